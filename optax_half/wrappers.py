"""Low-precision wrappers: any optax transformation, trained on 16-bit params.

Each wrapper runs its ``inner`` transformation on an fp32 (or ``master_dtype``)
view ``x`` of the parameters and fp32 gradients, adds the inner update to ``x``
in that precision, and stores the result back in the 16-bit parameter plus a
per-leaf buffer that keeps what 16 bits cannot hold:

============================  ==========================  =====================
wrapper                       buffer per 16-bit leaf       ``x`` seen by inner
============================  ==========================  =====================
``master_weights``            ``master_dtype`` copy        the master copy
``master_weights(split=True)``  int16 low half (bf16 only)  ``join(p, lo)``, exact
``kahan_summation``           compensation, param dtype   ``p + c``
``stochastic_rounding``       none (a seed and a counter)  ``p``
============================  ==========================  =====================

The returned updates ``u = new_p.astype(f32) - p.astype(f32)`` are fp32, so
``optax.apply_updates(params, u)`` computes ``round(p + u)`` in fp32 and lands
on ``new_p`` bit for bit (argument and its one limit:
``docs/algorithms.md#landing-exactly``).

Leaves that are already 32-bit (or at least as wide as ``master_dtype``) are
passed to the inner transformation unchanged and get no buffer. Non-float
leaves (integers, bools) are masked out of the inner transformation with
``optax.MaskedNode`` and receive zero updates: they are left untouched.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import MaskedNode

from optax_half import _in_place, rounding
from optax_half._util import (check_trees, is_float, leaf_indices, like_param, seed_from_key,
                              transformation, unzip, zeros_like_param)

__all__ = [
    "master_weights",
    "kahan_summation",
    "stochastic_rounding",
    "MasterWeightsState",
    "KahanSummationState",
    "StochasticRoundingState",
    "round_to_nearest",
    "RoundToNearestState",
]


class MasterWeightsState(NamedTuple):
  """State of ``master_weights``.

  Attributes:
    master: per leaf, the ``master_dtype`` copy; with ``split=True`` the int16
      low half for bf16 leaves; ``MaskedNode()`` for leaves without a buffer.
    inner_state: the inner transformation's state, built on the master params.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
    >>> state = oh.master_weights(optax.sgd(0.1)).init(params)
    >>> print(state.master["w"].dtype, state.master["b"])  # fp32 leaves: no copy
    float32 MaskedNode()
    >>> split = oh.master_weights(optax.sgd(0.1), split=True).init(params)
    >>> print(split.master["w"].dtype)  # the low half of the fp32 master
    int16
  """
  master: Any
  inner_state: Any


class KahanSummationState(NamedTuple):
  """State of ``kahan_summation``: compensation ``c`` in the param dtype.

  Attributes:
    compensation: per 16-bit leaf, what rounding the param lost (``x' - p'``),
      in the param dtype; ``MaskedNode()`` for leaves without a buffer.
    inner_state: the inner transformation's state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.kahan_summation(optax.sgd(0.1)).init(params)
    >>> print(state.compensation["w"].dtype, state.compensation["w"].tolist())
    bfloat16 [0.0, 0.0, 0.0]
  """
  compensation: Any
  inner_state: Any


class RoundToNearestState(NamedTuple):
  """State of ``round_to_nearest``: only the inner state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.round_to_nearest(optax.adam(1e-3)).init(params)
    >>> print(state.inner_state[0].mu["w"].dtype)  # the inner state, on fp32
    float32
  """
  inner_state: Any


class StochasticRoundingState(NamedTuple):
  """State of ``stochastic_rounding``.

  Attributes:
    seed: uint32 scalar; with ``count`` it determines every random bit.
    count: int32 number of updates taken (the per-step key is derived from
      ``(seed, count)`` by hashing: a counter-based split of the key).
    inner_state: the inner transformation's state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.stochastic_rounding(optax.sgd(0.1), key=7).init(params)
    >>> print(state.seed.dtype, int(state.count))
    uint32 0
  """
  seed: jax.Array
  count: jax.Array
  inner_state: Any


_WRAPPER_STATES = (MasterWeightsState, KahanSummationState, RoundToNearestState,
                   StochasticRoundingState)

# ---------------------------------------------------------------------------
# Shared machinery.
# ---------------------------------------------------------------------------

# Per-leaf roles.
_FROZEN = "frozen"  # not a float: masked out, zero update
_DIRECT = "direct"  # wide enough: inner runs on it as is, no buffer
_LOW = "low"        # 16-bit: inner runs on x, a buffer keeps the rest


def _lowp_wrapper(
    name: str,
    inner: optax.GradientTransformation,
    *,
    role: Callable[[jnp.dtype], str],
    work_dtype: Callable[[jnp.dtype], jnp.dtype],
    init_buffer: Callable[[jax.Array], jax.Array],
    read: Callable[[jax.Array, jax.Array], jax.Array],
    write: Callable[..., tuple[jax.Array, jax.Array]],
    nested_ok: bool = False,
):
  """Builds (init, step) for a wrapper from per-leaf rules.

  ``read(p, buf) -> x`` gives the high-precision value the inner transformation
  sees; ``write(x_new, p, buf, leaf_index, ctx) -> (new_p, new_buf)`` stores it
  back. ``ctx`` is whatever the caller passes to ``step`` (the random seed and
  step for stochastic rounding).
  """
  inner = optax.with_extra_args_support(inner)

  def roles(params):
    return jax.tree.map(
        lambda p: role(jnp.dtype(p.dtype)) if is_float(p) else _FROZEN, params)

  def view(params, buffers, rl):
    def one(p, buf, r):
      if r == _FROZEN:
        return MaskedNode()
      if r == _DIRECT:
        return p
      return read(p, buf)
    return jax.tree.map(one, params, buffers, rl)

  def init(params):
    params = jax.tree.map(jnp.asarray, params)
    rl = roles(params)
    buffers = jax.tree.map(
        lambda p, r: init_buffer(p) if r == _LOW else MaskedNode(), params, rl)
    # The view is sharded like the params, so state the inner transformation
    # makes from it is too.
    x = jax.tree.map(lambda p, xi, r: xi if r == _FROZEN else like_param(p, xi),
                     params, view(params, buffers, rl), rl)
    inner_state = _like_view(inner, inner.init(x), x)
    if not nested_ok:
      _check_not_nested(name, inner_state)
    return buffers, inner_state

  def step(grads, buffers, inner_state, params, ctx, fused=None, in_place=False, **extra_args):
    """The wrapper's step: ``(updates, buffers, inner state)``, or with
    ``in_place`` ``(new params, buffers, inner state)``: a 16-bit leaf's new
    param itself (the param its update lands on), the others
    ``optax.apply_updates``'. ``fused(g, inner_state, x, leaves, finish,
    in_place, **extra_args)``, or None: an inner step that may take the whole
    step of some 16-bit leaves (the inner's own ``kahan_update``); ``leaves``
    lists, per leaf the inner sees, ``(param, gradient, buffer or None, x,
    leaf index)``; it returns None (not taken) or ``(inner updates, inner
    state, done)`` with ``done`` mapping a leaf index to its ``(new param,
    new buffer)``, the bits ``finish`` would give; with ``in_place`` the new
    param may be written into the param's buffer."""
    check_trees(name, grads, params)
    params = jax.tree.map(jnp.asarray, params)
    if buffers is None:  # wrappers without per-leaf buffers
      buffers = jax.tree.map(lambda _: MaskedNode(), params)
    rl = roles(params)

    def finish(p, buf, xi, ui, i):
      """A 16-bit leaf's end of the step: x' = x + u stored back as
      ``(new param, new buffer)``."""
      # x' = x + u, rounded like optax.apply_updates rounds it.
      x_new = jnp.asarray(xi + ui).astype(xi.dtype)
      return write(x_new, p, buf, i, ctx)

    x = view(params, buffers, rl)
    g = jax.tree.map(
        lambda p, g_, r: MaskedNode() if r == _FROZEN
        else rounding.widen(g_).astype(work_dtype(jnp.dtype(p.dtype))),
        params, grads, rl)
    index = leaf_indices(params)
    taken = None
    if fused is not None:
      treedef = jax.tree.structure(params)
      flat = [treedef.flatten_up_to(t) for t in (params, grads, buffers, x, rl, index)]
      leaves = [(p, g_, b if r == _LOW else None, xi, i)
                for p, g_, b, xi, r, i in zip(*flat) if r != _FROZEN]
      taken = fused(g, inner_state, x, leaves, finish, in_place, **extra_args)
    if taken is None:
      inner_updates, inner_state = inner.update(g, inner_state, x, **extra_args)
      done = {}
    else:
      inner_updates, inner_state, done = taken

    def one(p, buf, xi, ui, r, i):
      if r == _LOW:
        new_p, buf = done[i] if i in done else finish(p, buf, xi, ui, i)
        if in_place:
          return new_p, buf
        # Work-dtype (fp32) updates: apply_updates(p, u) lands on new_p exactly.
        # `widen`: XLA must not fold f32(round(x_new)) back into x_new.
        dtype = xi.dtype
        return rounding.widen(new_p).astype(dtype) - rounding.widen(p).astype(dtype), buf
      u = jnp.zeros_like(p) if r == _FROZEN else ui
      return (optax.apply_updates(p, u) if in_place else u), buf

    pairs = jax.tree.map(one, params, buffers, x, inner_updates, rl, index)
    updates, buffers = unzip(params, pairs, 2)
    return updates, buffers, inner_state

  return init, step


def _like_view(inner, inner_state, x):
  """``inner_state`` with every params-shaped part sharded like ``x``.

  Under ``jax.jit`` with automatic sharding a state built from constants
  (``optax.adam``'s zero moments) would be replicated; ``optax.tree_map_params``
  finds the parts of the state that mirror the params, and ``like_param`` ties
  them to ``x``. Eagerly (nothing traced) the state already follows ``x``.
  """
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x)):
    return inner_state
  try:
    return optax.tree_map_params(
        inner, lambda s, xi: s if isinstance(s, MaskedNode) else like_param(xi, s),
        inner_state, x, is_leaf=lambda v: isinstance(v, MaskedNode))
  except Exception:  # noqa: BLE001 (an init that cannot run on optax's placeholder)
    return inner_state  # a layout hint only: the numbers are the same either way


