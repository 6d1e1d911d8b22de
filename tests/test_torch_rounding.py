"""torch_bridge.rounding reproduces optax_half.rounding bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from optax_half import rounding as jr  # noqa: E402
from torch_bridge import rounding as tr  # noqa: E402
from conftest import bitwise_equal  # noqa: E402


@pytest.mark.parametrize("seed, step, stream, leaf", [
    (0, 0, 0, 0), (12345, 7, 1, 3), (2**32 - 1, 2**31 - 1, 2, 999), (7, 100_000, 0, 1),
])
def test_random_bits_match(seed, step, stream, leaf):
  shape = (33, 65)
  j = np.asarray(jr.random_bits(seed, step, stream, leaf, shape))
  t = tr.random_bits(seed, step, stream, leaf, shape)
  assert t.dtype == torch.int32
  assert np.array_equal(j, t.numpy().view(np.uint32))


def _values(rng, n=200_000):
  mag = 10.0 ** rng.uniform(-30, 30, n)
  x = (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)
  return np.concatenate([x, np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-45,
                                      np.finfo(np.float32).max], np.float32)])


def test_split_join_match(rng):
  x = _values(rng)
  jhi, jlo = jr.split_f32(jnp.asarray(x))
  thi, tlo = tr.split_f32(torch.from_numpy(x))
  assert np.array_equal(np.asarray(jhi).view(np.uint16), thi.view(torch.int16).numpy().view(np.uint16))
  assert np.array_equal(np.asarray(jlo), tlo.numpy())
  finite = ~np.isnan(x)
  assert bitwise_equal(tr.join_f32(thi, tlo).numpy()[finite], x[finite])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_round_matches(dtype, rng):
  x = np.concatenate([_values(rng, 50_000), rng.uniform(-3, 3, 50_000).astype(np.float32)])
  bits = jr.random_bits(11, 3, 0, 5, x.shape)
  j = jr.stochastic_round(jnp.asarray(x), getattr(jnp, dtype), bits)
  t = tr.stochastic_round(torch.from_numpy(x), getattr(torch, dtype),
                          torch.from_numpy(np.array(bits).view(np.int32)))
  jv = np.asarray(j).view(np.uint16)
  tv = t.view(torch.int16).numpy().view(np.uint16)
  nan = np.isnan(x)
  assert np.array_equal(jv[~nan], tv[~nan])
  assert np.isnan(t.float().numpy()[nan]).all()
