"""optax_half and torch_bridge expose the same factories, keywords and defaults.

Every public function in ``optax_half.__all__`` (a transformation, optimizer
or schedule factory) must exist in ``torch_bridge`` with the same parameters
in the same order with the same defaults, once the param-like first argument
is set aside (``inner`` in JAX, ``optimizer``/``params`` in torch). Torch may
add keyword-only extensions listed in ``TORCH_ONLY``, JAX those in
``JAX_ONLY_KEYWORDS``. The factories in ``OPTAX_ORDER`` take optax.adamw's
order, defaults and parameters (``JAX_ONLY_OPTAX``) in JAX and torch.optim.AdamW's
in torch: their shared parameters are compared by name, and each default that
differs is listed in ``DEFAULT_DIFFERENCES``; the helpers
in ``JAX_ONLY`` are scaler or optimizer methods in torch; anything else is drift.
"""

import inspect

import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

import optax_half  # noqa: E402
import torch_bridge  # noqa: E402

# Keyword-only torch extensions, each with its reason.
TORCH_ONLY = {
    "fused": "picks the step's implementation (native kernel, eager, torch.compile); XLA compiles",
    "lr": "torch's spelling of learning_rate (drop-in for torch.optim)",
    "betas": "torch's spelling of (b1, b2) (drop-in for torch.optim, icefall's ScaledAdam)",
    "enabled": "torch.amp.GradScaler's switch: a disabled scaler is a no-op",
    "maximize": "torch.optim.AdamW's (drop-in): ascend; optax maximizes by negating the "
                "gradients first (optax.scale(-1))",
    "amsgrad": "torch.optim.AdamW's (drop-in): the running max of nu, stepped per tensor; "
               "optax.adamw has no amsgrad (optax.amsgrad is another optimizer)",
    "foreach": "torch.optim's: AdamW accepts it and fused= picks the step; master_weights "
               "batches its host work (None: on CUDA); XLA compiles",
    "capturable": "torch.optim.AdamW's (drop-in): only False (the step count is read on the "
                  "host); XLA compiles the whole step",
    "differentiable": "torch.optim.AdamW's (drop-in): autograd records the step (params of "
                      "32 bits or more); JAX differentiates through an update as it is",
}
# Parameters JAX requires that torch may leave out, each with its reason.
TORCH_OPTIONAL = {
    "learning_rate": "torch takes it as lr= instead; leaving out both is an error",
}
# Keyword-only JAX extensions, each with its reason.
JAX_ONLY_KEYWORDS = {
    "flat_state": "a state layout for JAX's cost per array of a jitted step; torch keeps "
                  "per-param state and its kernel steps a group's tensors in one call",
}
# JAX parameters from optax.adamw's signature (the factories in OPTAX_ORDER), each
# with its reason for not being in torch.
JAX_ONLY_OPTAX = {
    "eps_root": "optax.adamw's (inside the square root, for differentiating through the "
                "step); torch.optim.AdamW has none",
    "mask": "optax.adamw's weight-decay mask; torch: a param group with weight_decay=0",
    "nesterov": "optax.adamw's Nesterov momentum; torch.optim.NAdam is another optimizer",
}
# JAX factories in optax.adamw's parameter order (torch: torch.optim.AdamW's), whose
# shared parameters are compared by name; ours come after optax's, keyword-only.
OPTAX_ORDER = {"adamw_bf16", "adam_fp32_master"}
# Defaults that differ, each with its reason.
DEFAULT_DIFFERENCES = {
    ("adamw_bf16", "weight_decay"): "optax.adamw's 1e-4 in JAX, torch.optim.AdamW's 1e-2 in "
                                    "torch",
}
# JAX helpers whose torch counterparts are methods of the scaler or the optimizer.
JAX_ONLY = {
    "scale_loss": "torch: scaler.scale(loss)",
    "loss_scale": "torch: scaler.get_scale() / scaler.counters()",
    "value_and_scaled_grad": "torch: scaler.scale(loss).backward()",
    "find_loss_scale_state": "torch: the scaler object is the state (scaler.state_dict())",
    "update_and_apply": "torch: optimizer.step() writes the params in place",
    "relayout_state": "the flat_state layout is JAX's; torch keeps one state tensor per param",
    "chain": "torch: transform the grads (e.g. clip_grad_norm_) before optimizer.step()",
    "clip_by_global_norm": "optax's clipping compiled without an fp32 copy of 16-bit grads "
                           "(XLA:CPU); torch: torch.nn.utils.clip_grad_norm_ on the grads",
    "get_policy": "mixed-precision policies (jmp's API); torch: torch.autocast, module.to(dtype)",
    "cast_to_full": "a policy helper; torch: module.float()",
    "cast_to_half": "a policy helper; torch: module.half()",
    "half_dtype": "a policy helper; torch: the dtype of torch.autocast",
    "all_finite": "jmp's loss-scale helper; torch: the scaler's found_inf check",
    "select_tree": "jmp's loss-scale helper; torch: the scaler skips optimizer.step()",
}
# torch helpers with no JAX counterpart, each with its reason.
TORCH_ONLY_FUNCTIONS = {
    "accumulate_in_fp32": "fp32 main_grad accumulation behind backward's 16-bit p.grad; JAX "
                          "accumulates in any dtype it is given (optax.MultiSteps' accumulator_dtype)",
}
# Readers of an optimizer's statistics: JAX finds them in a state pytree and
# names leaves by the params tree; torch reads them from the optimizer object.
READERS = {
    "scaled_adam_stats": "JAX: (opt_state); torch: (optimizer, group=0)",
}
JAX_FIRST = {"inner"}
TORCH_FIRST = {"params", "optimizer"}


