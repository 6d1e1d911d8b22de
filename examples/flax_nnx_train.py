"""Train a bf16 transformer with ``optax_half.nnx.Optimizer`` and ``adamw_bf16``.

    python examples/flax_nnx_train.py            # 600 steps, about 15 s
    python examples/flax_nnx_train.py --quick    # 80 steps, for the tests

The weights are stored in bf16 (2 bytes each) and the optimizer keeps bf16
moments plus a bf16 Kahan buffer: 10 bytes per parameter in all, against 16
for fp32 AdamW, with the same loss (``examples/demo.py`` shows it).
``oh.nnx.Optimizer`` is ``flax.nnx.Optimizer`` with the step run by
``oh.update_and_apply``, and ``oh.chain`` keeps the optimizer last so its
kernel writes the params (the same bits as ``optax.chain``).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charlm_data  # noqa: E402
import charlm_flax  # noqa: E402

import optax_half as oh  # noqa: E402


def main(argv=None) -> dict:
  steps, train, val_batches = charlm_data.example_setup(argv)

  cfg = charlm_flax.Config()  # d_model 64, 2 layers, context 64

  model = charlm_flax.create(cfg, jnp.bfloat16)  # bf16 weights, fp32 math
  schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, max(1, steps // 10), steps)
  tx = oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(schedule, weight_decay=0.01))
  optimizer = oh.nnx.Optimizer(model, tx, wrt=nnx.Param)  # nnx.Optimizer + update_and_apply

  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(charlm_flax.loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  def val_loss(model, x, y):
    return charlm_flax.loss_fn(model, x, y)

  # Bind model and optimizer once (Flax >= 0.12.5): the call then does not
  # re-walk their graphs, and donating them (argument 0: the bound objects)
  # lets the kernel write the params in their own buffers.
  train_step = nnx.jit_partial(train_step, model, optimizer, donate_argnums=0, graph=False)
  val_loss = nnx.jit_partial(val_loss, model, graph=False)

  def evaluate():
    return float(np.mean([val_loss(x, y) for x, y in val_batches]))

  first = evaluate()
  starts = charlm_data.batch_starts(len(train), steps, 16, cfg.context, seed=0)
  for step in range(steps):
    loss = train_step(*charlm_data.windows(train, starts[step], cfg.context))
    if (step + 1) % max(1, steps // 4) == 0:
      print(f"step {step + 1:4d}  train loss {float(loss):.3f}")
  last = evaluate()
  dtypes = {str(p.dtype) for p in jax.tree.leaves(nnx.state(model, nnx.Param))}
  print(f"val loss {first:.3f} -> {last:.3f}; weights {dtypes}")
  return {"first": first, "last": last, "dtypes": dtypes}


if __name__ == "__main__":
  main()
