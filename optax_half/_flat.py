"""The flat state layout of ``adamw_bf16`` / ``adam_fp32_master`` (``flat_state=True``):
each param-shaped tree of the state is one 1-D array per dtype (docs/algorithms.md#flat-state).
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import optax_half_native as native_lib

__all__ = ["Flat", "check", "key", "pack", "relayout_state", "unpack", "template"]

# The state fields that hold one buffer per param.
FIELDS = ("mu", "nu", *native_lib.BUFFERS)


class Flat(NamedTuple):
  """A param-shaped tree stored flat: ``arrays[key(dtype, shapes)]`` holds every leaf of
  that dtype, raveled, in flatten order."""
  arrays: dict


def key(dtype, shapes) -> str:
  """A flat array's name: its dtype and a digest of its leaves' shapes, so a state of
  another params tree has other names (``checkpoint.check`` and ``check`` refuse it)."""
  digest = zlib.crc32(repr([tuple(int(d) for d in s) for s in shapes]).encode())
  return f"{jnp.dtype(dtype).name}_{digest:08x}"


def _is_state(x) -> bool:
  return isinstance(x, tuple) and hasattr(x, "_fields")


def _groups(leaves) -> dict:
  """dtype name -> the leaves of that dtype, in order."""
  out: dict = {}
  for x in leaves:
    out.setdefault(jnp.dtype(x.dtype).name, []).append(x)
  return out


@jax.jit
def _concatenate(xs):
  """``jnp.concatenate`` of the raveled ``xs`` as writes into one buffer: XLA:CPU makes a
  concatenation's converted operands (a master's ``f32(p)``) whole temporaries first, these
  writes none (docs/algorithms.md#memory)."""
  out = jnp.zeros((sum(math.prod(jnp.shape(x)) for x in xs),), xs[0].dtype)
  start = 0
  for x in xs:
    out = jax.lax.dynamic_update_slice(out, jnp.ravel(x), (start,))
    start += math.prod(jnp.shape(x))
  return out


def _pack_tree(tree) -> Flat:
  arrays = {}
  for d, xs in _groups(jax.tree.leaves(tree)).items():  # MaskedNode: no leaves
    name = key(d, [jnp.shape(x) for x in xs])
    arrays[name] = jnp.ravel(xs[0]) if len(xs) == 1 else _concatenate(xs)
  return Flat(arrays)


def _keys(like) -> dict:
  """dtype name -> the key of its flat array, for a tree-layout ``like``."""
  return {d: key(d, [t.shape for t in ts]) for d, ts in _groups(jax.tree.leaves(like)).items()}


def _unpack_tree(flat: Flat, like):
  keys = _keys(like)
  offsets: dict = {}

  def one(t):
    d = jnp.dtype(t.dtype).name
    start = offsets.get(d, 0)
    size = math.prod(t.shape)
    offsets[d] = start + size
    return jax.lax.slice(flat.arrays[keys[d]], (start,), (start + size,)).reshape(t.shape)

  return jax.tree.map(one, like)


def check(state, like, name: str = "flat_state=True") -> None:
  """Raises a ``ValueError`` unless each param-shaped field of ``state`` is the ``Flat``
  (names, dtypes, sizes) that ``pack(like)`` would give (``like``: ``template``)."""
  if not _is_state(like):
    return
  if not _is_state(state) or type(state) is not type(like):
    raise ValueError(f"{name}: the state is a {type(state).__name__} where the optimizer "
                     f"has a {type(like).__name__}: a state of another optimizer.")
  for f, v, w in zip(like._fields, state, like):
    if f not in FIELDS:
      check(v, w, name)
      continue
    expected = {key(d, [t.shape for t in ts]): ((sum(math.prod(t.shape) for t in ts),), d)
                for d, ts in _groups(jax.tree.leaves(w)).items()}
    have = ({k: (jnp.shape(x), jnp.dtype(x.dtype).name) for k, x in v.arrays.items()}
            if isinstance(v, Flat) else None)
    if have != expected:
      raise ValueError(
          f"{name}: the state's {f} is not in the flat layout of these params (expected "
          f"{expected}, got {have if have is not None else type(v).__name__}): a state built "
          "with flat_state=False (optax_half.relayout_state converts it), or for another "
          "params tree.")


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


def _relayout(state, like, path: str):
  """``state`` with every param-shaped field in the layout ``like`` has there."""
  if isinstance(like, Flat):
    out = state if isinstance(state, Flat) else _pack_tree(state)
    if set(out.arrays) != set(like.arrays):
      raise ValueError(f"relayout_state: {path} holds {sorted(out.arrays)} where the target "
                       f"has {sorted(like.arrays)}: buffers of another params tree or dtype.")
    return out
  if isinstance(state, Flat):
    try:
      return _unpack_tree(state, like)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"relayout_state: {path} is a flat array of another params tree or "
                       f"dtype ({e!r}).") from None
  if _is_state(like):
    if type(state) is not type(like):
      raise ValueError(f"relayout_state: {path} is a {type(state).__name__} where the target "
                       f"optimizer has a {type(like).__name__}: a state of another optimizer.")
    return state._replace(**{f: _relayout(v, w, f"{path}.{f}")
                             for f, v, w in zip(like._fields, state, like)})
  if isinstance(like, (tuple, list)):
    if not isinstance(state, (tuple, list)) or len(state) != len(like):
      raise ValueError(f"relayout_state: {path} does not have the target's "
                       f"{len(like)} elements: a state of another optimizer.")
    return type(state)(_relayout(v, w, f"{path}[{i}]")
                       for i, (v, w) in enumerate(zip(state, like)))
  if isinstance(like, dict):  # e.g. optax.multi_transform's inner states
    if not isinstance(state, dict) or set(state) != set(like):
      raise ValueError(f"relayout_state: {path} does not have the target's keys "
                       f"{sorted(like)}: a state of another optimizer.")
    return {k: _relayout(v, like[k], f"{path}[{k!r}]") for k, v in state.items()}
  return state


