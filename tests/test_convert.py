"""torch_bridge.convert: a run continues in the other framework.

For every pair of twin optimizers: 50 steps in JAX, ``optax_state_to_torch``,
50 steps in torch equals 100 steps in torch; and 50 in torch,
``torch_state_to_optax``, 50 in JAX equals 100 in JAX. Elementwise optimizers
(bit-exact across frameworks, ``python -m torch_bridge.parity``) must match
bit for bit, params and every state buffer. ScaledAdam and optax.adam /
torch.optim.Adam are not bit-exact across frameworks (reductions summed in
another order; another formula): there the move may not add error, each
buffer within twice the difference between the two frameworks' own runs of
all 100 steps (``max|a - b| / max|b|``, test_scaled_adam's measure). A JAX
state survives JAX -> torch -> JAX unchanged, and a state that does not fit
the optimizer is refused before anything is loaded.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

import optax_half as oh  # noqa: E402
import torch_bridge as tb  # noqa: E402
from torch_bridge import convert, dlpack  # noqa: E402
from conftest import bitwise_equal, jit_step  # noqa: E402
from suite_helpers import default_or_slow  # noqa: E402

N = 50
SHAPES = {"w": ((24, 16), "bfloat16"), "b": ((16,), "bfloat16"), "f": ((8, 4), "float32"),
          "s": ((), "bfloat16")}
LOSS_SCALE = dict(init_scale=2.0 ** 6, growth_interval=20)

# name -> (JAX transformation, torch optimizer on a param list, loss scale?, exact?)
PAIRS = {
    # weight_decay: torch's default (JAX's is optax.adamw's 1e-4)
    "adamw_bf16/kahan": (lambda: oh.adamw_bf16(1e-3, weight_decay=1e-2),
                         lambda ps: tb.adamw_bf16(ps, 1e-3), False, True),
    "adamw_bf16/split": (lambda: oh.adamw_bf16(1e-3, weight_decay=1e-2, compensation="split"),
                         lambda ps: tb.adamw_bf16(ps, 1e-3, compensation="split"), False, True),
    "adamw_bf16/stochastic": (
        lambda: oh.adamw_bf16(1e-3, weight_decay=1e-2, compensation="stochastic", key=11),
        lambda ps: tb.adamw_bf16(ps, 1e-3, compensation="stochastic", key=11), False, True),
    "adamw_bf16/none": (lambda: oh.adamw_bf16(1e-3, weight_decay=1e-2, compensation="none"),
                        lambda ps: tb.adamw_bf16(ps, 1e-3, compensation="none"), False, True),
    "adamw_bf16/fp32-moments": (
        lambda: oh.adamw_bf16(1e-3, weight_decay=1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32),
        lambda ps: tb.adamw_bf16(ps, 1e-3, mu_dtype=torch.float32, nu_dtype=torch.float32),
        False, True),
    "adam_fp32_master+skip": (
        lambda: oh.adam_fp32_master(1e-3, weight_decay=0.1, skip_nonfinite=True),
        lambda ps: tb.adam_fp32_master(ps, 1e-3, weight_decay=0.1, skip_nonfinite=True),
        False, True),
    "scale_by_adamw": (lambda: oh.scale_by_adamw(1e-3, weight_decay=0.1),
                       lambda ps: tb.scale_by_adamw(ps, 1e-3, weight_decay=0.1), False, True),
    "kahan_summation(scale_by_adamw)": (
        lambda: oh.kahan_summation(oh.scale_by_adamw(1e-3, mu_dtype=jnp.float32,
                                                     nu_dtype=jnp.float32)),
        lambda ps: tb.kahan_summation(tb.scale_by_adamw(ps, 1e-3)), False, True),
    "stochastic_rounding(scale_by_adamw)": (
        lambda: oh.stochastic_rounding(oh.scale_by_adamw(1e-3, mu_dtype=jnp.float32,
                                                         nu_dtype=jnp.float32), key=5),
        lambda ps: tb.stochastic_rounding(tb.scale_by_adamw(ps, 1e-3), key=5), False, True),
    "adamw_bf16+loss_scale": (lambda: oh.adamw_bf16(1e-3, weight_decay=1e-2),
                              lambda ps: tb.adamw_bf16(ps, 1e-3), True, True),
    "scaled_adam": (
        lambda: oh.scaled_adam(3e-3, clipping_scale=2.0, clipping_update_period=8),
        lambda ps: tb.scaled_adam(ps, 3e-3, clipping_scale=2.0, clipping_update_period=8),
        False, False),
    "kahan_summation(scaled_adam)": (
        lambda: oh.kahan_summation(oh.scaled_adam(3e-3, clipping_scale=2.0,
                                                  clipping_update_period=8)),
        lambda ps: tb.kahan_summation(tb.scaled_adam(ps, 3e-3, clipping_scale=2.0,
                                                     clipping_update_period=8)), False, False),
    "master_weights(adam)": (
        lambda: oh.master_weights(optax.adam(1e-3)),
        lambda ps: tb.master_weights(torch.optim.Adam(ps, lr=1e-3)), False, False),
}


@functools.cache
def _jax_side(name):
  """The JAX optimizer of a pair (with its loss scale) and its jitted step,
  built and compiled once per process: every test of the pair steps it."""
  make_tx, _, loss_scale, _ = PAIRS[name]
  tx = make_tx()
  if loss_scale:
    tx = oh.dynamic_loss_scale(tx, **LOSS_SCALE)
  return tx, jit_step(tx)


def _params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.standard_normal(s), d) for k, (s, d) in SHAPES.items()}


def _grads(name):
  rng = np.random.default_rng(1)
  out = [{k: np.asarray(rng.standard_normal(s) * 0.1, np.float32) for k, (s, _) in SHAPES.items()}
         for _ in range(2 * N)]
  if "skip" in name or "loss_scale" in name:
    out[N - 10]["w"][3, 4] = np.inf  # before the move: its counters travel too
    out[N + 10]["b"][2] = np.nan
  return out


def _torch_params(params):
  return [dlpack.to_torch(params[k]).clone().requires_grad_() for k in sorted(params)]


def _run_jax(step, params, state, grads):
  """``grads`` through ``step`` (a ``jit_step``), scaled by the state's loss scale."""
  for g in grads:
    scale = float(oh.loss_scale(state)) if _has_scale(state) else 1.0
    g = {k: jnp.asarray(v * np.float32(scale)).astype(params[k].dtype) for k, v in g.items()}
    params, state = step(params, state, g)
  return params, state


