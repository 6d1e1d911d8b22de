"""Small tree helpers shared by the wrappers and the AdamW core."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_float(x) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def seed_from_key(key) -> jax.Array:
  """A uint32 seed from ``None`` (seed 0), a Python int, or a JAX PRNG key.

  Integers are taken modulo 2^32; the same integer gives the same random bits
  in ``torch_bridge``. A JAX key is reduced with ``jax.random.bits``.
  """
  if key is None:
    return jnp.uint32(0)
  if isinstance(key, int) and not isinstance(key, bool):
    return jnp.uint32(key % 2**32)
  if isinstance(key, bool) or not isinstance(key, (jax.Array, np.ndarray)):
    raise TypeError(
        "key must be None, a Python int or a JAX PRNG key (jax.random.key(...)); "
        f"got {type(key).__name__}.")
  key = jnp.asarray(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.bits(key, (), jnp.uint32)
  if key.dtype == jnp.uint32 and key.shape == (2,):  # raw legacy key
    return jax.random.bits(key, (), jnp.uint32)
  if jnp.issubdtype(key.dtype, jnp.integer) and key.shape == ():
    return key.astype(jnp.uint32)
  raise TypeError(
      "key must be None, a Python int or a JAX PRNG key "
      f"(jax.random.key(...)); got {type(key).__name__} {key.dtype}{key.shape}.")


def check_trees(name: str, updates, params) -> None:
  """A clear error when the gradient tree does not fit the params tree.

  Checks the structure, then every leaf's shape, and names the first
  mismatching leaf by its tree path (trace-time only: shapes are static).
  """
  if params is None:
    raise ValueError(
        f"{name} needs the current params: call tx.update(grads, state, params).")
  if jax.tree.structure(updates) != jax.tree.structure(params):
    raise ValueError(
        f"{name}: the gradient tree does not match the params tree.\n"
        f"  grads:  {jax.tree.structure(updates)}\n"
        f"  params: {jax.tree.structure(params)}")
  for (path, g), p in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                          jax.tree.leaves(params)):
    if np.shape(g) != np.shape(p):
      raise ValueError(
          f"{name}: the gradient of params{jax.tree_util.keystr(path)} has shape "
          f"{tuple(np.shape(g))}; the param has shape {tuple(np.shape(p))}.")


def leaf_indices(params):
  """Index of every float leaf among the float leaves, in flatten order.

  This is the ``leaf`` coordinate of the random bits; ``torch_bridge`` uses a
  parameter's position in the optimizer's parameter list, which matches for
  trees holding only float leaves.
  """
  leaves, treedef = jax.tree.flatten(params)
  out, i = [], 0
  for p in leaves:
    out.append(i if is_float(p) else -1)
    i += is_float(p)
  return jax.tree.unflatten(treedef, out)


def unzip(like, tuples, n: int):
  """A tree of n-tuples (at the leaves of ``like``) -> n trees."""
  return tuple(jax.tree.map(lambda _, t, k=k: t[k], like, tuples) for k in range(n))
