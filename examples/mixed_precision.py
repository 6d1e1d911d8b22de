"""The two standard mixed-precision setups in JAX, with a policy (``optax_half.get_policy``).

    python examples/mixed_precision.py            # 600 steps per run
    python examples/mixed_precision.py --quick    # 80 steps per run, for the tests

The byte-level transformer of ``examples/demo.py``, trained three ways from
the same fp32 draw:

* ``fp32``: fp32 params and compute, ``optax.adamw`` (the reference);
* ``pure bf16``: policy ``p=bf16,c=bf16,o=f32``: bf16 params and compute,
  fp32 logits for the loss; ``optax_half.adamw_bf16`` keeps the bf16 weights
  moving (Kahan-compensated), 10 bytes per parameter in all;
* ``amp``: policy ``p=f32,c=f16,o=f32``: the classic AMP recipe, fp32 params
  (the master copy), fp16 compute, ``dynamic_loss_scale`` so the fp16
  backward pass neither underflows nor overflows.

``optax_half.nnx.apply_policy`` sets every layer's ``param_dtype``/``dtype``
(layer norms stay fp32) and casts the params; nothing in the model's code changes.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charlm_data  # noqa: E402
import charlm_flax  # noqa: E402

import optax_half as oh  # noqa: E402
import optax_half.nnx  # noqa: E402,F401

SETUPS = {  # name: (policy, optimizer, loss-scaled)
    "fp32": ("p=f32,c=f32,o=f32", lambda lr: optax.adamw(lr, weight_decay=0.01), False),
    "pure bf16": ("p=bf16,c=bf16,o=f32", lambda lr: oh.adamw_bf16(lr, weight_decay=0.01), False),
    "amp": ("p=f32,c=f16,o=f32", lambda lr: optax.adamw(lr, weight_decay=0.01), True),
}


def run(name: str, steps: int, train, val_batches) -> dict:
  policy_name, make_tx, scaled = SETUPS[name]
  policy = oh.get_policy(policy_name)
  cfg = charlm_flax.Config()
  model = oh.nnx.apply_policy(charlm_flax.create(cfg), policy)
  schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, max(1, steps // 10), steps)
  tx = optax.chain(optax.clip_by_global_norm(1.0), make_tx(schedule))
  if scaled:  # clipping inside the scaler sees the unscaled gradients
    tx = oh.dynamic_loss_scale(tx)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, x, y):
    logits = policy.cast_to_output(model(x))  # fp32 logits for the cross-entropy
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def scaled_loss(model, opt_state, x, y):
    loss = loss_fn(model, x, y)
    return (oh.scale_loss(loss, opt_state) if scaled else loss), loss

  @nnx.jit
  def train_step(model, optimizer, x, y):
    grads, loss = nnx.grad(scaled_loss, has_aux=True)(model, optimizer.opt_state, x, y)
    optimizer.update(model, grads)
    return loss

  val_loss = nnx.jit(loss_fn)
  starts = charlm_data.batch_starts(len(train), steps, 16, cfg.context, seed=0)
  for step in range(steps):
    train_step(model, optimizer, *charlm_data.windows(train, starts[step], cfg.context))
  val = float(np.mean([val_loss(model, x, y) for x, y in val_batches]))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  out = {"policy": str(policy), "val": val,
         "param_dtypes": sorted({str(p.dtype) for p in params})}
  if scaled:
    out["skipped"] = int(oh.find_loss_scale_state(optimizer.opt_state).skipped_steps)
  return out


def main(argv=None) -> dict:
  steps, train, val_batches = charlm_data.example_setup(argv)
  results = {name: run(name, steps, train, val_batches) for name in SETUPS}
  ref = results["fp32"]["val"]
  for name, r in results.items():
    extra = f", {r['skipped']} skipped steps" if "skipped" in r else ""
    print(f"{name:10s} {r['policy']:18s} val loss {r['val']:.4f} ({r['val'] / ref:.3f}x fp32); "
          f"params {', '.join(r['param_dtypes'])}{extra}")
  return results


if __name__ == "__main__":
  main()
