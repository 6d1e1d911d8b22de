"""Bit-level helpers for low-precision params: elementwise, jit-safe, no host syncs.

Spec: ``docs/algorithms.md#rounding-primitives``; ``torch_bridge/rounding.py`` mirrors it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import optax_half_native as native_lib

__all__ = [
    "widen",
    "land",
    "land_master",
    "update_of",
    "opaque_zero",
    "no_fma",
    "one_minus_pow",
    "split_f32",
    "join_f32",
    "mix32",
    "random_bits",
    "stochastic_round",
    "round_to",
    "swap_halves",
    "round_moments",
    "STREAM_PARAMS",
    "STREAM_MOMENTS",
]

# One stream per buffer kind keeps their bits independent; both moments share one.
STREAM_PARAMS, STREAM_MOMENTS = native_lib.STREAM_PARAMS, native_lib.STREAM_MOMENTS
_M1, _M2, _GOLDEN = native_lib.MIX32_M1, native_lib.MIX32_M2, native_lib.GOLDEN

# The helpers a step calls once per leaf (or more) are traced once per shape and dtype of
# their arguments and inlined where they are called: the same ops, at a fraction of the
# trace time of a tree of many leaves (docs/algorithms.md#determinism-and-jit). Python
# numbers are made uint32 arrays before the call (a seed may exceed int32).
_traced_once = functools.partial(jax.jit, inline=True)


def _u32(x) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.uint32)


def mix32(x: jax.Array) -> jax.Array:
  """A bijective uint32 hash (docs/algorithms.md#counter-based-random-bits).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> h = rounding.mix32(jnp.arange(4, dtype=jnp.uint32))
    >>> print(h.dtype, [hex(v) for v in h.tolist()])
    uint32 ['0x0', '0x86d2fa73', '0xda7f4e7', '0xed6e1efa']
  """
  return _mix32(_u32(x))


@_traced_once
def _mix32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * _u32(_M1)
  x = x ^ (x >> 15)
  x = x * _u32(_M2)
  x = x ^ (x >> 15)
  return x


def _leaf_key(seed, step, stream, leaf) -> jax.Array:
  """The scalar key of one (seed, step, stream, leaf); see ``random_bits``."""
  return _leaf_key_u32(_u32(seed), _u32(step), _u32(stream), _u32(leaf))


@_traced_once
def _leaf_key_u32(seed, step, stream, leaf) -> jax.Array:
  k = _mix32(seed)
  k = _mix32(k ^ step)
  k = _mix32(k ^ (stream * _u32(_GOLDEN)))
  k = _mix32(k ^ leaf)
  return k


def random_bits(seed, step, stream: int, leaf: int, shape) -> jax.Array:
  """Uniform uint32 bits per element, ``mix32(i ^ key(seed, step, stream, leaf))``;
  ``seed``, ``step`` may be traced (docs/algorithms.md#counter-based-random-bits).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> bits = rounding.random_bits(0, 0, rounding.STREAM_PARAMS, 0, (2, 3))
    >>> print(bits.dtype, bits.shape)
    uint32 (2, 3)
    >>> bool((bits == rounding.random_bits(0, 0, rounding.STREAM_PARAMS, 0, (2, 3))).all())
    True
    >>> bool((bits == rounding.random_bits(0, 1, rounding.STREAM_PARAMS, 0, (2, 3))).any())
    False
  """
  shape = tuple(int(d) for d in shape)
  return _random_bits(_u32(seed), _u32(step), _u32(stream), _u32(leaf), shape)


@functools.partial(_traced_once, static_argnums=(4,))
def _random_bits(seed, step, stream, leaf, shape: tuple) -> jax.Array:
  key = _leaf_key_u32(seed, step, stream, leaf)
  index = lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64))).reshape(shape)
  return _mix32(index ^ key)


def swap_halves(bits: jax.Array) -> jax.Array:
  """``bits``, 16-bit halves swapped (docs/algorithms.md#one-random-word-for-both-moments).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> hex(int(rounding.swap_halves(jnp.uint32(0x12345678))))
    '0x56781234'
  """
  return _swap_halves(_u32(bits))


@_traced_once
def _swap_halves(bits: jax.Array) -> jax.Array:
  return (bits << 16) | (bits >> 16)


def widen(p: jax.Array) -> jax.Array:
  """The exact fp32 value of ``p``, even just rounded in-graph (docs/algorithms.md#exact-upcasts).

  Its derivative is the identity, as ``astype``'s (bit casts alone would give zero).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_half import rounding
    >>> lost = jax.jit(lambda x: x - rounding.widen(x.astype(jnp.bfloat16)))
    >>> x = jnp.float32(1.001)  # 1.0 in bf16
    >>> float(lost(x)) == float(x) - 1.0
    True
    >>> print(rounding.widen(jnp.float16(1.5)).dtype)
    float32
  """
  p = jnp.asarray(p)
  if p.dtype.itemsize >= 4:
    return p.astype(jnp.float32)
  return _widen16_once(p)


@jax.custom_jvp
def _widen16(p: jax.Array) -> jax.Array:
  if p.dtype == jnp.bfloat16:
    bits = lax.bitcast_convert_type(p, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)
  if p.dtype == jnp.float16:
    return _widen_f16_bits(p)
  return lax.optimization_barrier(p).astype(jnp.float32)  # fp8 and the like


def _widen_f16_bits(p: jax.Array) -> jax.Array:
  """fp16 -> fp32 through the bits, as the conversion gives them (a signalling NaN
  quieted): normal and special values by moving the fields, subnormals as
  ``mantissa * 2^-24`` (exact). No float rewrite can fold it, and unlike an
  optimization barrier it fuses (docs/algorithms.md#exact-upcasts)."""
  b = lax.bitcast_convert_type(p, jnp.uint16).astype(jnp.uint32)
  sign = (b & 0x8000) << 16
  exponent = (b >> 10) & 0x1F
  mantissa = b & 0x3FF
  normal = sign | ((exponent + 112) << 23) | (mantissa << 13)
  special = sign | 0x7F800000 | (mantissa << 13) | jnp.where(mantissa != 0, _u32(0x400000), _u32(0))
  wide = lax.bitcast_convert_type(jnp.where(exponent == 31, special, normal), jnp.float32)
  small = mantissa.astype(jnp.float32) * jnp.float32(2.0**-24)
  small = jnp.where(sign != 0, -small, small)
  return jnp.where(exponent == 0, small, wide)


@_widen16.defjvp
def _widen16_jvp(primals, tangents):
  (p,), (t,) = primals, tangents
  return _widen16(p), jnp.asarray(t).astype(jnp.float32)


_widen16_once = _traced_once(_widen16)


def update_of(d: jax.Array, dtype) -> jax.Array:
  """The fp32 update ``d`` in a 16-bit ``dtype``, as a landing takes it: bf16 keeps ``d``'s
  high half (truncation toward zero, a NaN as ``astype``'s), fp16 rounds to nearest; exact
  where ``d`` fits (docs/algorithms.md#landing-exactly). Its derivative is the identity.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> d = jnp.float32(1.0 + 2.0**-7 + 2.0**-8 + 2.0**-10)  # bits below bf16's last
    >>> print(float(rounding.update_of(d, jnp.bfloat16)), float(d.astype(jnp.bfloat16)))
    1.0078125 1.015625
  """
  d = jnp.asarray(d, jnp.float32)
  return _truncate_bf16_once(d) if jnp.dtype(dtype) == jnp.bfloat16 else d.astype(dtype)


@jax.custom_jvp
def _truncate_bf16(d: jax.Array) -> jax.Array:
  word = lax.bitcast_convert_type(d, jnp.uint32) >> 16
  high = lax.bitcast_convert_type(word.astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isnan(d), d.astype(jnp.bfloat16), high)


@_truncate_bf16.defjvp
def _truncate_bf16_jvp(primals, tangents):
  (d,), (t,) = primals, tangents
  return _truncate_bf16(d), jnp.asarray(t).astype(jnp.bfloat16)


_truncate_bf16_once = _traced_once(_truncate_bf16)


def land(p: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(u, p_land)``: the update from ``p`` to ``t`` in ``p``'s dtype,
  ``update_of(f32(t) - f32(p))``, and where it lands, ``round(f32(p) + f32(u))`` (what
  ``optax.apply_updates(p, u)`` computes); ``p_land == t`` unless the step crosses binades
  far (docs/algorithms.md#landing-exactly).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> u, p_land = rounding.land(jnp.bfloat16(1.0), jnp.bfloat16(1.0078125))
    >>> print(u.dtype, float(u), float(p_land))
    bfloat16 0.0078125 1.0078125
  """
  return _land(jnp.asarray(p), jnp.asarray(t))


@_traced_once
def _land(p: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
  pw = widen(p)
  u = update_of(widen(t) - pw, p.dtype)
  return u, (pw + widen(u)).astype(p.dtype)


def land_master(p: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``land(p, t)`` for a master's update: where ``p + u`` misses ``t`` and ``t`` is out of
  reach from where it lands too (a weight that jumps from far across zero), ``u = -p``, and
  the param lands on ``+0.0``, from which the next step reaches its target
  (docs/algorithms.md#landing-exactly). A NaN target, or an Inf or NaN ``p``, lands as
  ``land``'s.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> p, t = jnp.bfloat16(1.0), jnp.bfloat16(2.0**-20)
    >>> print(float(rounding.land(p, t)[1]), float(rounding.land_master(p, t)[1]))
    0.00390625 0.0
  """
  return _land_master(jnp.asarray(p), jnp.asarray(t))


@_traced_once
def _land_master(p: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
  u, p_land = _land(p, t)
  t32 = widen(t)
  again = _land(p_land, t)[1]
  far = ((widen(p_land) != t32) & (widen(again) != t32) & ~jnp.isnan(t32)
         & jnp.isfinite(widen(p)))
  u = jnp.where(far, -p, u)
  return u, (widen(p) + widen(u)).astype(p.dtype)


def opaque_zero(count: jax.Array) -> jax.Array:
  """``count >> 31``, a zero the compiler cannot fold (docs/algorithms.md#determinism-and-jit).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> zero = rounding.opaque_zero(jnp.int32(5))
    >>> print(zero.dtype, int(zero))
    uint32 0
  """
  return lax.shift_right_logical(jnp.asarray(count).astype(jnp.uint32), jnp.uint32(31))


@jax.custom_jvp
def no_fma(x: jax.Array, zero: jax.Array) -> jax.Array:
  """fp32 ``x``, unchanged, but opaque to FMA contraction: ``no_fma(a * b, zero) + c``
  rounds the product first, as torch does (docs/algorithms.md#determinism-and-jit).

  Example:
    ``a * a - 1`` for ``a = 1 + 2**-12``: ``2**-11`` (fused: ``2**-11 + 2**-24``):

    >>> import jax, jax.numpy as jnp
    >>> from optax_half import rounding
    >>> @jax.jit
    ... def f(a, count):
    ...   return rounding.no_fma(a * a, rounding.opaque_zero(count)) - 1
    >>> float(f(jnp.float32(1 + 2**-12), jnp.int32(1))) == 2**-11
    True
  """
  bits = lax.bitcast_convert_type(x, jnp.uint32) ^ zero
  return lax.bitcast_convert_type(bits, jnp.float32)


@no_fma.defjvp
def _no_fma_jvp(primals, tangents):
  # The identity: derivatives pass through (bit casts alone would give zero).
  x, zero = primals
  return no_fma(x, zero), tangents[0]


def one_minus_pow(b, n: jax.Array, zero: jax.Array, one_minus_b=None) -> jax.Array:
  """``1 - b ** n`` in fp32 for an int32 ``n >= 0``, without ``pow``: the same bits
  as torch_bridge's (docs/algorithms.md#adamw-core).

  ``one_minus_b``: ``1 - b`` itself, ``b`` ignored (docs/algorithms.md#dtypes-and-coefficients).

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> zero = rounding.opaque_zero(jnp.int32(0))
    >>> float(rounding.one_minus_pow(0.5, jnp.int32(3), zero))  # 1 - 1/8
    0.875
    >>> round(float(rounding.one_minus_pow(0.999, jnp.int32(1000), zero)), 4)
    0.6323
  """
  if one_minus_b is None:
    d_pow = 1 - jnp.asarray(b, jnp.float32)  # d(2 ** i)
  else:
    d_pow = jnp.asarray(one_minus_b, jnp.float32)
  return _one_minus_pow(jnp.asarray(n), d_pow, jnp.asarray(zero))


@_traced_once
def _one_minus_pow(n: jax.Array, d_pow: jax.Array, zero: jax.Array) -> jax.Array:
  n = n.astype(jnp.uint32)
  two = jnp.float32(2)

  def bit(i, carry):  # one bit of n, lowest first (a loop: traced once, not 32 times)
    d, d_pow = carry
    take = lax.shift_right_logical(n, lax.convert_element_type(i, jnp.uint32)) & jnp.uint32(1)
    d = lax.select(take == 1, (d + d_pow) - no_fma(d * d_pow, zero), d)
    return d, no_fma(d_pow * (two - d_pow), zero)  # added to d at the next bit

  shape = jnp.broadcast_shapes(jnp.shape(n), jnp.shape(d_pow))
  d_pow = jnp.broadcast_to(d_pow, shape)
  return lax.fori_loop(0, 32, bit, (jnp.zeros(shape, jnp.float32), d_pow), unroll=True)[0]


_BF16_QNAN = 0x7FC0


@jax.custom_jvp
def split_f32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Split fp32 ``x`` into ``(hi: bfloat16, lo: int16)`` with no loss
  (docs/algorithms.md#split-fp32-into-bf16-and-int16); ``hi``'s derivative is the
  identity (as ``astype``'s), ``lo`` has none.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> x = jnp.float32(1.00001)
    >>> hi, lo = rounding.split_f32(x)
    >>> print(hi.dtype, float(hi), lo.dtype, int(lo))
    bfloat16 1.0 int16 84
    >>> bool(rounding.join_f32(hi, lo) == x)
    True
  """
  x = jnp.asarray(x, jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  hi = (bits + _u32(0x8000)) >> 16
  lo = bits - (hi << 16)
  lo = lax.bitcast_convert_type(lo, jnp.int32).astype(jnp.int16)
  nan = jnp.isnan(x)
  hi = jnp.where(nan, _u32(_BF16_QNAN), hi)
  lo = jnp.where(nan, jnp.int16(0), lo)
  hi = lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.bfloat16)
  return hi, lo


@split_f32.defjvp
def _split_f32_jvp(primals, tangents):
  hi, lo = split_f32(*primals)
  return (hi, lo), (jnp.asarray(tangents[0]).astype(jnp.bfloat16), _no_tangent(lo))


def _no_tangent(x: jax.Array) -> np.ndarray:
  """The (empty) tangent of an integer array."""
  return np.zeros(np.shape(x), jax.dtypes.float0)


@jax.custom_jvp
def join_f32(hi: jax.Array, lo: jax.Array) -> jax.Array:
  """Inverse of ``split_f32``; the derivative is ``hi``'s, the identity.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> x = jnp.array([3.14159265, -2e-5, 1e30], jnp.float32)
    >>> y = rounding.join_f32(*rounding.split_f32(x))
    >>> print(y.dtype, bool((y == x).all()))
    float32 True
  """
  hi_bits = lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32)
  lo_bits = lax.bitcast_convert_type(lo.astype(jnp.int32), jnp.uint32)
  return lax.bitcast_convert_type((hi_bits << 16) + lo_bits, jnp.float32)


@join_f32.defjvp
def _join_f32_jvp(primals, tangents):
  return join_f32(*primals), jnp.asarray(tangents[0]).astype(jnp.float32)


def _stochastic_round_bf16(x: jax.Array, bits: jax.Array) -> jax.Array:
  # 16 random bits added below the bf16 mantissa carry with probability low16(x) / 2^16.
  word = lax.bitcast_convert_type(x, jnp.uint32)
  word = (word + (bits >> 16)) >> 16
  y = lax.bitcast_convert_type(word.astype(jnp.uint16), jnp.bfloat16)
  return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), y)


def _stochastic_round_f16(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
  nearest = x.astype(dtype)
  overshoot = jnp.abs(widen(nearest)) > jnp.abs(x)
  # Neighbours by integer steps, as torch_bridge's: docs/algorithms.md#stochastic-rounding.
  word = lax.bitcast_convert_type(nearest, jnp.int16).astype(jnp.int32)
  sign, down_magnitude = word & -32768, (word & 0x7FFF) - overshoot.astype(jnp.int32)
  down = lax.bitcast_convert_type((sign | down_magnitude).astype(jnp.int16), dtype)
  up = lax.bitcast_convert_type((sign | (down_magnitude + 1)).astype(jnp.int16), dtype)
  down32 = widen(down)
  gap = jnp.abs(widen(up)) - jnp.abs(down32)
  frac = (jnp.abs(x) - jnp.abs(down32)) / gap
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  y = jnp.where(u < frac, up, down)
  return jnp.where(jnp.isfinite(x), y, nearest)


def stochastic_round(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
  """Round fp32 ``x`` to ``dtype`` up or down at random, unbiased, by uint32 ``bits`` of
  ``x``'s shape (docs/algorithms.md#stochastic-rounding); the derivative is the identity
  (straight through, as ``astype``'s).

  Example:

    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> x = jnp.full(10000, 1 + 2**-9, jnp.float32)
    >>> y = rounding.stochastic_round(x, jnp.bfloat16, rounding.random_bits(0, 0, 0, 0, x.shape))
    >>> print(y.dtype, sorted(set(y.tolist())))
    bfloat16 [1.0, 1.0078125]
    >>> round(float(y.astype(jnp.float32).mean()), 3), round(1 + 2**-9, 3)
    (1.002, 1.002)
  """
  x = jnp.asarray(x, jnp.float32)
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return x
  if dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"stochastic rounding rounds to bfloat16 or float16; got {dtype.name}.")
  return _stochastic_round16_once(x, dtype, jnp.asarray(bits))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _stochastic_round16(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
  if dtype == jnp.bfloat16:
    return _stochastic_round_bf16(x, bits)
  return _stochastic_round_f16(x, dtype, bits)


@_stochastic_round16.defjvp
def _stochastic_round16_jvp(dtype, primals, tangents):
  x, bits = primals
  return _stochastic_round16(x, dtype, bits), jnp.asarray(tangents[0]).astype(dtype)


_stochastic_round16_once = _traced_once(_stochastic_round16, static_argnums=(1,))


def round_to(x: jax.Array, dtype, rounding: str, seed=None, step=None,
             stream: int = 0, leaf: int = 0) -> jax.Array:
  """Round fp32 ``x`` to ``dtype`` by ``rounding`` in {"nearest", "stochastic"}.

  Stochastic draws ``random_bits(seed, step, stream, leaf, x.shape)``; targets wider than
  16 bits round to nearest.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> x = jnp.full(10000, 1 + 2**-9, jnp.float32)
    >>> nearest = rounding.round_to(x, jnp.bfloat16, "nearest")
    >>> random = rounding.round_to(x, jnp.bfloat16, "stochastic", seed=0, step=0)
    >>> mean = lambda y: round(float(y.astype(jnp.float32).mean()), 3)
    >>> mean(nearest), mean(random)
    (1.0, 1.002)
  """
  dtype = jnp.dtype(dtype)
  if rounding == "stochastic" and dtype.itemsize < 4:
    return stochastic_round(x, dtype, random_bits(seed, step, stream, leaf, x.shape))
  return jnp.asarray(x).astype(dtype)


def _stochastic_moments(m_dtype, v_dtype, rounding: str) -> bool:
  """Whether ``round_moments`` draws bits: stochastic, and a moment narrower than fp32."""
  return rounding == "stochastic" and (
      jnp.dtype(m_dtype).itemsize < 4 or jnp.dtype(v_dtype).itemsize < 4)


def round_moments(m32: jax.Array, v32: jax.Array, m_dtype, v_dtype, rounding: str,
                  seed=None, step=None, leaf: int = 0,
                  bits=None) -> tuple[jax.Array, jax.Array]:
  """Round Adam's fp32 moments to their storage dtypes, stochastically from one word
  per element (docs/algorithms.md#one-random-word-for-both-moments): ``bits``, or
  ``random_bits(seed, step, STREAM_MOMENTS, leaf, m32.shape)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half import rounding
    >>> m32 = jnp.full(10000, 1 + 2**-9, jnp.float32)
    >>> m, v = rounding.round_moments(m32, m32 * m32, jnp.bfloat16, jnp.float32,
    ...                               "stochastic", seed=0, step=0)
    >>> print(m.dtype, v.dtype, round(float(m.astype(jnp.float32).mean()), 3))
    bfloat16 float32 1.002
  """
  m_dtype, v_dtype = jnp.dtype(m_dtype), jnp.dtype(v_dtype)
  if not _stochastic_moments(m_dtype, v_dtype, rounding):
    return jnp.asarray(m32).astype(m_dtype), jnp.asarray(v32).astype(v_dtype)
  w = random_bits(seed, step, STREAM_MOMENTS, leaf, m32.shape) if bits is None else bits
  return stochastic_round(m32, m_dtype, w), stochastic_round(v32, v_dtype, swap_halves(w))
