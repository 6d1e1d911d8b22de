"""The optax contract over every public transformation of optax_half: a
GradientTransformationExtraArgs (extra arguments to update are accepted),
init on abstract params (jax.ShapeDtypeStruct, as sharding setup code
passes) gives the abstract state jax.eval_shape gives, complex params are
refused with an error naming the leaf, and optax_half.checkpoint's missing
and existing directories get errors that say what to do."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh


def _transformations():
  key = jax.random.key(0)
  return {
      "adamw_bf16": lambda: oh.adamw_bf16(1e-3),
      "adamw_bf16 stochastic": lambda: oh.adamw_bf16(1e-3, compensation="stochastic"),
      "adamw_bf16 split": lambda: oh.adamw_bf16(1e-3, compensation="split"),
      "adamw_bf16 flat_state": lambda: oh.adamw_bf16(1e-3, flat_state=True),
      "adamw_bf16 skip_nonfinite": lambda: oh.adamw_bf16(1e-3, skip_nonfinite=True),
      "adam_fp32_master": lambda: oh.adam_fp32_master(1e-3),
      "scale_by_adamw": lambda: oh.scale_by_adamw(1e-3, weight_decay=0.1),
      "master_weights": lambda: oh.master_weights(optax.sgd(1e-3)),
      "kahan_summation": lambda: oh.kahan_summation(optax.sgd(1e-3, momentum=0.9)),
      "stochastic_rounding": lambda: oh.stochastic_rounding(optax.sgd(1e-3), key),
      "round_to_nearest": lambda: oh.round_to_nearest(optax.sgd(1e-3)),
      "dynamic_loss_scale": lambda: oh.dynamic_loss_scale(oh.adamw_bf16(1e-3)),
      # (scale 1: these tests' gradients are unscaled; fp16 ones 2^15 times smaller than
      # 0.1 would underflow a plain fp16 optax.adam, as under GradScaler)
      "dynamic_loss_scale adam": lambda: oh.dynamic_loss_scale(optax.adam(1e-3), init_scale=1.0),
      "scaled_adam": lambda: oh.scaled_adam(1e-3),
      "scaled_adam clipping": lambda: oh.scaled_adam(1e-3, clipping_scale=2.0),
      "clip_by_global_norm": lambda: oh.clip_by_global_norm(1.0),
      "chain": lambda: oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3)),
  }


TXS = _transformations()
# The transformations that refuse complex params (the others pass them on:
# clipping and loss scaling are defined for complex gradients).
REAL_ONLY = [n for n in TXS if not n.startswith("dynamic_loss_scale")
             and n != "clip_by_global_norm"]


def _params():
  return {"w": jnp.ones((3, 4), jnp.bfloat16), "b": jnp.zeros(4, jnp.bfloat16),
          "step": jnp.zeros((), jnp.int32)}


@pytest.mark.parametrize("name", list(TXS))
def test_is_a_gradient_transformation_with_extra_args(name):
  tx = TXS[name]()
  assert isinstance(tx, optax.GradientTransformationExtraArgs), type(tx)
  params = {k: v for k, v in _params().items() if k != "step"}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), params)
  updates, _ = tx.update(grads, tx.init(params), params, some_extra_arg=3)
  assert jax.tree.structure(updates) == jax.tree.structure(params)


@pytest.mark.parametrize("name", list(TXS))
def test_init_on_abstract_params_is_the_abstract_state(name):
  params = _params()
  if name.startswith("scaled_adam"):
    params = {k: v for k, v in params.items() if k != "step"}  # float params only
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  got = TXS[name]().init(abstract)
  want = jax.eval_shape(TXS[name]().init, params)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert isinstance(g, jax.ShapeDtypeStruct)
    assert (g.shape, g.dtype) == (w.shape, w.dtype)
  # and the concrete state has those shapes and dtypes
  concrete = TXS[name]().init(params)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(concrete)] == [
      (x.shape, x.dtype) for x in jax.tree.leaves(got)]


@pytest.mark.parametrize("name", REAL_ONLY)
def test_complex_params_are_refused_naming_the_leaf(name):
  params = {"a": jnp.ones(2, jnp.bfloat16), "z": jnp.ones(3, jnp.complex64)}
  with pytest.raises(ValueError, match=r"params\['z'\] is complex64; complex params are not"):
    TXS[name]().init(params)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  with pytest.raises(ValueError, match=r"params\['z'\] is complex64"):
    TXS[name]().init(abstract)


def test_complex_params_pass_through_clipping_and_loss_scaling():
  params = {"z": jnp.ones(3, jnp.complex64)}
  grads = {"z": jnp.full(3, 3.0 + 4.0j, jnp.complex64)}
  clip = oh.clip_by_global_norm(1.0)
  updates, _ = clip.update(grads, clip.init(params))
  ref, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  np.testing.assert_array_equal(updates["z"], ref["z"])
  tx = oh.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["z"], -grads["z"])


def test_restore_from_a_missing_directory_names_it(tmp_path):
  like = oh.adamw_bf16(1e-3).init({"w": jnp.ones(3, jnp.bfloat16)})
  missing = tmp_path / "step_7"
  with pytest.raises(FileNotFoundError, match=f"no checkpoint directory {missing}"):
    oh.checkpoint.restore(missing, like)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
    oh.checkpoint.restore(empty, like)


def test_save_to_an_existing_directory_says_how_to_overwrite(tmp_path):
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = oh.adamw_bf16(1e-3)
  state = tx.init(params)
  path = tmp_path / "ckpt"
  oh.checkpoint.save(path, state)
  _, newer = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  with pytest.raises(FileExistsError, match="already exists; pass force=True"):
    oh.checkpoint.save(path, newer)
  assert int(oh.checkpoint.restore(path, state).inner_state.count) == 0  # untouched
  oh.checkpoint.save(path, newer, force=True)
  assert int(oh.checkpoint.restore(path, state).inner_state.count) == 1
  assert os.path.isdir(path)


def test_inject_hyperparams_of_scale_by_adamw_needs_no_params_by_default():
  params = {"w": jnp.ones(3)}
  tx = optax.inject_hyperparams(oh.scale_by_adamw)(learning_rate=1e-3)
  updates, state = jax.jit(tx.update)(params, tx.init(params))
  ref, _ = oh.scale_by_adamw(1e-3).update(params, oh.scale_by_adamw(1e-3).init(params))
  np.testing.assert_array_equal(updates["w"], ref["w"])
  # an injected weight_decay is an array (its value unknown while tracing): params needed
  tx = optax.inject_hyperparams(oh.scale_by_adamw)(learning_rate=1e-3, weight_decay=0.0)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))


@pytest.mark.parametrize("name", ["adamw_bf16", "adam_fp32_master", "scale_by_adamw",
                                  "scaled_adam"])
def test_inject_hyperparams_learning_rate_changes_the_step_as_a_fixed_one(name):
  """optax's alias tests: an injected learning rate, set between steps, gives
  the bits of the transformation built with that learning rate."""
  factory = getattr(oh, name)
  params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)}
  grads = jax.tree.map(lambda x: x * 0.5 + 0.1, params)
  static = ()
  if name == "scaled_adam":  # only its learning rate may be an array: the rest is static
    with pytest.raises(ValueError, match="list the others in static_args"):
      optax.inject_hyperparams(factory)(learning_rate=1e-3).init(params)
    static = ("b1", "b2", "scalar_lr_scale", "eps", "param_min_rms", "param_max_rms",
              "scalar_max", "size_update_period", "clipping_update_period")
  tx = optax.inject_hyperparams(factory, static_args=static)(learning_rate=1e-3)
  state = tx.init(params)
  state.hyperparams["learning_rate"] = jnp.asarray(3e-2)
  updates, state = jax.jit(tx.update)(grads, state, params)
  fixed = factory(3e-2)
  want, _ = fixed.update(grads, fixed.init(params), params)
  np.testing.assert_array_equal(updates["w"], want["w"])


_DTYPES = ["bfloat16", "float16", "float32"]


def _params_grads(dtype):
  params = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6).astype(dtype),
            "b": jnp.full((6,), 0.25, dtype), "s": jnp.asarray(0.5, dtype)}
  grads = jax.tree.map(lambda p: (jnp.cos(jnp.arange(p.size) * 0.7).reshape(p.shape) * 0.1
                                  ).astype(dtype), params)
  return params, grads


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("name", list(TXS))
def test_updates_have_the_param_dtype(name, dtype):
  """optax's test_preserve_dtype: update.dtype == param.dtype, bf16/fp16/fp32 params."""
  params, grads = _params_grads(dtype)
  tx = TXS[name]()
  state = tx.init(params)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates)):
    assert u.dtype == p.dtype, (name, dtype, u.dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(TXS))
