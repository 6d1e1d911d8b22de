"""The benchmark scripts run (--quick) and report what they say they report.

No timing is asserted: only that every run has a time, the byte counts that
follow from the dtypes, and a measured bandwidth to divide by.
"""

import json
import os
import pathlib
import platform
import subprocess
import sys

import jax
import pytest

import optax_half_native as native
from benchmarks import step
from optax_half import _native as jax_native

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _check(out, path, expected_bytes):
  assert json.loads(path.read_text()) == json.loads(json.dumps(out))
  assert all(v > 1.0 for v in out["bandwidth_gb_per_s"].values())
  assert out["cpu"]["model"] and out["cpu"]["cores"] >= 1
  assert out["cpu"]["kernel_lanes"] in (0, 1, 8, 16)
  for name, row in out["runs"].items():
    assert len(row["times_ms"]) == out["reps"] and row["ms"] > 0, name
    assert (0 < row["fraction_of_bandwidth"]) == (row["moved_bytes_per_param"] > 0), name
  for name, (per_param, moved) in expected_bytes.items():
    row = out["runs"][name]
    # Scalars and leaf-count rounding aside, the bytes follow from the dtypes.
    assert row["bytes_per_param"] == pytest.approx(per_param, rel=1e-3), name
    assert row["moved_bytes_per_param"] == pytest.approx(moved, rel=1e-3), name


# The Flax steps with optax_half's drop-ins: in place, so XLA itself touches
# no param (custom calls count as 0 bytes in cost_analysis).
FLAX_ROWS = ("oh.nnx.Optimizer adamw_bf16 kahan", "oh.TrainState adamw_bf16 kahan",
             "oh.nnx.Optimizer adamw_bf16 kahan (cached_partial)",
             "oh.nnx.Optimizer adamw_bf16 kahan flat_state (cached_partial)",
             "oh.nnx.Optimizer adamw_bf16 kahan (functional)",
             "oh.nnx.Optimizer adamw_bf16 kahan (jit_partial)",
             "oh.nnx.Optimizer adamw_bf16 kahan flat_state (jit_partial)")


@pytest.mark.slow  # a benchmark process's worth of compiles and timed steps
def test_jax_benchmark_quick(tmp_path):
  path = tmp_path / "jax.json"
  f16_in_place = "adamw_bf16 kahan fp16" + step.IN_PLACE_SUFFIX
  master_f16 = "adam_fp32_master fp16" + step.IN_PLACE_SUFFIX
  out = step.main(["--quick", "--reps", "2", "--json", str(path), "--only",
                   ",".join(["adamw_bf16 kahan", "adam_fp32_master",
                             "adamw_bf16 kahan (update_and_apply)", f16_in_place, master_f16,
                             step.FLOOR, *step.CLIPPED, *FLAX_ROWS])])
  _check(out, path, {"optax.adamw fp32 (reference)": (16, 28), "adamw_bf16 kahan": (10, 18),
                     "adam_fp32_master": (16, 30), "adamw_bf16 kahan (update_and_apply)": (10, 18),
                     f16_in_place: (14, 26), master_f16: (16, 30), step.FLOOR: (10, 0),
                     **{name: (10, 20) for name in step.CLIPPED},
                     **{name: (10, 18) for name in FLAX_ROWS}})
  # The lanes and fp16 of the library JAX stepped with (the FFI one).
  lib = native.ffi_library(jax.ffi.include_dir())
  assert out["cpu"]["kernel_lanes"] == (native.lanes(lib) if lib is not None else 0)
  assert out["cpu"]["kernel_f16"] == native.has_f16(lib)
  runs = out["runs"]
  assert runs["adamw_bf16 kahan"]["xla_bytes_accessed_per_param"] > 0
  if jax.default_backend() == "cpu" and jax_native.available():
    for name in FLAX_ROWS:
      assert runs[name]["xla_bytes_accessed_per_param"] < 0.5, name
  if jax.default_backend() == "cpu" and jax_native.available():  # the kernel's temporaries
    _check_cpu_temporaries(runs)
  assert out["settle_ms"] == 0.0 and out["gc"] == "on"
  memory = out["memory_bytes_per_param"]
  if os.path.exists("/proc/self/clear_refs"):  # each row in a fresh process
    assert set(memory) == set(step.QUICK_MEMORY_ROWS)
    for name, row in memory.items():
      assert row["resident"] == pytest.approx(out["runs"][name]["bytes_per_param"], abs=0.01)
      assert row["init_peak"] < 1.0, name  # the quick tree: no more than a leaf above
    assert memory["adamw_bf16 kahan (update_and_apply)"]["step_peak"] < 0.5


