"""What ``adamw_bf16``'s Pallas kernels share (TPU: ``_tpu``, GPU: ``_gpu``): the trees
they step, one block's step (the XLA step's own code between the wrapper's read and
write) and the scalars and keys every kernel reads (docs/algorithms.md#pallas-kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from optax import MaskedNode

from optax_half import rounding
from optax_half._coefficients import (Coefficients, _is_zero, adamw_leaf, coefficients,
                                      invert_bias_corrections)

COMPENSATIONS = ("kahan", "stochastic", "none")  # the compensations the kernels step
_STREAMS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SCALARS = 9  # Coefficients but zero: the f32 operand of every kernel


def takes(compensation, params, grads, core, cuts=lambda shape: True,
          compensations=COMPENSATIONS) -> bool:
  """Whether the kernels step this tree (trace time): bf16 params, bf16 or fp32 gradients
  and moments of the params' shapes, a compensation of ``compensations``, and every
  leaf's shape one the backend ``cuts`` into blocks."""
  if compensation.name not in compensations:
    return False
  leaves = jax.tree.leaves(params)
  others = [jax.tree.leaves(t) for t in (grads, core.mu, core.nu)]
  if not leaves or any(len(o) != len(leaves) for o in others):
    return False
  for p, *gmv in zip(leaves, *others):
    if jnp.dtype(p.dtype) != jnp.bfloat16 or not np.size(p) or not cuts(np.shape(p)):
      return False
    if any(np.shape(x) != np.shape(p) or jnp.dtype(x.dtype) not in _STREAMS for x in gmv):
      return False
  return True


def operands(hyperparams, count, keys, counts=()) -> tuple:
  """The uint32 vector every kernel reads: the step's ``Coefficients`` but ``zero`` (their
  f32 bits, ``SCALARS`` words; the bias corrections uninverted: each kernel divides, by
  IEEE division on a GPU, where XLA:GPU's ``1 / x`` is ``rcp.approx``), every leaf's (param
  key, moment key, mark) in a row (``_native._keys``, hashed as one vector), the state's
  new int32 ``counts`` (if any), then ``zero``. Each kernel reads its own row: no scalar op
  a leaf outside the kernels, and one small operand made for all of them. Returns the vector and
  ``counts`` read back from it (behind an optimization barrier XLA cannot fold): a donated
  count is then written after the vector's read of the old one, where XLA:GPU copied each
  count first (docs/algorithms.md#pallas-kernels)."""
  c = coefficients(*hyperparams, count, invert=False)
  scalars = lax.bitcast_convert_type(jnp.stack(list(c[:SCALARS])).astype(jnp.float32),
                                     jnp.uint32)
  words = [lax.bitcast_convert_type(x, jnp.uint32)[None] for x in counts]
  ops = jnp.concatenate([scalars, keys.ravel(), *words, c.zero[None]])
  if not counts:
    return ops, []
  ops = lax.optimization_barrier(ops)
  start = ops.shape[0] - 1 - len(words)
  return ops, [lax.bitcast_convert_type(ops[start + j], x.dtype) for j, x in enumerate(counts)]


def read_operands(ref, leaf: int, div=None) -> tuple:
  """(``Coefficients``, param key, moment key) of leaf ``leaf``, read from ``operands``;
  the bias corrections inverted by ``div`` (``invert_bias_corrections``)."""
  c = Coefficients(*(lax.bitcast_convert_type(ref[j], jnp.float32) for j in range(SCALARS)),
                   ref[ref.shape[0] - 1])
  return invert_bias_corrections(c, div), ref[SCALARS + 3 * leaf], ref[SCALARS + 3 * leaf + 1]


def decays(hyperparams, leaf_decays, leaf: int) -> bool:
  """Whether leaf ``leaf`` takes the weight-decay term (``leaf_decays``: per leaf, or None)."""
  return (leaf_decays is None or leaf_decays[leaf]) and not _is_zero(hyperparams[4])


def block_step(rules, decay: bool, state_rounding: str, in_place: bool, c, key_p, key_m,
               index, p, g, m, v, buf, div=None, sqrt=None) -> tuple:
  """One block of a leaf: ``adamw_leaf`` (``scale_by_adamw``'s) between the wrapper's
  ``read`` and ``write``, as ``wrappers._engine``'s step takes them, the random bits
  counted by ``index``, each element's row-major index in its leaf. Returns (the landed
  param or the update, m, v, buffer); ``div``/``sqrt``: ``adamw_leaf``'s."""
  m_dtype, v_dtype = m.dtype, v.dtype
  buf = MaskedNode() if buf is None else buf
  x = rules.read(p, buf)
  u, m32, v32 = adamw_leaf(c, g, m, v, x, decay, div=div, sqrt=sqrt)
  u = u.astype(x.dtype)
  stochastic_moments = rounding._stochastic_moments(m_dtype, v_dtype, state_rounding)
  m_new, v_new = rounding.round_moments(
      m32, v32, m_dtype, v_dtype, state_rounding,
      bits=rounding.mix32(index ^ key_m) if stochastic_moments else None)
  x_new = (x + u).astype(x.dtype)
  bits = rounding.mix32(index ^ key_p) if rules.draws_bits else None
  u_p, p_land, buf_new = rules.write(x_new, p, buf, bits, in_place)
  return p_land if in_place else u_p, m_new, v_new, buf_new


def leaves_of(compensation, updates, state, params) -> tuple:
  """(leaves, treedef, grads, mus, nus, buffers): the step's trees flattened by the
  params' (buffers: None a leaf without one)."""
  leaves, treedef = jax.tree.flatten(params)
  core = state.inner_state
  grads, mus, nus = (treedef.flatten_up_to(t) for t in (updates, core.mu, core.nu))
  buffers = (treedef.flatten_up_to(compensation.leaf_buffers(state)) if compensation.buffer
             else [None] * len(leaves))
  buffers = [None if isinstance(b, MaskedNode) else b for b in buffers]
  return leaves, treedef, grads, mus, nus, buffers
