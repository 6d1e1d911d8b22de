"""Optimizer-state checkpoints with Orbax, checked leaf by leaf before anything loads.

    optax_half.checkpoint.save(path, opt_state)
    opt_state = optax_half.checkpoint.restore(path, tx.init(params))

Resuming is bit for bit; Flax NNX and the checks: ``docs/algorithms.md#checkpoints``.
Orbax is an optional dependency (``optax-half[checkpoint]``; Flax brings it too).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

__all__ = ["save", "restore", "check"]


def _orbax():
  try:
    import orbax.checkpoint as ocp  # noqa: PLC0415 (optional dependency)
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "optax_half.checkpoint needs Orbax: pip install 'optax-half[checkpoint]' "
        "(or orbax-checkpoint).") from e
  return ocp


def _key_name(k) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _flat(tree, is_leaf=None) -> dict:
  """Leaf path (field names, dict keys, indices) -> leaf, as Orbax stores it: a NamedTuple
  as a dict of its fields, an empty node (``MaskedNode``, ``EmptyState``) as nothing."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves if leaf is not None}


def _describe(shape, dtype) -> str:
  return f"{np.dtype(dtype).name}{list(shape)}"


def check(saved_tree, like, name: str = "restore") -> None:
  """Raises a ``ValueError`` naming the first leaf where ``saved_tree`` and
  ``like`` differ: a leaf only one of them has, or another dtype or shape.

  ``saved_tree``: the tree of a checkpoint's array metadata
  (``StandardCheckpointer().metadata(path).item_metadata.tree``), or any tree
  whose leaves have ``shape`` and ``dtype``; ``like``: the state to restore into.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_half import checkpoint
    >>> saved = {"mu": jax.ShapeDtypeStruct((3,), jnp.float32)}
    >>> checkpoint.check(saved, {"mu": jnp.zeros(3, jnp.float32)})  # they fit: no error
    >>> checkpoint.check(saved, {"mu": jnp.zeros(3, jnp.bfloat16)})
    Traceback (most recent call last):
    ...
    ValueError: restore: state['mu'] was saved as float32[3]; the state to restore into ...
  """
  def is_array_leaf(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")
  saved = _flat(saved_tree, is_leaf=is_array_leaf)
  wanted = _flat(like)
  labels = {tuple(_key_name(k) for k in path): jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(like)[0]}
  for path, leaf in wanted.items():
    label = "state" + labels[path]
    if path not in saved:
      raise ValueError(
          f"{name}: the checkpoint has no {label} ({_describe(np.shape(leaf), leaf.dtype)}): "
          "it was saved from another optimizer, compensation or params tree.")
    s = saved[path]
    if np.dtype(s.dtype) != np.dtype(leaf.dtype) or tuple(s.shape) != tuple(np.shape(leaf)):
      raise ValueError(
          f"{name}: {label} was saved as {_describe(s.shape, s.dtype)}; the state to "
          f"restore into has {_describe(np.shape(leaf), leaf.dtype)}. Build the optimizer "
          "with the same dtypes and the same params.")
  extra = [p for p in saved if p not in wanted]
  if extra:
    raise ValueError(
        f"{name}: the checkpoint has {'.'.join(extra[0])}, which the state to restore into "
        f"lacks ({len(extra)} such leaves): it was saved from another optimizer, "
        "compensation or params tree.")


def save(directory: str | os.PathLike, state: Any, *, force: bool = False) -> None:
  """Writes ``state`` (any pytree of arrays, sharded or not) to ``directory`` with
  Orbax and returns when it is on disk. ``force``: overwrite an existing checkpoint.

  Example:
    >>> import os, tempfile, jax.numpy as jnp
    >>> import optax_half as oh
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = oh.adamw_bf16(1e-3).init(params)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...   oh.checkpoint.save(os.path.join(tmp, "step_0"), state)
    ...   print(os.listdir(tmp))
    ['step_0']
  """
  ocp = _orbax()
  directory = os.path.abspath(directory)
  if os.path.exists(directory) and not force:
    raise FileExistsError(
        f"save: {directory} already exists; pass force=True to overwrite it, or save each "
        "step to its own directory (e.g. .../step_1000).")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory, state, force=force)
  checkpointer.wait_until_finished()


def _target(leaf):
  """What Orbax restores a leaf as: ``like``'s shape, dtype and sharding."""
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)


def restore(directory: str | os.PathLike, like: Any) -> Any:
  """The state saved in ``directory``, in the structure, dtypes, shapes and shardings
  of ``like`` (a state of the same optimizer, or its ``jax.eval_shape`` with
  shardings); a mismatch (``check``) raises before any array is read.

  Example:
    >>> import os, tempfile, jax.numpy as jnp
    >>> import optax_half as oh
    >>> tx = oh.adamw_bf16(1e-3)
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> _, state = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, tx.init(params), params)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...   oh.checkpoint.save(os.path.join(tmp, "step_1"), state)
    ...   restored = oh.checkpoint.restore(os.path.join(tmp, "step_1"), tx.init(params))
    >>> print(int(restored.inner_state.count), restored.compensation["w"].dtype)
    1 bfloat16

    A state of another optimizer (here fp32 moments) is refused, naming the leaf:

    >>> with tempfile.TemporaryDirectory() as tmp:
    ...   oh.checkpoint.save(os.path.join(tmp, "step_1"), state)
    ...   other = oh.adamw_bf16(1e-3, mu_dtype=jnp.float32).init(params)
    ...   oh.checkpoint.restore(os.path.join(tmp, "step_1"), other)
    Traceback (most recent call last):
    ...
    ValueError: restore: state.inner_state.mu['w'] was saved as bfloat16[3]; ...
  """
  ocp = _orbax()
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"restore: no checkpoint directory {directory}.")
  checkpointer = ocp.StandardCheckpointer()
  metadata = checkpointer.metadata(directory).item_metadata
  if metadata is None:
    raise FileNotFoundError(
        f"restore: {directory} holds no checkpoint written by optax_half.checkpoint.save.")
  check(metadata.tree, like)
  return checkpointer.restore(directory, jax.tree.map(_target, like))
