"""GPU kernels compiled without a GPU: what an H100 (sm_90) would run, and its properties.

    python -m benchmarks.gpu_static OUT [--modes kahan,...] [--jax] [--rows A,B] [--tree gpt2]

**JAX** (``--jax``, ``--ieee`` with IEEE_XLA_FLAGS; needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at the
jaxlib version, which ``make gpu-static`` installs into ``.venv-gpu``):
every step row of ``benchmarks.step`` (``tx.update`` + ``apply_updates``, and
``update_and_apply`` where that row has it) traced with donated params, state
and gradients on a deviceless H100 (``jax.experimental.topologies`` with
``benchmarks/h100.txtpb``) and compiled by XLA:GPU. Writes per row its
optimized HLO and PTX under ``OUT/jax/`` and ``OUT/jax.json``: kernels
launched, bytes the kernels move per param (operands + results of each, from
the HLO's shapes), temporaries (``memory_analysis()``), param-sized copies,
outputs aliased to donated inputs, and the PTX's fp32 FMAs and approximate
divisions and square roots. ``tests/test_gpu_static.py`` asserts them.

**torch**: compiles the torch Triton step (``torch_bridge._triton_kernels.adamw_kernel``)
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
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
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
                LR_TENSOR=False, ALIGNED=aligned, INVERT_SCALE=True)
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
    report = subprocess.run([find_ptxas(), f"-arch={arch}", "-v", str(path), "-o",
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


# -- JAX: the benchmark rows compiled by XLA:GPU -------------------------------

H100_CONFIG = Path(__file__).with_name("h100.txtpb")  # an XLA GpuTargetConfig of an H100 SXM
# XLA_FLAGS for IEEE fp32 division and square root in XLA:GPU's kernels (LLVM's
# NVPTX options, passed through): JAX on the GPU then computes the CPU's ops.
IEEE_XLA_FLAGS = ("--xla_backend_extra_options="
                  "-nvptx-prec-divf32=2,-nvvm-reflect-add=__CUDA_PREC_SQRT=1")
# Instructions of the entry computation that launch nothing.
_NO_KERNEL = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
              "partition-id", "replica-id"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def jax_device():
  """A deviceless H100 (set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts)."""
  from jax.experimental import topologies  # noqa: PLC0415
  return topologies.get_topology_desc("h100", "cuda", target_config=H100_CONFIG.read_text(),
                                      topology="1x1x1").devices[0]


def jax_rows() -> dict:
  """name -> (dtype, tx, in_place) of benchmarks.step's tx.update and in-place rows."""
  from benchmarks import step  # noqa: PLC0415 (jax, flax)
  return {name: row for name, row in step.all_candidates().items()
          if row[2] in (False, True)}


def _type_bytes(text: str) -> int:
  """Bytes of an HLO type: ``bf16[768,64]{1,0}`` or a tuple of such."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
    if dtype in _BYTES:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _BYTES[dtype]
  return total


def _entry(hlo: str) -> list:
  """(name, type text, opcode, operand names) of the entry computation's instructions."""
  body = hlo[hlo.index("\nENTRY "):]
  body = body[body.index("{\n") + 2:body.index("\n}")]
  out = []
  for line in body.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if not m:
      continue
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple type: to its matching parenthesis
      depth = 0
      for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
          break
      type_text, rest = rest[:i + 1], rest[i + 2:]
    else:
      type_text, _, rest = rest.partition(" ")
    opcode = rest[:rest.index("(")]
    args = rest[rest.index("(") + 1:]
    operands = re.findall(r"%([\w.\-]+)", args[:args.find("), ") if "), " in args else None])
    out.append((m.group(1), type_text, opcode, operands))
  return out


def computations(hlo: str) -> dict:
  """name -> the instructions' text of each computation of ``hlo`` but the
  entry (fused computations, a conditional's branches)."""
  return {m.group(1): m.group(2)
          for m in re.finditer(r"^%?([\w.\-]+) \(.*\n((?:[^}\n].*\n)*?)\}$", hlo, re.M)}


