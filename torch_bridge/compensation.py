"""Compensations in torch: ``optax_half/compensation.py``'s rules, in place.

One object per entry of ``optax_half_native.COMPENSATIONS``, holding its
torch rules: the buffer's ``init_buffer``, the working value's ``read``, the
new param's and buffer's ``write`` and the buffer's ``follow`` of a param
written from outside. ``adam.adamw_step``, the wrappers, the optimizers'
state and ``convert`` all look a compensation up here. ``read``, ``write`` and
``follow`` take local tensors (a DTensor's shard). Spec:
``docs/algorithms.md#wrappers``.
"""

from __future__ import annotations

from typing import Optional

import torch

import optax_half_native as native_lib
from torch_bridge import rounding

__all__ = ["COMPENSATIONS", "Compensation", "kahan_remainder_fits"]

_SIGNED = {1: torch.int8, 2: torch.int16}


def kahan_remainder_fits(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
  """Where ``c`` is a Kahan remainder of ``p``: ``|c|`` at most half the gap
  from ``p`` to its neighbour in ``c``'s direction (the bound every Kahan
  write leaves, ties included). False where ``p`` is NaN or infinite."""
  signed = _SIGNED[p.element_size()]
  bits = p.view(signed).to(torch.int32)
  magnitude = bits & ((1 << (8 * p.element_size() - 1)) - 1)
  # Sign-magnitude: +1 moves away from zero, -1 towards it (from +-0: away).
  towards_zero = (torch.signbit(p) != torch.signbit(c)) & (magnitude > 0)
  neighbour = torch.where(towards_zero, bits - 1, bits + 1).to(signed).view(p.dtype)
  gap = (rounding.widen(neighbour) - rounding.widen(p)).abs()
  return 2 * rounding.widen(c).abs() <= gap


class Compensation(native_lib.Rules):
  """A compensation's torch rules; the shared facts are ``spec``'s
  (``optax_half_native.Compensation``), readable as attributes."""

  def __reduce__(self):  # one object per name, also after pickle and deepcopy
    return (_lookup, (self.spec.name,))

  def for_dtype(self, dtype: torch.dtype) -> Compensation:
    """The compensation a 16-bit param of ``dtype`` takes (``spec.fp16``
    where it is not bf16)."""
    return self if dtype == torch.bfloat16 else COMPENSATIONS[self.spec.fp16]

  def buffer_dtype_of(self, dtype: torch.dtype,
                      master_dtype=torch.float32) -> Optional[torch.dtype]:
    """The dtype of the buffer a 16-bit param of ``dtype`` keeps, or None."""
    kind = self.spec.buffer_dtype
    return None if kind is None else {"param": dtype, "int16": torch.int16,
                                      "float32": master_dtype}[kind]

  def init_buffer(self, p: torch.Tensor, master_dtype=torch.float32) -> Optional[torch.Tensor]:
    """The buffer of a fresh optimizer for ``p``, or None."""
    return None

  def read(self, p: torch.Tensor, buf) -> torch.Tensor:
    """The fp32 (or master dtype) working value the optimizer steps."""
    return rounding.widen(p)

  def write(self, x_new: torch.Tensor, p: torch.Tensor, buf, bits) -> None:
    """Stores ``x_new`` into ``p`` and ``buf``: ``p`` takes where ``p + u``
    lands (``u`` the update towards this compensation's rounding of
    ``x_new``, in ``p``'s dtype), ``buf`` is written against it; a master's
    param takes the target itself (docs/algorithms.md#landing-exactly);
    ``bits``: the random bits where
    ``draws_bits``, else None. For a compensation whose buffer
    ``holds_value``, ``buf`` None means the buffer was stepped in place."""
    p.copy_(rounding.land(p, x_new.to(p.dtype))[1])

  def follow(self, p: torch.Tensor, buf: torch.Tensor) -> None:
    """Re-seeds ``buf`` where ``p`` was written from outside (``follows``)."""


class _Master(Compensation):
  def init_buffer(self, p, master_dtype=torch.float32):
    return p.detach().to(master_dtype, copy=True)

  def read(self, p, buf):
    # The master follows the param: where the param is not the master's
    # rounding (written from outside the optimizer), the step starts from it.
    p32 = rounding.widen(p)
    return torch.where(rounding.widen(buf.to(p.dtype)) == p32, buf, p32)

  def write(self, x_new, p, buf, bits):
    # The step writes the param: it is the master's rounding, and the master is x_new, never
    # rounded (docs/algorithms.md#landing-exactly); buf None: x_new is the master itself,
    # stepped in place.
    if buf is not None:
      buf.copy_(x_new)
    p.copy_(x_new.to(p.dtype))

  def follow(self, p, buf):
    # Kept where the master rounds to the param, else the param widened.
    buf.copy_(torch.where(buf.to(p.dtype) == p, buf, p.to(buf.dtype)))


class _Split(Compensation):
  def init_buffer(self, p, master_dtype=torch.float32):
    return torch.zeros_like(p, dtype=torch.int16)  # bf16 -> fp32 is exact: lo = 0

  def read(self, p, buf):
    return rounding.join_f32(p, buf)

  def write(self, x_new, p, buf, bits):
    # The param is the high half, the buffer the low half: the master exactly.
    hi, lo = rounding.split_f32(x_new)
    buf.copy_(lo)
    p.copy_(hi)


class _Kahan(Compensation):
  def init_buffer(self, p, master_dtype=torch.float32):
    return torch.zeros_like(p)

  def read(self, p, buf):
    return rounding.widen(p) + rounding.widen(buf)

  def write(self, x_new, p, buf, bits):
    landed = rounding.land(p, x_new.to(p.dtype))[1]
    buf.copy_(x_new - rounding.widen(landed))  # against what landed
    p.copy_(landed)

  def follow(self, p, buf):
    # Kept where it is still a remainder of the param, else 0.
    buf.copy_(torch.where(kahan_remainder_fits(p, buf), buf, torch.zeros_like(buf)))


class _Stochastic(Compensation):
  def write(self, x_new, p, buf, bits):
    p.copy_(rounding.land(p, rounding.stochastic_round(x_new, p.dtype, bits))[1])


class _Nearest(Compensation):
  pass  # the base rules: read p, write round(x')


COMPENSATIONS = {name: rules(native_lib.COMPENSATIONS[name]) for name, rules in (
    ("kahan", _Kahan), ("split", _Split), ("stochastic", _Stochastic), ("none", _Nearest),
    ("master", _Master))}
assert set(COMPENSATIONS) == set(native_lib.COMPENSATIONS)


def _lookup(name: str) -> Compensation:
  return COMPENSATIONS[name]
