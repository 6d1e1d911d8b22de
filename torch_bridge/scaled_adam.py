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

import optax_half_native as native_lib
from optax_half_native.checks import QUARTILES, check_scaled_adam_args, quartile_indices
from torch_bridge import _dist, _native, rounding
from torch_bridge._optim import (LowPrecisionOptimizer, check_grad, check_no_float64, check_param,
                                 f32, grad_of, init_skip_nonfinite, load_nonfinite, prepare_load,
                                 stale_state_message, step_count, step_grad, torch_spellings)

__all__ = ["scaled_adam", "scaled_adam_stats", "ScaledAdam"]

logger = logging.getLogger(__name__)


_STATIC = (". (Only learning_rate may be a schedule; the other hyperparameters are "
           "Python numbers.)")


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
               skip_nonfinite: bool = False, *, fused: Optional[bool] = None, lr=None,
               betas=None):
    if lr is not None and learning_rate == 3e-2:  # the default, not a second spelling
      learning_rate = None
    learning_rate, b1, b2 = torch_spellings("scaled_adam", learning_rate, lr, b1, b2, betas,
                                            (0.9, 0.98))
    check_scaled_adam_args(learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps,
                           param_min_rms, param_max_rms, scalar_max, size_update_period,
                           clipping_update_period, _STATIC)
    schedule: Optional[Callable] = learning_rate if callable(learning_rate) else None
    lr0 = float(learning_rate(0)) if schedule is not None else float(learning_rate)
    self.show_dominant_parameters = bool(show_dominant_parameters)
    self._fused = None if fused is None else bool(fused)
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
                           group["size_update_period"], group["clipping_update_period"],
                           _STATIC)
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
    """``mean(p * p)`` in fp32 for each param, from all its shards: the kernel's
    float64 sum, rounded once, where it would step ``p`` (as at a size update),
    else one fp32 copy at a time."""
    native = _native_mean_squares(params) if self._fused is not False else {}
    values = []
    for k, p in enumerate(params):
      if k in native:
        values.append(native[k])
        continue
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

  @staticmethod
  def _layout(dtype: torch.dtype, scalar: bool) -> dict:
    """The dtype of each state tensor (``step`` aside) of a param of ``dtype``
    (``_new_state``'s)."""
    sq = torch.float32 if dtype == torch.float16 else dtype
    layout = {"delta": dtype, "exp_avg_sq": sq}
    if not scalar:
      layout.update(param_rms=dtype, scale_exp_avg_sq=sq, scale_grads=dtype)
    return layout

  def _check_states(self) -> None:
    """Before anything is stepped: the state of every param a step reads
    fits the param's dtype and shape now (not so after a model.to(dtype))."""
    position = 0
    for group in self.param_groups:
      for p in group["params"]:
        state = self.state.get(p)
        if state and grad_of(p) is not None:
          layout = self._layout(p.dtype, _is_scalar(p))
          if len(state) != len(layout) + 1 or "step" not in state or any(
              not torch.is_tensor(state.get(k)) or state[k].dtype != d
              or (k in ("delta", "exp_avg_sq") and state[k].shape != p.shape)
              for k, d in layout.items()):
            raise ValueError(stale_state_message(
                p, position, state, lambda d, p=p: self._layout(d, _is_scalar(p)),
                shaped=("delta", "exp_avg_sq")))
          step_count(state)
        position += 1

  def _step_all(self) -> None:
    self._check_states()
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
    # CPU tensors the native kernel takes step there (rows); the others (and
    # every tensor with fused=False) take the eager per-tensor step, whose
    # gradients are widened to fp32 here. Sharded params (FSDP2's DTensors)
    # step their local shards.
    rows = _NativeRows(todo, step_grad, self, group) if self._fused is not False else None
    grads = [None if rows is not None and k in rows else
             rounding.widen(_dist.local(step_grad(self, p))) for k, (_, p, _) in enumerate(todo)]
    factor = None
    if group["clipping_scale"] is not None:
      factor = self._clip(group, gstate, t, todo, self._clip_sums(todo, grads, rows))
      grads = [None if g is None else g * factor for g in grads]
    sums = self._param_sums(group, todo, grads, rows, factor)
    cache: dict = {}
    scale_steps = self._size_updates(group, lr, cache, todo, sums)
    for k, ((_, p, state), g) in enumerate(zip(todo, grads)):
      if g is not None:
        self._step_one(group, lr, p, g, state, cache, scale_steps[k])
        state["step"] += 1
    if rows:
      rows.step(self._native_scalars(group, lr, cache, todo, rows, scale_steps, factor))
    gstate["step"] = t + 1

  def _clip_sums(self, todo, grads, rows) -> list:
    """Per param, ``sum((g * param_rms)^2)`` (``sum(g^2)`` for a scalar) of its
    local gradient: from the kernel's sums, or eagerly."""
    out = []
    native = rows.clip_sums() if rows else {}
    for k, ((_, p, state), g) in enumerate(zip(todo, grads)):
      if g is None:
        out.append(native[k])
      elif _is_scalar(p):
        out.append((g * g).sum())
      else:
        gr = g * rounding.widen(state["param_rms"])
        out.append((gr * gr).sum())
    return out

  def _param_sums(self, group: dict, todo, grads, rows, factor) -> list:
    """Per param, the reductions of its step: the scale gradient ``sum(p * g)``
    and, at a size update, ``mean(p * p)`` (None where not needed), each over
    the whole param (one collective for all of them when params are sharded).
    The kernel's rows take ``sum(p * g)`` of the unclipped gradient, times
    the clipping factor."""
    S = group["size_update_period"]
    values, params, means, slots = [], [], [], []
    for k, ((_, p, state), g) in enumerate(zip(todo, grads)):
      if _is_scalar(p):
        slots.append((None, None))
        continue
      size_step = int(state["step"]) % S == S - 1
      if g is None:  # host fp32 values: one product, one rounding of the float64 mean
        scale_grad = np.float32(rows.sums[k][1])
        if factor is not None:
          scale_grad = scale_grad * np.float32(factor.item())
        slots.append((scale_grad, np.float32(rows.sums[k][2] / p.numel()) if size_step else None))
        continue
      p32 = rounding.widen(_dist.local(p))
      slots.append((len(values), None))
      values.append((p32 * g).sum())
      params.append(p)
      means.append(False)
      if size_step:
        slots[-1] = (slots[-1][0], len(values))
        values.append(_local_mean(p32 * p32, p))
        params.append(p)
        means.append(True)
    values = self._reduce(values, params, means) if values else values
    at = lambda a: values[a] if isinstance(a, int) else a
    return [(at(a), at(b)) for a, b in slots]

  def _clip(self, group: dict, gstate: dict, t: int, todo, sumsq: list) -> torch.Tensor:
    """The seed's ``_get_clipping_scale``: the factor (a 0-dim fp32 tensor) and
    stats, from each param's local ``sumsq`` (``_clip_sums``)."""
    P = group["clipping_update_period"]
    device = sumsq[0].device
    if "model_norms" not in gstate:
      gstate.update(self._init_clipping(P, device))
    c = gstate
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
                state: dict, cache: dict, scale_step) -> None:
    """The seed's ``_step_one_batch`` for one param, in place; fp32 math.

    ``g``: the (local) fp32 gradient; ``scale_step``: the size update's
    log-scale step (``_size_updates``; None where there is none). A sharded
    param steps its local shard.
    """
    t = int(state["step"])
    # Coefficients as the seed forms them: float64, then rounded once to fp32.
    k = self._coefficients(group, t, lr, cache)
    b1, b2, eps = k["b1"], k["b2"], k["eps"]
    one_minus_b1, one_minus_b2 = k["one_minus_b1"], k["one_minus_b2"]
    lr32, size_lr, bc2, inv_bc2 = k["lr"], k["size_lr"], k["bc2"], k["inv_bc2"]
    min_rms = np.float32(group["param_min_rms"])
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
      # JAX's update in p's dtype: a clamped p takes the step to round(clip(p) + delta), and
      # lands where p + u does (docs/algorithms.md#landing-exactly).
      t = (p32.clamp(min=-scalar_max, max=scalar_max) + rounding.widen(delta_buf)).to(p.dtype)
      p.add_(torch.where(p32.abs() > scalar_max, rounding.land(p, t)[0], delta_buf.to(p.dtype)))
      return
    if scale_step is not None:
      delta = delta + float(one_minus_b1) * (p32 * scale_step)
    # The Adam-like step, scaled by the tensor's RMS.
    v_hat = v32 * float(inv_bc2) if bc2 < np.float32(0.99) else v32
    denom = rounding.sqrt(v_hat) + float(eps)
    alpha = float(-lr32 * one_minus_b1) * torch.clamp(rounding.widen(state["param_rms"]),
                                                      min=float(min_rms))
    delta = delta + (g / denom) * alpha
    delta_buf.copy_(delta)
    p.add_(delta_buf)

  def _size_updates(self, group: dict, lr: float, cache: dict, todo, sums) -> list:
    """The size updates of a group step, for params of one step count, dtype
    and device at once: each param with more than one element records its
    scale gradient and, every S steps, takes its new RMS from ``mean(p * p)``
    and gets the log-scale step (``sums``: ``_param_sums``). Returns, per
    param of ``todo``, its scale step (a 0-dim fp32 tensor) or None."""
    S = group["size_update_period"]
    min_rms, max_rms = np.float32(group["param_min_rms"]), np.float32(group["param_max_rms"])
    batches: dict = {}
    for k, ((_, p, state), _) in enumerate(zip(todo, sums)):
      if not _is_scalar(p):
        sg = state["scale_grads"]
        batches.setdefault((int(state["step"]), sg.dtype, sg.device), []).append(k)
    out = [None] * len(todo)
    for (t, dtype, device), ks in batches.items():
      states = [todo[k][2] for k in ks]
      sg = torch.stack([s["scale_grads"] for s in states])
      sg[:, t % S] = _stack([sums[k][0] for k in ks], device)
      torch._foreach_copy_([s["scale_grads"] for s in states], list(sg.unbind(0)))
      if t % S != S - 1:
        continue
      # sum(p * g) and mean(p * p), which JAX computes here, come from
      # _param_sums: taken for all params before any steps (so that sharded
      # params reduce them over the ranks in one collective).
      rms = rounding.sqrt(_stack([sums[k][1] for k in ks], device)).to(dtype)
      torch._foreach_copy_([s["param_rms"] for s in states], list(rms.unbind(0)))
      if t == 0:
        continue
      k_ = self._coefficients(group, t, lr, cache)
      size_lr, eps = k_["size_lr"], k_["eps"]
      sg32 = rounding.widen(sg)
      w = torch.stack([s["scale_exp_avg_sq"] for s in states])
      w = (float(k_["b2_corr"]) * rounding.widen(w)
           + float(k_["one_minus_b2_corr"]) * (sg32 * sg32).mean(dim=1)).to(w.dtype)
      torch._foreach_copy_([s["scale_exp_avg_sq"] for s in states], list(w.unbind(0)))
      scale_step = (float(-size_lr * np.sqrt(k_["size_bc2"])) * sg32.sum(dim=1)
                    / (rounding.sqrt(rounding.widen(w)) + float(eps)))
      rms32 = rounding.widen(rms)
      scale_step = torch.where(rms32 < float(min_rms), 0.0, scale_step)
      scale_step = torch.where(rms32 > float(max_rms), float(-size_lr * np.float32(S)),
                               scale_step)
      for k, v in zip(ks, scale_step.unbind(0)):
        out[k] = v
    return out

  def _native_scalars(self, group: dict, lr: float, cache: dict, todo, rows,
                      scale_steps, factor) -> tuple:
    """``_step_one``'s per-tensor scalars for the kernel's rows (in
    ``rows.keys`` order, columns as SCALED_ADAM_SCALARS), and whether each
    adds the size term: host values (the kernel's tensors are on the CPU),
    the fp32 values ``_step_one`` computes."""
    states = [todo[k][2] for k in rows.keys]
    rms = rounding.widen(torch.stack([s["param_rms"] for s in states])).numpy()
    steps = torch.stack([_ZERO if scale_steps[k] is None else scale_steps[k]
                         for k in rows.keys]).numpy()
    counts = np.array([int(s["step"]) for s in states])
    out = np.empty((len(states), len(native_lib.SCALED_ADAM_SCALARS)), np.float32)
    out[:, 0] = 1.0 if factor is None else factor.item()
    for t in np.unique(counts):
      at = counts == t
      c = self._coefficients(group, int(t), lr, cache)
      # torch.clamp's min (NaN-propagating) on the fp32 RMS; then one fp32 product.
      alpha = (-c["lr"] * c["one_minus_b1"]) * np.maximum(rms[at],
                                                           np.float32(group["param_min_rms"]))
      inv_bc2 = c["inv_bc2"] if c["bc2"] < np.float32(0.99) else np.float32(1)
      out[at, 1:7] = (c["b1"], c["b2"], c["one_minus_b1"], c["one_minus_b2"], inv_bc2, c["eps"])
      out[at, 7] = alpha
    out[:, 8], out[:, 9] = steps, rms
    return out, np.array([scale_steps[k] is not None for k in rows.keys], np.int32)