@pytest.mark.slow  # two more benchmark processes' worth of compiles
def test_jax_benchmark_flags(monkeypatch):
  """--settle-ms, --gc and --grads in-step (the Flax rows too: nnx.grad,
  jax.grad of the linear loss: fp32 coefficients in, the step's bytes
  unchanged)."""
  bandwidth = {"in-place scale": 50.0, "copy": 25.0}  # not measured again
  monkeypatch.setattr(step, "bandwidth", lambda: bandwidth)
  idle = step.main(["--quick", "--reps", "1", "--settle-ms", "5", "--gc", "freeze",
                    "--only", "scaled_adam"])
  assert idle["settle_ms"] == 5.0 and idle["gc"] == "freeze"
  split = step.main(["--quick", "--reps", "2", "--memory", "off", "--split", "3", "--only",
                     "adamw_bf16 kahan (update_and_apply),adamw_bf16 kahan"])
  for name, row in split["runs"].items():  # device and host time apart, the reference's too
    assert row["device_ms"] > 0 and row["host_ms"] > 0 and row["device_ratio"] > 0, name
    assert row["name"] == name and row["tree"] == "quick" and row["ratio"] > 0, name
  in_step = step.main(["--quick", "--reps", "1", "--grads", "in-step", "--only",
                       ",".join(["adamw_bf16 kahan (update_and_apply)", *FLAX_ROWS])])
  assert set(in_step["runs"]) == {"optax.adamw fp32 (reference)",
                                  "adamw_bf16 kahan (update_and_apply)", *FLAX_ROWS}
  if jax.default_backend() == "cpu" and jax_native.available():
    for name in FLAX_ROWS:
      assert in_step["runs"][name]["xla_temp_bytes_per_param"] < 2.5, name


@pytest.mark.parametrize("mode", ["on", "freeze", "off"])
def test_garbage_collection_mode_holds_inside_and_is_undone_after(mode):
  import gc  # noqa: PLC0415

  from benchmarks import common  # noqa: PLC0415
  assert gc.isenabled() and gc.get_freeze_count() == 0
  with common.garbage_collection(mode):
    assert gc.isenabled() == (mode != "off")
    assert (gc.get_freeze_count() > 0) == (mode == "freeze")
  assert gc.isenabled() and gc.get_freeze_count() == 0
  with pytest.raises(ValueError, match="gc mode"):
    with common.garbage_collection("later"):
      pass


def _check_cpu_temporaries(runs):
  # tx.update's update is a temporary (2 B/param); in place none is. Clipped
  # by oh.clip_by_global_norm, the kernel clips as it reads: none either.
  # optax's clip runs first: the clipped bf16 gradients are one (2); where
  # XLA writes an fp32 copy of the gradients for it, that copy (4) is the
  # larger, and the clipped gradients reuse its memory.
  assert runs["adamw_bf16 kahan"]["xla_temp_bytes_per_param"] == pytest.approx(2, abs=0.01)
  assert runs["adamw_bf16 kahan (update_and_apply)"]["xla_temp_bytes_per_param"] < 0.01
  optax_clip, oh_clip = (runs[name]["xla_temp_bytes_per_param"] for name in step.CLIPPED)
  assert oh_clip < 0.01
  assert optax_clip == pytest.approx(2, abs=0.01) or optax_clip == pytest.approx(4, abs=0.01)


