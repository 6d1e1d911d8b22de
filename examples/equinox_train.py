"""Equinox: a bf16 MLP trained with Equinox's own loop, against fp32.

The loop of Equinox's optax example, unchanged but for the optimizer:
``eqx.filter_value_and_grad``, ``tx.update`` on the filtered model and
``eqx.apply_updates`` (which adds ``p + u`` without casting back). optax_half's
updates come in the param dtype, so the model stays bf16 and lands where the
optimizer meant (docs/algorithms.md#landing-exactly). A small learning rate
makes most updates smaller than half a bf16 ULP: plain bf16 stalls, the
compensations follow fp32.

    python examples/equinox_train.py            # 300 steps
    python examples/equinox_train.py --steps 60
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_half as oh


def data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((256, 8)).astype(np.float32)
  w = rng.standard_normal((8, 1)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(np.tanh(x @ w) + 0.1 * np.sin(3 * x[:, :1]))


def make_model(dtype):
  model = eqx.nn.MLP(8, 1, width_size=32, depth=2, key=jax.random.key(0))
  return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)


def loss_fn(model, x, y):
  pred = jax.vmap(model)(x.astype(model.layers[0].weight.dtype))
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def train(tx, dtype, steps, check=None):
  """Trains a fresh model; ``check(model, in_place)`` after each step, where
  ``in_place`` are ``oh.update_and_apply``'s params for the same step."""
  x, y = data()
  model = make_model(dtype)
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state):
    grads = eqx.filter_grad(loss_fn)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, new_state = tx.update(grads, state, params)
    in_place = oh.update_and_apply(tx, grads, state, params)[0] if check else None
    return eqx.apply_updates(model, updates), new_state, in_place

  for _ in range(steps):
    model, state, in_place = step(model, state)
    if check:
      check(model, in_place)
  return model, float(loss_fn(model, x, y))


RUNS = {
    "fp32 optax.adamw (reference)": (jnp.float32, lambda lr: optax.adamw(lr, weight_decay=0.0)),
    "bf16 optax.adamw (naive)": (jnp.bfloat16, lambda lr: optax.adamw(lr, weight_decay=0.0)),
    "bf16 oh.adamw_bf16 kahan": (jnp.bfloat16, lambda lr: oh.adamw_bf16(lr, weight_decay=0.0)),
    "bf16 oh.adamw_bf16 stochastic": (jnp.bfloat16, lambda lr: oh.adamw_bf16(
        lr, compensation="stochastic", weight_decay=0.0)),
    "bf16 oh.adam_fp32_master": (jnp.bfloat16, lambda lr: oh.adam_fp32_master(
        lr, weight_decay=0.0)),
}


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--lr", type=float, default=2e-4)
  args = parser.parse_args(argv)
  losses = {}
  for name, (dtype, make) in RUNS.items():
    model, losses[name] = train(make(args.lr), dtype, args.steps)
    kinds = {a.dtype.name for a in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))}
    print(f"{name:32s} loss {losses[name]:.4f}  params {', '.join(sorted(kinds))}")
  return losses


if __name__ == "__main__":
  main()
