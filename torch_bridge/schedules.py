"""Learning-rate schedules: ``optax_half/schedules.py`` in torch."""

from __future__ import annotations

import torch

__all__ = ["preheat_decay_schedule", "PreheatDecaySchedule"]


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
