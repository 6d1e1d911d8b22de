"""What the two benchmark scripts share: the trees, the memory-bandwidth
yardstick, bytes per param, the table and the JSON.

Bytes moved per step (the roofline's numerator) are the algorithm's minimum:
every persistent buffer (params and optimizer state) read once and written
once, and the gradient read once: ``2 * (param + state) + grad`` bytes. The
yardstick is this machine's memory bandwidth, measured in the same process
with an in-place streaming op over 256 MB (read + write) and a copy; the best
of those is the "bandwidth" a step's GB/s is divided by.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

# (shape, count): ~16.8M params in 16 leaves of mixed shapes, or in 512 small
# leaves; "transformer": the 147 tensors (9.7M params) of a 12-layer
# transformer of width 256 (per layer: qkv, out, two feed-forward matrices,
# their biases, two norms' scales and biases), an embedding, a final norm and a scalar.
GPT2_LAYER = [((768,), 2), ((768, 2304), 1), ((2304,), 1), ((768, 768), 1), ((768,), 1),
              ((768,), 2), ((768, 3072), 1), ((3072,), 1), ((3072, 768), 1), ((768,), 1)]
TREES = {
    "standard": [((4096, 1024), 4), ((1024,), 8), ((), 4)],
    "many": [((32768,), 512)],
    "transformer": [((1000, 256), 1)] + [
        layer for _ in range(12) for layer in (
            ((768, 256), 1), ((768,), 1), ((256, 256), 1), ((256,), 1), ((1024, 256), 1),
            ((1024,), 1), ((256, 1024), 1), ((256,), 1), ((256,), 4))] + [((256,), 1), ((), 1)],
    "quick": [((1024, 1024), 1), ((1024,), 1), ((1024, 256), 1), ((), 1)],
    # The GPU's sizes: GPT-2 small (124M params in 148 tensors: token and position
    # embeddings, 12 layers of two norms, qkv, out, two feed-forward matrices and their
    # biases, a final norm) and a 1.3B model (24 such layers of width 2048, 292 tensors).
    "gpt2": [((50257, 768), 1), ((1024, 768), 1)] + [
        layer for _ in range(12) for layer in GPT2_LAYER] + [((768,), 2)],
    # GPT-2 with one layer (16 leaves, 83% of its params the embedding): every
    # leaf shape of "gpt2" for the static compile tests, in a ninth of the time.
    "gpt2-layer": [((50257, 768), 1), ((1024, 768), 1)] + GPT2_LAYER + [((768,), 2)],
    "1.3b": [((50257, 2048), 1), ((2048, 2048), 1)] + [
        layer for _ in range(24) for layer in (
            ((2048,), 2), ((2048, 6144), 1), ((6144,), 1), ((2048, 2048), 1), ((2048,), 1),
            ((2048,), 2), ((2048, 8192), 1), ((8192,), 1), ((8192, 2048), 1), ((2048,), 1))]
    + [((2048,), 2)],
}
BANDWIDTH_BYTES = 256 * 2**20
# The yardsticks' best of BANDWIDTH_REPS calls after BANDWIDTH_WARMUP: the
# first calls of a fresh buffer run slower, and the best of only a few calls
# reads several GB/s low.
BANDWIDTH_WARMUP, BANDWIDTH_REPS = 2, 20


def best_gb_per_s(run, moved_bytes: int) -> float:
  """GB/s of the fastest of ``BANDWIDTH_REPS`` calls of ``run`` (which
  returns when its work is done), after ``BANDWIDTH_WARMUP`` untimed ones."""
  for _ in range(BANDWIDTH_WARMUP):
    run()
  best = float("inf")
  for _ in range(BANDWIDTH_REPS):
    start = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - start)
  return moved_bytes / best / 1e9


# glibc: serve every allocation from the heap and keep freed memory for reuse.
# By default an allocation of 32 MiB or more (an XLA executable's temporaries:
# a 16.8M-param bf16 gradient is 33.6 MB) is a fresh mmap each step, whose
# pages are all faulted in again (benchmarks/README.md). glibc reads these at
# process start; calling mallopt() after start does not have the same effect.
HEAP_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def _glibc() -> bool:
  return platform.libc_ver()[0] == "glibc"


def heap_malloc_active() -> bool:
  """Whether this process runs on glibc and started with ``HEAP_MALLOC_ENV``."""
  return _glibc() and all(os.environ.get(k) == v for k, v in HEAP_MALLOC_ENV.items())


def rerun_with_heap_malloc(argv) -> None:
  """Runs this command again in this process's place, with ``HEAP_MALLOC_ENV``
  set (``--heap-malloc``); returns if it is set already, or (with a warning)
  where the C library is not glibc."""
  if heap_malloc_active():
    return
  if not _glibc():
    print("--heap-malloc: not glibc, nothing changed")
    return
  if argv is not None:
    raise ValueError("--heap-malloc needs a process started with "
                     + " ".join(f"{k}={v}" for k, v in HEAP_MALLOC_ENV.items()))
  # The interpreter's own flags (-X, -W) and `-m module` too.
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
            {**os.environ, **HEAP_MALLOC_ENV})


def shapes(tree: str) -> list:
  return [shape for shape, count in TREES[tree] for _ in range(count)]


def interleaved(runs: dict, reps: int):
  """The runs in the order of each repetition: all of them every time, in
  an order shuffled anew each repetition (seeded), so no run always follows
  the same one (a step right after a heavy one can run slower:
  benchmarks/README.md)."""
  order = list(runs.values())
  rng = random.Random(0)
  for _ in range(reps):
    rng.shuffle(order)
    yield from order


# Idle time before each timed step (``--settle-ms``; default 0, back to
# back). Idle changes what it measures on a machine with few cores: XLA's pool
# threads park, and waking them costs a step with many parallel loops. With
# 20 ms before each step on 2 cores, optax.adamw fp32 took 13.6 ms against
# 9.4-10.4 back to back, while the Kahan step in place stayed at 6.8-7.1
# (benchmarks/README.md).
SETTLE_MS = 0.0


def add_settle_argument(parser) -> None:
  parser.add_argument("--settle-ms", type=float, default=SETTLE_MS,
                      help=f"idle milliseconds before each timed step (default {SETTLE_MS:g}; "
                           "0: back to back)")


def settle(ms: float) -> None:
  if ms > 0:
    time.sleep(ms / 1e3)


# Python's cyclic garbage collector during the timed steps (``--gc``). Each
# jitted call returns a new Python object per array (2,048 a step in the tree
# layout of 512 leaves), which sets off collections, and a full one walks
# every object in the process. Measured: about 1 ms a step on `many`, in
# every row (benchmarks/README.md).
# "on": as a training loop runs by default; "freeze": ``gc.freeze()`` after
# setup (the objects alive then are never walked again, the steps' arrays
# are still collected); "off": no collection while timing (as ``timeit`` does).
GC_MODES = ("on", "freeze", "off")


def add_gc_argument(parser) -> None:
  parser.add_argument("--gc", choices=GC_MODES, default="on",
                      help="Python's garbage collector during the timed steps: on (default), "
                           "freeze (gc.freeze() after setup) or off")


@contextlib.contextmanager
def garbage_collection(mode: str):
  """Runs the block with Python's collector in ``mode`` (``GC_MODES``);
  restores it (enabled, nothing frozen) after."""
  if mode not in GC_MODES:
    raise ValueError(f"gc mode must be one of {GC_MODES}; got {mode!r}.")
  gc.collect()
  if mode == "freeze":
    gc.freeze()
  elif mode == "off":
    gc.disable()
  try:
    yield
  finally:
    gc.enable()
    gc.unfreeze()


def median_ms(times) -> float:
  return statistics.median(times) * 1e3


def cpu(kernel_library=None) -> dict:
  """The machine a run measured: its CPU model (Linux: /proc/cpuinfo), the
  CPUs this process may use, and the lanes of the native kernel library the
  run stepped with (``kernel_library``: the ctypes library, None where it is
  not built; 16: AVX-512, 8: AVX2, 1: scalar, 0: not built) and whether it
  has fp16 params (F16C). Results of different CPUs differ in kind, not only
  in degree (benchmarks/README.md), so every JSON says which."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cores = os.cpu_count() or 1
  import optax_half_native  # noqa: PLC0415
  built = kernel_library is not None  # a run on a GPU builds nothing for the report
  return dict(model=model, machine=platform.machine(), cores=cores,
              kernel_lanes=optax_half_native.lanes(kernel_library) if built else 0,
              kernel_f16=built and optax_half_native.has_f16(kernel_library))


