"""PyTorch mirror of ``optax_half/rounding.py``: the same bits, op for op.

PyTorch has no full uint32 arithmetic, so 32-bit words live in int64 tensors
holding values in [0, 2^32). Products are formed from 16-bit halves of the
constant so that no intermediate exceeds 2^48, then masked to 32 bits: the
result equals JAX's wrapping uint32 multiply exactly. Spec:
``docs/algorithms.md`` ("Rounding primitives").
"""

from __future__ import annotations

import torch

__all__ = [
    "split_f32",
    "join_f32",
    "mix32",
    "random_bits",
    "stochastic_round",
    "STREAM_PARAMS",
    "STREAM_MU",
    "STREAM_NU",
]

STREAM_PARAMS = 0
STREAM_MU = 1
STREAM_NU = 2

_M1 = 0x21F0AAAD
_M2 = 0x735A2D97
_GOLDEN = 0x9E3779B9
_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
  """(x * c) mod 2^32 for int64 x in [0, 2^32) and a 32-bit constant c."""
  lo, hi = c & 0xFFFF, c >> 16
  return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK


def mix32(x: torch.Tensor) -> torch.Tensor:
  """``optax_half.rounding.mix32`` on int64 tensors holding uint32 values."""
  x = x ^ (x >> 16)
  x = _mul32(x, _M1)
  x = x ^ (x >> 15)
  x = _mul32(x, _M2)
  x = x ^ (x >> 15)
  return x


def _leaf_key(seed, step, stream: int, leaf: int, device) -> torch.Tensor:
  as_word = lambda v: torch.as_tensor(v, dtype=torch.int64, device=device) & _MASK
  k = mix32(as_word(seed))
  k = mix32(k ^ as_word(step))
  k = mix32(k ^ as_word((stream * _GOLDEN) & _MASK))
  k = mix32(k ^ as_word(leaf))
  return k


def random_bits(seed, step, stream: int, leaf: int, shape, device=None) -> torch.Tensor:
  """The same uint32 words as ``optax_half.rounding.random_bits`` (as int64)."""
  key = _leaf_key(seed, step, stream, leaf, device)
  numel = 1
  for d in shape:
    numel *= int(d)
  index = torch.arange(numel, dtype=torch.int64, device=device).reshape(tuple(shape))
  return mix32(index ^ key)


def split_f32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """fp32 -> (bf16 high half rounded half-up in bit space, int16 remainder)."""
  bits = x.float().view(torch.int32).to(torch.int64) & _MASK
  hi = ((bits + 0x8000) & _MASK) >> 16
  lo = bits - (hi << 16)
  lo = torch.where(lo >= 2**31, lo - 2**32, lo)
  lo = torch.where(lo < -(2**31), lo + 2**32, lo)
  nan = torch.isnan(x)
  hi = torch.where(nan, torch.full_like(hi, 0x7FC0), hi)
  lo = torch.where(nan, torch.zeros_like(lo), lo)
  hi16 = torch.where(hi >= 2**15, hi - 2**16, hi).to(torch.int16).view(torch.bfloat16)
  return hi16, lo.to(torch.int16)


def join_f32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
  """Inverse of ``split_f32``."""
  hi_bits = hi.view(torch.int16).to(torch.int64) & 0xFFFF
  bits = ((hi_bits << 16) + lo.to(torch.int64)) & _MASK
  bits = torch.where(bits >= 2**31, bits - 2**32, bits)
  return bits.to(torch.int32).view(torch.float32)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
  """``optax_half.rounding.stochastic_round``: unbiased rounding of fp32 ``x``."""
  x = x.float()
  if dtype == torch.float32:
    return x
  if dtype == torch.bfloat16:
    word = x.view(torch.int32).to(torch.int64) & _MASK
    word = ((word + (bits >> 16)) & _MASK) >> 16
    y = torch.where(word >= 2**15, word - 2**16, word).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), y)
  nearest = x.to(dtype)
  zero = torch.zeros((), dtype=dtype, device=x.device)
  overshoot = nearest.float().abs() > x.abs()
  down = torch.where(overshoot, torch.nextafter(nearest, zero.expand_as(nearest)), nearest)
  inf = torch.where(x < 0, -torch.inf, torch.inf).to(dtype)
  up = torch.nextafter(down, inf)
  gap = up.float().abs() - down.float().abs()
  frac = (x.abs() - down.float().abs()) / gap
  u = (bits >> 8).to(torch.float32) * 2.0**-24
  y = torch.where(u < frac, up, down)
  return torch.where(torch.isfinite(x), y, nearest)
