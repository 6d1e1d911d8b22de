"""PyTorch mirror of ``optax_half/rounding.py``: the same bits, op for op.

32-bit words live in int32 tensors: PyTorch has no full uint32 arithmetic, but
the bits of a wrapping int32 product, xor and add are those of the uint32 ones,
and a logical right shift is an arithmetic shift followed by a mask. Scalar
keys are hashed on the host with Python integers (no device work, no sync);
the grouped eager step (``adam._Grouped``) mixes each tensor's leaf into the
part common to its keys (``_stream_key``) on the device.
Spec: ``docs/algorithms.md#rounding-primitives``.
"""

from __future__ import annotations

import numpy as np
import torch

import optax_half_native as native_lib

__all__ = [
    "widen",
    "land",
    "update_of",
    "sqrt",
    "one_minus_pow",
    "split_f32",
    "join_f32",
    "mix32",
    "leaf_key",
    "device_scalar",
    "key_tensor",
    "leaf_keys",
    "bits_from_key",
    "random_bits",
    "stochastic_round",
    "round_to",
    "swap_halves",
    "round_moments",
    "STREAM_PARAMS",
    "STREAM_MOMENTS",
]

STREAM_PARAMS, STREAM_MOMENTS = native_lib.STREAM_PARAMS, native_lib.STREAM_MOMENTS

_M1, _M2, _GOLDEN = native_lib.MIX32_M1, native_lib.MIX32_M2, native_lib.GOLDEN
_MASK = 0xFFFFFFFF


def _signed32(v: int) -> int:
  v &= _MASK
  return v - 2**32 if v >= 2**31 else v


def _mix32_int(x: int) -> int:
  """``mix32`` on a Python integer (a uint32 value)."""
  x &= _MASK
  x ^= x >> 16
  x = (x * _M1) & _MASK
  x ^= x >> 15
  x = (x * _M2) & _MASK
  x ^= x >> 15
  return x


def _times(x: torch.Tensor, m: int) -> torch.Tensor:
  """``x * m`` mod 2^32 on int32 words (uint32 bits). Eagerly torch's int32
  multiply wraps. In a compiled graph (Inductor's C++, where a signed
  overflow is undefined) it is computed in int64 from m's 16-bit halves, so
  that no op overflows: x * m_lo + ((x * m_hi) mod 2^16) * 2^16."""
  if not torch.compiler.is_compiling():
    return x * m
  x64 = x.to(torch.int64) & _MASK
  y = (x64 * (m & 0xFFFF) + ((x64 * (m >> 16)) & 0xFFFF) * 65536) & _MASK
  return torch.where(y >= 2**31, y - 2**32, y).to(torch.int32)


def mix32(x: torch.Tensor) -> torch.Tensor:
  """``optax_half.rounding.mix32`` on int32 tensors (uint32 bits, wrapping).

  A bijective 32-bit hash: ``x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2;
  x ^= x >> 15`` with logical shifts and products mod 2^32. The int32 result
  holds the uint32 word's bits; ``& 0xFFFFFFFF`` (in int64) reads it as JAX does.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> words = rounding.mix32(torch.tensor([0, 1, 2], dtype=torch.int32))
    >>> [w & 0xFFFFFFFF for w in words.tolist()]  # the uint32 words
    [0, 2261973619, 229111015]
  """
  x = x ^ ((x >> 16) & 0xFFFF)
  x = _times(x, _M1)
  x = x ^ ((x >> 15) & 0x1FFFF)
  x = _times(x, _M2)
  x = x ^ ((x >> 15) & 0x1FFFF)
  return x


def _stream_key(seed: int, step: int, stream: int) -> int:
  """The part of ``leaf_key`` common to every leaf: ``leaf_key(seed, step,
  stream, leaf) == mix32(_stream_key(seed, step, stream) ^ leaf)`` (a uint32
  Python int)."""
  k = _mix32_int(seed)
  k = _mix32_int(k ^ (step & _MASK))
  return _mix32_int(k ^ ((stream * _GOLDEN) & _MASK))


