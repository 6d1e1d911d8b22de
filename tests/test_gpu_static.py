"""The JAX steps compiled for an H100 without a GPU (``benchmarks.gpu_static --jax``).

Runs where ``jax-cuda12-plugin`` is installed: ``make test-gpu-static`` (CI)
installs it into ``.venv-gpu`` and runs this file there; in the main
environment it is skipped. Each row is compiled by XLA:GPU for a deviceless
H100 in a fresh process, and its optimized HLO and PTX must show: at most
leaves + a few kernels, the byte model's bytes per param, temporaries of at
most one leaf, no param-sized copy, every output aliased to a donated input,
no fp32 FMA. The tree is GPT-2 with one layer ("gpt2-layer": every leaf
shape of GPT-2 in 16 leaves), which XLA:GPU fuses leaf by leaf as it does
GPT-2 (the same kernels per leaf, bytes per param and aliasing) in an
eighth of the time; ``make gpu-static`` gives every row on GPT-2.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax_cuda12_plugin")

from benchmarks import gpu_static  # noqa: E402 (where the plugin is)

ROOT = Path(__file__).resolve().parents[1]
# row -> bytes each param moves (read + written once): docs/algorithms.md#memory
BYTE_MODEL = {
    "optax.adamw fp32 (reference)": 28,
    "adamw_bf16 kahan": 18,
    "adamw_bf16 kahan (update_and_apply)": 18,
    "adamw_bf16 stochastic (update_and_apply)": 14,
    "adamw_bf16 split (update_and_apply)": 18,
    "adam_fp32_master (update_and_apply)": 30,
    "adamw_bf16 kahan flat_state (update_and_apply)": 18,
    "adamw_bf16 kahan fp16 (update_and_apply)": 26,  # fp32 moments
    "adam_fp32_master fp16 (update_and_apply)": 30,
}
GAPS: dict = {}  # rows not at the byte model yet (docs/algorithms.md#on-gpu): none
# The rows optax_half._gpu steps, a Pallas kernel a leaf (docs/algorithms.md#pallas-kernels);
# the others are XLA:GPU's fusions.
KERNEL_ROWS = ["adamw_bf16 kahan (update_and_apply)", "adamw_bf16 stochastic (update_and_apply)",
               "adamw_bf16 split (update_and_apply)",
               "adamw_bf16 kahan flat_state (update_and_apply)"]
FEW = 3  # kernels beyond one a leaf (a step count, a scalar or two)
REFERENCE = "optax.adamw fp32 (reference)"
TREE = "gpt2-layer"


IEEE_ROWS = ["adamw_bf16 kahan", "adam_fp32_master (update_and_apply)"]  # XLA:GPU's steps


def _compile(out: Path, rows, *flags) -> dict:
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-m", "benchmarks.gpu_static", str(out), "--jax",
                  "--rows", ",".join(rows), "--tree", TREE, *flags], check=True, cwd=ROOT, env=env,
                 timeout=1500)
  name = "jax-ieee.json" if flags else "jax.json"
  return json.loads((out / name).read_text())["rows"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  return _compile(tmp_path_factory.mktemp("gpu_static"), BYTE_MODEL)


def _rows(gaps):
  return [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=gaps[r])) if r in gaps
          else r for r in BYTE_MODEL if r != REFERENCE]


@pytest.mark.parametrize("row", _rows(GAPS))
def test_row_is_one_pass_over_memory(row, compiled):
  """The byte model's bytes, no temporaries beyond a leaf, no param-sized
  copy, every output aliased to a donated input, no fp32 FMA."""
  r = compiled[row]
  assert abs(r["bytes_per_param"] - BYTE_MODEL[row]) < 0.05, r
  assert r["temp_bytes"] <= r["largest_leaf_bytes"], r
  assert r["param_sized_copies"] == 0, r
  assert r["aliased_outputs"] == r["outputs"], r
  assert r["fma"] == 0, r


# In XLA:GPU's steps each leaf's random-bit key (mix32(stream key ^ leaf), for the
# stochastic moments and params) is a scalar computation XLA:GPU leaves as a kernel of
# its own for about a quarter of the leaves; one vector of keys for the tree gets the
# consumers sibling-fused, with copies (docs/algorithms.md#xlagpu-without-a-gpu). The
# Pallas kernels read their keys from one vector made for all of them.
KEY_KERNELS = "a scalar kernel per leaf's random-bit key (5 of 16 leaves, about 40 at GPT-2 size)"

# fp32 moments: no random bits. A full master's marks after an in-place step (0) are
# written in one fusion for the tree, not a scalar copy a leaf (compensation.kept_leaves).
NO_KEYS = {"adamw_bf16 kahan fp16 (update_and_apply)", "adam_fp32_master (update_and_apply)",
           "adam_fp32_master fp16 (update_and_apply)"}


@pytest.mark.parametrize("row", _rows({**{r: KEY_KERNELS for r in BYTE_MODEL
                                          if r not in NO_KEYS and r not in KERNEL_ROWS},
                                       **GAPS}))
def test_row_launches_a_kernel_a_leaf(row, compiled):
  r = compiled[row]
  assert r["kernels"] <= r["leaves"] + FEW, r


@pytest.mark.parametrize("row", KERNEL_ROWS)
def test_kernel_rows_are_a_pallas_kernel_a_leaf_with_ieee_ops(row, compiled):
  """optax_half._gpu's rows: one Pallas kernel a leaf, and no approximate instruction in
  the step without any XLA flag: division and square root are ``div.rn`` / ``sqrt.rn``,
  the CPU's ops (the bias corrections are inverted in the kernels; XLA:GPU's ``1 / x``
  is ``rcp.approx``). A flat state passes params, gradients and its few arrays in."""
  r = compiled[row]
  assert r["pallas_kernels"] == r["leaves"], r
  assert r["approx_div"] == r["approx_sqrt"] == r["approx_other"] == 0, r
  assert r["ieee_div"] > 0 and r["ieee_sqrt"] > 0, r
  if "flat_state" in row:  # outputs: params, count, mu, nu, Kahan buffer
    assert r["outputs"] == r["leaves"] + 5, r
  # ptxas (Triton's, from .venv) for sm_90a: no spills, registers within the torch
  # kernel's bound, and every stream written in 16-byte accesses (8 bf16 a thread).
  assert r["pallas_spill_bytes"] == 0, r
  assert r["pallas_max_registers"] <= gpu_static.MAX_REGISTERS, r
  stores = {k for k in r["pallas_accesses"] if k.startswith("st.")}
  assert stores == {"st.global.v4.b32"}, r


def test_optax_reference_is_what_the_model_says(compiled):
  """The reference, checked the same way: one pass, 28 B/param; XLA
  contracts its multiply-adds into FMAs (the optax_half rows have none)."""
  r = compiled[REFERENCE]
  assert r["kernels"] <= r["leaves"] + FEW and r["aliased_outputs"] == r["outputs"], r
  assert r["bytes_per_param"] == pytest.approx(28, abs=0.05), r
  assert r["temp_bytes"] <= r["largest_leaf_bytes"] and r["param_sized_copies"] == 0, r
  assert r["fma"] > 0, r


def test_ieee_flags_take_every_approximation_out(compiled, tmp_path):
  """With gpu_static.IEEE_XLA_FLAGS the steps' PTX divides and takes square
  roots by IEEE instructions (none approximate, ``div.rn`` / ``sqrt.rn``:
  the CPU's ops) and moves the same bytes in the same kernels; without
  them XLA:GPU approximates both (docs/algorithms.md#on-gpu)."""
  ieee = _compile(tmp_path, IEEE_ROWS, "--ieee")
  for row in IEEE_ROWS:
    fast, exact = compiled[row], ieee[row]
    assert fast["approx_div"] > 0 and fast["approx_sqrt"] > 0, fast
    assert exact["approx_div"] == exact["approx_sqrt"] == exact["approx_other"] == 0, exact
    assert exact["ieee_div"] > 0 and exact["ieee_sqrt"] > 0, exact
    for key in ("kernels", "bytes_moved", "temp_bytes", "aliased_outputs", "fma"):
      assert exact[key] == fast[key], (key, fast, exact)
