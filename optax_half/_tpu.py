"""``adamw_bf16``'s step on TPU: one Pallas kernel per leaf that reads the leaf's param,
gradient, moments and buffer once and writes each output once, with the spec's bits
(docs/algorithms.md#xlatpu-without-a-tpu). XLA:TPU splits the same step into two fusions a
leaf, and both read the largest leaves' streams from HBM."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from optax import MaskedNode

from optax_half import rounding
from optax_half._coefficients import Coefficients, _is_zero, adamw_leaf, coefficients

BLOCK = 1 << 16  # elements a block (128 KB of a bf16 stream in VMEM)
LANES = 128  # a block's columns: all of a leaf's last dimension, or a multiple of this
WIDE = 4096  # a last dimension up to this is one block wide
COMPENSATIONS = ("kahan", "stochastic", "none")  # the compensations the kernel steps
_STREAMS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _shape2d(shape) -> tuple:
  """The leaf as the kernel sees it: its rows (the leading dimensions together) and its
  last dimension, the layout XLA:TPU already tiles it by (a 1-D or 0-D leaf: one row)."""
  shape = tuple(int(d) for d in shape)
  if len(shape) < 2:
    return 1, math.prod(shape)
  return math.prod(shape[:-1]), shape[-1]


def _block(rows: int, cols: int):
  """A block's (rows, columns), or None: the whole last dimension up to ``WIDE`` (else
  ``WIDE / 2`` of it, where it is a multiple of ``LANES``; a single row up to ``4 * BLOCK``
  is one block), and rows by 16 (the bf16 tile) up to ``BLOCK`` elements, or all of them."""
  if cols > WIDE:
    if cols % LANES:
      return (1, cols) if rows == 1 and cols <= 4 * BLOCK else None
    cols = WIDE // 2
  block_rows = max(16, BLOCK // cols // 16 * 16)
  return min(rows, block_rows), cols


def takes(compensation, params, grads, core) -> bool:
  """Whether the kernel steps this tree (trace time): bf16 params, bf16 or fp32 gradients
  and moments of the params' shapes, a compensation of ``COMPENSATIONS``, and every leaf
  one that ``_block`` can cut."""
  if compensation.name not in COMPENSATIONS:
    return False
  leaves = jax.tree.leaves(params)
  others = [jax.tree.leaves(t) for t in (grads, core.mu, core.nu)]
  if not leaves or any(len(o) != len(leaves) for o in others):
    return False
  for p, *gmv in zip(leaves, *others):
    if jnp.dtype(p.dtype) != jnp.bfloat16 or not np.size(p) or _block(
        *_shape2d(np.shape(p))) is None:
      return False
    if any(np.shape(x) != np.shape(p) or jnp.dtype(x.dtype) not in _STREAMS for x in gmv):
      return False
  return True


def _kernel(rules, decay: bool, m_dtype, v_dtype, state_rounding: str, has_buffer: bool,
            in_place: bool, cols: int, leaf: int):
  """The step of one block: ``adamw_leaf`` (``scale_by_adamw``'s) between the wrapper's
  ``read`` and ``write``, as ``wrappers._engine``'s step takes them, the random bits counted
  by the element's index in its leaf."""
  from jax.experimental import pallas as pl  # noqa: PLC0415 (imported when a kernel is made)
  stochastic_moments = rounding._stochastic_moments(m_dtype, v_dtype, state_rounding)

  def kernel(s_ref, k_ref, p_ref, g_ref, m_ref, v_ref, *refs):
    b_ref, outs = (refs[0], refs[1:]) if has_buffer else (None, refs)
    # k_ref: every leaf's (param key, moment key, mark) in a row, then no_fma's zero
    key_p, key_m = k_ref[3 * leaf], k_ref[3 * leaf + 1]
    c = Coefficients(*(s_ref[j] for j in range(9)), k_ref[k_ref.shape[0] - 1])
    shape = p_ref.shape
    row = (pl.program_id(0) * shape[0]).astype(jnp.uint32) + lax.broadcasted_iota(
        jnp.uint32, shape, 0)
    col = (pl.program_id(1) * shape[1]).astype(jnp.uint32) + lax.broadcasted_iota(
        jnp.uint32, shape, 1)
    index = row * jnp.uint32(cols) + col  # the element's row-major index in its leaf
    p = p_ref[...]
    buf = b_ref[...] if has_buffer else MaskedNode()
    x = rules.read(p, buf)
    u, m32, v32 = adamw_leaf(c, g_ref[...], m_ref[...], v_ref[...], x, decay)
    u = u.astype(x.dtype)
    m_new, v_new = rounding.round_moments(
        m32, v32, m_dtype, v_dtype, state_rounding,
        bits=rounding.mix32(index ^ key_m) if stochastic_moments else None)
    x_new = (x + u).astype(x.dtype)
    bits = rounding.mix32(index ^ key_p) if rules.draws_bits else None
    u_p, p_land, buf_new = rules.write(x_new, p, buf, bits, in_place)
    outs[0][...] = p_land if in_place else u_p
    outs[1][...] = m_new
    outs[2][...] = v_new
    if has_buffer:
      outs[3][...] = buf_new
  return kernel


def _leaf(rules, decay, state_rounding, scalars, keys, leaf, p, g, m, v, b, in_place,
          interpret):
  """(param or update, m, v, buffer or None) of one leaf, each written in place."""
  from jax.experimental import pallas as pl  # noqa: PLC0415 (0.3 s to import: when used)
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
  rows, cols = _shape2d(np.shape(p))
  block = _block(rows, cols)
  has_buffer = b is not None
  arrays = [x.reshape(rows, cols) for x in (p, g, m, v, *([b] if has_buffer else []))]
  out_shape = [jax.ShapeDtypeStruct((rows, cols), x.dtype)
               for x in (arrays[0], *arrays[2:])]
  # Operands: scalars, keys, p, g, m, v, buffer; outputs: p (or u), m, v, buffer.
  aliases = {4: 1, 5: 2, **({6: 3} if has_buffer else {}), **({2: 0} if in_place else {})}
  spec = pl.BlockSpec(block, lambda i, j: (i, j))
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  out = pl.pallas_call(
      _kernel(rules, decay, m.dtype, v.dtype, state_rounding, has_buffer, in_place, cols, leaf),
      grid=(math.ceil(rows / block[0]), math.ceil(cols / block[1])),
      in_specs=[smem, smem] + [spec] * len(arrays), out_specs=[spec] * len(out_shape),
      out_shape=out_shape, input_output_aliases=aliases, interpret=interpret)(
          scalars, keys, *arrays)
  out = [x.reshape(np.shape(p)) for x in out]
  return (*out, None) if not has_buffer else tuple(out)


def update(compensation, hyperparams, state_rounding, updates, state, params, in_place,
           keys, decays=None, interpret=False):
  """``adamw_bf16``'s step over a tree ``takes`` accepts, a kernel per leaf: the trees of
  (new params or updates, mu, nu, buffers or None). ``keys``: ``_native._keys``'s uint32
  rows, per leaf (param stream key, moment stream key, mark); ``decays``: per leaf, whether
  weight decay applies (None: all); ``interpret``: Pallas's interpreter (tests, on CPU)."""
  leaves, treedef = jax.tree.flatten(params)
  core = state.inner_state
  grads, mus, nus = (treedef.flatten_up_to(t) for t in (updates, core.mu, core.nu))
  buffers = (treedef.flatten_up_to(compensation.leaf_buffers(state)) if compensation.buffer
             else [None] * len(leaves))
  c = coefficients(*hyperparams, core.count)
  scalars = jnp.stack(list(c[:9])).astype(jnp.float32)
  # Every leaf's keys in a row, hashed as one vector, then no_fma's zero: each kernel reads
  # its own row (no scalar ops a leaf outside the kernels).
  keys = jnp.concatenate([keys.ravel(), c.zero[None]])
  rules = compensation.for_dtype(jnp.bfloat16)
  outs = []
  for k, (p, g, m, v, b) in enumerate(zip(leaves, grads, mus, nus, buffers)):
    decay = (decays is None or decays[k]) and not _is_zero(hyperparams[4])
    outs.append(_leaf(rules, decay, state_rounding, scalars, keys, k, p, g, m, v,
                      None if isinstance(b, MaskedNode) else b, in_place, interpret))
  p_out, mu, nu, bufs = ([o[i] for o in outs] for i in range(4))
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
  return unflat(p_out), unflat(mu), unflat(nu), unflat(bufs) if compensation.buffer else None
