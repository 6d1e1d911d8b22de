"""Stale bf16 weights and their cure, on a teacher-student MLP (JAX, CPU).

A student MLP learns a fixed random teacher MLP. Every run sees the same data
and the same initial weights; only the storage precision and the optimizer
differ. The forward pass is fp32 in every run, so the differences in the
table come from how the optimizer stores and updates the weights.

    python examples/train_mlp.py            # the full comparison (~1 minute)
    python examples/train_mlp.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import optax_half as oh

IN, HIDDEN, OUT = 64, 256, 64
BATCH = 128


def init_mlp(key, hidden=HIDDEN):
  k1, k2 = jax.random.split(key)
  return {
      "w1": jax.random.normal(k1, (IN, hidden)) / jnp.sqrt(IN),
      "b1": jnp.zeros((hidden,)),
      "w2": jax.random.normal(k2, (hidden, OUT)) / jnp.sqrt(hidden),
      "b2": jnp.zeros((OUT,)),
  }


def mlp(params, x):
  p = jax.tree.map(lambda v: v.astype(jnp.float32), params)  # fp32 compute
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def runs(lr):
  """name -> (param dtype, optimizer). Same hyperparameters everywhere."""
  bf16 = jnp.bfloat16
  return {
      "fp32 optax.adamw (reference)": (jnp.float32, optax.adamw(lr, weight_decay=0.0)),
      "bf16 optax.adamw (naive)": (bf16, optax.adamw(lr, weight_decay=0.0)),
      "bf16 adamw_bf16 kahan": (bf16, oh.adamw_bf16(lr, weight_decay=0.0)),
      "bf16 adamw_bf16 split": (bf16, oh.adamw_bf16(lr, weight_decay=0.0, compensation="split")),
      "bf16 adamw_bf16 stochastic": (
          bf16, oh.adamw_bf16(lr, weight_decay=0.0, compensation="stochastic")),
      "bf16 adamw_bf16 kahan, nearest moments": (
          bf16, oh.adamw_bf16(lr, weight_decay=0.0, state_rounding="nearest")),
      "bf16 adamw_bf16 kahan, fp32 moments": (
          bf16, oh.adamw_bf16(lr, weight_decay=0.0, mu_dtype=jnp.float32,
                              nu_dtype=jnp.float32)),
      "bf16 adam_fp32_master": (bf16, oh.adam_fp32_master(lr)),
  }


def train(dtype, tx, steps, hidden=HIDDEN, seed=0):
  """Returns (final held-out loss, optimizer bytes/param, ms/step)."""
  key = jax.random.key(seed)
  teacher = init_mlp(jax.random.fold_in(key, 1), hidden)
  params = jax.tree.map(lambda v: v.astype(dtype), init_mlp(jax.random.fold_in(key, 2), hidden))
  x_eval = jax.random.normal(jax.random.fold_in(key, 3), (2048, IN))
  y_eval = mlp(teacher, x_eval)

  def loss_fn(p, x, y):
    return jnp.mean((mlp(p, x) - y) ** 2)

  @jax.jit
  def run(params):
    def step(carry, t):
      p, s = carry
      x = jax.random.normal(jax.random.fold_in(key, 1000 + t), (BATCH, IN))
      grads = jax.grad(loss_fn)(p, x, mlp(teacher, x))
      updates, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), None
    (p, _), _ = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
    return loss_fn(p, x_eval, y_eval)

  state = tx.init(params)
  n = sum(v.size for v in jax.tree.leaves(params))
  state_bytes = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(state) if v.ndim > 0)
  run.lower(params).compile()  # compile outside the timing
  start = time.perf_counter()
  loss = float(run(params))
  ms = (time.perf_counter() - start) * 1e3 / steps
  return loss, state_bytes / n, ms


def compare(steps=2500, lr=3e-4, hidden=HIDDEN, only=None):
  results = {}
  for name, (dtype, tx) in runs(lr).items():
    if only is None or name in only:
      results[name] = train(dtype, tx, steps, hidden)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=2500)
  parser.add_argument("--lr", type=float, default=3e-4)
  parser.add_argument("--hidden", type=int, default=HIDDEN)
  parser.add_argument("--quick", action="store_true", help="a few seconds, for CI")
  args = parser.parse_args()
  steps = 300 if args.quick else args.steps
  print(f"teacher-student MLP {IN}-{args.hidden}-{OUT}, batch {BATCH}, "
        f"{steps} steps, lr {args.lr}, backend {jax.default_backend()}\n")
  results = compare(steps, args.lr, args.hidden)
  ref = results["fp32 optax.adamw (reference)"][0]
  print(f"{'run':42s} {'eval loss':>10s} {'vs fp32':>8s} {'opt B/param':>12s} {'ms/step':>8s}")
  for name, (loss, bpp, ms) in results.items():
    print(f"{name:42s} {loss:10.3e} {loss / ref:8.3f} {bpp:12.1f} {ms:8.3f}")
  print("\nopt B/param: optimizer state only (add 2+2 bytes of bf16 param and grad, "
        "or 4+4 for fp32).")


if __name__ == "__main__":
  main()
