"""A multi-tensor Triton AdamW step: many tensors in one launch, the eager step's bits.

A ``Plan`` steps a group of tensors of one configuration (mode, dtypes,
maximize) with one kernel launch (two where some tensor is not 16-byte
aligned), as torch's ``_fused_adamw`` and apex's ``multi_tensor_apply`` do: a
table of the tensors' addresses, sizes, random-bit offsets, leaves and step
counts (int64), and a map from each program to (tensor, first element). It
is built once and run every step: the kernel reads each tensor's int64 step
count on the device and makes the bias corrections and random-bit keys from
it, a second small launch advances the counts, and lr, betas, eps and weight
decay go in as kernel arguments (or lr as a device tensor), so a step
allocates nothing and reads nothing back. GradScaler's ``inv_scale`` and
``found_inf`` are read on the device. Every element gets the bits of
``adam.adamw_step`` (``fused=False``): the kernels round with integer bit
operations and launch without FMA contraction (``_triton_kernels``). Runs
on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, which the CPU tests use).
Spec: docs/algorithms.md#triton-multi-tensor-step.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

import optax_half_native as native_lib
from torch_bridge import rounding

__all__ = ["available", "interpreting", "supports", "step_group", "round_bits", "Plan", "Batch",
           "CHUNK", "block_of"]

CHUNK = 4096  # elements per program (its blocks one after another)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BUFFER_KIND = {**_KIND, torch.int16: 1}  # split's int16 low half: 16-bit storage
_ROW = 9  # int64 columns of the table: p, g, mu, nu, buffer, numel, index0, leaf, step
_ALIGN = 16  # bytes: full blocks of aligned tensors move 16 bytes per access
_MAX_NUMEL = 2**31 - CHUNK  # the kernel's in-tensor offsets are int32


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
    _launch(k.round_kernel, (triton_cdiv(n, 1024),), x, out, n, _KIND[dtype],
            words is not None, x if words is None else words, 1024)
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


def _check_steps(steps, device) -> None:
  for i, t in enumerate(steps):
    if not (torch.is_tensor(t) and t.dtype == torch.int64 and t.numel() == 1
            and t.device == device):
      raise ValueError(f"tensor {i}: its step count must be a one-element int64 tensor on "
                       f"{device} (the kernel reads and advances it there); got "
                       f"{type(t).__name__ if not torch.is_tensor(t) else (t.dtype, t.device)}.")


def _to_device(values: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
  host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
  if device.type == "cuda":  # from pinned memory, without blocking the host
    return host.pin_memory().to(device, non_blocking=True)
  return host.to(device)


def block_of(config: dict) -> int:
  """Elements per block of a kernel configuration: 8 per thread (16-byte
  accesses of 16-bit tensors), 4 where that would take more than 96
  registers (fp16 moments rounded stochastically, an fp16 param's master,
  tensors not aligned): ``benchmarks.gpu_static`` reports them."""
  heavy = ((config["SR_MOMENTS"] and 2 in (config["M"], config["V"]))
           or (config["P"] == 2 and config["MODE"] == native_lib.MODES["master"]))
  return 512 if heavy or not config["ALIGNED"] else 1024


def _programs(numels: np.ndarray, rows: np.ndarray) -> np.ndarray:
  """(row, first element) of each program over the tensors ``rows`` (int32 pairs)."""
  counts = -(-numels[rows] // CHUNK)
  row_of = np.repeat(rows, counts)
  first = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                   counts)
  return np.stack([row_of, first * CHUNK], axis=1).astype(np.int32)


class Plan:
  """The launches that step one group of tensors, built once and run every step.

  Holds the params', moments', buffers' and step counts' tensors (their
  addresses are in the table); a gradient's address is taken as given, and
  whoever runs the plan again checks that each gradient is still there
  (``LowPrecisionAdamW`` compares their data pointers each step).
  """

  def __init__(self, params, grads, mus, nus, buffers, steps, *, mode: str,
               state_rounding: str = "nearest", leaves=None, indices=None,
               maximize: bool = False):
    params, grads, mus, nus, buffers, steps = (list(c) for c in (params, grads, mus, nus,
                                                                   buffers, steps))
    dtypes = _check(params, grads, mus, nus, buffers, mode)
    if state_rounding not in ("nearest", "stochastic"):
      raise ValueError(f"state_rounding must be 'nearest' or 'stochastic'; got "
                       f"{state_rounding!r}.")
    device = self.device = params[0].device
    n = len(params)
    if len(steps) != n:
      raise ValueError(f"step_group: {n} params but {len(steps)} step counts.")
    _check_steps(steps, device)
    leaves = list(range(n)) if leaves is None else [int(v) for v in leaves]
    indices = [0] * n if indices is None else [int(v) for v in indices]
    if len(leaves) != n or len(indices) != n:
      raise ValueError(f"step_group: {n} params, {len(leaves)} leaves, {len(indices)} indices.")
    for i, p in enumerate(params):
      if p.numel() > _MAX_NUMEL:
        raise ValueError(f"tensor {i} has {p.numel()} elements; the Triton step takes at most "
                         f"{_MAX_NUMEL} per tensor.")
    self.tensors = (params, mus, nus, buffers, steps)  # kept alive: the table points at them
    table = np.array([[t.data_ptr() if t is not None else 0 for t in (p, g, m, v, b)]
                      + [p.numel(), index, leaf & 0xFFFFFFFF, st.data_ptr()]
                      for p, g, m, v, b, index, leaf, st
                      in zip(params, grads, mus, nus, buffers, indices, leaves, steps)],
                     dtype=np.int64).reshape(-1, _ROW)
    p_dtype, g_dtype, m_dtype, v_dtype, b_dtype = dtypes
    base = dict(P=_KIND[p_dtype], G=_KIND[g_dtype], M=_KIND[m_dtype], V=_KIND[v_dtype],
                BUF=_BUFFER_KIND.get(b_dtype, 0), MODE=native_lib.MODES[mode],
                SR_MOMENTS=rounding._stochastic_moments(m_dtype, v_dtype, state_rounding),
                MAXIMIZE=bool(maximize))
    aligned = (table[:, :5] % _ALIGN == 0).all(axis=1)
    numels = table[:, 5]
    # one table on the device: every launch's programs name its rows, the advance reads them all
    self.table = _to_device(table, torch.int64, device)
    self.launches = []
    for flag in (True, False):
      rows = np.nonzero((aligned == flag) & (numels > 0))[0]
      if len(rows):
        config = dict(base, ALIGNED=flag)
        config["BLOCK"] = block_of(config)
        config["ITERS"] = CHUNK // config["BLOCK"]
        programs = _programs(numels, rows)
        self.launches.append((_to_device(programs, torch.int32, device), len(programs), config))
    self.n = n

  def run(self, lr, b1, b2, eps, weight_decay, seed: int, inv_scale=None, found_inf=None,
          grad_scale=None):
    """One step of every tensor: ``adamw_step``'s scalars from these
    hyperparameters and each tensor's step count, which it advances (not
    where ``found_inf`` is nonzero). ``lr``: a number or a one-element fp32
    tensor on the device; ``inv_scale``, ``found_inf``: one-element tensors
    there; ``grad_scale`` (instead of ``inv_scale``): the loss scale, whose
    reciprocal the kernel makes (GradScaler's ``optimizer.grad_scale``)."""
    k = _kernels()
    lr_tensor = torch.is_tensor(lr)
    if lr_tensor and (lr.device != self.device or lr.dtype != torch.float32):
      lr, lr_tensor = float(lr), False  # read once here, as the eager step reads it
    if lr_tensor:
      lr_ptr, lr = _device_scalar(lr, "a tensor lr", self.device), 0.0
      if lr_ptr.dtype != torch.float32:
        raise ValueError(f"a tensor lr must be float32 for the Triton step; got {lr_ptr.dtype}.")
    else:
      lr_ptr, lr = self.table, float(np.float32(lr))
    seed_key = rounding._signed32(rounding._mix32_int(int(seed)))
    dummy = self.table
    invert = grad_scale is not None
    if invert:
      inv_scale = grad_scale
    # a loss scaler's tensors on another device (its scale's): copied here, as torch's fused step does
    if inv_scale is not None and inv_scale.device != self.device:
      inv_scale = inv_scale.to(self.device)
    if found_inf is not None and found_inf.device != self.device:
      found_inf = found_inf.to(self.device)
    for programs, n_programs, config in self.launches:
      _launch(k.adamw_kernel, (n_programs,), self.table, programs, lr, lr_ptr, float(np.float32(b1)),
              float(np.float32(b2)), float(np.float32(eps)), float(np.float32(weight_decay)),
              seed_key, dummy if inv_scale is None else inv_scale,
              dummy if found_inf is None else found_inf, **config,
              HAS_INV_SCALE=inv_scale is not None, HAS_FOUND_INF=found_inf is not None,
              LR_TENSOR=lr_tensor, INVERT_SCALE=invert)
    _launch(k.advance_kernel, (triton_cdiv(self.n, 1024),), self.table, self.n,
            dummy if found_inf is None else found_inf, found_inf is not None, 1024)


def _device_scalar(t, name: str, device) -> torch.Tensor:
  if not torch.is_tensor(t) or t.numel() != 1 or t.device != device:
    raise ValueError(f"{name} must be a one-element tensor on {device}.")
  return t.reshape(())


def step_group(params: Sequence[torch.Tensor], grads, mus, nus, buffers, steps, *, lr, b1, b2,
               eps, weight_decay, mode: str, state_rounding: str = "nearest", seed: int = 0,
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
    steps: per param its step count before this step, a one-element int64
      tensor on the params' device (``state["step"]``), advanced by one here
      (not where ``found_inf`` is nonzero).
    lr, b1, b2, eps, weight_decay: the hyperparameters, each used as an fp32
      value (``lr`` may be a one-element fp32 tensor on the device); the bias
      corrections come from each tensor's step count, as ``_scalars`` makes them.
    mode: an ``optax_half_native.MODES`` key: "direct" (fp32 params), or the
      compensation of 16-bit params ("kahan", "split", "stochastic", "none", "master").
    state_rounding: "nearest" or "stochastic" (16-bit moments).
    seed: the random-bit keys' seed; ``leaves``: each tensor's leaf
      (default 0, 1, ...); ``indices``: each tensor's random-bit counter of
      element 0 (a shard's offset; default 0).
    maximize: the gradients are read negated.
    inv_scale: a one-element fp32 tensor every gradient is multiplied by as
      it is read (a loss scaler's ``1 / scale``).
    found_inf: a one-element tensor; where nonzero the kernel writes nothing
      and the step counts stay, as ``torch.optim.AdamW(fused=True)``.
  """
  params = list(params)
  if not params:
    raise ValueError("step_group needs at least one tensor.")
  device = params[0].device
  _check_device(device)
  if inv_scale is not None:
    inv_scale = _device_scalar(inv_scale, "inv_scale", device)
    if inv_scale.dtype != torch.float32:
      raise ValueError(f"inv_scale must be float32; got {inv_scale.dtype}.")
  if found_inf is not None:
    found_inf = _device_scalar(found_inf, "found_inf", device)
  Plan(params, grads, mus, nus, buffers, steps, mode=mode, state_rounding=state_rounding,
       leaves=leaves, indices=indices, maximize=maximize).run(
           lr, b1, b2, eps, weight_decay, seed, inv_scale, found_inf)


def supports(tensors, index=0) -> bool:
  """Whether ``step_group`` takes these ``(param, grad, mu, nu, buffer)``:
  on a device it runs on, contiguous, of the dtypes it reads, the random-bit
  counter an offset (not a tensor of every element's)."""
  p = tensors[0]
  if not available() or torch.is_tensor(index) or p.dtype not in _KIND:
    return False
  if p.device.type != "cuda" and not (p.device.type == "cpu" and interpreting()):
    return False
  if p.numel() > _MAX_NUMEL:
    return False
  return all(t is None or (t.is_contiguous() and t.device == p.device
                           and (k == 4 or t.dtype in _KIND))
             for k, t in enumerate(tensors))


class Batch:
  """``LowPrecisionAdamW``'s Triton step: ``add`` each tensor, then ``run``
  launches one plan per configuration (device, mode, dtypes, maximize, the
  group's hyperparameters) and keeps the plans it ran (``plans``), which the
  optimizer runs again while nothing changed. The interface of ``adam._Grouped``."""

  def __init__(self, seed: int, state_rounding: str, cuda_only: bool = False,
               grad_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None):
    self._seed = seed
    self._state_rounding = state_rounding
    self._cuda_only = cuda_only
    self._amp = dict(grad_scale=grad_scale, found_inf=found_inf)  # GradScaler's, for every run
    self._configs: dict = {}  # config -> [hyper, rows]
    self._taken: set = set()
    self.plans: list = []  # (plan, group index) of every launch so far
    self.count = 0  # tensors taken so far

  def add(self, tensors, mode: str, leaf: int, hyper: tuple, group: int, state: dict,
          index=0, maximize: bool = False) -> bool:
    """Takes ``(param, grad, mu, nu, buffer)``; False if ``supports`` does not.
    ``hyper``: ``(lr, b1, b2, eps, weight_decay)`` of the param's group (index ``group``)."""
    p = tensors[0]
    if (self._cuda_only and p.device.type != "cuda") or not supports(tensors, index):
      return False
    step = state["step"]
    if not (torch.is_tensor(step) and step.device == p.device and step.dtype == torch.int64):
      # the count lives where the kernel reads it (once; the step stays there)
      step = state["step"] = rounding.device_scalar(int(step), torch.int64, p.device)
    self._taken.add(id(p))
    self.count += 1
    config = (p.device, mode, bool(maximize), group,
              *(None if t is None else t.dtype for t in tensors))
    entry = self._configs.setdefault(config, [hyper, []])
    entry[1].append((tensors, step, leaf, int(index)))
    return True

  def before(self, p: torch.Tensor) -> None:
    """A param listed twice steps twice, in order: its first step runs here."""
    if id(p) in self._taken:
      self.run()

  @torch.no_grad()
  def run(self) -> None:
    configs, self._configs = self._configs, {}
    self._taken.clear()
    for config, (hyper, rows) in configs.items():
      _, mode, maximize, group = config[:4]
      columns = list(zip(*(tensors for tensors, _, _, _ in rows)))
      plan = Plan(*columns, [step for _, step, _, _ in rows], mode=mode,
                  state_rounding=self._state_rounding, leaves=[leaf for _, _, leaf, _ in rows],
                  indices=[index for _, _, _, index in rows], maximize=maximize)
      plan.run(*hyper, self._seed, **self._amp)
      self.plans.append((plan, group))
