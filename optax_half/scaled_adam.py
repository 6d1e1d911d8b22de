"""ScaledAdam (icefall, Daniel Povey 2022) as an optax transformation; spec:
``docs/algorithms.md#scaledadam-and-eden``. ``torch_bridge/scaled_adam.py`` names its steps alike.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from optax import MaskedNode

from optax_half_native.checks import QUARTILES, check_scaled_adam_args, quartile_indices
from optax_half import _in_place, _native, rounding
from optax_half._util import (check_no_float64, check_state_fits, check_trees, find_states,
                              is_float, maybe_skip_nonfinite, transformation,
                              zeros_like_param)

__all__ = ["scaled_adam", "scaled_adam_stats", "ScaledAdamState", "ScaledAdamClippingState"]

logger = logging.getLogger(__name__)



class ScaledAdamClippingState(NamedTuple):
  """The gradient-clipping statistics of ``scaled_adam`` (one set per tree).

  Attributes:
    model_norms: fp32 ``(P,)``, ``P = clipping_update_period``: step ``t``'s norm in slot ``t % P``.
    model_norm_threshold: fp32, ``clipping_scale`` x their median, every ``P`` steps; 0 at first.
    num_clipped: int32, steps clipped since the statistics were last taken.
    quartiles: fp32 ``(5,)``, the norms' min, 25%, 50%, 75%, max at the last multiple of ``P``.
    percent_clipped: fp32, the percentage of the ``P`` steps before that which were clipped.
    clipping_factor: fp32, the factor (<= 1) of the last step's gradients.
    grad_norm: fp32, the last step's weighted gradient norm.
    dominant_index: int32, the float leaf (flatten order) with the largest squared-norm share.
    dominant_share: fp32, that share (in [0, 1]).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_half as oh
    >>> tx = oh.scaled_adam(clipping_scale=2.0, clipping_update_period=10)
    >>> clipping = tx.init({"w": jnp.ones((2, 3))}).clipping
    >>> print(clipping.model_norms.shape, clipping.quartiles.shape,
    ...       float(clipping.clipping_factor))
    (10,) (5,) 1.0
  """
  model_norms: jax.Array
  model_norm_threshold: jax.Array
  num_clipped: jax.Array
  quartiles: jax.Array
  percent_clipped: jax.Array
  clipping_factor: jax.Array
  grad_norm: jax.Array
  dominant_index: jax.Array
  dominant_share: jax.Array


class ScaledAdamState(NamedTuple):
  """State of ``scaled_adam``: buffers in the param dtype, second moments fp32 for fp16.

  Attributes:
    count: int32 steps taken (the seed's ``step``).
    delta: per leaf, the momentum-filtered parameter change.
    exp_avg_sq: per leaf, the second moment of the gradient.
    param_rms: per non-scalar leaf, its RMS at the last size step; ``MaskedNode()`` for scalars.
    scale_exp_avg_sq: per non-scalar leaf, the second moment of the scale gradient.
    scale_grads: per non-scalar leaf, the period's ``(size_update_period,)`` ``sum(p * g)``.
    clipping: the ``ScaledAdamClippingState``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_half as oh
    >>> params = {"w": jnp.full((2, 3), 0.5, jnp.float16), "s": jnp.float16(1.0)}
    >>> state = oh.scaled_adam().init(params)
    >>> print(state.delta["w"].dtype, state.exp_avg_sq["w"].dtype)  # fp32 for fp16 params
    float16 float32
    >>> float(state.param_rms["w"]), state.scale_grads["w"].shape, state.param_rms["s"]
    (0.5, (4,), MaskedNode())
  """
  count: jax.Array
  delta: Any
  exp_avg_sq: Any
  param_rms: Any
  scale_exp_avg_sq: Any
  scale_grads: Any
  clipping: ScaledAdamClippingState


class ScaledAdamTransformation(_in_place.InPlaceTransformation):
  """``scaled_adam`` with ``update_and_apply`` and ``kahan_update``, ``update``'s bits either way
  (docs/algorithms.md#the-scaledadam-kernel)."""
  kahan_update = None  # set on each instance by scaled_adam


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


_STATIC = (". (Only learning_rate may be an array or a schedule: with "
           "optax.inject_hyperparams, list the others in static_args.)")


def _second_moment_dtype(dtype):
  """fp32 for fp16 params (whose g^2 underflows), else the param dtype (the seed's)."""
  return jnp.float32 if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def _is_scalar(p) -> bool:
  """The seed's scalar path: params with at most one element (``numel() == 1``)."""
  return p.size <= 1


def leaf_names(params) -> list[str]:
  """Dotted float-leaf names in flatten order (an NNX variable's ``value``: ``"linear.kernel"``)."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if is_float(leaf):
      if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
      out.append(jax.tree_util.keystr(path, simple=True, separator="."))
  return out


class _Hyper(NamedTuple):
  """``scaled_adam``'s arguments (checked): what ``init`` and ``update`` close over."""
  learning_rate: Any
  clipping_scale: Optional[float]
  b1: float
  b2: float
  scalar_lr_scale: float
  eps: float
  param_min_rms: float
  param_max_rms: float
  scalar_max: float
  size_update_period: int
  clipping_update_period: int
  show_dominant_parameters: bool


class _Coefficients(NamedTuple):
  """The fp32 scalars of the step at count ``t`` (torch: ``ScaledAdam._coefficients``)."""
  t: jax.Array
  is_size_step: jax.Array  # t mod S == S - 1: param_rms is refreshed
  do_size_update: jax.Array  # ... and t > 0: the size update
  lr: jax.Array
  b1: jax.Array
  b2: jax.Array
  eps: jax.Array
  one_minus_b1: jax.Array
  one_minus_b2: jax.Array
  b2_corr: jax.Array  # b2 ** S
  one_minus_b2_corr: jax.Array
  size_lr: jax.Array
  bc2: jax.Array
  inv_bc2: jax.Array
  size_bc2: jax.Array


def scaled_adam(
    learning_rate=3e-2,
    clipping_scale: Optional[float] = None,
    b1: float = 0.9,
    b2: float = 0.98,
    scalar_lr_scale: float = 0.1,
    eps: float = 1e-8,
    param_min_rms: float = 1e-5,
    param_max_rms: float = 3.0,
    scalar_max: float = 10.0,
    size_update_period: int = 4,
    clipping_update_period: int = 100,
    show_dominant_parameters: bool = False,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""ScaledAdam: Adam with updates proportional to each tensor's RMS, and a learnt scale.

  At step ``t`` (0-based; ``lr = learning_rate(t)``), ``g`` the fp32 gradient times the clipping
  factor ``c_t``, for a tensor ``p`` of more than one element and ``rms = param_rms``:

  .. math::
     \delta &\leftarrow b_1 \delta \\
     s_{t \bmod S} &= \textstyle\sum p \odot g
        \quad\text{(scale gradient; } S = \text{size\_update\_period)} \\
     &\text{if } t \bmod S = S - 1:\ rms = \sqrt{\mathrm{mean}(p^2)},\
        \text{and if } t > 0: \\
     &\quad w \leftarrow b_2^S w + (1 - b_2^S)\,\mathrm{mean}(s^2),\quad
        k = (t + 1) / S \\
     &\quad \sigma = -\eta_s \sqrt{1 - b_2^{S k}}\,\textstyle\sum s / (\sqrt{w} + \epsilon)
        \quad (0 \text{ if } rms < rms_{min};\ -\eta_s S \text{ if } rms > rms_{max}) \\
     &\quad \delta \leftarrow \delta + (1 - b_1)\,(p\,\sigma) \\
     v &\leftarrow b_2 v + (1 - b_2) g^2,\quad
        \hat v = v / (1 - b_2^{t+1}) \text{ while } 1 - b_2^{t+1} < 0.99,\ \text{else } v \\
     \delta &\leftarrow \delta + (g / (\sqrt{\hat v} + \epsilon))
        \cdot (-\eta (1 - b_1) \max(rms, rms_{min})),\qquad p \leftarrow p + \delta

  with ``eta_s = lr * scalar_lr_scale``; ``c_t = min(1, threshold / (N_t + 1e-20))``, ``N_t``
  the ``param_rms``-weighted norm. One-element tensors take a scalar path; ``delta`` has no
  bias correction (docs/algorithms.md#the-scaledadam-step).

  Args:
    learning_rate: a float or an optax schedule ``count -> lr`` (e.g. ``eden``).
    clipping_scale: clip to this multiple of the median norm; None: no clipping.
    b1, b2: momentum of ``delta`` and decay of the second moments.
    scalar_lr_scale: lr factor of the size updates and of one-element params.
    eps: added to square roots of second moments.
    param_min_rms, param_max_rms: limits on the RMS the size update may reach.
    scalar_max: one-element params are clipped to ``[-scalar_max, scalar_max]``.
    size_update_period: steps between size updates.
    clipping_update_period: steps between clipping statistics.
    show_dominant_parameters: log the statistics, and the param dominating a
      step scaled by < 0.1 (docs/algorithms.md#statistics-and-logging).
    skip_nonfinite: skip (and count) every step with a NaN or Inf gradient
      (docs/algorithms.md#non-finite-gradients).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``. Its updates
    are ``delta`` in the param dtype; fp32 for one-element leaves (the clamp to ``scalar_max``).

  Example:
    Steps in proportion to each tensor's RMS (``s``: lr times ``scalar_lr_scale``):

    >>> import jax, jax.numpy as jnp
    >>> import optax_half as oh
    >>> tx = oh.scaled_adam(learning_rate=0.1)
    >>> params = {"a": jnp.full((2, 2), 0.1), "b": jnp.full((2, 2), 1.0),
    ...           "s": jnp.array(0.5)}
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> {k: round(float(u.ravel()[0]), 6) for k, u in updates.items()}
    {'a': -0.001, 'b': -0.01, 's': -0.001}

  References:
    Yao et al., `Zipformer: A faster and better encoder for automatic speech
    recognition <https://arxiv.org/abs/2310.11230>`_, ICLR 2024 (ScaledAdam)

    k2-fsa, `icefall <https://github.com/k2-fsa/icefall>`_ (the ScaledAdam
    implementation this ports)
  """
  check_scaled_adam_args(learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps,
                         param_min_rms, param_max_rms, scalar_max, size_update_period,
                         clipping_update_period, _STATIC)
  h = _Hyper(learning_rate, clipping_scale, b1, b2, scalar_lr_scale, eps, param_min_rms,
             param_max_rms, scalar_max, size_update_period, clipping_update_period,
             show_dominant_parameters)

  def init(params):
    return _init(h, params)

  def update(updates, state, params=None, **extra_args):
    del extra_args
    check_state_fits("scaled_adam", init, state, params)  # trace time: shapes and dtypes
    return _step(h, updates, state, params, in_place=False)

  def update_and_apply(updates, state, params, **extra_args):
    """``update`` and ``optax.apply_updates`` in one step (the same bits)."""
    del extra_args
    check_state_fits("scaled_adam", init, state, params)
    return _step(h, updates, state, params, in_place=True)

  def kahan_update(grads, state, x, leaves, finish, in_place, **extra_args):
    del extra_args
    return _kahan_update(h, grads, state, x, leaves, finish, in_place)

  tx = transformation(init, update, "scaled_adam")
  if skip_nonfinite:  # docs/algorithms.md#the-scaledadam-kernel: no fused step then
    return maybe_skip_nonfinite(tx, skip_nonfinite)
  out = ScaledAdamTransformation(tx.init, tx.update)
  out.update_and_apply = update_and_apply
  out.kahan_update = kahan_update
  return out


def _init_clipping(period: int) -> ScaledAdamClippingState:
  """The clipping statistics before the first step."""
  return ScaledAdamClippingState(
      model_norms=jnp.zeros([period], jnp.float32),
      model_norm_threshold=jnp.zeros([], jnp.float32),
      num_clipped=jnp.zeros([], jnp.int32),
      quartiles=jnp.zeros([QUARTILES], jnp.float32),
      percent_clipped=jnp.zeros([], jnp.float32),
      clipping_factor=jnp.ones([], jnp.float32),
      grad_norm=jnp.zeros([], jnp.float32),
      dominant_index=jnp.zeros([], jnp.int32),
      dominant_share=jnp.zeros([], jnp.float32))


def _param_rms(params):
  """Each leaf's RMS (``MaskedNode()`` for scalars): ``sqrt(mean(p^2))`` in fp32, the mean
  the kernel's float64 sum, rounded once, where it takes the leaf (as at a size step: no
  fp32 copy of the params, docs/algorithms.md#memory), else XLA's fp32 mean."""
  leaves, treedef = jax.tree.flatten(params)
  takes = [k for k, p in enumerate(leaves) if not _is_scalar(p) and _native.scaled_adam_takes(
      p, p, jax.ShapeDtypeStruct(p.shape, _second_moment_dtype(p.dtype)))]

  def means(kernel: tuple):
    out = {}
    if kernel:
      zero = jnp.zeros([], jnp.float32)
      sums = _native.scaled_adam_sums([leaves[k] for k in kernel], [leaves[k] for k in kernel],
                                      [zero] * len(kernel), [jnp.int32(2)] * len(kernel))
      out = {k: sums[j, 2] for j, k in enumerate(kernel)}
    for k, p in enumerate(leaves):
      if k not in out and not _is_scalar(p):
        p32 = rounding.widen(p)
        out[k] = jnp.mean(p32 * p32)
    return [out[k] if k in out else jnp.zeros([], jnp.float32) for k in range(len(leaves))]

  if takes and _native.on_cpu(params):
    ms = jax.lax.platform_dependent(cpu=lambda: means(tuple(takes)), default=lambda: means(()))
  else:
    ms = means(())
  return jax.tree.unflatten(treedef, [MaskedNode() if _is_scalar(p) else
                                      jnp.sqrt(m).astype(p.dtype) for p, m in zip(leaves, ms)])


def _init(h: _Hyper, params) -> ScaledAdamState:
  """``init``: zero moments, each non-scalar leaf's RMS (docs/algorithms.md#the-scaledadam-step)."""
  for i, p in enumerate(jax.tree.leaves(params)):
    if not is_float(p):
      raise ValueError(
          f"scaled_adam: leaf {i} of the params has dtype {jnp.asarray(p).dtype}; only "
          "float params can be optimized (mask integer leaves with optax.masked, or "
          "wrap scaled_adam in optax_half.master_weights / kahan_summation, which do).")
  check_no_float64("scaled_adam", params)
  S = h.size_update_period
  sq_zeros = lambda p: zeros_like_param(p, _second_moment_dtype(p.dtype))
  nonscalar = lambda f: (lambda p: MaskedNode() if _is_scalar(p) else f(p))
  params = jax.tree.map(jnp.asarray, params)
  clipping = _init_clipping(h.clipping_update_period)
  return ScaledAdamState(
      count=jnp.zeros([], jnp.int32),
      delta=jax.tree.map(zeros_like_param, params),
      exp_avg_sq=jax.tree.map(sq_zeros, params),
      param_rms=_param_rms(params),
      scale_exp_avg_sq=jax.tree.map(
          nonscalar(lambda p: jnp.zeros([], _second_moment_dtype(p.dtype))), params),
      scale_grads=jax.tree.map(nonscalar(lambda p: jnp.zeros([S], p.dtype)), params),
      clipping=clipping)


def _step(h: _Hyper, updates, state, params, in_place: bool):
  """``update``, or with ``in_place`` ``update_and_apply`` (``(new params, state)``)."""
  check_trees("scaled_adam", updates, params)
  grads, treedef = jax.tree.flatten(updates)
  ps = treedef.flatten_up_to(params)
  ps = [jnp.asarray(p) for p in ps]  # Python scalars are leaves too
  grads = [jnp.asarray(g) for g in grads]
  vs = treedef.flatten_up_to(state.exp_avg_sq)
  # The kernel's leaves, chosen at trace time from dtypes and shapes.
  native = tuple(k for k, (p, g, v) in enumerate(zip(ps, grads, vs))
                 if _native.scaled_adam_takes(p, g, v))
  if native and not _native.on_cpu(params):
    native = ()
  run = functools.partial(_step_leaves, h, treedef, ps, grads, state, in_place=in_place)
  if not native:
    return run(())
  return jax.lax.platform_dependent(cpu=lambda: run(native), default=lambda: run(()))


def _step_leaves(h: _Hyper, treedef, ps, grads, state, native: tuple, in_place: bool):
  """``_step`` with the leaves ``native`` in the kernel (the platform's branch)."""
  u, new_state, done = _update(h, treedef, ps, grads, state, native, in_place=in_place)
  if not in_place:
    return u, new_state
  us = treedef.flatten_up_to(u)
  return jax.tree.unflatten(treedef, [
      done[k] if k in done else optax.apply_updates(p, uk)
      for k, (p, uk) in enumerate(zip(ps, us))]), new_state


def _kahan_update(h: _Hyper, grads, state, x, leaves, finish, in_place: bool):
  """``kahan_summation(scaled_adam)``'s kernel step, or None where the kernel takes no leaf
  (docs/algorithms.md#the-scaledadam-kernel)."""
  gs, treedef = jax.tree.flatten(grads)
  xs = treedef.flatten_up_to(x)
  ds = treedef.flatten_up_to(state.delta)
  vs = treedef.flatten_up_to(state.exp_avg_sq)
  whole = tuple(k for k, (p, g, c, _, _) in enumerate(leaves)
                if c is not None and _native.scaled_adam_takes_kahan(p, g, c, ds[k], vs[k]))
  if not whole or not _native.on_cpu(x):
    return None
  # The kernel also takes the leaves update would give it (fp32, no compensation).
  native = tuple(k for k in range(len(xs)) if k in whole
                 or _native.scaled_adam_takes(xs[k], gs[k], vs[k]))
  body = functools.partial(_kahan_step, h, treedef, xs, gs, state, leaves, whole, native,
                           finish, in_place)
  return jax.lax.platform_dependent(cpu=lambda: body(True), default=lambda: body(False))


def _kahan_step(h: _Hyper, treedef, xs, gs, state, leaves, whole, native, finish,
                in_place: bool, kernel: bool):
  """``_kahan_update``'s platform branch; ``done``: whole leaves' (param, compensation)."""
  kahan = {k: leaves[k][:3] for k in whole} if kernel else None
  u, new_state, kernel_done = _update(h, treedef, xs, gs, state, native if kernel else (),
                                      kahan=kahan, in_place=in_place)
  us = treedef.flatten_up_to(u)
  done = {leaves[k][4]: kernel_done[k] if kernel else
          finish(leaves[k][0], leaves[k][2], xs[k], us[k], leaves[k][4]) for k in whole}
  return u, new_state, done


def _update(h: _Hyper, treedef, ps, grads, state, native: tuple, kahan=None, in_place=False):
  """The step of the flat leaves ``ps`` (``p + c`` for ``kahan``'s), ``native``'s in the kernel,
  in torch's ``_step_group`` order: ``(updates, state, done)``, ``done`` the kernel's."""
  names = leaf_names(jax.tree.unflatten(treedef, ps))
  deltas = treedef.flatten_up_to(state.delta)
  vs = treedef.flatten_up_to(state.exp_avg_sq)
  rmss = treedef.flatten_up_to(state.param_rms)
  ws = treedef.flatten_up_to(state.scale_exp_avg_sq)
  sgs = treedef.flatten_up_to(state.scale_grads)
  c = _coefficients(h, state.count)
  rms_old = [None if isinstance(r, MaskedNode) else rounding.widen(r) for r in rmss]
  calls = _native_rows(ps, grads, native, kahan or {})
  sums = _native_sums(h, c, calls, rms_old)
  g32 = [None if k in sums else rounding.widen(g) for k, g in enumerate(grads)]
  clipping, factor = state.clipping, None
  if h.clipping_scale is not None:
    factor, clipping = _clip(h, c.t, clipping, _clip_sums(sums, g32, rms_old), names)
    g32 = [None if g is None else g * factor for g in g32]
  rows, sized = _native_scalars(h, c, sums, factor, sgs, ws, rmss)
  new = [None] * len(ps)  # per leaf: (update, delta, v, param_rms, w, scale_grads)
  for k, (p, g, d, v, r, w, sg) in enumerate(zip(ps, g32, deltas, vs, rmss, ws, sgs)):
    if k not in sums:
      new[k] = _step_one(h, c, p, g, d, v, r, w, sg)
  stepped, done = _native_step(c, calls, rows, deltas, vs, in_place)
  for k, (u, d, v) in stepped.items():
    new[k] = (u, d, v, *sized[k])
  u, delta, v, rms, w, sg = [jax.tree.unflatten(treedef, [x[i] for x in new])
                             for i in range(6)]
  return u, ScaledAdamState(
      count=optax.safe_increment(c.t), delta=delta, exp_avg_sq=v, param_rms=rms,
      scale_exp_avg_sq=w, scale_grads=sg, clipping=clipping), done


def _coefficients(h: _Hyper, t) -> _Coefficients:
  """Step ``t``'s fp32 scalars, each rounded once from float64
  (docs/algorithms.md#dtypes-and-coefficients)."""
  S = h.size_update_period
  lr = _f32(h.learning_rate(t) if callable(h.learning_rate) else h.learning_rate)
  one_minus_b2 = _f32(1 - h.b2)
  b2_corr, one_minus_b2_corr = _f32(h.b2 ** S), _f32(1 - h.b2 ** S)
  zero = rounding.opaque_zero(t)
  is_size_step = (t % S) == (S - 1)
  bc2 = rounding.one_minus_pow(h.b2, t + 1, zero, one_minus_b=one_minus_b2)
  size_bc2 = rounding.one_minus_pow(b2_corr, (t + 1) // S, zero, one_minus_b=one_minus_b2_corr)
  return _Coefficients(
      t=t, is_size_step=is_size_step, do_size_update=is_size_step & (t > 0), lr=lr,
      b1=_f32(h.b1), b2=_f32(h.b2), eps=_f32(h.eps), one_minus_b1=_f32(1 - h.b1),
      one_minus_b2=one_minus_b2, b2_corr=b2_corr, one_minus_b2_corr=one_minus_b2_corr,
      size_lr=lr * _f32(h.scalar_lr_scale), bc2=bc2, inv_bc2=1 / bc2, size_bc2=size_bc2)


def _native_rows(ps, grads, native: tuple, kahan: dict) -> list:
  """The kernel's calls, ``(positions, params, gradients, compensations or None)``."""
  calls = []
  for ks in ([k for k in native if k not in kahan], [k for k in native if k in kahan]):
    if ks:
      with_comps = ks[0] in kahan
      calls.append((ks, [kahan[k][0] if with_comps else ps[k] for k in ks],
                    [kahan[k][1] if with_comps else grads[k] for k in ks],
                    [kahan[k][2] for k in ks] if with_comps else None))
  return calls


def _native_sums(h: _Hyper, c: _Coefficients, calls, rms_old) -> dict:
  """Kernel leaf -> its ``sum((g r)^2)``, ``sum(p g)``, ``mean(p p)`` of the
  unclipped gradient, in one pass (docs/algorithms.md#the-scaledadam-kernel)."""
  want = jnp.int32(0 if h.clipping_scale is None else 1) + 2 * c.is_size_step.astype(jnp.int32)
  sums = {}
  for ks, kernel_ps, kernel_gs, comps in calls:
    out = _native.scaled_adam_sums(kernel_ps, kernel_gs, [rms_old[k] for k in ks],
                                   [want] * len(ks), comps=comps)
    sums.update({k: out[j] for j, k in enumerate(ks)})
  return sums


def _clip_sums(sums: dict, g32, rms_old) -> list:
  """Per leaf, ``sum((g * param_rms)^2)`` (``sum(g^2)`` for a scalar): the kernel's or XLA's."""
  return [sums[k][0] if k in sums else jnp.sum(g * g) if r is None
          else jnp.sum((g * r) * (g * r)) for k, (g, r) in enumerate(zip(g32, rms_old))]


def _clip(h: _Hyper, t, c: ScaledAdamClippingState, sumsq: list, names):
  """The seed's ``_get_clipping_scale``: the factor of step ``t`` and the new
  statistics, from each leaf's ``sumsq`` (docs/algorithms.md#the-scaledadam-step)."""
  P = h.clipping_update_period
  tot_sumsq = jnp.zeros([], jnp.float32)
  for s in sumsq:  # in leaf order, as torch_bridge adds them
    tot_sumsq = tot_sumsq + s
  tot_norm = jnp.sqrt(tot_sumsq)
  slot = t % P
  model_norms = jnp.where(t > 0, c.model_norms.at[slot].set(tot_norm), c.model_norms)
  take_stats = (t > 0) & (slot == 0)
  quartiles = jnp.sort(model_norms)[jnp.array(quartile_indices(P))]
  threshold = jnp.where(take_stats, _f32(h.clipping_scale) * quartiles[2],
                        c.model_norm_threshold)
  percent = (c.num_clipped.astype(jnp.float32) * 100) * (1 / _f32(P))
  num_clipped = jnp.where(take_stats, 0, c.num_clipped)
  factor = jnp.where(t >= P, jnp.minimum(1.0, threshold / (tot_norm + _f32(1e-20))),
                     _f32(1.0))
  num_clipped = num_clipped + (factor < 1).astype(jnp.int32)
  if sumsq:
    shares = jnp.stack(sumsq)
    dominant = jnp.argmax(shares).astype(jnp.int32)
    share = shares[dominant] / tot_sumsq
  else:
    dominant, share = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32)
  c = ScaledAdamClippingState(
      model_norms=model_norms,
      model_norm_threshold=threshold,
      num_clipped=num_clipped,
      quartiles=jnp.where(take_stats, quartiles, c.quartiles),
      percent_clipped=jnp.where(take_stats, percent, c.percent_clipped),
      clipping_factor=factor,
      grad_norm=tot_norm,
      dominant_index=dominant,
      dominant_share=share)
  if h.show_dominant_parameters or logger.isEnabledFor(logging.INFO):
    _log(h, t, c, names)
  return factor, c


def _log(h: _Hyper, t, c: ScaledAdamClippingState, names) -> None:
  """Logs from inside jit at the seed's cadence (docs/algorithms.md#statistics-and-logging)."""
  P = h.clipping_update_period
  due = ((t > 0) & (t % P == 0)) | (c.clipping_factor < 0.1)
  host_log = functools.partial(_host_log, names, h.clipping_scale, h.show_dominant_parameters, P)
  jax.lax.cond(due, lambda: jax.debug.callback(host_log, t, c), lambda: None)


def _host_log(names, clipping_scale, show_dominant: bool, P: int, t, c) -> None:
  t = int(t)
  _log_stats(t, _stats_dict(c, names), clipping_scale, show_dominant,
             take_stats=t > 0 and t % P == 0)


def _size_updates(h: _Hyper, c: _Coefficients, sg, w, rms, scale_grad, mean_sq) -> tuple:
  """The size updates of a batch of leaves (``sg`` (n, S)) or of one (``sg`` (S,)),
  and the step's RMS factor ``alpha`` (docs/algorithms.md#the-scaledadam-step)."""
  S = h.size_update_period
  sg_new = sg.at[..., c.t % S].set(scale_grad.astype(sg.dtype))
  sg32 = rounding.widen(sg_new)
  rms_new = jnp.where(c.is_size_step, jnp.sqrt(mean_sq).astype(rms.dtype), rms)
  w_new = (c.b2_corr * rounding.widen(w) + c.one_minus_b2_corr * jnp.mean(sg32 * sg32, axis=-1)
           ).astype(w.dtype)
  w_new = jnp.where(c.do_size_update, w_new, w)
  scale_step = ((-c.size_lr * jnp.sqrt(c.size_bc2)) * jnp.sum(sg32, axis=-1)
                / (jnp.sqrt(rounding.widen(w_new)) + c.eps))
  rms32 = rounding.widen(rms_new)
  scale_step = jnp.where(rms32 < _f32(h.param_min_rms), 0.0, scale_step)
  scale_step = jnp.where(rms32 > _f32(h.param_max_rms), -c.size_lr * S, scale_step)
  scale_step = jnp.where(c.do_size_update, scale_step, 0.0)  # delta + 0 = delta
  alpha = (-c.lr * c.one_minus_b1) * jnp.maximum(rms32, _f32(h.param_min_rms))
  return sg_new, rms_new, w_new, scale_step, alpha, rms32


def _step_one(h: _Hyper, c: _Coefficients, p, g, d, v, rms, w, sg) -> tuple:
  """The seed's ``_step_one_batch`` (``_step_scalar`` for one element) of a leaf in XLA:
  ``(update, delta, v, param_rms, w, scale_grads)`` (docs/algorithms.md#the-scaledadam-step)."""
  p32 = rounding.widen(p)
  delta = c.b1 * rounding.widen(d)
  v_new = (c.b2 * rounding.widen(v) + c.one_minus_b2 * (g * g)).astype(v.dtype)
  v32 = rounding.widen(v_new)
  if _is_scalar(p):
    lr_s = -c.size_lr * c.one_minus_b1
    denom = jnp.sqrt(v32 * c.inv_bc2) + c.eps
    delta = (delta + lr_s * (g / denom)).astype(d.dtype)
    clamped = jnp.abs(p32) > _f32(h.scalar_max)
    p_clamped = jnp.clip(p32, -_f32(h.scalar_max), _f32(h.scalar_max))
    # In p's dtype (docs/algorithms.md#landing-exactly): apply_updates lands on clip(p) + delta.
    to_clamped = rounding.land(p, (p_clamped + rounding.widen(delta)).astype(p.dtype))[0]
    u = jnp.where(clamped, to_clamped, delta.astype(p.dtype))
    return u, delta, v_new, MaskedNode(), MaskedNode(), MaskedNode()
  sg_new, rms_new, w_new, scale_step, alpha, _ = _size_updates(
      h, c, sg, w, rms, jnp.sum(p32 * g), jnp.mean(p32 * p32))
  delta = delta + c.one_minus_b1 * (p32 * scale_step)
  v_hat = jnp.where(c.bc2 < _f32(0.99), v32 * c.inv_bc2, v32)
  denom = jnp.sqrt(v_hat) + c.eps
  delta = (delta + (g / denom) * alpha).astype(d.dtype)
  return delta.astype(p.dtype), delta, v_new, rms_new, w_new, sg_new


def _native_scalars(h: _Hyper, c: _Coefficients, sums: dict, factor, sgs, ws, rmss) -> tuple:
  """The kernel leaves' size updates, batched per buffer dtypes, and their rows of
  ``ScaledAdamScalars``: ``(rows, sized)`` by position, ``sized`` (param_rms, w, scale_grads)."""
  rows, sized, batches = {}, {}, {}
  for k in sums:
    batches.setdefault((sgs[k].dtype, ws[k].dtype, rmss[k].dtype), []).append(k)
  for ks in batches.values():
    out = jnp.stack([sums[k] for k in ks])
    scale_grad = out[:, 1] if factor is None else out[:, 1] * factor
    sg_new, rms_new, w_new, scale_step, alpha, rms32 = _size_updates(
        h, c, jnp.stack([sgs[k] for k in ks]), jnp.stack([ws[k] for k in ks]),
        jnp.stack([rmss[k] for k in ks]), scale_grad, out[:, 2])
    ones = jnp.ones([len(ks)], jnp.float32)
    columns = [ones if factor is None else factor * ones, c.b1 * ones, c.b2 * ones,
               c.one_minus_b1 * ones, c.one_minus_b2 * ones,
               jnp.where(c.bc2 < _f32(0.99), c.inv_bc2, _f32(1.0)) * ones, c.eps * ones, alpha,
               scale_step, rms32]
    for j, (k, row) in enumerate(zip(ks, jnp.stack(columns, axis=1))):
      rows[k] = row
      sized[k] = (rms_new[j], w_new[j], sg_new[j])
  return rows, sized


def _native_step(c: _Coefficients, calls, rows: dict, deltas, vs, in_place: bool) -> tuple:
  """The kernel's step: ``(stepped, done)``, ``stepped[k] = (delta, delta, v)``."""
  stepped, done = {}, {}
  for ks, kernel_ps, kernel_gs, comps in calls:
    size = jnp.broadcast_to(c.do_size_update.astype(jnp.int32), (len(ks),))
    out = _native.scaled_adam_step(
        jnp.stack([rows[k] for k in ks]), size, kernel_ps, kernel_gs,
        [deltas[k] for k in ks], [vs[k] for k in ks], comps=comps, in_place=in_place)
    for j, k in enumerate(ks):
      stepped[k] = (out.deltas[j], out.deltas[j], out.vs[j])
      if comps is not None:  # (update, landed param, compensation), as the wrappers' finish
        p = kernel_ps[j]
        if in_place:  # the kernel wrote the landed param; u only matches finish's structure
          landed = out.params[j]
          u = (rounding.widen(landed) - rounding.widen(p)).astype(p.dtype)
        else:  # the kernel wrote u; p + u only matches finish's structure
          u = out.params[j]
          landed = (rounding.widen(p) + rounding.widen(u)).astype(p.dtype)
        done[k] = (u, landed, out.comps[j])
      elif in_place:
        done[k] = out.params[j]
  return stepped, done


def _stats_dict(c: ScaledAdamClippingState, names) -> dict:
  index = int(c.dominant_index)
  return {
      "grad_norm_quartiles": [float(q) for q in c.quartiles],
      "model_norm_threshold": float(c.model_norm_threshold),
      "percent_clipped": float(c.percent_clipped),
      "num_clipped": int(c.num_clipped),
      "clipping_factor": float(c.clipping_factor),
      "grad_norm": float(c.grad_norm),
      "dominant_parameter": names[index] if 0 <= index < len(names) else None,
      "dominant_share": float(c.dominant_share),
  }


def _log_stats(step: int, stats: dict, clipping_scale, show_dominant: bool,
               take_stats: bool, log=logger) -> None:
  """The seed's log lines, shared with ``torch_bridge.scaled_adam``."""
  if take_stats:
    quartiles = " ".join("%.3e" % q for q in stats["grad_norm_quartiles"])
    log.info(f"Clipping_scale={clipping_scale}, grad-norm quartiles {quartiles}, "
             f"threshold={stats['model_norm_threshold']:.3e}, "
             f"percent-clipped={stats['percent_clipped']:.1f}")
  if stats["clipping_factor"] < 0.1:
    log.warning(f"Scaling gradients by {stats['clipping_factor']}, "
                f"model_norm_threshold={stats['model_norm_threshold']}")
    if show_dominant:
      log.info(f"Parameter dominating tot_sumsq {stats['dominant_parameter']} with "
               f"proportion {stats['dominant_share']:.2f} (step {step})")


def scaled_adam_stats(opt_state) -> dict:
  """The clipping statistics of the ``scaled_adam`` in ``opt_state``, read to the host
  (a sync: not inside a jitted step; docs/algorithms.md#statistics-and-logging).

  Returns:
    A dict: ``grad_norm_quartiles`` (min, 25%, median, 75%, max at the last multiple of
    ``clipping_update_period``), ``model_norm_threshold``, ``percent_clipped``, ``num_clipped``;
    the last step's ``clipping_factor``, ``grad_norm``, ``dominant_parameter``, ``dominant_share``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_half as oh
    >>> tx = oh.scaled_adam(0.1, clipping_scale=2.0)
    >>> params = {"a": jnp.full((2, 2), 0.1), "b": jnp.full((2, 2), 1.0)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> stats = oh.scaled_adam_stats(state)
    >>> round(stats["grad_norm"], 4), stats["dominant_parameter"], stats["clipping_factor"]
    (2.01, 'b', 1.0)
  """
  found = find_states(opt_state, ScaledAdamState, {"clipping": ScaledAdamClippingState})
  if not found:
    raise ValueError("scaled_adam_stats: no ScaledAdamState in this optimizer state.")
  state = found[0]
  return _stats_dict(jax.device_get(state.clipping), leaf_names(state.delta))
