"""Bad calls get a clear error that names the argument (or the leaf) and the fix.

One table per framework; every row asserts the exception type and the
message. Loading a mismatched state dict is an error that names the first
mismatch and leaves the optimizer untouched (nothing half-loaded).
"""

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh

torch = pytest.importorskip("torch")
import torch_bridge as tb  # noqa: E402

BF16 = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}


def _update(tx, grads, params=BF16):
  return tx.update(grads, tx.init(params), params)


JAX_CASES = [
    ("compensation", lambda: oh.adamw_bf16(1e-3, compensation="foo"),
     ValueError, re.escape("compensation must be one of ('kahan', 'split', 'stochastic', "
                           "'none'); got 'foo'.")),
    ("state_rounding", lambda: oh.adamw_bf16(1e-3, state_rounding="up"),
     ValueError, "state_rounding must be one of"),
    ("negative lr", lambda: oh.adamw_bf16(-1e-3), ValueError, "learning_rate must be >= 0"),
    ("b1 = 1", lambda: oh.adamw_bf16(1e-3, b1=1.0), ValueError, r"b1 must be in \[0, 1\); got 1.0"),
    ("b2 < 0", lambda: oh.adam_fp32_master(1e-3, b2=-0.1), ValueError, r"b2 must be in \[0, 1\)"),
    ("eps = 0", lambda: oh.adamw_bf16(1e-3, eps=0.0), ValueError, "eps must be > 0; got 0.0"),
    ("negative weight decay", lambda: oh.adamw_bf16(1e-3, weight_decay=-1.0),
     ValueError, "weight_decay must be >= 0"),
    ("key of a wrong type", lambda: oh.adamw_bf16(1e-3, key="seed"),
     TypeError, "key must be None, a Python int or a JAX PRNG key"),
    ("grads tree != params tree", lambda: _update(oh.adamw_bf16(1e-3), {"w": BF16["w"]}),
     ValueError, "kahan_summation: the gradient tree does not match the params tree"),
    ("grad shape != param shape",
     lambda: _update(oh.adamw_bf16(1e-3), {"w": BF16["w"].T, "b": BF16["b"]}),
     ValueError, r"the gradient of params\['w'\] has shape \(3, 2\); the param has shape \(2, 3\)"),
    ("grad shape, scale_by_adamw",
     lambda: _update(oh.scale_by_adamw(1e-3), {"w": BF16["w"], "b": jnp.zeros(4, jnp.bfloat16)}),
     ValueError, r"scale_by_adamw: the gradient of params\['b'\] has shape \(4,\)"),
    ("grad shape, scaled_adam",
     lambda: _update(oh.scaled_adam(0.03), {"w": BF16["w"], "b": jnp.zeros(4, jnp.bfloat16)}),
     ValueError, r"scaled_adam: the gradient of params\['b'\] has shape \(4,\)"),
    ("update without params", lambda: oh.master_weights(optax.adam(1e-3)).update(
        BF16, oh.master_weights(optax.adam(1e-3)).init(BF16)),
     ValueError, r"master_weights needs the current params: call tx.update\(grads, state, params\)"),
    ("scaled_adam clipping_scale", lambda: oh.scaled_adam(0.03, clipping_scale=-1.0),
     ValueError, "clipping_scale must be None"),
    ("loss scale init_scale", lambda: oh.dynamic_loss_scale(optax.adam(1e-3), init_scale=0.0),
     ValueError, "init_scale must be > 0"),
    ("loss scale backoff", lambda: oh.dynamic_loss_scale(optax.adam(1e-3), backoff_factor=1.5),
     ValueError, r"backoff_factor must be in \(0, 1\)"),
    ("no scaler in the state", lambda: oh.loss_scale(optax.adam(1e-3).init(BF16)),
     ValueError, "build the optimizer as optax_half.dynamic_loss_scale"),
    ("no ScaledAdam in the state", lambda: oh.scaled_adam_stats(optax.adam(1e-3).init(BF16)),
     ValueError, "no ScaledAdamState"),
    ("kahan_summation of master_weights",
     lambda: oh.kahan_summation(oh.master_weights(optax.adam(1e-3))).init(BF16),
     ValueError, r"kahan_summation: the inner transformation already keeps low-precision "
                 r"params \(its state holds a MasterWeightsState"),
    ("master_weights of adamw_bf16", lambda: oh.master_weights(oh.adamw_bf16(1e-3)).init(BF16),
     ValueError, r"master_weights: the inner transformation already keeps low-precision "
                 r"params \(its state holds a KahanSummationState"),
    ("stochastic_rounding of adam_fp32_master",
     lambda: oh.stochastic_rounding(oh.adam_fp32_master(1e-3), key=0).init(BF16),
     ValueError, r"stochastic_rounding: the inner transformation already keeps "
                 r"low-precision params \(its state holds a MasterWeightsState"),
    ("stochastic rounding without a key",
     lambda: oh.stochastic_rounding(optax.adam(1e-3), key=None),
     ValueError, r"stochastic_rounding needs a key: pass key=<int seed>"),
    ("float64 params", lambda: _with_x64(lambda: oh.adamw_bf16(1e-3).init(
        {"w": jnp.ones(3, jnp.float64)})),
     ValueError, r"scale_by_adamw \(the fp32 AdamW core of adamw_bf16 and adam_fp32_master\): "
                 r"params\['w'\] is float64, but the math here is fp32"),
    ("float64 params, scaled_adam", lambda: _with_x64(lambda: oh.scaled_adam().init(
        {"w": np.ones(3, np.float64)})),
     ValueError, r"scaled_adam: params\['w'\] is float64"),
    ("kahan_summation of adamw_bf16(compensation='none', skip_nonfinite=True)",
     lambda: oh.kahan_summation(
         oh.adamw_bf16(1e-3, compensation="none", skip_nonfinite=True)).init(BF16),
     ValueError, r"kahan_summation: the inner transformation already keeps low-precision "
                 r"params \(its state holds a RoundToNearestState"),
    ("skip_nonfinite not a bool", lambda: oh.adamw_bf16(1e-3, skip_nonfinite="yes"),
     TypeError, "skip_nonfinite must be True or False; got 'yes'"),
]


