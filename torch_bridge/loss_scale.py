"""Dynamic loss scaling for PyTorch: the twin of ``optax_half/loss_scale.py``.

``dynamic_loss_scale(...)`` returns a ``DynamicLossScaler``, used like
``torch.amp.GradScaler``::

    scaler = torch_bridge.dynamic_loss_scale()
    for x, y in data:
      optimizer.zero_grad()
      scaler.scale(loss_fn(model(x), y)).backward()
      scaler.unscale_(optimizer)                    # optional: to clip or log
      scaler.clip_grad_norm_(optimizer, 1.0)        # optional
      scaler.step(optimizer)                        # skipped on inf/NaN
      scaler.update()

Differences from ``torch.amp.GradScaler`` (the scale and growth-tracker
arithmetic is the same, see ``docs/algorithms.md`` section 8):

* 16-bit gradients are upcast to fp32 **before** unscaling (labml's
  GradScalerFP16). For ``torch_bridge`` optimizers (``adamw_bf16``,
  ``master_weights(...)``, ...) the unscaled fp32 gradient is handed to the
  step directly, so fp16 gradients work (GradScaler refuses them) and the
  step sees exactly what ``optax_half.dynamic_loss_scale`` gives its inner
  transformation. ``p.grad`` itself keeps the scaled 16-bit value: clip with
  ``scaler.clip_grad_norm_``, which clips the gradients the step will use
  (modifying ``p.grad`` after ``unscale_`` is detected and raises).
  Other optimizers get their fp32/bf16 gradients unscaled in place; fp16
  gradients of a plain ``torch.optim`` optimizer are refused with the fix.
* The finiteness check is made on the unscaled fp32 values.
* ``min_scale`` floors the scale on backoff; counters ``skipped_steps`` and
  ``last_finite`` are kept and saved.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from torch_bridge import _dist, rounding
from torch_bridge._optim import check_loss_scale_args, f32, step_grad

__all__ = ["DynamicLossScaler", "dynamic_loss_scale", "check_loss_scale_args"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def takes_fp32_grads(optimizer, p=None) -> bool:
  """Whether ``optimizer`` steps on fp32 gradients handed over by the scaler
  (for ``p``: whether it widens that param; a wrapper leaves params that are
  as wide as its ``master_dtype`` to the inner optimizer as they are)."""
  if not isinstance(getattr(optimizer, "_unscaled_grads", None), dict):
    return False
  return p is None or optimizer._takes_fp32_grad(p)


class DynamicLossScaler:
  """GradScaler-like dynamic loss scaling; build it with ``dynamic_loss_scale``.

  State (0-dim tensors on the device of the first scaled loss): ``scale``
  (fp32), ``growth_tracker`` (int32), ``skipped_steps`` (int32),
  ``last_finite`` (bool); ``counters()`` returns them without a host sync.
  Any number of optimizers can share one scaler: ``step`` skips each
  optimizer whose own gradients are non-finite, and ``update`` backs off if
  any optimizer stepped since the last ``update`` saw a non-finite gradient.
  """

  def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, growth_interval: int = 2000,
               min_scale: float = 1.0):
    check_loss_scale_args(init_scale, growth_factor, backoff_factor, growth_interval,
                          min_scale)
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
    """``outputs * scale`` in (at least) fp32; tensors, or lists/tuples of them."""
    if isinstance(outputs, torch.Tensor):
      if not outputs.is_floating_point():
        raise TypeError(f"scale() needs a float loss; got {outputs.dtype}.")
      self._to(outputs.device)
      wide = torch.promote_types(outputs.dtype, torch.float32)
      return outputs.to(wide) * self._scale.to(wide)
    if isinstance(outputs, (list, tuple)):
      return type(outputs)(self.scale(o) for o in outputs)
    raise TypeError(f"scale() takes a tensor or a list/tuple of tensors; got {type(outputs).__name__}.")

  @torch.no_grad()
  def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
    """Unscales ``optimizer``'s gradients (fp32) and records whether all are finite.

    16-bit gradients of a ``torch_bridge`` optimizer: ``widen(g) * inv_scale``
    is handed to its next step (``p.grad`` is left as it is). fp32 gradients,
    and bf16 gradients of other optimizers: unscaled in place (the bf16 ones
    computed in fp32 and rounded back). fp16 gradients of other optimizers: an
    error (unscaling in fp16 would underflow).
    """
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
        g = p.grad
        if g is None:
          continue
        if g.is_sparse:
          raise RuntimeError(
              f"param {position - 1} has a sparse gradient; dynamic_loss_scale needs dense "
              "gradients.")
        hand_over = g.dtype.itemsize < 4 and takes_fp32_grads(optimizer, p)
        if g.dtype == torch.float16 and not hand_over:
          raise TypeError(
              f"param {position - 1} has an fp16 gradient and {type(optimizer).__name__} "
              "steps in fp16: unscaling fp16 in fp16 underflows. Wrap the optimizer so it "
              "steps fp32 masters: torch_bridge.master_weights(optimizer), or use a "
              "torch_bridge optimizer.")
        todo.append((p, g, hand_over))
    if todo:
      self._to(todo[0][1].device)  # the state lives where the gradients are
    inv_scale = torch.ones((), dtype=torch.float32, device=self._scale.device) / self._scale
    found_inf = torch.zeros((), dtype=torch.bool, device=self._scale.device)
    for p, g, hand_over in todo:
      g_local = _dist.local(g)  # a sharded gradient: this rank's shard
      inv = inv_scale.to(g_local.device)
      if g.dtype.itemsize >= 4:
        g_local.mul_(inv)  # fp32 math, like GradScaler
        g32 = g_local
      elif hand_over:
        g32 = rounding.widen(g_local) * inv
        optimizer._unscaled_grads[p] = _dist.like(g32, g)
        state["versions"][p] = (g, g._version)
      else:  # bf16, stepped in bf16 by a plain optimizer
        g32 = rounding.widen(g_local) * inv
        g_local.copy_(g32)
      found_inf |= ~torch.isfinite(g32).all().to(found_inf.device)
    # Sharded gradients: an inf in any rank's shard skips the step on every rank.
    state["found_inf"] = _dist.any_rank(found_inf, [g for _, g, _ in todo])
    state["stage"] = _UNSCALED

  def _step_grads(self, optimizer) -> list:
    """The unscaled gradients the step will use (handed-over fp32 copies, or
    ``p.grad`` unscaled in place)."""
    ours = takes_fp32_grads(optimizer)
    return [step_grad(optimizer, p) if ours else p.grad
            for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None]

  @torch.no_grad()
  def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                      norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on the unscaled gradients the step will use.

    Unscales first if ``unscale_`` was not called. Returns the total norm
    (an fp32 tensor, no host sync). Same formula as torch:
    ``g *= min(1, max_norm / (norm + 1e-6))``.
    """
    state = self._opt_state(optimizer)
    if state["stage"] == _READY:
      self.unscale_(optimizer)
    elif state["stage"] == _STEPPED:
      raise RuntimeError("clip_grad_norm_() is being called after step().")
    grads = self._step_grads(optimizer)
    if not grads:
      return torch.zeros((), dtype=torch.float32)
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
    """``optimizer.step()`` unless its unscaled gradients hold an inf or NaN.

    The decision reads one bool from the device (a host sync, as in
    ``torch.amp.GradScaler`` for optimizers without in-kernel skipping).
    """
    if "closure" in kwargs or args:
      raise RuntimeError("closures are not supported with dynamic_loss_scale: compute the "
                         "loss, scale it and call backward() before step().")
    state = self._opt_state(optimizer)
    if state["stage"] == _STEPPED:
      raise RuntimeError("step() has already been called since the last update().")
    if state["stage"] == _READY:
      self.unscale_(optimizer)
    for p, (grad, version) in state["versions"].items():
      if p.grad is not grad or grad._version != version:
        raise RuntimeError(
            "a 16-bit gradient (p.grad) was changed after scaler.unscale_(); the step "
            "uses the fp32 unscaled copy. Clip with scaler.clip_grad_norm_(optimizer, "
            "max_norm) instead of torch.nn.utils.clip_grad_norm_.")
    try:
      retval = None
      if not bool(state["found_inf"]):
        # Every gradient the step uses was just found finite: an optimizer
        # with skip_nonfinite need not read that again (one host read a step).
        optimizer._grads_checked_finite = True
        retval = optimizer.step(**kwargs)
    finally:
      optimizer.__dict__.pop("_grads_checked_finite", None)
      if takes_fp32_grads(optimizer):
        optimizer._unscaled_grads.clear()
      state["versions"] = {}
      state["stage"] = _STEPPED
    return retval

  @torch.no_grad()
  def update(self, new_scale: Optional[float] = None) -> None:
    """Updates the scale from the steps taken since the last ``update``.

    Non-finite: ``scale = max(scale * backoff_factor, min_scale)``, tracker 0,
    ``skipped_steps += 1``. Finite: ``tracker += 1``; at ``growth_interval``
    the scale grows by ``growth_factor`` if the product is finite, tracker 0.
    ``new_scale`` (a number or a 0-dim tensor) sets the scale instead.
    """
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

  # -- reading and saving ---------------------------------------------------------

  def get_scale(self) -> float:
    """The current scale as a Python float (reads the device: for logging)."""
    return float(self._scale)

  def get_growth_tracker(self) -> int:
    return int(self._growth_tracker)

  def counters(self) -> dict:
    """``scale``, ``growth_tracker``, ``skipped_steps``, ``last_finite`` as 0-dim
    tensors (copies; no host sync)."""
    return {"scale": self._scale.clone(), "growth_tracker": self._growth_tracker.clone(),
            "skipped_steps": self._skipped_steps.clone(),
            "last_finite": self._last_finite.clone()}

  def state_dict(self) -> dict:
    """``torch.amp.GradScaler``'s keys plus ``min_scale``, ``skipped_steps``,
    ``last_finite``; the scale is a Python float holding the fp32 value exactly."""
    return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
            "_growth_tracker": self.get_growth_tracker(), "min_scale": self._min_scale,
            "skipped_steps": int(self._skipped_steps), "last_finite": bool(self._last_finite)}

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads ours or a ``torch.amp.GradScaler`` state dict (our extra counters
    then restart at 0 / True and ``min_scale`` keeps its current value)."""
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


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
) -> DynamicLossScaler:
  """A ``DynamicLossScaler``: ``optax_half.dynamic_loss_scale`` for torch.

  Same defaults and the same scale arithmetic as ``torch.amp.GradScaler``
  (plus ``min_scale``); see the module docstring for the differences.
  """
  return DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval,
                           min_scale)
