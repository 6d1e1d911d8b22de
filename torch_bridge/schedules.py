"""Learning-rate schedules: ``optax_half/schedules.py`` in torch."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["eden", "preheat_decay_schedule", "Eden", "EdenLR", "PreheatDecaySchedule"]


class PreheatDecaySchedule:
  """``count -> learning_rate * min(x, x ** decay_power)``, fp32, picklable.

  ``x = (count + 2) / preheat_steps``, as in ``optax_half``. Pass it as the
  ``learning_rate`` of a torch_bridge optimizer, or with
  ``learning_rate=1.0`` as the factor of ``torch.optim.lr_scheduler.LambdaLR``
  (LambdaLR evaluates it at the number of scheduler steps taken, the same
  pre-increment count).
  """

  def __init__(self, learning_rate: float, preheat_steps: int, decay_power: float):
    self.learning_rate = learning_rate
    self.preheat_steps = preheat_steps
    self.decay_power = decay_power

  def __call__(self, count) -> float:
    f = lambda v: torch.tensor(v, dtype=torch.float32)
    step = f(float(count)) + 1
    x = (step + 1) * (f(1.0) / f(float(self.preheat_steps)))  # as optax_half
    return float(f(self.learning_rate) * torch.minimum(x, x ** f(self.decay_power)))

  def __repr__(self):
    return (f"PreheatDecaySchedule(learning_rate={self.learning_rate}, "
            f"preheat_steps={self.preheat_steps}, decay_power={self.decay_power})")


def preheat_decay_schedule(learning_rate: float, preheat_steps: int = 3000,
                           decay_power: float = -0.5) -> PreheatDecaySchedule:
  """The adamw_bfloat16 schedule: linear preheat, then ``x ** decay_power``.

  See ``optax_half.preheat_decay_schedule``; values agree to fp32 (``pow`` may
  differ by one ULP between XLA and torch).
  """
  if preheat_steps <= 0:
    raise ValueError(f"preheat_steps must be > 0; got {preheat_steps}.")
  if decay_power >= 0:
    raise ValueError(f"decay_power must be < 0 for a decay; got {decay_power}.")
  return PreheatDecaySchedule(learning_rate, preheat_steps, decay_power)


def check_eden_args(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
                    steps_per_epoch) -> None:
  """The checks of ``optax_half.schedules.check_eden_args``, same messages."""
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


class Eden:
  """icefall's Eden schedule ``count -> lr`` (fp32 value as a float), picklable.

  The same fp32 operations as ``optax_half.eden``, on the host in numpy fp32:
  ``lr * ((b^2 + B^2) / B^2) ** -0.25 * ((e^2 + E^2) / E^2) ** -0.25 * w``
  with ``b = count``, ``e = count // steps_per_epoch``. Use it as the
  ``learning_rate`` of a torch_bridge optimizer, or through ``EdenLR`` as a
  ``torch.optim.lr_scheduler``.
  """

  def __init__(self, learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
               steps_per_epoch):
    self.learning_rate = learning_rate
    self.lr_batches = lr_batches
    self.lr_epochs = lr_epochs
    self.warmup_batches = warmup_batches
    self.warmup_start = warmup_start
    self.steps_per_epoch = steps_per_epoch

  def __call__(self, count) -> float:
    f = np.float32
    count = int(count)
    B2 = f(self.lr_batches) * f(self.lr_batches)
    E2 = f(self.lr_epochs) * f(self.lr_epochs)
    W = f(self.warmup_batches)
    inv_W = f(1) / W if self.warmup_batches > 0 else f(0)
    s = f(self.warmup_start)
    b = f(count)
    e = f(0) if self.steps_per_epoch is None else f(count // self.steps_per_epoch)

    def decay(x2, c2):
      return f(1) / np.sqrt(np.sqrt((x2 + c2) * (f(1) / c2)))

    factor = decay(b * b, B2) * decay(e * e, E2)
    warmup = f(1) if b >= W else s + (f(1) - s) * (b * inv_W)
    return float((f(self.learning_rate) * factor) * warmup)

  def __repr__(self):
    return (f"Eden(learning_rate={self.learning_rate}, lr_batches={self.lr_batches}, "
            f"lr_epochs={self.lr_epochs}, warmup_batches={self.warmup_batches}, "
            f"warmup_start={self.warmup_start}, steps_per_epoch={self.steps_per_epoch})")


def eden(learning_rate, lr_batches: float = 7500, lr_epochs: float = 3.5,
         warmup_batches: float = 500.0, warmup_start: float = 0.5, *, steps_per_epoch) -> Eden:
  """icefall's Eden schedule; see ``optax_half.eden`` (the same fp32 values, bit for bit)."""
  check_eden_args(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
                  steps_per_epoch)
  return Eden(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
              steps_per_epoch)


class EdenLR(torch.optim.lr_scheduler.LRScheduler):
  """Eden as a ``torch.optim.lr_scheduler``: call ``step()`` after every optimizer step.

  Each group's ``lr`` becomes ``eden(base_lr, ...)(n)`` after ``n`` scheduler
  steps (``base_lr``: the group's initial lr), the value ``optax_half.eden``
  gives at ``count = n``.
  """

  def __init__(self, optimizer, lr_batches: float = 7500, lr_epochs: float = 3.5,
               warmup_batches: float = 500.0, warmup_start: float = 0.5, *, steps_per_epoch,
               last_epoch: int = -1):
    check_eden_args(0.0, lr_batches, lr_epochs, warmup_batches, warmup_start, steps_per_epoch)
    self._eden_args = (lr_batches, lr_epochs, warmup_batches, warmup_start, steps_per_epoch)
    super().__init__(optimizer, last_epoch)

  def get_lr(self):
    count = max(self.last_epoch, 0)
    return [Eden(base, *self._eden_args)(count) for base in self.base_lrs]
