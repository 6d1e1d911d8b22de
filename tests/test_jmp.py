"""jmp's API from optax_half: code written for jmp runs after ``import optax_half as jmp``.

Each behaviour jmp's own tests check (policies, loss-scale objects, all_finite, select_tree),
plus the two jmp bugs ours must not have: min_loss_scale lost through jit, fp16 scales.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_half as jmp

HALF = (np.float16, jnp.float16, jnp.bfloat16)
FULL = (np.float32, jnp.float32)
NAMES = {np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16",
         np.dtype(np.float32): "float32"}


def test_the_names_jmp_exports_are_here():
  for name in ("all_finite", "DynamicLossScale", "LossScale", "NoOpLossScale", "select_tree",
               "StaticLossScale", "cast_to_full", "cast_to_half", "get_policy", "half_dtype",
               "Policy"):
    assert hasattr(jmp, name), name
  assert jmp.LossScale.__args__ == (jmp.NoOpLossScale, jmp.StaticLossScale,
                                    jmp.DynamicLossScale)


# ---------------------------------------------------------------------------
# Policies.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF + FULL)
@pytest.mark.parametrize("xnp", [np, jnp])
def test_policy_casts_to_each_of_its_dtypes(dtype, xnp):
  policy = jmp.Policy(dtype, dtype, dtype)
  assert policy.param_dtype == dtype == policy.compute_dtype == policy.output_dtype
  for cast in (policy.cast_to_param, policy.cast_to_compute, policy.cast_to_output):
    out = cast({"a": xnp.ones([])})["a"]
    assert out.dtype == dtype and float(out) == 1.0
  full = jmp.Policy(xnp.float32, xnp.float32, xnp.float32)
  assert full.with_output_dtype(dtype).output_dtype == dtype


@pytest.mark.parametrize("dtype", [np.float16, np.float32, jnp.bfloat16])
def test_get_policy_of_one_dtype_name_sets_all_three(dtype):
  policy = jmp.get_policy(NAMES[np.dtype(dtype)])
  assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype


@pytest.mark.parametrize("dtype", HALF + FULL)
def test_get_policy_params_default_to_full_output_follows_compute(dtype):
  name = NAMES[np.dtype(dtype)]
  policy = jmp.get_policy(f"c={name}")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      jnp.float32, dtype, dtype)
  policy = jmp.get_policy(f"c={name},o=full")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      jnp.float32, dtype, jnp.float32)


def test_get_policy_refuses_a_near_miss_as_jmp_does():
  with pytest.raises(ValueError, match="Unknown dtype"):
    jmp.get_policy("compute_float16")
  with pytest.raises(ValueError, match="Unknown key"):
    jmp.get_policy("q=f16")


def test_half_dtype_and_the_full_and_half_casts():
  half = jmp.half_dtype()
  assert half == (jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)
  marker = object()
  half_tree = {"o": marker, "h": jnp.ones([], half), "f": jnp.ones([]),
               "i": jnp.ones([], jnp.int16)}
  full = jmp.cast_to_full(half_tree)
  assert full["o"] is marker and full["h"].dtype == jnp.float32 == full["f"].dtype
  assert full["i"].dtype == jnp.int16
  back = jmp.cast_to_half(full)
  assert back["h"].dtype == half == back["f"].dtype and back["i"].dtype == jnp.int16
  assert back["o"] is marker


# ---------------------------------------------------------------------------
# Loss-scale objects.
# ---------------------------------------------------------------------------

def test_no_op_loss_scale_returns_its_input():
  loss_scale = jmp.NoOpLossScale()
  tree = {"a": jnp.ones([])}
  assert loss_scale.scale(tree) is tree and loss_scale.unscale(tree) is tree
  assert loss_scale.loss_scale == 1 and loss_scale.adjust(jnp.bool_(False)) is loss_scale
  assert jax.tree.leaves(loss_scale) == []


@pytest.mark.parametrize("cls", [jmp.StaticLossScale, jmp.DynamicLossScale])
@pytest.mark.parametrize("scale", [2, 3, 4, 2.0**15])
def test_scale_and_unscale_values(cls, scale):
  loss_scale = cls(scale)
  assert float(loss_scale.scale({"a": jnp.array(1.0)})["a"]) == scale
  assert float(loss_scale.unscale({"a": jnp.array(1.0 * scale)})["a"]) == pytest.approx(1.0)


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_scale_and_unscale_dtypes(scale_dtype):
  """scale keeps fp32 losses fp32 and lifts fp16 ones (no overflow); unscale gives fp32
  gradients, each exactly g / scale for a power-of-two scale."""
  loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0**12, scale_dtype))
  scaled = loss_scale.scale({"f32": jnp.float32(3.0), "f16": jnp.float16(30.0)})
  assert scaled["f32"].dtype == jnp.float32 == scaled["f16"].dtype
  assert float(scaled["f16"]) == 30.0 * 2**12  # > fp16's max: kept in fp32
  grads = {"f16": jnp.array([2.0**-10, 60000.0], jnp.float16),
           "bf16": jnp.array([3.0, 2.0**100], jnp.bfloat16), "f32": jnp.float32(1.5)}
  out = loss_scale.unscale(grads)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out))
  for k in grads:
    np.testing.assert_array_equal(out[k], np.asarray(grads[k], np.float32) / 2**12)
  assert loss_scale.loss_scale.dtype == scale_dtype


def test_static_loss_scale_is_a_pytree_without_leaves_usable_under_jit():
  loss_scale = jmp.StaticLossScale(jnp.float32(2.0**8))
  assert jax.tree.leaves(loss_scale) == [] and jax.tree.leaves(jmp.StaticLossScale(0)) == []

  @jax.jit
  def step(ls, g):
    return ls, ls.unscale(g)
  out_scale, g = step(loss_scale, jnp.full(2, 512.0, jnp.float16))
  assert out_scale == loss_scale and g.tolist() == [2.0, 2.0]
  assert loss_scale.adjust(jnp.bool_(False)) is loss_scale
  with pytest.raises(TypeError, match="static"):
    jax.jit(lambda s: jmp.StaticLossScale(s))(jnp.float32(2.0))


def test_dynamic_loss_scale_leaves_and_tree_map():
  scale, counter = jnp.ones([]), jnp.zeros([], jnp.int32)
  loss_scale = jmp.DynamicLossScale(scale, counter, 2000, 2)
  leaves = jax.tree.leaves(loss_scale)
  assert len(leaves) == 2 and leaves[0] is scale and leaves[1] is counter
  assert jax.tree.map(lambda x: x, loss_scale) == loss_scale
  default = jmp.DynamicLossScale(jnp.float32(2**15))
  assert (int(default.counter), default.period, default.factor, default.min_loss_scale) == (
      0, 2000, 2, 1.0)
  assert default.counter.dtype == jnp.int32


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_adjust_grows_after_period_finite_steps(period, factor):
  loss_scale = jmp.DynamicLossScale(jnp.float32(10), jnp.int32(0), period, factor)
  for i in range(1, period):
    loss_scale = loss_scale.adjust(jnp.bool_(True))
    assert float(loss_scale.loss_scale) == 10 and int(loss_scale.counter) == i
    assert (loss_scale.period, loss_scale.factor) == (period, factor)
  loss_scale = loss_scale.adjust(jnp.bool_(True))
  assert float(loss_scale.loss_scale) == 10 * factor and int(loss_scale.counter) == 0
  assert (loss_scale.period, loss_scale.factor) == (period, factor)


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_adjust_backs_off_on_non_finite_down_to_one(period, factor):
  init = 10.0
  loss_scale = jmp.DynamicLossScale(jnp.float32(init), jnp.int32(0), period, factor)
  assert init / factor**100 < 1  # reaches the floor
  for i in range(100):
    loss_scale = loss_scale.adjust(jnp.bool_(False))
    np.testing.assert_allclose(loss_scale.loss_scale, max(1, init / factor ** (i + 1)),
                               rtol=1e-6)
    assert int(loss_scale.counter) == 0
    assert (loss_scale.period, loss_scale.factor) == (period, factor)


@pytest.mark.parametrize("period, factor, floor", [(20, 2, 0.3125), (30, 3, 0.37), (5, 2, 0)])
def test_min_loss_scale_floor(period, factor, floor):
  init = 10.0
  loss_scale = jmp.DynamicLossScale(jnp.float32(init), jnp.int32(0), period, factor,
                                    jnp.asarray(floor))
  for i in range(100):
    loss_scale = loss_scale.adjust(jnp.bool_(False))
    np.testing.assert_allclose(loss_scale.loss_scale, max(floor, init / factor ** (i + 1)),
                               rtol=1e-6)
    assert int(loss_scale.counter) == 0


def test_a_non_finite_step_restarts_the_count():
  loss_scale = jmp.DynamicLossScale(jnp.float32(8), period=3)
  for finite in (True, True, False, True, True):
    loss_scale = loss_scale.adjust(jnp.bool_(finite))
  assert float(loss_scale.loss_scale) == 4 and int(loss_scale.counter) == 2
  loss_scale = loss_scale.adjust(jnp.bool_(True))
  assert float(loss_scale.loss_scale) == 8 and int(loss_scale.counter) == 0


@pytest.mark.parametrize("dtype, top", [(jnp.float16, 2.0**15), (jnp.float32, 2.0**127),
                                        (jnp.bfloat16, 2.0**127)])
def test_growth_stops_where_the_scale_would_overflow_its_dtype(dtype, top):
  loss_scale = jmp.DynamicLossScale(jnp.asarray(top / 2, dtype), period=1)
  for _ in range(3):
    loss_scale = loss_scale.adjust(jnp.bool_(True))
  assert loss_scale.loss_scale.dtype == dtype and float(loss_scale.loss_scale) == top


def test_fp16_scale_adjusts_and_keeps_its_dtype():
  """jmp issue #47: ``adjust`` of a float16 scale failed in ``lax.select``."""
  loss_scale = jmp.DynamicLossScale(jnp.float16(2**15))
  finite = jmp.all_finite(jnp.ones(5, jnp.float16))
  backed_off = loss_scale.adjust(~finite)
  assert backed_off.loss_scale.dtype == jnp.float16 and float(backed_off.loss_scale) == 2**14
  assert loss_scale.adjust(finite).loss_scale.dtype == jnp.float16
  # An integer scale (jmp's README wrote jnp.asarray(2 ** 15)) is taken as fp32.
  int_scale = jmp.DynamicLossScale(jnp.asarray(2**15))
  assert int_scale.loss_scale.dtype == jnp.float32
  assert float(int_scale.adjust(jnp.bool_(False)).loss_scale) == 2**14


