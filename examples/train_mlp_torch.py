"""Stale bf16 weights and their cure, on a teacher-student MLP (PyTorch, CPU).

The torch twin of ``examples/train_mlp.py``: a student MLP learns a fixed
random teacher; every run sees the same data and initial weights, the forward
pass is fp32 in every run, and only the storage precision and the optimizer
differ.

    python examples/train_mlp_torch.py            # the full comparison
    python examples/train_mlp_torch.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_bridge as tb

IN, HIDDEN, OUT = 64, 256, 64
BATCH = 128


def init_mlp(generator, hidden=HIDDEN):
  return {
      "w1": torch.randn(IN, hidden, generator=generator) / IN**0.5,
      "b1": torch.zeros(hidden),
      "w2": torch.randn(hidden, OUT, generator=generator) / hidden**0.5,
      "b2": torch.zeros(OUT),
  }


def mlp(params, x):
  p = {k: v.float() for k, v in params.items()}  # fp32 compute
  return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def runs(lr):
  """name -> (param dtype, optimizer factory). Same hyperparameters everywhere."""
  bf16 = torch.bfloat16
  return {
      "fp32 torch.optim.AdamW (reference)": (
          torch.float32, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)),
      "bf16 torch.optim.AdamW (naive)": (
          bf16, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)),
      "bf16 adamw_bf16 kahan": (bf16, lambda ps: tb.adamw_bf16(ps, lr, weight_decay=0.0)),
      "bf16 adamw_bf16 split": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, weight_decay=0.0, compensation="split")),
      "bf16 adamw_bf16 stochastic": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, weight_decay=0.0, compensation="stochastic")),
      "bf16 adamw_bf16 kahan, nearest moments": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, weight_decay=0.0, state_rounding="nearest")),
      "bf16 adamw_bf16 kahan, fp32 moments": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, weight_decay=0.0, mu_dtype=torch.float32,
                                         nu_dtype=torch.float32)),
      "bf16 adam_fp32_master": (bf16, lambda ps: tb.adam_fp32_master(ps, lr)),
      "bf16 master_weights(torch.optim.AdamW)": (
          bf16, lambda ps: tb.master_weights(torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))),
      "bf16 kahan_summation(torch.optim.AdamW)": (
          bf16, lambda ps: tb.kahan_summation(torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))),
  }


def state_bytes(opt) -> int:
  """Bytes of every tensor the optimizer (and a wrapped one) keeps per param."""
  total = 0
  for o in (opt, getattr(opt, "inner", None)):
    if o is None:
      continue
    for state in o.state.values():
      total += sum(v.numel() * v.element_size() for v in state.values()
                   if torch.is_tensor(v) and v.dim() > 0)
  return total


def train(dtype, make_opt, steps, hidden=HIDDEN, seed=0):
  """Returns (final held-out loss, optimizer bytes/param, ms/step)."""
  gen = torch.Generator().manual_seed(seed)
  teacher = init_mlp(gen, hidden)
  params = {k: v.to(dtype).requires_grad_() for k, v in init_mlp(gen, hidden).items()}
  x_eval = torch.randn(2048, IN, generator=gen)
  with torch.no_grad():
    y_eval = mlp(teacher, x_eval)
  opt = make_opt(list(params.values()))
  start = time.perf_counter()
  for _ in range(steps):
    x = torch.randn(BATCH, IN, generator=gen)
    with torch.no_grad():
      y = mlp(teacher, x)
    loss = torch.mean((mlp(params, x) - y) ** 2)
    opt.zero_grad()
    loss.backward()
    opt.step()
  ms = (time.perf_counter() - start) * 1e3 / steps
  with torch.no_grad():
    final = float(torch.mean((mlp(params, x_eval) - y_eval) ** 2))
  n = sum(v.numel() for v in params.values())
  return final, state_bytes(opt) / n, ms


def compare(steps=2500, lr=3e-4, hidden=HIDDEN, only=None):
  results = {}
  for name, (dtype, make_opt) in runs(lr).items():
    if only is None or name in only:
      results[name] = train(dtype, make_opt, steps, hidden)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=2500)
  parser.add_argument("--lr", type=float, default=3e-4)
  parser.add_argument("--hidden", type=int, default=HIDDEN)
  parser.add_argument("--quick", action="store_true", help="a few seconds, for CI")
  args = parser.parse_args()
  torch.set_num_threads(max(1, torch.get_num_threads()))
  steps = 300 if args.quick else args.steps
  print(f"teacher-student MLP {IN}-{args.hidden}-{OUT}, batch {BATCH}, "
        f"{steps} steps, lr {args.lr}, torch {torch.__version__}\n")
  results = compare(steps, args.lr, args.hidden)
  ref = results["fp32 torch.optim.AdamW (reference)"][0]
  print(f"{'run':42s} {'eval loss':>10s} {'vs fp32':>8s} {'opt B/param':>12s} {'ms/step':>8s}")
  for name, (loss, bpp, ms) in results.items():
    print(f"{name:42s} {loss:10.3e} {loss / ref:8.3f} {bpp:12.1f} {ms:8.3f}")
  print("\nopt B/param: optimizer state only (add 2+2 bytes of bf16 param and grad, "
        "or 4+4 for fp32).")


if __name__ == "__main__":
  main()
