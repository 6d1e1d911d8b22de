"""Optimizer step time on one tree, as ratios to optax.adamw fp32 in the same process.

    python -m benchmarks.step [--quick] [--json PATH]

Every optimizer runs jitted with donated params and state, interleaved
(A B C ... A B C ...), median of the repetitions after a warm-up; compile time
is reported separately. Bytes/param count the params, one gradient and the
optimizer state actually allocated. The full suite (torch, optimi, roofline)
is tracked by the benchmarks issue; this is its first piece.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optax_half as oh


def make_tree(quick: bool):
  key = jax.random.key(0)
  shapes = [(1024, 1024), (1024,), (1024, 256), ()] if quick else \
           [(4096, 1024)] * 4 + [(1024,)] * 8 + [()] * 4
  return {f"p{i}": jax.random.normal(jax.random.fold_in(key, i), s) * 0.02
          for i, s in enumerate(shapes)}


def candidates(lr=1e-3):
  bf16 = jnp.bfloat16
  return {
      "optax.adamw fp32 (reference)": (jnp.float32, optax.adamw(lr)),
      "optax.adamw bf16 (naive)": (bf16, optax.adamw(lr)),
      "adamw_bf16 kahan": (bf16, oh.adamw_bf16(lr)),
      "adamw_bf16 split": (bf16, oh.adamw_bf16(lr, compensation="split")),
      "adamw_bf16 stochastic": (bf16, oh.adamw_bf16(lr, compensation="stochastic")),
      "adam_fp32_master": (bf16, oh.adam_fp32_master(lr)),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  reps = args.reps or (5 if args.quick else 15)
  tree32 = make_tree(args.quick)
  n = sum(x.size for x in jax.tree.leaves(tree32))

  runs = {}
  for name, (dtype, tx) in candidates().items():
    params = jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), tree32)
    grads = jax.tree.map(lambda x: (x * 0.1).astype(dtype), tree32)
    state = tx.init(params)

    def step(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    t0 = time.perf_counter()
    fn = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    compile_s = time.perf_counter() - t0
    bytes_ = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, state, grads)))
    runs[name] = dict(fn=fn, params=params, state=state, grads=grads, times=[],
                      compile_s=compile_s, bytes_per_param=bytes_ / n)
    for _ in range(2):  # warm-up
      r = runs[name]
      r["params"], r["state"] = fn(r["params"], r["state"], grads)
    jax.block_until_ready(runs[name]["params"])

  for _ in range(reps):  # interleaved repetitions
    for r in runs.values():
      t0 = time.perf_counter()
      r["params"], r["state"] = r["fn"](r["params"], r["state"], r["grads"])
      jax.block_until_ready(r["params"])
      r["times"].append(time.perf_counter() - t0)

  ref = statistics.median(runs["optax.adamw fp32 (reference)"]["times"])
  print(f"{n / 1e6:.2f}M params, {len(tree32)} leaves, backend {jax.default_backend()}, "
        f"median of {reps}\n")
  print(f"{'optimizer':32s} {'ms/step':>9s} {'speed vs ref':>13s} {'B/param':>8s} {'compile s':>10s}")
  out = {}
  for name, r in runs.items():
    med = statistics.median(r["times"])
    out[name] = dict(ms=med * 1e3, speedup=ref / med, bytes_per_param=r["bytes_per_param"],
                     compile_s=r["compile_s"])
    print(f"{name:32s} {med * 1e3:9.2f} {ref / med:12.2f}x {r['bytes_per_param']:8.1f} "
          f"{r['compile_s']:10.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(params=n, reps=reps, results=out), f, indent=2)


if __name__ == "__main__":
  main()