_ZERO = torch.zeros(())


def _stack(values: list, device) -> torch.Tensor:
  """Host fp32 numbers or 0-dim fp32 tensors, stacked on ``device``."""
  if not any(torch.is_tensor(v) for v in values):
    return torch.from_numpy(np.array(values, np.float32)).to(device)
  return torch.stack([v if torch.is_tensor(v) else torch.tensor(v, device=device)
                      for v in values])


_KERNELS: dict = {}  # (param, grad, exp_avg_sq dtypes) -> (sums, step) or None


def _kernels(config: tuple):
  """The kernel's ``(sums, step)`` of a (param, grad, exp_avg_sq) dtype configuration, or
  None; looked up once per configuration."""
  if config not in _KERNELS:
    codes = [_native._CODES.get(d) for d in config]
    _KERNELS[config] = None if None in codes else native_lib.scaled_adam_kernels(*codes)
  return _KERNELS[config]


def _native_mean_squares(params: list) -> dict:
  """Position -> ``mean(p * p)`` (a 0-dim fp32 tensor: the float64 sum over ``numel``,
  rounded once) of the params the kernel sums (``_NativeRows``' conditions, the
  param as its own gradient), one call per configuration, reading each param once."""
  by_config: dict = {}
  for k, p in enumerate(params):
    if _is_scalar(p) or _dist.is_dtensor(p) or not (p.is_cpu and p.is_contiguous()):
      continue
    config = (p.dtype, p.dtype, torch.float32 if p.dtype == torch.float16 else p.dtype)
    if _kernels(config) is not None:
      by_config.setdefault(config, []).append(k)
  out = {}
  for config, ks in by_config.items():
    table = np.zeros(len(ks), native_lib.SCALED_ADAM_DTYPE)
    table["numel"] = [params[k].numel() for k in ks]
    table["p"] = table["g"] = [params[k].data_ptr() for k in ks]
    table["want"] = 2
    for k, sums in zip(ks, _sums(_kernels(config)[0], table)):
      out[k] = torch.tensor(np.float32(sums[2] / params[k].numel()))
  return out


