"""Dynamic loss scaling: fp16 gradients without underflow, non-finite steps never applied.

No host sync, jit- and sharding-safe; spec: ``docs/algorithms.md#dynamic-loss-scaling``.
Also jmp's loss-scale objects (``DynamicLossScale``, ``StaticLossScale``, ``NoOpLossScale``,
``all_finite``, ``select_tree``) on the same arithmetic: ``import optax_half as jmp`` ports
jmp code (docs/algorithms.md#mixed-precision-policies-and-fp32-gradient-accumulation).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, NamedTuple, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_half import _in_place, _native
from optax_half_native.checks import check_loss_scale_args
from optax_half._util import find_states, if_finite, is_float, skipped, transformation, unscaled

T = TypeVar("T")

__all__ = [
    "DynamicLossScale",
    "DynamicLossScaleState",
    "LossScale",
    "NoOpLossScale",
    "NotABooleanScalar",
    "StaticLossScale",
    "all_finite",
    "select_tree",
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
    inner: any transformation. optax_half's receive the gradients unscaled in fp32; a
      plain optax one in their own dtype (``torch.amp.GradScaler.unscale_``'s), so its
      updates and state keep the param dtype (fp16 gradients can underflow there, as
      under GradScaler: keep fp16 params behind ``master_weights`` or ``adam_fp32_master``).
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
    scale, tracker = _next_scale(jnp.asarray(state.scale, jnp.float32), state.growth_tracker,
                                 finite, interval, lambda s: s * growth, lambda s: s * backoff,
                                 floor)
    return DynamicLossScaleState(
        scale=scale,
        growth_tracker=tracker,
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
      if not _widens(state.inner_state):
        # A plain optax inner takes them in their own dtype, as GradScaler.unscale_ leaves
        # them: its updates and state keep the param dtype (optax's convention).
        grads = jax.tree.map(lambda w, g: w.astype(g.dtype) if is_float(g) else w,
                             grads, updates)
        finite = _native.all_finite(grads)
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


def _widens(inner_state) -> bool:
  """Whether the inner transformation is one of optax_half's (its state holds one): they
  read gradients widened to fp32, and take them unscaled in fp32, tiny fp16 values kept."""
  def ours(x) -> bool:
    if type(x).__module__.startswith("optax_half"):
      return True
    if isinstance(x, dict):
      return any(ours(v) for v in x.values())
    if isinstance(x, (tuple, list)):
      return any(ours(v) for v in x)
    return False
  return ours(inner_state)


def _next_scale(scale, counter, finite, period, grow, shrink, floor):
  """``(scale', counter')`` after a step: ``grow(scale)`` after ``period`` finite steps in a
  row if that is finite in ``scale``'s dtype, ``max(shrink(scale), floor)`` on a non-finite
  one. The arithmetic runs in (at least) fp32; the scale keeps its dtype, the counter int32
  (docs/algorithms.md#dynamic-loss-scaling)."""
  scale = jnp.asarray(scale)
  wide = scale.astype(jnp.promote_types(scale.dtype, jnp.float32))
  tracker = jnp.asarray(counter, jnp.int32) + 1
  at_period = tracker == period
  grown = grow(wide).astype(scale.dtype)  # finite where the scale is stored, not only in fp32
  if_finite = jnp.where(at_period & jnp.isfinite(grown), grown, scale)
  if_not = jnp.maximum(shrink(wide), jnp.asarray(floor, wide.dtype)).astype(scale.dtype)
  return (jnp.where(finite, if_finite, if_not),
          jnp.where(finite & ~at_period, tracker, 0).astype(jnp.int32))


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
  found = find_states(opt_state, DynamicLossScaleState)
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


# ---------------------------------------------------------------------------
# jmp's loss-scale objects: ``import optax_half as jmp`` runs code written for jmp.
# ---------------------------------------------------------------------------


class NotABooleanScalar(TypeError, AssertionError):
  """A predicate that is not a boolean scalar (an ``AssertionError`` too, which jmp raised).

  Example:
    >>> import jax.numpy as jnp, optax_half as oh
    >>> try:
    ...   oh.select_tree(jnp.ones(2, bool), 1.0, 2.0)
    ... except oh.NotABooleanScalar as e:
    ...   print(str(e)[:54])
    select_tree: expected boolean scalar pred; got bool[2]
  """


def _bool_scalar(pred, what: str) -> jax.Array:
  pred = jnp.asarray(pred)
  if pred.shape != () or pred.dtype != jnp.bool_:
    raise NotABooleanScalar(
        f"{what}: expected boolean scalar {'pred' if what == 'select_tree' else 'grads_finite'}; "
        f"got {pred.dtype}{list(pred.shape)}. Reduce it first, e.g. with all_finite(grads).")
  return pred


def _static_number(value, name: str, kind=float):
  """``value`` as a Python number: part of the compiled program, so known at trace time."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} is static (compiled into the program) and must be a Python or NumPy number; "
        "got a traced value. Build the loss scale outside jit and pass it in.")
  value = np.asarray(value)
  if value.shape != ():
    raise ValueError(f"{name} must be a scalar; got shape {value.shape}.")
  return kind(value)


def _float_scale(value, name: str):
  """A loss scale as a float array: floating dtypes kept, anything else fp32."""
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    value = value.astype(jnp.float32)  # an int scale would break the float arithmetic
  if value.shape != ():
    raise ValueError(f"{name} must be a scalar; got shape {value.shape}.")
  return value


def _scaled(tree, scale):
  """Every leaf times ``scale``, in (at least) fp32: a scaled fp16 loss cannot overflow."""
  def one(x):
    x = jnp.asarray(x)
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    return x.astype(dtype) * jnp.asarray(scale).astype(dtype)
  return jax.tree.map(one, tree)


def _inverse(scale) -> jax.Array:
  scale = jnp.asarray(scale, jnp.float32)
  return jnp.float32(1.0) / scale


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale of 1 that does nothing (jmp's ``NoOpLossScale``): the same code runs with
  or without loss scaling.

  Example:
    >>> import jax.numpy as jnp, optax_half as jmp
    >>> loss_scale = jmp.NoOpLossScale()
    >>> grads = {"w": jnp.ones(2, jnp.float16)}
    >>> loss_scale.unscale(grads) is grads, loss_scale.loss_scale
    (True, 1)
    >>> loss_scale.adjust(jmp.all_finite(grads)) is loss_scale
    True
  """

  @property
  def loss_scale(self):
    return 1

  def scale(self, tree: T) -> T:
    """``tree`` itself."""
    return tree

  def unscale(self, tree: T) -> T:
    """``tree`` itself."""
    return tree

  def adjust(self, grads_finite) -> "NoOpLossScale":
    """``self``."""
    del grads_finite
    return self

  def tree_flatten(self):
    return (), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls()


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale (jmp's ``StaticLossScale``); a pytree without leaves (the scale is
  compiled into the program), usable as a jit argument.

  Args:
    loss_scale: a Python or NumPy number, or a concrete scalar array; kept as a NumPy
      scalar of its float dtype (fp32 for an integer).

  Example:
    >>> import jax, jax.numpy as jnp, optax_half as jmp
    >>> loss_scale = jmp.StaticLossScale(2.0**10)
    >>> print(loss_scale.scale(jnp.float16(3.0)))       # in fp32: cannot overflow
    3072.0
    >>> g = loss_scale.unscale({"w": jnp.full(2, 2048.0, jnp.float16)})["w"]
    >>> print(g.dtype, g.tolist())                       # unscaled in fp32
    float32 [2.0, 2.0]
    >>> jax.tree.leaves(loss_scale), jax.jit(lambda s: s)(loss_scale) == loss_scale
    ([], True)
  """
  loss_scale: Any

  def __post_init__(self):
    value = _static_number(self.loss_scale, "StaticLossScale's loss_scale", np.asarray)
    dtype = value.dtype if jnp.issubdtype(value.dtype, jnp.floating) else np.dtype(np.float32)
    object.__setattr__(self, "loss_scale", value.astype(dtype)[()])

  def scale(self, tree: T) -> T:
    """Every leaf times the scale, in (at least) fp32."""
    return _scaled(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Every float leaf widened exactly to fp32, times ``f32(1 / scale)``."""
    return unscaled(tree, _inverse(self.loss_scale))

  def adjust(self, grads_finite) -> "StaticLossScale":
    """``self``: a static scale never changes."""
    del grads_finite
    return self

  def tree_flatten(self):
    return (), self.loss_scale

  @classmethod
  def tree_unflatten(cls, aux, children):
    out = object.__new__(cls)
    object.__setattr__(out, "loss_scale", aux)
    return out


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  r"""A loss scale that grows while gradients stay finite and backs off when they do not
  (jmp's ``DynamicLossScale``, with ``dynamic_loss_scale``'s arithmetic).

  ``adjust(grads_finite)``: after ``period`` finite steps in a row the scale is multiplied by
  ``factor`` (kept if that is not finite in the scale's dtype); on a non-finite step it is
  divided by ``factor``, floored at ``min_loss_scale``, and the count restarts. A pytree: its
  leaves are ``loss_scale`` and ``counter``; ``period``, ``factor`` and ``min_loss_scale``
  are static (they survive ``jit``, where jmp dropped ``min_loss_scale``). The scale keeps
  its dtype (fp16 too, which broke jmp's ``lax.select``); the arithmetic runs in fp32.
  ``optax_half.dynamic_loss_scale`` does the same inside an optimizer, skipping bad steps
  (docs/algorithms.md#dynamic-loss-scaling).

  Args:
    loss_scale: the current scale, a float scalar (an integer one is taken as fp32).
    counter: int32 scalar, finite steps since the last growth or backoff.
    period: finite steps between growths.
    factor: growth factor (> 1); backoff divides by it.
    min_loss_scale: floor of the scale after a backoff (>= 0).

  Example:
    >>> import jax, jax.numpy as jnp, optax_half as jmp
    >>> loss_scale = jmp.DynamicLossScale(jnp.float32(2**15), period=2, min_loss_scale=2**14)
    >>> grads = loss_scale.unscale({"w": jnp.array([2.0**15, jnp.inf], jnp.float16)})
    >>> loss_scale = jax.jit(lambda s, f: s.adjust(f))(loss_scale, jmp.all_finite(grads))
    >>> float(loss_scale.loss_scale), loss_scale.min_loss_scale   # backed off, floor kept
    (16384.0, 16384.0)
    >>> for _ in range(2):
    ...   loss_scale = loss_scale.adjust(jnp.bool_(True))
    >>> float(loss_scale.loss_scale), int(loss_scale.counter)     # grown after period steps
    (32768.0, 0)

  References:
    google-deepmind/jmp, ``jmp.DynamicLossScale`` (the API followed here)

    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018 (loss scaling)
  """
  loss_scale: Any
  counter: Any = None
  period: int = 2000
  factor: float = 2
  min_loss_scale: float = 1.0

  def __post_init__(self):
    counter = np.zeros([], np.int32) if self.counter is None else self.counter
    object.__setattr__(self, "loss_scale", _float_scale(self.loss_scale, "loss_scale"))
    object.__setattr__(self, "counter", jnp.asarray(counter, jnp.int32))
    period = _static_number(self.period, "period", int)
    factor = _static_number(self.factor, "factor")
    floor = _static_number(self.min_loss_scale, "min_loss_scale")
    if period < 1:
      raise ValueError(f"period must be a positive number of steps; got {period}.")
    if not factor > 1:
      raise ValueError(f"factor must be > 1; got {factor}.")
    if not floor >= 0:
      raise ValueError(f"min_loss_scale must be >= 0; got {floor}.")
    # Integers stay integers (jmp's factor=2 prints as 2).
    object.__setattr__(self, "period", period)
    object.__setattr__(self, "factor", int(factor) if factor == int(factor) else factor)
    object.__setattr__(self, "min_loss_scale", floor)

  def scale(self, tree: T) -> T:
    """Every leaf times the scale, in (at least) fp32."""
    return _scaled(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Every float leaf widened exactly to fp32, times ``f32(1 / scale)``."""
    return unscaled(tree, _inverse(self.loss_scale))

  def adjust(self, grads_finite) -> "DynamicLossScale":
    """The next loss scale, given whether this step's gradients were all finite (a bool
    scalar, e.g. ``all_finite(grads)``)."""
    finite = _bool_scalar(grads_finite, "DynamicLossScale.adjust")
    factor = self.factor
    scale, counter = _next_scale(self.loss_scale, self.counter, finite, self.period,
                                 lambda s: s * factor, lambda s: s / factor,
                                 self.min_loss_scale)
    return self._with(scale, counter)

  def _with(self, loss_scale, counter) -> "DynamicLossScale":
    out = object.__new__(DynamicLossScale)  # no checks: leaves may be tracers or placeholders
    for name, value in (("loss_scale", loss_scale), ("counter", counter),
                        ("period", self.period), ("factor", self.factor),
                        ("min_loss_scale", self.min_loss_scale)):
      object.__setattr__(out, name, value)
    return out

  def tree_flatten(self):
    return (self.loss_scale, self.counter), (self.period, self.factor, self.min_loss_scale)

  @classmethod
  def tree_unflatten(cls, aux, children):
    period, factor, floor = aux
    out = object.__new__(cls)
    for name, value in zip(("loss_scale", "counter", "period", "factor", "min_loss_scale"),
                           (*children, period, factor, floor)):
      object.__setattr__(out, name, value)
    return out


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree) -> jax.Array:
  """A bool scalar: whether every element of every float leaf of ``tree`` is finite (True
  for an empty tree); the check ``dynamic_loss_scale`` makes (jmp's ``all_finite``).

  Example:
    >>> import jax.numpy as jnp, optax_half as jmp
    >>> bool(jmp.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}))
    False
    >>> bool(jmp.all_finite({"a": jnp.ones(2, jnp.float16)})), bool(jmp.all_finite(None))
    (True, True)
  """
  return _native.all_finite(tree)


def select_tree(pred, a: T, b: T) -> T:
  """``a`` where the bool scalar ``pred`` is true, else ``b``, leaf by leaf (jmp's
  ``select_tree``; e.g. keep the old params on a non-finite step). The trees must have the
  same structure, and each pair of leaves the same shape and dtype (no promotion: a select
  keeps the params' dtypes).

  Example:
    >>> import jax, jax.numpy as jnp, optax_half as jmp
    >>> new, old = {"w": jnp.zeros(2, jnp.float16)}, {"w": jnp.ones(2, jnp.float16)}
    >>> out = jax.jit(jmp.select_tree)(jnp.bool_(False), new, old)
    >>> print(out["w"].dtype, out["w"].tolist())
    float16 [1.0, 1.0]
  """
  pred = _bool_scalar(pred, "select_tree")
  a_leaves, treedef = jax.tree_util.tree_flatten_with_path(a)
  b_leaves = jax.tree.leaves(b)
  if jax.tree.structure(b) != jax.tree.structure(a):
    raise ValueError(f"select_tree: a and b differ in structure:\n  a: {jax.tree.structure(a)}"
                     f"\n  b: {jax.tree.structure(b)}")
  out = []
  for (path, x), y in zip(a_leaves, b_leaves):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.dtype != y.dtype or x.shape != y.shape:
      raise TypeError(
          f"select_tree: leaf {jax.tree_util.keystr(path) or '(root)'} is "
          f"{x.dtype}{list(x.shape)} in a and {y.dtype}{list(y.shape)} in b; a select "
          "keeps shapes and dtypes: cast one side first.")
    out.append(jax.lax.select(pred, x, y))
  return jax.tree.unflatten(jax.tree.structure(a), out)
