"""fp16 training where the gradients underflow, and dynamic loss scaling fixing it.

A teacher-student MLP whose targets are small (scale 3e-3, as when a loss is
already low): the hidden layer's gradients are ~1e-8, below fp16's smallest
subnormal (6e-8), so in fp16 they become 0 and that layer stops learning.
Three runs per framework, same data and initial weights:

* fp32 params, Adam (reference);
* fp16 params, fp32 masters (master_weights(Adam)), no loss scaling;
* the same with dynamic loss scaling.

    python examples/fp16_loss_scaling.py [--framework jax|torch|both] [--steps N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

D_IN, HIDDEN, D_OUT, BATCH = 32, 64, 8, 128
TARGET_SCALE = 3e-3
LR = 1e-3
# Grow every 100 finite steps (GradScaler's default is 2000) so that a short run
# shows the scale growing until fp16 overflows and backing off.
SCALER = dict(init_scale=2.0**16, growth_interval=100)


def make_problem(steps: int, seed: int = 0):
  """Initial weights, and the per-step batches (x, y), as fp32 numpy arrays."""
  rng = np.random.default_rng(seed)

  def layer(fan_in, fan_out, scale):
    return (rng.standard_normal((fan_in, fan_out)) * scale / np.sqrt(fan_in)).astype(np.float32)

  teacher = [layer(D_IN, HIDDEN, 1.0), layer(HIDDEN, D_OUT, 1.0)]
  init = {"w1": layer(D_IN, HIDDEN, 1.0), "b1": np.zeros(HIDDEN, np.float32),
          "w2": layer(HIDDEN, D_OUT, TARGET_SCALE), "b2": np.zeros(D_OUT, np.float32)}

  def data(n):
    x = rng.standard_normal((n, D_IN)).astype(np.float32)
    y = TARGET_SCALE * np.tanh(x @ teacher[0]) @ teacher[1]
    return x, y.astype(np.float32)

  batches = [data(BATCH) for _ in range(steps)]
  return init, batches, data(4096)


def run_jax(steps: int, seed: int = 0) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import optax_half

  init, batches, (x_val, y_val) = make_problem(steps, seed)

  def loss_fn(params, x, y):
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
    out = (h @ params["w2"] + params["b2"]).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)

  def train(dtype, tx, scaled: bool):
    params = {k: jnp.asarray(v, dtype) for k, v in init.items()}
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
      if scaled:
        loss, grads = optax_half.value_and_scaled_grad(loss_fn)(state, params, x, y)
      else:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, jnp.mean(grads["w1"] == 0)

    start = time.perf_counter()
    zero = None
    for x, y in batches:
      params, state, zero = step(params, state, x, y)
    out = {"val_loss": float(loss_fn(params, x_val, y_val)),
           "w1_grads_zero": float(zero), "seconds": time.perf_counter() - start}
    if scaled:
      out["scale"] = float(optax_half.loss_scale(state))
      out["skipped"] = int(state.skipped_steps)
    return out

  return {
      "fp32": train(jnp.float32, optax.adam(LR), False),
      "fp16, no scaling": train(jnp.float16, optax_half.master_weights(optax.adam(LR)), False),
      "fp16 + dynamic_loss_scale": train(
          jnp.float16,
          optax_half.dynamic_loss_scale(optax_half.master_weights(optax.adam(LR)), **SCALER),
          True),
  }


def run_torch(steps: int, seed: int = 0) -> dict:
  import torch

  import torch_bridge

  init, batches, (x_val, y_val) = make_problem(steps, seed)

  def forward(params, x):
    h = torch.tanh(x.to(params["w1"].dtype) @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"]).float()

  def train(dtype, scaled: bool):
    params = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in init.items()}
    adam = torch.optim.Adam(list(params.values()), lr=LR)
    opt = adam if dtype == torch.float32 else torch_bridge.master_weights(adam)
    scaler = torch_bridge.dynamic_loss_scale(**SCALER) if scaled else None
    start = time.perf_counter()
    zero = None
    for x, y in batches:
      opt.zero_grad()
      loss = torch.mean((forward(params, torch.from_numpy(x)) - torch.from_numpy(y)) ** 2)
      if scaled:
        scaler.scale(loss).backward()
      else:
        loss.backward()
      zero = (params["w1"].grad == 0).float().mean()
      if scaled:
        scaler.step(opt)
        scaler.update()
      else:
        opt.step()
    with torch.no_grad():
      val = torch.mean((forward(params, torch.from_numpy(x_val)) - torch.from_numpy(y_val)) ** 2)
    out = {"val_loss": float(val), "w1_grads_zero": float(zero),
           "seconds": time.perf_counter() - start}
    if scaled:
      out["scale"] = scaler.get_scale()
      out["skipped"] = scaler.state_dict()["skipped_steps"]
    return out

  return {
      "fp32": train(torch.float32, False),
      "fp16, no scaling": train(torch.float16, False),
      "fp16 + dynamic_loss_scale": train(torch.float16, True),
  }


def print_table(framework: str, results: dict, steps: int) -> None:
  ref = results["fp32"]["val_loss"]
  print(f"\n{framework}: {steps} steps, teacher-student MLP, targets x{TARGET_SCALE}, Adam lr {LR}")
  print(f"{'run':28s} {'val loss':>10s} {'/ fp32':>8s} {'w1 grads == 0':>14s} "
        f"{'skipped':>8s} {'final scale':>12s}")
  for name, r in results.items():
    print(f"{name:28s} {r['val_loss']:10.4g} {r['val_loss'] / ref:8.3f} "
          f"{100 * r['w1_grads_zero']:13.1f}% {r.get('skipped', ''):>8} "
          f"{r.get('scale', ''):>12}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--framework", choices=["jax", "torch", "both"], default="both")
  parser.add_argument("--steps", type=int, default=1500)
  args = parser.parse_args(argv)
  out = {}
  if args.framework in ("jax", "both"):
    out["jax"] = run_jax(args.steps)
    print_table("JAX (optax_half)", out["jax"], args.steps)
  if args.framework in ("torch", "both"):
    out["torch"] = run_torch(args.steps)
    print_table("PyTorch (torch_bridge)", out["torch"], args.steps)
  return out


if __name__ == "__main__":
  main()
