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
  """The array cannot cross the framework boundary without a copy.

  A ``ValueError`` raised by ``to_jax`` and ``to_torch`` when sharing the
  buffer is impossible; its message says why and names ``allow_copy=True``.

  Example:
    >>> import torch
    >>> from torch_bridge import dlpack
    >>> try:
    ...   dlpack.to_jax(torch.arange(6.0)[::2])  # strided: JAX takes compact buffers
    ... except dlpack.CopyRequired as e:
    ...   print(type(e).__name__, isinstance(e, ValueError))
    CopyRequired True
  """


class DLPackCopyWarning(UserWarning):
  """An array was copied instead of shared (``allow_copy=True``).

  A ``UserWarning``, so the usual filters apply: turned into an error, it
  makes any copy fail loudly.

  Example:
    >>> import warnings, torch
    >>> from torch_bridge import dlpack
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("error", dlpack.DLPackCopyWarning)
    ...   dlpack.to_jax(torch.arange(6.0)[::2], allow_copy=True)
    Traceback (most recent call last):
      ...
    torch_bridge.dlpack.DLPackCopyWarning: copied a torch.float32(3,) tensor to JAX: ...
  """


def _jax_pointer(x: jax.Array) -> int:
  return x.unsafe_buffer_pointer()


def shares_memory(x: jax.Array, t: torch.Tensor) -> bool:
  """Whether the JAX array and the torch tensor start at the same address.

  Compares the data pointers only (not the extents): the check that
  ``to_jax`` and ``to_torch`` use to tell a shared buffer from a copy.

  Example:
    >>> import jax.numpy as jnp, torch
    >>> from torch_bridge import dlpack
    >>> x = jnp.arange(4.0)
    >>> dlpack.shares_memory(x, dlpack.to_torch(x)), dlpack.shares_memory(x, torch.arange(4.0))
    (True, False)
  """
  return _jax_pointer(x) == t.data_ptr()


def to_jax(t: torch.Tensor, allow_copy: bool = False) -> jax.Array:
  """The JAX array sharing ``t``'s buffer (``t`` detached first).

  Raises ``CopyRequired`` when sharing is impossible, unless ``allow_copy``,
  which copies (a contiguous clone) and warns.

  Args:
    t: a torch tensor (detached first).
    allow_copy: copy (and warn with ``DLPackCopyWarning``) instead of raising.

  Returns:
    A ``jax.Array`` over ``t``'s buffer, or over a copy with ``allow_copy``.

  Example:
    >>> import torch
    >>> from torch_bridge import dlpack
    >>> t = torch.arange(4.0)
    >>> x = dlpack.to_jax(t)
    >>> x.tolist(), dlpack.shares_memory(x, t)  # no copy
    ([0.0, 1.0, 2.0, 3.0], True)
    >>> dlpack.to_jax(t[::2])  # a strided view cannot be shared
    Traceback (most recent call last):
      ...
    torch_bridge.dlpack.CopyRequired: a torch.float32(2,) tensor with strides (2,) ...
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
  """The torch tensor sharing ``x``'s buffer (read-only by contract).

  JAX memory is immutable: clone the tensor before writing to it. Raises
  ``CopyRequired`` if torch would copy, unless ``allow_copy`` (then it warns
  with ``DLPackCopyWarning``).

  Example:
    >>> import jax.numpy as jnp
    >>> from torch_bridge import dlpack
    >>> x = jnp.arange(4.0)
    >>> t = dlpack.to_torch(x)
    >>> t, dlpack.shares_memory(x, t)  # the same buffer, no copy
    (tensor([0., 1., 2., 3.]), True)
    >>> t = t.clone().add_(1)  # a copy of its own to write to
  """
  x = jax.numpy.asarray(x)
  t = torch.from_dlpack(x)
  if x.size and not shares_memory(x, t):
    if not allow_copy:
      raise CopyRequired(
          f"torch copied a {x.dtype}{x.shape} JAX array; pass allow_copy=True to accept it.")
    warnings.warn(f"copied a {x.dtype}{x.shape} JAX array to torch", DLPackCopyWarning,
                  stacklevel=2)
  return t
