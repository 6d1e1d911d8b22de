"""torch_bridge.dlpack: JAX <-> torch without copies, and copies never silent."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge import dlpack  # noqa: E402

DTYPES = [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]


@pytest.mark.parametrize("jname, tdtype", DTYPES)
def test_zero_copy_both_ways(jname, tdtype):
  x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6).astype(jname)
  t = dlpack.to_torch(x)
  assert t.dtype == tdtype and tuple(t.shape) == x.shape
  assert t.data_ptr() == x.unsafe_buffer_pointer()
  assert np.array_equal(t.float().numpy(), np.asarray(x, np.float32))

  src = (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7).to(tdtype)
  y = dlpack.to_jax(src)
  assert y.dtype == jnp.dtype(jname) and y.unsafe_buffer_pointer() == src.data_ptr()
  assert np.array_equal(np.asarray(y, np.float32), src.float().numpy())
  back = dlpack.to_torch(y)
  assert back.data_ptr() == src.data_ptr()  # a round trip is still the same buffer


def test_transposed_tensors_are_shared_too():
  src = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
  y = dlpack.to_jax(src)
  assert y.unsafe_buffer_pointer() == src.data_ptr()
  assert np.array_equal(np.asarray(y), src.numpy())


def test_a_copy_is_an_error_or_a_warning_never_silent():
  base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
  strided = base[:, ::2]
  with pytest.raises(dlpack.CopyRequired, match=r"strides \(6, 2\).*allow_copy=True"):
    dlpack.to_jax(strided)
  with pytest.warns(dlpack.DLPackCopyWarning, match="copied"):
    y = dlpack.to_jax(strided, allow_copy=True)
  assert np.array_equal(np.asarray(y), strided.numpy())
  assert y.unsafe_buffer_pointer() != strided.data_ptr()


def test_requires_grad_tensors_are_detached():
  p = torch.ones(3, requires_grad=True)
  assert dlpack.to_jax(p).unsafe_buffer_pointer() == p.data_ptr()


def test_misaligned_cpu_buffers_are_reported():
  """XLA wants 64-byte aligned CPU buffers; JAX would copy this one silently."""
  raw = torch.zeros(1024, dtype=torch.uint8)
  offset = (64 - raw.data_ptr() % 64) % 64 + 4  # 4 bytes past a 64-byte boundary
  misaligned = raw[offset:offset + 64].view(torch.float32)
  with pytest.raises(dlpack.CopyRequired, match="not aligned to 64 bytes"):
    dlpack.to_jax(misaligned)


def test_int64_tensor_is_a_copy_and_says_so():
  """Without jax_enable_x64 JAX stores int64 as int32: a new buffer, never silent."""
  t = torch.arange(5, dtype=torch.int64)
  with pytest.raises(dlpack.CopyRequired, match="JAX stores it as int32"):
    dlpack.to_jax(t)
  with pytest.warns(dlpack.DLPackCopyWarning, match="int32"):
    x = dlpack.to_jax(t, allow_copy=True)
  assert np.array_equal(np.asarray(x), np.arange(5))
