"""TPU steps compiled without a TPU: what XLA:TPU makes of the JAX benchmark rows.

    python -m benchmarks.tpu_static OUT [--chips v5e,v6e,v4] [--rows A,B] [--tree gpt2]

Needs ``jax[tpu]`` at the jaxlib version (its libtpu is XLA:TPU), which
``make tpu-static`` installs into ``.venv-tpu``; no TPU is opened
(``JAX_PLATFORMS=cpu``). Every step row of ``benchmarks.step``
(``gpu_static.jax_rows()``: ``tx.update`` + ``apply_updates``, and
``update_and_apply`` where that row has it) is traced with donated params,
state and gradients, as ``gpu_static.compile_jax`` does, on a deviceless chip
of each kind (``jax.experimental.topologies``) and compiled by XLA:TPU. The
GPU's static check (``benchmarks/gpu_static.py``) says what an H100 runs; this
one says what a TPU runs, where the same step may fuse differently.

Writes per chip and row the optimized HLO under ``OUT/tpu-<chip>/`` and
``OUT/tpu.json`` ({chip: {row: properties}}): fusions and other kernels of
the entry computation, an estimate of the HBM bytes they move per param,
param-sized copies from HBM to HBM (a pass of their own; copies into or out
of VMEM are counted apart, as transfers), temporaries (``memory_analysis()``),
outputs aliased to donated inputs and scalar ops left outside the fusions
(the integer ones are mostly each leaf's random-bit key).

The HBM estimate: in XLA:TPU's optimized HLO an array whose layout names a
memory space (``f32[768]{0:T(256)S(1)}``: VMEM, SMEM, v4's CMEM) is on the
chip, one without is in HBM. A kernel moves the HBM arrays among its
operands and results, by their elements (tile padding not counted); an
asynchronous copy or slice (``copy-start``/``copy-done``, XLA staging an
array in VMEM or writing one back) moves what it delivers, once. A fusion
that slices a buffer or updates it in place (``flat_state``'s flat buffers)
moves the slices, not the buffer. optax.adamw comes out at 28 B/param on
every chip, its byte model. ``tests/test_tpu_static.py`` asserts them.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import time
import warnings
from pathlib import Path

from benchmarks.gpu_static import (_BYTES, _NO_KERNEL, _entry, _type_bytes, cheaper_branch,
                                   computations, instructions, jax_rows)

# chip -> get_topology_desc's arguments for a deviceless 2x2 slice of it
CHIPS = {
    "v5e": dict(topology_name="v5e:2x2", chip_config_name="default"),
    "v6e": dict(topology_name="v6e:2x2", chip_config_name="default"),
    "v4": dict(topology_name="v4:2x2x1", chip_config_name="megacore"),
}
# What libtpu reads when it starts: no metadata server to ask, no TPU to open,
# no lock on the (absent) TPU, so that several processes compile at once.
TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
           "TPU_WORKER_HOSTNAMES": "localhost", "JAX_PLATFORMS": "cpu",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           # the trace a TPU process makes: no CPU kernel, the TPU kernels in
           # (deviceless, the default backend is the CPU: optax_half._native.on_tpu)
           "OPTAX_HALF_NATIVE": "0", "OPTAX_HALF_TPU_KERNEL": "1"}
# An array type and its layout: f32[768,64]{1,0:T(8,128)S(1)}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^{}]*\})?")


def tpu_device(chip: str):
  """Device 0 of a deviceless 2x2 slice of ``chip`` (v5e, v6e, v4)."""
  from jax.experimental import topologies  # noqa: PLC0415
  return topologies.get_topology_desc(
      platform="tpu", chips_per_host_bounds=(2, 2, 1), num_slices=1,
      wrap=(False, False, False), **CHIPS[chip]).devices[0]


def _hbm_bytes(text: str) -> int:
  """Bytes of the arrays of an HLO type (one or a tuple) that live in HBM:
  those whose layout names no memory space ``S(n)``."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(text):
    if dtype in _BYTES and "S(" not in layout:
      total += math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
  return total


def _on_chip(text: str) -> bool:
  """Whether every array of an HLO type lives in a memory space of its own (VMEM, SMEM...)."""
  return all("S(" in layout for _, _, layout in _ARRAY.findall(text))


def _computations(hlo: str) -> dict:
  """name -> (instructions as ``_entry`` gives them, parameter names by number,
  the root's name) of each fused computation."""
  out = {}
  for name, body in computations(hlo).items():
    params = {int(n): p for p, n in re.findall(r"%?([\w.\-]+) = \S+ parameter\((\d+)\)", body)}
    root = re.search(r"ROOT %?([\w.\-]+) = ", body)
    out[name] = (instructions(body), params, root and root.group(1))
  return out


