"""Plumbing shared by the torch_bridge optimizers (the ``_util.py`` of this side).

* host-side fp32 scalars: every hyperparameter enters the math as an fp32
  value, like ``optax_half`` (which makes them fp32 arrays);
* the same argument checks as ``optax_half.adam._check_hyperparams`` and
  ``optax_half.loss_scale.check_loss_scale_args``;
* ``seed_from_key``: the uint32 seed of an integer key;
* ``step_grad``: the gradient a step uses (the loss scaler's fp32 one, or ``p.grad``);
* ``load_state_dict_exact``: ``Optimizer.load_state_dict`` without its casts.
  torch casts every floating state tensor to its param's dtype on load, which
  would round an fp32 master or fp32 moments of a bf16 param to bf16. Here each
  saved tensor is copied into the live buffer of the same dtype, bit for bit,
  and a dtype or shape mismatch is an error. Everything is checked before
  anything is written; a ``"kind"`` entry names the optimizer that saved it.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import numpy as np
import torch

from torch_bridge import _dist

__all__ = ["f32", "check_hyperparams", "check_loss_scale_args", "seed_from_key", "load_state_dict_exact",
           "prepare_load", "check_kind", "optimizer_kind", "check_param", "check_grad",
           "step_grad", "run_step", "init_skip_nonfinite", "load_nonfinite",
           "register_param_group", "stepping_params"]


def f32(x) -> float:
  """``x`` rounded to fp32, as a Python float (exact in any later fp32 op)."""
  with np.errstate(over="ignore"):  # too large -> inf, which the checks report
    return float(np.float32(x))


def check_hyperparams(learning_rate, b1, b2, eps, weight_decay) -> None:
  """The checks of ``optax_half.adam._check_hyperparams``, same messages."""
  def concrete(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)
  if concrete(learning_rate) and learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0; got {learning_rate}.")
  for name, v in (("b1", b1), ("b2", b2)):
    if concrete(v) and not 0.0 <= v < 1.0:
      raise ValueError(f"{name} must be in [0, 1); got {v}.")
  if concrete(eps) and eps <= 0:
    raise ValueError(f"eps must be > 0; got {eps}.")
  if concrete(weight_decay) and weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0; got {weight_decay}.")


def check_loss_scale_args(init_scale, growth_factor, backoff_factor, growth_interval,
                          min_scale) -> None:
  """The checks of ``optax_half.loss_scale.check_loss_scale_args``, same messages."""
  for name, v in (("init_scale", init_scale), ("min_scale", min_scale),
                  ("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise TypeError(f"{name} must be a Python number; got {type(v).__name__}.")
    if not math.isfinite(f32(v)):
      raise ValueError(f"{name} must be finite in fp32; got {v}.")
  if not f32(init_scale) > 0:
    raise ValueError(f"init_scale must be > 0; got {init_scale}.")
  if not f32(min_scale) > 0:
    raise ValueError(f"min_scale must be > 0 (a scale of 0 would stop training); got {min_scale}.")
  if f32(min_scale) > f32(init_scale):
    raise ValueError(f"min_scale ({min_scale}) must be <= init_scale ({init_scale}).")
  if not f32(growth_factor) > 1.0:
    raise ValueError(f"growth_factor must be > 1; got {growth_factor}.")
  if not 0.0 < f32(backoff_factor) < 1.0:
    raise ValueError(f"backoff_factor must be in (0, 1); got {backoff_factor}.")
  if (isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer))
      or not 1 <= growth_interval < 2**31):
    raise ValueError(f"growth_interval must be an integer >= 1; got {growth_interval!r}.")


def seed_from_key(key) -> int:
  """``None`` -> 0, an int -> ``key mod 2**32``: the seed ``optax_half`` derives."""
  if key is None:
    return 0
  if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
    raise TypeError(f"key must be None or an integer seed; got {type(key).__name__}.")
  return int(key) % 2**32


def check_param(p: torch.Tensor, position: int) -> None:
  if not isinstance(p, torch.Tensor):
    raise TypeError(f"param {position} is a {type(p).__name__}, not a tensor.")
  if not p.is_floating_point():
    raise ValueError(
        f"param {position} has dtype {p.dtype}: only floating-point params can be "
        "optimized (keep integer buffers out of the optimizer).")


def check_no_float64(p: torch.Tensor, position: int, name: str) -> None:
  """The check of ``optax_half._util.check_no_float64``, same message."""
  if p.dtype == torch.float64:
    raise ValueError(
        f"{name}: param {position} is float64, but the math here is fp32 and would "
        "silently drop the extra precision. Cast the params to float32 (or bf16/fp16), "
        "or use a torch.optim optimizer for float64.")


def check_grad(grad: torch.Tensor, position: int) -> None:
  if grad.is_sparse:
    raise RuntimeError(
        f"param {position} has a sparse gradient; torch_bridge optimizers need dense "
        "gradients (use torch.optim.SparseAdam for sparse embeddings).")


def step_grad(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
  """The gradient a step of ``optimizer`` uses for ``p``.

  ``torch_bridge`` optimizers keep a dict ``_unscaled_grads`` that a
  ``DynamicLossScaler.unscale_`` fills with the fp32 unscaled gradients of
  16-bit params (``p.grad`` keeps the scaled 16-bit value); otherwise ``p.grad``.
  """
  g = optimizer._unscaled_grads.get(p)
  return p.grad if g is None else g


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
  """What wrote a state_dict: a torch_bridge optimizer's ``_kind()`` (its class, and
  for a wrapper the wrapped optimizer's kind), or the class name of any other one."""
  kind = getattr(optimizer, "_kind", None)
  return kind() if callable(kind) else type(optimizer).__name__


