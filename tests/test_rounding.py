"""Rounding primitives: exact split, unbiased stochastic rounding, exact landing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import optax_half as oh
from optax_half import _native, rounding
from conftest import bitwise_equal


def _wide_f32(rng, n):
  """Random fp32 values over 60 decades, both signs."""
  mag = 10.0 ** rng.uniform(-30, 30, n)
  return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def test_split_join_is_exact_over_60_decades(rng):
  x = np.concatenate([_wide_f32(rng, 1_000_000),
                      np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45,
                                np.finfo(np.float32).tiny], np.float32)])
  hi, lo = rounding.split_f32(jnp.asarray(x))
  assert hi.dtype == jnp.bfloat16 and lo.dtype == jnp.int16
  assert bitwise_equal(rounding.join_f32(hi, lo), x)
  # hi is round-to-nearest; it differs from the nearest-even cast only on ties.
  tie = (x.view(np.uint32) & 0xFFFF) == 0x8000
  rne = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
  assert bitwise_equal(np.asarray(hi)[~tie], rne[~tie])


def test_split_of_nan_is_nan_with_zero_remainder():
  hi, lo = rounding.split_f32(jnp.array([np.nan, -np.nan], jnp.float32))
  assert np.isnan(np.asarray(hi, np.float32)).all() and (np.asarray(lo) == 0).all()


def test_random_bits_are_uniform_and_distinct_per_coordinate():
  shape = (1 << 16,)
  base = rounding.random_bits(1, 0, 0, 0, shape)
  assert base.dtype == jnp.uint32
  u = np.asarray(base, np.float64) / 2**32
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
  # 16 bits of every word are used by bf16 rounding: check each is balanced.
  words = np.asarray(base)
  for bit in range(32):
    ones = ((words >> bit) & 1).mean()
    assert abs(ones - 0.5) < 5 * 0.5 / np.sqrt(words.size), bit
  for other in [(2, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 0, 0, 1)]:
    bits = np.asarray(rounding.random_bits(*other, shape))
    assert (bits == words).mean() < 1e-3, other
  again = rounding.random_bits(jnp.uint32(1), jnp.int32(0), 0, 0, shape)
  assert bitwise_equal(again, base)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_round_is_unbiased(dtype, rng):
  x = np.concatenate([rng.uniform(-4, 4, 64), 10.0 ** rng.uniform(-6, 3, 64),
                      [1.0 + 2**-10, -1.0 - 3 * 2**-12, 5e-5]]).astype(np.float32)
  n = 4096
  draws = jax.vmap(lambda s: rounding.stochastic_round(
      jnp.asarray(x), dtype, rounding.random_bits(3, s, 0, 0, x.shape)))(jnp.arange(n))
  draws = np.asarray(draws, np.float64)
  lo, hi = draws.min(0), draws.max(0)
  # Every draw is one of the two neighbours of x.
  down = np.asarray(jnp.asarray(x).astype(dtype), np.float64)
  assert np.all(lo <= x) and np.all(hi >= x)
  gap = np.maximum(hi - lo, 1e-300)
  frac = (x - lo) / gap
  # Mean within 5 standard errors of the exact value.
  sigma = gap * np.sqrt(np.maximum(frac * (1 - frac), 1.0 / n)) / np.sqrt(n)
  err = np.abs(draws.mean(0) - x)
  assert np.all(err <= 5 * sigma + 1e-12 * np.abs(x)), (err / sigma).max()
  # Values exactly representable are never moved.
  exact = down == x
  assert np.all(lo[exact] == hi[exact])


def test_round_moments_draws_one_word_and_its_swapped_halves():
  m = jnp.linspace(-1, 1, 4099, dtype=jnp.float32) * 1.001
  v = m * m + 1e-3
  w = rounding.random_bits(9, 4, rounding.STREAM_MOMENTS, 2, m.shape)
  mb, vb = rounding.round_moments(m, v, jnp.bfloat16, jnp.bfloat16, "stochastic", 9, 4, 2)
  assert bitwise_equal(mb, rounding.stochastic_round(m, jnp.bfloat16, w))
  swapped = (np.asarray(w) << np.uint32(16)) | (np.asarray(w) >> np.uint32(16))
  assert np.array_equal(np.asarray(rounding.swap_halves(w)), swapped)
  assert bitwise_equal(vb, rounding.stochastic_round(v, jnp.bfloat16, jnp.asarray(swapped)))
  # Nearest rounding, and 32-bit targets, draw nothing.
  mn, vn = rounding.round_moments(m, v, jnp.bfloat16, jnp.float32, "nearest", 9, 4, 2)
  assert bitwise_equal(mn, m.astype(jnp.bfloat16)) and bitwise_equal(vn, v)
  mf, vf = rounding.round_moments(m, v, jnp.float32, jnp.float32, "stochastic", 9, 4, 2)
  assert bitwise_equal(mf, m) and bitwise_equal(vf, v)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_moments_unbiased_each_and_bf16_decisions_independent(dtype):
  # Both moments at random fractions between two neighbours: each is unbiased over 4096 steps; for bf16 the up/down decisions of the
  # two moments, drawn from disjoint halves of one word, are uncorrelated.
  rng = np.random.default_rng(3)
  frac = rng.uniform(0.05, 0.95, 512).astype(np.float32)
  gap = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-10
  m = jnp.asarray(np.float32(1.0) + frac * np.float32(gap))
  v = jnp.asarray(np.float32(2.0) + (1 - frac) * np.float32(2 * gap))
  n = 4096
  mu, nu = jax.vmap(lambda s: rounding.round_moments(
      m, v, dtype, dtype, "stochastic", 1, s, 0))(jnp.arange(n))
  up_m = np.asarray(mu, np.float64) > np.asarray(m)
  up_v = np.asarray(nu, np.float64) > np.asarray(v)
  for up, p in ((up_m, frac), (up_v, 1 - frac)):
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(up.mean(0) - p) <= 5 * sigma), (np.abs(up.mean(0) - p) / sigma).max()
  # Correlation of the two decisions, pooled over the 512 elements.
  zm = (up_m - frac) / np.sqrt(frac * (1 - frac))
  zv = (up_v - (1 - frac)) / np.sqrt(frac * (1 - frac))
  corr = float(np.mean(zm * zv))
  if dtype == jnp.bfloat16:
    assert abs(corr) < 5 / np.sqrt(n * 512), corr  # independent within 5 standard errors


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_round_keeps_non_finite(dtype):
  x = jnp.array([np.nan, np.inf, -np.inf, 0.0, -0.0], jnp.float32)
  y = rounding.stochastic_round(x, dtype, rounding.random_bits(0, 0, 0, 0, x.shape))
  y = np.asarray(y, np.float32)
  assert np.isnan(y[0]) and y[1] == np.inf and y[2] == -np.inf
  assert np.signbit(y[4]) and y[3] == 0


def test_same_key_same_result_different_key_different_result():
  x = jnp.linspace(-1, 1, 1000, dtype=jnp.float32) * 1.001
  a = rounding.stochastic_round(x, jnp.bfloat16, rounding.random_bits(5, 3, 0, 2, x.shape))
  b = rounding.stochastic_round(x, jnp.bfloat16, rounding.random_bits(5, 3, 0, 2, x.shape))
  c = rounding.stochastic_round(x, jnp.bfloat16, rounding.random_bits(6, 3, 0, 2, x.shape))
  assert bitwise_equal(a, b)
  assert not bitwise_equal(a, c)


# --- Landing exactly: apply_updates(p, t - p) == t. -------------------------
# Spec: docs/algorithms.md#landing-exactly.

def _bf16_from_bits(bits):
  return np.array([bits], np.uint16).view(jnp.bfloat16)[0]


finite_bf16 = st.integers(0, 0xFFFF).map(_bf16_from_bits).filter(
    lambda v: np.isfinite(np.float32(v)))


@settings(max_examples=2000, deadline=None)
@given(p=finite_bf16, t=finite_bf16)
def test_fp32_update_lands_on_target(p, t):
  """round(p + fl32(t - p)) == t for bf16 p, t whenever |t| >= 2^-15 |p| or t == 0.

  Subnormal p or t are excluded: XLA flushes fp32 subnormals to zero.
  """
  p32, t32 = np.float32(p), np.float32(t)
  if t32 != 0 and abs(t32) < 2.0**-15 * abs(p32):
    return  # outside the documented condition (see the next test)
  tiny = np.finfo(np.float32).tiny
  if 0 < abs(t32) < tiny or 0 < abs(p32) < tiny or 0 < abs(t32 - p32) < tiny:
    return
  u = np.float32(t32 - p32)
  landed = optax.apply_updates(jnp.asarray(p, jnp.bfloat16), jnp.asarray(u))
  assert bitwise_equal(np.asarray(landed), np.asarray(t, dtype=jnp.bfloat16)) or (
      t32 == 0 and float(landed) == 0)  # +0 and -0 both acceptable for a zero target


def test_landing_limit_is_real_and_documented():
  # A jump from 1.0 to 1e-10 in one step cannot be expressed as an fp32 update.
  p, t = jnp.bfloat16(1.0), jnp.bfloat16(1e-10)
  u = jnp.float32(t) - jnp.float32(p)
  assert float(optax.apply_updates(p, u)) != float(t)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_widen_keeps_the_rounding_error_inside_jit(dtype, rng):
  """x - f32(round(x)) must survive XLA's excess-precision rewrites.

  With plain astype, XLA:GPU folds f32(bf16(x)) into x and this is all zeros
  (that broke Kahan summation on GPU before `widen` existed).
  """
  x = jnp.asarray(rng.uniform(-2, 2, 4096).astype(np.float32))
  err = jax.jit(lambda x: x - rounding.widen(x.astype(dtype)))(x)
  expected = np.asarray(x) - np.asarray(x.astype(dtype), np.float32)
  assert bitwise_equal(err, expected)
  assert np.count_nonzero(np.asarray(err)) > 4000


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_widen_is_the_conversion_on_every_16_bit_pattern(dtype):
  """Through the bits (no float op XLA could fold), ``widen`` gives every one
  of the 65536 values the conversion's fp32 bits: subnormals, both zeros,
  infinities, and NaNs quieted as the conversion quiets them."""
  words = np.arange(65536, dtype=np.uint32).astype(np.uint16)
  x = jax.lax.bitcast_convert_type(jnp.asarray(words), dtype)
  want = np.asarray(words.view(np.dtype(dtype)).astype(np.float32)).view(np.uint32)
  for widen in (rounding.widen, jax.jit(rounding.widen)):
    got = np.asarray(widen(x)).view(np.uint32)
    nan = np.isnan(want.view(np.float32))
    assert np.array_equal(got[~nan], want[~nan])
    # a NaN keeps its sign and payload; fp16's signalling ones come quieted, as
    # XLA's conversion gives them (numpy's keeps the bits; bf16's is a shift)
    assert np.array_equal(got[nan] | 0x400000, want[nan] | 0x400000)
    assert np.isnan(got[nan].view(np.float32)).all()


def test_no_fma_rounds_the_product_before_the_add():
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(100_000).astype(np.float32) for _ in range(3))
  rounded_first = (a * b) + c  # numpy: two roundings, like torch
  fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
  kept = np.asarray(jax.jit(
      lambda a, b, c, n: rounding.no_fma(a * b, rounding.opaque_zero(n)) + c)(a, b, c, jnp.int32(7)))
  assert np.array_equal(kept.view(np.uint32), rounded_first.view(np.uint32))
  # What no_fma prevents, on this backend (XLA:CPU and XLA:GPU contract):
  print(f"plain jit equals the rounded product on {np.mean(fused == rounded_first):.1%}")


# depth: the leaves' last dimension, other in each case (its shapes no other test traces)
@pytest.mark.parametrize("compensation, depth", [("kahan", 3), ("stochastic", 4)])
def test_per_leaf_helpers_are_traced_once_per_shape_not_per_leaf(compensation, depth,
                                                                  monkeypatch):
  """Tracing a step over 16 leaves of one shape runs the per-leaf helpers' Python (the
  AdamW math, its roundings) no more often than tracing it over one leaf
  (rounding._traced_once: docs/algorithms.md#determinism-and-jit). Counted through
  ``no_fma``, which the AdamW math and the bias corrections call as they are traced; fresh
  shapes, so that no earlier test traced them. Without the kernel (the path off CPU)."""
  monkeypatch.setattr(_native, "available", lambda: False)
  calls = []
  real = rounding.no_fma
  monkeypatch.setattr(rounding, "no_fma", lambda x, zero: (calls.append(1), real(x, zero))[1])

  def traced_calls(n, shape):
    params = {f"w{i:02d}": jnp.ones(shape, jnp.bfloat16) for i in range(n)}
    tx = oh.adamw_bf16(1e-3, compensation=compensation)
    state = tx.init(params)
    calls.clear()
    jax.jit(lambda p, s, g: optax.apply_updates(p, tx.update(g, s, p)[0])).trace(
        params, state, params)
    return len(calls)

  one = traced_calls(1, (7, 13, depth))
  assert one > 0  # the count sees the math being traced
  assert traced_calls(16, (11, 5, depth)) <= one
