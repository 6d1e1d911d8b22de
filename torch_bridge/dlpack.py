"""Zero-copy array exchange between JAX and torch (DLPack), copies made explicit.

The parity harness moves every array it compares across the framework
boundary with these two functions. Both share the buffer (the data pointers
are equal) or raise ``CopyRequired`` saying why they cannot; with
``allow_copy=True`` they copy instead and warn with ``DLPackCopyWarning``, so
a copy is never silent. Reasons a copy is needed (torch 2.13, jax 0.10, CPU):

* the tensor's strides are not a permutation of a compact layout (slices,
  broadcast views): JAX imports only compact buffers;
* the CPU buffer is not aligned the way XLA requires (JAX would copy it);
* the tensor lives on a device JAX does not see;
* a 64-bit tensor while ``jax_enable_x64`` is off (JAX makes it 32-bit).

A torch view of a JAX array aliases immutable JAX memory: read it, never write
it (``to_torch`` returns it as is; clone before mutating).
"""

from __future__ import annotations

import warnings

import jax
import torch

__all__ = ["CopyRequired", "DLPackCopyWarning", "to_jax", "to_torch", "shares_memory"]


class CopyRequired(ValueError):
  """The array cannot cross the framework boundary without a copy."""


class DLPackCopyWarning(UserWarning):
  """An array was copied instead of shared (``allow_copy=True``)."""


def _jax_pointer(x: jax.Array) -> int:
  return x.unsafe_buffer_pointer()


def shares_memory(x: jax.Array, t: torch.Tensor) -> bool:
  """Whether the JAX array and the torch tensor start at the same address."""
  return _jax_pointer(x) == t.data_ptr()


def to_jax(t: torch.Tensor, allow_copy: bool = False) -> jax.Array:
  """The JAX array sharing ``t``'s buffer (``t`` detached first).

  Raises ``CopyRequired`` when sharing is impossible, unless ``allow_copy``,
  which copies (a contiguous clone) and warns.
  """
  t = t.detach()
  try:
    x = jax.dlpack.from_dlpack(t, copy=False)
  except Exception as e:  # noqa: BLE001 (jax raises several types here)
    reason = str(e).splitlines()[0]
    if not allow_copy:
      raise CopyRequired(
          f"a {t.dtype}{tuple(t.shape)} tensor with strides {t.stride()} cannot be shared "
          f"with JAX ({reason}); pass allow_copy=True to copy it.") from e
    warnings.warn(f"copied a {t.dtype}{tuple(t.shape)} tensor to JAX: {reason}",
                  DLPackCopyWarning, stacklevel=2)
    return jax.dlpack.from_dlpack(t.contiguous().clone(), copy=True)
  if t.numel() and not shares_memory(x, t):
    # copy=False does not stop JAX from converting 64-bit tensors to 32 bits
    # when jax_enable_x64 is off (a new buffer).
    reason = f"JAX stores it as {x.dtype}" if x.dtype.itemsize != t.element_size() else \
        "JAX made a new buffer"
    if not allow_copy:
      raise CopyRequired(
          f"a {t.dtype}{tuple(t.shape)} tensor cannot be shared with JAX ({reason}); "
          "pass allow_copy=True to copy it.")
    warnings.warn(f"copied a {t.dtype}{tuple(t.shape)} tensor to JAX: {reason}",
                  DLPackCopyWarning, stacklevel=2)
  return x


def to_torch(x: jax.Array, allow_copy: bool = False) -> torch.Tensor:
  """The torch tensor sharing ``x``'s buffer (read-only by contract)."""
  x = jax.numpy.asarray(x)
  t = torch.from_dlpack(x)
  if x.size and not shares_memory(x, t):
    if not allow_copy:
      raise CopyRequired(
          f"torch copied a {x.dtype}{x.shape} JAX array; pass allow_copy=True to accept it.")
    warnings.warn(f"copied a {x.dtype}{x.shape} JAX array to torch", DLPackCopyWarning,
                  stacklevel=2)
  return t
