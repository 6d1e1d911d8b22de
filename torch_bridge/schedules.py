"""Learning-rate schedules: ``optax_half/schedules.py`` in torch."""

from __future__ import annotations

import numpy as np
import torch

from optax_half_native.checks import check_eden_args, check_preheat_decay_args

__all__ = ["eden", "preheat_decay_schedule", "Eden", "EdenLR", "PreheatDecaySchedule"]


class PreheatDecaySchedule:
  """``count -> learning_rate * min(x, x ** decay_power)``, fp32, picklable.

  ``x = (count + 2) / preheat_steps``, as in ``optax_half``. Pass it as the
  ``learning_rate`` of a torch_bridge optimizer, or with
  ``learning_rate=1.0`` as the factor of ``torch.optim.lr_scheduler.LambdaLR``
  (LambdaLR evaluates it at the number of scheduler steps taken, the same
  pre-increment count).

  Example:
    >>> import torch, torch_bridge as tb
    >>> schedule = tb.PreheatDecaySchedule(1.0, preheat_steps=4, decay_power=-0.5)
    >>> [round(schedule(c), 4) for c in range(6)]  # x = (c + 2) / 4; x, then x ** -0.5
    [0.5, 0.75, 1.0, 0.8944, 0.8165, 0.7559]
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1e-3)
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    >>> opt.param_groups[0]["lr"]  # 1e-3 * schedule(0)
    0.0005

  References:
    arogozhnikov/adamw_bfloat16 (`github.com/arogozhnikov/adamw_bfloat16
    <https://github.com/arogozhnikov/adamw_bfloat16>`_): the schedule this ports.
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

  .. code-block:: text

     x  = (count + 2) / preheat_steps
     lr = learning_rate * min(x, x ** decay_power)

  The lr grows linearly to ``learning_rate`` at ``count = preheat_steps - 2``
  and then decays as ``x ** decay_power`` (1/sqrt by default).

  Args:
    learning_rate: the peak learning rate.
    preheat_steps: the length of the linear warm-up (> 0).
    decay_power: the exponent of the decay (< 0).

  Returns:
    A ``PreheatDecaySchedule``: ``count -> lr`` (an fp32 value as a float), to
    pass as the ``learning_rate`` of a torch_bridge optimizer.

  Example:
    >>> import torch, torch_bridge as tb
    >>> schedule = tb.preheat_decay_schedule(1e-3, preheat_steps=100)
    >>> schedule(98), schedule(398)  # the peak, then 1 / sqrt(4) of it
    (0.0010000000474974513, 0.0005000000237487257)
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.adamw_bf16([p], learning_rate=schedule)

  References:
    arogozhnikov/adamw_bfloat16 (`github.com/arogozhnikov/adamw_bfloat16
    <https://github.com/arogozhnikov/adamw_bfloat16>`_): the schedule and the
    bf16 AdamW it was written for.
  """
  check_preheat_decay_args(preheat_steps, decay_power)
  return PreheatDecaySchedule(learning_rate, preheat_steps, decay_power)


class Eden:
  """icefall's Eden schedule ``count -> lr`` (fp32 value as a float), picklable.

  The same fp32 operations as ``optax_half.eden``, on the host in numpy fp32:
  ``lr * ((b^2 + B^2) / B^2) ** -0.25 * ((e^2 + E^2) / E^2) ** -0.25 * w``
  with ``b = count``, ``e = count // steps_per_epoch``. Use it as the
  ``learning_rate`` of a torch_bridge optimizer, or through ``EdenLR`` as a
  ``torch.optim.lr_scheduler``. ``w``: the linear warm-up from
  ``warmup_start`` to 1 over ``warmup_batches``; 1 afterwards.

  Example:
    >>> import torch_bridge as tb
    >>> schedule = tb.Eden(0.05, lr_batches=100, lr_epochs=2, warmup_batches=10,
    ...                    warmup_start=0.5, steps_per_epoch=50)
    >>> schedule(0)  # the warm-up starts at half the lr
    0.02500000037252903
    >>> schedule(100)  # b = B and e = E: each factor is 2 ** -0.25
    0.0353553406894207

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024;
    `k2-fsa/icefall <https://github.com/k2-fsa/icefall>`_'s ``Eden`` (``optim.py``).
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
  """icefall's Eden schedule; see ``optax_half.eden`` (the same fp32 values, bit for bit).

  .. code-block:: text

     b = count, e = count // steps_per_epoch   (e = 0 if steps_per_epoch is None)
     lr = learning_rate * ((b^2 + lr_batches^2) / lr_batches^2) ** -0.25
                        * ((e^2 + lr_epochs^2) / lr_epochs^2) ** -0.25 * warmup(b)

  with ``warmup(b)`` rising linearly from ``warmup_start`` to 1 over
  ``warmup_batches`` steps. The schedule for ``scaled_adam``.

  Args:
    learning_rate: the base learning rate.
    lr_batches, lr_epochs: the step count and epoch at which each decay
      factor reaches ``2 ** -0.25``.
    warmup_batches, warmup_start: the warm-up's length and initial factor.
    steps_per_epoch: optimizer steps per epoch (a positive integer), or None
      to leave the epoch factor out.

  Returns:
    An ``Eden``: ``count -> lr`` (an fp32 value as a float).

  Example:
    >>> import torch, torch_bridge as tb
    >>> schedule = tb.eden(0.045, steps_per_epoch=1000)  # icefall's other defaults
    >>> schedule(0), schedule(500)  # half the lr, then the end of the warm-up
    (0.02250000089406967, 0.04495014250278473)
    >>> opt = tb.scaled_adam([torch.nn.Parameter(torch.ones(4, 4))], learning_rate=schedule)

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024;
    `k2-fsa/icefall <https://github.com/k2-fsa/icefall>`_'s ``Eden`` (``optim.py``).
  """
  check_eden_args(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
                  steps_per_epoch)
  return Eden(learning_rate, lr_batches, lr_epochs, warmup_batches, warmup_start,
              steps_per_epoch)


class EdenLR(torch.optim.lr_scheduler.LRScheduler):
  """Eden as a ``torch.optim.lr_scheduler``: call ``step()`` after every optimizer step.

  Each group's ``lr`` becomes ``eden(base_lr, ...)(n)`` after ``n`` scheduler
  steps (``base_lr``: the group's initial lr), the value ``optax_half.eden``
  gives at ``count = n``.

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([p], lr=0.05)
    >>> scheduler = tb.EdenLR(opt, lr_batches=100, lr_epochs=2, warmup_batches=10,
    ...                       steps_per_epoch=50)
    >>> opt.param_groups[0]["lr"]  # warm-up: half the base lr
    0.02500000037252903
    >>> for _ in range(10):
    ...   p.grad = torch.ones_like(p)
    ...   opt.step()
    ...   scheduler.step()
    >>> opt.param_groups[0]["lr"] == tb.eden(0.05, 100, 2, 10, steps_per_epoch=50)(10)
    True

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024;
    `k2-fsa/icefall <https://github.com/k2-fsa/icefall>`_'s ``Eden`` (``optim.py``).
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