def _check_not_nested(name, inner_state) -> None:
  """Refuses an inner transformation that is itself a low-precision wrapper.

  Its state would hold one of the wrapper states: ``adamw_bf16``,
  ``adam_fp32_master`` and every wrapper here keep their own master,
  compensation or rounding, and a second layer would only hand them fp32
  params (a second master copy, or a buffer that never fills). Not checked
  under ``master_weights`` with a 16-bit ``master_dtype`` (bf16 masters of
  fp8 params): there the inner wrapper has 16-bit params of its own to keep.
  """
  nested = [type(x).__name__ for x in jax.tree.leaves(
      inner_state, is_leaf=lambda x: isinstance(x, _WRAPPER_STATES))
            if isinstance(x, _WRAPPER_STATES)]
  if nested:
    raise ValueError(
        f"{name}: the inner transformation already keeps low-precision params "
        f"(its state holds a {nested[0]}: adamw_bf16, adam_fp32_master and the "
        "wrappers do). Wrap a plain optimizer once, e.g. "
        f"{name}(optax.adam(1e-3)), or use the named optimizer alone.")


def _validate_inner(name, inner):
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        f"{name} wraps an optax.GradientTransformation (e.g. optax.adam(1e-3)); "
        f"got {type(inner).__name__}.")


# ---------------------------------------------------------------------------
# Public wrappers.
# ---------------------------------------------------------------------------


