"""NaN/Inf gradients: what every optimizer does with them, in both frameworks.

* ``skip_nonfinite=True`` (adamw_bf16, adam_fp32_master, scaled_adam): a step
  whose gradients hold a NaN or Inf changes nothing, step counts included, and
  is counted; the run then equals one that never saw that step, bit for bit.
* Without it (the default) the poison spreads as docs/algorithms.md, section
  "Non-finite gradients", says: the elementwise AdamW family loses exactly the
  element whose gradient was bad; ScaledAdam loses that element at once, its
  whole tensor at the next size update, and every param once clipping starts.
* With a loss scaler the step is skipped and counted whatever the optimizer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh

torch = pytest.importorskip("torch")
import torch_bridge as tb  # noqa: E402

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
NAMES = list(SHAPES)  # torch param order = JAX flatten order of the dict (sorted keys)
NAMES.sort()


def _values(seed):
  rng = np.random.default_rng(seed)
  return {k: np.asarray(rng.standard_normal(s) * 0.5, np.float32) for k, s in SHAPES.items()}


def _grads(step, bad=None):
  g = _values(100 + step)
  if bad is not None:
    g["w"] = g["w"].copy()
    g["w"][0, 0] = bad
  return g


# name -> (JAX factory, torch factory taking a param list); lr etc. shared.
OPTIMIZERS = {
    "adamw_bf16 kahan": (lambda **kw: oh.adamw_bf16(1e-3, **kw),
                         lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, **kw)),
    "adamw_bf16 split": (lambda **kw: oh.adamw_bf16(1e-3, compensation="split", **kw),
                         lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, compensation="split", **kw)),
    "adamw_bf16 stochastic": (
        lambda **kw: oh.adamw_bf16(1e-3, compensation="stochastic", key=3, **kw),
        lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, compensation="stochastic", key=3, **kw)),
    "adamw_bf16 none": (lambda **kw: oh.adamw_bf16(1e-3, compensation="none", **kw),
                        lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, compensation="none", **kw)),
    "adam_fp32_master": (lambda **kw: oh.adam_fp32_master(1e-3, weight_decay=0.1, **kw),
                         lambda ps, **kw: tb.adam_fp32_master(ps, 1e-3, weight_decay=0.1, **kw)),
    "scaled_adam": (lambda **kw: oh.scaled_adam(0.03, **kw),
                    lambda ps, **kw: tb.scaled_adam(ps, 0.03, **kw)),
    "scaled_adam clipping": (
        lambda **kw: oh.scaled_adam(0.03, clipping_scale=2.0, clipping_update_period=4, **kw),
        lambda ps, **kw: tb.scaled_adam(ps, 0.03, clipping_scale=2.0,
                                        clipping_update_period=4, **kw)),
}


def _bits(x):
  x = np.atleast_1d(np.asarray(x))
  return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint8)


def _jax_run(name, grads, history=None, **kw):
  """Params (bf16) and state after feeding ``grads``, jitted; ``history`` (a
  list) receives the params after every step."""
  tx = OPTIMIZERS[name][0](**kw)
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _values(0).items()}
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for g in grads:
    params, state = step(params, state, {k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()})
    if history is not None:
      history.append(params)
  return params, state


def _torch_run(name, grads, history=None, **kw):
  params = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16)) for k in NAMES]
  opt = OPTIMIZERS[name][1](params, **kw)
  for g in grads:
    for p, k in zip(params, NAMES):
      p.grad = torch.from_numpy(g[k]).to(torch.bfloat16)
    opt.step()
    if history is not None:
      history.append([p.detach().clone() for p in params])
  return params, opt


def _nonfinite_count(x) -> int:
  return int(np.sum(~np.isfinite(np.asarray(x, np.float32))))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skip_nonfinite_equals_a_run_without_those_steps(name):
  good = [_grads(i) for i in range(5)]
  bad = [_grads(9, np.nan), _grads(10, np.inf), _grads(11, -np.inf)]
  # A NaN step inside the run, then two bad steps in a row at its end.
  with_bad = good[:2] + bad[:1] + good[2:] + bad[1:]
  # JAX: the skipped steps change nothing; later steps equal the clean run bitwise.
  clean_p, clean_s = _jax_run(name, good, skip_nonfinite=True)
  p, s = _jax_run(name, with_bad, skip_nonfinite=True)
  for a, b in zip(jax.tree.leaves((clean_p, clean_s.inner_state)),
                  jax.tree.leaves((p, s.inner_state))):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert int(clean_s.total_notfinite) == 0
  assert (int(s.notfinite_count), bool(s.last_finite), int(s.total_notfinite)) == (2, False, 3)
  # torch: the same, and the same bits as JAX for the elementwise optimizers.
  clean_tp, clean_opt = _torch_run(name, good, skip_nonfinite=True)
  tp, opt = _torch_run(name, with_bad, skip_nonfinite=True)
  for a, b in zip(clean_tp, tp):
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
  assert opt.nonfinite == {"notfinite_count": 2, "last_finite": False, "total_notfinite": 3}
  assert clean_opt.nonfinite["total_notfinite"] == 0
  for a, b in zip(clean_opt.state.values(), opt.state.values()):
    for k in a:
      assert torch.equal(a[k], b[k]), k
  if not name.startswith("scaled_adam"):  # ScaledAdam matches within ULPs (test_parity)
    for t, k in zip(tp, NAMES):
      np.testing.assert_array_equal(
          _bits(p[k]), t.detach().view(torch.int16).numpy().view(np.uint16))
  # The counters are saved and loaded with the optimizer.
  params = [torch.nn.Parameter(torch.zeros(SHAPES[k], dtype=torch.bfloat16)) for k in NAMES]
  fresh = OPTIMIZERS[name][1](params, skip_nonfinite=True)
  fresh.load_state_dict(opt.state_dict())
  assert fresh.nonfinite == opt.nonfinite


# Without skip_nonfinite: which params are poisoned after a bad gradient
# element in w[0, 0] at step 1 (0-based), per step, as documented.
def _expected_poisoned(name, step):
  if step < 1:
    return {"b": 0, "s": 0, "w": 0}
  if not name.startswith("scaled_adam"):
    return {"b": 0, "s": 0, "w": 1}  # only the element itself
  if step < 3:  # ScaledAdam: the element, until the size update at step S - 1 = 3
    return {"b": 0, "s": 0, "w": 1}
  if name == "scaled_adam clipping" and step >= 4:  # clipping from step P = 4 on
    return {"b": 3, "s": 1, "w": 12}
  return {"b": 0, "s": 0, "w": 12}  # the whole tensor from the size update on


@pytest.mark.parametrize("name,bad", [(n, np.nan) for n in OPTIMIZERS] + [
    ("adamw_bf16 kahan", np.inf), ("scaled_adam clipping", np.inf)])
def test_without_skip_the_poison_spreads_as_documented(name, bad):
  grads = [_grads(i, bad if i == 1 else None) for i in range(6)]
  jax_history, torch_history = [], []
  p, _ = _jax_run(name, grads, jax_history)
  _torch_run(name, grads, torch_history)
  for step, (jp, tp) in enumerate(zip(jax_history, torch_history)):
    expected = _expected_poisoned(name, step)
    assert {k: _nonfinite_count(v) for k, v in jp.items()} == expected, step
    got = {k: _nonfinite_count(t.float().numpy()) for t, k in zip(tp, NAMES)}
    assert got == expected, step
  # The element-wise family: the other elements equal a run whose bad element was 0.
  if not name.startswith("scaled_adam"):
    zeroed = [_grads(i, 0.0 if i == 1 else None) for i in range(6)]
    p_ref, _ = _jax_run(name, zeroed)
    w, w_ref = np.asarray(p["w"], np.float32), np.asarray(p_ref["w"], np.float32)
    np.testing.assert_array_equal(w.ravel()[1:], w_ref.ravel()[1:])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_loss_scaler_skips_and_counts_for_every_optimizer(name):
  """With a loss scaler nothing changes on a non-finite step and the skip is counted."""
  tx = oh.dynamic_loss_scale(OPTIMIZERS[name][0](), init_scale=2.0**4)
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _values(0).items()}
  state = tx.init(params)
  g = {k: jnp.asarray(v * 2.0**4, jnp.bfloat16) for k, v in _grads(0, np.nan).items()}
  u, new_state = jax.jit(tx.update)(g, state, params)
  new_params = optax.apply_updates(params, u)
  for a, b in zip(jax.tree.leaves((params, state.inner_state)),
                  jax.tree.leaves((new_params, new_state.inner_state))):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert int(new_state.skipped_steps) == 1 and float(new_state.scale) == 2.0**3

  tparams = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16))
             for k in NAMES]
  before = [p.detach().clone() for p in tparams]
  opt = OPTIMIZERS[name][1](tparams)
  scaler = tb.dynamic_loss_scale(init_scale=2.0**4)
  loss = sum((p.float() * torch.from_numpy(_grads(0, np.nan)[k])).sum()
             for p, k in zip(tparams, NAMES))
  scaler.scale(loss).backward()
  scaler.step(opt)
  scaler.update()
  for a, b in zip(before, tparams):
    assert torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
  assert all(not s or int(s.get("step", 0)) == 0 for s in opt.state.values())
  assert int(scaler.counters()["skipped_steps"]) == 1 and scaler.get_scale() == 2.0**3


def test_skip_nonfinite_must_be_a_bool():
  with pytest.raises(TypeError, match="skip_nonfinite must be True or False; got 1"):
    oh.adamw_bf16(1e-3, skip_nonfinite=1)
  with pytest.raises(TypeError, match="skip_nonfinite must be True or False; got 1"):
    tb.adamw_bf16([torch.nn.Parameter(torch.ones(2))], 1e-3, skip_nonfinite=1)
