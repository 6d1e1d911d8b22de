"""Learning-rate schedules: adamw_bfloat16's preheat-decay and icefall's Eden, as optax's."""

from __future__ import annotations

import jax.numpy as jnp

from optax_half_native.checks import check_eden_args, check_preheat_decay_args

__all__ = ["eden", "preheat_decay_schedule"]


def preheat_decay_schedule(learning_rate: float, preheat_steps: int = 3000,
                           decay_power: float = -0.5):
  r"""``lr(count) = learning_rate * min(x, x ** decay_power)``, fp32.

  ``x = (count + 2) / preheat_steps`` (docs/algorithms.md#preheat-decay-schedule):
  linear up to the peak at ``count = preheat_steps - 2``, then ``x ** decay_power``.

  Args:
    learning_rate: peak learning rate.
    preheat_steps: length of the linear warm-up.
    decay_power: exponent of the decay (negative).

  Returns:
    An optax schedule ``count -> lr`` (fp32 scalar).

  Example:
    >>> import optax_half as oh
    >>> schedule = oh.preheat_decay_schedule(1e-3, preheat_steps=10)
    >>> [round(float(schedule(count)), 6) for count in (0, 8, 38)]  # rise, peak, decay
    [0.0002, 0.001, 0.0005]

  References:
    arogozhnikov, `adamw_bfloat16 <https://github.com/arogozhnikov/adamw_bfloat16>`_
    (the ``LR`` schedule shipped with its bf16 AdamW)
  """
  check_preheat_decay_args(preheat_steps, decay_power)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1
    # A product with the fp32 reciprocal: XLA turns `/ scalar` into it anyway.
    x = (step + 1) * (jnp.float32(1) / jnp.float32(preheat_steps))
    return jnp.float32(learning_rate) * jnp.minimum(x, x ** jnp.float32(decay_power))

  return schedule


def eden(learning_rate, lr_batches: float = 7500, lr_epochs: float = 3.5,
         warmup_batches: float = 500.0, warmup_start: float = 0.5, *, steps_per_epoch):
  r"""icefall's Eden schedule, ``count -> lr`` in fp32.

  .. math::
     \mathrm{lr} = \mathrm{lr}_0
        \left(\frac{b^2 + B^2}{B^2}\right)^{-1/4}
        \left(\frac{e^2 + E^2}{E^2}\right)^{-1/4} w,\qquad
     w = \begin{cases} s + (1 - s)\, b / W & b < W \\ 1 & b \ge W \end{cases}

  with ``b = count``, ``e = count // steps_per_epoch``; fp32 ops, the same bits as
  ``torch_bridge.eden`` (docs/algorithms.md#eden).

  Args:
    learning_rate: the base rate (icefall's ``base_lr``; Zipformer used 0.045).
    lr_batches: ``B``, the step scale of the decay.
    lr_epochs: ``E``, the epoch scale of the decay.
    warmup_batches: ``W``, the length of the linear warm-up (0: none).
    warmup_start: ``s``, the warm-up's starting factor.
    steps_per_epoch: optimizer steps per epoch (keyword, required); ``None``: ``e = 0``.

  Returns:
    An optax schedule.

  Example:

    >>> import optax_half as oh
    >>> schedule = oh.eden(0.045, lr_batches=100, lr_epochs=2, warmup_batches=10,
    ...                    steps_per_epoch=50)
    >>> [round(float(schedule(count)), 4) for count in (0, 5, 10, 100)]
    [0.0225, 0.0337, 0.0449, 0.0318]

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024 (the Eden
    schedule)

    k2-fsa, `icefall <https://github.com/k2-fsa/icefall>`_ (the ``Eden``
    scheduler this ports)
  """
  check_eden_args(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
                  steps_per_epoch)
  f = lambda v: jnp.asarray(v, jnp.float32)
  B2 = f(lr_batches) * f(lr_batches)
  E2 = f(lr_epochs) * f(lr_epochs)
  inv_B2, inv_E2 = 1 / B2, 1 / E2
  W = f(warmup_batches)
  inv_W = 1 / W if warmup_batches > 0 else f(0.0)
  s = f(warmup_start)

  def decay(x2, c2, inv_c2):
    return 1 / jnp.sqrt(jnp.sqrt((x2 + c2) * inv_c2))

  def schedule(count):
    count = jnp.asarray(count, jnp.int32)
    b = count.astype(jnp.float32)
    if steps_per_epoch is None:
      e = f(0.0)
    else:
      e = (count // steps_per_epoch).astype(jnp.float32)
    factor = decay(b * b, B2, inv_B2) * decay(e * e, E2, inv_E2)
    warmup = jnp.where(b >= W, f(1.0), s + (1 - s) * (b * inv_W))
    return (f(learning_rate) * factor) * warmup

  return schedule
