"""Named Adam optimizers for low-precision params: ``optax_half/adam.py`` in torch.

* ``adam_fp32_master``: Adam(W) with fp32 moments on an fp32 master copy.
* ``adamw_bf16``: AdamW whose params stay 16-bit, compensated by Kahan
  summation, an exact split master, stochastic rounding, or nothing.
* ``scale_by_adamw``: the shared core applied directly (round to nearest).

All three are ``LowPrecisionAdamW`` optimizers: one native implementation of
the core and of every compensation, a per-tensor kernel (``adamw_step``) that
runs eagerly or, with ``fused=True``, compiled into one loop per tensor by
``torch.compile``. The order of operations and every dtype follow
``docs/algorithms.md#adamw-core`` and ``optax_half.adam.scale_by_adamw``
line for line; random bits come from ``torch_bridge.rounding`` and equal the
JAX ones for the same integer key.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import types
from typing import Callable, Optional

import numpy as np
import torch

import optax_half_native as native_lib
from optax_half_native import checks
from torch_bridge import _dist, _native, _triton, rounding
from torch_bridge.compensation import COMPENSATIONS, Compensation
from torch_bridge._optim import (TORCH_ADAMW_KEYS, LowPrecisionOptimizer, check_grad,
                                 check_no_grad_hyperparams, check_param, check_torch_adamw_args,
                                 check_torch_keys, grad_of, grads_of,
                                 init_skip_nonfinite, seed_from_key, stale_state_message,
                                 step_count, step_grad, torch_spellings)

__all__ = ["adam_fp32_master", "adamw_bf16", "scale_by_adamw", "LowPrecisionAdamW",
           "adamw_step"]

# torch.optim.AdamW's keys that param groups keep (the step reads them).
_KEPT = ("maximize", "amsgrad", "differentiable")

def _param_compensation(compensation: Compensation,
                        dtype: torch.dtype) -> Optional[Compensation]:
  """What a param of ``dtype`` takes: its 16-bit compensation, or None for a
  param of 32 bits or more (``p += u`` in its own dtype)."""
  return None if dtype.itemsize >= 4 else compensation.for_dtype(dtype)


def _own_moments(dtype: torch.dtype) -> bool:
  """Whether a param of ``dtype`` keeps moments of its own dtype whatever
  mu_dtype/nu_dtype say (None or float32, _check_param): float64 (stepped in
  float64) and complex params (stepped as real pairs, as torch.optim.AdamW)."""
  return dtype.is_complex or dtype == torch.float64


def moment_dtype(dtype: torch.dtype) -> torch.dtype:
  """The moments' default dtype for a param of ``dtype`` (fp16: fp32), as in optax_half."""
  return getattr(torch, native_lib.moment_dtype_of(str(dtype).removeprefix("torch.")))


def _kernel_mode(compensation: Optional[Compensation]) -> str:
  """The kernel's mode (an ``optax_half_native.MODES`` key)."""
  return "direct" if compensation is None else compensation.name


@functools.lru_cache(maxsize=None)
def _state_layout(compensation: Compensation, mu_dtype, nu_dtype, dtype: torch.dtype,
                  amsgrad: bool = False) -> dict:
  """``LowPrecisionAdamW``'s state tensors (``step`` aside) of a ``dtype``
  param: name -> dtype (``amsgrad``: with ``nu_max``, nu's running max)."""
  if _own_moments(dtype):
    layout = {"mu": dtype, "nu": dtype}
  else:
    layout = {"mu": mu_dtype or moment_dtype(dtype), "nu": nu_dtype or moment_dtype(dtype)}
  if amsgrad:
    layout["nu_max"] = layout["nu"]
  rules = _param_compensation(compensation, dtype)
  if rules is not None and rules.buffer:
    layout[rules.buffer] = rules.buffer_dtype_of(dtype)
  return layout


def adamw_step(param, grad, mu, nu, buffer, scalars, keys,
               compensation: Optional[Compensation], state_rounding: str, index=0,
               maximize: bool = False, nu_max=None) -> None:
  """One AdamW step on one tensor, in place, in fp32 (the core + compensation).

  ``scalars``: fp32 0-dim tensors ``(lr, b1, b2, one_minus_b1, one_minus_b2,
  inv_bc1, inv_bc2, eps, weight_decay)`` (``inv_bc = 1 / (1 - b ** t)`` from
  ``rounding.one_minus_pow``); ``keys``: int32 0-dim tensors, the random keys
  of the param and moments streams; ``index``: the random-bit counter of the
  elements (``rounding.bits_from_key``: 0 for a whole tensor, a shard's
  offset, or every element's); ``compensation``: the param's
  (``_param_compensation``), None for a wide param; ``maximize``: the
  gradient is negated as it is read (exact: the bits of a step on
  ``-grad``); ``nu_max``: AMSGrad's running max of the stored ``nu`` (in
  nu's dtype), or None. Written with tensor scalars only, so that ``torch.compile``
  turns it into one loop without recompiling when the learning rate or the
  step change. Every op rounds to fp32 (no FMA: Inductor's
  CPU backend compiles with ``-ffp-contract=off``); the JAX side matches with
  ``no_fma``. Compiled for CUDA (Triton) the step may differ from the eager one
  by a few ULP (docs/algorithms.md#on-gpu).
  """
  lr, b1, b2, one_minus_b1, one_minus_b2, inv_bc1, inv_bc2, eps, weight_decay = scalars
  key_p, key_m = keys
  # fp32 math; a float64 param's in float64 (its scalars too, LowPrecisionAdamW._scalars)
  widen = rounding.widen if param.dtype != torch.float64 else torch.Tensor.double
  g = widen(grad)
  if maximize:
    g = -g
  x = widen(param) if compensation is None else compensation.read(param, buffer)
  m32 = b1 * widen(mu) + one_minus_b1 * g
  v32 = b2 * widen(nu) + one_minus_b2 * (g * g)
  m_hat = m32 * inv_bc1
  # AMSGrad: the denominator takes the largest second moment so far
  v_den = v32
  if nu_max is not None:
    held = widen(nu_max)
    if torch.is_grad_enabled():  # differentiable: autograd keeps it; nu_max is written below
      held = held.clone()
    v_den = torch.maximum(held, v32)
  v_hat = v_den * inv_bc2
  u = m_hat / (rounding.sqrt(v_hat) + eps)
  # No decay term at 0 (an Inf param stays one, as torch.optim.AdamW's): docs, AdamW core.
  u = torch.where(torch.as_tensor(weight_decay == 0), u, u + weight_decay * x)
  u = -lr * u
  if compensation is None:  # a wide param (16-bit ones land through their compensation)
    param.add_(u)
  else:
    x_new = x + u
    bits = (rounding.bits_from_key(key_p, x_new.shape, x_new.device, index)
            if compensation.draws_bits else None)
    compensation.write(x_new, param, buffer, bits)
  m_new, v_new = rounding.round_moments(m32, v32, mu.dtype, nu.dtype, state_rounding, key_m,
                                        index)
  mu.copy_(m_new)
  nu.copy_(v_new)
  if nu_max is not None:  # the running max of the stored nu (torch's max_exp_avg_sq)
    nu_max.copy_(torch.maximum(held.to(nu_max.dtype), v_new))


