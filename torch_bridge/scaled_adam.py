"""ScaledAdam (icefall, seed 002): ``optax_half/scaled_adam.py`` in torch.

The same algorithm, names, defaults and order of operations as
``optax_half.scaled_adam`` (spec: ``docs/algorithms.md#scaledadam-and-eden``), as a
``torch.optim.Optimizer``. Params may be given as ``parameters()``, param
groups, or ``named_parameters()`` (the names label the dominant parameter in
the statistics; without them a param is named by its position in its group).

Per param group, as in the seed: one clipping norm over the group's params,
and a group step counter; per param: ``delta``, ``exp_avg_sq`` and, for
params with more than one element, ``param_rms``, ``scale_exp_avg_sq`` and
``scale_grads``, all in the param dtype, created at the param's first step.
The math is fp32; every hyperparameter enters as an fp32 value and ``1 - b **
n`` comes from ``rounding.one_minus_pow``, as in JAX. Nothing reads a device
value back to the host unless logging is on.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from torch_bridge import _dist, rounding
from torch_bridge._optim import (LowPrecisionOptimizer, check_grad, check_no_float64, check_param,
                                 f32, grad_of, init_skip_nonfinite, load_nonfinite, prepare_load,
                                 step_grad, torch_spellings)

__all__ = ["scaled_adam", "scaled_adam_stats", "ScaledAdam"]

logger = logging.getLogger(__name__)

QUARTILES = 5


_STATIC = (". (Only learning_rate may be a schedule; the other hyperparameters are "
           "Python numbers.)")


def check_scaled_adam_args(learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps,
                           param_min_rms, param_max_rms, scalar_max, size_update_period,
                           clipping_update_period) -> None:
  """The checks of ``optax_half.scaled_adam.check_scaled_adam_args``, same messages."""
  def concrete(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)
  if concrete(learning_rate) and learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0; got {learning_rate}.")
  if clipping_scale is not None and not (concrete(clipping_scale) and clipping_scale > 0):
    raise ValueError(f"clipping_scale must be None (no clipping) or > 0; got {clipping_scale!r}"
                     + _STATIC)
  for name, v in (("b1", b1), ("b2", b2)):
    if not (concrete(v) and 0.0 <= v < 1.0):
      raise ValueError(f"{name} must be a Python number in [0, 1); got {v!r}" + _STATIC)
  for name, v in (("scalar_lr_scale", scalar_lr_scale), ("eps", eps),
                  ("param_min_rms", param_min_rms), ("param_max_rms", param_max_rms),
                  ("scalar_max", scalar_max)):
    if not (concrete(v) and v > 0):
      raise ValueError(f"{name} must be a Python number > 0; got {v!r}" + _STATIC)
  if param_min_rms > param_max_rms:
    raise ValueError(
        f"param_min_rms ({param_min_rms}) must be <= param_max_rms ({param_max_rms}).")
  for name, v in (("size_update_period", size_update_period),
                  ("clipping_update_period", clipping_update_period)):
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 2**31:
      raise ValueError(f"{name} must be an integer >= 1; got {v!r}" + _STATIC)


def quartile_indices(period: int) -> list[int]:
  """Indices into the sorted norms that the seed reports: ``min(P-1, (P//4) n)``."""
  return [min(period - 1, (period // 4) * n) for n in range(QUARTILES)]


def _is_scalar(p: torch.Tensor) -> bool:
  return p.numel() <= 1


class ScaledAdam(LowPrecisionOptimizer):
  r"""ScaledAdam; see ``scaled_adam`` and ``optax_half.scaled_adam`` for the math.

  Param groups carry torch's keys ``lr`` and ``betas`` (as icefall's
  ScaledAdam; ``torch.optim.lr_scheduler`` works), ``lr_schedule`` (a
  callable ``learning_rate`` is evaluated at the group's step instead) and
  every other hyperparameter of the factory. ``group_state[i]`` holds group
  ``i``'s step and clipping statistics; ``state_dict()`` saves it.

  Example:
    >>> import torch, torch_bridge as tb
    >>> w = torch.nn.Parameter(torch.ones(4, 4))
    >>> opt = tb.ScaledAdam([w], lr=0.03, betas=(0.9, 0.98))
    >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> w.grad = torch.ones_like(w)
    >>> opt.step()
    >>> scheduler.step()  # torch's schedulers edit the group's lr
    >>> opt.param_groups[0]["lr"], opt.group_state[0]["step"]
    (0.015, 1)

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024 (ScaledAdam);
    `k2-fsa/icefall <https://github.com/k2-fsa/icefall>`_'s ``ScaledAdam``
    (``optim.py``).
  """

  def __init__(self, params, learning_rate=3e-2, clipping_scale=None, b1: float = 0.9,
               b2: float = 0.98, scalar_lr_scale: float = 0.1, eps: float = 1e-8,
               param_min_rms: float = 1e-5, param_max_rms: float = 3.0,
               scalar_max: float = 10.0, size_update_period: int = 4,
               clipping_update_period: int = 100, show_dominant_parameters: bool = False,
               skip_nonfinite: bool = False, *, lr=None, betas=None):
    if lr is not None and learning_rate == 3e-2:  # the default, not a second spelling
      learning_rate = None
    learning_rate, b1, b2 = torch_spellings("scaled_adam", learning_rate, lr, b1, b2, betas,
                                            (0.9, 0.98))
    check_scaled_adam_args(learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps,
                           param_min_rms, param_max_rms, scalar_max, size_update_period,
                           clipping_update_period)
    schedule: Optional[Callable] = learning_rate if callable(learning_rate) else None
    lr0 = float(learning_rate(0)) if schedule is not None else float(learning_rate)
    self.show_dominant_parameters = bool(show_dominant_parameters)
    init_skip_nonfinite(self, skip_nonfinite)
    self.group_state: list = []
    defaults = dict(lr=lr0, lr_schedule=schedule, clipping_scale=clipping_scale, betas=(b1, b2),
                    scalar_lr_scale=scalar_lr_scale, eps=eps, param_min_rms=param_min_rms,
                    param_max_rms=param_max_rms, scalar_max=scalar_max,
                    size_update_period=size_update_period,
                    clipping_update_period=clipping_update_period)
    super().__init__(params, defaults)

  # One clipping norm over all params of a group: the low-precision wrappers
  # must step this optimizer with every param at once, not in chunks.
  steps_all_params_together = True

  def _check_group(self, group: dict, first: int) -> None:
    b1, b2 = group["betas"]
    check_scaled_adam_args(group["lr"], group["clipping_scale"], b1, b2,
                           group["scalar_lr_scale"], group["eps"], group["param_min_rms"],
                           group["param_max_rms"], group["scalar_max"],
                           group["size_update_period"], group["clipping_update_period"])
    for position, p in enumerate(group["params"], first):
      check_param(p, position)
      check_no_float64(p, position, "scaled_adam")

  def _init_group(self, group: dict) -> None:
    self.group_state.append({"step": 0})

  @torch.no_grad()
  def _new_state(self, group: dict, p: torch.Tensor, rms=None) -> dict:
    """The state of ``p`` before its first step, with ``rms`` its RMS (a 0-dim
    fp32 tensor, ``_mean_squares``); without it, what a loaded state must look like."""
    state = {}
    state["step"] = torch.tensor(0, dtype=torch.int64)
    state["delta"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    # Second moments of fp16 params are fp32, as in optax_half (g^2 underflows fp16).
    sq_dtype = torch.float32 if p.dtype == torch.float16 else p.dtype
    state["exp_avg_sq"] = torch.zeros_like(p, dtype=sq_dtype, memory_format=torch.preserve_format)
    if not _is_scalar(p):
      device = _dist.local(p).device
      state["param_rms"] = (torch.zeros((), device=device) if rms is None else rms).to(p.dtype)
      state["scale_exp_avg_sq"] = torch.zeros((), dtype=sq_dtype, device=device)
      state["scale_grads"] = torch.zeros(group["size_update_period"], dtype=p.dtype,
                                         device=device)
    return state

  @staticmethod
  def _reduce(values: list, params: list, means: list) -> list:
    """Per param reductions of the step, whole-tensor values from all shards.

    ``values[k]``: a 0-dim fp32 tensor reduced over ``params[k]`` (the local
    shard's, for a DTensor: a sum); ``means[k]``: whether it is a mean, which
    a sharded param gets as the sum over all shards divided by its size. One
    collective for all of them under FSDP2; plain params keep their values.
    """
    if not any(_dist.is_dtensor(p) for p in params):
      return values
    out = _dist.sum_over_shards(torch.stack(values), params)
    return [v / p.numel() if mean and _dist.is_dtensor(p) else v
            for v, p, mean in zip(out.unbind(), params, means)]

  def _mean_squares(self, params: list) -> list:
    """``mean(p * p)`` in fp32 for each param, from all its shards."""
    values = []
    for p in params:  # one fp32 copy at a time
      p32 = rounding.widen(_dist.local(p))
      values.append(_local_mean(p32 * p32, p))
    return self._reduce(values, params, [True] * len(params))

  @staticmethod
  def _init_clipping(period: int, device) -> dict:
    z = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=device)
    return {"model_norms": z(period), "model_norm_threshold": z(),
            "num_clipped": z(dtype=torch.int32), "quartiles": z(QUARTILES),
            "percent_clipped": z(), "clipping_factor": torch.ones((), device=device),
            "grad_norm": z(), "dominant_index": z(dtype=torch.int32), "dominant_share": z()}

  # -- checkpoints -----------------------------------------------------------

  def _extra_state(self) -> dict:
    # A dict per group, so that later steps do not rewrite a saved state_dict's
    # counters (tensors are shared, as torch's own state_dict shares them).
    return {**super()._extra_state(), "group_state": [dict(g) for g in self.group_state]}

  def _load(self, state_dict: dict) -> None:
    saved = state_dict.get("group_state")
    if saved is None or len(saved) != len(self.param_groups):
      raise ValueError("state_dict is not from a ScaledAdam with the same param groups "
                       "(its 'group_state' is missing or has another length).")
    # A fresh optimizer has no state yet: check against the state it would
    # make, except for an empty tensor (a wrapper's stand-in between steps,
    # whose shape is known only during a step).
    def template(group, p):
      return self._new_state(group, p) if p.numel() else None  # shapes and dtypes only
    prepare_load(self, state_dict, template=template)()
    def device(i):
      params = self.param_groups[i]["params"]
      return params[0].device if params else None
    self.group_state = [
        {k: (v.to(device(i) or v.device, copy=True) if torch.is_tensor(v) else v)
         for k, v in g.items()} for i, g in enumerate(saved)]
    if hasattr(self, "nonfinite"):
      load_nonfinite(self, state_dict)

  # -- the step --------------------------------------------------------------

  def _step_all(self) -> None:
    position = 0
    for group, gstate in zip(self.param_groups, self.group_state):
      self._step_group(group, gstate, position)
      position += len(group["params"])

  def _step_group(self, group: dict, gstate: dict, position: int) -> None:
    t = gstate["step"]
    lr = self._group_lr(group, t)
    stepping = []
    for i, p in enumerate(group["params"]):
      if grad_of(p) is None:
        continue
      check_grad(grad_of(p), position + i)
      stepping.append((i, p))
    if not stepping:
      return
    # State is made at a param's first step, as in the seed.
    fresh = [p for _, p in stepping if not self.state[p] and not _is_scalar(p)]
    rms = dict(zip(fresh, self._mean_squares(fresh)))
    for _, p in stepping:
      if not self.state[p]:
        self.state[p].update(self._new_state(
            group, p, rounding.sqrt(rms[p]) if p in rms else None))
    todo = [(i, p, self.state[p]) for i, p in stepping]
    # Sharded params (FSDP2's DTensors) step their local shards.
    grads = [rounding.widen(_dist.local(step_grad(self, p))) for _, p, _ in todo]
    if group["clipping_scale"] is not None:
      factor = self._clip(group, gstate, t, todo, grads)
      grads = [g * factor for g in grads]
    sums = self._param_sums(group, todo, grads)
    cache: dict = {}
    for (_, p, state), g, (scale_grad, mean_sq) in zip(todo, grads, sums):
      self._step_one(group, lr, p, g, state, cache, scale_grad, mean_sq)
      state["step"] += 1
    gstate["step"] = t + 1

  def _param_sums(self, group: dict, todo, grads) -> list:
    """Per param, the reductions of its step: the scale gradient ``sum(p * g)``
    and, at a size update, ``mean(p * p)`` (None where not needed), each over
    the whole param (one collective for all of them when params are sharded)."""
    S = group["size_update_period"]
    values, params, means, slots = [], [], [], []
    for (_, p, state), g in zip(todo, grads):
      if _is_scalar(p):
        slots.append((None, None))
        continue
      p32 = rounding.widen(_dist.local(p))
      slots.append((len(values), None))
      values.append((p32 * g).sum())
      params.append(p)
      means.append(False)
      if int(state["step"]) % S == S - 1:
        slots[-1] = (slots[-1][0], len(values))
        values.append(_local_mean(p32 * p32, p))
        params.append(p)
        means.append(True)
    values = self._reduce(values, params, means) if values else values
    return [(None if a is None else values[a], None if b is None else values[b])
            for a, b in slots]

  def _clip(self, group: dict, gstate: dict, t: int, todo, grads) -> torch.Tensor:
    """The seed's ``_get_clipping_scale``: the factor (a 0-dim fp32 tensor) and stats."""
    P = group["clipping_update_period"]
    device = grads[0].device
    if "model_norms" not in gstate:
      gstate.update(self._init_clipping(P, device))
    c = gstate
    sumsq = []
    for (_, p, state), g in zip(todo, grads):
      if _is_scalar(p):
        sumsq.append((g * g).sum())
      else:
        gr = g * rounding.widen(state["param_rms"])
        sumsq.append((gr * gr).sum())
    sumsq = self._reduce(sumsq, [p for _, p, _ in todo], [False] * len(todo))
    tot_sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for s in sumsq:  # in param order, the same sequence of fp32 adds as optax_half
      tot_sumsq = tot_sumsq + s
    tot_norm = rounding.sqrt(tot_sumsq)
    slot = t % P
    if t > 0:
      c["model_norms"][slot] = tot_norm
    take_stats = t > 0 and slot == 0
    if take_stats:
      index = self._device_tensor(("quartiles", P), quartile_indices(P), torch.int64, device)
      quartiles = torch.sort(c["model_norms"]).values.index_select(0, index)
      c["model_norm_threshold"] = f32(group["clipping_scale"]) * quartiles[2]
      c["percent_clipped"] = (c["num_clipped"].float() * 100) * f32(np.float32(1) / np.float32(P))
      c["quartiles"] = quartiles
      c["num_clipped"] = torch.zeros_like(c["num_clipped"])
    if t >= P:
      factor = torch.clamp(c["model_norm_threshold"] / (tot_norm + f32(1e-20)), max=1.0)
    else:
      factor = torch.ones((), dtype=torch.float32, device=device)
    c["num_clipped"] = c["num_clipped"] + (factor < 1).to(torch.int32)
    # argmax and max on the device; indexing with a 0-d tensor would be a host read.
    shares = torch.stack(sumsq)
    dominant = torch.argmax(shares).view(1)
    positions = self._device_tensor(("positions", tuple(i for i, _, _ in todo)),
                                    [i for i, _, _ in todo], torch.int32, device)
    c["dominant_index"] = positions.index_select(0, dominant)[0]
    c["dominant_share"] = shares.max() / tot_sumsq
    c["clipping_factor"] = factor
    c["grad_norm"] = tot_norm
    if self.show_dominant_parameters or logger.isEnabledFor(logging.INFO):
      # Reading the factor is a host sync: only when logging is asked for.
      if take_stats or float(factor) < 0.1:
        _log_stats(t, _stats_dict(c, _names(group)), group["clipping_scale"],
                   self.show_dominant_parameters, take_stats)
    return factor

  def _device_tensor(self, key, values, dtype, device) -> torch.Tensor:
    """A small constant index tensor, copied to ``device`` once and cached."""
    cache = self.__dict__.setdefault("_constants", {})
    key = (key, str(device))
    if key not in cache:
      cache[key] = torch.tensor(values, dtype=dtype, device=device)
    return cache[key]

  def _coefficients(self, group: dict, t: int, lr: float, cache: dict) -> dict:
    """The fp32 scalars of a step at count ``t``, formed once per group step."""
    key = (t, lr)
    if key not in cache:
      S = group["size_update_period"]
      b1, b2 = group["betas"]
      k = {"b1": np.float32(b1), "b2": np.float32(b2),
           "eps": np.float32(group["eps"]),
           "one_minus_b1": np.float32(1 - b1),
           "one_minus_b2": np.float32(1 - b2),
           "b2_corr": np.float32(b2 ** S),
           "one_minus_b2_corr": np.float32(1 - b2 ** S),
           "lr": np.float32(lr)}
      k["size_lr"] = k["lr"] * np.float32(group["scalar_lr_scale"])
      k["bc2"] = np.float32(rounding.one_minus_pow(k["b2"], t + 1, one_minus_b=k["one_minus_b2"]))
      k["inv_bc2"] = np.float32(1) / k["bc2"]
      k["size_bc2"] = np.float32(rounding.one_minus_pow(k["b2_corr"], (t + 1) // S,
                                                        one_minus_b=k["one_minus_b2_corr"]))
      cache[key] = k
    return cache[key]

  def _step_one(self, group: dict, lr: float, p: torch.Tensor, g: torch.Tensor,
                state: dict, cache: dict, scale_grad, mean_sq) -> None:
    """The seed's ``_step_one_batch`` for one param, in place; fp32 math.

    ``g``: the (local) fp32 gradient; ``scale_grad``, ``mean_sq``: ``sum(p *
    g)`` and, at a size update, ``mean(p * p)`` over the whole param
    (``_param_sums``). A sharded param steps its local shard.
    """
    t = int(state["step"])
    S = group["size_update_period"]
    # Coefficients as the seed forms them: float64, then rounded once to fp32.
    k = self._coefficients(group, t, lr, cache)
    b1, b2, eps = k["b1"], k["b2"], k["eps"]
    one_minus_b1, one_minus_b2 = k["one_minus_b1"], k["one_minus_b2"]
    b2_corr, one_minus_b2_corr = k["b2_corr"], k["one_minus_b2_corr"]
    lr32, size_lr, bc2, inv_bc2 = k["lr"], k["size_lr"], k["bc2"], k["inv_bc2"]
    min_rms, max_rms = np.float32(group["param_min_rms"]), np.float32(group["param_max_rms"])
    p = _dist.local(p)
    p32 = rounding.widen(p)
    delta_buf, v_buf = _dist.local(state["delta"]), _dist.local(state["exp_avg_sq"])

    delta = float(b1) * rounding.widen(delta_buf)
    v_buf.copy_(float(b2) * rounding.widen(v_buf) + float(one_minus_b2) * (g * g))
    v32 = rounding.widen(v_buf)
    if _is_scalar(p):
      lr_s = -size_lr * one_minus_b1
      denom = rounding.sqrt(v32 * float(inv_bc2)) + float(eps)
      delta = delta + float(lr_s) * (g / denom)
      delta_buf.copy_(delta)
      scalar_max = f32(group["scalar_max"])
      p.clamp_(min=-scalar_max, max=scalar_max)
      p.add_(delta_buf)
      return
    # Size update: learn the tensor's scale, in log space, every S steps.
    is_size_step = t % S == S - 1
    sg = state["scale_grads"]
    # sum(p * g) and mean(p * p), which JAX computes here, come from
    # _param_sums: the same values, taken for all params before any steps (so
    # that sharded params reduce them over the ranks in one collective).
    sg[t % S] = scale_grad
    rms_buf = state["param_rms"]
    if is_size_step:
      rms_buf.copy_(rounding.sqrt(mean_sq))
      if t > 0:
        size_bc2 = k["size_bc2"]
        sg32 = rounding.widen(sg)
        w_buf = state["scale_exp_avg_sq"]
        w_buf.copy_(float(b2_corr) * rounding.widen(w_buf)
                    + float(one_minus_b2_corr) * (sg32 * sg32).mean())
        scale_step = (float(-size_lr * np.sqrt(size_bc2)) * sg32.sum()
                      / (rounding.sqrt(rounding.widen(w_buf)) + float(eps)))
        rms32 = rounding.widen(rms_buf)
        scale_step = torch.where(rms32 < float(min_rms), 0.0, scale_step)
        scale_step = torch.where(rms32 > float(max_rms), float(-size_lr * np.float32(S)),
                                 scale_step)
        delta = delta + float(one_minus_b1) * (p32 * scale_step)
    # The Adam-like step, scaled by the tensor's RMS.
    v_hat = v32 * float(inv_bc2) if bc2 < np.float32(0.99) else v32
    denom = rounding.sqrt(v_hat) + float(eps)
    alpha = float(-lr32 * one_minus_b1) * torch.clamp(rounding.widen(rms_buf), min=float(min_rms))
    delta = delta + (g / denom) * alpha
    delta_buf.copy_(delta)
    p.add_(delta_buf)


def _local_mean(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
  """``x.mean()`` for ``x`` computed from a whole param; from a shard, the sum
  over it (``ScaledAdam._reduce`` adds the shards' sums and divides by the size)."""
  return x.sum() if _dist.is_dtensor(p) else x.mean()


def _names(group: dict) -> list:
  names = group.get("param_names")
  return list(names) if names is not None else [str(i) for i in range(len(group["params"]))]


def _stats_dict(c: dict, names) -> dict:
  index = int(c["dominant_index"])
  return {
      "grad_norm_quartiles": [float(q) for q in c["quartiles"]],
      "model_norm_threshold": float(c["model_norm_threshold"]),
      "percent_clipped": float(c["percent_clipped"]),
      "num_clipped": int(c["num_clipped"]),
      "clipping_factor": float(c["clipping_factor"]),
      "grad_norm": float(c["grad_norm"]),
      "dominant_parameter": names[index] if 0 <= index < len(names) else None,
      "dominant_share": float(c["dominant_share"]),
  }


def _log_stats(step: int, stats: dict, clipping_scale, show_dominant: bool,
               take_stats: bool, log=logger) -> None:
  """The seed's log lines (the same text as ``optax_half.scaled_adam``)."""
  if take_stats:
    quartiles = " ".join("%.3e" % q for q in stats["grad_norm_quartiles"])
    log.info(f"Clipping_scale={clipping_scale}, grad-norm quartiles {quartiles}, "
             f"threshold={stats['model_norm_threshold']:.3e}, "
             f"percent-clipped={stats['percent_clipped']:.1f}")
  if stats["clipping_factor"] < 0.1:
    log.warning(f"Scaling gradients by {stats['clipping_factor']}, "
                f"model_norm_threshold={stats['model_norm_threshold']}")
    if show_dominant:
      log.info(f"Parameter dominating tot_sumsq {stats['dominant_parameter']} with "
               f"proportion {stats['dominant_share']:.2f} (step {step})")


def _find(optimizer) -> ScaledAdam:
  seen = optimizer
  while not isinstance(seen, ScaledAdam):
    seen = getattr(seen, "inner", None)
    if seen is None:
      raise ValueError("scaled_adam_stats: this optimizer is not (and does not wrap) a ScaledAdam.")
  return seen


def scaled_adam_stats(optimizer, group: int = 0) -> dict:
  """The clipping statistics of param group ``group`` (host values; a device sync).

  The same dict as ``optax_half.scaled_adam_stats``; ``optimizer`` may be a
  ``ScaledAdam`` or a torch_bridge wrapper around one.

  Example:
    >>> import torch, torch_bridge as tb
    >>> w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.zeros(4))
    >>> opt = tb.scaled_adam([("w", w), ("b", b)], lr=0.03, clipping_scale=2.0)
    >>> w.grad, b.grad = torch.ones_like(w), torch.full_like(b, 0.1)
    >>> opt.step()
    >>> stats = tb.scaled_adam_stats(opt)
    >>> stats["grad_norm"], stats["clipping_factor"], stats["dominant_parameter"]
    (4.0, 1.0, 'w')
  """
  opt = _find(optimizer)
  c = opt.group_state[group]
  if "model_norms" not in c:
    c = {**ScaledAdam._init_clipping(opt.param_groups[group]["clipping_update_period"],
                                     "cpu"), **c}
  return _stats_dict(c, _names(opt.param_groups[group]))


def scaled_adam(
    params,
    learning_rate=3e-2,
    clipping_scale: Optional[float] = None,
    b1: float = 0.9,
    b2: float = 0.98,
    scalar_lr_scale: float = 0.1,
    eps: float = 1e-8,
    param_min_rms: float = 1e-5,
    param_max_rms: float = 3.0,
    scalar_max: float = 10.0,
    size_update_period: int = 4,
    clipping_update_period: int = 100,
    show_dominant_parameters: bool = False,
    skip_nonfinite: bool = False,
    *,
    lr=None,
    betas=None,
) -> ScaledAdam:
  """ScaledAdam for torch: ``optax_half.scaled_adam`` as a ``torch.optim.Optimizer``.

  Args:
    params: ``model.parameters()``, ``model.named_parameters()`` (names show
      up in the statistics) or a list of param-group dicts.
    learning_rate: a float or a schedule ``count -> lr`` (e.g. ``eden(...)``).
    lr, betas: torch's (and icefall's) spellings of ``learning_rate`` and ``(b1, b2)``.
    The rest: as ``optax_half.scaled_adam``.

  Example:
    >>> import torch, torch_bridge as tb
    >>> w = torch.nn.Parameter(torch.ones(4, 4))
    >>> opt = tb.scaled_adam([w], lr=0.03, clipping_scale=2.0)
    >>> w.grad = torch.ones_like(w)
    >>> opt.step()
    >>> w[0, 0].item() < 1.0
    True

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024 (ScaledAdam,
    Eden); k2-fsa/icefall's ``optim.py``.
  """
  return ScaledAdam(params, learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps,
                    param_min_rms, param_max_rms, scalar_max, size_update_period,
                    clipping_update_period, show_dominant_parameters, skip_nonfinite,
                    lr=lr, betas=betas)
