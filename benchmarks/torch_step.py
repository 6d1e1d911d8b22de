"""torch optimizer step time, as ratios to torch.optim.AdamW(fused=True) fp32 in the same process.

    python -m benchmarks.torch_step [--tree standard|many|quick] [--quick] [--reps N]
                                    [--only A,B] [--heap-malloc] [--gc on|freeze|off]
                                    [--settle-ms MS] [--device cpu|cuda] [--json PATH]
                                    [--memory on|off]

The trees of benchmarks/step.py. Runs are interleaved (every run once per
repetition, in an order shuffled each repetition), the median of the
repetitions after a warm-up step ("setup s": the first step, which builds the
native kernel or compiles ``fused=True`` code the first time in a process).
Bytes/param count the params, one gradient and every state tensor the
optimizer holds; "moved" is the algorithm's minimum traffic
(benchmarks/common.py). ``optimi`` (``pip install torch-optimi``, the
``bench`` extra) is skipped when it is not installed; the seed's ScaledAdam
is benchmarks/seed_scaled_adam.py. The memory table (``--memory on``, the
default): per row, in a fresh process, bytes per param resident and the peaks
above it at the first step (which makes the state) and a later one. Findings:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import optax_half_native as native
import torch_bridge as tb
from benchmarks import common
from benchmarks.seed_scaled_adam import SeedScaledAdam


def make_tree(tree: str, device="cpu"):
  gen = torch.Generator().manual_seed(0)
  return [(torch.randn(s, generator=gen) * 0.02).to(device) for s in common.shapes(tree)]


def candidates(lr=1e-3, device="cpu"):
  bf16, f32 = torch.bfloat16, torch.float32
  out = {
      "torch AdamW fused fp32 (reference)": (f32, lambda ps: torch.optim.AdamW(ps, lr, fused=True)),
      "torch AdamW foreach fp32": (f32, lambda ps: torch.optim.AdamW(ps, lr, foreach=True)),
      "torch AdamW fused bf16 (naive)": (bf16, lambda ps: torch.optim.AdamW(ps, lr, fused=True)),
      "adamw_bf16 kahan": (bf16, lambda ps: tb.adamw_bf16(ps, lr)),
      "adamw_bf16 kahan, nearest moments": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, state_rounding="nearest")),
      "adamw_bf16 split": (bf16, lambda ps: tb.adamw_bf16(ps, lr, compensation="split")),
      "adamw_bf16 stochastic": (bf16, lambda ps: tb.adamw_bf16(ps, lr, compensation="stochastic")),
      "adam_fp32_master": (bf16, lambda ps: tb.adam_fp32_master(ps, lr)),
      "adam_fp32_master fp16": (torch.float16, lambda ps: tb.adam_fp32_master(ps, lr)),
      "adamw_bf16 kahan fp16": (torch.float16, lambda ps: tb.adamw_bf16(ps, lr)),
      "master_weights(AdamW fused) foreach=True": (bf16, lambda ps: tb.master_weights(
          torch.optim.AdamW(ps, lr, fused=True), foreach=True)),
      "master_weights(AdamW fused) foreach=False": (
          bf16, lambda ps: tb.master_weights(torch.optim.AdamW(ps, lr, fused=True),
                                             foreach=False)),
      "kahan_summation(AdamW fused) foreach=True": (bf16, lambda ps: tb.kahan_summation(
          torch.optim.AdamW(ps, lr, fused=True), foreach=True)),
      "kahan_summation(AdamW fused) foreach=False": (bf16, lambda ps: tb.kahan_summation(
          torch.optim.AdamW(ps, lr, fused=True), foreach=False)),
      "adamw_bf16 kahan, eager per-tensor (fused=False)": (
          bf16, lambda ps: tb.adamw_bf16(ps, lr, fused=False)),
      "scaled_adam": (bf16, lambda ps: tb.scaled_adam(ps, lr)),
      "scaled_adam clip 2.0": (bf16, lambda ps: tb.scaled_adam(ps, lr, clipping_scale=2.0)),
      "scaled_adam clip 2.0 fp32": (f32, lambda ps: tb.scaled_adam(ps, lr, clipping_scale=2.0)),
      "scaled_adam clip 2.0 eager (fused=False)": (
          bf16, lambda ps: tb.scaled_adam(ps, lr, clipping_scale=2.0, fused=False)),
      "seed ScaledAdam clip 2.0 (stacked eager)": (
          bf16, lambda ps: SeedScaledAdam(ps, lr, clipping_scale=2.0)),
      "seed ScaledAdam clip 2.0 fp32 (stacked eager)": (
          f32, lambda ps: SeedScaledAdam(ps, lr, clipping_scale=2.0)),
  }
  if torch.device(device).type != "cpu":  # on CPU the default is the native kernel, as True
    out["adamw_bf16 kahan (fused=False)"] = (bf16, lambda ps: tb.adamw_bf16(ps, lr, fused=False))
    out["adamw_bf16 kahan (fused=True)"] = (bf16, lambda ps: tb.adamw_bf16(ps, lr, fused=True))
  try:
    import optimi  # noqa: PLC0415
  except ImportError:
    return out
  out["optimi AdamW kahan_sum bf16"] = (
      bf16, lambda ps: optimi.AdamW(ps, lr, kahan_sum=True, foreach=True))
  out["optimi AdamW kahan_sum bf16 (for-loop)"] = (
      bf16, lambda ps: optimi.AdamW(ps, lr, kahan_sum=True, foreach=False))
  return out


def waiter(device: torch.device):
  """What makes a timed call return when its work is done: on CUDA, a wait
  for the device (kernels are queued asynchronously); nothing on CPU."""
  if device.type == "cuda":
    return lambda: torch.cuda.synchronize(device)
  return lambda: None


def split_times(opt, device: torch.device, steps: int = 20) -> dict:
  """On CUDA, what a training step pays, apart: ``host_ms``, the median wall
  time of ``opt.step()`` returning without waiting for the device, and
  ``device_ms``, CUDA events around ``steps`` steps queued back to back
  (the device's time per step while the host is ahead of it;
  ``host_bound`` says where it was not)."""
  torch.cuda.synchronize(device)
  host = []
  for _ in range(steps):
    start = time.perf_counter()
    opt.step()
    host.append(time.perf_counter() - start)
  torch.cuda.synchronize(device)
  first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  first.record()
  for _ in range(steps):
    opt.step()
  last.record()
  torch.cuda.synchronize(device)
  device_ms = first.elapsed_time(last) / steps
  host_ms = float(np.median(host)) * 1e3
  return dict(host_ms=host_ms, device_ms=device_ms, host_bound=host_ms >= device_ms,
              device_timing="CUDA events around back-to-back steps")


def bandwidth(device: torch.device) -> dict:
  x = torch.ones(common.BANDWIDTH_BYTES // 4, device=device)
  y = torch.empty_like(x)
  wait = waiter(device)
  return {name: common.best_gb_per_s(lambda fn=fn: (fn(), wait()), 2 * common.BANDWIDTH_BYTES)
          for name, fn in (("in-place scale", lambda: x.mul_(1.0000001)),
                           ("copy", lambda: y.copy_(x)))}


def state_bytes(opt) -> int:
  total = 0
  for o in (opt, getattr(opt, "inner", None)):
    if o is not None:
      for state in o.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0)
  return total


# The rows whose memory is measured (each in a fresh process, ``--memory``): resident
# bytes and the transient peaks of the first step (which makes the state: torch.optim's
# lazy state) and of a later one.
MEMORY_ROWS = ("torch AdamW fused fp32 (reference)", "torch AdamW fused bf16 (naive)",
               "adamw_bf16 kahan", "adamw_bf16 split", "adamw_bf16 stochastic",
               "adam_fp32_master", "adamw_bf16 kahan fp16", "scaled_adam clip 2.0",
               "optimi AdamW kahan_sum bf16")
QUICK_MEMORY_ROWS = ("torch AdamW fused fp32 (reference)", "adamw_bf16 kahan", "adam_fp32_master")


def memory_row(name: str, tree_name: str, device: str) -> dict:
  """Bytes per param of one row, in this process: the state, the resident params +
  gradients + state, the peak above params + gradients + state while the first step
  makes the state ("init"; the kernel built before, on a throwaway optimizer), what it
  left beyond the state ("kept"), and the peak above resident during a later step. CPU:
  the process's high-water mark (fresh process, ``common.MEMORY_ENV``); CUDA: the
  allocator's peak (``torch.cuda.max_memory_allocated``)."""
  dtype, make = candidates(device=device)[name]
  dev = torch.device(device)
  if dev.type == "cuda":
    def resident():
      return torch.cuda.memory_allocated(dev)

    def reset():
      torch.cuda.synchronize(dev)
      torch.cuda.reset_peak_memory_stats(dev)

    def peak():
      torch.cuda.synchronize(dev)
      return torch.cuda.max_memory_allocated(dev)
  else:
    resident, reset, peak = common.resident_bytes, common.reset_peak, common.peak_bytes
  tree = make_tree(tree_name, device)
  n = sum(x.numel() for x in tree)
  params = [x.to(dtype, copy=True).requires_grad_() for x in tree]
  for p in params:
    p.grad = (p.detach() * 0.1).to(dtype)
  del tree
  warm = [torch.zeros(4, 4, dtype=dtype, device=device, requires_grad=True)]
  warm[0].grad = torch.zeros_like(warm[0])
  make(warm).step()  # builds the native kernel / compiles: not a per-step cost
  opt = make(params)
  base = resident()
  reset()
  opt.step()  # the first step makes the state
  state = state_bytes(opt)
  init_peak, kept = peak() - base - state, resident() - base - state
  opt.step()
  before = resident()
  reset()
  opt.step()
  step_peak = peak() - before
  grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
  return dict(state=state / n, resident=(2 * grad_bytes + state) / n, init_peak=init_peak / n,
              init_kept=kept / n, step_peak=step_peak / n)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--tree", choices=list(common.TREES), default=None)
  parser.add_argument("--quick", action="store_true", help="small tree, few repetitions")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--only", default=None, help="comma-separated candidate names (+ reference)")
  parser.add_argument("--json", default=None)
  parser.add_argument("--device", default="cpu",
                      help="where the params and state live: cpu (default) or cuda; on CUDA "
                           "each timed step ends with a wait for the device")
  common.add_settle_argument(parser)
  common.add_gc_argument(parser)
  parser.add_argument("--memory", choices=["on", "off"], default="on",
                      help="measure MEMORY_ROWS' resident bytes and peaks, each in a fresh "
                           "process (CPU: Linux only)")
  parser.add_argument("--memory-row", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--heap-malloc", action="store_true",
                      help="rerun with glibc serving large allocations from the heap "
                           "(common.HEAP_MALLOC_ENV)")
  args = parser.parse_args(argv)
  tree_name = args.tree or ("quick" if args.quick else "standard")
  if args.memory_row:
    print(json.dumps(memory_row(args.memory_row, tree_name, args.device)))
    return None
  if args.heap_malloc:
    common.rerun_with_heap_malloc(argv)
  heap_malloc = common.heap_malloc_active()
  reps = args.reps or (3 if args.quick else 11)
  device = torch.device(args.device)
  wait = waiter(device)
  tree = make_tree(tree_name, device)
  n = sum(x.numel() for x in tree)
  bw = bandwidth(device)
  chosen = candidates(device=args.device)
  if args.only:
    keep = {"torch AdamW fused fp32 (reference)", *args.only.split(",")}
    chosen = {k: v for k, v in chosen.items() if k in keep}
  runs = {}
  for name, (dtype, make) in chosen.items():
    params = [x.to(dtype, copy=True).requires_grad_() for x in tree]
    for p in params:
      p.grad = (p.detach() * 0.1).to(dtype)
    opt = make(params)
    start = time.perf_counter()
    opt.step()  # warm-up: builds the kernel / compiles on first use in the process
    wait()
    setup = time.perf_counter() - start
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    persistent = param_bytes + state_bytes(opt)
    runs[name] = dict(opt=opt, times=[], setup_s=setup,
                      bytes_per_param=(persistent + param_bytes) / n,
                      moved_per_param=(2 * persistent + param_bytes) / n)
  with common.garbage_collection(args.gc):
    for run in common.interleaved(runs, reps):
      common.settle(args.settle_ms)
      start = time.perf_counter()
      run["opt"].step()
      wait()
      run["times"].append(time.perf_counter() - start)
  if device.type == "cuda":
    for run in runs.values():
      run["extra"] = split_times(run["opt"], device)
    ref_device = runs["torch AdamW fused fp32 (reference)"]["extra"]["device_ms"]
    for name, run in runs.items():
      run["extra"].update(name=name, tree=tree_name,
                          device_ratio=ref_device / run["extra"]["device_ms"])
  where = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"{torch.get_num_threads()} threads")
  memory = {}
  if args.memory == "on" and (device.type == "cuda" or common.memory_supported()):
    names = [k for k in (QUICK_MEMORY_ROWS if args.quick else MEMORY_ROWS) if k in chosen]
    memory = common.memory_rows("benchmarks.torch_step", names,
                                ["--tree", tree_name, "--device", args.device])
  out = common.report(
      f"torch {torch.__version__}, {where}, tree {tree_name}"
      f"{', heap-only malloc' if heap_malloc else ''}"
      f"{'' if args.gc == 'on' else f', gc {args.gc}'}", runs,
      "torch AdamW fused fp32 (reference)", n, bw, args.json,
      extra=dict(framework="torch", device=str(device), tree=tree_name, reps=reps,
                 heap_malloc=heap_malloc, settle_ms=args.settle_ms, gc=args.gc,
                 memory_bytes_per_param=memory),
      kernel_library=native.library() if device.type == "cpu" else None)
  if device.type == "cuda":
    print(f"{'what a step pays (CUDA)':48s} {'device ms':>9s} {'vs ref':>7s} {'host ms':>8s}")
    for name, run in runs.items():
      e = run["extra"]
      print(f"{name:48s} {e['device_ms']:9.3f} {e['device_ratio']:6.2f}x {e['host_ms']:8.3f}"
            f"{'  (host-bound)' if e['host_bound'] else ''}")
  if memory:
    common.print_memory(memory)
  return out


if __name__ == "__main__":
  main()