def _has_scale(state):
  try:
    oh.find_loss_scale_state(state)
    return True
  except ValueError:
    return False


def _run_torch(opt, params, scaler, grads):
  for g in grads:
    scale = scaler.get_scale() if scaler is not None else 1.0
    for p, k in zip(params, sorted(g)):
      p.grad = torch.from_numpy(np.asarray(g[k] * np.float32(scale), np.float32)).to(p.dtype)
    if scaler is None:
      opt.step()
    else:
      scaler.step(opt)
      scaler.update()


def _normwise(a, b) -> float:
  """``max|a - b| / max|b|``: the error of a buffer relative to its size
  (``test_scaled_adam``'s measure across frameworks)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-30))


def _close(moved, full, exact: bool, what: str, baseline=None):
  """``moved`` (a run that changed frameworks halfway) against ``full`` (a run
  in one framework). ``exact``: equal bits (the elementwise optimizers agree
  bit for bit across frameworks). Otherwise ``baseline`` is ``full``'s own
  framework's twin of the whole run moved over at the end, and the move may
  not add error: within twice the frameworks' own difference (or 1e-6)."""
  a, b = np.asarray(moved), np.asarray(full)
  assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
  if exact or not jnp.issubdtype(a.dtype, jnp.floating):
    assert bitwise_equal(a, b), what
  else:
    inherent = _normwise(baseline, b)
    assert _normwise(a, b) <= max(2 * inherent, 1e-6), (what, _normwise(a, b), inherent)


def _torch_snapshot(opt, params, scaler):
  out = [p.detach().clone() for p in params]
  for o in (opt, getattr(opt, "inner", None)):
    if o is not None:
      for s in o.state.values():
        out += [s[k].detach().clone() for k in sorted(s) if torch.is_tensor(s[k])
                and k != "step" and s[k].numel() > 0]
  if scaler is not None:
    out += list(scaler.counters().values())
  return [dlpack.to_jax(t, allow_copy=True) for t in out]