@functools.lru_cache(maxsize=None)
def _compiled_step(config: tuple):
  """``adamw_step`` compiled for one (compensation, rounding, dtypes) configuration.

  Each configuration gets its own copy of the code object, so its graphs
  count against their own recompile limit (Dynamo's limit is per code
  object). ``dynamic=True`` and flattened tensors: one graph for all sizes
  (plus Dynamo's size-1 specialisation). ``emulate_precision_casts`` keeps
  every fp32 <-> 16-bit conversion the math asks for (Inductor would
  otherwise fold ``f32(bf16(x))`` into ``x``).
  """
  name = "adamw_step_" + "_".join(str(c).replace("torch.", "") for c in config)
  code = adamw_step.__code__.replace(co_name=name)
  fn = types.FunctionType(code, adamw_step.__globals__, name)
  return torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})


# The most elements a grouped eager step concatenates: what it adds to the
# device's memory is one such group's copies, counters and keys, and the
# step's fp32 temporaries, at most about 75 bytes an element (0.6 GB).
_GROUP_ELEMENTS = 1 << 23
# Groups whose index tensors _Grouped keeps on the device (least recently used out).
_GROUP_CACHE = 256


_STREAMS = (rounding.STREAM_PARAMS, rounding.STREAM_MOMENTS)


def _leaf_keys(seed: int, step: int, leaf: int, device) -> tuple:
  """One tensor's keys of the params and moments streams (``key_tensor``)."""
  return tuple(rounding.key_tensor(seed, step, s, leaf, device) for s in _STREAMS)


def _groups_on(device: torch.device) -> bool:
  """Whether the default step (``fused=None``) groups this device's tensors:
  every device but the CPU, where the native kernel steps them."""
  return device.type != "cpu"


def _to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
  """A small host array on ``device`` without a sync: on CUDA, copied from
  pinned memory without blocking (a copy from pageable memory waits)."""
  host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
  if device.type == "cuda":
    return host.pin_memory().to(device, non_blocking=True)
  return host.to(device)


class _Grouped:
  """The eager step of many tensors at once (``fused=None`` off the CPU).

  ``adamw_step`` on one tensor is about 70 ops, each a kernel launch on a
  GPU, so stepping tensors one by one is bound by the launches. Tensors of
  one configuration (device, compensation, dtypes, step, group scalars) are
  concatenated, up to ``_GROUP_ELEMENTS`` elements, stepped by one
  ``adamw_step`` with every element's random-bit counter (its index in its
  own tensor) and keys (its own tensor's), and copied back: the same bits as
  stepping each alone, in about 70 launches for all of them plus a few per
  buffer. ``add`` each tensor, then ``run``; a tensor's step count advances
  once it is stepped. ``cache``: the optimizer's, for the small index
  tensors of each group of tensors (on the device once, not every step).
  """

  def __init__(self, seed: int, state_rounding: str, cache: collections.OrderedDict):
    self._seed = seed
    self._state_rounding = state_rounding
    self._cache = cache
    self._configs: dict = {}  # config -> [scalars, [(tensors, leaf, state)], elements]
    self._taken: set = set()  # ids of the params taken since the last run

  def add(self, tensors, compensation: Optional[Compensation], step: int, leaf: int, scalars,
          state: dict, index=0, maximize: bool = False) -> bool:
    """Takes ``(param, grad, mu, nu, buffer)`` for a grouped step; False if
    it does not (the CPU, a shard's counters, a non-contiguous tensor, a
    tensor of ``_GROUP_ELEMENTS`` or more: its own step costs no more)."""
    p = tensors[0]
    if (not _groups_on(p.device) or torch.is_tensor(index) or index
        or p.numel() >= _GROUP_ELEMENTS
        or not all(t is None or t.is_contiguous() for t in tensors)):
      return False
    self._taken.add(id(p))
    config = (p.device, compensation, step, id(scalars), maximize,
              *(None if t is None else t.dtype for t in tensors))
    entry = self._configs.get(config)
    if entry is not None and entry[2] + p.numel() > _GROUP_ELEMENTS:
      self._step(config, self._configs.pop(config))  # full: step it, start another
      entry = None
    if entry is None:
      entry = self._configs[config] = [scalars, [], 0]
    entry[1].append((tensors, leaf, state))
    entry[2] += p.numel()
    return True

  def before(self, p: torch.Tensor) -> None:
    """Called before ``p``'s step count is read: a param listed twice in the
    optimizer steps twice, in order (its first step is run here)."""
    if id(p) in self._taken:
      self.run()

  def run(self) -> None:
    """Steps every tensor added and advances its step count."""
    configs, self._configs = self._configs, {}
    self._taken.clear()
    for config, entry in configs.items():
      self._step(config, entry)

  def _index(self, device, sizes: tuple, leaves: tuple):
    """The group's leaves, sizes and first elements' positions on the device."""
    key = (device, sizes, leaves)
    if key in self._cache:
      self._cache.move_to_end(key)
    else:
      starts = np.concatenate([[0], np.cumsum(sizes[:-1])])
      self._cache[key] = (_to_device(leaves, torch.int32, device),
                          _to_device(sizes, torch.int64, device),
                          _to_device(starts, torch.int32, device))
      if len(self._cache) > _GROUP_CACHE:
        self._cache.popitem(last=False)
    return self._cache[key]

  def _random_bits(self, compensation: Optional[Compensation], mu, nu) -> bool:
    """Whether the step draws random bits: for the params, or for moments
    that ``rounding.round_moments`` rounds stochastically."""
    return (compensation is not None and compensation.draws_bits) or \
        rounding._stochastic_moments(mu.dtype, nu.dtype, self._state_rounding)

  @torch.no_grad()
  def _step(self, config, entry) -> None:
    device, compensation, step, _, maximize = config[:5]
    scalars, rows, total = entry
    if len(rows) == 1:  # nothing to concatenate
      tensors, leaf, _ = rows[0]
      adamw_step(*tensors, scalars, _leaf_keys(self._seed, step, leaf, device), compensation,
                 self._state_rounding, 0, maximize)
    else:
      columns = list(zip(*(tensors for tensors, _, _ in rows)))
      sizes = tuple(t.numel() for t in columns[0])
      flat = [None if col[0] is None else torch.cat([t.reshape(-1) for t in col])
              for col in columns]
      index, keys = 0, (0, 0)
      if self._random_bits(compensation, columns[2][0], columns[3][0]):
        leaves, counts, starts = self._index(device, sizes, tuple(leaf for _, leaf, _ in rows))
        # every element's random-bit counter: its index in its own tensor
        index = (torch.arange(total, dtype=torch.int32, device=device)
                 - torch.repeat_interleave(starts, counts, output_size=total))
        # every element's keys: its tensor's leaf_key, mix32(stream_key ^ leaf)
        keys = tuple(torch.repeat_interleave(rounding.mix32(
            rounding._key_tensor_of(rounding._stream_key(self._seed, step, s), device)
            ^ leaves), counts, output_size=total) for s in _STREAMS)
      adamw_step(*flat, scalars, keys, compensation, self._state_rounding, index, maximize)
      for k, (col, values) in enumerate(zip(columns, flat)):
        if k != 1 and values is not None:  # the gradient is only read
          torch._foreach_copy_([t.view(-1) for t in col], list(values.split(list(sizes))))
    for _, _, state in rows:
      state["step"] += 1


