"""A ``flax.training.train_state.TrainState`` that steps the params in place. Imported
on demand (``optax_half.train_state``), so ``optax_half`` itself does not need Flax."""

from __future__ import annotations

from flax.training import train_state

from optax_half._in_place import update_and_apply

__all__ = ["TrainState"]


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` whose ``apply_gradients`` runs
  ``oh.update_and_apply``.

  Flax's fields, ``create``, pytree and bits; the kernel's optimizers write the
  new params into the params' buffers on CPU. Donate the state to the jitted
  step (``donate_argnums=0``) or XLA copies the buffers first.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_half as oh
    >>> state = oh.train_state.TrainState.create(
    ...     apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.ones((3, 2), jnp.bfloat16)},
    ...     tx=oh.adamw_bf16(1e-3))
    >>> @jax.jit(donate_argnums=0)
    ... def train_step(state, x):
    ...   loss = lambda p: (state.apply_fn(p, x).astype(jnp.float32) ** 2).mean()
    ...   return state.apply_gradients(grads=jax.grad(loss)(state.params))
    >>> state = train_step(state, jnp.ones((4, 3), jnp.bfloat16))
    >>> int(state.step), state.params["w"].dtype
    (1, dtype(bfloat16))
  """

  def apply_gradients(self, *, grads, **kwargs):
    """As Flax's: ``step + 1``, new ``params`` and ``opt_state``, ``**kwargs`` replaced."""
    owg = train_state.OVERWRITE_WITH_GRADIENT
    if owg in grads:
      new_params, new_opt_state = update_and_apply(self.tx, grads["params"], self.opt_state,
                                                   self.params["params"])
      new_params = {"params": new_params, owg: grads[owg]}
    else:
      new_params, new_opt_state = update_and_apply(self.tx, grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state,
                        **kwargs)
