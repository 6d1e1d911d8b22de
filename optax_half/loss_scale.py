"""Dynamic loss scaling: fp16 gradients without underflow, non-finite steps never applied.

No host sync, jit- and sharding-safe; spec: ``docs/algorithms.md#dynamic-loss-scaling``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_half import _in_place, _native
from optax_half_native.checks import check_loss_scale_args
from optax_half._util import if_finite, is_float, skipped, transformation, unscaled

__all__ = [
    "DynamicLossScaleState",
    "dynamic_loss_scale",
    "loss_scale",
    "scale_loss",
    "value_and_scaled_grad",
]


class DynamicLossScaleState(NamedTuple):
  """State of ``dynamic_loss_scale``; the first four fields are for logging.

  Attributes:
    scale: fp32 scalar, the current loss scale.
    growth_tracker: int32 scalar, finite steps since the last growth or backoff.
    skipped_steps: int32 scalar, total steps skipped for non-finite gradients.
    last_finite: bool scalar, whether the last step's gradients were finite.
    inner_state: the inner transformation's state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> params = {"w": jnp.ones(2, jnp.float16)}
    >>> state = oh.dynamic_loss_scale(optax.sgd(0.1)).init(params)
    >>> print(float(state.scale), state.scale.dtype, int(state.skipped_steps),
    ...       bool(state.last_finite))
    65536.0 float32 0 True
  """
  scale: jax.Array
  growth_tracker: jax.Array
  skipped_steps: jax.Array
  last_finite: jax.Array
  inner_state: Any


def _refuse_inside_multisteps() -> None:
  """Raises when ``optax.MultiSteps.init`` is on the call stack: one overflow would
  leave its accumulator NaN for good (docs/algorithms.md#dynamic-loss-scaling)."""
  multisteps_init = optax.MultiSteps.init.__code__
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code is multisteps_init:
      raise ValueError(
          "dynamic_loss_scale inside optax.MultiSteps: one overflowing micro-batch "
          "would leave MultiSteps' accumulator NaN for good (it resets it as "
          "(1 - emit) * acc, and 0 * inf is NaN), so every later window would be "
          "skipped. Put MultiSteps inside the scaler instead: "
          "dynamic_loss_scale(optax.MultiSteps(inner, k, accumulator_dtype=jnp.float32)); "
          "each micro-batch is then unscaled and checked on its own, and a bad one "
          "is dropped alone (docs/algorithms.md#dynamic-loss-scaling).")
    frame = frame.f_back


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  r"""Unscales fp32-upcast gradients, skips non-finite steps, adapts the scale.

  With :math:`s` the scale, per step and per gradient leaf :math:`\hat g`
  (the gradient of :math:`s \cdot \text{loss}`):

  .. math::
    g = \text{f32}(\hat g) \cdot \text{f32}(1 / s), \qquad
    \text{finite} = \bigwedge_{\text{leaves}} \text{all}(\text{isfinite}(g))

  ``inner`` steps only when ``finite`` (else updates ``-0.0``, inner state kept); the
  scale then follows ``torch.amp.GradScaler``, floored at ``min_scale``. Put clipping and
  ``optax.MultiSteps`` inside (docs/algorithms.md#dynamic-loss-scaling).

  Args:
    inner: any transformation; it receives fp32 gradients.
    init_scale: the first scale.
    growth_factor: factor (> 1) applied after ``growth_interval`` finite steps.
    backoff_factor: factor in (0, 1) applied on a non-finite step.
    growth_interval: number of consecutive finite steps between growths.
    min_scale: floor of the scale (> 0); ``torch.amp.GradScaler`` has none.

  Returns:
    A ``GradientTransformationExtraArgs`` with ``DynamicLossScaleState``.

  Example:

    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0, growth_interval=2)
    >>> params = {"w": jnp.ones(2, jnp.float16)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([512.0, jnp.inf], jnp.float16)}  # overflowed
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"].tolist(), float(state.scale)
    ([1.0, 1.0], 512.0)
    >>> grads = {"w": jnp.array([256.0, 512.0], jnp.float16)}  # 0.5 and 1.0, unscaled
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"].tolist()
    [0.9501953125, 0.89990234375]
    >>> updates, state = tx.update(grads, state, params)
    >>> float(state.scale), int(state.skipped_steps)
    (1024.0, 1)

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018 (loss scaling)

    PyTorch, `torch.amp.GradScaler <https://pytorch.org/docs/stable/amp.html>`_
    (the dynamic scale update followed here)
  """
  check_loss_scale_args(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
  inner = optax.with_extra_args_support(inner)
  f32 = np.float32
  growth = f32(growth_factor)
  backoff = f32(backoff_factor)
  floor = f32(min_scale)
  interval = np.int32(growth_interval)

  def init_fn(params):
    _refuse_inside_multisteps()
    return DynamicLossScaleState(
        scale=jnp.asarray(init_scale, jnp.float32),
        growth_tracker=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
        last_finite=jnp.ones((), jnp.bool_),
        inner_state=inner.init(params))

  def inverse(state):
    return jnp.float32(1.0) / jnp.asarray(state.scale, jnp.float32)

  def next_state(state, finite, new_inner):
    scale = jnp.asarray(state.scale, jnp.float32)
    tracker = state.growth_tracker + 1
    at_interval = tracker == interval
    grown = scale * growth
    scale_if_finite = jnp.where(at_interval & jnp.isfinite(grown), grown, scale)
    scale_if_not = jnp.maximum(scale * backoff, floor)
    return DynamicLossScaleState(
        scale=jnp.where(finite, scale_if_finite, scale_if_not),
        growth_tracker=jnp.where(finite & ~at_interval, tracker, 0).astype(jnp.int32),
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        last_finite=finite,
        inner_state=new_inner)

  inner_step = _in_place.step_of(inner)
  # The native kernel's step unscales as it reads: no fp32 unscaled copy.
  scaled = _in_place.scaled_of(inner)

  def step(in_place, updates, state, params, extra_args):
    inv_scale = inverse(state)
    finite = _native.all_finite(updates, inv_scale)
    if scaled is not None:
      def apply():
        return scaled(in_place, updates, inv_scale, state.inner_state, params, **extra_args)
    else:
      grads = unscaled(updates, inv_scale)
      run = inner_step if in_place else inner.update

      def apply():
        return run(grads, state.inner_state, params, **extra_args)

    # lax.cond on CPU, a select elsewhere: docs/algorithms.md#dynamic-loss-scaling.
    branch_on_cpu = not _native._maybe_sharded(updates)
    first, new_inner = if_finite(finite, apply,
                                 lambda: skipped(apply, state.inner_state,
                                                 params if in_place else None),
                                 elsewhere="select", branch_on_cpu=branch_on_cpu)
    return first, next_state(state, finite, new_inner)

  def update_fn(updates, state, params=None, **extra_args):
    return step(False, updates, state, params, extra_args)

  tx = transformation(init_fn, update_fn)
  if inner_step is None:
    return tx

  def update_and_apply_fn(updates, state, params, **extra_args):
    return step(True, updates, state, params, extra_args)

  return _in_place.register(tx, update_and_apply_fn)


def _value(x):
  """The array inside an ``nnx`` variable (``nnx.Optimizer`` states), or ``x``."""
  get_value = getattr(x, "get_value", None)
  return get_value() if callable(get_value) else x


def find_loss_scale_state(opt_state) -> DynamicLossScaleState:
  """The one ``DynamicLossScaleState`` in ``opt_state`` (any nesting); else ``ValueError``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = optax.chain(optax.identity(), oh.dynamic_loss_scale(optax.sgd(0.1)))
    >>> state = tx.init({"w": jnp.ones(2, jnp.float16)})
    >>> int(oh.find_loss_scale_state(state).growth_tracker)
    0
  """
  def is_ours(x):
    return isinstance(x, DynamicLossScaleState)
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_ours) if is_ours(s)]
  if not found:
    raise ValueError(
        "opt_state holds no DynamicLossScaleState: build the optimizer as "
        "optax_half.dynamic_loss_scale(tx) to scale the loss.")
  if len(found) > 1:
    raise ValueError(
        f"opt_state holds {len(found)} DynamicLossScaleStates; pass the one you mean "
        "(e.g. the state of that part of the optimizer).")
  return found[0]


