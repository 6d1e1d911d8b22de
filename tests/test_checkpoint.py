"""Checkpoints: N steps == N/2 + save + restore + N/2, bit for bit; clear errors.

JAX: ``optax_half.checkpoint`` (Orbax) for every optimizer, with the state
restored into a fresh ``tx.init(params)``. torch: ``state_dict()`` through
``torch.save`` / ``torch.load(weights_only=True)`` (test_torch_optim covers
every optimizer with ``weights_only=False``; here the safe default loader).
Sharded states: tests/test_sharding.py. A checkpoint of another optimizer,
compensation, dtype or params tree is refused with the first mismatching
leaf named, and nothing is loaded.
"""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import checkpoint
from conftest import bitwise_equal, jit_step
from suite_helpers import default_or_slow

N = 12
SHAPES = {"w": ((24, 16), jnp.bfloat16), "b": ((16,), jnp.bfloat16),
          "f": ((8, 4), jnp.float32), "s": ((), jnp.bfloat16)}
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 4, N)  # reads the restored count

JAX_CONFIGS = {
    "adamw_bf16/kahan": lambda: oh.adamw_bf16(SCHEDULE),
    "adamw_bf16/split": lambda: oh.adamw_bf16(SCHEDULE, compensation="split"),
    "adamw_bf16/stochastic": lambda: oh.adamw_bf16(SCHEDULE, compensation="stochastic", key=9),
    "adamw_bf16/none": lambda: oh.adamw_bf16(SCHEDULE, compensation="none"),
    "adamw_bf16/fp32-moments": lambda: oh.adamw_bf16(SCHEDULE, mu_dtype=jnp.float32,
                                                     nu_dtype=jnp.float32),
    "adam_fp32_master+skip": lambda: oh.adam_fp32_master(SCHEDULE, skip_nonfinite=True),
    "adamw_bf16/kahan/flat_state+skip": lambda: oh.adamw_bf16(SCHEDULE, skip_nonfinite=True,
                                                              flat_state=True),
    "adam_fp32_master/flat_state": lambda: oh.adam_fp32_master(SCHEDULE, flat_state=True),
    "scale_by_adamw": lambda: oh.scale_by_adamw(SCHEDULE, weight_decay=0.1),
    "master_weights(optax.adam)": lambda: oh.master_weights(optax.adam(SCHEDULE)),
    "master_weights(split)": lambda: oh.master_weights(optax.adamw(SCHEDULE), split=True),
    "kahan_summation(optax.adamw)": lambda: oh.kahan_summation(optax.adamw(SCHEDULE)),
    "stochastic_rounding(optax.adam)": lambda: oh.stochastic_rounding(optax.adam(SCHEDULE), 4),
    "round_to_nearest(optax.adam)": lambda: oh.round_to_nearest(optax.adam(SCHEDULE)),
    "scaled_adam": lambda: oh.scaled_adam(oh.eden(0.05, lr_batches=5, warmup_batches=3, steps_per_epoch=4),
                                          clipping_scale=2.0, clipping_update_period=3),
    "kahan_summation(scaled_adam)": lambda: oh.kahan_summation(
        oh.scaled_adam(clipping_scale=2.0, clipping_update_period=3)),
    "dynamic_loss_scale(adamw_bf16)": lambda: oh.dynamic_loss_scale(
        oh.adamw_bf16(SCHEDULE), init_scale=2.0 ** 6, growth_interval=3),
    "chain(clip, adamw_bf16)": lambda: optax.chain(optax.clip_by_global_norm(0.1),
                                                   oh.adamw_bf16(SCHEDULE)),
}


def _params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.standard_normal(s), d) for k, (s, d) in SHAPES.items()}


def _grads():
  rng = np.random.default_rng(1)
  out = [{k: jnp.asarray(rng.standard_normal(s) * 0.1, d) for k, (s, d) in SHAPES.items()}
         for _ in range(N)]
  out[3]["w"] = out[3]["w"].at[0, 0].set(jnp.inf)  # skipped where a config skips
  return out


