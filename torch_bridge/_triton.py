"""A multi-tensor Triton AdamW step: many tensors in one launch, the eager step's bits.

``step_group`` steps a group of tensors of one configuration (mode, dtypes,
step count, scalars) with one kernel launch, as torch's ``_fused_adamw`` and
apex's ``multi_tensor_apply`` do: a table of the tensors' data pointers,
sizes, random-bit offsets and leaves (int64), and a map from each program to
(tensor, block). The fp32 scalars, GradScaler's ``inv_scale`` and
``found_inf`` and a tensor ``lr`` are read on the device (no host sync).
Every element gets the bits of ``adam.adamw_step`` (``fused=False``):
the kernels round with integer bit operations, and launch without FMA
contraction (``_triton_kernels``). Runs on CUDA tensors, or on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU tests
use). Not the CUDA default yet: it has not been measured on a GPU
(docs/algorithms.md#triton-multi-tensor-step).
"""

from __future__ import annotations

import collections
import functools
import importlib.util
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

import optax_half_native as native_lib
from torch_bridge import rounding

__all__ = ["available", "interpreting", "supports", "step_group", "round_bits", "Batch", "BLOCK"]

BLOCK = 1024  # elements per program
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ROW = 8  # int64 columns of the table: p, g, mu, nu, buffer, numel, index0, leaf
_CACHE = 256  # tables kept on the device (least recently used out)
_N_SCALARS = 9


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether ``triton`` is importable."""
  return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
  """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``) now."""
  import triton  # noqa: PLC0415 (optional)
  return bool(triton.knobs.runtime.interpret)


@functools.lru_cache(maxsize=None)
def _kernels_for(interpret: bool):
  # triton.jit picks compiler or interpreter when it decorates: one module each.
  path = Path(__file__).with_name("_triton_kernels.py")
  name = "torch_bridge._triton_kernels" + ("_interpreted" if interpret else "")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _kernels():
  if not available():
    raise RuntimeError("torch_bridge's Triton step needs triton (pip install triton).")
  return _kernels_for(interpreting())


def _check_device(device: torch.device) -> None:
  if device.type == "cuda":
    return
  if device.type == "cpu" and interpreting():
    return
  raise ValueError(f"the Triton step runs on CUDA tensors (CPU tensors only under "
                   f"TRITON_INTERPRET=1); got tensors on {device}.")


def _launch(kernel, grid, *args, **kwargs):
  # The interpreter's numpy ops warn on the overflows the hash wants, and
  # on NaN/Inf inputs the eager step also takes.
  with np.errstate(all="ignore"):
    kernel[grid](*args, **kwargs, enable_fp_fusion=False)


def round_bits(x: torch.Tensor, dtype: torch.dtype, words: Optional[torch.Tensor] = None):
  """fp32 ``x`` rounded to ``dtype`` (bf16 or fp16) by the kernels' integer
  rounding: nearest even, or ``rounding.stochastic_round`` with int32
  ``words``. Returns a ``dtype`` tensor (for tests of the rounding itself)."""
  if dtype not in (torch.bfloat16, torch.float16):
    raise ValueError(f"round_bits rounds to bfloat16 or float16; got {dtype}.")
  if x.dtype != torch.float32 or not x.is_contiguous():
    raise ValueError("round_bits takes a contiguous float32 tensor.")
  _check_device(x.device)
  k = _kernels()
  out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
  if words is not None and (words.dtype != torch.int32 or words.shape != x.shape
                            or not words.is_contiguous() or words.device != x.device):
    raise ValueError("words must be a contiguous int32 tensor of x's shape and device.")
  n = x.numel()
  if n:
    _launch(k.round_kernel, (triton_cdiv(n, BLOCK),), x, out, n, _KIND[dtype],
            words is not None, x if words is None else words, BLOCK)
  return out.view(dtype)


def triton_cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _buffer_dtype(mode: str, dtype: torch.dtype) -> Optional[torch.dtype]:
  """The buffer a param of ``dtype`` keeps in ``mode`` (the compensation table's)."""
  if mode == "direct":
    return None
  return {None: None, "param": dtype, "int16": torch.int16,
          "float32": torch.float32}[native_lib.COMPENSATIONS[mode].buffer_dtype]


def _check(params, grads, mus, nus, buffers, mode: str) -> tuple:
  """The group's dtypes ``(param, grad, mu, nu, buffer)``, or a ValueError."""
  if mode not in native_lib.MODES or mode == "update":
    raise ValueError(f"mode must be one of {sorted(set(native_lib.MODES) - {'update'})}; "
                     f"got {mode!r}.")
  n = len(params)
  if not n:
    raise ValueError("step_group needs at least one tensor.")
  for name, col in (("grads", grads), ("mus", mus), ("nus", nus), ("buffers", buffers)):
    if len(col) != n:
      raise ValueError(f"step_group: {n} params but {len(col)} {name}.")
  for i, (p, g, m, v) in enumerate(zip(params, grads, mus, nus)):
    for name, t in (("param", p), ("grad", g), ("mu", m), ("nu", v)):
      if not torch.is_tensor(t):
        raise TypeError(f"tensor {i}: the {name} is a {type(t).__name__}, not a tensor.")
  p0 = params[0]
  if p0.dtype not in _KIND:
    raise ValueError(f"the Triton step takes float32, bfloat16 or float16 params; got {p0.dtype}.")
  if (mode == "direct") != (p0.dtype == torch.float32):
    raise ValueError(f"mode {mode!r} is for {'fp32' if mode == 'direct' else '16-bit'} "
                     f"params; got {p0.dtype} (an fp32 param takes 'direct').")
  if mode == "split" and p0.dtype != torch.bfloat16:
    raise ValueError(f"mode 'split' is for bfloat16 params; got {p0.dtype} "
                     f"(fp16 params take {native_lib.COMPENSATIONS['split'].fp16!r}).")
  want_buffer = _buffer_dtype(mode, p0.dtype)
  dtypes = (p0.dtype, grads[0].dtype, mus[0].dtype, nus[0].dtype, want_buffer)
  for k in (1, 2, 3):
    if dtypes[k] not in _KIND:
      raise ValueError(f"the Triton step takes float32, bfloat16 or float16 "
                       f"{('grads', 'mus', 'nus')[k - 1]}; got {dtypes[k]}.")
  device = p0.device
  _check_device(device)
  names = ("param", "grad", "mu", "nu", "buffer")
  for i, tensors in enumerate(zip(params, grads, mus, nus, buffers)):
    p = tensors[0]
    if (tensors[4] is None) != (want_buffer is None):
      raise ValueError(f"tensor {i}: mode {mode!r} {'needs' if want_buffer else 'takes no'} "
                       f"buffer.")
    for name, t, dtype in zip(names, tensors, dtypes):
      if t is None:
        continue
      if not torch.is_tensor(t):
        raise TypeError(f"tensor {i}: the {name} is a {type(t).__name__}, not a tensor.")
      if t.dtype != dtype:
        raise ValueError(f"tensor {i}: {name} dtype {t.dtype}, expected {dtype} "
                         f"(one group has one configuration).")
      if t.shape != p.shape:
        raise ValueError(f"tensor {i}: {name} shape {tuple(t.shape)} differs from the "
                         f"param's {tuple(p.shape)}.")
      if t.device != device:
        raise ValueError(f"tensor {i}: {name} on {t.device}, the group's params on {device}.")
      if not t.is_contiguous():
        raise ValueError(f"tensor {i}: the {name} is not contiguous (the Triton step "
                         f"reads flat memory).")
  return dtypes


def _to_device(values: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
  host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
  if device.type == "cuda":  # from pinned memory, without blocking the host
    return host.pin_memory().to(device, non_blocking=True)
  return host.to(device)


_tables: collections.OrderedDict = collections.OrderedDict()


def _table(device, rows: tuple):
  """The group's table and block map on the device (cached by their contents)."""
  key = (device, rows)
  if key in _tables:
    _tables.move_to_end(key)
    return _tables[key]
  table = np.array(rows, dtype=np.int64).reshape(-1, _ROW)
  blocks = [(t, b) for t, numel in enumerate(table[:, 5]) for b in range(triton_cdiv(int(numel), BLOCK))]
  if not blocks:
    value = None
  else:
    value = (_to_device(table, torch.int64, device),
             _to_device(np.array(blocks, dtype=np.int32), torch.int32, device), len(blocks))
  _tables[key] = value
  if len(_tables) > _CACHE:
    _tables.popitem(last=False)
  return value


def _scalars_tensor(scalars, device) -> torch.Tensor:
  if torch.is_tensor(scalars):
    s = scalars
  else:
    if len(scalars) != _N_SCALARS:
      raise ValueError(f"scalars: {_N_SCALARS} values (adamw_step's), got {len(scalars)}.")
    s = torch.stack([v.reshape(()) if torch.is_tensor(v) else
                     torch.tensor(v, dtype=torch.float32, device=device) for v in scalars])
  if s.dtype != torch.float32 or s.numel() != _N_SCALARS or s.device != device:
    raise ValueError(f"scalars: {_N_SCALARS} float32 values on {device}; got "
                     f"{s.numel()} {s.dtype} on {s.device}.")
  return s.reshape(-1).contiguous()


def _device_scalar(t, name: str, device) -> torch.Tensor:
  if not torch.is_tensor(t) or t.numel() != 1 or t.device != device:
    raise ValueError(f"{name} must be a one-element tensor on {device}.")
  return t.reshape(())


def step_group(params: Sequence[torch.Tensor], grads, mus, nus, buffers, scalars, *,
               mode: str, state_rounding: str = "nearest", seed: int = 0, step: int = 0,
               leaves: Optional[Sequence[int]] = None, indices: Optional[Sequence[int]] = None,
               maximize: bool = False, inv_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None) -> None:
  """One AdamW step of every tensor, in place, in one launch: ``adamw_step``'s bits.

  Args:
    params, grads, mus, nus: contiguous tensors, one configuration (dtypes
      alike within each list), each grad, moment and buffer of its param's shape.
    buffers: per param the mode's buffer (the compensation table's dtype:
      Kahan in the param dtype, split's int16 low half, master's fp32), or
      None for the modes without one.
    scalars: ``adamw_step``'s nine fp32 scalars, as one float32 tensor or a
      sequence of 0-dim tensors (a tensor ``lr`` included) or numbers.
    mode: an ``optax_half_native.MODES`` key: "direct" (fp32 params), or the
      compensation of 16-bit params ("kahan", "split", "stochastic", "none", "master").
    state_rounding: "nearest" or "stochastic" (16-bit moments).
    seed, step: the random-bit keys' seed and the tensors' step count
      before this step (one for the group); ``leaves``: each tensor's leaf
      (default 0, 1, ...); ``indices``: each tensor's random-bit counter of
      element 0 (a shard's offset; default 0).
    maximize: the gradients are read negated.
    inv_scale: a one-element fp32 tensor every gradient is multiplied by as
      it is read (a loss scaler's ``1 / scale``).
    found_inf: a one-element tensor; where nonzero the kernel writes nothing
      (the caller keeps the step count, as ``torch.optim.AdamW(fused=True)``).
  """
  params, grads, mus, nus, buffers = (list(c) for c in (params, grads, mus, nus, buffers))
  dtypes = _check(params, grads, mus, nus, buffers, mode)
  if state_rounding not in ("nearest", "stochastic"):
    raise ValueError(f"state_rounding must be 'nearest' or 'stochastic'; got {state_rounding!r}.")
  device = params[0].device
  n = len(params)
  leaves = list(range(n)) if leaves is None else [int(v) for v in leaves]
  indices = [0] * n if indices is None else [int(v) for v in indices]
  if len(leaves) != n or len(indices) != n:
    raise ValueError(f"step_group: {n} params, {len(leaves)} leaves, {len(indices)} indices.")
  s = _scalars_tensor(scalars, device)
  if inv_scale is not None:
    inv_scale = _device_scalar(inv_scale, "inv_scale", device)
    if inv_scale.dtype != torch.float32:
      raise ValueError(f"inv_scale must be float32; got {inv_scale.dtype}.")
  if found_inf is not None:
    found_inf = _device_scalar(found_inf, "found_inf", device)
  rows = []
  for p, g, m, v, b, leaf, index in zip(params, grads, mus, nus, buffers, leaves, indices):
    rows += [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
             0 if b is None else b.data_ptr(), p.numel(), index, leaf & 0xFFFFFFFF]
  entry = _table(device, tuple(rows))
  if entry is None:  # no elements
    return
  table, blocks, n_blocks = entry
  keys = [rounding._signed32(rounding._stream_key(int(seed), int(step), stream))
          for stream in (rounding.STREAM_PARAMS, rounding.STREAM_MOMENTS)]
  p_dtype, g_dtype, m_dtype, v_dtype, b_dtype = dtypes
  sr = rounding._stochastic_moments(m_dtype, v_dtype, state_rounding)
  _launch(_kernels().adamw_kernel, (n_blocks,), table, blocks, s,
          s if inv_scale is None else inv_scale, s if found_inf is None else found_inf,
          keys[0], keys[1], _KIND[p_dtype], _KIND[g_dtype], _KIND[m_dtype], _KIND[v_dtype],
          _KIND.get(b_dtype, 0), native_lib.MODES[mode], sr, bool(maximize),
          inv_scale is not None, found_inf is not None, BLOCK)


def supports(tensors, index=0) -> bool:
  """Whether ``step_group`` takes these ``(param, grad, mu, nu, buffer)``:
  on a device it runs on, contiguous, of the dtypes it reads, the random-bit
  counter an offset (not a tensor of every element's)."""
  p = tensors[0]
  if not available() or torch.is_tensor(index) or p.dtype not in _KIND:
    return False
  if p.device.type != "cuda" and not (p.device.type == "cpu" and interpreting()):
    return False
  return all(t is None or (t.is_contiguous() and t.device == p.device
                           and (k == 4 or t.dtype in _KIND))
             for k, t in enumerate(tensors))


class Batch:
  """``LowPrecisionAdamW``'s Triton step: ``add`` each tensor, then ``run``
  launches one kernel per configuration (device, mode, dtypes, step count,
  scalars, maximize) and advances each tensor's step count. The interface
  of ``adam._Grouped``."""

  def __init__(self, seed: int, state_rounding: str):
    self._seed = seed
    self._state_rounding = state_rounding
    self._configs: dict = {}  # config -> [scalars, rows]
    self._taken: set = set()

  def add(self, tensors, mode: str, step: int, leaf: int, scalars, state: dict, index=0,
          maximize: bool = False) -> bool:
    """Takes ``(param, grad, mu, nu, buffer)``; False if ``supports`` does not."""
    if not supports(tensors, index):
      return False
    p = tensors[0]
    self._taken.add(id(p))
    config = (p.device, mode, step, id(scalars), bool(maximize),
              *(None if t is None else t.dtype for t in tensors))
    entry = self._configs.setdefault(config, [scalars, []])
    entry[1].append((tensors, leaf, int(index), state))
    return True

  def before(self, p: torch.Tensor) -> None:
    """A param listed twice steps twice, in order: its first step runs here."""
    if id(p) in self._taken:
      self.run()

  @torch.no_grad()
  def run(self) -> None:
    configs, self._configs = self._configs, {}
    self._taken.clear()
    for config, (scalars, rows) in configs.items():
      _, mode, step, _, maximize = config[:5]
      columns = list(zip(*(tensors for tensors, _, _, _ in rows)))
      step_group(*columns, scalars, mode=mode, state_rounding=self._state_rounding,
                 seed=self._seed, step=step, leaves=[leaf for _, leaf, _, _ in rows],
                 indices=[index for _, _, index, _ in rows], maximize=maximize)
      for _, _, _, state in rows:
        state["step"] += 1
