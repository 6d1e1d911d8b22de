"""JAX/torch parity on a Flax NNX model and its torch twin, with the same weights.

    python examples/parity.py [--quick] [--steps N] [--dtype bf16|fp16|fp32]
        [--optimizer adamw_bf16|adam_fp32_master|scale_by_adamw] [--grads-from jax|torch]

1. Builds a small MLP in Flax NNX and the same architecture in torch, and
   gives the torch model the Flax weights through DLPack (the JAX arrays are
   viewed by torch without a copy, then copied into torch's own parameters,
   transposed: Flax kernels are ``(in, out)``, torch weights ``(out, in)``).
2. Checks that both models compute the same outputs.
3. Trains with ``torch_bridge.parity.compare``: at every step the gradient of
   the regression loss is taken by one of the two models at the current
   weights, both optimizers (``optax_half`` jitted, ``torch_bridge``) apply it,
   and every buffer is compared. Prints the report; exits 1 if a tolerance
   broke.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from torch_bridge import dlpack, parity

SIZES = [2, 64, 64, 1]


class MLP(nnx.Module):
  def __init__(self, sizes, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jnp.tanh(layer(x))
    return self.layers[-1](x)


def torch_mlp(sizes) -> torch.nn.Sequential:
  layers = []
  for a, b in zip(sizes[:-1], sizes[1:]):
    layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
  return torch.nn.Sequential(*layers[:-1])


def torch_name(path: str) -> tuple[str, bool]:
  """``['layers'][1]['kernel'].value`` -> (``2.weight``, transposed)."""
  parts = path.replace("'", "").replace("]", "").split("[")
  index, kind = int(parts[2]), parts[3].split(".")[0]
  return f"{2 * index}.{'weight' if kind == 'kernel' else 'bias'}", kind == "kernel"


@torch.no_grad()
def load_into_torch(model: torch.nn.Module, params) -> None:
  """Copies a Flax param tree into the torch model (DLPack view, then copy_)."""
  named = dict(model.named_parameters())
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, transposed = torch_name(jax.tree_util.keystr(path))
    view = dlpack.to_torch(leaf)  # zero-copy, read-only by contract
    named[name].copy_(view.T if transposed else view)


def data(n: int = 256, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(-2, 2, (n, 2)).astype(np.float32)
  y = (np.sin(2 * x[:, :1]) * np.cos(x[:, 1:]) + 0.1 * x[:, :1] ** 2).astype(np.float32)
  return x, y


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="60 steps (for the tests)")
  parser.add_argument("--steps", type=int, default=500)
  parser.add_argument("--dtype", default="bf16", choices=list(parity.DTYPES))
  parser.add_argument("--optimizer", default="adamw_bf16",
                      choices=["adamw_bf16", "adam_fp32_master", "scale_by_adamw"])
  parser.add_argument("--grads-from", default="jax", choices=["jax", "torch"])
  args = parser.parse_args(argv)
  steps = 60 if args.quick else args.steps
  dtype = jnp.dtype(parity.DTYPES[args.dtype])

  # 1. The same weights in both models.
  model = MLP(SIZES, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  twin = torch_mlp(SIZES)
  load_into_torch(twin, params)
  x, y = data()
  out_jax = np.asarray(model(jnp.asarray(x)))
  out_torch = twin(torch.from_numpy(x)).detach().numpy()
  print(f"fp32 forward, max |flax - torch| = {np.abs(out_jax - out_torch).max():.2e} "
        "(matmuls may sum in different orders)")

  # 2. The gradient source: either model, at the current (JAX-side) weights.
  def loss_fn(p, xb, yb):
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    return jnp.mean((nnx.merge(graphdef, wide)(xb) - yb) ** 2)

  jax_value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
  losses = []
  twin_lowp = torch_mlp(SIZES).to(getattr(torch, dtype.name))
  batches = [(x[i::4], y[i::4]) for i in range(4)]

  def grads(step, p):
    xb, yb = batches[step % len(batches)]
    loss, g = jax_value_and_grad(p, xb, yb)
    losses.append(float(loss))
    if args.grads_from == "jax":
      return g
    load_into_torch(twin_lowp, p)
    twin_lowp.zero_grad()
    out = twin_lowp(torch.from_numpy(xb).to(twin_lowp[0].weight.dtype)).float()
    torch.mean((out - torch.from_numpy(yb)) ** 2).backward()
    named = dict(twin_lowp.named_parameters())
    flat, treedef = jax.tree_util.tree_flatten_with_path(p)
    leaves = []
    for path, _ in flat:
      name, transposed = torch_name(jax.tree_util.keystr(path))
      g = named[name].grad
      leaves.append(dlpack.to_jax(g.T.contiguous() if transposed else g))
    return jax.tree.unflatten(treedef, leaves)

  # 3. Both optimizers, the same gradients, every buffer compared.
  report = parity.compare(args.optimizer, params, grads, steps=steps, dtype=dtype,
                          learning_rate=3e-3, weight_decay=0.01)
  print(report.table())
  print(f"grads from {args.grads_from}; {steps} steps in {report.seconds:.1f} s; "
        f"batch loss {losses[0]:.4f} -> {losses[-1]:.4f}")
  return 0 if report.ok else 1


if __name__ == "__main__":
  sys.exit(main())