def loss_scale(opt_state) -> jax.Array:
  """The current loss scale (fp32 scalar) found anywhere in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> scale = oh.loss_scale(tx.init({"w": jnp.ones(2, jnp.float16)}))
    >>> print(float(scale), scale.dtype)
    1024.0 float32
  """
  return jnp.asarray(_value(find_loss_scale_state(opt_state).scale), jnp.float32)


def scale_loss(loss, opt_state) -> jax.Array:
  """``loss * scale`` in (at least) fp32, so an fp16 loss cannot overflow.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> state = tx.init({"w": jnp.ones(2, jnp.float16)})
    >>> scaled = oh.scale_loss(jnp.float16(3.0), state)
    >>> print(float(scaled), scaled.dtype)
    3072.0 float32
  """
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss must be a float array; got {loss.dtype}.")
  loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
  return loss * loss_scale(opt_state).astype(loss.dtype)


def value_and_scaled_grad(fun: Callable, argnums=0, has_aux: bool = False) -> Callable:
  """``jax.value_and_grad`` for loss scaling.

  Returns ``f(opt_state, *args, **kwargs) -> (value, grads)``: ``fun``'s unscaled value
  (``(loss, aux)`` with ``has_aux``), and ``scale * loss``'s gradients w.r.t. ``args[argnums]``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> params = {"w": jnp.ones(2, jnp.float16)}
    >>> state = tx.init(params)
    >>> def loss_fn(params, x):
    ...   return jnp.sum(params["w"] * x)
    >>> x = jnp.array([1.0, 2.0], jnp.float16)
    >>> loss, grads = oh.value_and_scaled_grad(loss_fn)(state, params, x)
    >>> float(loss), grads["w"].tolist()  # the loss unscaled, the grads scaled
    (3.0, [1024.0, 2048.0])
    >>> updates, state = tx.update(grads, state, params)  # unscaled: -0.1 * x
    >>> optax.apply_updates(params, updates)["w"].tolist()
    [0.89990234375, 0.7998046875]
  """
  def scaled(opt_state, *args, **kwargs):
    out = fun(*args, **kwargs)
    loss = out[0] if has_aux else out
    return scale_loss(loss, opt_state), out

  def value_and_grad_fn(opt_state, *args, **kwargs):
    # argnums index ``args``; opt_state is argument 0 of ``scaled``.
    n = len(args)
    def shift(a):
      if not -n <= a < n:
        raise ValueError(f"argnums {a} is out of range for {n} positional arguments.")
      return a % n + 1
    shifted = shift(argnums) if isinstance(argnums, int) else tuple(map(shift, argnums))
    grads, value = jax.grad(scaled, argnums=shifted, has_aux=True)(opt_state, *args, **kwargs)
    return value, grads

  return value_and_grad_fn
