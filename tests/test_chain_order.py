"""oh.chain refuses a transformation after a compensated optimizer (it would rescale an
update made to land exactly, and stall bf16 weights); the nested order works."""

import jax.numpy as jnp
import optax
import pytest

import optax_half as oh

PARAMS = {"w": jnp.ones(4, jnp.bfloat16)}


@pytest.mark.parametrize("make", [
    lambda: oh.chain(oh.adamw_bf16(1e-3), optax.scale(0.5)),
    lambda: oh.chain(oh.adamw_bf16(1e-3), optax.contrib.reduce_on_plateau()),
    lambda: oh.chain(oh.dynamic_loss_scale(oh.adam_fp32_master(1e-3)), optax.scale(0.5)),
    lambda: oh.chain(oh.kahan_summation(optax.sgd(1e-3)), optax.identity(), optax.scale(2.0)),
])
def test_a_transformation_after_a_compensated_optimizer_is_refused(make):
  with pytest.raises(ValueError, match=r"compensated optimizer.*oh\.kahan_summation\(optax"):
    make().init(PARAMS)


def _plateau_run(tx, steps=8):
  params, state = PARAMS, tx.init(PARAMS)
  for _ in range(steps):
    updates, state = tx.update({"w": jnp.full(4, 0.5, jnp.bfloat16)}, state, params,
                               value=jnp.asarray(1.0))
    params = optax.apply_updates(params, updates)
  return float(params["w"][0]), float(optax.tree_utils.tree_get(state, "scale"))


def test_nested_reduce_on_plateau_moves_bf16_weights():
  def inner():
    return optax.chain(optax.adamw(1e-3),
                       optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.5))
  w, scale = _plateau_run(oh.kahan_summation(inner()))
  assert scale < 1.0  # the plateau was seen
  assert w < 1.0  # steps below half a bf16 ULP still landed
  assert _plateau_run(inner())[0] == 1.0  # without the compensation they do not
  # gradients' transformations before the optimizer stay allowed
  oh.chain(oh.clip_by_global_norm(1.0), optax.identity(), oh.adamw_bf16(1e-3)).init(PARAMS)
