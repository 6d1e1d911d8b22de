"""optax_half.clip_by_global_norm gives optax.clip_by_global_norm's bits,
without the fp32 temporary XLA:CPU writes for optax's on 16-bit gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import bitwise_equal, random_tree

import optax_half as oh
from optax_half import _native as jax_native

SHAPES = {"w0": (256, 512), "w1": (512, 128), "b": (512,), "s": ()}


def _tree(dtype, scale, seed=0):
  return jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(dtype),
                      random_tree(seed, SHAPES, jnp.float32))


def _clipped(tx, grads, jit=True):
  fn = lambda g: tx.update(g, tx.init(g))[0]  # noqa: E731
  return (jax.jit(fn) if jit else fn)(grads)


def _assert_same_bits(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for path, a, b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                        jax.tree.leaves(want)):
    assert bitwise_equal(a, b), path[0]


def _assert_clips_as_optax(max_norm, grads, jit=True):
  got = _clipped(oh.clip_by_global_norm(max_norm), grads, jit)
  _assert_same_bits(got, _clipped(optax.clip_by_global_norm(max_norm), grads, jit))
  return got


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("scale", [1e-4, 1e-2, 1.0])  # global norms ~0.05, 5, 500
@pytest.mark.parametrize("max_norm", [1.0, 0.25, 3.0])
def test_bits_equal_optax(dtype, scale, max_norm):
  grads = _tree(dtype, scale)
  got = _assert_clips_as_optax(max_norm, grads)
  norm = float(optax.tree.norm(grads))
  changed = any(not bitwise_equal(got[k], grads[k]) for k in grads)
  assert changed == (norm >= max_norm)  # both branches are exercised


def test_fp16_norm_beyond_fp16_range_as_optax():
  """Squares of fp16 elements above 256 exceed fp16's range (65504)."""
  grads = _tree(jnp.float16, 300.0)
  assert np.abs(np.asarray(grads["w0"], np.float32)).max() > 256
  _assert_clips_as_optax(1.0, grads)


def test_norm_equal_to_max_norm_as_optax():
  grads = {"a": jnp.array([3.0, 4.0], jnp.float32), "b": jnp.array([0.0], jnp.bfloat16)}
  assert float(optax.tree.norm(grads)) == 5.0
  _assert_clips_as_optax(5.0, grads)  # not below max_norm: the scaling branch


def test_array_max_norm_as_optax():
  """A float32 array max_norm: fp32 gradients; beside 16-bit ones optax's
  select rejects the promoted product, and so does this one."""
  grads = _tree(jnp.float32, 1e-2)
  for max_norm in (jnp.float32(1.0), jnp.float32(100.0)):
    _assert_clips_as_optax(max_norm, grads)
  for tx in (oh.clip_by_global_norm, optax.clip_by_global_norm):
    with pytest.raises(TypeError):
      _clipped(tx(jnp.float32(1.0)), _tree(jnp.bfloat16, 1.0))


def test_bits_equal_optax_mixed_dtypes_and_op_by_op():
  grads = {**_tree(jnp.bfloat16, 1e-2), "f32": _tree(jnp.float32, 1e-2, seed=1)["w1"],
           "f16": _tree(jnp.float16, 1e-2, seed=2)["b"]}
  for jit in (True, False):
    _assert_clips_as_optax(1.0, grads, jit)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradients_as_optax(bad):
  grads = _tree(jnp.bfloat16, 1e-2)
  grads["b"] = grads["b"].at[3].set(bad)
  got = _assert_clips_as_optax(1.0, grads)
  assert not np.isfinite(np.asarray(got["b"], np.float32)).all()


def test_empty_tree_and_state():
  tx = oh.clip_by_global_norm(1.0)
  assert tx.init({}) == optax.EmptyState()
  assert tx.update({}, optax.EmptyState()) == ({}, optax.EmptyState())
  assert jax.jit(tx.update)({}, optax.EmptyState()) == ({}, optax.EmptyState())


def test_max_norm_must_be_a_scalar():
  for tx in (oh.clip_by_global_norm, optax.clip_by_global_norm):
    with pytest.raises(ValueError):
      _clipped(tx(jnp.ones(2)), _tree(jnp.bfloat16, 1.0))
  with pytest.raises(ValueError, match="max_norm must be a scalar"):
    _clipped(oh.clip_by_global_norm(jnp.ones(2)), _tree(jnp.bfloat16, 1.0))


@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # clipped, not clipped
def test_gradient_through_the_clip_equals_optax(max_norm):
  for dtype in (jnp.float32, jnp.bfloat16):
    grads = _tree(dtype, 1e-2)

    def loss(tx):
      return lambda g: sum(jnp.sum(x.astype(jnp.float32) ** 2)
                           for x in jax.tree.leaves(tx.update(g, None)[0]))

    _assert_same_bits(jax.jit(jax.grad(loss(oh.clip_by_global_norm(max_norm))))(grads),
                      jax.jit(jax.grad(loss(optax.clip_by_global_norm(max_norm))))(grads))


def test_vmap_over_a_batch_of_trees_equals_optax():
  grads = jax.tree.map(lambda x: jnp.stack([x, 10 * x]), _tree(jnp.bfloat16, 1e-2))

  def clip(tx):
    return jax.jit(jax.vmap(lambda g: tx.update(g, optax.EmptyState())[0]))(grads)

  _assert_same_bits(clip(oh.clip_by_global_norm(1.0)), clip(optax.clip_by_global_norm(1.0)))


def _temp_bytes(tx, grads):
  fn = jax.jit(lambda g: tx.update(g, optax.EmptyState())[0], donate_argnums=0)
  return fn.lower(grads).compile().memory_analysis().temp_size_in_bytes


def test_no_fp32_temporary_for_bf16_gradients():
  grads = _tree(jnp.bfloat16, 1.0)
  n = sum(x.size for x in jax.tree.leaves(grads))
  if _temp_bytes(optax.clip_by_global_norm(1.0), grads) < 4 * n:
    pytest.skip("this XLA writes no fp32 copy for optax's clipping either")
  assert _temp_bytes(oh.clip_by_global_norm(1.0), grads) < n  # no widened copy (4 B/param)


def test_fp32_gradients_lower_to_optax_ops_alone():
  grads = _tree(jnp.float32, 1.0)
  text = jax.jit(oh.clip_by_global_norm(1.0).update).lower(grads, optax.EmptyState()).as_text()
  assert "optimization_barrier" not in text


def test_in_place_chain_equals_optax_chain():
  params = jax.tree.map(lambda x: x + 1, _tree(jnp.bfloat16, 1.0, seed=3))
  grads = _tree(jnp.bfloat16, 1e-2)
  ours = oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
  ref = optax.chain(optax.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
  in_place = jax.jit(lambda p, s, g: oh.update_and_apply(ours, g, s, p))

  @jax.jit
  def step_ref(p, s, g):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  if jax.default_backend() == "cpu" and jax_native.available():  # the kernel steps in place
    hlo = in_place.lower(params, ours.init(params), grads).as_text()
    assert hlo.count(jax_native.TARGET) == 1
  p1, s1, p2, s2 = params, ours.init(params), params, ref.init(params)
  for _ in range(3):
    p1, s1 = in_place(p1, s1, grads)
    p2, s2 = step_ref(p2, s2, grads)
  _assert_same_bits((p1, s1), (p2, s2))
