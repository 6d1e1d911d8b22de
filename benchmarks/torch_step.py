"""torch_bridge step time, as ratios to torch.optim.AdamW(fused=True) fp32 in the same process.

    python -m benchmarks.torch_step [--quick] [--json PATH]

The tree is the one of ``benchmarks/step.py`` (16.8M params in 16 leaves;
``--quick``: 1.3M). Runs are interleaved (A B C ... A B C ...), the median of
the repetitions after a warm-up is reported; ``fused=True`` compile time is
paid in the warm-up and reported separately. Bytes/param count the params, one
gradient and every state tensor the optimizer holds. Goals and analysis: the
benchmarks issue (benchmarks/README.md once it lands).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torch_bridge as tb


def make_tree(quick: bool):
  gen = torch.Generator().manual_seed(0)
  shapes = [(1024, 1024), (1024,), (1024, 256), ()] if quick else \
           [(4096, 1024)] * 4 + [(1024,)] * 8 + [()] * 4
  return [torch.randn(s, generator=gen) * 0.02 for s in shapes]


def candidates(lr=1e-3):
  bf16, f32 = torch.bfloat16, torch.float32
  return {
      "torch AdamW fused fp32 (reference)": (f32, lambda ps: torch.optim.AdamW(ps, lr, fused=True)),
      "torch AdamW foreach fp32": (f32, lambda ps: torch.optim.AdamW(ps, lr, foreach=True)),
      "torch AdamW fused bf16 (naive)": (bf16, lambda ps: torch.optim.AdamW(ps, lr, fused=True)),
      "adamw_bf16 kahan": (bf16, lambda ps: tb.adamw_bf16(ps, lr)),
      "adamw_bf16 kahan fused": (bf16, lambda ps: tb.adamw_bf16(ps, lr, fused=True)),
      "adamw_bf16 kahan fused, nearest moments": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, fused=True, state_rounding="nearest")),
      "adamw_bf16 stochastic fused": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, compensation="stochastic", fused=True)),
      "adam_fp32_master fused": (bf16, lambda ps: tb.adam_fp32_master(ps, lr, fused=True)),
      "master_weights(AdamW fused)": (
          bf16, lambda ps: tb.master_weights(torch.optim.AdamW(ps, lr, fused=True))),
  }


def state_bytes(opt) -> int:
  total = 0
  for o in (opt, getattr(opt, "inner", None)):
    if o is not None:
      for state in o.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0)
  return total


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  reps = args.reps or (5 if args.quick else 11)
  tree = make_tree(args.quick)
  n = sum(x.numel() for x in tree)
  runs = {}
  for name, (dtype, make) in candidates().items():
    params = [x.to(dtype, copy=True).requires_grad_() for x in tree]
    for p in params:
      p.grad = (p.detach() * 0.1).to(dtype)
    opt = make(params)
    start = time.perf_counter()
    opt.step()  # warm-up (and compile, for fused=True)
    warm = time.perf_counter() - start
    nbytes = sum(p.numel() * p.element_size() * 2 for p in params) + state_bytes(opt)
    runs[name] = dict(opt=opt, times=[], warmup_s=warm, bytes_per_param=nbytes / n)
  for _ in range(reps):
    for run in runs.values():
      start = time.perf_counter()
      run["opt"].step()
      run["times"].append(time.perf_counter() - start)
  ref = statistics.median(next(iter(runs.values()))["times"])
  print(f"{n / 1e6:.1f}M params, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"median of {reps}\n")
  print(f"{'optimizer':42s} {'ms/step':>8s} {'speed vs ref':>12s} {'B/param':>8s} {'warm-up s':>9s}")
  table = {}
  for name, run in runs.items():
    ms = statistics.median(run["times"]) * 1e3
    table[name] = dict(ms=ms, speed_vs_ref=ref * 1e3 / ms, bytes_per_param=run["bytes_per_param"],
                       warmup_s=run["warmup_s"])
    print(f"{name:42s} {ms:8.1f} {ref * 1e3 / ms:11.2f}x {run['bytes_per_param']:8.1f} "
          f"{run['warmup_s']:9.1f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(params=n, runs=table), f, indent=1)


if __name__ == "__main__":
  main()