def _with_x64(fn):
  import jax  # noqa: PLC0415
  with jax.enable_x64(True):
    return fn()


@pytest.mark.parametrize("name,call,error,message", JAX_CASES, ids=[c[0] for c in JAX_CASES])
def test_jax_bad_calls(name, call, error, message):
  with pytest.raises(error, match=message):
    call()


def _model():
  return torch.nn.Linear(3, 2).to(torch.bfloat16)


TORCH_CASES = [
    ("integer param", lambda: tb.adamw_bf16(
        [torch.nn.Parameter(torch.ones(3, dtype=torch.int32), requires_grad=False)], 1e-3),
     ValueError, "param 0 has dtype torch.int32: only floating-point params can be optimized"),
    ("compensation", lambda: tb.adamw_bf16(_model().parameters(), 1e-3, compensation="foo"),
     ValueError, re.escape("compensation must be one of ('kahan', 'split', 'stochastic', "
                           "'none'); got 'foo'.")),
    ("negative lr", lambda: tb.adamw_bf16(_model().parameters(), -1e-3),
     ValueError, "learning_rate must be >= 0"),
    ("b2 = 1", lambda: tb.adam_fp32_master(_model().parameters(), 1e-3, b2=1.0),
     ValueError, r"b2 must be in \[0, 1\); got 1.0"),
    ("eps = 0", lambda: tb.adamw_bf16(_model().parameters(), 1e-3, eps=0.0),
     ValueError, "eps must be > 0; got 0.0"),
    ("empty params", lambda: tb.adamw_bf16([], 1e-3), ValueError, "empty parameter list"),
    ("wrapping a non-optimizer", lambda: tb.kahan_summation(_model().parameters()),
     TypeError, "the wrappers take a constructed torch.optim.Optimizer"),
    ("wrapping a wrapper", lambda: tb.master_weights(
        tb.kahan_summation(torch.optim.Adam(_model().parameters()))),
     ValueError, r"master_weights: the inner optimizer already keeps low-precision params "
                 r"\(it is a kahan_summation wrapper"),
    ("master_weights of adam_fp32_master",
     lambda: tb.master_weights(tb.adam_fp32_master(_model().parameters(), 1e-3)),
     ValueError, r"master_weights: the inner optimizer already keeps low-precision params "
                 r"\(it is adam_fp32_master"),
    ("kahan_summation of adamw_bf16",
     lambda: tb.kahan_summation(tb.adamw_bf16(_model().parameters(), 1e-3)),
     ValueError, r"\(it is adamw_bf16\(compensation='kahan'\)"),
    ("kahan_summation of adamw_bf16(compensation='none', skip_nonfinite=True)",
     lambda: tb.kahan_summation(tb.adamw_bf16(_model().parameters(), 1e-3,
                                              compensation="none", skip_nonfinite=True)),
     ValueError, r"kahan_summation: the inner optimizer already keeps low-precision params "
                 r"\(it is adamw_bf16\(compensation='none'\)"),
    ("sparse gradient with skip_nonfinite", lambda: _sparse_step(skip_nonfinite=True),
     RuntimeError, "param 0 has a sparse gradient; torch_bridge optimizers need dense"),
    ("sparse gradient", lambda: _sparse_step(skip_nonfinite=False),
     RuntimeError, "param 0 has a sparse gradient; torch_bridge optimizers need dense"),
    ("stochastic rounding without a key",
     lambda: tb.stochastic_rounding(torch.optim.Adam(_model().parameters()), key=None),
     ValueError, r"stochastic_rounding needs a key: pass key=<int seed>"),
    ("complex32 params",
     lambda: tb.adamw_bf16([torch.zeros(2, dtype=torch.complex32, requires_grad=True)], 1e-3),
     ValueError, "param 0 is complex32, whose fp16 parts no compensation here steps. Cast it "
                 "to complex64"),
    ("float64 params, scaled_adam", lambda: tb.scaled_adam(_model().double().parameters()),
     ValueError, "scaled_adam: param 0 is float64"),
    ("skip_nonfinite not a bool",
     lambda: tb.adamw_bf16(_model().parameters(), 1e-3, skip_nonfinite="yes"),
     TypeError, "skip_nonfinite must be True or False; got 'yes'"),
    ("loss scale init_scale", lambda: tb.dynamic_loss_scale(init_scale=0.0),
     ValueError, "init_scale must be > 0"),
    ("scaled_adam clipping_scale", lambda: tb.scaled_adam(_model().parameters(), 0.03,
                                                          clipping_scale=-1.0),
     ValueError, "clipping_scale must be None"),
]


