"""``adamw_bf16``'s step on an NVIDIA GPU: one Pallas (Triton) kernel per leaf that reads
the leaf's param, gradient, moments and buffer once and writes each output once, in place,
with IEEE division and square root: the CPU's bits (docs/algorithms.md#pallas-kernels).
A flat state (``flat_state=True``) is stepped where it lies: each leaf's kernel reads and
writes its slice of the flat arrays, which pass from kernel to kernel in place."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_half import _pallas

BLOCK = 1024  # elements a program steps (a power of 2, as Triton's blocks are)
WARPS = 4  # 8 elements a thread: 16-byte accesses of the bf16 streams
COMPENSATIONS = (*_pallas.COMPENSATIONS, "split")  # the int16 low half too
MAX_ELEMENTS = 2**31 - BLOCK  # a program's int32 start in a leaf or flat array


def takes(compensation, params, grads, core, flat: bool = False) -> bool:
  """``_pallas.takes``: leaves of any shape (stepped as their 1-D raveling) below
  ``MAX_ELEMENTS``; ``flat``: also all of them together (a flat state's arrays)."""
  sizes = [math.prod(np.shape(p)) for p in jax.tree.leaves(params)]
  return ((not flat or sum(sizes) < MAX_ELEMENTS)
          and _pallas.takes(compensation, params, grads, core,
                            lambda shape: math.prod(shape) < MAX_ELEMENTS, COMPENSATIONS))


def _ieee_ops():
  """(div, sqrt) as PTX's IEEE instructions (``div.rn.f32``, ``sqrt.rn.f32``): Triton's
  ``/`` is ``div.full.f32``, an approximation (docs/algorithms.md#on-gpu)."""
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415

  def asm(text, *args):
    shape = jnp.shape(args[0])
    # Inline assembly takes blocks: a scalar (the bias corrections) as a block of one.
    args = [jnp.broadcast_to(jnp.asarray(x, jnp.float32), shape or (1,)) for x in args]
    out = plt.elementwise_inline_asm(
        text, args=args, constraints=",".join(["=f"] + ["f"] * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape or (1,), jnp.float32)])[0]
    return out.reshape(shape)
  return (lambda a, b: asm("div.rn.f32 $0, $1, $2;", a, b),
          lambda a: asm("sqrt.rn.f32 $0, $1;", a))


def _kernel(rules, decay: bool, state_rounding: str, has_buffer: bool, in_place: bool,
            n: int, offset: int, leaf: int, interpret: bool):
  """The step of one block of ``BLOCK`` elements of a leaf of ``n``: ``_pallas.block_step``
  on the elements the mask keeps; the state's streams are read at ``offset`` (a flat
  state: the leaf's place in its flat arrays; else 0)."""
  from jax.experimental import pallas as pl  # noqa: PLC0415 (imported when a kernel is made)
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415
  div, sqrt = (None, None) if interpret else _ieee_ops()  # the interpreter's ops: the CPU's

  def kernel(k_ref, p_ref, g_ref, m_ref, v_ref, *refs):
    b_ref, outs = (refs[0], refs[1:]) if has_buffer else (None, refs)
    c, key_p, key_m = _pallas.read_operands(k_ref, leaf, div)
    start = pl.program_id(0) * BLOCK
    index = start.astype(jnp.uint32) + lax.broadcasted_iota(jnp.uint32, (BLOCK,), 0)
    mask = index < jnp.uint32(n)  # the leaf's last block: its elements only
    own, at = pl.ds(start, BLOCK), pl.ds(start + offset, BLOCK)

    def load(ref, where):
      return plt.load(ref.at[where], mask=mask, other=jnp.zeros((), ref.dtype))
    new = _pallas.block_step(rules, decay, state_rounding, in_place, c, key_p, key_m, index,
                             load(p_ref, own), load(g_ref, own), load(m_ref, at),
                             load(v_ref, at), load(b_ref, at) if has_buffer else None,
                             div=div, sqrt=sqrt)
    for ref, where, x in zip(outs, (own, at, at, at), new):
      plt.store(ref.at[where], x, mask=mask)
  return kernel


def _call(rules, decay, state_rounding, keys, leaf, p, g, states, offset, in_place,
          interpret) -> list:
  """(param or update, *states) after leaf ``leaf``'s kernel: ``p`` and ``g`` the leaf's,
  ``states`` (m, v and the buffer, if any) 1-D, the leaf at ``offset``, written in place."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415
  n = int(np.size(p))
  flat = [jnp.ravel(p), jnp.ravel(g), *states]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (flat[0], *states)]
  # Operands: keys, p, g, m, v, buffer; outputs: p (or u), m, v, buffer.
  aliases = {3 + j: 1 + j for j in range(len(states))}
  if in_place:
    aliases[1] = 0
  out = pl.pallas_call(
      _kernel(rules, decay, state_rounding, len(states) == 3, in_place, n, offset, leaf,
              interpret),
      grid=(math.ceil(n / BLOCK),), out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=plt.CompilerParams(num_warps=WARPS, num_stages=1),
      interpret=interpret, name=f"adamw_bf16_leaf{leaf}")(keys, *flat)
  return [out[0].reshape(np.shape(p)), *out[1:]]


def update(compensation, hyperparams, state_rounding, updates, state, params, in_place,
           keys, decays=None, interpret=False):
  """``adamw_bf16``'s step over a tree ``takes`` accepts, a kernel per leaf: the trees of
  (new params or updates, mu, nu, buffers or None). ``keys``: ``_pallas.operands``'s
  vector; ``decays``: per leaf, whether weight decay applies (None: all);
  ``interpret``: Pallas's interpreter (tests, on CPU)."""
  leaves, treedef, grads, mus, nus, buffers = _pallas.leaves_of(compensation, updates, state,
                                                                params)
  rules = compensation.for_dtype(jnp.bfloat16)
  outs = []
  for k, (p, g, m, v, b) in enumerate(zip(leaves, grads, mus, nus, buffers)):
    states = [jnp.ravel(x) for x in (m, v, *([b] if b is not None else []))]
    out = _call(rules, _pallas.decays(hyperparams, decays, k), state_rounding, keys,
                k, p, g, states, 0, in_place, interpret)
    out = [out[0], *(x.reshape(np.shape(p)) for x in out[1:])]
    outs.append(out if b is not None else [*out, None])  # no buffer: None in its place
  p_out, mu, nu, bufs = ([o[i] for o in outs] for i in range(4))
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
  return unflat(p_out), unflat(mu), unflat(nu), unflat(bufs) if compensation.buffer else None


def update_flat(rules, hyperparams, state_rounding, updates, params, flats, in_place,
                keys, interpret=False):
  """The step over a flat state (``_flat``: one array per field): (the tree of new params
  or updates, the new flat arrays). ``flats``: the flat mu, nu and buffer (if any) arrays,
  each leaf at its offset in flatten order; each passes through the leaves' kernels in
  place (no slice or concatenation outside them)."""
  leaves, treedef = jax.tree.flatten(params)
  grads = treedef.flatten_up_to(updates)
  out, offset = [], 0
  for k, (p, g) in enumerate(zip(leaves, grads)):
    p_new, *flats = _call(rules, _pallas.decays(hyperparams, None, k), state_rounding, keys,
                          k, p, g, list(flats), offset, in_place, interpret)
    out.append(p_new)
    offset += int(np.size(p))
  return jax.tree.unflatten(treedef, out), flats
