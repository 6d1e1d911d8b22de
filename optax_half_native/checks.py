"""Argument checks and constants both frameworks share, written once.

``optax_half`` and ``torch_bridge`` call these with the same arguments, so a
bad hyperparameter gets the same message in either. Only Python numbers are
checked: arrays and schedules (whose values may be traced) pass through, and
each framework checks what only it can see (16-bit JAX arrays, tensors).
Nothing here imports JAX or torch.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["STATE_ROUNDINGS", "QUARTILES", "f32", "check_adamw_args", "check_state_rounding",
           "check_loss_scale_args", "check_scaled_adam_args", "check_eden_args",
           "check_preheat_decay_args", "float64_message", "quartile_indices"]

# The ways 16-bit moments are written (``state_rounding=``).
STATE_ROUNDINGS = ("stochastic", "nearest")
# ScaledAdam's reported gradient-norm quartiles: min, 25%, median, 75%, max.
QUARTILES = 5


def f32(x) -> float:
  """``x`` rounded to fp32, as a Python float (too large: inf)."""
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_adamw_args(learning_rate, b1, b2, eps, weight_decay) -> None:
  """AdamW's hyperparameters (``adamw_bf16``, ``adam_fp32_master``, ``scale_by_adamw``)."""
  def concrete(v):  # a bool is a number here: b1=True is refused
    return isinstance(v, (int, float))
  if concrete(learning_rate) and learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0; got {learning_rate}.")
  for name, v in (("b1", b1), ("b2", b2)):
    if concrete(v) and not 0.0 <= v < 1.0:
      raise ValueError(f"{name} must be in [0, 1); got {v}.")
  if concrete(eps) and eps <= 0:
    raise ValueError(f"eps must be > 0; got {eps}.")
  if concrete(weight_decay) and weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0; got {weight_decay}.")


def check_state_rounding(state_rounding: str) -> None:
  if state_rounding not in STATE_ROUNDINGS:
    raise ValueError(
        f"state_rounding must be one of {STATE_ROUNDINGS}; got {state_rounding!r}.")


def check_loss_scale_args(init_scale, growth_factor, backoff_factor, growth_interval,
                          min_scale) -> None:
  """The dynamic loss scaler's (``dynamic_loss_scale``), in fp32 as it uses them."""
  for name, v in (("init_scale", init_scale), ("min_scale", min_scale),
                  ("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
    if not _number(v):
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


def check_scaled_adam_args(learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps,
                           param_min_rms, param_max_rms, scalar_max, size_update_period,
                           clipping_update_period, static_hint: str) -> None:
  """ScaledAdam's; ``static_hint`` ends a message about a hyperparameter that
  must be a Python number (how to pass one in that framework)."""
  if _number(learning_rate) and learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0; got {learning_rate}.")
  if clipping_scale is not None and not (_number(clipping_scale) and clipping_scale > 0):
    raise ValueError(f"clipping_scale must be None (no clipping) or > 0; got {clipping_scale!r}"
                     + static_hint)
  for name, v in (("b1", b1), ("b2", b2)):
    if not (_number(v) and 0.0 <= v < 1.0):
      raise ValueError(f"{name} must be a Python number in [0, 1); got {v!r}" + static_hint)
  for name, v in (("scalar_lr_scale", scalar_lr_scale), ("eps", eps),
                  ("param_min_rms", param_min_rms), ("param_max_rms", param_max_rms),
                  ("scalar_max", scalar_max)):
    if not (_number(v) and v > 0):
      raise ValueError(f"{name} must be a Python number > 0; got {v!r}" + static_hint)
  if param_min_rms > param_max_rms:
    raise ValueError(
        f"param_min_rms ({param_min_rms}) must be <= param_max_rms ({param_max_rms}).")
  for name, v in (("size_update_period", size_update_period),
                  ("clipping_update_period", clipping_update_period)):
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 2**31:
      raise ValueError(f"{name} must be an integer >= 1; got {v!r}" + static_hint)


def quartile_indices(period: int) -> list[int]:
  """Indices into ScaledAdam's sorted norms that the seed reports: ``min(P-1, (P//4) n)``."""
  return [min(period - 1, (period // 4) * n) for n in range(QUARTILES)]


def check_eden_args(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
                    steps_per_epoch) -> None:
  """The Eden schedule's (``eden``)."""
  if isinstance(learning_rate, (int, float)) and learning_rate < 0:
    raise ValueError(f"learning_rate must be >= 0; got {learning_rate}.")
  for name, v in (("lr_batches", lr_batches), ("lr_epochs", lr_epochs)):
    if not v > 0:
      raise ValueError(f"{name} must be > 0; got {v}.")
  if warmup_batches < 0:
    raise ValueError(f"warmup_batches must be >= 0; got {warmup_batches}.")
  if not 0 <= warmup_start <= 1:
    raise ValueError(f"warmup_start must be in [0, 1]; got {warmup_start}.")
  if steps_per_epoch is not None and (
      isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
      or steps_per_epoch < 1):
    raise ValueError(
        "steps_per_epoch must be a positive integer (the epoch is count // steps_per_epoch), "
        f"or None to leave the epoch factor out; got {steps_per_epoch!r}.")


def check_preheat_decay_args(preheat_steps, decay_power) -> None:
  """``preheat_decay_schedule``'s."""
  if preheat_steps <= 0:
    raise ValueError(f"preheat_steps must be > 0; got {preheat_steps}.")
  if decay_power >= 0:
    raise ValueError(f"decay_power must be < 0 for a decay; got {decay_power}.")


def float64_message(name: str, where: str, instead: str) -> str:
  """The refusal of a float64 param (``where``: which one) by an fp32
  optimizer; ``instead``: the framework's own optimizers."""
  return (f"{name}: {where} is float64, but the math here is fp32 and would silently drop "
          "the extra precision. Cast the params to float32 (or bf16/fp16), or use "
          f"{instead} for float64.")
