"""Compensations in JAX: the rules (state, buffer ``init``, ``read``, ``write``) of each
``optax_half_native.COMPENSATIONS`` entry. Spec: ``docs/algorithms.md#wrappers``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from optax import MaskedNode

import optax_half_native as native_lib
from optax_half import rounding
from optax_half._util import zeros_like_param

__all__ = ["BUFFER_FIELDS", "COMPENSATIONS", "Compensation", "MasterWeightsState", "KahanSummationState",
           "StochasticRoundingState", "RoundToNearestState", "landing_mark"]


def landing_mark(p: jax.Array, where: jax.Array) -> jax.Array:
  """The uint32 mark of ``p``'s elements where ``where``: the wrapping sum over them of
  ``mix32(i ^ mix32(bits | 0x10000))``, ``i`` the row-major index and ``bits`` the
  element's bits, 0xFFFF for every NaN (docs/algorithms.md#landing-exactly). 0 where
  ``where`` is all False.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_half.compensation import landing_mark
    >>> p = jnp.array([1.0, -2.0, 0.5], jnp.bfloat16)
    >>> int(landing_mark(p, jnp.array([False, False, False])))
    0
    >>> a = landing_mark(p, jnp.array([False, True, False]))
    >>> bool(a != 0), bool(a != landing_mark(p.at[1].set(-3.0), jnp.array([False, True, False])))
    (True, True)
  """
  return _landing_mark(jnp.asarray(p), jnp.asarray(where))


@rounding._traced_once  # traced once per shape and dtype, as rounding's helpers
def _landing_mark(p: jax.Array, where: jax.Array) -> jax.Array:
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[p.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(p, unsigned).astype(jnp.uint32)
  bits = jnp.where(jnp.isnan(p), jnp.uint32(0xFFFF), bits)  # every NaN alike
  index = jax.lax.iota(jnp.uint32, p.size).reshape(p.shape)
  marks = rounding.mix32(index ^ rounding.mix32(bits | jnp.uint32(0x10000)))
  return jnp.sum(jnp.where(where, marks, jnp.uint32(0)), dtype=jnp.uint32)


class MasterWeightsState(NamedTuple):
  """State of ``master_weights``.

  Attributes:
    master: per leaf, the ``master_dtype`` copy; with ``split=True`` the int16
      low half for bf16 leaves; ``MaskedNode()`` for leaves without a buffer.
    missed: per leaf with a full master copy, a uint32 scalar: the mark
      (``landing_mark``) of the params where the last update landed off the
      master's rounding, 0 where none did; ``MaskedNode()`` for other leaves.
      The next step keeps the master there (docs/algorithms.md#landing-exactly).
    inner_state: the inner transformation's state, built on the master params.

  Example:
    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
    >>> state = oh.master_weights(optax.sgd(0.1)).init(params)
    >>> print(state.master["w"].dtype, state.master["b"])  # fp32 leaves: no copy
    float32 MaskedNode()
    >>> split = oh.master_weights(optax.sgd(0.1), split=True).init(params)
    >>> print(split.master["w"].dtype)  # the low half of the fp32 master
    int16
  """
  lands_exactly = True  # its update lands exactly: nothing may rescale it after
  master: Any
  missed: Any
  inner_state: Any


class KahanSummationState(NamedTuple):
  """State of ``kahan_summation``: compensation ``c`` in the param dtype.

  Attributes:
    compensation: per 16-bit leaf, what rounding the param lost (``x' - p'``),
      in the param dtype; ``MaskedNode()`` for leaves without a buffer.
    inner_state: the inner transformation's state.

  Example:
    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.kahan_summation(optax.sgd(0.1)).init(params)
    >>> print(state.compensation["w"].dtype, state.compensation["w"].tolist())
    bfloat16 [0.0, 0.0, 0.0]
  """
  lands_exactly = True  # its update lands exactly: nothing may rescale it after
  compensation: Any
  inner_state: Any


class RoundToNearestState(NamedTuple):
  """State of ``round_to_nearest``: only the inner state.

  Example:
    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.round_to_nearest(optax.adam(1e-3)).init(params)
    >>> print(state.inner_state[0].mu["w"].dtype)  # the inner state, on fp32
    float32
  """
  lands_exactly = True  # its update lands exactly: nothing may rescale it after
  inner_state: Any


class StochasticRoundingState(NamedTuple):
  """State of ``stochastic_rounding``.

  Attributes:
    seed: uint32 scalar; with ``rng_count`` it determines every random bit.
    rng_count: int32 number of updates taken (not ``count``, so that
      ``optax.tree_utils.tree_get(state, "count")`` finds the inner step count).
    inner_state: the inner transformation's state.

  Example:
    >>> import jax.numpy as jnp, optax, optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.stochastic_rounding(optax.sgd(0.1), key=7).init(params)
    >>> print(state.seed.dtype, int(state.rng_count))
    uint32 0
  """
  lands_exactly = True  # its update lands exactly: nothing may rescale it after
  seed: jax.Array
  rng_count: jax.Array
  inner_state: Any


class Compensation(native_lib.Rules):
  """A compensation's JAX rules; ``spec``'s shared facts read as attributes."""

  state_type: type = None  # the wrapper state holding the buffers
  marks = False  # whether a leaf's buffer holds the marks of missed landings (a full master)

  def for_dtype(self, dtype) -> Compensation:
    """The compensation a 16-bit param of ``dtype`` takes (not bf16: ``spec.fp16``)."""
    return self if jnp.dtype(dtype) == jnp.bfloat16 else COMPENSATIONS[self.spec.fp16]

  def buffer_dtype_of(self, dtype, master_dtype=jnp.float32):
    """The dtype of the buffer a 16-bit param of ``dtype`` keeps, or None."""
    kind = self.spec.buffer_dtype
    return None if kind is None else jnp.dtype(
        {"param": dtype, "int16": jnp.int16, "float32": master_dtype}[kind])

  def init_buffer(self, p, master_dtype):
    """The buffer of a fresh state for 16-bit ``p``, or ``MaskedNode()``."""
    return MaskedNode()

  def read(self, p, buf):
    """The working value ``x`` the optimizer steps (fp32, or ``master_dtype``)."""
    return rounding.widen(p)

  def write(self, x_new, p, buf, bits, in_place=False):
    """``(u, p_land, buf')``: the update in ``p``'s dtype towards this compensation's
    rounding of ``x_new``, the param it lands on, and the buffer written against that
    param (docs/algorithms.md#landing-exactly); ``bits`` where ``draws_bits``, else None.
    ``in_place``: the param is written, not updated (a master's step then lands on its
    target: ``holds_value``)."""
    return (*rounding.land(p, x_new.astype(p.dtype)), buf)

  def init_state(self, buffers, inner_state, seed: Optional[jax.Array]):
    """A fresh state; ``buffers`` per leaf as ``leaf_buffers`` gives them."""
    fields = {"inner_state": inner_state}
    if self.spec.buffer:
      fields.update(self._fields_of(buffers))
    if self.spec.draws_bits:
      fields.update(seed=seed, rng_count=jnp.zeros([], jnp.int32))
    return self.state_type(**fields)

  def buffers(self, state):
    """The per-leaf buffers of ``state`` (None: this compensation keeps none)."""
    return getattr(state, self.spec.buffer) if self.spec.buffer else None

  def leaf_buffers(self, state):
    """Per leaf, the buffer ``read`` and ``write`` take (None: none kept)."""
    return self.buffers(state)

  def _fields_of(self, buffers) -> dict:
    """The state fields holding ``buffers`` (per leaf as ``leaf_buffers`` gives them)."""
    return {self.spec.buffer: buffers}

  def param_stream(self, state):
    """``(seed, rng_count)`` of the param writes' random bits, or None."""
    return (state.seed, state.rng_count) if self.spec.draws_bits else None

  def next_state(self, state, buffers, inner_state):
    """``state`` after a step: the new buffers and inner state, the count advanced."""
    fields = {"inner_state": inner_state}
    if self.spec.buffer:
      fields.update(self._fields_of(buffers))
    if self.spec.draws_bits:
      fields["rng_count"] = optax.safe_increment(state.rng_count)
    return state._replace(**fields)


class MasterBuffer(NamedTuple):
  """A full master's per-leaf buffer as ``read`` and ``write`` take it."""
  master: jax.Array
  missed: jax.Array  # uint32 scalar: MasterWeightsState.missed


def _is_pair(b) -> bool:
  return isinstance(b, MasterBuffer)


def _leaf(b) -> bool:
  return isinstance(b, (MasterBuffer, MaskedNode))


class _MasterState(Compensation):
  """The rules of ``MasterWeightsState``: a full master's leaf buffer is the pair
  ``(master, missed)``, split's the low half alone."""
  state_type = MasterWeightsState

  def leaf_buffers(self, state):
    return jax.tree.map(lambda m, f: m if isinstance(f, MaskedNode) else MasterBuffer(m, f),
                        state.master, state.missed,
                        is_leaf=lambda x: isinstance(x, MaskedNode))

  def _fields_of(self, buffers) -> dict:
    pick = lambda k, other: jax.tree.map(  # noqa: E731
        lambda b: b[k] if _is_pair(b) else other(b), buffers, is_leaf=_leaf)
    return {"master": pick(0, lambda b: b), "missed": pick(1, lambda b: MaskedNode())}


def kept(p, master, missed) -> jax.Array:
  """Whether ``master`` is kept where ``p`` is not its rounding: the elements that are not
  are exactly those the last update missed, by their mark ``missed`` (nonzero), so nothing
  was written into ``p`` from outside since (docs/algorithms.md#landing-exactly)."""
  return _keeps(missed, _mark_of(p, master))


@rounding._traced_once
def _mark_of(p, master) -> jax.Array:
  """The mark of the elements where ``p`` is not ``master``'s rounding."""
  return _landing_mark(p, _differ(master.astype(p.dtype), p))


def _keeps(missed, marks) -> jax.Array:
  """The rule: the master is kept where it holds a mark that the elements it
  does not round to give again."""
  return (missed != 0) & (marks == missed)


def kept_leaves(leaves) -> tuple[list, list]:
  """``kept(p, master, missed)`` of each ``(p, master, missed)`` in ``leaves``, and its mark
  after an in-place step. The marks are checked only where some leaf holds any (one
  ``lax.cond`` for the tree): after a step in which every landing was exact (every in-place
  step) none does, and the step reads each param and master once, not again in a reduction
  (docs/algorithms.md#landing-exactly). The new marks (0: an in-place step lands exactly)
  are the old ones cleared as one vector, which XLA:GPU writes in one fusion; a constant 0
  a leaf is a copy kernel a leaf (docs/algorithms.md#xlagpu-without-a-gpu)."""
  if not leaves:
    return [], []
  # The old marks as one array (materialized: read one by one after the step writes the new
  # ones into their buffers, XLA would first copy each).
  missed = jax.lax.optimization_barrier(jnp.stack([m for _, _, m in leaves]))
  any_marked = (missed != 0).any()
  marks = jax.lax.cond(
      any_marked,
      lambda: jnp.stack([_mark_of(p, master) for p, master, _ in leaves]),
      lambda: jnp.zeros_like(missed))
  keep = _keeps(missed, marks)
  cleared = jnp.where(any_marked, jnp.zeros_like(missed), missed)  # 0: unmarked, missed is 0
  return [keep[k] for k in range(len(leaves))], [cleared[k] for k in range(len(leaves))]


@rounding._traced_once
def _differ(a, b) -> jax.Array:
  """Where two 16-bit arrays hold other values (-0 and +0 alike, a NaN like any NaN)."""
  a, b = rounding.widen(a), rounding.widen(b)
  return (a != b) & ~(jnp.isnan(a) & jnp.isnan(b))


class _Master(_MasterState):
  def init_buffer(self, p, master_dtype):
    return MasterBuffer(p.astype(master_dtype), jnp.zeros((), jnp.uint32))

  marks = True  # its buffer is (master, missed): `read` takes `kept_leaves`' flag

  def read(self, p, buf, keep=None):
    # Follows outside writes, and keeps the master where the last update missed
    # (docs/algorithms.md#wrappers); `widen`: XLA keeps the round trip. `keep`: the leaf's
    # `kept`, computed here if not given.
    master, missed = buf
    keep = kept(p, master, missed) if keep is None else keep
    p_wide = rounding.widen(p).astype(master.dtype)
    return jnp.where(keep
                     | (rounding.widen(master.astype(p.dtype)).astype(master.dtype) == p_wide),
                     master, p_wide)

  def write(self, x_new, p, buf, bits, in_place=False):
    target = x_new.astype(p.dtype)
    if in_place:  # the param is written: the master's rounding
      return None, target, MasterBuffer(x_new, jnp.zeros((), jnp.uint32))
    # The master is x_new, never rounded; the elements where p + u misses its rounding are
    # marked, and the next step keeps the master there.
    u, p_land = rounding.land_master(p, target)
    return u, p_land, MasterBuffer(x_new, _landing_mark(p_land, _differ(p_land, target)))


class _Split(_MasterState):

  def init_buffer(self, p, master_dtype):
    return zeros_like_param(p, jnp.int16)  # bf16 -> fp32 is exact: lo = 0

  def read(self, p, buf):
    return rounding.join_f32(p, buf)

  def write(self, x_new, p, buf, bits, in_place=False):
    hi, lo = rounding.split_f32(x_new)
    if in_place:  # the param is written: the high half, the master exactly
      return None, hi, lo
    u, p_land = rounding.land(p, hi)
    # As the full master: where the param landed elsewhere, the master is the param (lo = 0).
    landed = rounding.widen(p_land)
    return u, p_land, rounding.split_f32(jnp.where(landed == rounding.widen(hi), x_new, landed))[1]


class _Kahan(Compensation):
  state_type = KahanSummationState

  def init_buffer(self, p, master_dtype):
    return zeros_like_param(p)

  def read(self, p, buf):
    return rounding.widen(p) + rounding.widen(buf)

  def write(self, x_new, p, buf, bits, in_place=False):
    u, p_land = rounding.land(p, x_new.astype(p.dtype))
    # Against what landed: `widen`, not astype (an excess-precision rewrite would make this 0).
    return u, p_land, (x_new - rounding.widen(p_land)).astype(p.dtype)


class _Stochastic(Compensation):
  state_type = StochasticRoundingState

  def write(self, x_new, p, buf, bits, in_place=False):
    return (*rounding.land(p, rounding.stochastic_round(x_new, p.dtype, bits)), buf)


class _Nearest(Compensation):
  state_type = RoundToNearestState


COMPENSATIONS = {name: rules(native_lib.COMPENSATIONS[name]) for name, rules in (
    ("kahan", _Kahan), ("split", _Split), ("stochastic", _Stochastic), ("none", _Nearest),
    ("master", _Master))}
assert set(COMPENSATIONS) == set(native_lib.COMPENSATIONS)
# A wrapper state -> the field of its per-leaf buffers (also the torch state key).
BUFFER_FIELDS = {c.state_type: c.buffer for c in COMPENSATIONS.values() if c.buffer}
