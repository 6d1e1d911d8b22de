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

from optax_half import _pallas

BLOCK = 1 << 16  # elements a block (128 KB of a bf16 stream in VMEM)
LANES = 128  # a block's columns: all of a leaf's last dimension, or a multiple of this
WIDE = 4096  # a last dimension up to this is one block wide


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
  """``_pallas.takes``, every leaf one that ``_block`` can cut."""
  return _pallas.takes(compensation, params, grads, core,
                       lambda shape: _block(*_shape2d(shape)) is not None)


def _kernel(rules, decay: bool, state_rounding: str, has_buffer: bool, in_place: bool,
            cols: int, leaf: int):
  """The step of one (rows, cols) block: ``_pallas.block_step``, each element's index in
  its leaf counted from the block's place in the grid."""
  from jax.experimental import pallas as pl  # noqa: PLC0415 (imported when a kernel is made)

  def kernel(k_ref, p_ref, g_ref, m_ref, v_ref, *refs):
    b_ref, outs = (refs[0], refs[1:]) if has_buffer else (None, refs)
    c, key_p, key_m = _pallas.read_operands(k_ref, leaf)
    shape = p_ref.shape
    row = (pl.program_id(0) * shape[0]).astype(jnp.uint32) + lax.broadcasted_iota(
        jnp.uint32, shape, 0)
    col = (pl.program_id(1) * shape[1]).astype(jnp.uint32) + lax.broadcasted_iota(
        jnp.uint32, shape, 1)
    index = row * jnp.uint32(cols) + col  # the element's row-major index in its leaf
    new = _pallas.block_step(rules, decay, state_rounding, in_place, c, key_p, key_m, index,
                             p_ref[...], g_ref[...], m_ref[...], v_ref[...],
                             b_ref[...] if has_buffer else None)
    for ref, x in zip(outs, new):
      ref[...] = x
  return kernel


def _leaf(rules, decay, state_rounding, keys, leaf, p, g, m, v, b, in_place,
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
  # Operands: keys, p, g, m, v, buffer; outputs: p (or u), m, v, buffer.
  aliases = {3: 1, 4: 2, **({5: 3} if has_buffer else {}), **({1: 0} if in_place else {})}
  spec = pl.BlockSpec(block, lambda i, j: (i, j))
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  out = pl.pallas_call(
      _kernel(rules, decay, state_rounding, has_buffer, in_place, cols, leaf),
      grid=(math.ceil(rows / block[0]), math.ceil(cols / block[1])),
      in_specs=[smem] + [spec] * len(arrays), out_specs=[spec] * len(out_shape),
      out_shape=out_shape, input_output_aliases=aliases, interpret=interpret)(
          keys, *arrays)
  out = [x.reshape(np.shape(p)) for x in out]
  return (*out, None) if not has_buffer else tuple(out)


def update(compensation, hyperparams, state_rounding, updates, state, params, in_place,
           keys, decays=None, interpret=False):
  """``adamw_bf16``'s step over a tree ``takes`` accepts, a kernel per leaf: the trees of
  (new params or updates, mu, nu, buffers or None). ``keys``: ``_pallas.operands``'s
  vector; ``decays``: per leaf, whether weight decay applies (None: all); ``interpret``:
  Pallas's interpreter (tests, on CPU)."""
  leaves, treedef, grads, mus, nus, buffers = _pallas.leaves_of(compensation, updates, state,
                                                                params)
  rules = compensation.for_dtype(jnp.bfloat16)
  outs = [_leaf(rules, _pallas.decays(hyperparams, decays, k), state_rounding, keys, k,
                *leaf, in_place, interpret)
          for k, leaf in enumerate(zip(leaves, grads, mus, nus, buffers))]
  p_out, mu, nu, bufs = ([o[i] for o in outs] for i in range(4))
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
  return unflat(p_out), unflat(mu), unflat(nu), unflat(bufs) if compensation.buffer else None
