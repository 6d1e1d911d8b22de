"""``clip_by_global_norm``: optax's, bit for bit, without an fp32 copy of 16-bit gradients.

Math, and the ``optimization_barrier`` that avoids the copy on CPU:
``docs/algorithms.md#gradient-clipping``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_half import _in_place
from optax_half._util import is_float

__all__ = ["clip_by_global_norm"]

# optax's norm: optax.tree.norm, or optax.global_norm in older optax (pyproject allows 0.2.5).
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def _widened_by_xla_cpu(updates) -> bool:
  """Whether XLA:CPU would write an fp32 copy of a 16-bit leaf for optax's norm (trace time)."""
  return jax.default_backend() == "cpu" and any(
      is_float(x) and jnp.dtype(x.dtype).itemsize == 2 for x in jax.tree.leaves(updates))


class ClipRead(NamedTuple):
  """One step's clip, for a kernel step that clips as it reads (``Scalars.clip_div``,
  ``clip_mul``) or for ``apply``. ``trigger``: ``norm < max_norm`` (gradients kept)."""
  trigger: jax.Array
  norm: jax.Array
  max_norm: jax.typing.ArrayLike

  def apply(self, updates):
    """The clipped gradients: ``clip_by_global_norm``'s ``update``."""
    return jax.tree.map(lambda t: _clip_leaf(t, self), updates)

  def folds(self, dtype) -> bool:
    """Whether a step may clip a ``dtype`` gradient as it reads it (trace time): bf16 or
    fp32, not promoted by ``max_norm`` (docs/algorithms.md#gradient-clipping)."""
    dtype = jnp.dtype(dtype)
    return (dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
            and jnp.result_type(dtype, self.max_norm) == dtype)

  def factors(self, dtype) -> tuple:
    """fp32 ``(clip_div, clip_mul)``: norm, ``max_norm`` as ``_clip_leaf`` rounds them; or 1s."""
    one = jnp.ones((), dtype)
    div = self.norm.astype(dtype)
    mul = one * self.max_norm  # max_norm in dtype, exactly as `(t / norm) * max_norm` takes it
    return tuple(jnp.where(self.trigger, one, x).astype(jnp.float32) for x in (div, mul))


def read(updates, max_norm) -> ClipRead:
  """The norm and the trigger of ``clip_by_global_norm(max_norm)`` on ``updates``."""
  g_norm = _tree_norm(updates)
  trigger = jnp.squeeze(g_norm < max_norm)
  if jnp.ndim(trigger) != 0:
    raise ValueError(f"max_norm must be a scalar, got shape {jnp.shape(max_norm)}")
  return ClipRead(trigger, g_norm, max_norm)


def _clip_leaf(t, clip: ClipRead):
  return jax.lax.select(clip.trigger, t, (t / clip.norm.astype(t.dtype)) * clip.max_norm)


def clip_by_global_norm(max_norm: jax.typing.ArrayLike) -> optax.GradientTransformation:
  """Clips the gradients to a global norm of at most ``max_norm``.

  A drop-in for ``optax.clip_by_global_norm`` (the same math, dtypes, errors and
  bits) that writes no fp32 temporary of 16-bit gradients on CPU.

  Args:
    max_norm: the largest global norm the updates may have (a float or a
      scalar array).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``optax.EmptyState``; in ``optax_half.chain``
    before ``adamw_bf16`` or ``adam_fp32_master``, the in-place kernel step clips as it reads.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_half as oh
    >>> tx = oh.clip_by_global_norm(1.0)
    >>> grads = {"g": jnp.array([3.0, 4.0], jnp.bfloat16)}  # global norm 5
    >>> clipped, _ = tx.update(grads, tx.init(grads))
    >>> print(clipped["g"].dtype, clipped["g"].tolist())  # 0.6 and 0.8 in bf16
    bfloat16 [0.6015625, 0.80078125]

  References:
    Pascanu et al., `On the difficulty of training recurrent neural networks
    <https://arxiv.org/abs/1211.5063>`_, ICML 2013

    optax, `optax.clip_by_global_norm
    <https://optax.readthedocs.io/en/latest/api/transformations.html#optax.clip_by_global_norm>`_
    (the transformation this reproduces bit for bit)
  """

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    clip = read(updates, max_norm)
    if _widened_by_xla_cpu(updates):
      # No widening with two readers, which XLA would write to an fp32 temporary.
      updates = jax.lax.optimization_barrier(updates)
    return clip.apply(updates), state

  # `read`: the clip a following kernel step applies as it reads (optax_half.chain).
  out = _in_place.ClipTransformation(optax.init_empty_state, update_fn)
  out.read = lambda updates: read(updates, max_norm)
  return out