def leaf_key(seed: int, step: int, stream: int, leaf: int) -> int:
  """The uint32 key of one (seed, step, stream, leaf), as a Python int.

  ``k = mix(seed); k = mix(k ^ step); k = mix(k ^ stream * 0x9E3779B9); k =
  mix(k ^ leaf)``, computed on the host with Python integers (no device work).

  Example:
    >>> from torch_bridge import rounding
    >>> rounding.leaf_key(seed=0, step=1, stream=rounding.STREAM_PARAMS, leaf=0)
    1317927411
    >>> rounding.leaf_key(0, 1, rounding.STREAM_PARAMS, leaf=1) != 1317927411
    True
  """
  return _mix32_int(_stream_key(seed, step, stream) ^ (leaf & _MASK))


def _mix32_np(x: np.ndarray) -> np.ndarray:
  """``mix32`` on a uint32 numpy array (products wrap mod 2^32)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(_M1)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(_M2)
  return x ^ (x >> np.uint32(15))


def leaf_keys(seed: int, steps, stream: int, leaves) -> np.ndarray:
  """``leaf_key`` of many leaves at once, as int32 words (uint32 bits): one
  host computation for a whole step, whatever the number of leaves.

  Example:
    >>> from torch_bridge import rounding
    >>> keys = rounding.leaf_keys(0, [1, 1, 2], rounding.STREAM_PARAMS, [0, 1, 0])
    >>> [int(k) & 0xFFFFFFFF for k in keys] == [
    ...     rounding.leaf_key(0, s, rounding.STREAM_PARAMS, leaf) for s, leaf in
    ...     ((1, 0), (1, 1), (2, 0))]
    True
  """
  steps = np.asarray(steps, np.int64)
  leaves = (np.asarray(leaves, np.int64) & _MASK).astype(np.uint32)
  out = np.empty(leaves.shape, np.uint32)
  for step in np.unique(steps):  # the part common to the leaves of one step count, once
    at = steps == step
    out[at] = _mix32_np(np.uint32(_stream_key(int(seed), int(step), int(stream))) ^ leaves[at])
  return out.view(np.int32)


def device_scalar(value, dtype: torch.dtype, device=None) -> torch.Tensor:
  """A 0-dim ``dtype`` tensor holding ``value`` (exact in ``dtype``) on ``device``.

  Written by a fill: ``torch.tensor(value).to(device)`` copies from pageable
  host memory, and on CUDA that copy makes the host wait for the stream (a
  sync, which ``torch.cuda.set_sync_debug_mode`` reports); a fill is a kernel
  launch that takes the value as an argument.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> s = rounding.device_scalar(0.5, torch.float32)
    >>> s.shape, s.dtype, s.item()
    (torch.Size([]), torch.float32, 0.5)
  """
  return torch.full((), value, dtype=dtype, device=device)


def _key_tensor_of(key: int, device=None) -> torch.Tensor:
  """A uint32 key (a Python int) as a 0-dim int32 tensor of its bits, by a fill."""
  return device_scalar(_signed32(key), torch.int32, device)


def key_tensor(seed: int, step: int, stream: int, leaf: int, device=None) -> torch.Tensor:
  """``leaf_key`` as a 0-dim int32 tensor (its uint32 bits), for ``bits_from_key``.

  Example:
    >>> from torch_bridge import rounding
    >>> k = rounding.key_tensor(seed=0, step=1, stream=rounding.STREAM_PARAMS, leaf=0)
    >>> k.dtype, k.item() & 0xFFFFFFFF == rounding.leaf_key(0, 1, rounding.STREAM_PARAMS, 0)
    (torch.int32, True)
  """
  return _key_tensor_of(leaf_key(int(seed), int(step), int(stream), int(leaf)), device)


def _counter(shape, device, index) -> torch.Tensor:
  """The int32 random-bit counter (uint32 bits) of every element of ``shape``."""
  numel = 1
  for d in shape:
    numel *= int(d)
  if not torch.is_tensor(index) and not index:
    return torch.arange(numel, dtype=torch.int32, device=device).reshape(tuple(shape))
  if torch.is_tensor(index):  # every element's index, e.g. a strided shard's
    c = index.to(torch.int64)
  else:  # a shard's offset
    c = torch.arange(numel, dtype=torch.int64, device=device) + int(index)
  c = c.reshape(tuple(shape)) & _MASK  # mod 2^32, as int32 bits
  return torch.where(c >= 2**31, c - 2**32, c).to(torch.int32)


def bits_from_key(key, shape, device=None, index=0) -> torch.Tensor:
  """``mix32(index ^ key)`` over the row-major element index of ``shape``.

  ``key``: a Python int (int32 range) or a 0-dim int32 tensor; a tensor key
  lets a compiled kernel take new keys without recompiling. ``index``: the
  counter of element 0 (a shard's offset in the whole tensor, from
  ``_dist.index``), or an integer tensor of ``shape`` holding every
  element's counter; counters are taken mod 2^32.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> key = rounding.key_tensor(seed=0, step=1, stream=rounding.STREAM_PARAMS, leaf=0)
    >>> whole = rounding.bits_from_key(key, (6,))
    >>> shard = rounding.bits_from_key(key, (3,), index=3)  # elements 3..5 of the whole
    >>> torch.equal(shard, whole[3:])
    True
  """
  return mix32(_counter(shape, device, index) ^ key)


def random_bits(seed: int, step: int, stream: int, leaf: int, shape,
                device=None, index=0) -> torch.Tensor:
  """The words of ``optax_half.rounding.random_bits`` as an int32 tensor.

  ``bits[i] = mix32(i ^ key)``; view the result as uint32 (``& 0xFFFFFFFF``
  in int64) to compare with JAX. ``seed``, ``step`` and ``leaf`` are Python
  integers (host-side counters): the key costs no device work. ``index``: as
  in ``bits_from_key`` (a shard draws the bits of its elements in the whole tensor).

  Example:
    >>> import numpy as np, optax_half as oh
    >>> from torch_bridge import rounding
    >>> bits = rounding.random_bits(seed=0, step=1, stream=rounding.STREAM_PARAMS,
    ...                             leaf=0, shape=(3,))
    >>> bits.dtype
    torch.int32
    >>> jax_bits = oh.rounding.random_bits(0, 1, rounding.STREAM_PARAMS, 0, (3,))
    >>> [b & 0xFFFFFFFF for b in bits.tolist()] == np.asarray(jax_bits).tolist()
    True
  """
  key = _signed32(leaf_key(int(seed), int(step), int(stream), int(leaf)))
  return bits_from_key(key, shape, device, index)


def widen(t: torch.Tensor) -> torch.Tensor:
  """The exact fp32 value of ``t`` (the mirror of ``optax_half.rounding.widen``).

  Eagerly, ``t.float()`` is exact. Inside a ``torch.compile``d graph it is
  exact only with Inductor's ``emulate_precision_casts=True``: otherwise
  Inductor drops ``f32(bf16(x))`` pairs (the XLA:GPU trap of the JAX side)
  and a Kahan buffer ``x - f32(bf16(x))`` becomes 0. torch_bridge's optimizer
  steps run eagerly (``torch.compiler.disable``) or in their own kernel
  compiled with that option; a bit-level widen would be exact everywhere but
  stops Inductor from vectorising the loop (measured: 10x slower).

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> rounding.widen(torch.tensor([0.1, 3.0], dtype=torch.bfloat16)).tolist()
    [0.10009765625, 3.0]
  """
  return t.float()


def update_of(d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
  """``optax_half.rounding.update_of``: the fp32 update ``d`` in a 16-bit ``dtype``
  (bf16: its high half, a NaN as ``.to``'s; fp16: rounded to nearest).

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> d = torch.tensor(1.0 + 2.0**-7 + 2.0**-8 + 2.0**-10)  # bits below bf16's last
    >>> rounding.update_of(d, torch.bfloat16).item(), d.to(torch.bfloat16).item()
    (1.0078125, 1.015625)
  """
  if dtype != torch.bfloat16:
    return d.to(dtype)
  high = (d.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
  return torch.where(torch.isnan(d), d.to(dtype), high)


def land(p: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """``(u, p_land)``: ``optax_half.rounding.land``, the update from ``p`` to
  ``t`` in ``p``'s dtype (``update_of``) and where ``p + u`` lands (``p_land ==
  t`` unless the step crosses binades far).

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> u, p_land = rounding.land(torch.tensor(1.0, dtype=torch.bfloat16),
    ...                           torch.tensor(1.0078125, dtype=torch.bfloat16))
    >>> print(u.dtype, u.item(), p_land.item())
    torch.bfloat16 0.0078125 1.0078125
  """
  pw = widen(p)
  u = update_of(widen(t) - pw, p.dtype)
  return u, (pw + widen(u)).to(p.dtype)


def sqrt(x: torch.Tensor) -> torch.Tensor:
  """Correctly rounded fp32 square root (what XLA and IEEE ``sqrtf`` give).

  ``torch.sqrt`` on CPU float32 is not correctly rounded: measured on this
  build (torch 2.13.0, AVX2), 17% of 2M random inputs came out one ULP off.
  The square root of an fp32 value taken in float64 and rounded once to fp32
  is correctly rounded, so that is what runs on CPU eagerly; compiled code
  (Inductor emits IEEE ``sqrt``) and other devices use ``torch.sqrt``.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> x = torch.linspace(0.5, 2.0, 10_000)
    >>> torch.equal(rounding.sqrt(x), torch.sqrt(x.double()).float())  # rounded once
    True
    >>> rounding.sqrt(torch.tensor([4.0, 2.0])).tolist()
    [2.0, 1.4142135381698608]
  """
  if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling():
    return torch.sqrt(x.double()).float()
  return torch.sqrt(x)  # IEEE in float64 (the step of float64 params)


def one_minus_pow(b: float, n: int, one_minus_b=None) -> float:
  """``1 - b ** n`` in fp32 for an integer ``n >= 0``, on the host, without ``pow``.

  The mirror of ``optax_half.rounding.one_minus_pow``: binary exponentiation
  on ``d(k) = 1 - b ** k`` with ``d(2k) = d(k) * (2 - d(k))`` and
  ``d(j+k) = (d(j) + d(k)) - d(j) * d(k)``, every operation an fp32 numpy
  scalar op (rounded once, never fused), so the result has the same bits as
  the jitted JAX one. Returns a Python float holding the fp32 value.
  ``one_minus_b``: ``d(1)`` given directly, as in JAX.

  Example:
    >>> from torch_bridge import rounding
    >>> rounding.one_minus_pow(0.999, 10)  # Adam's bias correction at step 10
    0.00995499175041914
    >>> rounding.one_minus_pow(0.9, 0)
    0.0
  """
  n = int(n)
  if not 0 <= n < 2 ** 32:
    raise ValueError(f"one_minus_pow needs 0 <= n < 2**32; got {n}.")
  one, two = np.float32(1), np.float32(2)
  d_pow = one - np.float32(b) if one_minus_b is None else np.float32(one_minus_b)  # d(2 ** i)
  d = np.float32(0)
  while n:
    if n & 1:
      d = (d + d_pow) - d * d_pow
    d_pow = d_pow * (two - d_pow)
    n >>= 1
  return float(d)


def split_f32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """fp32 -> (bf16 high half rounded half-up in bit space, int16 remainder).

  ``hi = (bits + 0x8000) >> 16`` and ``lo = bits - (hi << 16)``, so that
  ``join_f32(hi, lo)`` gives back every bit of ``x``: an fp32 master weight
  stored as its bf16 param plus 2 bytes (``master_weights(split=True)``).
  NaN splits into a quiet bf16 NaN and 0.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> x = torch.tensor([1.0 + 2**-20, -3.14159, 1e-30])
    >>> hi, lo = rounding.split_f32(x)
    >>> hi.dtype, lo.dtype, hi[0].item(), lo[0].item()
    (torch.bfloat16, torch.int16, 1.0, 8)
    >>> torch.equal(rounding.join_f32(hi, lo), x)  # exact round trip
    True
  """
  x = x.float()
  bits = x.view(torch.int32)
  hi = (bits + 0x8000) >> 16           # arithmetic shift: the low 16 bits are right
  lo = bits - (hi << 16)                # in [-32768, 32767] for non-NaN x
  nan = torch.isnan(x)
  hi = torch.where(nan, torch.full_like(hi, 0x7FC0), hi)
  lo = torch.where(nan, torch.zeros_like(lo), lo)
  return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join_f32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
  """Inverse of ``split_f32``: ``bits = (hi_bits << 16) + lo``.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> hi = torch.tensor([1.0], dtype=torch.bfloat16)
    >>> rounding.join_f32(hi, torch.tensor([8], dtype=torch.int16)).item() == 1.0 + 2**-20
    True
    >>> x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    >>> torch.equal(rounding.join_f32(*rounding.split_f32(x)), x)
    True
  """
  bits = (hi.view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)
  return bits.view(torch.float32)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
  """``optax_half.rounding.stochastic_round``: unbiased rounding of fp32 ``x``.

  Rounds up (away from zero) with probability ``(|x| - |down|) / (|up| -
  |down|)``, so ``E[result] = x`` up to the 2^-16 (bf16) or 2^-24 (fp16)
  resolution of the random draw. ``bits``: int32 words (``random_bits``);
  int64 words in [0, 2^32) are accepted too. ``dtype=torch.float32``
  returns ``x``.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> x = torch.full((1000,), 0.999)
    >>> bits = rounding.random_bits(seed=0, step=1, stream=rounding.STREAM_PARAMS,
    ...                             leaf=0, shape=x.shape)
    >>> y = rounding.stochastic_round(x, torch.bfloat16, bits)
    >>> sorted(set(y.tolist()))  # the two bf16 neighbours of 0.999
    [0.99609375, 1.0]
    >>> round(y.float().mean().item(), 3)  # unbiased: round-to-nearest gives 1.0
    0.999

  References:
    Gupta et al., `Deep Learning with Limited Numerical Precision
    <https://arxiv.org/abs/1502.02551>`_, ICML 2015.
  """
  x = x.float()
  if dtype == torch.float32:
    return x
  bits = bits.to(torch.int32) if bits.dtype != torch.int32 else bits
  if dtype == torch.bfloat16:
    # Add 16 random bits below the bf16 mantissa and truncate; the truncated
    # word converts to bf16 exactly.
    word = (x.view(torch.int32) + ((bits >> 16) & 0xFFFF)) & -65536
    y = word.view(torch.float32).to(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), y)
  if dtype != torch.float16:
    raise ValueError(f"stochastic rounding rounds to bfloat16 or float16; got "
                     f"{str(dtype).removeprefix('torch.')}.")
  nearest = x.to(dtype)
  overshoot = widen(nearest).abs() > x.abs()
  # down = nextafter(nearest, 0) where nearest overshoots, else nearest; up =
  # nextafter(down, +-inf on x's side): one step of the 15-bit magnitude, the
  # sign kept (nearest has x's sign, -0 included; x = +-0 never takes up).
  # Integer steps, not torch.nextafter, which Inductor computes in fp32 for
  # fp16 tensors (a compiled step, fused=True, then never moved a value).
  word = nearest.view(torch.int16).to(torch.int32)
  sign, down_magnitude = word & -32768, (word & 0x7FFF) - overshoot.to(torch.int32)
  down = (sign | down_magnitude).to(torch.int16).view(dtype)
  up = (sign | (down_magnitude + 1)).to(torch.int16).view(dtype)
  down32 = widen(down)
  gap = widen(up).abs() - down32.abs()
  frac = (x.abs() - down32.abs()) / gap
  u = ((bits >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24
  y = torch.where(u < frac, up, down)
  return torch.where(torch.isfinite(x), y, nearest)


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: str, seed: int = 0,
             step: int = 0, stream: int = 0, leaf: int = 0, index=0) -> torch.Tensor:
  """Round fp32 ``x`` to ``dtype``: "nearest" or "stochastic" (16-bit only).

  With "stochastic" the bits are ``random_bits(seed, step, stream, leaf,
  x.shape, index=index)``; to fp32 (or with "nearest") it is ``x.to(dtype)``.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> x = torch.full((1000,), 0.999)
    >>> rounding.round_to(x, torch.bfloat16, "nearest").unique().tolist()
    [1.0]
    >>> y = rounding.round_to(x, torch.bfloat16, "stochastic", seed=0, step=1)
    >>> y.unique().tolist()
    [0.99609375, 1.0]
  """
  if rounding == "stochastic" and dtype.itemsize < 4:
    bits = random_bits(seed, step, stream, leaf, x.shape, device=x.device, index=index)
    return stochastic_round(x, dtype, bits)
  return x.to(dtype)


def swap_halves(bits: torch.Tensor) -> torch.Tensor:
  """``optax_half.rounding.swap_halves`` on int32 words: the 16-bit halves exchanged.

  No op overflows int32: a compiled step (Inductor's C++, where signed
  overflow is undefined) rounded fp16 moments with other bits than the eager
  step when the low half was shifted up by ``(bits & 0xFFFF) * 65536``; its
  top bit is set separately.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> w = rounding.swap_halves(torch.tensor([0x12345678, 0x0000ABCD], dtype=torch.int32))
    >>> [hex(b & 0xFFFFFFFF) for b in w.tolist()]
    ['0x56781234', '0xabcd0000']
  """
  top = torch.where((bits & 0x8000) != 0, -2**31, 0).to(torch.int32)
  return ((bits & 0x7FFF) * 65536) | top | ((bits >> 16) & 0xFFFF)


def _stochastic_moments(m_dtype: torch.dtype, v_dtype: torch.dtype, rounding: str) -> bool:
  """Whether ``round_moments`` draws random bits: stochastic rounding and
  a 16-bit moment (fp32 moments are written as they are)."""
  return rounding == "stochastic" and (m_dtype.itemsize < 4 or v_dtype.itemsize < 4)


def round_moments(m32: torch.Tensor, v32: torch.Tensor, m_dtype: torch.dtype,
                  v_dtype: torch.dtype, rounding: str, key=0, index=0):
  """``optax_half.rounding.round_moments``: both moments from one word per element.

  ``key``: the leaf key of ``STREAM_MOMENTS``, as ``bits_from_key`` takes it
  (``key_tensor``, or a Python int in int32 range);
  ``m32`` rounds with ``w = bits_from_key(key, shape, index=index)`` and
  ``v32`` with ``swap_halves(w)``.

  Example:
    >>> import torch
    >>> from torch_bridge import rounding
    >>> m32 = v32 = torch.full((1000,), 0.999)
    >>> key = rounding.key_tensor(seed=0, step=1, stream=rounding.STREAM_MOMENTS, leaf=0)
    >>> m, v = rounding.round_moments(m32, v32, torch.bfloat16, torch.bfloat16,
    ...                               "stochastic", key)
    >>> m.unique().tolist(), torch.equal(m, v)  # one word, two independent halves
    ([0.99609375, 1.0], False)
  """
  if not _stochastic_moments(m_dtype, v_dtype, rounding):
    return m32.to(m_dtype), v32.to(v_dtype)
  w = bits_from_key(key, m32.shape, m32.device, index)
  return stochastic_round(m32, m_dtype, w), stochastic_round(v32, v_dtype, swap_halves(w))
