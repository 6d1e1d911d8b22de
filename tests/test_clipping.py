"""optax_half.clip_by_global_norm gives optax.clip_by_global_norm's bits,
without the fp32 temporary XLA:CPU writes for optax's on 16-bit gradients."""

import fractions

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import bitwise_equal, random_tree
from suite_helpers import default_or_slow

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


# Global norms ~0.05, 5, 500 (scale) against three max_norms, each dtype:
# make test runs each (scale, max_norm) pair once (a Latin square over the
# dtypes), make test-slow every combination.
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_SCALES, _MAX_NORMS = (1e-4, 1e-2, 1.0), (1.0, 0.25, 3.0)


@pytest.mark.parametrize("max_norm, scale, dtype", default_or_slow(
    [(m, s, d) for m in _MAX_NORMS for s in _SCALES for d in _DTYPES],
    default=[(m, s, _DTYPES[(i + j) % 3]) for i, m in enumerate(_MAX_NORMS)
             for j, s in enumerate(_SCALES)]))
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


# The optimizers whose in-place step clips the gradients as the kernel reads
# them (optax_half.chain of clip_by_global_norm and one of these).
FOLDED = {
    "kahan": lambda: oh.adamw_bf16(1e-2),
    "stochastic": lambda: oh.adamw_bf16(1e-2, compensation="stochastic"),
    "split": lambda: oh.adamw_bf16(1e-2, compensation="split"),
    "none": lambda: oh.adamw_bf16(1e-2, compensation="none"),
    "master": lambda: oh.adam_fp32_master(1e-2),
    "kahan flat_state": lambda: oh.adamw_bf16(1e-2, flat_state=True),
}


def _mixed_tree(scale, seed, f16=False):
  """bf16 leaves and an fp32 leaf (and with ``f16`` an fp16 leaf)."""
  out = {**_tree(jnp.bfloat16, scale, seed), "f32": _tree(jnp.float32, scale, seed + 2)["w1"]}
  if f16:
    out["f16"] = _tree(jnp.float16, scale, seed + 1)["b"]
  return out


def _steps_as_optax_chain(max_norm, make, params, grads_list, expect_fold=True, jit=True):
  """Steps ``oh.chain(clip, make())`` in place and ``optax.chain`` of the same
  (optax's clip, then ``make()``'s own in-place step: ``tx.update`` +
  ``optax.apply_updates`` but for a master, which lands on its rounding) over
  ``grads_list``, both jitted or both op by op; asserts the same bits in every
  param and state array after each step."""
  ours = oh.chain(oh.clip_by_global_norm(max_norm), make())
  clip, inner = optax.clip_by_global_norm(max_norm), make()
  ref = optax.chain(clip, inner)
  maybe_jit = jax.jit if jit else (lambda f: f)
  in_place = maybe_jit(lambda p, s, g: oh.update_and_apply(ours, g, s, p))

  @maybe_jit
  def step_ref(p, s, g):
    g, clip_state = clip.update(g, s[0], p)
    p, inner_state = oh.update_and_apply(inner, g, s[1], p)
    return p, (clip_state, inner_state)

  if jit and expect_fold and jax.default_backend() == "cpu" and jax_native.available():
    # The clip is the kernel's: no clipped copy of the gradients (2 or 4
    # bytes each); fp32 leaves take their kernel's update (4 bytes each),
    # and the scalars a few hundred bytes.
    compiled = jax.jit(lambda p, s, g: oh.update_and_apply(ours, g, s, p),
                       donate_argnums=(0, 1, 2)).lower(params, ours.init(params),
                                                       grads_list[0]).compile()
    sizes = [(x.size, x.dtype.itemsize) for x in jax.tree.leaves(params)]
    n16 = sum(n for n, b in sizes if b == 2)
    n32 = sum(n for n, b in sizes if b == 4)
    # A master's mark: its check's hashes, one 16-bit leaf of uint32 (docs/algorithms.md#memory).
    mark = 4 * max((n for n, b in sizes if b == 2), default=0) if isinstance(
        jax.eval_shape(ours.init, params)[1], oh.MasterWeightsState) else 0
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * n32 + n16 + mark + 1024
  p1, s1, p2, s2 = params, ours.init(params), params, ref.init(params)
  for grads in grads_list:
    p1, s1 = in_place(p1, s1, grads)
    p2, s2 = step_ref(p2, s2, grads)
    _assert_same_bits((p1, s1), (p2, s2))
  return p1