def test_min_loss_scale_period_and_factor_survive_jit_and_scan():
  """jmp bug: ``min_loss_scale`` was not part of the pytree, so jit reset it to 1."""
  loss_scale = jmp.DynamicLossScale(jnp.float32(1.0), period=7, factor=4, min_loss_scale=2**-10)
  out = jax.jit(lambda s: s)(loss_scale)
  assert (out.period, out.factor, out.min_loss_scale) == (7, 4, 2**-10)
  adjusted = jax.jit(lambda s, f: s.adjust(f))(loss_scale, jnp.bool_(False))
  assert float(adjusted.loss_scale) == 0.25 and adjusted.min_loss_scale == 2**-10

  def body(s, finite):
    s = s.adjust(finite)
    return s, s.loss_scale
  final, scales = jax.lax.scan(body, loss_scale, jnp.zeros(8, jnp.bool_))
  assert float(final.loss_scale) == 2**-10 and float(scales.min()) == 2**-10
  assert final.min_loss_scale == 2**-10 and final.loss_scale.dtype == jnp.float32


def test_adjust_requires_a_boolean_scalar():
  loss_scale = jmp.DynamicLossScale(jnp.float32(2))
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    loss_scale.adjust(jnp.ones([2], jnp.bool_))
  with pytest.raises(jmp.NotABooleanScalar):
    loss_scale.adjust(jnp.float32(1.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"period": 0}, "period"), ({"factor": 1}, "factor"), ({"min_loss_scale": -1.0},
                                                           "min_loss_scale")])