def relayout_state(state, tx, params):
  """``state`` in the layout of ``tx.init(params)``: the same values, with the
  param-shaped buffers per param (``flat_state=False``) or flat (``True``) as ``tx``
  stores them, so a run can change layout bit for bit (docs/algorithms.md#flat-state).

  Args:
    state: a state of ``tx``'s optimizer, in either layout.
    tx: the optimizer in the target layout (also inside ``optax.chain`` etc.).
    params: the params tree, whose shapes give the per-param layout.

  Returns:
    ``state`` in ``tx``'s layout; a state of another optimizer or params tree
    is a ``ValueError``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import optax_half as oh
    >>> params = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones((2, 2), jnp.bfloat16)}
    >>> state = oh.adamw_bf16(1e-3).init(params)
    >>> flat = oh.relayout_state(state, oh.adamw_bf16(1e-3, flat_state=True), params)
    >>> mu = flat.inner_state.mu  # both leaves' moments in one bf16 array
    >>> print(type(mu).__name__, [(a.dtype.name, a.shape) for a in mu.arrays.values()])
    Flat [('bfloat16', (7,))]
    >>> back = oh.relayout_state(flat, oh.adamw_bf16(1e-3), params)
    >>> jax.tree.structure(back) == jax.tree.structure(state)
    True
  """
  like = template(tx.init, params)
  out = _relayout(state, like, "state")

  def spec(x):
    return tuple(jnp.shape(x)), jnp.dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x))
  if (jax.tree.structure(out) != jax.tree.structure(like)
      or [spec(x) for x in jax.tree.leaves(out)] != [spec(x) for x in jax.tree.leaves(like)]):
    raise ValueError("relayout_state: the state does not fit tx.init(params) (its structure, "
                     "shapes or dtypes differ): a state of another optimizer or params tree.")
  return out