def _fusion_hbm_bytes(t: str, operand_types, computation) -> int:
  """HBM bytes of a fusion: an operand only sliced counts its slices, one
  updated in place (a dynamic-update-slice into it) nothing, and such an
  output the update; a flat buffer is not moved whole for each leaf's slice."""
  instrs, params, root = computation
  users = collections.defaultdict(list)
  by_name = {name: (type_text, op, ops) for name, type_text, op, ops in instrs}
  for name, type_text, op, ops in instrs:
    for k, o in enumerate(ops):
      users[o].append((op, k, type_text))
  total = 0
  for i, operand in enumerate(operand_types):
    uses = users[params.get(i)]
    if not _hbm_bytes(operand):
      continue
    if uses and all(op in ("slice", "dynamic-slice") and k == 0 for op, k, _ in uses):
      total += sum(_type_bytes(u) for _, _, u in uses)
    elif not (uses and all(op == "dynamic-update-slice" and k == 0 for op, k, _ in uses)):
      total += _hbm_bytes(operand)
  _, root_op, root_ops = by_name[root]
  outputs = root_ops if root_op == "tuple" else [root]
  for (dtype, dims, layout), out in zip(_ARRAY.findall(t), outputs):
    if "S(" in layout:
      continue
    _, op, ops = by_name[out]
    total += _type_bytes(by_name[ops[1]][0] if op == "dynamic-update-slice"
                         else f"{dtype}[{dims}]")
  return total


def hlo_properties(hlo: str, leaf_shapes) -> dict:
  """Kernels, HBM bytes, param-sized copies and scalar ops of an optimized XLA:TPU module.

  A kernel moves its HBM operands and results (a fusion only the slices of
  a buffer it slices or updates in place); an asynchronous copy or slice
  (``copy-start`` ... ``copy-done``) what it delivers (the done's result),
  read from HBM if its source is there and written to HBM if its
  destination is; a conditional what its cheaper branch's kernels move
  (``gpu_static.cheaper_branch``)."""
  entry = _entry(hlo)
  types = {name: type_text for name, type_text, _, _ in entry}
  operands = {name: ops for name, _, _, ops in entry}
  calls = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = .* calls=%?([\w.\-]+)", hlo, re.M))
  computations = _computations(hlo)

  def hbm_by(instrs, pick=min) -> int:
    types = {name: type_text for name, type_text, _, _ in instrs}
    operands = {name: ops for name, _, _, ops in instrs}
    hbm = 0
    for name, t, op, ops in instrs:
      if op in _NO_KERNEL or op.endswith("-start"):
        continue  # an asynchronous op: counted at its done
      if op.endswith("-done"):
        ops = [o for start in ops for o in operands[start]]
      sources = [types.get(o, "") for o in ops]
      if op.endswith("-done"):
        hbm += _type_bytes(t) * ((not _on_chip(t)) + any(not _on_chip(s) for s in sources))
      elif op == "conditional":
        hbm += cheaper_branch(hlo, name, lambda i: hbm_by(i, pick), pick)[0]
      elif op == "fusion" and calls.get(name) in computations:
        hbm += _fusion_hbm_bytes(t, sources, computations[calls[name]])
      elif op == "dynamic-update-slice":  # in place: the update read and written
        hbm += _hbm_bytes(sources[1]) + (_hbm_bytes(t) and _type_bytes(sources[1]))
      else:
        hbm += _hbm_bytes(t) + sum(map(_hbm_bytes, sources))
    return hbm
  hbm = hbm_by(entry)
  kernels = [(name, t, op, ops) for name, t, op, ops in entry if op not in _NO_KERNEL]
  kernels += [k for name, _, op, _ in kernels if op == "conditional"
              for k in cheaper_branch(hlo, name, hbm_by)[1]]
  shapes = {f"[{','.join(map(str, s))}]" for s in leaf_shapes if s}
  copies, transfers, integer, scalars = 0, 0, 0, collections.Counter()
  for name, t, op, ops in kernels:
    if op.endswith("-start"):
      continue  # counted at its done
    if op.endswith("-done"):
      ops = [o for start in ops for o in operands.get(start, ())]
    sources = [types.get(o, "") for o in ops]
    if op in ("copy", "copy-done") and re.search(r"\[[\d,]*\]", t).group(0) in shapes:
      if _on_chip(t) or all(map(_on_chip, sources)):
        transfers += 1  # into or out of VMEM: the kernel's reads and writes
      else:
        copies += 1  # HBM to HBM: a pass of its own
    scalar = re.fullmatch(r"([a-z]+)\d*\[\]\S*", t)
    if scalar and op not in ("fusion", "copy", "copy-done"):
      scalars[op] += 1  # a scalar op of its own, outside the fusions
      integer += scalar.group(1) in ("s", "u")
  aliased = len(re.findall(r"\{[\d,]*\}: \(\d+, \{", hlo.splitlines()[0]))
  ops = collections.Counter(op for _, _, op, _ in kernels)
  return dict(kernels=len(kernels), fusions=ops["fusion"], kernel_ops=dict(ops),
              # Pallas kernels (optax_half._tpu), apart from XLA:TPU's own custom calls
              pallas_kernels=len(re.findall(r'custom_call_target="tpu_custom_call"', hlo)),
              hbm_bytes=hbm, hbm_bytes_costlier_branches=hbm_by(entry, max),
              param_sized_copies=copies, param_sized_transfers=transfers,
              scalar_ops=sum(scalars.values()), integer_scalar_ops=integer,
              scalar_op_kinds=dict(scalars), aliased_outputs=aliased)