def test_bad_dynamic_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    jmp.DynamicLossScale(jnp.float32(2), **kwargs)


def test_the_same_steps_as_dynamic_loss_scale():
  """The object and the optimizer wrapper share the arithmetic: same scales, step by step."""
  import optax
  tx = jmp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**4, growth_interval=3,
                              min_scale=2.0)
  params = {"w": jnp.ones(2, jnp.float16)}
  state = tx.init(params)
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**4), period=3, min_loss_scale=2.0)
  pattern = [True] * 7 + [False] * 5 + [True] * 4
  for finite in pattern:
    grads = {"w": jnp.array([1.0, 1.0 if finite else jnp.inf], jnp.float16)}
    _, state = tx.update(grads, state, params)
    loss_scale = loss_scale.adjust(jmp.all_finite(loss_scale.unscale(grads)))
    assert float(state.scale) == float(loss_scale.loss_scale)
    assert int(state.growth_tracker) == int(loss_scale.counter)


def test_the_jmp_training_loop():
  """jmp's documented loop, under jit, with select_tree skipping a bad step."""
  params = {"w": jnp.ones(3, jnp.float16)}

  @jax.jit
  def step(params, loss_scale, x):
    def loss_fn(p):
      return loss_scale.scale(jnp.sum(p["w"] * x))
    grads = loss_scale.unscale(jax.grad(loss_fn)(params))
    finite = jmp.all_finite(grads)
    new = jax.tree.map(lambda p, g: (p - 0.5 * g).astype(p.dtype), params, grads)
    return jmp.select_tree(finite, new, params), loss_scale.adjust(finite)

  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15), period=2)
  params, loss_scale = step(params, loss_scale, jnp.full(3, 4.0, jnp.float16))  # overflows
  assert params["w"].tolist() == [1.0] * 3 and float(loss_scale.loss_scale) == 2**14
  params, loss_scale = step(params, loss_scale, jnp.full(3, 1.0, jnp.float16))
  assert params["w"].tolist() == [0.5] * 3 and params["w"].dtype == jnp.float16