# make test moves each configuration one way (this way: the odd ones in
# PAIRS' order, the other way the even ones); both ways in make test-slow.
_JAX_FIRST = list(PAIRS)[1::2]


@pytest.mark.parametrize("name", default_or_slow(list(PAIRS), _JAX_FIRST))
def test_jax_then_torch_equals_torch(name):
  _, make_opt, loss_scale, exact = PAIRS[name]
  grads = _grads(name)
  params = _params()
  # 100 steps in torch.
  tparams = _torch_params(params)
  opt = make_opt(tparams)
  scaler = tb.dynamic_loss_scale(**LOSS_SCALE) if loss_scale else None
  _run_torch(opt, tparams, scaler, grads)
  full = _torch_snapshot(opt, tparams, scaler)
  # 50 in JAX, move, 50 in torch.
  tx, step = _jax_side(name)
  jparams, state = _run_jax(step, params, tx.init(params), grads[:N])
  tparams = _torch_params(jparams)
  opt = make_opt(tparams)
  scaler = tb.dynamic_loss_scale(**LOSS_SCALE) if loss_scale else None
  convert.optax_state_to_torch(state, jparams, opt, scaler)
  _run_torch(opt, tparams, scaler, grads[N:])
  moved = _torch_snapshot(opt, tparams, scaler)
  baseline = moved
  if not exact:  # all 100 steps in JAX, moved over at the end
    jparams, state = _run_jax(step, jparams, state, grads[N:])
    tparams = _torch_params(jparams)
    opt = make_opt(tparams)
    convert.optax_state_to_torch(state, jparams, opt, scaler)
    baseline = _torch_snapshot(opt, tparams, scaler)
  assert len(moved) == len(full) == len(baseline) >= 4
  for i, (a, b, c) in enumerate(zip(moved, full, baseline)):
    _close(a, b, exact, f"{name}: buffer {i}", c)
  if "skip" in name:
    assert opt.nonfinite["total_notfinite"] == 2  # one before the move, one after


@pytest.mark.parametrize("name", default_or_slow(
    list(PAIRS), [n for n in PAIRS if n not in _JAX_FIRST]))
def test_torch_then_jax_equals_jax(name):
  _, make_opt, loss_scale, exact = PAIRS[name]
  grads = _grads(name)
  params = _params()
  tx, step = _jax_side(name)
  full_p, full_s = _run_jax(step, params, tx.init(params), grads)
  # 50 in torch, move, 50 in JAX.
  tparams = _torch_params(params)
  opt = make_opt(tparams)
  scaler = tb.dynamic_loss_scale(**LOSS_SCALE) if loss_scale else None
  _run_torch(opt, tparams, scaler, grads[:N])
  jparams = {k: dlpack.to_jax(p.detach().clone()) for k, p in zip(sorted(params), tparams)}
  state = convert.torch_state_to_optax(opt, jparams, tx.init(jparams), scaler)
  end_p, end_s = _run_jax(step, jparams, state, grads[N:])
  baseline = (end_p, end_s)
  if not exact:  # all 100 steps in torch, moved over at the end
    _run_torch(opt, tparams, scaler, grads[N:])
    bparams = {k: dlpack.to_jax(p.detach().clone()) for k, p in zip(sorted(params), tparams)}
    baseline = (bparams, convert.torch_state_to_optax(opt, bparams, tx.init(bparams), scaler))
  assert jax.tree.structure(end_s) == jax.tree.structure(full_s)
  for i, (a, b, c) in enumerate(zip(jax.tree.leaves((end_p, end_s)),
                                    jax.tree.leaves((full_p, full_s)),
                                    jax.tree.leaves(baseline))):
    _close(a, b, exact, f"{name}: leaf {i}", c)


@pytest.mark.parametrize("name", list(PAIRS))
def test_jax_torch_jax_round_trip_is_exact(name):
  _, make_opt, loss_scale, _ = PAIRS[name]
  params = _params()
  tx, step = _jax_side(name)
  jparams, state = _run_jax(step, params, tx.init(params), _grads(name)[:7])
  tparams = _torch_params(jparams)
  opt = make_opt(tparams)
  scaler = tb.dynamic_loss_scale(**LOSS_SCALE) if loss_scale else None
  convert.optax_state_to_torch(state, jparams, opt, scaler)
  back = convert.torch_state_to_optax(opt, jparams, tx.init(jparams), scaler)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    assert bitwise_equal(a, b)


