"""optax_half.clip_by_global_norm gives optax.clip_by_global_norm's bits,
without the fp32 temporary XLA:CPU writes for optax's on 16-bit gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh

SHAPES = {"w0": (256, 512), "w1": (512, 128), "b": (512,), "s": ()}


def _tree(dtype, scale, seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray((rng.standard_normal(s) * scale).astype(np.float32)).astype(dtype)
          for k, s in SHAPES.items()}


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _clipped(tx, grads, jit=True):
  fn = lambda g: tx.update(g, tx.init(g))[0]  # noqa: E731
  return (jax.jit(fn) if jit else fn)(grads)


def _assert_same_bits(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]), err_msg=k)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("scale", [1e-4, 1e-2, 1.0])  # global norms ~0.05, 5, 500
@pytest.mark.parametrize("max_norm", [1.0, 0.25, 3.0])
def test_bits_equal_optax(dtype, scale, max_norm):
  grads = _tree(dtype, scale)
  want = _clipped(optax.clip_by_global_norm(max_norm), grads)
  got = _clipped(oh.clip_by_global_norm(max_norm), grads)
  _assert_same_bits(got, want)
  norm = float(optax.tree.norm(grads))
  changed = any(not np.array_equal(_bits(got[k]), _bits(grads[k])) for k in grads)
  assert changed == (norm >= float(max_norm))  # both branches are exercised


def test_array_max_norm_as_optax():  # a float32 array: fp32 gradients (optax's select
  grads = _tree(jnp.float32, 1e-2)     # rejects it beside 16-bit ones, and so does this)
  for max_norm in (jnp.float32(1.0), jnp.float32(100.0)):
    _assert_same_bits(_clipped(oh.clip_by_global_norm(max_norm), grads),
                      _clipped(optax.clip_by_global_norm(max_norm), grads))
  with pytest.raises(TypeError):
    _clipped(oh.clip_by_global_norm(jnp.float32(1.0)), _tree(jnp.bfloat16, 1.0))


def test_bits_equal_optax_mixed_dtypes_and_eager():
  grads = {**_tree(jnp.bfloat16, 1e-2), "f32": _tree(jnp.float32, 1e-2, seed=1)["w1"],
           "f16": _tree(jnp.float16, 1e-2, seed=2)["b"]}
  for jit in (True, False):
    _assert_same_bits(_clipped(oh.clip_by_global_norm(1.0), grads, jit),
                      _clipped(optax.clip_by_global_norm(1.0), grads, jit))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradients_as_optax(bad):
  grads = _tree(jnp.bfloat16, 1e-2)
  grads["b"] = grads["b"].at[3].set(bad)
  got = _clipped(oh.clip_by_global_norm(1.0), grads)
  _assert_same_bits(got, _clipped(optax.clip_by_global_norm(1.0), grads))
  assert not np.isfinite(np.asarray(got["b"], np.float32)).all()


def test_empty_tree_and_state():
  tx = oh.clip_by_global_norm(1.0)
  assert tx.init({}) == optax.EmptyState()
  assert tx.update({}, optax.EmptyState()) == ({}, optax.EmptyState())


def test_max_norm_must_be_a_scalar():
  with pytest.raises(ValueError, match="max_norm must be a scalar"):
    _clipped(oh.clip_by_global_norm(jnp.ones(2)), _tree(jnp.bfloat16, 1.0))


def test_gradient_through_the_clip_equals_optax():
  grads = _tree(jnp.float32, 1e-2)
  def loss(tx):
    return lambda g: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tx.update(g, None)[0]))
  _assert_same_bits(jax.grad(loss(oh.clip_by_global_norm(1.0)))(grads),
                    jax.grad(loss(optax.clip_by_global_norm(1.0)))(grads))


def test_no_fp32_temporary_for_bf16_gradients():
  grads = _tree(jnp.bfloat16, 1.0)
  n = sum(x.size for x in jax.tree.leaves(grads))

  def temp_bytes(tx):
    fn = jax.jit(lambda g: tx.update(g, optax.EmptyState())[0], donate_argnums=0)
    return fn.lower(grads).compile().memory_analysis().temp_size_in_bytes

  if temp_bytes(optax.clip_by_global_norm(1.0)) < 4 * n:
    pytest.skip("this XLA writes no fp32 copy for optax's clipping either")
  assert temp_bytes(oh.clip_by_global_norm(1.0)) < n  # no widened copy (4 B/param)


def test_in_place_chain_equals_optax_chain():
  params = jax.tree.map(lambda x: x + 1, _tree(jnp.bfloat16, 1.0, seed=3))
  grads = _tree(jnp.bfloat16, 1e-2)
  ours = oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
  ref = optax.chain(optax.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))

  @jax.jit
  def step_ours(p, s, g):
    return oh.update_and_apply(ours, g, s, p)

  @jax.jit
  def step_ref(p, s, g):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  p1, s1, p2, s2 = params, ours.init(params), params, ref.init(params)
  for _ in range(3):
    p1, s1 = step_ours(p1, s1, grads)
    p2, s2 = step_ref(p2, s2, grads)
  _assert_same_bits(p1, p2)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(_bits(a), _bits(b))
