"""fp16 training with a ``TrainState`` and dynamic loss scaling.

    python examples/flax_train_state.py            # 600 steps
    python examples/flax_train_state.py --quick    # 80 steps, for the tests

The weights are fp16. ``optax_half.value_and_scaled_grad`` differentiates
``scale * loss`` so small gradients survive fp16; ``dynamic_loss_scale``
unscales them in fp32, skips any step whose gradients overflowed (nothing in
the params or optimizer state changes) and adapts the scale like
``torch.amp.GradScaler``. ``adam_fp32_master`` keeps an fp32 master copy of
the weights. All of it is one optax transformation, so Flax's ``TrainState``
takes it as it is; ``optax_half.train_state.TrainState`` (used here) is that
class with ``apply_gradients`` run by ``oh.update_and_apply``, and the state
donated to the step lets the kernel write the params in place. The scale starts too high (2**24) on purpose: the first
steps overflow, are skipped, and the scale backs off until gradients fit.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charlm_data  # noqa: E402
import charlm_flax  # noqa: E402

import optax_half as oh  # noqa: E402


def main(argv=None) -> dict:
  steps, train, val_batches = charlm_data.example_setup(argv)

  cfg = charlm_flax.Config()  # d_model 64, 2 layers, context 64

  graphdef, params = nnx.split(charlm_flax.create(cfg, jnp.float16))  # fp16 weights

  def loss_fn(params, x, y):
    return charlm_flax.loss_fn(nnx.merge(graphdef, params), x, y)

  state = oh.train_state.TrainState.create(
      apply_fn=graphdef.apply, params=params,
      tx=oh.dynamic_loss_scale(oh.adam_fp32_master(1e-3), init_scale=2.0**24))

  @jax.jit(donate_argnums=0)
  def train_step(state, x, y):
    loss, grads = oh.value_and_scaled_grad(loss_fn)(state.opt_state, state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  val_loss = jax.jit(loss_fn)

  def evaluate(params):
    return float(np.mean([val_loss(params, x, y) for x, y in val_batches]))

  first = evaluate(state.params)
  starts = charlm_data.batch_starts(len(train), steps, 16, cfg.context, seed=0)
  for step in range(steps):
    state, loss = train_step(state, *charlm_data.windows(train, starts[step], cfg.context))
    if (step + 1) % max(1, steps // 4) == 0:
      print(f"step {step + 1:4d}  train loss {float(loss):.3f}  "
            f"loss scale {float(oh.loss_scale(state.opt_state)):g}")
  last = evaluate(state.params)
  skipped = int(oh.find_loss_scale_state(state.opt_state).skipped_steps)
  dtypes = {str(p.dtype) for p in jax.tree.leaves(state.params)}
  print(f"val loss {first:.3f} -> {last:.3f}; {skipped} overflowing steps skipped; "
        f"weights {dtypes}")
  return {"first": first, "last": last, "skipped": skipped, "dtypes": dtypes}


if __name__ == "__main__":
  main()
