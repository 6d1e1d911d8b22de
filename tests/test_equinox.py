"""Equinox's training loop (``eqx.filter_value_and_grad``, ``tx.update`` on the filtered
model, ``eqx.apply_updates``, which adds ``p + u`` without casting back): a bf16 model
stays bf16, every compensation steps the same bits as ``oh.update_and_apply``, and the
compensations keep it near the fp32 run where round-to-nearest goes stale
(docs/algorithms.md#landing-exactly)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh

eqx = pytest.importorskip("equinox")


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((256, 8)).astype(np.float32)
  w = rng.standard_normal((8, 1)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.tanh(x @ w) + 0.1 * np.sin(3 * x[:, :1]))


def _model(dtype):
  model = eqx.nn.MLP(8, 1, width_size=32, depth=2, key=jax.random.key(0))
  return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)


def _loss(model, x, y):
  pred = jax.vmap(model)(x.astype(model.layers[0].weight.dtype))
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def _train(tx, dtype, steps):
  """The loop of Equinox's optax example; also returns the in-place step's params."""
  x, y = _data()
  model = _model(dtype)
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, new_state = tx.update(grads, state, params)
    in_place, _ = oh.update_and_apply(tx, grads, state, params)
    return eqx.apply_updates(model, updates), new_state, in_place, loss

  for _ in range(steps):
    model, state, in_place, _ = step(model, state)
    params = eqx.filter(model, eqx.is_inexact_array)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(in_place)):
      assert a.dtype == dtype
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  return float(_loss(model, x, y))


@pytest.mark.parametrize("compensation", ["kahan", "split", "stochastic", "none"])
def test_a_bf16_model_stays_bf16_and_steps_as_update_and_apply(compensation):
  tx = oh.adamw_bf16(1e-3, compensation=compensation, weight_decay=0.0)
  assert np.isfinite(_train(tx, jnp.bfloat16, steps=5))


def test_compensation_tracks_fp32_where_nearest_goes_stale():
  """A small learning rate (updates below half a bf16 ULP): Kahan ends at the fp32
  loss (0.6468 against 0.6467 here), round-to-nearest stays behind (0.730)."""
  steps, lr = 60, 2e-4
  fp32 = _train(optax.adamw(lr, weight_decay=0.0), jnp.float32, steps)
  kahan = _train(oh.adamw_bf16(lr, compensation="kahan", weight_decay=0.0), jnp.bfloat16, steps)
  nearest = _train(oh.adamw_bf16(lr, compensation="none", weight_decay=0.0), jnp.bfloat16,
                   steps)
  assert abs(kahan - fp32) < 0.05 * abs(nearest - fp32), (fp32, kahan, nearest)