def master_weights(
    inner: optax.GradientTransformation,
    master_dtype=jnp.float32,
    split: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Keeps a high-precision master copy of every low-precision param.

  For each floating-point leaf ``p`` narrower than ``master_dtype``:

  .. math::
     g_m = \mathrm{cast}(g, m),\quad
     (u, s') = \mathrm{inner}(g_m, s, m),\quad
     m' = m + u,\quad p' = \mathrm{round}(m')

  and the returned update is ``m'.astype(p.dtype).astype(m.dtype) - p``
  (fp32), so that ``optax.apply_updates(params, updates)`` equals
  ``m'.astype(p.dtype)`` bit for bit. Leaves already in ``master_dtype`` carry
  no copy: the inner update is returned for them unchanged.

  The master follows the param: where ``p`` is not the master's rounding
  (params written from outside after ``init``: a checkpoint or pretrained
  weights loaded into the model), the step starts from ``p`` instead of the
  stale master, so the load is not reverted (one compare per element; in a
  run only the optimizer writes it changes no bit;
  docs/algorithms.md#wrappers).

  With ``split=True`` (fp32 master, bf16 leaves) the master is not stored as a
  second fp32 array: the bf16 param is its high half (``rounding.split_f32``:
  nearest, ties away from zero) and an int16 buffer holds the low 16 bits, so
  ``m = join(p, lo)`` is exact at 2 bytes/param. Non-bf16 16-bit leaves (fp16)
  fall back to a full fp32 copy.

  Args:
    inner: the transformation to run on the master params (e.g.
      ``optax.adam(1e-3)`` or an ``optax.chain``).
    master_dtype: dtype of the master copy (a float type).
    split: store the fp32 master of bf16 leaves as param + int16 low half.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is
    ``MasterWeightsState``. ``update`` requires ``params``.

  Example:
    SGD steps of ``-1e-3`` are below half a bf16 ULP at 1.0: on the bf16
    param they are lost, the fp32 master adds them up until the param moves:

    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.master_weights(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> for _ in range(3):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> print(params["w"].dtype, float(params["w"][0]), round(float(state.master["w"][0]), 4))
    bfloat16 0.99609375 0.997

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018 (an fp32 master copy of
    fp16 weights)

    NVIDIA NeMo, ``MainParamsOptimizerWrapper``, `github.com/NVIDIA/NeMo
    <https://github.com/NVIDIA/NeMo>`_ (fp32 main params for any optimizer)
  """
  _validate_inner("master_weights", inner)
  master_dtype = jnp.dtype(master_dtype)
  if not jnp.issubdtype(master_dtype, jnp.floating):
    raise ValueError(f"master_dtype must be a float dtype; got {master_dtype}.")
  if split and master_dtype != jnp.float32:
    raise ValueError(
        "master_weights(split=True) stores an fp32 master as a bf16 high half plus "
        f"int16 low half; it needs master_dtype=float32, got {master_dtype}.")

  def role(dtype):
    return _DIRECT if dtype.itemsize >= master_dtype.itemsize else _LOW

  def is_split(p):
    return split and p.dtype == jnp.bfloat16

  def init_buffer(p):
    if is_split(p):
      return zeros_like_param(p, jnp.int16)  # bf16 -> fp32 is exact: lo = 0
    return p.astype(master_dtype)

  def read(p, buf):
    if is_split(p):
      return rounding.join_f32(p, buf)
    # The master follows the param: where the param is not the master's
    # rounding (written from outside: a checkpoint loaded into the model
    # after init), the step starts from the param (docs/algorithms.md#wrappers).
    # `widen`: XLA must not fold the round trip through p.dtype away.
    p_wide = rounding.widen(p).astype(master_dtype)
    return jnp.where(rounding.widen(buf.astype(p.dtype)).astype(master_dtype) == p_wide,
                     buf, p_wide)

  def write(x_new, p, buf, leaf, ctx):
    if is_split(p):
      return rounding.split_f32(x_new)
    return x_new.astype(p.dtype), x_new

  init_fn, step = _lowp_wrapper(
      "master_weights", inner, role=role, work_dtype=lambda _: master_dtype,
      init_buffer=init_buffer, read=read, write=write,
      nested_ok=master_dtype.itemsize < 4)

  def init(params):
    return MasterWeightsState(*init_fn(params))

  def update(updates, state, params=None, **extra_args):
    updates, master, inner_state = step(
        updates, state.master, state.inner_state, params, None, **extra_args)
    return updates, MasterWeightsState(master, inner_state)

  return transformation(init, update, "master_weights")


def kahan_summation(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  r"""Kahan-compensated 16-bit params: a compensation buffer in the param dtype.

  For each 16-bit leaf ``p`` with compensation ``c`` (same dtype), in fp32:

  .. math::
     x = p + c,\quad (u, s') = \mathrm{inner}(g, s, x),\quad x' = x + u,\quad
     p' = \mathrm{round}(x'),\quad c' = \mathrm{round}(x' - p')

  ``x' - p'`` is exact in fp32; rounding it to the param dtype keeps ~8 (bf16)
  or ~11 (fp16) more bits of the weight than ``p`` alone. The returned fp32
  updates make ``optax.apply_updates`` land on ``p'`` bit for bit. 32-bit
  leaves get no buffer.

  Args:
    inner: the transformation to run on the compensated params.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``KahanSummationState``.
    ``update`` requires ``params``.

  Example:
    SGD steps of ``-1e-3`` are below half a bf16 ULP at 1.0; the
    compensation keeps what rounding loses until the param moves:

    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.kahan_summation(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> float(params["w"][0]), round(float(state.compensation["w"][0]), 5)
    (1.0, -0.001)
    >>> for _ in range(2):
    ...   updates, state = tx.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> float(params["w"][0])
    0.99609375

  References:
    Kahan, `Further remarks on reducing truncation errors
    <https://doi.org/10.1145/363707.363723>`_, Communications of the ACM, 1965

    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (Kahan summation for bf16
    weight updates)
  """
  _validate_inner("kahan_summation", inner)

  def write(x_new, p, buf, leaf, ctx):
    new_p = x_new.astype(p.dtype)
    # `widen`, not astype: an excess-precision rewrite would make this 0.
    return new_p, (x_new - rounding.widen(new_p)).astype(p.dtype)

  init_fn, step = _lowp_wrapper(
      "kahan_summation", inner,
      role=lambda dtype: _DIRECT if dtype.itemsize >= 4 else _LOW,
      work_dtype=lambda _: jnp.float32,
      init_buffer=zeros_like_param,
      read=lambda p, c: rounding.widen(p) + rounding.widen(c),
      write=write)

  def init(params):
    return KahanSummationState(*init_fn(params))

  # An inner transformation may step its 16-bit leaves and their compensation
  # in one kernel pass (scaled_adam on CPU: the same bits), and then write
  # the new params into their buffers (update_and_apply).
  fused = getattr(inner, "kahan_update", None)

  def update(updates, state, params=None, **extra_args):
    updates, comp, inner_state = step(
        updates, state.compensation, state.inner_state, params, None, fused=fused,
        **extra_args)
    return updates, KahanSummationState(comp, inner_state)

  tx = transformation(init, update, "kahan_summation")
  if fused is None:
    return tx

  def update_and_apply(updates, state, params, **extra_args):
    new_params, comp, inner_state = step(
        updates, state.compensation, state.inner_state, params, None, fused=fused,
        in_place=True, **extra_args)
    return new_params, KahanSummationState(comp, inner_state)

  return _in_place.register(tx, update_and_apply)


def stochastic_rounding(inner: optax.GradientTransformation,
                        key) -> optax.GradientTransformationExtraArgs:
  r"""Stochastically rounded 16-bit params: unbiased, no extra buffer.

  For each 16-bit leaf, in fp32: ``x = p``, ``x' = x + u``,
  ``p' = stochastic_round(x')`` with bits
  ``random_bits(seed, count, STREAM_PARAMS, leaf, shape)``
  (``rounding.random_bits``), so ``E[p'] = x'``. ``count`` advances every step;
  results are deterministic given ``key`` and reproducible in ``torch_bridge``
  for an integer key.

  Args:
    inner: the transformation to run on the fp32 view of the params.
    key: a Python int or a JAX PRNG key (required: the random bits are a
      function of it; ``adamw_bf16(compensation="stochastic")`` defaults to
      seed 0).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``StochasticRoundingState``.
    ``update`` requires ``params``.

  Example:
    An SGD step of ``-1e-3`` is a quarter of a bf16 ULP below 1.0: about a
    quarter of the elements move down one ULP, the mean follows the update:

    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.stochastic_rounding(optax.sgd(1e-3), key=0)
    >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(1000, jnp.bfloat16)}, state, params)
    >>> w = optax.apply_updates(params, updates)["w"]
    >>> sorted(set(w.tolist())), round(float(w.astype(jnp.float32).mean()), 3)
    ([0.99609375, 1.0], 0.999)

  References:
    Gupta et al., `Deep Learning with Limited Numerical Precision
    <https://arxiv.org/abs/1502.02551>`_, ICML 2015

    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (stochastic rounding of bf16
    weight updates)
  """
  _validate_inner("stochastic_rounding", inner)
  if key is None:
    raise ValueError(
        "stochastic_rounding needs a key: pass key=<int seed> (an int gives the same "
        "random bits in optax_half and torch_bridge; optax_half also takes a jax.random.key).")
  seed_from_key(key)  # a bad key fails here, not at init

  def write(x_new, p, buf, leaf, ctx):
    seed, count = ctx
    bits = rounding.random_bits(seed, count, rounding.STREAM_PARAMS, leaf, x_new.shape)
    return rounding.stochastic_round(x_new, p.dtype, bits), buf

  init_fn, step = _lowp_wrapper(
      "stochastic_rounding", inner,
      role=lambda dtype: _DIRECT if dtype.itemsize >= 4 else _LOW,
      work_dtype=lambda _: jnp.float32,
      init_buffer=lambda p: MaskedNode(),
      read=lambda p, buf: rounding.widen(p),
      write=write)

  def init(params):
    _, inner_state = init_fn(params)
    return StochasticRoundingState(seed_from_key(key), jnp.zeros([], jnp.int32), inner_state)

  def update(updates, state, params=None, **extra_args):
    ctx = (state.seed, state.count)
    updates, _, inner_state = step(
        updates, None, state.inner_state, params, ctx, **extra_args)
    return updates, StochasticRoundingState(
        state.seed, optax.safe_increment(state.count), inner_state)

  return transformation(init, update, "stochastic_rounding")


def round_to_nearest(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """No compensation: ``p' = round_nearest(p + u)`` with fp32 ``u``.

  The baseline the other wrappers cure: an update smaller than half a ULP of
  ``p`` is lost. The inner transformation still sees fp32 grads and params,
  and non-float leaves are masked like in the other wrappers. Used by
  ``adamw_bf16(compensation="none")``.

  Args:
    inner: the transformation to run on the fp32 view of the params.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``RoundToNearestState``.
    ``update`` requires ``params``.

  Example:
    SGD steps of ``-1e-3`` are below half a bf16 ULP at 1.0: every one of
    them is lost (the stale weights the other wrappers cure):

    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.round_to_nearest(optax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(3):
    ...   updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> float(params["w"][0])
    1.0

  References:
    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020 (why nearest rounding of bf16
    weight updates stalls)
  """
  _validate_inner("round_to_nearest", inner)

  init_fn, step = _lowp_wrapper(
      "round_to_nearest", inner,
      role=lambda dtype: _DIRECT if dtype.itemsize >= 4 else _LOW,
      work_dtype=lambda _: jnp.float32,
      init_buffer=lambda p: MaskedNode(),
      read=lambda p, buf: rounding.widen(p),
      write=lambda x_new, p, buf, leaf, ctx: (x_new.astype(p.dtype), buf))

  def init(params):
    return RoundToNearestState(init_fn(params)[1])

  def update(updates, state, params=None, **extra_args):
    updates, _, inner_state = step(updates, None, state.inner_state, params, None,
                                   **extra_args)
    return updates, RoundToNearestState(inner_state)

  return transformation(init, update, "round_to_nearest")