def _sparse_step(skip_nonfinite):
  p = torch.nn.Parameter(torch.ones(3, 2))
  opt = tb.adamw_bf16([p], 1e-3, skip_nonfinite=skip_nonfinite)
  p.grad = torch.ones(3, 2).to_sparse()
  opt.step()


@pytest.mark.parametrize("name,call,error,message", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_torch_bad_calls(name, call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_jax_and_torch_say_the_same():
  """Rows checked in both frameworks give the same message, word for word (torch's
  AdamW first says it in torch.optim.AdamW's words)."""
  pairs = [
      (lambda: oh.adamw_bf16(1e-3, compensation="foo"),
       lambda: tb.adamw_bf16(_model().parameters(), 1e-3, compensation="foo")),
      (lambda: oh.adamw_bf16(1e-3, b1=1.0),
       lambda: tb.adamw_bf16(_model().parameters(), 1e-3, b1=1.0)),
      (lambda: oh.adamw_bf16(1e-3, eps=0.0),
       lambda: tb.adamw_bf16(_model().parameters(), 1e-3, eps=0.0)),
      (lambda: oh.dynamic_loss_scale(optax.adam(1e-3), init_scale=0.0),
       lambda: tb.dynamic_loss_scale(init_scale=0.0)),
      (lambda: oh.stochastic_rounding(optax.adam(1e-3), key=None),
       lambda: tb.stochastic_rounding(torch.optim.Adam(_model().parameters()), key=None)),
  ]
  for jax_call, torch_call in pairs:
    with pytest.raises(ValueError) as a:
      jax_call()
    with pytest.raises(ValueError) as b:
      torch_call()
    assert str(b.value) in (str(a.value), f"Invalid beta parameter at index 0: 1.0: {a.value}")


# -- loading a state dict that does not fit --------------------------------------


def _stepped(make, steps=2, model=None):
  model = model or _model()
  opt = make(model)
  for _ in range(steps):
    opt.zero_grad()
    model(torch.ones(4, 3, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
  return opt


MAKERS = {
    "adamw_bf16 kahan": lambda m: tb.adamw_bf16(m.parameters(), 1e-3),
    "adamw_bf16 stochastic": lambda m: tb.adamw_bf16(m.parameters(), 1e-3,
                                                     compensation="stochastic"),
    "adam_fp32_master": lambda m: tb.adam_fp32_master(m.parameters(), 1e-3),
    "scaled_adam": lambda m: tb.scaled_adam(m.parameters(), 0.03),
    "kahan_summation(Adam)": lambda m: tb.kahan_summation(torch.optim.Adam(m.parameters())),
    "master_weights(Adam)": lambda m: tb.master_weights(torch.optim.Adam(m.parameters())),
    "torch.optim.Adam": lambda m: torch.optim.Adam(m.parameters()),
}
OURS = [k for k in MAKERS if k != "torch.optim.Adam"]
MISMATCH = (r"this state_dict was saved by \S+; this optimizer is \S+\. Load it into the same "
            r"kind of optimizer\.|state of param 0: saved \[.*\], the optimizer holds \[.*\]\."
            r"|state_dict is not from a ScaledAdam")


def _snapshot(opt):
  """Every tensor of the optimizer's state_dict, cloned, plus its non-tensor values."""
  def clone(x):
    if torch.is_tensor(x):
      return x.clone()
    if isinstance(x, dict):
      return {k: clone(v) for k, v in x.items()}
    if isinstance(x, list):
      return [clone(v) for v in x]
    return x
  return clone(opt.state_dict())


def _equal(a, b):
  if torch.is_tensor(a):
    return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
  if isinstance(a, list):
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
  return a == b


@pytest.mark.parametrize("target", OURS)
@pytest.mark.parametrize("source", list(MAKERS))
def test_load_from_another_optimizer(source, target):
  saved = _stepped(MAKERS[source]).state_dict()
  opt = _stepped(MAKERS[target], steps=1)
  before = _snapshot(opt)
  if source == target:
    opt.load_state_dict(saved)  # the same kind loads
    assert _equal(_snapshot(opt), saved)
    return
  # Another class or wrapped optimizer: named by "kind". The same class with other
  # buffers (e.g. a Kahan buffer vs an fp32 master): named by the first param's keys.
  with pytest.raises(ValueError, match=MISMATCH):
    opt.load_state_dict(saved)
  assert _equal(_snapshot(opt), before)


@pytest.mark.parametrize("name", OURS)
def test_mismatch_in_a_later_param_loads_nothing(name):
  """The second param's state has the wrong shape: the first param's is not loaded either."""
  saved = _stepped(MAKERS[name], steps=3).state_dict()
  last = max(saved["state"])  # wrappers: their own buffers; the rest: moments etc.
  key, value = next((k, v) for k, v in saved["state"][last].items()
                    if torch.is_tensor(v) and v.ndim > 0)
  saved["state"][last][key] = torch.zeros(value.numel() + 1, dtype=value.dtype)
  opt = _stepped(MAKERS[name], steps=1)
  before = _snapshot(opt)
  with pytest.raises(ValueError, match=re.escape(f"state {key!r} of param {last}: saved ")):
    opt.load_state_dict(saved)
  assert _equal(_snapshot(opt), before)


def test_wrapper_inner_mismatch_leaves_the_wrapper_untouched():
  """The wrapper's own buffers fit but the wrapped optimizer's state does not (groups of
  its own, as a wrapper's state_dict held them before it saved them once)."""
  saved = _stepped(MAKERS["kahan_summation(Adam)"], steps=3).state_dict()
  assert "param_groups" not in saved["inner"]
  saved["inner"]["param_groups"] = [dict(g) for g in saved["param_groups"]] * 2
  opt = _stepped(MAKERS["kahan_summation(Adam)"], steps=1)
  before = _snapshot(opt)
  with pytest.raises(ValueError, match="parameter groups"):  # torch.optim.Adam's own check
    opt.load_state_dict(saved)
  assert _equal(_snapshot(opt), before)


def test_wrapper_around_ours_inner_mismatch_loads_nothing():
  def make(m):
    return tb.kahan_summation(tb.scaled_adam(m.parameters(), 0.03))
  saved = _stepped(make, steps=3).state_dict()
  last = max(saved["inner"]["state"])
  saved["inner"]["state"][last]["delta"] = torch.zeros(7)
  opt = _stepped(make, steps=1)
  before = _snapshot(opt)
  with pytest.raises(ValueError, match=f"state 'delta' of param {last}: saved torch.float32"):
    opt.load_state_dict(saved)
  assert _equal(_snapshot(opt), before)


def test_key_mismatch_is_named():
  saved = _stepped(MAKERS["adamw_bf16 kahan"]).state_dict()
  opt = _stepped(MAKERS["adamw_bf16 stochastic"], steps=1)
  with pytest.raises(ValueError, match=re.escape(
      "state of param 0: saved ['compensation', 'mu', 'nu', 'step'], the optimizer holds "
      "['mu', 'nu', 'step'].")):
    opt.load_state_dict(saved)


def test_state_dict_without_kind_is_checked_by_structure():
  """Older checkpoints, or tools that keep only state and param_groups, still load."""
  saved = _stepped(MAKERS["adamw_bf16 kahan"], steps=3).state_dict()
  saved.pop("kind")
  opt = _stepped(MAKERS["adamw_bf16 kahan"], steps=1)
  opt.load_state_dict(saved)
  assert _equal({k: v for k, v in _snapshot(opt).items() if k != "kind"}, saved)
  torch_adam = _stepped(MAKERS["torch.optim.Adam"]).state_dict()
  with pytest.raises(ValueError, match=re.escape("state of param 0: saved ['exp_avg', ")):
    opt.load_state_dict(torch_adam)


def test_rounding_can_change_on_resume():
  """Nearest- and stochastically-rounded moments have the same buffers."""
  saved = _stepped(lambda m: tb.adamw_bf16(m.parameters(), 1e-3, state_rounding="nearest"),
                   steps=3).state_dict()
  opt = _stepped(MAKERS["adamw_bf16 kahan"], steps=1)
  opt.load_state_dict(saved)
  assert _equal(_snapshot(opt), saved)


def test_fresh_scaled_adam_checks_against_its_first_state():
  """ScaledAdam makes its state on the first step: a fresh one checks the layout it would make."""
  saved = _stepped(MAKERS["scaled_adam"], steps=3).state_dict()
  good = _stepped(MAKERS["scaled_adam"], steps=0)
  good.load_state_dict(saved)
  assert _equal(_snapshot(good), saved)
  saved["state"][0]["delta"] = torch.zeros(5, dtype=torch.bfloat16)
  fresh = _stepped(MAKERS["scaled_adam"], steps=0)
  with pytest.raises(ValueError, match=re.escape("state 'delta' of param 0: saved torch.bfloat16(5,)")):
    fresh.load_state_dict(saved)
  assert len(fresh.state) == 0  # a failed load leaves no empty entries behind


def test_params_without_saved_state_lose_theirs():
  """A state dict saved before any step, loaded after steps: as if nothing had stepped."""
  saved = _stepped(MAKERS["scaled_adam"], steps=0).state_dict()
  opt = _stepped(MAKERS["scaled_adam"], steps=2)
  assert len(opt.state) == 2
  opt.load_state_dict(saved)
  assert len(opt.state) == 0 and _equal(_snapshot(opt), saved)


def test_fresh_wrapped_scaled_adam_resumes():
  """A wrapper's stand-ins are empty between steps: the fresh inner ScaledAdam still loads."""
  def make(m):
    return tb.kahan_summation(tb.scaled_adam(m.parameters(), 0.03))
  saved = _stepped(make, steps=3).state_dict()
  fresh = _stepped(make, steps=0)
  fresh.load_state_dict(saved)
  assert _equal(_snapshot(fresh), saved)


# -- what is accepted, and a refused param group ------------------------------------


def test_numpy_float64_with_x64_off_is_fp32_everywhere():
  """JAX's default (x64 off) makes a numpy float64 leaf an fp32 array in every
  op: the named optimizers and the wrappers alike take it as fp32."""
  import jax  # noqa: PLC0415
  assert not jax.config.jax_enable_x64
  params = {"w": np.linspace(-1.0, 1.0, 6).reshape(2, 3)}  # float64
  grads = {"w": np.full((2, 3), 0.5)}
  for tx in (oh.scaled_adam(0.03), oh.scale_by_adamw(1e-3), oh.adamw_bf16(1e-3),
             oh.master_weights(optax.adam(1e-3))):
    updates, _ = tx.update(grads, tx.init(params), params)
    assert jnp.asarray(updates["w"]).dtype == jnp.float32
  # The same numbers as fp32 params: the float64 values were only cast.
  tx = oh.scaled_adam(0.03)
  f32 = {"w": params["w"].astype(np.float32)}
  a, _ = tx.update(grads, tx.init(params), params)
  b, _ = tx.update({"w": grads["w"].astype(np.float32)}, tx.init(f32), f32)
  np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))


@pytest.mark.parametrize("make", [
    lambda ps: tb.adamw_bf16(ps, 1e-3), lambda ps: tb.scaled_adam(ps, 0.03)],
    ids=["adamw_bf16", "scaled_adam"])
def test_a_refused_param_group_is_not_registered(make):
  p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
  opt = make([p])
  before = (len(opt.param_groups), len(opt.state), len(getattr(opt, "group_state", [])))
  with pytest.raises(ValueError, match="param 1 has dtype torch.int64"):
    opt.add_param_group({"params": [torch.ones(3, dtype=torch.int64)]})
  with pytest.raises(ValueError, match="must be"):
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "eps": -1.0})
  assert (len(opt.param_groups), len(opt.state),
          len(getattr(opt, "group_state", []))) == before
  # The optimizer still works, and a good group is still welcome (at position 1).
  q = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
  opt.add_param_group({"params": [q]})
  p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
  opt.step()
  assert len(opt.param_groups) == 2 and int(opt.state[q]["step"]) == 1