def check_kind(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
  """A clear error when ``state_dict`` says another kind of optimizer saved it.

  A state dict without ``"kind"`` (saved by an older torch_bridge, or kept as
  only ``state`` and ``param_groups`` by a checkpointing tool) is checked by
  its structure alone (``prepare_load``).
  """
  mine, saved = optimizer_kind(optimizer), state_dict.get("kind")
  if saved is not None and saved != mine:
    raise ValueError(
        f"this state_dict was saved by {saved}; this optimizer is {mine}. Load it into "
        "the same kind of optimizer.")


@torch.no_grad()
def prepare_load(optimizer: torch.optim.Optimizer, state_dict: dict, template=None):
  """Checks ``state_dict`` against ``optimizer`` and returns a function that loads it.

  Each saved param state must have the keys, dtypes and shapes of the state
  the optimizer holds for that param, or, where it holds none yet (state made
  on the first step), of ``template(group, param)`` when that is not None.
  Every check runs before anything is written, so a mismatch (the first one is named)
  leaves the optimizer untouched: nothing is half-loaded. Loading copies each
  saved tensor into the optimizer's live buffer of the same dtype and shape
  (tensors shared with other objects, such as a wrapped optimizer's param
  lists, keep their identity); ``step`` counters stay on the CPU, other new
  tensors go to their param's device; a param without saved state loses the
  state it had, as in ``torch.optim``.
  """
  groups = optimizer.param_groups
  saved_groups = state_dict["param_groups"]
  if len(groups) != len(saved_groups):
    raise ValueError(
        f"state_dict has {len(saved_groups)} param groups; the optimizer has {len(groups)}.")
  for i, (g, s) in enumerate(zip(groups, saved_groups)):
    if len(g["params"]) != len(s["params"]):
      raise ValueError(
          f"param group {i}: state_dict has {len(s['params'])} params; the optimizer "
          f"has {len(g['params'])}.")
  id_map = {old: p for g, s in zip(groups, saved_groups)
            for old, p in zip(s["params"], g["params"])}
  group_of = {old: g for g, s in zip(groups, saved_groups) for old in s["params"]}
  for old, saved in state_dict["state"].items():
    if old not in id_map:
      raise ValueError(f"state_dict has state for param id {old}, which no group lists.")
    state = optimizer.state.get(id_map[old]) or {}  # .get: no empty entries on a failed load
    if not state and template is not None:
      state = template(group_of[old], id_map[old]) or {}
    if state and set(saved) != set(state):
      raise ValueError(
          f"state of param {old}: saved {sorted(saved)}, the optimizer holds {sorted(state)}.")
    for name, value in saved.items():
      current = state.get(name)
      if torch.is_tensor(value) and torch.is_tensor(current) and (
          current.dtype != value.dtype or current.shape != value.shape):
        raise ValueError(
            f"state {name!r} of param {old}: saved {value.dtype}{tuple(value.shape)}, "
            f"the optimizer holds {current.dtype}{tuple(current.shape)}.")
      if torch.is_tensor(value) and torch.is_tensor(current) and (
          _dist.layout(value) != _dist.layout(current)):
        raise ValueError(
            f"state {name!r} of param {old}: saved {_dist.layout(value)}, the optimizer "
            f"holds {_dist.layout(current)}. Load each rank's own state_dict into the "
            "same sharding (FSDP2), or a whole-tensor one into unsharded params.")

  @torch.no_grad()
  def load() -> None:
    for old, p in id_map.items():
      if old not in state_dict["state"]:
        optimizer.state.pop(p, None)
    for old, saved in state_dict["state"].items():
      p = id_map[old]
      state = optimizer.state[p]
      for name, value in saved.items():
        current = state.get(name)
        if torch.is_tensor(value) and torch.is_tensor(current):
          current.copy_(value)
        elif torch.is_tensor(value):
          device = value.device if name == "step" else p.device
          state[name] = value.to(device=device, copy=True)
        else:
          state[name] = copy.deepcopy(value)
    for g, s in zip(groups, saved_groups):
      g.update({k: copy.deepcopy(v) for k, v in s.items() if k != "params"})

  return load


def register_param_group(optimizer: torch.optim.Optimizer, param_group: dict, check) -> dict:
  """``Optimizer.add_param_group``, then ``check(group, first_position)``; a
  check that raises takes the group back out, so a refused group leaves the
  optimizer as it was. Returns the registered group."""
  first = sum(len(g["params"]) for g in optimizer.param_groups)
  torch.optim.Optimizer.add_param_group(optimizer, param_group)
  group = optimizer.param_groups[-1]
  try:
    check(group, first)
  except Exception:
    optimizer.param_groups.pop()
    raise
  return group


_NONFINITE_START = {"notfinite_count": 0, "last_finite": True, "total_notfinite": 0}


def init_skip_nonfinite(optimizer: torch.optim.Optimizer, skip_nonfinite: bool) -> None:
  """Sets up ``skip_nonfinite`` and its counters (``optax.ApplyIfFiniteState``'s
  names: ``notfinite_count`` in a row, ``last_finite``, ``total_notfinite``)."""
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be True or False; got {skip_nonfinite!r}.")
  optimizer._skip_nonfinite = skip_nonfinite
  optimizer.nonfinite = dict(_NONFINITE_START)


def load_nonfinite(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
  """The skip counters of ``state_dict``; a dict saved without them (an older
  torch_bridge) starts them afresh, as a new optimizer would."""
  optimizer.nonfinite = {**_NONFINITE_START, **state_dict.get("nonfinite", {})}


def stepping_params(optimizer: torch.optim.Optimizer) -> list:
  """``(position, param)`` of every param a step updates (a gradient, and
  ``requires_grad``), position counted over all params; a sparse gradient is
  refused (``check_grad``)."""
  out = []
  position = 0
  for group in optimizer.param_groups:
    for p in group["params"]:
      if p.grad is not None and p.requires_grad:
        check_grad(p.grad, position)
        out.append((position, p))
      position += 1
  return out


def _grads_finite(optimizer: torch.optim.Optimizer) -> bool:
  """Whether every gradient the step would use is finite: one host read.

  A sparse gradient is refused first, with the message the step itself would
  give. Sharded gradients (DTensors) are checked shard by shard and the
  answer is combined over the ranks, so every rank skips the same steps.
  """
  params = [p for _, p in stepping_params(optimizer)]
  checks = [torch.isfinite(_dist.local(step_grad(optimizer, p))).all() for p in params]
  if not checks:
    return True
  bad = ~torch.stack([c.to(checks[0].device) for c in checks]).all()
  return not bool(_dist.any_rank(bad, params))


def run_step(optimizer: torch.optim.Optimizer, closure, step_all) -> Optional[torch.Tensor]:
  """``Optimizer.step(closure)`` as every torch_bridge optimizer runs it.

  ``closure`` (optional) re-evaluates the loss with gradients enabled; then
  ``step_all()`` updates the params, unless ``skip_nonfinite`` is on and a
  gradient holds a NaN or Inf: then nothing changes (step counts included) and
  the skip is counted in ``optimizer.nonfinite``. That check reads one bool on
  the host, as ``torch.amp.GradScaler.step`` does; a loss scaler that has just
  found every gradient finite says so (``_grads_checked_finite``) and nothing
  more is read. The fp32 gradients a loss
  scaler handed over (``_unscaled_grads``) are dropped afterwards, even if the
  step raised.
  """
  loss = None
  if closure is not None:
    with torch.enable_grad():
      loss = closure()
  try:
    if getattr(optimizer, "_skip_nonfinite", False):
      finite = (optimizer.__dict__.pop("_grads_checked_finite", False)
                or _grads_finite(optimizer))
      counters = optimizer.nonfinite
      counters["last_finite"] = finite
      if not finite:
        counters["notfinite_count"] = min(counters["notfinite_count"] + 1, 2**31 - 1)
        counters["total_notfinite"] = min(counters["total_notfinite"] + 1, 2**31 - 1)
        return loss
      counters["notfinite_count"] = 0
    step_all()
  finally:
    optimizer._unscaled_grads.clear()
  return loss


def load_state_dict_exact(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
  """Loads ``state`` and ``param_groups`` into ``optimizer`` bit for bit (see ``prepare_load``)."""
  prepare_load(optimizer, state_dict)()
