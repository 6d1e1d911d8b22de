"""The flat state layout of ``adamw_bf16`` / ``adam_fp32_master`` (``flat_state=True``).

Every param-shaped tree of the state (the moments ``mu`` and ``nu``, the Kahan
``compensation``, the ``master`` copy or low halves) is stored as a ``Flat``:
one 1-D array per dtype, holding the tree's leaves of that dtype raveled and
concatenated in flatten order (``optax.MaskedNode`` leaves hold nothing).
Nothing else changes: the counts, seeds and wrapper states stay where they
were, and the values are the tree layout's, bit for bit.

Why: JAX pays a fixed cost for every array a jitted step takes and returns
(about 2-3 us each here, benchmarks/README.md), so a tree of 512 small leaves
costs ~2560 arrays per step in the tree layout and ~1030 in the flat one; on
CPU the native kernel steps all leaves of a flat state in one call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["Flat", "pack", "unpack", "template"]

# The state fields that hold one buffer per param.
FIELDS = ("mu", "nu", "compensation", "master")


class Flat(NamedTuple):
  """A param-shaped tree stored flat: ``arrays[dtype name]`` is a 1-D array
  with every leaf of that dtype, raveled, in flatten order."""
  arrays: dict


def _is_state(x) -> bool:
  return isinstance(x, tuple) and hasattr(x, "_fields")


def _pack_tree(tree) -> Flat:
  parts: dict = {}
  for x in jax.tree.leaves(tree):  # MaskedNode: no leaves
    parts.setdefault(jnp.dtype(x.dtype).name, []).append(jnp.ravel(x))
  return Flat({d: xs[0] if len(xs) == 1 else jnp.concatenate(xs) for d, xs in parts.items()})


def _unpack_tree(flat: Flat, like):
  offsets: dict = {}

  def one(t):
    d = jnp.dtype(t.dtype).name
    start = offsets.get(d, 0)
    size = math.prod(t.shape)
    offsets[d] = start + size
    return jax.lax.slice(flat.arrays[d], (start,), (start + size,)).reshape(t.shape)

  return jax.tree.map(one, like)


def pack(state):
  """``state`` (tree layout) in the flat layout."""
  if not _is_state(state):
    return state
  return state._replace(**{f: _pack_tree(v) if f in FIELDS else pack(v)
                           for f, v in zip(state._fields, state)})


def unpack(state, like):
  """``state`` (flat layout) in the tree layout of ``like`` (``template``)."""
  if not _is_state(state):
    return state
  return state._replace(**{f: _unpack_tree(v, w) if f in FIELDS else unpack(v, w)
                           for f, v, w in zip(state._fields, state, like)})


def template(init, params):
  """The tree-layout state ``init(params)`` would return, as shapes and dtypes."""
  return jax.eval_shape(init, jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.asarray(p).dtype)
      if not isinstance(p, optax.MaskedNode) else p, params))