class LowPrecisionAdamW(LowPrecisionOptimizer):
  r"""AdamW on 16-bit (or wider) params with fp32 math; see ``adamw_bf16``.

  Per param ``p`` with gradient ``g`` (both upcast exactly to fp32), at 1-based
  step ``t`` and all hyperparameters fp32:

  .. code-block:: text

     x   = read(p, buffer)                  # fp32 view of the weight
     m   = b1 * mu + (1 - b1) * g
     v   = b2 * nu + (1 - b2) * (g * g)
     u   = -lr * ((m * ibc1) / (sqrt(v * ibc2) + eps) + wd * x)
                                            # ibc = f32(1 / (1 - b^t))
     x'  = x + u
     p, buffer = write(x')                  # per compensation
     mu, nu = round(m), round(v)            # nearest or stochastic

  Param groups carry torch's keys ``lr``, ``betas``, ``eps``,
  ``weight_decay``, ``maximize``, ``amsgrad`` and ``differentiable`` (so
  ``torch.optim.lr_scheduler``, ``OneCycleLR`` with momentum cycling
  included, works), ``lr_schedule`` (the
  group's schedule, or None) and a host-side ``count`` of steps; a group
  copied from a ``torch.optim.AdamW`` (with ``amsgrad``, ``foreach``,
  ``fused``, ``capturable``, ``differentiable``) is taken as the keywords
  are. State per param, made at its first step as in ``torch.optim``:
  ``step`` (CPU int64), ``mu``, ``nu`` (and ``nu_max`` with amsgrad), and
  ``master`` (fp32 copy, or the int16 low half with
  ``compensation="split"``) or ``compensation`` (Kahan
  buffer in the param dtype). ``learning_rate``/``lr`` defaults to 1e-3,
  as in ``torch.optim.AdamW`` (here and in the factories).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    >>> opt = tb.LowPrecisionAdamW([p], lr=1e-3, betas=(0.9, 0.95))
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()
    >>> opt.param_groups[0]["betas"], p.dtype
    ((0.9, 0.95), torch.bfloat16)

  References:
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019 (AdamW); Kahan, `Further
    remarks on reducing truncation errors <https://doi.org/10.1145/363707.363723>`_,
    CACM 1965 (the compensation buffer).
  """

  def __init__(self, params, learning_rate=None, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0, *,
               compensation: str = "kahan", mu_dtype: Optional[torch.dtype] = None,
               nu_dtype: Optional[torch.dtype] = None, state_rounding: str = "nearest",
               key=None, skip_nonfinite: bool = False, fused: Optional[bool] = None,
               lr=None, betas=None, maximize: bool = False, amsgrad: bool = False,
               foreach: Optional[bool] = None, capturable: bool = False,
               differentiable: bool = False, _factory: str = "LowPrecisionAdamW"):
    check_no_grad_hyperparams(_factory, dict(eps=eps, weight_decay=weight_decay))
    if learning_rate is None and lr is None:
      lr = 1e-3  # torch.optim.AdamW's default
    learning_rate, b1, b2 = torch_spellings(_factory, learning_rate, lr, b1, b2, betas,
                                            (0.9, 0.999))
    check_torch_adamw_args(learning_rate, b1, b2, eps, weight_decay, betas_given=betas is not None,
                           foreach=foreach, capturable=capturable, fused=fused,
                           differentiable=differentiable)
    check_torch_keys(_factory, dict(maximize=maximize, amsgrad=amsgrad, foreach=foreach,
                                    capturable=capturable, differentiable=differentiable))
    if compensation != "master":  # adam_fp32_master's, not an adamw_bf16 choice
      native_lib.check_compensation(compensation)
    checks.check_state_rounding(state_rounding)
    for name, d in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
      if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
        raise ValueError(f"{name} must be None or a torch float dtype; got {d!r}.")
    schedule: Optional[Callable] = learning_rate if callable(learning_rate) else None
    lr0 = float(learning_rate(0)) if schedule is not None else float(learning_rate)
    self._compensation = COMPENSATIONS[compensation]
    self._mu_dtype, self._nu_dtype = mu_dtype, nu_dtype
    self._state_rounding = state_rounding
    self._seed = seed_from_key(key)
    self._fused = None if fused is None else bool(fused)
    init_skip_nonfinite(self, skip_nonfinite)
    # The factory that built it, when that matters: the low-precision wrappers
    # accept scale_by_adamw (the bare core) but refuse adamw_bf16.
    self._factory = _factory
    defaults = dict(lr=lr0, lr_schedule=schedule, betas=(b1, b2), eps=eps,
                    weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad,
                    differentiable=differentiable, count=0)
    super().__init__(params, defaults)

  # -- construction ----------------------------------------------------------

  def _normalize_group(self, param_group: dict) -> dict:
    # torch.optim.AdamW's other group keys (a group copied from a torch
    # optimizer): checked as the keywords are, then dropped (_KEPT stay).
    # Called by torch.optim.Optimizer.__init__ after self.defaults is set.
    if isinstance(param_group, dict):
      check_torch_keys("param group", {k: v for k, v in param_group.items()
                                       if k in TORCH_ADAMW_KEYS},
                       param_group.get("weight_decay", self.defaults["weight_decay"]))
      param_group = {k: v for k, v in param_group.items()
                     if k not in TORCH_ADAMW_KEYS or k in _KEPT}
    return super()._normalize_group(param_group)

  def _check_group(self, group: dict, first: int) -> None:
    b1, b2 = group["betas"]
    checks.check_adamw_args(group["lr"], b1, b2, group["eps"], group["weight_decay"])
    for position, p in enumerate(group["params"], first):
      self._check_param(p, position)

  def _check_param(self, p: torch.Tensor, position: int) -> None:
    """A param the step can take: float, or complex, stepped as
    torch.optim.AdamW steps complex params: as pairs of reals (view_as_real)."""
    if not (isinstance(p, torch.Tensor) and p.is_complex()):
      check_param(p, position)
    elif p.dtype == torch.complex32:
      raise ValueError(
          f"param {position} is complex32, whose fp16 parts no compensation here steps. Cast "
          "it to complex64.")
    if _own_moments(p.dtype) and {self._mu_dtype, self._nu_dtype} - {None, torch.float32}:
      raise ValueError(
          f"param {position} is {p.dtype}, whose moments are {p.dtype}, not "
          f"mu_dtype={self._mu_dtype}, nu_dtype={self._nu_dtype}. Keep such params in an "
          "optimizer with fp32 (or default) moments.")

  def _init_group(self, group: dict) -> None:
    # A param's state is made at its first step (_state_of), as in torch.optim,
    # so a model.to(dtype) between construction and that step just works.
    self._remember(group["params"])

  @torch.no_grad()
  def _new_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
    """The state of ``p`` before its first step (for its dtype and shape now)."""
    layout = self._layout(p.dtype, amsgrad)
    state = {"step": torch.tensor(0, dtype=torch.int64),
             **{k: torch.zeros_like(p, dtype=layout[k]) for k in ("mu", "nu", "nu_max")
                if k in layout}}
    compensation = _param_compensation(self._compensation, p.dtype)
    buffer = None if compensation is None else compensation.init_buffer(p)
    if buffer is not None:
      state[compensation.buffer] = buffer
    return state

  def _layout(self, dtype: torch.dtype, amsgrad: bool = False) -> dict:
    """The dtype of each state tensor (``step`` aside) of a param of ``dtype``."""
    return _state_layout(self._compensation, self._mu_dtype, self._nu_dtype, dtype, amsgrad)

  def _state_of(self, p: torch.Tensor, position: int, amsgrad: bool) -> dict:
    """``p``'s state: made now if ``p`` has none yet, else checked against
    ``p``'s dtype and shape (a ``model.to(dtype)`` after the state was made
    would have the step read buffers of another dtype, or none)."""
    state = self.state[p]
    # Checked once per param while its dtype, shape and keys stay (a load
    # clears these marks); a step count set from outside is still taken up.
    fits = self.__dict__.setdefault("_state_fits", {})
    mark = (p.dtype, p.shape, len(state), amsgrad)
    if fits.get(p) == mark and type(state["step"]) is torch.Tensor:
      return state
    if not state:
      self._check_param(p, position)
      state.update(self._new_state(p, amsgrad))
      fits[p] = (p.dtype, p.shape, len(state), amsgrad)
      return state
    if amsgrad != ("nu_max" in state):  # the group's amsgrad switched: start or drop the max
      if amsgrad and torch.is_tensor(state.get("nu")):
        state["nu_max"] = torch.zeros_like(state["nu"])
      elif not amsgrad:
        del state["nu_max"]
    layout = self._layout(p.dtype, amsgrad)
    ok = len(state) == len(layout) + 1 and "step" in state
    for k, dtype in layout.items():
      t = state.get(k)
      ok = ok and torch.is_tensor(t) and t.dtype == dtype and t.shape == p.shape
    if not ok:
      raise ValueError(stale_state_message(p, position, state,
                                           lambda d: self._layout(d, amsgrad),
                                           shaped=tuple(layout)))
    step_count(state)
    self._state_fits[p] = (p.dtype, p.shape, len(state), amsgrad)
    return state

  # -- checkpoints -----------------------------------------------------------
  # The buffers (master, split low half, Kahan buffer or none) are checked by
  # their keys and dtypes; switching the rounding when resuming is allowed.

  def _extra_state(self) -> dict:
    return {**super()._extra_state(), "seed": self._seed}

  def _template(self, group: dict, p: torch.Tensor) -> Optional[dict]:
    # A param with no state yet is checked against the state its first step
    # makes; a wrapper's stand-in between steps (no elements) is not checked.
    return self._new_state(p, group["amsgrad"]) if p.numel() else None

  def _load(self, state_dict: dict) -> None:
    super()._load(state_dict)
    self.__dict__.pop("_state_fits", None)  # loaded state is checked at its next step
    self.__dict__.pop("_replay", None)
    self._seed = int(state_dict.get("seed", self._seed))

  # -- the step --------------------------------------------------------------

  def _scalars(self, group: dict, t: int, lr: float, device, cache: dict,
               dtype: torch.dtype = torch.float32):
    key = (t, device, dtype)
    if key in cache:
      return cache[key]
    if dtype == torch.float64:  # a float64 param's step: torch.optim.AdamW's double scalars
      b1, b2 = (float(b) for b in group["betas"])
      values = (lr, b1, b2, 1 - b1, 1 - b2, 1 / (1 - b1 ** t), 1 / (1 - b2 ** t),
                group["eps"], group["weight_decay"])
      cache[key] = tuple(rounding.device_scalar(float(v), dtype, device) for v in values)
    else:  # each fp32 value goes to the device by a fill (no sync)
      cache[key] = tuple(rounding.device_scalar(v, torch.float32, device)
                         for v in self._host_scalars(group, t, lr, cache))
    return cache[key]

  @staticmethod
  def _host_scalars(group: dict, t: int, lr: float, cache: dict) -> tuple:
    """The fp32 AdamW scalars of step ``t`` as floats (the native kernel's):
    numpy fp32 ops on the host, each rounded once, whatever torch's default dtype."""
    key = ("host", t)
    if key not in cache:
      one = np.float32(1)
      b1, b2 = (np.float32(b) for b in group["betas"])
      bc1 = np.float32(rounding.one_minus_pow(float(b1), t))
      bc2 = np.float32(rounding.one_minus_pow(float(b2), t))
      values = (np.float32(lr), b1, b2, one - b1, one - b2, one / bc1, one / bc2,
                np.float32(group["eps"]), np.float32(group["weight_decay"]))
      cache[key] = tuple(float(v) for v in values)
    return cache[key]

  @property
  def _step_supports_amp_scaling(self) -> bool:
    """GradScaler's contract with steps that unscale and skip on the device
    (as torch's fused AdamW): where every param takes the Triton step, the
    kernel reads ``optimizer.grad_scale`` and ``optimizer.found_inf`` and
    the gradients stay scaled (fp16 ones included); elsewhere GradScaler
    unscales them and reads ``found_inf`` on the host, as for any optimizer."""
    want = _triton_wanted(self)
    if want is False or self._fused is False or not _triton.available():
      return False
    if any(g["amsgrad"] or g["differentiable"] for g in self.param_groups):
      return False
    params = [p for g in self.param_groups for p in g["params"]]
    return bool(params) and all(
        (p.is_cuda or (want and p.is_cpu and _triton.interpreting()))
        and not p.is_complex() and getattr(p, "main_grad", None) is None
        and not _dist.is_dtensor(p) for p in params)

  def _amp_scaling(self) -> "_AmpScaling":
    """GradScaler's ``grad_scale`` and ``found_inf`` for this step, if it set them."""
    amp = _AmpScaling(self.__dict__.get("grad_scale"), self.__dict__.get("found_inf"))
    if amp.found_inf is not None and any(g.get("lr_schedule") is not None
                                         for g in self.param_groups):
      amp.read()  # a schedule's count advances only on a step taken: read on the host
    return amp

  def _step_all(self) -> None:
    amp = self._amp_scaling()
    if amp.skipped():  # found_inf, read on the host: nothing changes
      return
    # The last step's Triton launches again, while nothing they hang on changed.
    replay = self.__dict__.pop("_replay", None)
    if replay is not None and replay.step(self, amp):
      self._replay = replay
      return
    # Every state made or checked first: a param whose dtype changed since
    # its state was made is an error before anything is stepped.
    position = 0
    for group in self.param_groups:
      for p in group["params"]:
        if grad_of(p) is not None:
          self._state_of(p, position, group["amsgrad"])
        position += 1
    # CPU tensors go to the native kernel, one call per configuration, after the loop.
    native = _native.Batch(self._seed, self._state_rounding) if self._fused is not False else None
    # Off the CPU, the default step groups tensors (_Grouped); fused=True
    # compiles each, fused=False steps each eagerly.
    grouped = (_Grouped(self._seed, self._state_rounding,
                        self.__dict__.setdefault("_grouped_cache", collections.OrderedDict()))
               if self._fused is None else None)
    # The Triton multi-tensor step takes the tensors it can first
    # (_triton.supports): by default CUDA tensors; opted in
    # (OPTAX_HALF_TRITON=1 or opt._triton = True) also CPU tensors under
    # Triton's interpreter; off with fused=False, OPTAX_HALF_TRITON=0 or opt._triton = False.
    want_triton = _triton_wanted(self)
    triton = (_triton.Batch(self._seed, self._state_rounding, cuda_only=want_triton is None,
                            grad_scale=amp.grad_scale, found_inf=amp.found_inf)
              if want_triton is not False and self._fused is not False and _triton.available()
              else None)
    stepped: list = []
    # As the eager step would have: what was taken is stepped, even if a
    # later check fails; each of these runs even if one before it raises.
    with contextlib.ExitStack() as after:
      after.callback(self._remember, stepped)
      for batch in (grouped, native, triton):  # run last in, first out: triton first
        if batch is not None:
          after.callback(batch.run)
      self._step_each(native, grouped, stepped, triton, amp)
    if triton is not None and triton.count:
      self._replay = _Replay.of(self, triton)
    elif native is not None:
      self._replay = _NativeReplay.of(self, native, amp)

  def _step_each(self, native, grouped, stepped: list, triton=None,
                 amp: Optional["_AmpScaling"] = None) -> None:
    position = 0
    for group_index, group in enumerate(self.param_groups):
      count = group["count"]
      lr = self._group_lr(group, count)
      hyper = (lr, *group["betas"], group["eps"], group["weight_decay"])
      maximize = group["maximize"]
      amsgrad = group["amsgrad"]
      differentiable = group["differentiable"]
      cache: dict = {}
      for p in group["params"]:
        leaf = position
        position += 1
        if grad_of(p) is None:
          continue
        check_grad(grad_of(p), leaf)
        for batch in (grouped, native, triton):  # a param listed twice: its first step first
          if batch is not None:
            batch.before(p)
        grad = step_grad(self, p)
        state = self.state[p]
        compensation = _param_compensation(self._compensation, p.dtype)
        buffer = None if compensation is None else state.get(compensation.buffer)
        # Written from outside since the last step: re-seed the buffer (a
        # master's read does that for every element itself).
        if compensation is not None and compensation.follows and not compensation.read_follows:
          self._follow(p, compensation, buffer)
          stepped.append(p)
        tensors = (p, grad, state["mu"], state["nu"], buffer)
        index = 0
        if _dist.is_dtensor(p):
          # Sharded params (FSDP2's DTensors) step their local shards; the
          # random-bit counter is the elements' index in the whole tensor.
          tensors = tuple(_dist.local(t) for t in tensors)
          index = _dist.index(p)
        if p.is_complex():  # as torch.optim.AdamW: each real and imaginary part a param
          tensors = tuple(None if t is None else torch.view_as_real(t) for t in tensors)
        math_dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
        if differentiable and compensation is not None:
          raise ValueError(
              f"param {leaf} is {p.dtype}: differentiable=True steps params of 32 bits or more "
              "(a rounding to 16 bits has no gradient). Pass float32 params, or "
              "differentiable=False.")
        nu_max = _dist.local(state["nu_max"]) if amsgrad else None
        if nu_max is not None and nu_max.is_complex():
          nu_max = torch.view_as_real(nu_max)
        # AMSGrad's running max and a differentiable step: the per-tensor step (eager,
        # recorded by autograd where differentiable; else compiled with fused=True)
        per_tensor = amsgrad or differentiable
        if not per_tensor and triton is not None and triton.add(
            tensors, _kernel_mode(compensation), leaf, hyper, group_index, state, index,
            maximize):
          continue
        if amp is not None and amp.given:  # GradScaler's scale, off the Triton step
          if amp.skipped(read=True):
            continue
          tensors = (tensors[0], amp.unscale(tensors[1]), *tensors[2:])
        step = int(state["step"])
        if not per_tensor and native is not None and native.add(
            tensors, _kernel_mode(compensation), state["step"], leaf,
            lambda: self._host_scalars(group, step + 1, lr, cache), index,
            maximize):
          continue
        device = tensors[0].device
        scalars = self._scalars(group, step + 1, lr, device, cache, math_dtype)
        if not per_tensor and grouped is not None and grouped.add(
            tensors, compensation, step, leaf, scalars, state, index, maximize):
          continue
        keys = _leaf_keys(self._seed, step, leaf, device)
        if self._fused and all(t is None or t.is_contiguous() for t in tensors):
          # Flat views: the element index (the random-bit counter) is the
          # row-major index either way.
          tensors = tuple(None if t is None else t.view(-1) for t in tensors)
          index = index.reshape(-1) if torch.is_tensor(index) else index
          nu_max = None if nu_max is None else nu_max.view(-1)
        kernel = adamw_step
        if self._fused and not differentiable:
          kernel = _compiled_step((_kernel_mode(compensation), self._state_rounding, p.dtype,
                                   grad.dtype, state["mu"].dtype, state["nu"].dtype, maximize,
                                   nu_max is not None))
        with torch.enable_grad() if differentiable else contextlib.nullcontext():
          kernel(*tensors, scalars, keys, compensation, self._state_rounding, index, maximize,
                 nu_max)
        state["step"] += 1
      group["count"] = count + 1