def _run(step, params, state, grads):
  for g in grads:
    params, state = step(params, state, g)
  return params, state


def _skips(name):
  return "skip" in name or "loss_scale" in name


# make test resumes one of each kind (kernel, flat state, skips, loss
# scaling, chain, wrappers, ScaledAdam); every configuration in make test-slow.
_RESUME_DEFAULT = ["adamw_bf16/kahan", "adamw_bf16/kahan/flat_state+skip", "adam_fp32_master+skip",
                   "dynamic_loss_scale(adamw_bf16)", "kahan_summation(scaled_adam)",
                   "master_weights(optax.adam)", "stochastic_rounding(optax.adam)"]


@pytest.mark.parametrize("name", default_or_slow(list(JAX_CONFIGS), _RESUME_DEFAULT))
def test_jax_resume_is_bitwise(name, tmp_path):
  tx = JAX_CONFIGS[name]()
  grads = _grads()
  if not _skips(name):  # the others would be poisoned by the inf
    grads[3]["w"] = grads[2]["w"]
  params = _params()
  step = jit_step(tx)  # one compile for the uninterrupted run and the first half
  full_p, full_s = _run(step, params, tx.init(params), grads)

  half_p, half_s = _run(step, params, tx.init(params), grads[:N // 2])
  checkpoint.save(tmp_path / "opt", half_s)
  fresh = JAX_CONFIGS[name]()  # a new process would build the optimizer again
  restored = checkpoint.restore(tmp_path / "opt", fresh.init(half_p))
  assert jax.tree.structure(restored) == jax.tree.structure(half_s)
  assert all(bitwise_equal(a, b) for a, b in
             zip(jax.tree.leaves(restored), jax.tree.leaves(half_s)))
  end_p, end_s = _run(jit_step(fresh), half_p, restored, grads[N // 2:])
  for a, b in zip(jax.tree.leaves((full_p, full_s)), jax.tree.leaves((end_p, end_s))):
    assert bitwise_equal(a, b), name
  if _skips(name):  # the skipped step is counted once, before the checkpoint
    assert _skipped(end_s) == _skipped(full_s) == 1


def _skipped(state) -> int:
  kinds = (optax.ApplyIfFiniteState, oh.DynamicLossScaleState)
  for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(s, optax.ApplyIfFiniteState):
      return int(s.total_notfinite)
    if isinstance(s, oh.DynamicLossScaleState):
      return int(s.skipped_steps)
  raise AssertionError("no skip counter in the state")


def _kahan_checkpoint(tmp_path):
  params = _params()
  state = oh.adamw_bf16(1e-3).init(params)
  checkpoint.save(tmp_path / "kahan", state)
  return params, tmp_path / "kahan"


@pytest.mark.parametrize("like,message", [
    (lambda p: oh.adamw_bf16(1e-3, compensation="split").init(p),
     r"the checkpoint has no state.master\['b'\] \(int16\[16\]\)"),
    (lambda p: oh.adamw_bf16(1e-3, mu_dtype=jnp.float32).init(p),
     r"state.inner_state.mu\['b'\] was saved as bfloat16\[16\]; the state to restore into "
     r"has float32\[16\]"),
    (lambda p: oh.adamw_bf16(1e-3).init({**p, "w": jnp.zeros((24, 8), jnp.bfloat16)}),
     r"state.compensation\['w'\] was saved as bfloat16\[24, 16\]; .* bfloat16\[24, 8\]"),
    (lambda p: oh.adamw_bf16(1e-3).init({k: v for k, v in p.items() if k != "f"}),
     r"the checkpoint has inner_state.mu.f, which the state to restore into lacks"),
    (lambda p: oh.adam_fp32_master(1e-3).init(p),
     r"the checkpoint has no state.master\['b'\] \(float32\[16\]\)"),
    (lambda p: oh.scaled_adam().init(p), r"the checkpoint has no state.count"),
])
def test_jax_mismatch_names_the_first_leaf(tmp_path, like, message):
  params, path = _kahan_checkpoint(tmp_path)
  target = like(params)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(target)]
  with pytest.raises(ValueError, match=message):
    checkpoint.restore(path, target)
  # Nothing was loaded into (or changed in) the state given.
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(target)))


def test_orbax_alone_would_cast_silently(tmp_path):
  """Why ``check`` exists: Orbax restores a bf16 moment into an fp32 target."""
  import orbax.checkpoint as ocp
  params, path = _kahan_checkpoint(tmp_path)
  target = oh.adamw_bf16(1e-3, mu_dtype=jnp.float32).init(params)
  restored = ocp.StandardCheckpointer().restore(path.absolute(), target)
  assert restored.inner_state.mu["w"].dtype == jnp.float32


def test_check_takes_abstract_states(tmp_path):
  params, path = _kahan_checkpoint(tmp_path)
  like = jax.eval_shape(oh.adamw_bf16(1e-3).init, params)
  like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), like)
  restored = checkpoint.restore(path, like)
  assert restored.inner_state.mu["w"].dtype == jnp.bfloat16