def test_inside_optax_chain():
  """A chain with stateless parts (clipping) maps to the one torch optimizer."""
  params = _params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
  jparams, state = _run_jax(jit_step(tx), params, tx.init(params), _grads("chain")[:3])
  opt = tb.adamw_bf16(_torch_params(jparams), 1e-3)
  convert.optax_state_to_torch(state, jparams, opt)
  back = convert.torch_state_to_optax(opt, jparams, tx.init(jparams))
  assert all(bitwise_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)))
  assert int(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 3


def _moved_kahan_state():
  params = _params()
  tx, step = _jax_side("adamw_bf16/kahan")  # oh.adamw_bf16(1e-3), compiled once
  return _run_jax(step, params, tx.init(params), _grads("x")[:3])


@pytest.mark.parametrize("make_opt,message", [
    (lambda ps: tb.adamw_bf16(ps, 1e-3, compensation="split"),
     "needs a MasterWeightsState in the JAX state; found KahanSummationState"),
    (lambda ps: tb.adam_fp32_master(ps, 1e-3), "needs a MasterWeightsState"),
    (lambda ps: tb.scaled_adam(ps), "needs a ScaledAdamState"),
    (lambda ps: tb.adamw_bf16(ps, 1e-3, mu_dtype=torch.float32),
     r"state 'mu' of param 0: saved torch.bfloat16\(16,\), the optimizer holds torch.float32"),
    (lambda ps: tb.adamw_bf16(ps[:3], 1e-3), "the optimizer has 3 params; the params tree has 4"),
    (lambda ps: tb.adamw_bf16(ps, 1e-3, skip_nonfinite=True),
     "skip_nonfinite=True; the JAX state has no skip counters"),
    (lambda ps: tb.adamw_bf16(ps, 1e-3, amsgrad=True), "amsgrad=True .* has no counterpart"),
    (lambda ps: tb.kahan_summation(torch.optim.AdamW(ps, 1e-3, amsgrad=True)),
     "amsgrad=True .* has no counterpart"),
])
def test_a_state_that_does_not_fit_is_refused_and_nothing_loads(make_opt, message):
  jparams, state = _moved_kahan_state()
  tparams = _torch_params(jparams)
  opt = make_opt(tparams)
  before = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
  with pytest.raises(ValueError, match=message):
    convert.optax_state_to_torch(state, jparams, opt)
  after = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
  assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def test_an_amsgrad_state_is_not_dropped_on_the_way_to_jax():
  """torch's running max of nu has no place in an optax_half state: refused."""
  jparams, state = _moved_kahan_state()
  opt = tb.adamw_bf16(_torch_params(jparams), 1e-3, amsgrad=True)
  with pytest.raises(ValueError, match="amsgrad=True .* has no counterpart"):
    convert.torch_state_to_optax(opt, jparams, state)


def test_loss_scale_needs_the_scaler_both_ways():
  params = _params()
  tx = oh.dynamic_loss_scale(oh.adamw_bf16(1e-3))
  state = tx.init(params)
  opt = tb.adamw_bf16(_torch_params(params), 1e-3)
  with pytest.raises(ValueError, match="pass scaler="):
    convert.optax_state_to_torch(state, params, opt)
  with pytest.raises(ValueError, match="has no dynamic_loss_scale"):
    convert.optax_state_to_torch(oh.adamw_bf16(1e-3).init(params), params, opt,
                                 tb.dynamic_loss_scale())


def test_torch_state_moves_without_aliasing():
  """The JAX arrays made from torch do not change when torch steps on."""
  jparams, state = _moved_kahan_state()
  tparams = _torch_params(jparams)
  opt = tb.adamw_bf16(tparams, 1e-3)
  convert.optax_state_to_torch(state, jparams, opt)
  back = convert.torch_state_to_optax(opt, jparams, oh.adamw_bf16(1e-3).init(jparams))
  saved = [np.asarray(x).copy() for x in jax.tree.leaves(back)]
  _run_torch(opt, tparams, None, _grads("y")[:2])
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(saved, jax.tree.leaves(back)))
  # and torch's buffers are its own, not views of the JAX state
  mu = opt.state[tparams[0]]["mu"]
  assert not dlpack.shares_memory(jax.tree.leaves(state.inner_state.mu)[0], mu)