def report(title: str, runs: dict, reference: str, n_params: int, bandwidth: dict,
           json_path=None, extra=None, kernel_library=None) -> dict:
  """Prints the table (ratios to ``reference``) and writes JSON; returns the
  JSON dict. ``kernel_library``: the native library the framework stepped with."""
  best_bw = max(bandwidth.values())
  width = max(56, *map(len, runs))
  ref = median_ms(runs[reference]["times"])
  machine = cpu(kernel_library)
  lanes = machine["kernel_lanes"]
  kernel = f"kernel lanes {lanes}" if lanes else "kernel not used"
  print(f"{title}: {n_params / 1e6:.2f}M params; {machine['model']} ({machine['machine']}, "
        f"{machine['cores']} CPUs, {kernel}"
        f"{', fp16' if machine['kernel_f16'] else ''}); memory "
        f"bandwidth " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items()))
  print(f"{'optimizer':{width}s} {'ms/step':>8s} {'vs ref':>7s} {'B/param':>8s} {'moved B/p':>9s} "
        f"{'GB/s':>6s} {'of bw':>6s} {'setup s':>8s}")
  table = {}
  for name, r in runs.items():
    ms = median_ms(r["times"])
    gbs = r["moved_per_param"] * n_params / (ms * 1e-3) / 1e9
    row = dict(ms=ms, speed_vs_ref=ref / ms, ratio=ref / ms, bytes_per_param=r["bytes_per_param"],
               moved_bytes_per_param=r["moved_per_param"], gb_per_s=gbs,
               fraction_of_bandwidth=gbs / best_bw, setup_s=r["setup_s"],
               times_ms=[t * 1e3 for t in r["times"]], **r.get("extra", {}))
    table[name] = row
    print(f"{name:{width}s} {ms:8.2f} {ref / ms:6.2f}x {r['bytes_per_param']:8.1f} "
          f"{r['moved_per_param']:9.1f} {gbs:6.1f} {gbs / best_bw:6.0%} {r['setup_s']:8.2f}")
  out = dict(title=title, params=n_params, reference=reference, bandwidth_gb_per_s=bandwidth,
             cpu=machine, runs=table, **(extra or {}))
  if json_path:
    with open(json_path, "w") as f:
      json.dump(out, f, indent=1)
  return out


