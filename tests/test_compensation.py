"""Kahan summation, split master and stochastic rounding cure stale bf16 weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from conftest import bitwise_equal

N_TINY = 10_000


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run_tiny(make_tx, n, delta):
  """n updates of exactly +delta (fp32) to bf16 params of 1.0."""
  params = {"w": jnp.ones((1024,), jnp.bfloat16)}
  tx = make_tx()
  grads = {"w": jnp.full((1024,), delta, jnp.float32)}

  def body(carry, _):
    p, s = carry
    u, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, u), s), None

  (p, s), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=n)
  return p, s


def _identity():
  return optax.scale(1.0)


WRAPPERS = {
    "naive": lambda: oh.round_to_nearest(_identity()),
    "kahan": lambda: oh.kahan_summation(_identity()),
    "split": lambda: oh.master_weights(_identity(), split=True),
    "stochastic": lambda: oh.stochastic_rounding(_identity(), key=0),
    "master": lambda: oh.master_weights(_identity()),
}


@pytest.fixture(scope="module")
def tiny_results():
  return {name: _run_tiny(make, N_TINY, 1e-4) for name, make in WRAPPERS.items()}


def test_naive_bf16_never_moves(tiny_results):
  p, _ = tiny_results["naive"]
  assert np.all(np.asarray(p["w"], np.float32) == 1.0)


def test_kahan_within_3_percent_of_two(tiny_results):
  p, s = tiny_results["kahan"]
  total = np.asarray(p["w"], np.float32) + np.asarray(s.compensation["w"], np.float32)
  assert np.all(np.abs(total - 2.0) <= 0.03 * 2.0), total[:4]
  assert np.all(np.abs(np.asarray(p["w"], np.float32) - 2.0) <= 0.03 * 2.0)


def test_split_master_within_0_05_percent_of_two(tiny_results):
  p, s = tiny_results["split"]
  master = np.asarray(oh.rounding.join_f32(p["w"], s.master["w"]))
  # fp32 accumulation of 1e-4 (fp32) 10,000 times: 2.0002, per REFERENCES.md.
  assert np.all(np.abs(master - 2.0) <= 5e-4 * 2.0), master[:4]


def test_split_master_equals_full_fp32_master(tiny_results):
  p, s = tiny_results["split"]
  pm, sm = tiny_results["master"]
  assert bitwise_equal(oh.rounding.join_f32(p["w"], s.master["w"]), sm.master["w"])


def test_stochastic_rounding_is_right_on_average(tiny_results):
  p, _ = tiny_results["stochastic"]
  w = np.asarray(p["w"], np.float64)
  # Each element is an independent unbiased walk; the mean of 1024 is tight.
  assert abs(w.mean() - 2.0002) < 0.01, w.mean()
  assert w.std() > 0  # elements really are rounded independently


def test_stochastic_rounding_is_deterministic_given_key():
  a, _ = _run_tiny(WRAPPERS["stochastic"], 200, 1e-3)
  b, _ = _run_tiny(WRAPPERS["stochastic"], 200, 1e-3)
  c, _ = _run_tiny(lambda: oh.stochastic_rounding(_identity(), key=1), 200, 1e-3)
  assert bitwise_equal(a["w"], b["w"])
  assert not bitwise_equal(a["w"], c["w"])


def test_stochastic_rounding_accepts_jax_keys():
  tx = oh.stochastic_rounding(_identity(), key=jax.random.key(3))
  assert tx.init({"w": jnp.ones(2, jnp.bfloat16)}).seed.dtype == jnp.uint32
  with pytest.raises(TypeError, match="key must be"):
    oh.stochastic_rounding(_identity(), key="seven")


def _trajectory(make_tx, dtype, steps=1000):
  """Adam on a random tree for `steps` steps; returns (params, state)."""
  key = jax.random.key(11)
  p0 = jax.random.normal(key, (4096,)).astype(jnp.bfloat16).astype(dtype)
  tx = make_tx()

  @jax.jit
  def run(p):
    def body(carry, t):
      p, s = carry
      g = jax.random.normal(jax.random.fold_in(key, t), p.shape)
      u, s = tx.update({"w": g}, s, {"w": p})
      return (optax.apply_updates({"w": p}, u)["w"], s), None
    (p, s), _ = jax.lax.scan(body, (p, tx.init({"w": p})), jnp.arange(steps))
    return p, s

  return run(p0)


def test_kahan_is_10x_closer_to_fp32_than_naive_over_1000_steps():
  adam = lambda: optax.adam(1e-3)
  ref, _ = _trajectory(adam, jnp.float32)
  naive, _ = _trajectory(lambda: oh.round_to_nearest(adam()), jnp.bfloat16)
  kahan, ks = _trajectory(lambda: oh.kahan_summation(adam()), jnp.bfloat16)
  ref = np.asarray(ref, np.float64)
  naive_err = np.abs(np.asarray(naive, np.float64) - ref).max()
  kahan_val = np.asarray(kahan, np.float64) + np.asarray(ks.compensation["w"], np.float64)
  kahan_err = np.abs(kahan_val - ref).max()
  print(f"max |error| vs fp32 after 1000 Adam steps: naive bf16 {naive_err:.3e}, "
        f"kahan {kahan_err:.3e} ({naive_err / kahan_err:.0f}x smaller)")
  assert kahan_err * 10 <= naive_err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["kahan", "split", "stochastic", "none", "master"])
def test_each_compensation_reads_writes_and_inits_the_same_bits_in_both_frameworks(name, dtype):
  """The two registries' rules (optax_half.compensation, torch_bridge.compensation)
  are one rule: per compensation and 16-bit dtype, the buffer a fresh state
  holds, the working value read from (param, buffer) and the (param, buffer)
  written for a new value are the same bits in JAX and torch, over values
  that round either way, ties, fp16 subnormals, large values and signed zeros
  (not fp32 subnormals, which XLA flushes: docs/algorithms.md#landing-exactly)."""
  torch = pytest.importorskip("torch")
  from optax_half.compensation import COMPENSATIONS as jax_rules  # noqa: PLC0415
  from torch_bridge import dlpack  # noqa: PLC0415
  from torch_bridge.compensation import COMPENSATIONS as torch_rules  # noqa: PLC0415

  def as_np(x):
    x = x.detach() if isinstance(x, torch.Tensor) else x
    return np.asarray(dlpack.to_jax(x) if isinstance(x, torch.Tensor) else x)

  jc = jax_rules[name].for_dtype(jnp.dtype(dtype))
  tc = torch_rules[name].for_dtype(getattr(torch, dtype))
  assert jc.name == tc.name
  from optax_half.compensation import MasterBuffer  # noqa: PLC0415
  array = lambda b: b.master if isinstance(b, MasterBuffer) else b  # noqa: E731
  rng = np.random.default_rng(0)
  n = 4096
  x_new = np.concatenate([
      rng.standard_normal(n) * np.exp2(rng.integers(-30, 12, n)),  # many binades
      [0.0, -0.0, 1.0 + 2.0 ** -9, 1.0 + 3 * 2.0 ** -9, 6e-8, -1e-30, 60000.0]],
  ).astype(np.float32)
  p16 = jnp.asarray(x_new).astype(dtype)
  p_torch = dlpack.to_torch(p16, allow_copy=True).clone()
  # A fresh buffer, then one written for x_new: read both ways.
  j_buf = jc.init_buffer(p16, jnp.float32)
  t_buf = tc.init_buffer(p_torch)
  if jc.buffer is None:
    assert t_buf is None
  else:
    np.testing.assert_array_equal(as_np(array(j_buf)).view(np.uint8),
                                  as_np(t_buf).view(np.uint8))
  bits = jnp.asarray(rng.integers(0, 2**32, x_new.shape, dtype=np.uint32))
  t_bits = dlpack.to_torch(bits.view(jnp.int32), allow_copy=True)
  # torch's step is in place: JAX's in-place write (the same as its update's here, where
  # every target is reachable).
  j_u, j_p, j_buf = jc.write(jnp.asarray(x_new), p16, j_buf, bits if jc.draws_bits else None)
  assert j_u.dtype == p16.dtype
  _, j_p_in, j_buf_in = jc.write(jnp.asarray(x_new), p16, jc.init_buffer(p16, jnp.float32),
                                 bits if jc.draws_bits else None, True)
  # (equal values: p + u lands a zero on +0.0, docs/algorithms.md#landing-exactly)
  np.testing.assert_array_equal(as_np(j_p_in).astype(np.float32), as_np(j_p).astype(np.float32))
  np.testing.assert_array_equal(as_np(array(j_buf_in)).view(np.uint8),
                                as_np(array(j_buf)).view(np.uint8))
  j_p, j_buf = j_p_in, j_buf_in
  t_p = p_torch.clone()
  t_buf = None if t_buf is None else t_buf.clone()
  tc.write(torch.from_numpy(x_new), t_p, t_buf, t_bits if tc.draws_bits else None)
  np.testing.assert_array_equal(as_np(j_p).view(np.uint16), as_np(t_p).view(np.uint16))
  if jc.buffer is not None:
    np.testing.assert_array_equal(as_np(array(j_buf)).view(np.uint8), as_np(t_buf).view(np.uint8))
  j_x = jc.read(j_p, j_buf)
  t_x = tc.read(t_p, t_buf)
  np.testing.assert_array_equal(as_np(j_x).view(np.uint32), as_np(t_x).view(np.uint32))
  # The master and the split master keep the value exactly: the read gets it back.
  if jc.name in ("split", "master"):
    np.testing.assert_array_equal(as_np(j_x), x_new)