def instructions(body: str) -> list:
  """A computation's text (``computations``) as ``_entry`` reads an entry's."""
  return _entry(f"\nENTRY x {{\n{body}\n}}")


def branches(hlo: str) -> dict:
  """conditional's name -> its branch computations' names."""
  out = {}
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .* conditional\(", line)
    if m:
      found = re.search(r"branch_computations=\{([^}]*)\}", line)
      names = (found.group(1).split(",") if found else
               re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
      out[m.group(1)] = [n.strip().lstrip("%") for n in names]
  return out


def cheaper_branch(hlo: str, name: str, cost, pick=min) -> tuple:
  """(cost, kernels) of conditional ``name``'s branch of least ``cost(instructions)``
  (the kernels it launches, the conditional not counted). A conditional's operands are
  passed, not moved: what it moves is what its branch's kernels do. For the master's mark
  check that branch is the one every step takes after a step that landed exactly.
  ``pick=max``: the costlier branch instead."""
  found, bodies = [], computations(hlo)
  for branch in branches(hlo)[name]:
    instrs = instructions(bodies[branch])
    found.append((cost(instrs), [i for i in instrs if i[2] not in _NO_KERNEL]))
  return pick(found, key=lambda f: f[0])


def _elements(text: str) -> list:
  """(elements, bytes each) of each array of an HLO type (``_type_bytes``'s)."""
  return [(math.prod(int(d) for d in filter(None, dims.split(","))), _BYTES[dtype])
          for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text) if dtype in _BYTES]


def leaf_kernels(hlo: str) -> set:
  """The names of the Pallas step kernels (``optax_half._gpu``: ``adamw_bf16_leaf<k>``)."""
  return set(re.findall(r"%([\w.\-]+) = [^\n]*custom-call\([^\n]*adamw_bf16_leaf\d+/pallas_call",
                        hlo))


def _leaf_kernel_bytes(t: str, operands: list) -> int:
  """What a Pallas step kernel moves: its key vector, then of each stream the leaf's
  elements (its param operand's count; a flat state's arrays are read and written at the
  leaf's offset, masked to the leaf: tests/test_pallas_kernels.py)."""
  (keys, width), (n, _) = _elements(operands[0])[0], _elements(operands[1])[0]
  streams = [e for o in operands[1:] for e in _elements(o)] + _elements(t)
  return keys * width + sum(min(e, n) * b for e, b in streams)


def hlo_properties(hlo: str, leaf_shapes) -> dict:
  """Kernels, bytes moved and param-sized copies of an optimized XLA:GPU module; a
  conditional counts its cheaper branch (``cheaper_branch``)."""
  entry = _entry(hlo)
  pallas = leaf_kernels(hlo)

  def moved_by(instrs, pick=min) -> int:
    types = {name: type_text for name, type_text, _, _ in instrs}
    total = 0
    for name, t, op, ops in instrs:
      if op == "conditional":
        total += cheaper_branch(hlo, name, lambda i: moved_by(i, pick), pick)[0]
      elif name in pallas:
        total += _leaf_kernel_bytes(t, [types.get(o, "") for o in ops])
      elif op not in _NO_KERNEL:
        total += _type_bytes(t) + sum(_type_bytes(types.get(o, "")) for o in ops)
    return total
  kernels = [(name, t, op, ops) for name, t, op, ops in entry if op not in _NO_KERNEL]
  moved = moved_by(entry)
  shapes = {f"[{','.join(map(str, s))}]" for s in leaf_shapes if s}
  copies = [name for name, t, op, _ in kernels
            if op == "copy" and re.search(r"\[[\d,]*\]", t).group(0) in shapes]
  aliased = len(re.findall(r"\{[\d,]*\}: \(\d+, \{", hlo.splitlines()[0]))
  kernels += [k for name, _, op, _ in kernels if op == "conditional"
              for k in cheaper_branch(hlo, name, moved_by)[1]]
  return dict(kernels=len(kernels), pallas_kernels=len(pallas),
              kernel_ops=dict(collections.Counter(op for _, _, op, _ in kernels)),
              bytes_moved=moved, bytes_moved_costlier_branches=moved_by(entry, max),
              param_sized_copies=len(copies), aliased_outputs=aliased)


def ptx_properties(ptx: str) -> dict:
  return dict(fma=len(re.findall(r"\bfma\.\w*\.?f32\b", ptx)),
              approx_div=len(re.findall(r"\bdiv\.(?:full|approx)[.\w]*f32", ptx)),
              approx_sqrt=len(re.findall(r"\bsqrt\.approx[.\w]*f32", ptx)),
              approx_other=len(re.findall(r"\b(?:rcp|rsqrt|ex2|lg2|sin|cos)\.approx", ptx)),
              ieee_div=len(re.findall(r"\bdiv\.rn[.\w]*f32", ptx)),
              ieee_sqrt=len(re.findall(r"\bsqrt\.rn[.\w]*f32", ptx)))


def find_ptxas() -> str | None:
  """Triton's bundled ptxas: this environment's, or the repository's ``.venv``'s (``.venv-gpu``
  has no Triton), or None."""
  try:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    return get_ptxas(90).path
  except Exception:  # noqa: BLE001 (no Triton here: look in .venv)
    found = sorted(Path(__file__).resolve().parents[1].glob(
        ".venv/lib/python*/site-packages/triton/backends/nvidia/bin/ptxas"))
    return str(found[0]) if found else None


def pallas_kernel_properties(ptx_files) -> dict:
  """Registers, spills and global accesses of the Pallas step kernels (``leaf_kernels``)
  in ``ptx_files``, by ptxas for sm_90a; {} without ptxas."""
  ptxas = find_ptxas()
  files = [f for f in ptx_files if ".entry adamw_bf16_leaf" in f.read_text()]
  if ptxas is None or not files:
    return {}
  registers, spills, accesses = [], 0, collections.Counter()
  with tempfile.TemporaryDirectory() as tmp:
    for f in files:
      report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(f), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                              check=True).stderr
      registers += [int(r) for r in re.findall(r"Used (\d+) registers", report)]
      spills += sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
      accesses.update(re.findall(r"\b((?:ld|st)\.global(?:\.nc)?(?:\.v\d)?\.b\d+)",
                                 f.read_text()))
  return dict(pallas_max_registers=max(registers), pallas_spill_bytes=spills,
              pallas_accesses=dict(sorted(accesses.items())))


