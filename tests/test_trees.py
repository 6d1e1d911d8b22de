"""Mixed trees: every wrapper and optimizer on bf16, fp16 and fp32 leaves, a
scalar, a 0-size leaf, None and empty subtrees, and integer leaves (which are
left untouched: zero updates, no state)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from conftest import bitwise_equal
from suite_helpers import default_or_slow


def mixed_params():
  k = jax.random.key(0)
  n = lambda i, s, d: jax.random.normal(jax.random.fold_in(k, i), s).astype(d)
  return {
      "bf16": n(0, (7, 3), jnp.bfloat16),
      "fp16": n(1, (5,), jnp.float16),
      "fp32": n(2, (4, 2), jnp.float32),
      "scalar": n(3, (), jnp.bfloat16),
      "empty": jnp.zeros((0, 3), jnp.bfloat16),
      "none": None,
      "nested": {"also_empty": {}, "tuple": (n(4, (2,), jnp.bfloat16),)},
      "step": jnp.array(7, jnp.int32),
      "ids": jnp.arange(3, dtype=jnp.int32),
  }


def mixed_grads(params, t):
  def g(p):
    if not jnp.issubdtype(p.dtype, jnp.floating):
      return np.zeros(p.shape, jax.dtypes.float0)  # what jax.grad gives
    return (jnp.sin(jnp.arange(p.size, dtype=jnp.float32) + t).reshape(p.shape)).astype(p.dtype)
  return jax.tree.map(g, params)


OPTIMIZERS = {
    "master_weights": lambda: oh.master_weights(optax.adam(1e-2)),
    "master_weights_split": lambda: oh.master_weights(optax.adam(1e-2), split=True),
    "kahan_summation": lambda: oh.kahan_summation(optax.adam(1e-2)),
    "stochastic_rounding": lambda: oh.stochastic_rounding(optax.adam(1e-2), key=1),
    "round_to_nearest": lambda: oh.round_to_nearest(optax.adam(1e-2)),
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-2),
    "adamw_bf16_kahan": lambda: oh.adamw_bf16(1e-2),
    "adamw_bf16_split": lambda: oh.adamw_bf16(1e-2, compensation="split"),
    "adamw_bf16_stochastic": lambda: oh.adamw_bf16(1e-2, compensation="stochastic"),
    "adamw_bf16_none": lambda: oh.adamw_bf16(1e-2, compensation="none"),
}


def _run(tx, params, steps, jit):
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for t in range(steps):
    updates, state = update(mixed_grads(params, t), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


# make test: every wrapper and each named optimizer's kernel path once; the rest slow.
@pytest.mark.parametrize("name", default_or_slow(sorted(OPTIMIZERS), [
    n for n in sorted(OPTIMIZERS) if n not in ("adamw_bf16_split", "adamw_bf16_none")]))
def test_mixed_tree_dtypes_shapes_and_untouched_integers(name):
  params0 = mixed_params()
  params, state = _run(OPTIMIZERS[name](), params0, 5, jit=True)
  assert jax.tree.structure(params) == jax.tree.structure(params0)
  for p, p0 in zip(jax.tree.leaves(params), jax.tree.leaves(params0)):
    assert p.dtype == p0.dtype and p.shape == p0.shape
  assert bitwise_equal(params["step"], params0["step"])
  assert bitwise_equal(params["ids"], params0["ids"])
  for key in ("bf16", "fp16", "fp32", "scalar"):
    assert not bitwise_equal(params[key], params0[key]), key  # trained
  for leaf in jax.tree.leaves(state):
    assert jnp.all(jnp.isfinite(leaf)) if jnp.issubdtype(leaf.dtype, jnp.floating) else True


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_jit_and_no_jit_agree(name):
  """Same params within 1 ULP of the param dtype (XLA fuses FMAs under jit)."""
  a, _ = _run(OPTIMIZERS[name](), mixed_params(), 3, jit=True)
  b, _ = _run(OPTIMIZERS[name](), mixed_params(), 3, jit=False)
  from conftest import ulp_diff
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert ulp_diff(x, y) <= 1


def test_fp32_leaves_in_a_wrapper_follow_the_inner_transformation():
  params = {"w": jnp.ones((4,), jnp.float32), "h": jnp.ones((4,), jnp.bfloat16)}
  g = {"w": jnp.full((4,), 0.5), "h": jnp.full((4,), 0.5, jnp.bfloat16)}
  for tx in (oh.kahan_summation(optax.sgd(0.1)), oh.stochastic_rounding(optax.sgd(0.1), key=0)):
    u, _ = tx.update(g, tx.init(params), params)
    assert bitwise_equal(u["w"], jnp.full((4,), -0.05, jnp.float32))


def test_empty_tree():
  for name, make in OPTIMIZERS.items():
    tx = make()
    state = tx.init({})
    updates, state = tx.update({}, state, {})
    assert updates == {}, name