@pytest.mark.parametrize("make,max_norm", default_or_slow(
    # clipped (0.5, 1.0: the read without the product), kept (1e4)
    [(make, max_norm) for max_norm in (0.5, 1.0, 1e4) for make in FOLDED],
    default=[("kahan", 0.5), ("master", 0.5), ("kahan flat_state", 0.5), ("kahan", 1.0),
             ("kahan", 1e4)]))
def test_folded_clip_equals_optax_chain(make, max_norm):
  """bf16 and fp32 gradients (the kernel's clip in each type; a flat state
  takes one dtype, bf16), both branches of the clip, three steps; max_norm 1,
  whose product the kernel leaves out for bf16 gradients (kClipFiniteUnit)."""
  tree = (lambda scale, seed: _tree(jnp.bfloat16, scale, seed)) if "flat" in make else _mixed_tree
  params = jax.tree.map(lambda x: x + 1, tree(1.0, seed=3))
  grads = [tree(1e-2 * (k + 1), seed=10 + k) for k in range(3)]
  _steps_as_optax_chain(max_norm, FOLDED[make], params, grads)


def test_op_by_op_clip_is_not_folded():
  """Op by op, XLA divides fp32 gradients by the norm through its reciprocal
  (bits the jitted clip does not give): the in-place step then clips first,
  as optax.chain does, and gives its bits."""
  params = jax.tree.map(lambda x: x + 1, _mixed_tree(1.0, seed=3))
  _steps_as_optax_chain(0.5, FOLDED["kahan"], params, [_mixed_tree(1e-2, seed=5)], jit=False)


def test_in_place_chain_equals_optax_chain():
  params = jax.tree.map(lambda x: x + 1, _tree(jnp.bfloat16, 1.0, seed=3))
  grads = _tree(jnp.bfloat16, 1e-2)
  ours = oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
  if jax.default_backend() == "cpu" and jax_native.available():  # the kernel steps in place
    hlo = jax.jit(lambda p, s, g: oh.update_and_apply(ours, g, s, p)).lower(
        params, ours.init(params), grads).as_text()
    assert hlo.count(jax_native.TARGET) == 1
  _steps_as_optax_chain(1.0, lambda: oh.adamw_bf16(1e-3), params, [grads] * 3)


@pytest.mark.parametrize("dtype,max_norm", default_or_slow(
    [(dtype, m) for dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
     for m in ("0.3", "0.3 in the dtype", "1/3", "1")],
    default=[(jnp.bfloat16, "0.3 in the dtype"), (jnp.bfloat16, "1"), (jnp.float32, "1/3")]))
def test_folded_clip_edge_values_equal_optax_chain(dtype, max_norm):
  """Quotients that flush to zero (a gradient far below the norm), one that
  lands on the smallest normal fp32 (2^-126: g = norm * 2^-126), zeros of
  both signs, a max_norm that rounds in the gradients' type and max_norm 1
  (the kernel's read without the product for bf16 gradients). (fp16
  gradients: clipped before the kernel, not by it; the same bits.)"""
  params = {"w": jnp.linspace(-1, 1, 4096).astype(dtype)}
  g = np.array(jax.random.normal(jax.random.key(0), (4096,)), np.float32)
  g[:8] = [1e-38, -1e-38, 2e-38, 0.0, -0.0, 3e-39, 1.5e-37, 6e-8]
  grads = {"w": jnp.asarray(g).astype(dtype)}
  norm = float(np.asarray(optax.tree.norm(grads)).astype(np.float32))
  exact = np.float32(np.asarray(jnp.asarray(norm, dtype).astype(jnp.float32))) * np.float32(2**-126)
  grads["w"] = grads["w"].at[8].set(jnp.asarray(exact, jnp.float32).astype(dtype))
  max_norm = {"0.3": 0.3, "0.3 in the dtype": jnp.asarray(0.3, dtype), "1/3": 1 / 3,
              "1": 1.0}[max_norm]
  _steps_as_optax_chain(max_norm, lambda: oh.adamw_bf16(1e-2), params, [grads] * 2,
                        expect_fold=dtype != jnp.float16)