# ---------------------------------------------------------------------------
# all_finite and select_tree.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_all_finite(bad, dtype):
  one, nonfinite = jnp.ones([], dtype), jnp.array(bad, dtype)
  assert bool(jmp.all_finite(None)) and bool(jmp.all_finite({}))
  assert not jmp.all_finite({"a": nonfinite})
  assert not jmp.all_finite({"a": one, "b": nonfinite})
  assert not jmp.all_finite({"a": nonfinite, "b": one})
  assert jmp.all_finite({"a": one, "b": one, "i": jnp.arange(3)})
  big = jnp.ones((5, 7), dtype).at[3, 4].set(bad)
  assert not jax.jit(jmp.all_finite)([jnp.ones(4, dtype), big])
  out = jmp.all_finite({"a": one})
  assert out.shape == () and out.dtype == jnp.bool_


def test_select_tree():
  a = {"a": jnp.ones([]), "b": jnp.zeros([], jnp.bfloat16)}
  b = {"a": jnp.zeros([]), "b": jnp.ones([], jnp.bfloat16)}
  assert jmp.select_tree(jnp.bool_(True), None, None) is None
  assert jmp.select_tree(jnp.bool_(False), None, None) is None
  for pred, want in ((True, a), (False, b)):
    out = jmp.select_tree(jnp.bool_(pred), a, b)
    assert out == want and out["b"].dtype == jnp.bfloat16
    out = jax.jit(jmp.select_tree)(jnp.bool_(pred), a, b)
    assert out == want


def test_select_tree_errors():
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    jmp.select_tree(jnp.ones([1]), None, None)
  with pytest.raises(jmp.NotABooleanScalar, match="expected boolean scalar"):
    jmp.select_tree(jnp.ones([], jnp.float32), None, None)
  with pytest.raises(TypeError, match=r"\['w'\] is float16\[2\] in a and float32\[2\] in b"):
    jmp.select_tree(jnp.bool_(True), {"w": jnp.ones(2, jnp.float16)}, {"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="differ in structure"):
    jmp.select_tree(jnp.bool_(True), {"w": jnp.ones(2)}, [jnp.ones(2)])