def compile_tpu(name: str, chip: str, tree: str = "gpt2") -> tuple[str, dict]:
  """The optimized HLO of row ``name`` on ``tree`` for ``chip``, and its properties."""
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  import optax_half as oh  # noqa: PLC0415
  from benchmarks import common  # noqa: PLC0415
  dtype, tx, in_place = jax_rows()[name]
  sharding = jax.sharding.SingleDeviceSharding(tpu_device(chip))
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
  step.__name__ = "row_" + re.sub(r"\W+", "_", name).strip("_").lower()
  start = time.perf_counter()
  with warnings.catch_warnings():  # the gradients die unused, as in a training step
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params)
    compiled = lowered.compile()
  seconds = time.perf_counter() - start
  hlo = compiled.as_text()
  n = sum(math.prod(s) for s in shapes)
  info = hlo_properties(hlo, shapes)
  info.update(leaves=len(shapes), params=n, outputs=len(jax.tree.leaves(lowered.out_info)),
              hbm_bytes_per_param=info["hbm_bytes"] / n,
              hbm_bytes_per_param_costlier_branches=info["hbm_bytes_costlier_branches"] / n,
              scalar_ops_per_leaf=info["scalar_ops"] / len(shapes),
              temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
              largest_leaf_bytes=max(math.prod(s) for s in shapes) * jax.numpy.dtype(dtype).itemsize,
              compile_s=seconds, in_place=bool(in_place))
  return hlo, info


def tpu_kernels(out: Path, chips=None, rows=None, tree: str = "gpt2", echo=None) -> dict:
  """Compiles ``rows`` (default all) for ``chips`` (default all), writes the
  HLO and ``tpu.json`` into ``out``; ``echo(chip, row, info)`` after each.
  Run it in a fresh process: libtpu reads its environment when JAX starts."""
  for key, value in TPU_ENV.items():
    os.environ.setdefault(key, value)
  # the CPU kernel is off on purpose (OPTAX_HALF_NATIVE=0): no need to say so
  warnings.filterwarnings("ignore", "optax_half_native: ", RuntimeWarning)
  results = {}
  for chip in chips or CHIPS:
    (out / f"tpu-{chip}").mkdir(parents=True, exist_ok=True)
    results[chip] = {}
    for name in rows or jax_rows():
      hlo, info = compile_tpu(name, chip, tree)
      stem = re.sub(r"\W+", "_", name).strip("_").lower()
      (out / f"tpu-{chip}" / f"{stem}.hlo.txt").write_text(hlo)
      results[chip][name] = info
      # after each row: an hour's run stopped halfway keeps what it has
      (out / "tpu.json").write_text(json.dumps(dict(tree=tree, chips=results), indent=1) + "\n")
      if echo:
        echo(chip, name, info)
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--chips", default=None, help=f"comma-separated, of {','.join(CHIPS)} (default: all)")
  parser.add_argument("--rows", default=None, help="comma-separated JAX rows (default: all)")
  parser.add_argument("--tree", default="gpt2", help="the rows' tree (benchmarks.common)")
  args = parser.parse_args()
  chips = [c for c in args.chips.split(",") if c] if args.chips else None
  rows = [r for r in args.rows.split(",") if r] if args.rows else None
  # copies: param-sized, HBM to HBM; xfers: param-sized, between HBM and VMEM;
  # int ops: integer scalar ops outside the fusions (the leaves' random-bit keys)
  print(f"{'chip':4s} {'JAX row (' + args.tree + ')':56s} {'fusions':>7s} {'HBM B/p':>7s} "
        f"{'copies':>6s} {'xfers':>5s} {'temp MB':>7s} {'aliased':>7s} {'int ops':>7s} "
        f"{'compile s':>9s}", flush=True)

  def echo(chip, name, r):
    print(f"{chip:4s} {name:56s} {r['fusions']:7d} {r['hbm_bytes_per_param']:7.2f} "
          f"{r['param_sized_copies']:6d} {r['param_sized_transfers']:5d} "
          f"{r['temp_bytes'] / 1e6:7.1f} {r['aliased_outputs']:3d}/{r['outputs']:<3d} "
          f"{r['integer_scalar_ops']:7d} {r['compile_s']:9.1f}", flush=True)
  tpu_kernels(args.out, chips, rows, args.tree, echo)


if __name__ == "__main__":
  main()