@pytest.mark.slow  # a benchmark process's worth of compiles and timed steps
def test_torch_benchmark_quick(tmp_path):
  pytest.importorskip("torch")
  from benchmarks import torch_step  # noqa: PLC0415
  path = tmp_path / "torch.json"
  out = torch_step.main(["--quick", "--reps", "2", "--json", str(path), "--only",
                         "adamw_bf16 kahan,adam_fp32_master,adam_fp32_master fp16,"
                         "adamw_bf16 kahan fp16"])
  _check(out, path, {"torch AdamW fused fp32 (reference)": (16, 28),
                     "adamw_bf16 kahan": (10, 18), "adam_fp32_master": (16, 30),
                     "adam_fp32_master fp16": (16, 30), "adamw_bf16 kahan fp16": (14, 26)})
  assert out["cpu"]["kernel_lanes"] == native.lanes(native.library())
  memory = out["memory_bytes_per_param"]
  if os.path.exists("/proc/self/clear_refs"):  # each row in a fresh process
    assert set(memory) == set(torch_step.QUICK_MEMORY_ROWS)
    for name, row in memory.items():
      assert row["resident"] == pytest.approx(out["runs"][name]["bytes_per_param"], abs=0.01)
      # the first step makes the state with no more than a leaf above it, a later one 0
      assert row["init_peak"] < 1.0 and row["step_peak"] < 0.5, (name, row)


@pytest.mark.slow  # a benchmark process's worth of compiles and timed steps
def test_torch_benchmark_scaled_adam_rows_and_the_transformer_tree(tmp_path):
  pytest.importorskip("torch")
  from benchmarks import common, torch_step  # noqa: PLC0415
  assert len(common.shapes("transformer")) == 147
  path = tmp_path / "torch.json"
  out = torch_step.main(["--quick", "--reps", "1", "--json", str(path), "--only",
                         "scaled_adam clip 2.0,seed ScaledAdam clip 2.0 (stacked eager)"])
  # bf16 params, delta and second moments (+ a gradient); both keep the same state.
  _check(out, path, {"torch AdamW fused fp32 (reference)": (16, 28),
                     "scaled_adam clip 2.0": (8, 14),
                     "seed ScaledAdam clip 2.0 (stacked eager)": (8, 14)})


def test_seed_scaled_adam_port_computes_scaled_adam():
  """The benchmark's port of the seed's batched ScaledAdam follows the
  library's ScaledAdam without clipping (where the two define the same step)
  to fp32 rounding over 30 steps, scalars and size updates included."""
  torch = pytest.importorskip("torch")
  import torch_bridge as tb  # noqa: PLC0415
  from benchmarks.seed_scaled_adam import SeedScaledAdam  # noqa: PLC0415
  gen = torch.Generator().manual_seed(0)
  shapes = [(8, 5), (8, 5), (7,), (), ()]
  init = [torch.randn(s, generator=gen) * 0.5 for s in shapes]
  grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(30)]
  runs = []
  for make in (lambda ps: SeedScaledAdam(ps, lr=0.03),
               lambda ps: tb.scaled_adam(ps, lr=0.03, fused=False)):
    ps = [x.clone().requires_grad_() for x in init]
    opt = make(ps)
    for gs in grads:
      for p, g in zip(ps, gs):
        p.grad = g.clone()
      opt.step()
    runs.append([p.detach() for p in ps])
  for a, b, x in zip(*runs, init):
    assert not torch.equal(b, x)
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), (a, b)