def _factories(module):
  return {name: getattr(module, name) for name in module.__all__
          if inspect.isfunction(getattr(module, name))
          and name not in JAX_ONLY and name not in READERS and name not in TORCH_ONLY_FUNCTIONS}


def _normalize(default):
  """dtype defaults compare by name (jnp.float32 <-> torch.float32)."""
  if isinstance(default, torch.dtype):
    return ("dtype", str(default).removeprefix("torch."))
  try:
    if default is not None and isinstance(default, type) or isinstance(default, np.dtype):
      return ("dtype", np.dtype(default).name)
  except TypeError:
    pass
  return default


def _params(fn, first_names):
  params = list(inspect.signature(fn).parameters.values())
  if params and params[0].name in first_names:
    params = params[1:]
  return params


def test_every_jax_factory_has_a_torch_twin():
  jax_f, torch_f = _factories(optax_half), _factories(torch_bridge)
  missing = sorted(set(jax_f) - set(torch_f))
  extra = sorted(set(torch_f) - set(jax_f))
  assert not missing, f"in optax_half but not torch_bridge: {missing}"
  assert not extra, f"in torch_bridge but not optax_half: {extra}"
  assert len(jax_f) >= 8


@pytest.mark.parametrize("name", sorted(_factories(optax_half)))
def test_same_keywords_and_defaults(name):
  jp = _params(getattr(optax_half, name), JAX_FIRST)
  tp = _params(getattr(torch_bridge, name), TORCH_FIRST)
  tp_shared = [p for p in tp if p.name not in TORCH_ONLY]
  for p in tp:
    if p.name in TORCH_ONLY:
      assert p.kind == inspect.Parameter.KEYWORD_ONLY, f"{name}: {p.name} must be keyword-only"
  for p in jp:
    if p.name in JAX_ONLY_KEYWORDS:
      assert p.kind == inspect.Parameter.KEYWORD_ONLY, f"{name}: {p.name} must be keyword-only"
      assert p.name not in {q.name for q in tp}, f"{name}: {p.name} is in torch too"
  jp = [p for p in jp if p.name not in JAX_ONLY_KEYWORDS]
  if name in OPTAX_ORDER:
    # optax.adamw's parameters first, in its order and with its defaults (weight_decay
    # aside where DEFAULT_DIFFERENCES says so), then ours, keyword-only.
    optax_params = list(inspect.signature(optax.adamw).parameters.values())
    ours = [p for p in jp if p.name in {q.name for q in optax_params}]
    assert [p.name for p in jp[:len(ours)]] == [p.name for p in ours], name
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in jp[len(ours):]), name
    by_name = {q.name: q for q in optax_params}
    for p in ours:
      if p.name != "weight_decay" or (name, p.name) in DEFAULT_DIFFERENCES:
        assert p.default == by_name[p.name].default, (name, p.name)
    jp = [p for p in jp if p.name not in JAX_ONLY_OPTAX]
    order = {p.name: k for k, p in enumerate(tp_shared)}
    assert sorted(p.name for p in jp) == sorted(order), name
    jp = sorted(jp, key=lambda p: order[p.name])
  else:  # elsewhere (scale_by_adamw) optax.adamw's options are JAX-only keywords
    for p in jp:
      if p.name in JAX_ONLY_OPTAX:
        assert p.kind == inspect.Parameter.KEYWORD_ONLY, f"{name}: {p.name} must be keyword-only"
    jp = [p for p in jp if p.name not in JAX_ONLY_OPTAX]
  assert [p.name for p in jp] == [p.name for p in tp_shared], name
  for a, b in zip(jp, tp_shared):
    if a.name in TORCH_OPTIONAL and a.default is inspect.Parameter.empty and b.default is None:
      assert "lr" in {q.name for q in tp}, f"{name}: {a.name} optional without lr="
      continue
    if (name, a.name) in DEFAULT_DIFFERENCES:
      assert _normalize(a.default) != _normalize(b.default), (name, a.name, "documented")
      continue
    assert _normalize(a.default) == _normalize(b.default), (
        f"{name}({a.name}=...): optax_half default {a.default!r}, torch_bridge {b.default!r}")


