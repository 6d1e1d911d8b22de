"""torch_bridge.rounding reproduces optax_half.rounding bit for bit."""

import jax
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


def test_leaf_keys_are_leaf_key_for_many_leaves_at_once():
  """The vectorized keys (the batched wrappers' bits) equal ``leaf_key`` one by
  one, over seeds, step counts and leaves past 32 bits, mixed step counts."""
  rng = np.random.default_rng(0)
  for seed in (0, 12345, 2**32 - 1, 2**40 + 3):
    steps = np.concatenate([rng.integers(0, 2**34, 40), [0, 0, 2**31 - 1, 2**32]])
    leaves = np.concatenate([rng.integers(0, 2**34, 40), [0, 1, 2**32 - 1, 2**32]])
    for stream in (tr.STREAM_PARAMS, tr.STREAM_MOMENTS):
      keys = tr.leaf_keys(seed, steps, stream, leaves)
      assert keys.dtype == np.int32
      assert keys.view(np.uint32).tolist() == [
          tr.leaf_key(seed, int(t), stream, int(leaf)) for t, leaf in zip(steps, leaves)]


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


@pytest.mark.parametrize("m_dtype, v_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                              ("bfloat16", "float32"), ("float32", "float16")])
def test_round_moments_matches(m_dtype, v_dtype, rng):
  m = np.concatenate([_values(rng, 20_000), rng.uniform(-3, 3, 20_000).astype(np.float32)])
  v = np.abs(m[::-1]).copy()
  seed, step, leaf = 77, 12, 3
  jm, jv = jr.round_moments(jnp.asarray(m), jnp.asarray(v), getattr(jnp, m_dtype),
                            getattr(jnp, v_dtype), "stochastic", seed, step, leaf)
  key = tr.key_tensor(seed, step, tr.STREAM_MOMENTS, leaf)
  tm, tv = tr.round_moments(torch.from_numpy(m), torch.from_numpy(v), getattr(torch, m_dtype),
                            getattr(torch, v_dtype), "stochastic", key)
  for x, j, t in ((m, jm, tm), (v, jv, tv)):
    keep = ~np.isnan(x)
    assert bitwise_equal(np.asarray(j.astype(jnp.float32))[keep], t.float().numpy()[keep])


@pytest.mark.parametrize("b", [0.0, 0.3, 0.5, 0.9, 0.95, 0.98, 0.99, 0.999, 0.9999])
def test_one_minus_pow_is_accurate_and_the_same_in_both(b):
  b32 = np.float32(b)
  rng = np.random.default_rng(1)
  ns = np.concatenate([np.arange(0, 600), rng.integers(600, 2**31 - 1, 400),
                       [2**31 - 1]]).astype(np.int32)
  f = jax.jit(jax.vmap(lambda n: jr.one_minus_pow(b32, n, jr.opaque_zero(n))))
  ours = np.asarray(f(ns))
  theirs = np.array([tr.one_minus_pow(float(b32), int(n)) for n in ns], np.float32)
  assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
  exact = (-np.expm1(ns * np.log(np.float64(b32))) if b > 0 else (ns > 0).astype(np.float64))
  ulps = np.abs(ours - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
  assert ulps.max() <= 3.0, ulps.max()  # measured: 2.52 at most
  assert ours[0] == 0 and ours[1] == np.float32(1) - b32


def test_one_minus_pow_rejects_bad_exponents():
  with pytest.raises(ValueError, match="0 <= n"):
    tr.one_minus_pow(0.9, -1)


def test_one_minus_pow_with_a_traced_b():
  """b as a run-time value (e.g. optax.inject_hyperparams): still torch's bits."""
  f = jax.jit(lambda b, n: jr.one_minus_pow(b, n, jr.opaque_zero(n)))
  for b in (0.9, 0.98, 0.999, 0.9999):
    for n in (1, 2, 3, 10, 977, 12345, 2**31 - 1):
      ours = np.float32(f(jnp.float32(b), jnp.int32(n)))
      assert ours == np.float32(tr.one_minus_pow(float(np.float32(b)), n)), (b, n)


def test_mix32_compiled_equals_python_integers():
  """Compiled, mix32 multiplies without int32 overflow (undefined in
  Inductor's C++) and gives the words of the integer reference, as eagerly."""
  gen = torch.Generator().manual_seed(0)
  edges = [0, 1, -1, 2**31 - 1, -2**31, 0xFFFF, 0x10000, -0x10000, 0x8000, -0x8000]
  x = torch.cat([torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=gen),
                 torch.tensor(edges, dtype=torch.int32)])
  want = torch.tensor([tr._signed32(tr._mix32_int(v & 0xFFFFFFFF)) for v in x.tolist()],
                      dtype=torch.int32)
  compiled = torch.compile(tr.mix32, dynamic=True, options={"emulate_precision_casts": True})
  assert torch.equal(tr.mix32(x), want)
  assert torch.equal(compiled(x), want)
  assert torch.equal(tr.swap_halves(x), (x << 16) | ((x >> 16) & 0xFFFF))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_stochastic_round_refuses_fp8_with_one_message(dtype):
  x = np.linspace(-2, 2, 64, dtype=np.float32)
  bits = jr.random_bits(0, 0, 0, 0, x.shape)
  with pytest.raises(ValueError) as j:
    jr.stochastic_round(jnp.asarray(x), getattr(jnp, dtype), bits)
  with pytest.raises(ValueError) as t:
    tr.stochastic_round(torch.from_numpy(x), getattr(torch, dtype),
                        torch.from_numpy(np.array(bits).view(np.int32)))
  assert str(j.value) == str(t.value) == (
      f"stochastic rounding rounds to bfloat16 or float16; got {dtype}.")
