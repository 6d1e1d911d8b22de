"""Dynamic loss scaling for PyTorch: the twin of ``optax_half/loss_scale.py``.

``dynamic_loss_scale(...)`` returns a ``DynamicLossScaler``, a drop-in for
``torch.amp.GradScaler`` (the same methods, state-dict keys and recipes)::

    scaler = torch_bridge.dynamic_loss_scale()
    for x, y in data:
      optimizer.zero_grad()
      scaler.scale(loss_fn(model(x), y)).backward()
      scaler.unscale_(optimizer)                    # optional: to clip or log
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # optional
      scaler.step(optimizer)                        # skipped on inf/NaN
      scaler.update()

The scale and growth-tracker arithmetic is GradScaler's
(``docs/algorithms.md#dynamic-loss-scaling``). Where it differs:

* fp16 gradients work. They are upcast to fp32 **before** unscaling
  (labml's GradScalerFP16) and, for ``torch_bridge`` optimizers
  (``adamw_bf16``, ``master_weights(...)``, ...), the unscaled fp32
  gradient is handed to the step directly, so it sees exactly what
  ``optax_half.dynamic_loss_scale`` gives its inner transformation.
  ``p.grad`` of an fp16 param keeps the scaled value (unscaled in fp16 it
  would underflow): clip those with ``scaler.clip_grad_norm_``, which clips
  what the step will use; a change to such a ``p.grad`` after ``unscale_``
  is an error. fp16 gradients of a plain ``torch.optim`` optimizer are
  refused with the fix, as GradScaler refuses them (a ``ValueError``).
  Sparse gradients of a plain optimizer are unscaled in their values, as
  GradScaler's; torch_bridge optimizers refuse them.
* fp32 and bf16 gradients are unscaled in place, as GradScaler does (a
  power-of-two scale is exact there), so ``clip_grad_norm_`` after
  ``unscale_`` works on them unchanged.
* The finiteness check is made on the unscaled values.
* ``min_scale`` floors the scale on backoff; counters ``skipped_steps`` and
  ``last_finite`` are kept and saved.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Optional

import torch

from torch_bridge import _dist, rounding
from optax_half_native.checks import check_loss_scale_args, f32
from torch_bridge._optim import grad_of, step_grad

__all__ = ["DynamicLossScaler", "dynamic_loss_scale", "check_loss_scale_args"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def takes_fp32_grads(optimizer, p=None) -> bool:
  """Whether ``optimizer`` steps on fp32 gradients handed over by the scaler
  (for ``p``: whether it widens that param; a wrapper leaves params that are
  as wide as its ``master_dtype`` to the inner optimizer as they are)."""
  if not isinstance(getattr(optimizer, "_unscaled_grads", None), dict):
    return False
  return p is None or optimizer._takes_fp32_grad(p)


def _main_grad_unread(position: int, optimizer) -> TypeError:
  return TypeError(
      f"param {position} accumulates its gradient in p.main_grad (accumulate_in_fp32), "
      f"which {type(optimizer).__name__} does not read. Use a torch_bridge optimizer, or "
      "wrap this one: torch_bridge.master_weights(optimizer).")


def _values(g: torch.Tensor) -> torch.Tensor:
  """What of ``g`` this process unscales and checks: a sharded gradient's local
  shard, a sparse one's values (a plain optimizer's, as GradScaler), else ``g``."""
  return g._values() if g.is_sparse else _dist.local(g)


class DynamicLossScaler:
  """GradScaler-like dynamic loss scaling; build it with ``dynamic_loss_scale``.

  State (0-dim tensors on the device of the first scaled loss): ``scale``
  (fp32), ``growth_tracker`` (int32), ``skipped_steps`` (int32),
  ``last_finite`` (bool); ``counters()`` returns them without a host sync.
  Any number of optimizers can share one scaler: ``step`` skips each
  optimizer whose own gradients are non-finite, and ``update`` backs off if
  any optimizer stepped since the last ``update`` saw a non-finite gradient.
  With ``enabled=False`` every method is a no-op, as GradScaler's:
  ``scale`` returns its input, ``step`` calls ``optimizer.step``.

  Example:
    >>> import torch, torch_bridge as tb
    >>> scaler = tb.dynamic_loss_scale(init_scale=1024.0)
    >>> scaler.scale(torch.tensor(2.0)).item(), scaler.get_growth_interval()
    (2048.0, 2000)

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
    ICLR 2018 (loss scaling); ``torch.amp.GradScaler``, whose interface and
    scale arithmetic it follows.
  """

  def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, growth_interval: int = 2000,
               min_scale: float = 1.0, *, enabled: bool = True):
    if not isinstance(enabled, bool):
      raise TypeError(f"enabled must be True or False; got {enabled!r}.")
    check_loss_scale_args(init_scale, growth_factor, backoff_factor, growth_interval,
                          min_scale)
    self._enabled = enabled
    self._growth_factor = float(growth_factor)
    self._backoff_factor = float(backoff_factor)
    self._growth_interval = int(growth_interval)
    self._min_scale = float(min_scale)
    self._scale = torch.tensor(init_scale, dtype=torch.float32)
    self._growth_tracker = torch.tensor(0, dtype=torch.int32)
    self._skipped_steps = torch.tensor(0, dtype=torch.int32)
    self._last_finite = torch.tensor(True)
    self._per_optimizer: dict[int, dict] = {}

  # -- state on the right device ------------------------------------------------

  def _to(self, device: torch.device) -> None:
    if self._scale.device != device:
      for name in ("_scale", "_growth_tracker", "_skipped_steps", "_last_finite"):
        setattr(self, name, getattr(self, name).to(device))

  def _opt_state(self, optimizer) -> dict:
    state = self._per_optimizer.get(id(optimizer))
    if state is None:
      state = {"optimizer": optimizer, "stage": _READY, "found_inf": None, "versions": {}}
      self._per_optimizer[id(optimizer)] = state
    return state

  # -- the GradScaler API -------------------------------------------------------

  def scale(self, outputs):
    """``outputs * scale`` in (at least) fp32: a tensor, or (nested) lists and
    tuples of them (other iterables give an iterator), as GradScaler's."""
    if not self._enabled:
      return outputs
    if isinstance(outputs, torch.Tensor):
      if not outputs.is_floating_point():
        raise TypeError(f"scale() needs a float loss; got {outputs.dtype}.")
      self._to(outputs.device)
      wide = torch.promote_types(outputs.dtype, torch.float32)
      return outputs.to(wide) * self._scale.to(wide)
    if isinstance(outputs, (list, tuple)):
      return type(outputs)(self.scale(o) for o in outputs)
    if isinstance(outputs, (str, bytes)) or not hasattr(outputs, "__iter__"):
      raise TypeError("scale() takes a tensor or an iterable of tensors; got "
                      f"{type(outputs).__name__}.")
    return map(self.scale, outputs)

  @torch.no_grad()
  def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
    """Unscales ``optimizer``'s gradients (fp32 math) and records whether all are finite.

    fp32 and bf16 gradients: unscaled in place (bf16 computed in fp32 and
    rounded back, exact for a power-of-two scale), so ``p.grad`` holds the
    unscaled gradient, as after ``GradScaler.unscale_``. fp16 gradients of a
    ``torch_bridge`` optimizer: ``widen(g) * inv_scale`` is handed to its
    next step and ``p.grad`` keeps the scaled value (in fp16 it would
    underflow); of other optimizers: an error that names the fix.
    """
    if not self._enabled:
      return
    state = self._opt_state(optimizer)
    if state["stage"] == _UNSCALED:
      raise RuntimeError("unscale_() has already been called on this optimizer since the "
                         "last update().")
    if state["stage"] == _STEPPED:
      raise RuntimeError("unscale_() is being called after step().")
    # Check every gradient before changing any, so an error leaves nothing
    # half-unscaled.
    todo = []
    position = 0
    for group in optimizer.param_groups:
      for p in group["params"]:
        position += 1
        g = grad_of(p)  # an fp32 main_grad (accumulate_in_fp32), or p.grad
        if g is None:
          continue
        if g is not p.grad and not takes_fp32_grads(optimizer):
          raise _main_grad_unread(position - 1, optimizer)
        if g.is_sparse and takes_fp32_grads(optimizer):
          raise RuntimeError(
              f"param {position - 1} has a sparse gradient; torch_bridge optimizers need "
              "dense gradients.")
        hand_over = g.dtype == torch.float16 and takes_fp32_grads(optimizer, p)
        if g.dtype == torch.float16 and not hand_over:
          raise ValueError(  # GradScaler's error type
              f"Attempting to unscale FP16 gradients: param {position - 1}'s, which "
              f"{type(optimizer).__name__} steps in fp16, where the unscaled gradient "
              "underflows. Wrap the optimizer so it steps fp32 masters: "
              "torch_bridge.master_weights(optimizer), or use a torch_bridge optimizer.")
        todo.append((p, g, hand_over))
    if todo:
      self._to(todo[0][1].device)  # the state lives where the gradients are
    inv_scale = torch.ones((), dtype=torch.float32, device=self._scale.device) / self._scale
    found_inf = torch.zeros((), dtype=torch.bool, device=self._scale.device)
    for p, g, hand_over in todo:
      g_local = _values(g)
      inv = inv_scale.to(g_local.device)
      if g.dtype.itemsize >= 4:
        g_local.mul_(inv)  # fp32 math, like GradScaler
        unscaled = g_local
      elif hand_over:
        unscaled = rounding.widen(g_local) * inv
        optimizer._unscaled_grads[p] = _dist.like(unscaled, g)
        state["versions"][p] = (g, g._version)
      else:  # bf16: computed in fp32, rounded back
        g_local.copy_(rounding.widen(g_local) * inv)
        unscaled = g_local
      found_inf |= ~torch.isfinite(unscaled).all().to(found_inf.device)
    # Sharded gradients: an inf in any rank's shard skips the step on every rank.
    state["found_inf"] = _dist.any_rank(found_inf, [g for _, g, _ in todo])
    state["stage"] = _UNSCALED

  def _step_grads(self, optimizer) -> list:
    """The unscaled gradients the step will use (handed-over fp32 copies, or
    ``p.grad`` unscaled in place)."""
    ours = takes_fp32_grads(optimizer)
    return [step_grad(optimizer, p) if ours else p.grad
            for group in optimizer.param_groups for p in group["params"]
            if (grad_of(p) if ours else p.grad) is not None]

  @torch.no_grad()
  def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                      norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on the unscaled gradients the step will use.

    Unscales first if ``unscale_`` was not called. Returns the total norm
    (an fp32 tensor, no host sync). Same formula as torch:
    ``g *= min(1, max_norm / (norm + 1e-6))``.
    """
    if self._enabled:
      state = self._opt_state(optimizer)
      if state["stage"] == _READY:
        self.unscale_(optimizer)
      elif state["stage"] == _STEPPED:
        raise RuntimeError("clip_grad_norm_() is being called after step().")
    grads = self._step_grads(optimizer)
    if not grads:
      return torch.zeros((), dtype=torch.float32)
    if any(g.is_sparse for g in grads):
      raise RuntimeError("clip_grad_norm_: a gradient is sparse, and norms of sparse "
                         "gradients are not taken (nor by torch.nn.utils.clip_grad_norm_).")
    local = [_dist.local(g) for g in grads]
    device = local[0].device

    def norm(g):
      if g.numel() == 0 and math.isinf(norm_type):  # an empty shard: the max's (min's) identity
        return torch.full((), 0.0 if norm_type > 0 else math.inf, dtype=torch.float32,
                          device=device)
      return torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device)
    # Sharded gradients: the norms of the whole tensors, from their shards' (no-op otherwise).
    norms = _dist.norm_over_shards(torch.stack([norm(g) for g in local]), grads, norm_type)
    total = torch.linalg.vector_norm(norms, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in local:
      if g.dtype.itemsize >= 4:
        g.mul_(coef.to(g.device))
      else:
        g.copy_(rounding.widen(g) * coef.to(g.device))
    return total

  def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
    """``optimizer.step(*args, **kwargs)`` unless its unscaled gradients hold an inf or NaN.

    As ``torch.amp.GradScaler.step``: extra arguments go to ``optimizer.step``
    (a ``None`` closure, as accelerate passes, included); a closure is refused.
    The decision reads one bool from the device (a host sync, as in
    ``torch.amp.GradScaler`` for optimizers without in-kernel skipping).
    """
    if not self._enabled:
      return optimizer.step(*args, **kwargs)
    closure = kwargs["closure"] if "closure" in kwargs else (args[0] if args else None)
    if closure is not None:
      raise RuntimeError("closures are not supported with dynamic_loss_scale: compute the "
                         "loss, scale it and call backward() before step().")
    state = self._opt_state(optimizer)
    if state["stage"] == _STEPPED:
      raise RuntimeError("step() has already been called since the last update().")
    if getattr(optimizer, "_step_supports_amp_scaling", False):
      return self._step_scaling_inside(optimizer, state, args, kwargs)
    if state["stage"] == _READY:
      self.unscale_(optimizer)
    for p, (grad, version) in state["versions"].items():
      if p.grad is not grad or grad._version != version:
        raise RuntimeError(
            "an fp16 gradient (p.grad) was changed after scaler.unscale_(); the step "
            "uses the fp32 unscaled copy (fp16 gradients stay scaled, unscaled they would "
            "underflow). Clip with scaler.clip_grad_norm_(optimizer, max_norm) instead of "
            "torch.nn.utils.clip_grad_norm_.")
    try:
      retval = None
      if not bool(state["found_inf"]):
        # Every gradient the step uses was just found finite: an optimizer
        # with skip_nonfinite need not read that again (one host read a step).
        optimizer._grads_checked_finite = True
        retval = optimizer.step(*args, **kwargs)
    finally:
      optimizer.__dict__.pop("_grads_checked_finite", None)
      if takes_fp32_grads(optimizer):
        optimizer._unscaled_grads.clear()
      state["versions"] = {}
      state["stage"] = _STEPPED
    return retval

  def _step_scaling_inside(self, optimizer, state, args, kwargs):
    """GradScaler's contract with optimizers that unscale and skip inside their
    step (``_step_supports_amp_scaling``: torch's fused Adam, AdamW, SGD and
    Adagrad): ``optimizer.grad_scale`` and ``optimizer.found_inf`` (fp32
    tensors) are set for the step and removed after; the gradients stay
    scaled. A step taking a ``grad_scaler`` argument gets the scaler instead
    (GradScaler's older contract, with its ``FutureWarning``)."""
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
      warnings.warn(
          "dynamic_loss_scale passes itself as grad_scaler, as GradScaler still does; "
          "GradScaler is going to set optimizer.grad_scale and optimizer.found_inf instead.",
          FutureWarning, stacklevel=3)
      try:
        return optimizer.step(*args, **{**kwargs, "grad_scaler": self})
      finally:
        state["stage"] = _STEPPED
    if state["stage"] == _READY:  # the scaled gradients' check, without unscaling them
      grads = []
      for position, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        if grad_of(p) is not p.grad:
          raise _main_grad_unread(position, optimizer)
        if p.grad is not None:
          grads.append(p.grad)
      if grads:
        self._to(grads[0].device)
      found_inf = torch.zeros((), dtype=torch.bool, device=self._scale.device)
      for g in grads:
        found_inf |= ~torch.isfinite(_values(g)).all().to(found_inf.device)
      state["found_inf"] = _dist.any_rank(found_inf, grads)
      optimizer.grad_scale = self._scale * getattr(optimizer, "grad_scale", 1)
    else:  # unscale_ was called: the gradients are unscaled already
      optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
    optimizer.found_inf = state["found_inf"].to(torch.float32)
    try:
      return optimizer.step(*args, **kwargs)
    finally:
      state["stage"] = _STEPPED
      del optimizer.grad_scale, optimizer.found_inf

  @torch.no_grad()
  def update(self, new_scale: Optional[float] = None) -> None:
    """Updates the scale from the steps taken since the last ``update``.

    Non-finite: ``scale = max(scale * backoff_factor, min_scale)``, tracker 0,
    ``skipped_steps += 1``. Finite: ``tracker += 1``; at ``growth_interval``
    the scale grows by ``growth_factor`` if the product is finite, tracker 0.
    ``new_scale`` (a number or a 0-dim tensor) sets the scale instead.
    """
    if not self._enabled:
      return
    try:
      if new_scale is not None:
        value = torch.as_tensor(new_scale, dtype=torch.float32).to(self._scale.device)
        if value.numel() != 1:
          raise ValueError("new_scale must be a number or a one-element tensor.")
        self._scale.copy_(value.reshape(()))
        return
      checks = [s["found_inf"] for s in self._per_optimizer.values()
                if s["found_inf"] is not None]
      if not checks:
        raise RuntimeError("No inf checks were recorded prior to update(): call "
                           "scaler.step(optimizer) (or unscale_) first.")
      found_inf = torch.stack([c.to(self._scale.device) for c in checks]).any()
      finite = ~found_inf
      scale = self._scale
      tracker = self._growth_tracker + 1
      at_interval = tracker == self._growth_interval
      # Python floats holding fp32 values: multiplying an fp32 tensor by them
      # is an fp32 product, and no host-to-device copy (a sync on GPU).
      grown = scale * f32(self._growth_factor)
      scale_if_finite = torch.where(at_interval & torch.isfinite(grown), grown, scale)
      scale_if_not = torch.clamp(scale * f32(self._backoff_factor), min=f32(self._min_scale))
      # In place: a tensor obtained from counters() stays a copy, the state
      # tensors keep their identity.
      self._scale.copy_(torch.where(finite, scale_if_finite, scale_if_not))
      self._growth_tracker.copy_(torch.where(finite & ~at_interval, tracker,
                                             torch.zeros_like(tracker)))
      self._skipped_steps.add_(found_inf.to(torch.int32))
      self._last_finite.copy_(finite)
    finally:
      for s in self._per_optimizer.values():
        opt = s["optimizer"]
        if takes_fp32_grads(opt):
          opt._unscaled_grads.clear()
      self._per_optimizer = {}

  # -- reading, setting and saving ---------------------------------------------------

  def is_enabled(self) -> bool:
    return self._enabled

  def get_scale(self) -> float:
    """The current scale as a Python float (reads the device: for logging);
    1.0 when disabled."""
    return float(self._scale) if self._enabled else 1.0

  def get_growth_tracker(self) -> int:
    return int(self._growth_tracker) if self._enabled else 0

  _get_growth_tracker = get_growth_tracker  # GradScaler's (private) name

  def get_growth_factor(self) -> float:
    return self._growth_factor

  def set_growth_factor(self, new_factor: float) -> None:
    check_loss_scale_args(1.0, new_factor, self._backoff_factor, self._growth_interval, 1.0)
    self._growth_factor = float(new_factor)

  def get_backoff_factor(self) -> float:
    return self._backoff_factor

  def set_backoff_factor(self, new_factor: float) -> None:
    check_loss_scale_args(1.0, self._growth_factor, new_factor, self._growth_interval, 1.0)
    self._backoff_factor = float(new_factor)

  def get_growth_interval(self) -> int:
    return self._growth_interval

  def set_growth_interval(self, new_interval: int) -> None:
    check_loss_scale_args(1.0, self._growth_factor, self._backoff_factor, new_interval, 1.0)
    self._growth_interval = int(new_interval)

  def get_min_scale(self) -> float:
    return self._min_scale

  def set_min_scale(self, new_min_scale: float) -> None:
    check_loss_scale_args(max(self.get_scale(), f32(new_min_scale)), self._growth_factor,
                          self._backoff_factor, self._growth_interval, new_min_scale)
    self._min_scale = float(new_min_scale)

  def counters(self) -> dict:
    """``scale``, ``growth_tracker``, ``skipped_steps``, ``last_finite`` as 0-dim
    tensors (copies; no host sync)."""
    return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker.clone(),
            "skipped_steps": self._skipped_steps.clone(),
            "last_finite": self._last_finite.clone()}

  def state_dict(self) -> dict:
    """``torch.amp.GradScaler``'s keys plus ``min_scale``, ``skipped_steps``,
    ``last_finite``; the scale is a Python float holding the fp32 value exactly.
    Empty when disabled, as GradScaler's."""
    if not self._enabled:
      return {}
    return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
            "_growth_tracker": self.get_growth_tracker(), "min_scale": self._min_scale,
            "skipped_steps": int(self._skipped_steps), "last_finite": bool(self._last_finite)}

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads ours or a ``torch.amp.GradScaler`` state dict (our extra counters
    then restart at 0 / True and ``min_scale`` keeps its current value).
    A disabled scaler loads nothing, as GradScaler's."""
    if not self._enabled:
      return
    if not state_dict:
      raise RuntimeError("The state dict is empty (saved from a disabled GradScaler?).")
    missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                           "_growth_tracker") if k not in state_dict]
    if missing:
      raise KeyError(f"loss-scaler state dict lacks {missing}.")
    min_scale = state_dict.get("min_scale", self._min_scale)
    scale = float(state_dict["scale"])
    if not (math.isfinite(scale) and scale > 0):
      raise ValueError(f"the saved scale must be finite and > 0; got {scale}.")
    # The saved scale may sit below min_scale (a GradScaler's): check the rest.
    check_loss_scale_args(max(scale, min_scale), state_dict["growth_factor"],
                          state_dict["backoff_factor"], state_dict["growth_interval"],
                          min_scale)
    device = self._scale.device
    self._growth_factor = float(state_dict["growth_factor"])
    self._backoff_factor = float(state_dict["backoff_factor"])
    self._growth_interval = int(state_dict["growth_interval"])
    self._min_scale = float(min_scale)
    self._scale = torch.tensor(scale, dtype=torch.float32, device=device)
    self._growth_tracker = torch.tensor(int(state_dict["_growth_tracker"]), dtype=torch.int32,
                                        device=device)
    self._skipped_steps = torch.tensor(int(state_dict.get("skipped_steps", 0)),
                                       dtype=torch.int32, device=device)
    self._last_finite = torch.tensor(bool(state_dict.get("last_finite", True)), device=device)
    self._per_optimizer = {}

  def __getstate__(self) -> dict:
    """Pickles between iterations only (after ``update()``), as GradScaler."""
    if self._enabled and self._per_optimizer:
      raise RuntimeError("A dynamic loss scaler may only be pickled at the beginning of an "
                         "iteration, or at the end after scaler.update().")
    return self.__dict__.copy()


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    *,
    enabled: bool = True,
) -> DynamicLossScaler:
  """A ``DynamicLossScaler``: ``optax_half.dynamic_loss_scale`` for torch.

  Same defaults and the same scale arithmetic as ``torch.amp.GradScaler``
  (plus ``min_scale``), and its methods, so it replaces a GradScaler as is;
  see the module docstring for what differs (fp16 gradients).

  Args:
    init_scale, growth_factor, backoff_factor, growth_interval: as GradScaler's.
    min_scale: the floor of the scale on backoff.
    enabled: False makes every method a no-op (``scale`` returns its input,
      ``step`` calls ``optimizer.step``), as ``GradScaler(enabled=False)``.

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    >>> opt = tb.adam_fp32_master([p], lr=1e-3)
    >>> scaler = tb.dynamic_loss_scale()
    >>> scaler.scale((p.float() * 1e-6).sum()).backward()  # 1e-6 underflows fp16 unscaled
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> p.grad[0].item(), p[0].item()   # scaled 16-bit grad, stepped param
    (0.0655517578125, 0.9990234375)

  References:
    Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
    ICLR 2018; ``torch.amp.GradScaler``.
  """
  return DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval,
                           min_scale, enabled=enabled)