def test_a_second_step_reuses_the_compiled_one(name, dtype):
  """The state keeps its types across a step: the jitted update compiles once."""
  params, grads = _params_grads(dtype)
  tx = TXS[name]()
  step = jax.jit(tx.update)
  state = tx.init(params)
  _, new_state = step(grads, state, params)
  assert jax.tree.map(lambda x: (x.dtype, x.shape), new_state) == jax.tree.map(
      lambda x: (x.dtype, x.shape), state)
  step(grads, new_state, params)
  assert step._cache_size() == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(TXS))
def test_cond_over_update_or_no_update_compiles(name, dtype):
  """optax's test_state_shape_dtype_shard_stability: lax.cond over (update, state) or
  (zero updates, state) needs equal output types."""
  params, grads = _params_grads(dtype)
  tx = TXS[name]()
  state = tx.init(params)

  def step(flag, grads, state, params):
    return jax.lax.cond(flag, lambda: tx.update(grads, state, params),
                        lambda: (jax.tree.map(jnp.zeros_like, params), state))

  updates, new_state = jax.jit(step)(True, grads, state, params)
  assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
  assert all(np.isfinite(np.asarray(u, np.float32)).all() for u in jax.tree.leaves(updates))


def test_apply_if_finite_of_adamw_bf16_steps_and_skips_a_nan_step():
  params = {"w": jnp.full((5,), 1.0, jnp.bfloat16)}
  tx = optax.apply_if_finite(oh.adamw_bf16(0.1), max_consecutive_errors=3)
  state = tx.init(params)
  step = jax.jit(tx.update)
  good = {"w": jnp.full((5,), 0.5, jnp.bfloat16)}
  updates, state = step(good, state, params)
  params = optax.apply_updates(params, updates)
  assert params["w"].dtype == jnp.bfloat16 and float(params["w"][0]) == 0.8984375
  before = params["w"]
  updates, state = step({"w": good["w"].at[0].set(jnp.nan)}, state, params)
  params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(np.asarray(params["w"]).view(np.uint16),
                                np.asarray(before).view(np.uint16))
  assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 1


@pytest.mark.parametrize("make", [
    lambda: oh.adamw_bf16(1e-3, compensation="stochastic"),
    lambda: oh.stochastic_rounding(optax.adam(1e-3), key=0),
    lambda: oh.adamw_bf16(1e-3),
    lambda: oh.adam_fp32_master(1e-3),
    lambda: oh.scaled_adam(1e-3),
], ids=["adamw_bf16 stochastic", "stochastic_rounding(adam)", "adamw_bf16", "adam_fp32_master",
        "scaled_adam"])
def test_tree_get_finds_the_one_step_count(make):
  """optax.tree_utils.tree_get(state, "count"): one step count per state, after a step too."""
  tx = make()
  params = {"w": jnp.ones((5,), jnp.bfloat16)}
  state = tx.init(params)
  assert int(optax.tree_utils.tree_get(state, "count")) == 0
  _, state = tx.update({"w": jnp.full((5,), 0.1, jnp.bfloat16)}, state, params)
  assert int(optax.tree_utils.tree_get(state, "count")) == 1