def compile_jax(name: str, tree: str, dump: Path) -> tuple[str, str, dict]:
  """The optimized HLO and PTX of row ``name`` on ``tree``, and their properties."""
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  import optax_half as oh  # noqa: PLC0415
  from benchmarks import common  # noqa: PLC0415
  dtype, tx, in_place = jax_rows()[name]
  sharding = jax.sharding.SingleDeviceSharding(jax_device())
  shapes = common.shapes(tree)

  def placed(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  params = {f"p{i:03d}": placed(jax.ShapeDtypeStruct(s, dtype)) for i, s in enumerate(shapes)}
  state = jax.tree.map(placed, jax.eval_shape(tx.init, params))

  def step(p, s, g):
    if in_place:
      return oh.update_and_apply(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  module = "row_" + re.sub(r"\W+", "_", name).strip("_").lower()
  step.__name__ = module
  start = time.perf_counter()
  with warnings.catch_warnings():  # the gradients die unused, as in a training step
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params)
    compiled = lowered.compile()
  seconds = time.perf_counter() - start
  hlo = compiled.as_text()
  ptx_files = sorted(dump.glob(f"*jit_{module}.*.ptx"))
  ptx = "\n".join(f.read_text() for f in ptx_files)
  n = sum(math.prod(s) for s in shapes)
  info = hlo_properties(hlo, shapes)
  memory = compiled.memory_analysis()
  outputs = len(jax.tree.leaves(lowered.out_info))
  info.update(ptx_properties(ptx), **pallas_kernel_properties(ptx_files), leaves=len(shapes), params=n, outputs=outputs,
              bytes_per_param=info["bytes_moved"] / n,
              bytes_per_param_costlier_branches=info["bytes_moved_costlier_branches"] / n,
              temp_bytes=memory.temp_size_in_bytes,
              largest_leaf_bytes=max(math.prod(s) for s in shapes) * jax.numpy.dtype(dtype).itemsize,
              compile_s=seconds, in_place=bool(in_place))
  return hlo, ptx, info


def jax_kernels(out: Path, rows=None, tree: str = "gpt2", ieee: bool = False) -> dict:
  """Compiles ``rows`` (default all) for the H100, writes HLO, PTX and
  ``jax.json`` (``jax-ieee.json`` with IEEE_XLA_FLAGS) into ``out``. Run it
  in a fresh process: XLA's flags are read when JAX starts."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no CUDA to load: the H100 is deviceless
  os.environ.setdefault("OPTAX_HALF_NATIVE", "0")  # the trace a GPU process makes
  os.environ.setdefault("OPTAX_HALF_GPU_KERNEL", "1")  # on the GPU backend by default
  suffix = "-ieee" if ieee else ""
  dump = out / f"jax{suffix}" / "xla"
  shutil.rmtree(dump, ignore_errors=True)  # module numbers restart in each process
  dump.mkdir(parents=True)
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (flags, f"--xla_dump_to={dump}",
                                                   IEEE_XLA_FLAGS if ieee else "")))
  results = {}
  for name in rows or jax_rows():
    hlo, ptx, info = compile_jax(name, tree, dump)
    stem = re.sub(r"\W+", "_", name).strip("_").lower()
    (out / f"jax{suffix}" / f"{stem}.hlo.txt").write_text(hlo)
    (out / f"jax{suffix}" / f"{stem}.ptx").write_text(ptx)
    results[name] = info
  (out / f"jax{suffix}.json").write_text(
      json.dumps(dict(tree=tree, xla_flags=os.environ["XLA_FLAGS"], rows=results), indent=1)
      + "\n")
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--modes", default=None,
                      help="comma-separated torch kernel modes (default: all, unless --jax)")
  parser.add_argument("--jax", action="store_true", help="compile the JAX rows (.venv-gpu)")
  parser.add_argument("--rows", default=None, help="comma-separated JAX rows (default: all)")
  parser.add_argument("--tree", default="gpt2", help="the JAX rows' tree (benchmarks.common)")
  parser.add_argument("--ieee", action="store_true",
                      help="JAX with IEEE_XLA_FLAGS (IEEE division and square root)")
  args = parser.parse_args()
  if args.jax:
    rows = [r for r in args.rows.split(",") if r] if args.rows else None
    results = jax_kernels(args.out, rows, args.tree, args.ieee)
    print(f"{'JAX row (sm_90, ' + args.tree + (', IEEE' if args.ieee else '') + ')':56s} {'kernels':>7s} {'B/param':>7s} "
          f"{'temp MB':>7s} {'copies':>6s} {'aliased':>7s} {'fma':>4s} {'~div':>4s} "
          f"{'~sqrt':>5s} {'compile s':>9s}")
    for name, r in results.items():
      print(f"{name:56s} {r['kernels']:7d} {r['bytes_per_param']:7.2f} "
            f"{r['temp_bytes'] / 1e6:7.1f} {r['param_sized_copies']:6d} "
            f"{r['aliased_outputs']:3d}/{r['outputs']:<3d} {r['fma']:4d} {r['approx_div']:4d} "
            f"{r['approx_sqrt']:5d} {r['compile_s']:9.1f}")
    if args.modes is None:
      return
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
  modes = [m for m in args.modes.split(",") if m] if args.modes else None
  results = torch_kernels(args.out, modes)
  print(f"{'torch kernel (sm_90)':26s} {'regs':>4s} {'spill':>5s} {'block':>5s} "
        f"{'vec B':>5s} {'v.ld':>4s} {'v.st':>4s} fma approx")
  for mode, r in results.items():
    print(f"{mode:26s} {r['registers']:4d} {r['spill_bytes']:5d} {r['block']:5d} "
          f"{r['bytes_per_vector_access']:5d} {r['vector_loads']:4d} {r['vector_stores']:4d} "
          f"{'yes' if r['fma'] else 'no':3s} {'yes' if r['approx'] else 'no'}")


if __name__ == "__main__":
  main()
