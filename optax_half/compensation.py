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
           "StochasticRoundingState", "RoundToNearestState"]


class MasterWeightsState(NamedTuple):
  """State of ``master_weights``.

  Attributes:
    master: per leaf, the ``master_dtype`` copy; with ``split=True`` the int16
      low half for bf16 leaves; ``MaskedNode()`` for leaves without a buffer.
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

  def write(self, x_new, p, buf, bits):
    """``(u, p_land, buf')``: the update in ``p``'s dtype towards this compensation's
    rounding of ``x_new``, the param it lands on, and the buffer written against that
    param (docs/algorithms.md#landing-exactly); ``bits`` where ``draws_bits``, else None."""
    return (*rounding.land(p, x_new.astype(p.dtype)), buf)

  def init_state(self, buffers, inner_state, seed: Optional[jax.Array]):
    fields = {"inner_state": inner_state}
    if self.spec.buffer:
      fields[self.spec.buffer] = buffers
    if self.spec.draws_bits:
      fields.update(seed=seed, rng_count=jnp.zeros([], jnp.int32))
    return self.state_type(**fields)

  def buffers(self, state):
    """The per-leaf buffers of ``state`` (None: this compensation keeps none)."""
    return getattr(state, self.spec.buffer) if self.spec.buffer else None

  def param_stream(self, state):
    """``(seed, rng_count)`` of the param writes' random bits, or None."""
    return (state.seed, state.rng_count) if self.spec.draws_bits else None

  def next_state(self, state, buffers, inner_state):
    """``state`` after a step: the new buffers and inner state, the count advanced."""
    fields = {"inner_state": inner_state}
    if self.spec.buffer:
      fields[self.spec.buffer] = buffers
    if self.spec.draws_bits:
      fields["rng_count"] = optax.safe_increment(state.rng_count)
    return state._replace(**fields)


class _Master(Compensation):
  state_type = MasterWeightsState

  def init_buffer(self, p, master_dtype):
    return p.astype(master_dtype)

  def read(self, p, buf):
    # Follows outside writes (docs/algorithms.md#wrappers); `widen`: XLA keeps the round trip.
    p_wide = rounding.widen(p).astype(buf.dtype)
    return jnp.where(rounding.widen(buf.astype(p.dtype)).astype(buf.dtype) == p_wide,
                     buf, p_wide)

  def write(self, x_new, p, buf, bits):
    target = x_new.astype(p.dtype)
    u, p_land = rounding.land(p, target)
    # Where the param did not land on x_new's rounding, the master is the param (the
    # read rule would take it up next step anyway): the param stays the master's rounding.
    landed = rounding.widen(p_land)
    return u, p_land, jnp.where(landed == rounding.widen(target), x_new, landed.astype(x_new.dtype))


class _Split(Compensation):
  state_type = MasterWeightsState

  def init_buffer(self, p, master_dtype):
    return zeros_like_param(p, jnp.int16)  # bf16 -> fp32 is exact: lo = 0

  def read(self, p, buf):
    return rounding.join_f32(p, buf)

  def write(self, x_new, p, buf, bits):
    hi, _ = rounding.split_f32(x_new)
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

  def write(self, x_new, p, buf, bits):
    u, p_land = rounding.land(p, x_new.astype(p.dtype))
    # Against what landed: `widen`, not astype (an excess-precision rewrite would make this 0).
    return u, p_land, (x_new - rounding.widen(p_land)).astype(p.dtype)


class _Stochastic(Compensation):
  state_type = StochasticRoundingState

  def write(self, x_new, p, buf, bits):
    return (*rounding.land(p, rounding.stochastic_round(x_new, p.dtype, bits)), buf)


class _Nearest(Compensation):
  state_type = RoundToNearestState


COMPENSATIONS = {name: rules(native_lib.COMPENSATIONS[name]) for name, rules in (
    ("kahan", _Kahan), ("split", _Split), ("stochastic", _Stochastic), ("none", _Nearest),
    ("master", _Master))}
assert set(COMPENSATIONS) == set(native_lib.COMPENSATIONS)
# A wrapper state -> the field of its per-leaf buffers (also the torch state key).
BUFFER_FIELDS = {c.state_type: c.buffer for c in COMPENSATIONS.values() if c.buffer}
