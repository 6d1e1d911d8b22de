"""A state made for params of one dtype, stepped with params of another, is refused at
trace time, naming the leaf, both dtypes and the fix (both ways round)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_half as oh

F32 = {"w": jnp.ones(64)}
BF16 = {"w": jnp.ones(64, jnp.bfloat16)}

TXS = {
    "adamw_bf16": lambda: oh.adamw_bf16(1e-3),
    "adamw_bf16 stochastic": lambda: oh.adamw_bf16(1e-3, compensation="stochastic"),
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-3),
    "kahan_summation": lambda: oh.kahan_summation(optax.adam(1e-3)),
    "master_weights": lambda: oh.master_weights(optax.sgd(1e-3)),
    "scaled_adam": lambda: oh.scaled_adam(1e-3),
}


@pytest.mark.parametrize("made_for,stepped", [(F32, BF16), (BF16, F32)])
@pytest.mark.parametrize("name", list(TXS))
def test_a_state_for_other_dtypes_is_refused(name, made_for, stepped):
  tx = TXS[name]()
  state = tx.init(made_for)
  grads = jax.tree.map(jnp.ones_like, stepped)
  have = jnp.dtype(stepped["w"].dtype).name
  with pytest.raises(ValueError, match=rf"params\['w'\] is {have}.*tx.init\(params\).*cast "):
    jax.jit(tx.update)(grads, state, stepped)
  with pytest.raises(ValueError, match=r"params\['w'\]"):
    jax.jit(lambda g, s, p: oh.update_and_apply(tx, g, s, p))(grads, state, stepped)
  tx.update(grads, tx.init(stepped), stepped)  # a fresh state is fine
