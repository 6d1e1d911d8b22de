"""Hypergradients: jax.grad through k steps of the wrappers and adamw_bf16 with respect to the
learning rate matches the same computation on fp32 params (rounding is straight through, as
astype's derivative), and the native kernel, which has no derivative, is never silently zero."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import _native, rounding
from suite_helpers import default_or_slow

X = jax.random.normal(jax.random.key(0), (32, 16))
Y = jax.random.normal(jax.random.key(1), (32,))
W0 = jax.random.normal(jax.random.key(2), (16,)) * 0.5


def _loss(params):
  return jnp.mean((X @ params["w"].astype(jnp.float32) - Y) ** 2)


def _final_loss(make_tx, dtype, lr, steps=5, scan=False):
  params = {"w": W0.astype(dtype)}
  tx = make_tx(lr)

  def step(carry, _):
    params, state = carry
    updates, state = tx.update(jax.grad(_loss)(params), state, params)
    return (optax.apply_updates(params, updates), state), None

  carry = (params, tx.init(params))
  if scan:
    carry, _ = jax.lax.scan(step, carry, None, length=steps)
  else:
    for _ in range(steps):
      carry, _ = step(carry, None)
  return _loss(carry[0])


def _hypergradient(make_tx, dtype, lr, **kwargs):
  return float(jax.jit(jax.grad(lambda lr: _final_loss(make_tx, dtype, lr, **kwargs)))(lr))


WRAPPERS = {
    "kahan": lambda lr: oh.kahan_summation(optax.sgd(lr)),
    "master": lambda lr: oh.master_weights(optax.sgd(lr)),
    "split": lambda lr: oh.master_weights(optax.sgd(lr), split=True),
    "none": lambda lr: oh.round_to_nearest(optax.sgd(lr)),
    "stochastic": lambda lr: oh.stochastic_rounding(optax.sgd(lr), key=0),
    "loss_scaled": lambda lr: oh.dynamic_loss_scale(oh.kahan_summation(optax.sgd(lr)),
                                                    init_scale=1.0),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrappers_hypergradient_matches_fp32(name, dtype):
  want = _hypergradient(optax.sgd, jnp.float32, 0.1)
  got = _hypergradient(WRAPPERS[name], dtype, 0.1)
  assert abs(want) > 1.0
  assert got == pytest.approx(want, rel=0.02), (name, got, want)


# make test: one bf16 and one fp16 case; make test-slow: every compensation in both.
_ADAMW_CASES = [(c, d) for d in (jnp.bfloat16, jnp.float16)
                for c in ("kahan", "split", "stochastic", "none")]


@pytest.mark.parametrize("compensation, dtype", default_or_slow(
    _ADAMW_CASES, [("kahan", jnp.bfloat16), ("stochastic", jnp.float16)]))
def test_adamw_bf16_hypergradient_matches_fp32_with_the_kernel_available(compensation, dtype):
  """Traced under jax.grad, adamw_bf16 takes its composed path (the kernel has no derivative),
  also inside a scan."""
  want = _hypergradient(lambda lr: optax.adamw(lr, weight_decay=0.01), jnp.float32, 0.01)
  got = _hypergradient(lambda lr: oh.adamw_bf16(lr, compensation=compensation), dtype, 0.01)
  assert abs(want) > 1.0
  assert got == pytest.approx(want, rel=0.02), (got, want)
  scanned = _hypergradient(lambda lr: oh.adamw_bf16(lr, compensation=compensation), dtype,
                           0.01, scan=True)
  assert scanned == pytest.approx(got, rel=1e-5)


@pytest.mark.parametrize("name", default_or_slow(
    ["adam_fp32_master", "scaled_adam", "kahan_scaled_adam"], ["adam_fp32_master"]))
def test_other_kernel_optimizers_hypergradient_matches_fp32(name):
  make, reference, lr = {
      "adam_fp32_master": (oh.adam_fp32_master, optax.adam, 0.01),
      "scaled_adam": (oh.scaled_adam, oh.scaled_adam, 0.03),
      "kahan_scaled_adam": (lambda lr: oh.kahan_summation(oh.scaled_adam(lr)), oh.scaled_adam,
                            0.03)}[name]
  want = _hypergradient(reference, jnp.float32, lr)
  assert abs(want) > 1.0
  assert _hypergradient(make, jnp.bfloat16, lr) == pytest.approx(want, rel=0.02)


def test_differentiating_is_seen_through_jit_and_vmap():
  seen = []

  def probe(x):
    seen.append(_native.differentiating())
    return x * 2

  probe(1.0)
  jax.jit(probe)(1.0)
  jax.grad(probe)(1.0)
  jax.grad(jax.jit(lambda x: probe(x)))(1.0)  # a fresh trace (jit caches by function)
  jax.grad(lambda x: jax.vmap(probe)(x).sum())(jnp.ones(2))
  jax.jvp(probe, (1.0,), (1.0,))
  assert seen == [False, False, True, True, True, True]


@pytest.mark.skipif(not _native.available(), reason="the native kernel is not built")
def test_a_kernel_step_traced_before_differentiation_is_a_clear_error():
  """A jitted step traced outside jax.grad holds the kernel; differentiating it later must
  raise, naming the fixes, never give zero."""
  params = {"w": W0.astype(jnp.bfloat16)}
  tx = oh.adamw_bf16(0.01)
  state = tx.init(params)
  step = jax.jit(tx.update)
  step(jax.grad(_loss)(params), state, params)  # traced here, with the kernel

  def f(scale):
    p = {"w": (params["w"] * scale).astype(jnp.bfloat16)}
    updates, _ = step(jax.grad(_loss)(p), state, p)
    return _loss(optax.apply_updates(p, updates))

  with pytest.raises(ValueError, match="no derivative.*OPTAX_HALF_NATIVE=0"):
    jax.grad(f)(1.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rounding_primitives_are_straight_through(dtype):
  x = jnp.array([1.001, -3.7, 2.0**-20], jnp.float32)
  ones = np.ones(3, np.float32)
  widen_grad = jax.grad(lambda v: jnp.sum(rounding.widen(v.astype(dtype)) * 2))(x)
  np.testing.assert_array_equal(widen_grad, 2 * ones)
  bits = rounding.random_bits(0, 0, 0, 0, x.shape)
  sr_grad = jax.grad(
      lambda v: jnp.sum(rounding.widen(rounding.stochastic_round(v, dtype, bits))))(x)
  np.testing.assert_array_equal(sr_grad, ones)
  out, tangent = jax.jvp(lambda v: rounding.widen(v.astype(dtype)), (x,), (ones,))
  assert out.dtype == tangent.dtype == jnp.float32


def test_split_and_join_are_straight_through_in_hi():
  x = jnp.array([1.00001, -2e-5, 3.0], jnp.float32)
  grad = jax.grad(lambda v: jnp.sum(rounding.join_f32(*rounding.split_f32(v)) * 3))(x)
  np.testing.assert_array_equal(grad, np.full(3, 3.0, np.float32))
  (hi, lo), (t_hi, t_lo) = jax.jvp(rounding.split_f32, (x,), (jnp.ones(3),))
  assert t_hi.dtype == jnp.bfloat16 and t_lo.dtype == jax.dtypes.float0
  assert bool((rounding.join_f32(hi, lo) == x).all())