def test_readers_exist_in_both():
  for name in READERS:
    assert inspect.isfunction(getattr(optax_half, name))
    assert inspect.isfunction(getattr(torch_bridge, name))


def test_jax_only_helpers_exist_and_have_torch_methods():
  for name in JAX_ONLY:
    assert inspect.isfunction(getattr(optax_half, name))
  for method in ("scale", "get_scale", "counters", "unscale_", "step", "update"):
    assert callable(getattr(torch_bridge.DynamicLossScaler, method))


def test_normalize_catches_dtype_drift():
  """The comparison itself can fail: float32 vs bfloat16 defaults differ."""
  assert _normalize(jnp.float32) == _normalize(torch.float32)
  assert _normalize(jnp.float32) != _normalize(torch.bfloat16)
  assert _normalize(1e-2) != _normalize(0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["kahan", "split", "stochastic", "none", "master"])
def test_the_compensation_table_is_what_both_frameworks_keep(name, dtype):
  """optax_half_native.COMPENSATIONS: the buffer's field (JAX) and key
  (torch) and its dtype, the fp16 rule, and the compensation= choices."""
  import optax_half_native as native_lib  # noqa: PLC0415
  from optax_half.compensation import COMPENSATIONS as jax_rules  # noqa: PLC0415
  from torch_bridge.compensation import COMPENSATIONS as torch_rules  # noqa: PLC0415
  # One registry per framework, keyed by the table, each entry holding its row.
  for rules, framework_dtype in ((jax_rules, jnp.dtype(dtype)),
                                 (torch_rules, getattr(torch, dtype))):
    assert list(rules) == list(native_lib.COMPENSATIONS)
    assert all(rules[k].spec is native_lib.COMPENSATIONS[k] for k in rules)
    assert rules[name].for_dtype(framework_dtype).spec is native_lib.compensation_of(
        name, dtype == "bfloat16")
  for choice in native_lib.OPTIMIZER_COMPENSATIONS:
    optax_half.adamw_bf16(1e-3, compensation=choice)
  with pytest.raises(ValueError, match="compensation must be one of"):
    optax_half.adamw_bf16(1e-3, compensation="master")
  with pytest.raises(ValueError, match="compensation must be one of"):
    torch_bridge.adamw_bf16([torch.zeros(1)], lr=1e-3, compensation="master")
  want = native_lib.compensation_of(name, dtype == "bfloat16")
  want_dtype = {"param": dtype, "int16": "int16", "float32": "float32", None: None}[
      want.buffer_dtype]
  if name == "master":
    tx = optax_half.adam_fp32_master(1e-3)
    opt_of = lambda ps: torch_bridge.adam_fp32_master(ps, lr=1e-3)  # noqa: E731
  else:
    tx = optax_half.adamw_bf16(1e-3, compensation=name)
    opt_of = lambda ps: torch_bridge.adamw_bf16(ps, lr=1e-3, compensation=name)  # noqa: E731
  state = tx.init({"w": jnp.ones(3, dtype)})
  for field in ("compensation", "master"):
    value = getattr(state, field, None)
    if field == want.buffer:
      assert str(value["w"].dtype) == want_dtype, (field, value)
    else:
      assert value is None, field
  p = torch.nn.Parameter(torch.ones(3, dtype=getattr(torch, dtype)))
  opt = opt_of([p])
  p.grad = torch.ones_like(p)
  opt.step()
  assert set(opt.state[p]) & {"compensation", "master"} == ({want.buffer} if want.buffer
                                                             else set())
  if want.buffer:
    assert str(opt.state[p][want.buffer].dtype) == f"torch.{want_dtype}"