# -- torch ---------------------------------------------------------------------

torch = pytest.importorskip("torch")
import torch_bridge as tb  # noqa: E402

TORCH_CONFIGS = {
    "adamw_bf16/kahan": lambda ps: tb.adamw_bf16(ps, 1e-2),
    "adamw_bf16/stochastic": lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="stochastic"),
    "adam_fp32_master+skip": lambda ps: tb.adam_fp32_master(ps, 1e-2, skip_nonfinite=True),
    "kahan_summation(Adam)": lambda ps: tb.kahan_summation(torch.optim.Adam(ps, lr=1e-2)),
    "kahan_summation(scaled_adam)": lambda ps: tb.kahan_summation(
        tb.scaled_adam(ps, clipping_scale=2.0, clipping_update_period=3)),
}


@pytest.mark.parametrize("name", list(TORCH_CONFIGS))
def test_torch_resume_through_weights_only_load(name):
  """``torch.load``'s default (``weights_only=True``) reads our state dicts and
  the loss scaler's; the resumed run equals the uninterrupted one bit for bit."""
  grads = [[torch.from_numpy(np.asarray(g[k], np.float32)).to(torch.bfloat16)
            for k in ("w", "b")] for g in _grads()]
  grads[3][0] = grads[2][0]

  def make():
    p = _params()
    params = [torch.from_numpy(np.asarray(p[k], np.float32)).to(torch.bfloat16)
              .requires_grad_() for k in ("w", "b")]
    return params, TORCH_CONFIGS[name](params), tb.dynamic_loss_scale(init_scale=8.0)

  def run(params, opt, scaler, grads):
    for g in grads:
      for p, x in zip(params, g):
        p.grad = x * scaler.get_scale()
      scaler.step(opt)
      scaler.update()

  params, opt, scaler = make()
  run(params, opt, scaler, grads)
  full = [p.detach().clone() for p in params]

  params, opt, scaler = make()
  run(params, opt, scaler, grads[:N // 2])
  buf = io.BytesIO()
  torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict(),
              "scaler": scaler.state_dict()}, buf)
  buf.seek(0)
  ckpt = torch.load(buf)  # weights_only=True, torch's default
  params, opt, scaler = make()
  with torch.no_grad():
    for p, saved in zip(params, ckpt["params"]):
      p.copy_(saved)
  opt.load_state_dict(ckpt["opt"])
  scaler.load_state_dict(ckpt["scaler"])
  run(params, opt, scaler, grads[N // 2:])
  assert all(torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
             for a, b in zip(full, params))
