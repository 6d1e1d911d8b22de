"""Learning-rate schedules.

``preheat_decay_schedule`` is the built-in schedule of arogozhnikov's
adamw_bfloat16 (its ``LR`` class): a linear "preheat" followed by a power-law
decay, written as an optax schedule.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["preheat_decay_schedule"]


def preheat_decay_schedule(learning_rate: float, preheat_steps: int = 3000,
                           decay_power: float = -0.5):
  r"""``lr(count) = learning_rate * min(x, x ** decay_power)``, fp32.

  ``x = (step + 1) / preheat_steps`` with ``step = count + 1``: the reference
  increments its step counter before evaluating the schedule, so the first
  update (optax ``count == 0``) uses ``x = 2 / preheat_steps``. The peak,
  ``learning_rate``, is reached at ``count = preheat_steps - 2``; afterwards
  the rate decays as ``x ** decay_power``.

  Args:
    learning_rate: peak learning rate.
    preheat_steps: length of the linear warm-up.
    decay_power: exponent of the decay (negative).

  Returns:
    An optax schedule ``count -> lr`` (fp32 scalar).
  """
  if preheat_steps <= 0:
    raise ValueError(f"preheat_steps must be > 0; got {preheat_steps}.")
  if decay_power >= 0:
    raise ValueError(f"decay_power must be < 0 for a decay; got {decay_power}.")

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1
    # A product with the fp32 reciprocal: XLA turns `/ scalar` into it anyway.
    x = (step + 1) * (jnp.float32(1) / jnp.float32(preheat_steps))
    return jnp.float32(learning_rate) * jnp.minimum(x, x ** jnp.float32(decay_power))

  return schedule