_MMAPPED_BLOCKS = """
import ctypes
from benchmarks import common
class Mallinfo(ctypes.Structure):  # the old mallinfo: in every glibc
  _fields_ = [(n, ctypes.c_int) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                          "usmblks", "fsmblks", "uordblks", "fordblks",
                                          "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo.restype = Mallinfo
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo().hblks
block = libc.malloc(64 << 20)
print(common.heap_malloc_active(), libc.mallinfo().hblks - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_heap_malloc_env_serves_a_64_mib_block_from_the_heap():
  """--heap-malloc's environment: by default glibc maps a 64 MiB block of its
  own (one more mmapped block, faulted in anew after each free), with it the
  heap serves it (none more)."""
  from benchmarks import common  # noqa: PLC0415

  def run(extra_env):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    return subprocess.run([sys.executable, "-c", _MMAPPED_BLOCKS], capture_output=True,
                          text=True, check=True, cwd=ROOT, env={**env, **extra_env}).stdout.split()
  assert run({}) == ["False", "1"]
  assert run(common.HEAP_MALLOC_ENV) == ["True", "0"]
  if not common.heap_malloc_active():
    with pytest.raises(ValueError, match="MALLOC_MMAP_MAX_=0"):
      step.main(["--quick", "--heap-malloc"])


def test_jax_yardsticks_write_into_the_donated_buffers():
  # A fresh output would time page faults, not memory bandwidth.
  import jax.numpy as jnp  # noqa: PLC0415
  x = jnp.ones(1024, jnp.float32)
  for fn, args in ((step._scale, (x,)), (step._copy, (jnp.zeros_like(x), x))):
    assert fn.lower(*args).compile().memory_analysis().alias_size_in_bytes == x.nbytes


@pytest.mark.slow  # a benchmark process's worth of compiles and timed steps
def test_flax_call_cost_benchmark_runs_every_wrapper():
  from benchmarks import flax_calls  # noqa: PLC0415
  out = flax_calls.main(["--reps", "1", "--trees", "quick"])["quick"]
  expected = {f"{name}, {wrapper}" for name in flax_calls.OPTIMIZERS
              for wrapper in flax_calls.WRAPPERS}
  assert expected <= set(out) and len(out) == len(expected) + 2
  assert all(ms > 0 for ms in out.values())


def test_report_without_a_kernel_builds_none(monkeypatch, capsys):
  # A run on a GPU (no kernel taken) reports "kernel not used" and builds no
  # library for the report (building one took 40 s of a GPU machine's time).
  from benchmarks import common
  monkeypatch.setattr(native, "library", lambda: pytest.fail("built a library"))
  monkeypatch.setattr(native, "ffi_library", lambda *a: pytest.fail("built a library"))
  runs = {"ref": dict(times=[1e-3], moved_per_param=1.0, bytes_per_param=1.0, setup_s=0.0)}
  out = common.report("t", runs, "ref", 10, {"copy": 1.0}, kernel_library=None)
  assert (out["cpu"]["kernel_lanes"], out["cpu"]["kernel_f16"]) == (0, False)
  assert "kernel not used" in capsys.readouterr().out


def test_gpu_check_script_names_rows_and_trees_that_exist():
  """benchmarks/gpu_check.sh runs where no test can (a GPU machine, minutes of lent
  time): its bash parses, and every row and tree it names is one the benchmarks have."""
  import re  # noqa: PLC0415
  pytest.importorskip("torch")
  from benchmarks import common, torch_step  # noqa: PLC0415
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.sh")
  subprocess.run(["bash", "-n", path], check=True)
  text = open(path).read().replace("\\\n", "")
  rows = dict(re.findall(r'^(\w+_rows(?:_big)?)="([^"]*)"', text, flags=re.M))
  assert set(rows) == {"jax_rows", "jax_rows_big", "torch_rows", "torch_rows_big"}
  known = {"jax": set(step.all_candidates()), "torch": set(torch_step.candidates(device="cuda"))}
  for name, value in rows.items():
    missing = set(value.split(",")) - known[name.split("_")[0]]
    assert not missing, (name, missing)
  trees = re.search(r'trees=\$\{GPU_CHECK_TREES:-([^}]*)\}', text).group(1).split()
  assert trees and set(trees) <= set(common.TREES)