def _sums(sums_fn, table) -> list:
  """The kernel's sums of the rows of ``table`` (their ``want``): per row, float64
  ``sum((g r)^2)``, ``sum(p g)``, ``sum(p p)``."""
  blocks = (table["numel"] + native_lib.SUM_BLOCK - 1) // native_lib.SUM_BLOCK
  scratch = np.zeros(3 * int(blocks.sum()), np.float64)
  offsets = np.cumsum(blocks) - blocks
  table["sums"] = scratch.ctypes.data + 24 * offsets.astype(np.uint64)
  sums_fn(table.ctypes.data, len(table), torch.get_num_threads())
  return [scratch[3 * o:3 * o + 3] for o in offsets]


class _NativeRows:
  """The params of one group step that the native kernel (scaled_adam.h) steps.

  Taken: params with more than one element whose param, gradient, delta and
  second moments are contiguous CPU tensors of a configuration the kernel
  was built for (not sharded). On creation the kernel takes their sums (one
  pass over params and gradients); ``scalars`` then gives each row its step's
  scalars and ``step`` steps them all, one call per configuration.
  """

  def __init__(self, todo, grad_of_param, optimizer, group: dict):
    self._rows: dict = {}  # position in todo -> (configuration, p, g, delta, v, state)
    for k, (_, p, state) in enumerate(todo):
      if _is_scalar(p) or _dist.is_dtensor(p):
        continue
      g = grad_of_param(optimizer, p)
      tensors = (p, g, state["delta"], state["exp_avg_sq"])
      if not all(t.is_cpu and t.is_contiguous() for t in tensors) or g.shape != p.shape:
        continue
      config = (p.dtype, g.dtype, state["exp_avg_sq"].dtype)
      if _kernels(config) is not None and state["delta"].dtype == p.dtype:
        self._rows[k] = (config, *tensors, state)
    self.keys = list(self._rows)
    # The sums each row needs: sum((g r)^2) when clipping, sum(p p) at a size update.
    S = group["size_update_period"]
    clipping = int(group["clipping_scale"] is not None)
    self._want = np.array([clipping | 2 * (int(self._rows[k][5]["step"]) % S == S - 1)
                           for k in self.keys], np.int32)
    self._tables = self._make_tables()
    # Per row: float64 sum((g r)^2), sum(p g), sum(p p).
    self.sums = self._take_sums()

  def __contains__(self, k) -> bool:
    return k in self._rows

  def __len__(self) -> int:
    return len(self._rows)

  def _make_tables(self) -> list:
    """One SCALED_ADAM_DTYPE table per configuration: ((sums, step), rows' positions in
    ``keys``, table)."""
    by_config: dict = {}
    for j, k in enumerate(self.keys):
      by_config.setdefault(self._rows[k][0], []).append(j)
    tables = []
    for config, js in by_config.items():
      table = np.zeros(len(js), native_lib.SCALED_ADAM_DTYPE)
      rows = [self._rows[self.keys[j]] for j in js]
      table["numel"] = [r[1].numel() for r in rows]
      for name, i in (("p", 1), ("g", 2), ("delta", 3), ("v", 4)):
        table[name] = [r[i].data_ptr() for r in rows]
      tables.append((_kernels(config), np.array(js), table))
    return tables

  def _take_sums(self) -> dict:
    if not self._rows:
      return {}
    rms = rounding.widen(torch.stack([self._rows[k][5]["param_rms"] for k in self.keys])).numpy()
    sums = {}
    for (sums_fn, _), js, table in self._tables:
      table["scalars"][:, native_lib.SCALED_ADAM_SCALARS.index("rms")] = rms[js]
      table["want"] = self._want[js]
      sums.update(zip([self.keys[j] for j in js], _sums(sums_fn, table)))
    return sums

  def clip_sums(self) -> dict:
    """Row -> ``sum((g r)^2)``, the float64 sum rounded once, as 0-dim fp32 tensors."""
    values = torch.from_numpy(np.array([self.sums[k][0] for k in self.keys], np.float32))
    return dict(zip(self.keys, values.unbind(0)))

  def step(self, scalars) -> None:
    """Steps every row with its scalars (``(values, size term)`` arrays in
    ``keys`` order), then advances their step counts."""
    values, size = scalars
    threads = torch.get_num_threads()
    for (_, step_fn), js, table in self._tables:
      table["scalars"] = values[js]
      table["size"] = size[js]
      step_fn(table.ctypes.data, len(js), threads)
    rows = self._rows.values()
    # Written through raw pointers: tell autograd, as an in-place op would.
    torch.autograd.graph.increment_version([t for r in rows for t in (r[1], r[3], r[4])])
    torch._foreach_add_([r[5]["step"] for r in rows], 1)


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
    fused: Optional[bool] = None,
    lr=None,
    betas=None,
) -> ScaledAdam:
  """ScaledAdam for torch: ``optax_half.scaled_adam`` as a ``torch.optim.Optimizer``.

  Args:
    params: ``model.parameters()``, ``model.named_parameters()`` (names show
      up in the statistics) or a list of param-group dicts.
    learning_rate: a float or a schedule ``count -> lr`` (e.g. ``eden(...)``).
    fused: how the step runs (torch only). None or True: params whose
      tensors are contiguous CPU tensors of fp32, bf16 or fp16 (where the CPU
      has F16C) step in the native kernel (``optax_half_native``: one pass for
      the sums, one for the step), the others (scalars, other devices,
      sharded params) in the eager per-tensor step; False: the eager step
      everywhere (the reference). The elementwise step is the same bits in
      both; the sums are not summed in the same order, so the clipping
      factor, scale gradient and RMS may differ by an ULP
      (docs/algorithms.md#scaledadam-and-eden).
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
                    fused=fused, lr=lr, betas=betas)