# -- Memory: resident bytes and transient peaks, per row ------------------------
# Each row is measured in a fresh process (``memory_rows``), so no other row's
# freed memory hides its peaks. glibc keeps freed memory below its mmap threshold
# for reuse, and the threshold grows with what was freed: with it fixed at 64 KiB
# (MALLOC_MMAP_THRESHOLD_) every array is its own mapping, returned when freed, and
# the resident set follows the live arrays.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _status(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise OSError(f"no {field} in /proc/self/status")


def resident_bytes() -> int:
  """This process's resident set (VmRSS)."""
  return _status("VmRSS")


def reset_peak() -> None:
  """Resets the process's high-water mark (VmHWM) to its resident set (Linux)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def peak_bytes() -> int:
  """The process's high-water mark (VmHWM) since start or ``reset_peak``."""
  return _status("VmHWM")


def memory_supported() -> bool:
  """Whether ``reset_peak`` works here (Linux with /proc/self/clear_refs)."""
  try:
    reset_peak()
    peak_bytes()
  except OSError:
    return False
  return True


def memory_rows(module: str, names, argv) -> dict:
  """name -> what ``python -m module --memory-row NAME *argv`` prints (a JSON line), each
  row in a fresh process with ``MEMORY_ENV``; a row that fails gives its error."""
  import subprocess  # noqa: PLC0415
  out = {}
  for name in names:
    proc = subprocess.run([sys.executable, "-m", module, "--memory-row", name, *argv],
                          capture_output=True, text=True,
                          env={**os.environ, **MEMORY_ENV})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    out[name] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                 else dict(error=(proc.stderr or proc.stdout).strip().splitlines()[-1:]))
  return out


def print_memory(rows: dict) -> None:
  """The memory table: bytes per param resident (params + one gradient + state), the
  state's, the peaks above resident while making the state (init) and stepping, and
  what making the state left resident beyond the state ("kept")."""
  width = max([56, *map(len, rows)])
  print(f"\n{'memory (B/param; peak: above resident)':{width}s} {'resident':>8s} {'state':>6s} "
        f"{'init pk':>7s} {'kept':>6s} {'step pk':>7s}")
  for name, r in rows.items():
    if "error" in r:
      print(f"{name:{width}s} error: {r['error']}")
      continue
    shown = {k: max(v, 0.0) for k, v in r.items()}  # a peak below resident: freed memory
    print(f"{name:{width}s} {shown['resident']:8.2f} {shown['state']:6.2f} "
          f"{shown['init_peak']:7.2f} {shown['init_kept']:6.2f} {shown['step_peak']:7.2f}")
