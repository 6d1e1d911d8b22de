"""Composition with optax.chain, MultiSteps, flax and donated jit buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from conftest import bitwise_equal, random_tree

SHAPES = {"w": (16, 8), "b": (8,)}


def _params():
  return random_tree(0, SHAPES, jnp.bfloat16)


def _grads(t):
  return jax.tree.map(lambda g: 3.0 * g, random_tree(50 + t, SHAPES, jnp.bfloat16))


def _train(tx, params, steps=5, jit=True):
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for t in range(steps):
    u, state = update(_grads(t), state, params)
    params = optax.apply_updates(params, u)
  return params, state


@pytest.mark.parametrize("make", [
    lambda: oh.adamw_bf16(1e-2),
    lambda: oh.adam_fp32_master(1e-2),
    lambda: oh.master_weights(optax.adam(1e-2)),
])
def test_chain_with_clip_equals_clipping_by_hand(make):
  clip = optax.clip_by_global_norm(1.0)
  chained, _ = _train(optax.chain(clip, make()), _params())
  tx, params = make(), _params()
  state = tx.init(params)

  @jax.jit
  def by_hand(g, state, params):
    g, _ = clip.update(g, clip.init(params))
    return tx.update(g, state, params)

  for t in range(5):
    u, state = by_hand(_grads(t), state, params)
    params = optax.apply_updates(params, u)
  for a, b in zip(jax.tree.leaves(chained), jax.tree.leaves(params)):
    assert bitwise_equal(a, b)


def test_clipping_inside_a_wrapper_sees_fp32_grads():
  """master_weights(chain(clip, adam)): the global norm is taken in fp32."""
  params = _params()
  tx = oh.master_weights(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
  _, state = tx.update(_grads(0), tx.init(params), params)
  clip_state, adam_state = state.inner_state
  assert adam_state[0].mu["w"].dtype == jnp.float32
  g32 = jax.tree.map(lambda g: g.astype(jnp.float32), _grads(0))
  clipped, _ = optax.clip_by_global_norm(1.0).update(g32, optax.EmptyState())
  expected_mu = jax.tree.map(lambda g: (1 - 0.9) * g, clipped)
  np.testing.assert_allclose(np.asarray(adam_state[0].mu["w"]), np.asarray(expected_mu["w"]),
                             rtol=1e-6)


def test_multisteps_accumulates_then_takes_one_step():
  params = _params()
  tx = optax.MultiSteps(oh.adamw_bf16(1e-2), every_k_schedule=4)
  state = tx.init(params)
  update = jax.jit(tx.update)
  g = _grads(0)
  p = params
  for k in range(4):
    u, state = update(g, state, p)
    p = optax.apply_updates(p, u)
    if k < 3:
      assert all(bitwise_equal(a, b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)))
  # Four identical micro-batches average to g: one step of the inner optimizer on g.
  inner = oh.adamw_bf16(1e-2)
  u, _ = jax.jit(inner.update)(g, inner.init(params), params)
  expected = optax.apply_updates(params, u)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(expected)):
    assert bitwise_equal(a, b)


def test_jit_with_donated_buffers_equals_plain_jit():
  tx = oh.adamw_bf16(1e-2)

  def step(params, state, g):
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  plain = jax.jit(step)
  p1, s1 = _params(), tx.init(_params())
  p2, s2 = _params(), tx.init(_params())
  for t in range(5):
    p1, s1 = donated(p1, s1, _grads(t))
    p2, s2 = plain(p2, s2, _grads(t))
  for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
    assert bitwise_equal(a, b)


def test_flax_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")

  def make_model():
    return nnx.Linear(8, 4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)

  tx = oh.adamw_bf16(1e-2)
  model = make_model()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jnp.ones((2, 8), jnp.bfloat16)

  def loss_fn(m):
    return jnp.mean(m(x).astype(jnp.float32) ** 2)

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)

  # The same steps by hand on the parameter state.
  ref_model = make_model()
  graphdef, params = nnx.split(ref_model, nnx.Param)
  state = tx.init(params)
  for _ in range(3):
    train_step(model, optimizer)
    grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p)))(params)
    u, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, u)
  assert model.kernel[...].dtype == jnp.bfloat16
  assert bitwise_equal(model.kernel[...], params["kernel"][...])
  assert bitwise_equal(model.bias[...], params["bias"][...])
  assert not bitwise_equal(model.kernel[...], make_model().kernel[...])


def test_flax_train_state():
  train_state = pytest.importorskip("flax.training.train_state")
  tx = oh.adam_fp32_master(1e-2)
  ts = train_state.TrainState.create(apply_fn=None, params=_params(), tx=tx)
  apply = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))
  for t in range(3):
    ts = apply(ts, _grads(t))
  expected, state = _train(tx, _params(), steps=3)
  assert int(ts.step) == 3
  for a, b in zip(jax.tree.leaves(ts.params), jax.tree.leaves(expected)):
    assert bitwise_equal(a, b)
  for a, b in zip(jax.tree.leaves(ts.opt_state), jax.tree.leaves(state)):
    assert bitwise_equal(a, b)
