"""GPU kernels compiled without a GPU: what an H100 (sm_90) would run, and its properties.

    python -m benchmarks.gpu_static OUT [--modes kahan,stochastic,...]

Compiles the torch Triton step (``torch_bridge._triton_kernels.adamw_kernel``)
for sm_90 with Triton's own compiler, once per mode in the configuration
users get (bf16 params and moments, the default stochastic moment rounding;
``master`` with fp32 moments, ``direct`` fp32), plus the fp16 and unaligned
variants. Writes ``OUT/torch-<mode>.ptx`` and ``OUT/torch.json``: per mode
the registers and spill bytes ``ptxas -v`` reports (Triton's bundled
ptxas), the global accesses by width, and whether the PTX holds an fp32
FMA or an approximate instruction. ``tests/test_triton.py`` asserts the
kernel properties from it (docs/algorithms.md#triton-multi-tensor-step).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import optax_half_native as native_lib

# mode name -> (P, G, M, V, BUF kinds: 0 fp32, 1 16-bit bf16, 2 fp16; kernel mode;
#               stochastic moments; aligned)
TORCH_MODES = {
    "kahan": (1, 1, 1, 1, 1, "kahan", True, True),
    "stochastic": (1, 1, 1, 1, 0, "stochastic", True, True),
    "split": (1, 1, 1, 1, 1, "split", True, True),
    "none": (1, 1, 1, 1, 0, "none", True, True),
    "master": (1, 1, 0, 0, 0, "master", False, True),
    "direct": (0, 0, 0, 0, 0, "direct", False, True),
    "kahan-fp16": (2, 2, 0, 0, 2, "kahan", False, True),
    "master-fp16": (2, 2, 0, 0, 0, "master", False, True),
    "stochastic-fp16-moments": (2, 2, 2, 2, 0, "stochastic", True, True),
    "kahan-unaligned": (1, 1, 1, 1, 1, "kahan", True, False),
}
# streams each mode reads and writes (param, grad, moments, buffer)
_READS = {"kahan": 5, "split": 5, "master": 5, "stochastic": 4, "none": 4, "direct": 4}
_WRITES = {"kahan": 4, "split": 4, "master": 4, "stochastic": 3, "none": 3, "direct": 3}
MAX_REGISTERS = 96


def _config(mode: str) -> dict:
  from torch_bridge import _triton  # noqa: PLC0415 (needs torch and triton)
  p, g, m, v, buf, kernel_mode, sr, aligned = TORCH_MODES[mode]
  config = dict(P=p, G=g, M=m, V=v, BUF=buf, MODE=native_lib.MODES[kernel_mode],
                SR_MOMENTS=sr, MAXIMIZE=False, HAS_INV_SCALE=True, HAS_FOUND_INF=True,
                LR_TENSOR=False, ALIGNED=aligned)
  config["BLOCK"] = _triton.block_of(config)
  config["ITERS"] = _triton.CHUNK // config["BLOCK"]
  return config


def compile_torch(mode: str) -> tuple[str, dict]:
  """The PTX of ``mode``'s kernel for sm_90 and its properties."""
  import triton  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
  from triton.compiler import ASTSource  # noqa: PLC0415
  from torch_bridge import _triton  # noqa: PLC0415
  config = _config(mode)
  signature = {"table_ptr": "*i64", "programs_ptr": "*i32", "lr": "fp32", "lr_ptr": "*fp32",
               "b1": "fp32", "b2": "fp32", "eps": "fp32", "weight_decay": "fp32",
               "seed_key": "i32", "inv_scale_ptr": "*fp32", "found_inf_ptr": "*fp32",
               **{name: "constexpr" for name in config}}
  source = ASTSource(fn=_triton._kernels_for(False).adamw_kernel, signature=signature,
                     constexprs=config)
  ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                       options={"enable_fp_fusion": False}).asm["ptx"]
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "k.ptx"
    path.write_text(ptx)
    arch = "sm_90a" if ".target sm_90a" in ptx else "sm_90"
    report = subprocess.run([get_ptxas(90).path, f"-arch={arch}", "-v", str(path), "-o",
                             str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                            check=True).stderr
  spills = [int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
  accesses = collections.Counter(re.findall(r"\b((?:ld|st)\.global(?:\.v\d)?\.b\d+)", ptx))
  kernel_mode = TORCH_MODES[mode][5]
  return ptx, {
      "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
      "spill_bytes": sum(spills),
      "block": config["BLOCK"], "elements_per_program": _triton.CHUNK,
      "accesses": dict(sorted(accesses.items())),
      "vector_loads": accesses["ld.global.v4.b32"] + accesses["ld.global.v2.b32"],
      "vector_stores": accesses["st.global.v4.b32"] + accesses["st.global.v2.b32"],
      "bytes_per_vector_access": 16 if accesses["ld.global.v4.b32"] else 8,
      "streams_read": _READS[kernel_mode], "streams_written": _WRITES[kernel_mode],
      "fma": bool(re.search(r"\bfma\.\w*f32", ptx)),
      "approx": "approx" in ptx,
      "ieee_sqrt_div": bool(re.search(r"sqrt\.rn\.f32", ptx) and re.search(r"div\.rn\.f32", ptx)),
  }


def torch_kernels(out: Path, modes=None) -> dict:
  """Compiles ``modes`` (default all), writes their PTX and ``torch.json`` into ``out``."""
  out.mkdir(parents=True, exist_ok=True)
  results = {}
  for mode in modes or TORCH_MODES:
    ptx, info = compile_torch(mode)
    (out / f"torch-{mode}.ptx").write_text(ptx)
    results[mode] = info
  (out / "torch.json").write_text(json.dumps(results, indent=1) + "\n")
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--modes", default=",".join(TORCH_MODES),
                      help="comma-separated torch kernel modes (default: all)")
  args = parser.parse_args()
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
  results = torch_kernels(args.out, [m for m in args.modes.split(",") if m])
  print(f"{'torch kernel (sm_90)':26s} {'regs':>4s} {'spill':>5s} {'block':>5s} "
        f"{'vec B':>5s} {'v.ld':>4s} {'v.st':>4s} fma approx")
  for mode, r in results.items():
    print(f"{mode:26s} {r['registers']:4d} {r['spill_bytes']:5d} {r['block']:5d} "
          f"{r['bytes_per_vector_access']:5d} {r['vector_loads']:4d} {r['vector_stores']:4d} "
          f"{'yes' if r['fma'] else 'no':3s} {'yes' if r['approx'] else 'no'}")


if __name__ == "__main__":
  main()