def test_folded_clip_divides_bf16_gradients_as_xla_does():
  """XLA:CPU divides bf16 gradients by the norm as a product with the norm's
  fp32 reciprocal r = fl(1 / n). That product differs from a true division
  where the quotient is exactly 2^-126 and r lies below 1 / n: g * r falls
  under 2^-126 and flushes to zero. A bf16 gradient n * 2^-126 over such a
  bf16 norm n: the kernel's clip gives XLA's bits. With b1 = 0 the first
  moment is the clipped gradient itself, so that element shows in the state."""
  n = 1.90625  # a bf16 value
  r = np.float32(1) / np.float32(n)
  below = 1 - fractions.Fraction(n) * fractions.Fraction(float(r))
  assert below > fractions.Fraction(1, 2**25)  # g * r rounds below 2^-126
  g = np.zeros(4096, np.float32)
  g[5], g[9] = n, n * 2.0**-126
  grads = {"w": jnp.asarray(g).astype(jnp.bfloat16)}
  assert float(optax.tree.norm(grads)) == n
  params = {"w": jnp.linspace(-1, 1, 4096).astype(jnp.bfloat16)}
  _steps_as_optax_chain(1.0, lambda: oh.adamw_bf16(1e-2, b1=0.0), params, [grads] * 2)


@pytest.mark.parametrize("bad,leaf", default_or_slow(
    [(bad, leaf) for bad in ("nan", "inf") for leaf in ("b", "f32")],
    default=[("nan", "b"), ("inf", "f32")]))
def test_folded_clip_nonfinite_gradients_equal_optax_chain(bad, leaf):
  """A NaN or an Inf gradient makes the norm NaN or Inf: the kernel's clip
  then gives optax's NaN and zero results (the clip's exact read, not the
  finite one)."""
  params = jax.tree.map(lambda x: x + 1, _mixed_tree(1.0, seed=3))
  grads = _mixed_tree(1e-2, seed=5)
  grads[leaf] = grads[leaf].at[3].set(float(bad))
  _steps_as_optax_chain(1.0, FOLDED["kahan"], params, [grads])


def test_fp16_gradients_are_clipped_before_the_kernel():
  """A tree with an fp16 gradient is not clipped by the kernel (XLA may
  compute the fp16 division through a rounded reciprocal): the same bits as
  optax.chain, from the clip's own ops."""
  params = jax.tree.map(lambda x: x + 1, _mixed_tree(1.0, seed=3, f16=True))
  grads = [_mixed_tree(1e-2 * (k + 1), seed=10 + k, f16=True) for k in range(2)]
  _steps_as_optax_chain(0.5, FOLDED["kahan"], params, grads, expect_fold=False)


def test_skip_nonfinite_after_the_clip_is_not_folded():
  """adam_fp32_master(skip_nonfinite=True) checks the clipped gradients, so
  the clip runs first (the same bits, a clipped copy of the gradients)."""
  params = jax.tree.map(lambda x: x + 1, _tree(jnp.bfloat16, 1.0, seed=3))
  grads = [_tree(jnp.bfloat16, 1e-2, seed=4), jax.tree.map(lambda x: x * np.inf,
                                                           _tree(jnp.bfloat16, 1e-2, seed=5))]
  _steps_as_optax_chain(1.0, lambda: oh.adam_fp32_master(1e-2, skip_nonfinite=True), params,
                        grads, expect_fold=False)


def test_promoting_max_norm_is_not_folded():
  """An fp32 array max_norm beside bf16 gradients: optax's select rejects
  the promoted product; so does the in-place step, which leaves it to the clip."""
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  tx = oh.chain(oh.clip_by_global_norm(jnp.float32(1.0)), oh.adamw_bf16(1e-3))
  with pytest.raises(TypeError):
    jax.jit(lambda p, s, g: oh.update_and_apply(tx, g, s, p))(
        params, tx.init(params), {"w": jnp.full(8, 3.0, jnp.bfloat16)})