def _triton_wanted(opt) -> Optional[bool]:
  """True: the Triton step opted in; False: off; None: the default (CUDA tensors)."""
  want = opt.__dict__.get("_triton")
  if want is None:
    env = os.environ.get("OPTAX_HALF_TRITON", "")
    want = {"1": True, "0": False}.get(env)
  return want


class _Replay:
  """The Triton plans of a step, run again at the next steps while nothing
  they point at changed: the same params (identity, storage, and no write
  from outside: their version counters, which the kernel's writes leave), each
  gradient (``main_grad`` or ``grad``) at the same address with the same
  dtype, the groups' switches, the optimizer's ``fused`` and ``_triton``. The
  check is a few list comprehensions over the params (no Python call per
  tensor, no torch op); a step then reads each group's hyperparameters and
  launches (docs/algorithms.md#triton-multi-tensor-step). Anything else
  takes the full step, which makes the plans again."""

  def __init__(self, plans: list, key: tuple):
    self.plans = plans
    self.key = key

  @classmethod
  def of(cls, opt, batch) -> Optional["_Replay"]:
    """The replay of ``batch``'s plans, if they stepped every param of ``opt``."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if (batch.count != len(params) or len(set(map(id, params))) != len(params)
        or any(p.is_complex() or _dist.is_dtensor(p) for p in params)):
      return None
    key = cls._key(opt)
    return None if key is None else cls(batch.plans, key)

  @staticmethod
  def _key(opt) -> Optional[tuple]:
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = grads_of(params)
    try:
      grad_ptrs = [g.data_ptr() for g in grads]
    except AttributeError:  # a param without a gradient
      return None
    return (*_params_key(opt, params), grad_ptrs, [g.dtype for g in grads])

  def step(self, opt, amp: "_AmpScaling") -> bool:
    """One step by the plans; False (nothing done) where they no longer fit."""
    if opt._unscaled_grads or self._key(opt) != self.key:
      return False
    hyper = []
    for group in opt.param_groups:
      count = group["count"]
      hyper.append((opt._group_lr(group, count), *group["betas"], group["eps"],
                    group["weight_decay"]))
      group["count"] = count + 1
    for plan, group in self.plans:
      plan.run(*hyper[group], opt._seed, found_inf=amp.found_inf, grad_scale=amp.grad_scale)
    return True


def _params_key(opt, params) -> tuple:
  """What a replay's plans hang on besides the gradients: each group's params
  (identity and order), their storage, dtype, shape and version counters (a
  write from outside; ``.data =`` keeps the counter, not the rest), the
  groups' switches, the optimizer's ``fused`` and ``_triton``; the versions last."""
  return ([list(map(id, g["params"])) for g in opt.param_groups],
          [p.data_ptr() for p in params], [p.dtype for p in params], [p.shape for p in params],
          [(g["maximize"], g["amsgrad"], g["differentiable"]) for g in opt.param_groups],
          opt._fused, _triton_wanted(opt), [p._version for p in params])


class _NativeReplay:
  """The native kernel's tables of a CPU step that took every param
  (``_native.Batch``), run again at the next steps while the params and their
  state are those the tables point at: as ``_Replay``, checked in list
  comprehensions, and the versions the step's writes leave are the next
  check's. Each step reads the gradients anew (address, dtype, shape, a dense
  CPU tensor), the step counts, each group's hyperparameters, and fills the
  tables' gradient, scalar and key columns; then one kernel call per
  configuration, as ``Batch.run`` (docs/algorithms.md#the-torch-entry).
  Anything else takes the full step."""

  def __init__(self, opt, ran: list, params: list, rows: list):
    self.calls, start = [], 0
    for fn, table, rs in ran:
      self.calls.append((fn, table, start, start + len(rs)))
      start += len(rs)
    self.params = [r[0][0] for r in rows]
    self.dicts = [opt.state[p] for p in self.params]
    self.state_dicts = list(opt.state.values())
    comps = [_param_compensation(opt._compensation, p.dtype) for p in self.params]
    self.buffers = [None if c is None else c.buffer for c in comps]
    self.step_tensors = [r[1] for r in rows]
    self.leaves = np.array([r[2] for r in rows], np.int64)
    group_of = {id(p): k for k, g in enumerate(opt.param_groups) for p in g["params"]}
    at = np.array([group_of[id(p)] for p in self.params])
    self.group_rows = [np.flatnonzero(at == k) for k in range(len(opt.param_groups))]
    self.written = [t for r in rows for k, t in enumerate(r[0]) if t is not None and k != 1]
    # Those whose buffer follows outside writes: remembered after each step (_step_each).
    self.follows = [p for p, c in zip(self.params, comps)
                    if c is not None and c.follows and not c.read_follows]
    self.grad_dtypes = [g.dtype for g in grads_of(self.params)]
    self.shapes = [p.shape for p in self.params]
    self.key = _params_key(opt, params)
    self.state = self._state_now()  # as the steps leave it: they write through the addresses

  @classmethod
  def of(cls, opt, batch, amp) -> Optional["_NativeReplay"]:
    """The replay of ``batch``'s calls, if they stepped every param of ``opt``
    (plain tensors, each once) on the gradient it holds and the state it has."""
    params = [p for g in opt.param_groups for p in g["params"]]
    rows = [r for _, _, rs in batch.ran for r in rs]
    if (amp.given or opt._unscaled_grads or len(rows) != len(params)
        or len(set(map(id, params))) != len(params)  # a param listed twice steps twice
        or {id(r[0][0]) for r in rows} != set(map(id, params))
        or any(type(p) not in _native._PLAIN or p.is_complex() for p in params)):
      return None
    for (p, grad, mu, nu, buffer), step, _, _, index, _ in rows:
      state = opt.state[p]
      compensation = _param_compensation(opt._compensation, p.dtype)
      if (index != 0 or grad is not grad_of(p) or state["mu"] is not mu
          or state["nu"] is not nu or state["step"] is not step
          or (compensation is not None and state.get(compensation.buffer) is not buffer)):
        return None
    return cls(opt, batch.ran, params, rows)

  def _state_now(self) -> Optional[tuple]:
    """The state the tables point at, as it is now: each dict's size, and each
    moment's, buffer's and step count's identity, address, dtype and shape
    (``.data =`` and ``set_`` keep a tensor and change the rest). None: a key is gone."""
    dicts = self.dicts
    try:
      flat = ([s["mu"] for s in dicts] + [s["nu"] for s in dicts] + [s["step"] for s in dicts]
              + [s[n] for s, n in zip(dicts, self.buffers) if n is not None])
      return ([len(s) for s in dicts], [id(t) for t in flat], [t.data_ptr() for t in flat],
              [t.dtype for t in flat], [t.shape for t in flat])
    except (KeyError, AttributeError):
      return None

  def step(self, opt, amp: "_AmpScaling") -> bool:
    """One step by the tables; False (nothing done) where they no longer fit."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if amp.given or opt._unscaled_grads or _params_key(opt, params) != self.key:
      return False
    # The same state dicts (compared in order: no lookup by param), holding the same tensors.
    if (len(opt.state) != len(self.state_dicts)
        or not all([a is b for a, b in zip(opt.state.values(), self.state_dicts)])
        or self._state_now() != self.state):
      return False
    grads = grads_of(self.params)
    if (any([g is None for g in grads]) or [g.dtype for g in grads] != self.grad_dtypes
        or [g.shape for g in grads] != self.shapes
        or not all([type(g) in _native._PLAIN for g in grads]) or not _native.dense_cpu(grads)):
      return False
    # Read, as the full step reads them: a write through .data leaves no version behind.
    steps = np.array([int(t) for t in self.step_tensors], np.int64)
    if steps.size and steps.min() < 0:
      return False
    scalars = np.empty((len(self.params), _native._GRAD_SCALE), np.float32)
    for group, rows in zip(opt.param_groups, self.group_rows):
      count = group["count"]
      lr = opt._group_lr(group, count)
      cache: dict = {}
      group_steps = steps[rows]
      for step in np.unique(group_steps):  # most groups: one step count
        scalars[rows[group_steps == step]] = opt._host_scalars(group, int(step) + 1, lr, cache)
      group["count"] = count + 1
    keys = native_lib.leaf_keys(opt._seed, steps, self.leaves)
    pointers = np.array([g.data_ptr() for g in grads], np.uint64)
    threads = torch.get_num_threads()
    for fn, table, lo, hi in self.calls:
      table["g"] = pointers[lo:hi]
      table["scalars"][:, :_native._GRAD_SCALE] = scalars[lo:hi]
      table["keys"] = keys[lo:hi]
      fn(table.ctypes.data, hi - lo, threads)
    torch.autograd.graph.increment_version(self.written)  # as Batch.run
    torch._foreach_add_(self.step_tensors, 1)
    opt._remember_plain(self.follows)
    self.key = (*self.key[:-1], [p._version for p in params])  # the versions its writes left
    return True


class _AmpScaling:
  """GradScaler's ``grad_scale`` (None: the gradients are unscaled already)
  and ``found_inf`` of one step, which the Triton step reads on the device.
  Any other step reads ``found_inf`` on the host (once) and unscales its
  gradient: ``widen(g) * inv_scale``, ``inv_scale = f32(1 / scale)`` as
  GradScaler.unscale_ makes it. A skipped step's params, moments and step
  counts stay; the groups' ``count`` advances unless the skip was read on the
  host (where a group's lr schedule needs it)."""

  def __init__(self, grad_scale, found_inf):
    for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
      if value is not None and not (torch.is_tensor(value) and value.numel() == 1):
        if name == "found_inf" and isinstance(value, (int, float)):
          continue  # GradScaler's sum over no gradients: 0
        raise TypeError(f"optimizer.{name} must be a one-element tensor (GradScaler "
                        f"sets it); got {value!r}.")
    if grad_scale is not None and grad_scale.dtype != torch.float32:
      raise TypeError(f"optimizer.grad_scale must be float32, as GradScaler's scale; got "
                      f"{grad_scale.dtype}.")
    self.grad_scale = grad_scale
    self.found_inf = found_inf
    self.given = grad_scale is not None or found_inf is not None
    self._skip: Optional[bool] = None
    self._inv: dict = {}
    if found_inf is not None and not torch.is_tensor(found_inf):
      self.read()

  def read(self) -> None:
    """Reads ``found_inf`` on the host (a sync)."""
    self._skip = bool(self.found_inf)
    self.found_inf = None

  def skipped(self, read: bool = False) -> bool:
    """Whether the step is skipped, as read on the host (``read``: read it now)."""
    if read and self.found_inf is not None:
      self.read()
    return bool(self._skip)

  def unscale(self, g: torch.Tensor) -> torch.Tensor:
    if self.grad_scale is None:
      return g
    inv = self._inv.get(g.device)
    if inv is None:
      inv = self._inv[g.device] = self.grad_scale.double().reciprocal().float().reshape(
          ()).to(g.device)
    return rounding.widen(g) * inv


def scale_by_adamw(
    params,
    learning_rate=None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: Optional[float] = None,
    mu_dtype=None,
    nu_dtype=None,
    state_rounding: str = "nearest",
    key=None,
    *,
    fused: Optional[bool] = None,
    lr=None,
    betas=None,
    maximize: bool = False,
    amsgrad: bool = False,
    foreach: Optional[bool] = None,
    capturable: bool = False,
    differentiable: bool = False,
) -> LowPrecisionAdamW:
  """The AdamW core applied directly: ``p = round_nearest(p + u)``.

  ``optax.apply_updates(params, optax_half.scale_by_adamw(...))`` as a torch
  optimizer: fp32 math, moments in ``mu_dtype``/``nu_dtype`` (default: the
  param dtype; fp32 for fp16 params) written by ``state_rounding``; no compensation of the params.
  This is the optimizer to wrap (``kahan_summation(scale_by_adamw(...))``);
  ``lr=`` and ``betas=`` are torch's spellings of ``learning_rate``, ``b1``, ``b2``,
  and torch.optim.AdamW's other keywords are taken as in ``adam_fp32_master``.

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(4))
    >>> opt = tb.scale_by_adamw([p], lr=0.1)
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()
    >>> round(p[0].item(), 4)
    0.9

  References:
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
  """
  return LowPrecisionAdamW(params, learning_rate, b1, b2, eps,
                           0.0 if weight_decay is None else weight_decay,
                           compensation="none", mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                           state_rounding=state_rounding, key=key, fused=fused, lr=lr,
                           betas=betas, maximize=maximize, amsgrad=amsgrad, foreach=foreach,
                           capturable=capturable, differentiable=differentiable,
                           _factory="scale_by_adamw")


def adam_fp32_master(
    params,
    learning_rate=None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    skip_nonfinite: bool = False,
    *,
    fused: Optional[bool] = None,
    lr=None,
    betas=None,
    maximize: bool = False,
    amsgrad: bool = False,
    foreach: Optional[bool] = None,
    capturable: bool = False,
    differentiable: bool = False,
) -> LowPrecisionAdamW:
  """Adam(W) on an fp32 master copy of 16-bit params, fp32 moments.

  16 bytes/param for 16-bit params (master 4, mu 4, nu 4, param 2, grad 2);
  the master follows fp32 AdamW exactly and the param is its nearest rounding.
  fp32 params are updated in place with no copy. Weights loaded into the
  model after the optimizer was built (``model.load_state_dict``,
  ``p.copy_``) are taken up by the master at the next step: where a param no
  longer equals its master's rounding, the master is re-seeded from it.

  Args:
    params: an iterable of tensors or of param-group dicts.
    learning_rate: a float or a schedule ``count -> lr`` (torch's ``lr=`` also works);
      1e-3 if neither is given, as ``torch.optim.AdamW``.
    b1, b2, eps: Adam coefficients (torch's ``betas=(b1, b2)`` also works).
    weight_decay: decoupled weight decay, multiplied by the lr.
    skip_nonfinite: skip (and count in ``optimizer.nonfinite``) every step whose
      gradients hold a NaN or Inf; reads one bool on the host per step, like
      ``torch.amp.GradScaler``. Without it a non-finite gradient element
      poisons its own param and moments (docs/algorithms.md#non-finite-gradients).
    fused: how the step runs (torch only). None: CPU tensors the native
      kernel takes (``optax_half_native``, one call for all of them) there;
      tensors on other devices (CUDA) in the eager step of all of a
      configuration at once (concatenated up to 2^23 elements: about 70
      ops for them all, each tensor's bits; docs/algorithms.md#pytorch-mirror);
      the rest (tensors of 2^23 elements or more, non-contiguous tensors,
      DTensor shards at a non-zero offset, fp16 params where the CPU has no
      F16C) in the eager per-tensor step. True: the same kernel, and the per-tensor step
      compiled by ``torch.compile`` for the others. False: the eager
      per-tensor step everywhere (the reference). The eager steps have the
      same bits on any device; on CPU all three do (on CUDA see
      docs/algorithms.md#on-gpu).
    lr, betas: torch's spellings of ``learning_rate`` and ``(b1, b2)``.
    maximize, amsgrad, foreach, capturable, differentiable: torch.optim.AdamW's
      (also as param-group keys). ``maximize=True`` ascends (the gradient is
      negated as it is read); ``amsgrad=True`` keeps the running max of nu
      (state ``nu_max``) for the denominator; ``differentiable=True`` lets
      autograd record the step (params of 32 bits or more); ``foreach`` is
      accepted and not used; ``capturable`` must be False.

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.adam_fp32_master([p], lr=1e-4)
    >>> for _ in range(10):
    ...   p.grad = torch.ones_like(p)
    ...   opt.step()
    >>> p[0].item(), round(opt.state[p]["master"][0].item(), 6)
    (1.0, 0.999)

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
    ICLR 2018; NVIDIA NeMo's ``MainParamsOptimizerWrapper``.
  """
  return LowPrecisionAdamW(params, learning_rate, b1, b2, eps, weight_decay,
                           compensation="master", mu_dtype=torch.float32,
                           nu_dtype=torch.float32, state_rounding="nearest",
                           skip_nonfinite=skip_nonfinite, fused=fused, lr=lr, betas=betas,
                           maximize=maximize, amsgrad=amsgrad, foreach=foreach,
                           capturable=capturable, differentiable=differentiable,
                           _factory="adam_fp32_master")


def adamw_bf16(
    params,
    learning_rate=None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    compensation: str = "kahan",
    mu_dtype=None,
    nu_dtype=None,
    state_rounding: str = "stochastic",
    key=None,
    skip_nonfinite: bool = False,
    *,
    fused: Optional[bool] = None,
    lr=None,
    betas=None,
    maximize: bool = False,
    amsgrad: bool = False,
    foreach: Optional[bool] = None,
    capturable: bool = False,
    differentiable: bool = False,
) -> LowPrecisionAdamW:
  """AdamW for params that stay in bf16 (or fp16), without stale weights.

  The torch twin of ``optax_half.adamw_bf16``: same keywords, defaults and
  numbers, and torch's ``lr=``/``betas=`` besides, so it replaces
  ``torch.optim.AdamW(params, lr=..., betas=..., weight_decay=...)`` as is.
  ``compensation``: "kahan" (a buffer in the param dtype, 10 bytes/param in
  bf16 with bf16 moments), "split" (the exact fp32 master as param + int16
  low half), "stochastic" (no buffer), or "none" (nearest). Moments default
  to the param dtype (fp32 for fp16 params), written with stochastic rounding.

  Args:
    params: an iterable of tensors or of param-group dicts.
    learning_rate: a float or a schedule ``count -> lr`` (torch's ``lr=`` also works);
      1e-3 if neither is given, as ``torch.optim.AdamW``.
    b1, b2, eps: Adam coefficients (torch's ``betas=(b1, b2)`` also works).
    weight_decay: decoupled weight decay, multiplied by the lr.
    compensation: one of "kahan", "split", "stochastic", "none".
    mu_dtype, nu_dtype: moment dtypes; ``None`` means the param dtype, fp32 for fp16
      params (fp16's range underflows ``(1 - b2) g^2``).
    state_rounding: "stochastic" or "nearest", for 16-bit moment writes.
    key: ``None`` (seed 0) or an integer seed; the same seed as an integer key
      in ``optax_half`` gives the same random bits.
    skip_nonfinite: skip (and count) every step whose gradients hold a NaN or
      Inf, as in ``adam_fp32_master``.
    fused: how the step runs (torch only), as in ``adam_fp32_master``.
    lr, betas: torch's spellings of ``learning_rate`` and ``(b1, b2)``.
    maximize, amsgrad, foreach, capturable, differentiable: torch.optim.AdamW's,
      as in ``adam_fp32_master``.

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.adamw_bf16([p], lr=1e-4, weight_decay=0.0)
    >>> for _ in range(100):
    ...   p.grad = torch.full_like(p, 0.5)
    ...   opt.step()
    >>> p[0].item()  # plain bf16 AdamW stays at 1.0: each step is below half a ULP
    0.98828125

  References:
    Kahan, `Further remarks on reducing truncation errors
    <https://doi.org/10.1145/363707.363723>`_, CACM 1965; Loshchilov & Hutter,
    `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_,
    ICLR 2019; Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020; Gupta et al., `Deep Learning with
    Limited Numerical Precision <https://arxiv.org/abs/1502.02551>`_, ICML 2015;
    arogozhnikov/adamw_bfloat16.
  """
  native_lib.check_compensation(compensation)
  return LowPrecisionAdamW(params, learning_rate, b1, b2, eps, weight_decay,
                           compensation=compensation, mu_dtype=mu_dtype,
                           nu_dtype=nu_dtype, state_rounding=state_rounding, key=key,
                           skip_nonfinite=skip_nonfinite, fused=fused, lr=lr, betas=betas,
                           maximize=maximize, amsgrad=amsgrad, foreach=foreach,
                           capturable=capturable, differentiable=differentiable,
                           _factory="adamw_bf16")
