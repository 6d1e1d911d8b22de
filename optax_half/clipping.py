"""``clip_by_global_norm``: optax's, without an fp32 copy of 16-bit gradients.

``optax.clip_by_global_norm(max_norm)`` reads the gradients twice: once for
their global norm and once to scale them. With bf16 or fp16 gradients
XLA:CPU then writes the fp32 widening of every gradient to a temporary for
the norm to read (4 bytes a param on top of the 2-byte gradients, allocated
afresh each step). This one computes the same ops in the same order, so the
same bits (tests/test_clipping.py compares them with optax's), but on CPU,
when a leaf is 16-bit, it hands the scaling an ``optimization_barrier`` of
the gradients: the norm is then the widening's only reader, and XLA fuses
the widening into the reduction, which reads the 16-bit gradients
(docs/algorithms.md#gradient-clipping; timings of clipping before the Kahan
step, with this one and with optax's:
benchmarks/README.md#what-bounds-each-row). Elsewhere (fp32 gradients, or a
backend other than the CPU, where the barrier was not examined) the ops are
optax's and nothing more.

Math (optax's, for a tree of gradients ``g``)::

  norm  = sqrt(sum over leaves of sum(g_i * g_i))   optax.tree.norm
  g_i'  = g_i                            if norm < max_norm
          (g_i / norm) * max_norm        otherwise

in the leaves' dtypes: each leaf's sum is ``jnp.sum`` in ``g_i``'s dtype
(XLA accumulates in fp32 and may keep the squares in fp32: its excess
precision), the sums are added in JAX's promoted dtype, and ``norm`` is cast
to ``g_i``'s dtype before the division. A NaN or Inf gradient makes ``norm``
NaN or Inf, and the second branch then makes every gradient NaN (NaN norm)
or zero or NaN (Inf norm), as optax does; ``skip_nonfinite``
(docs/algorithms.md#non-finite-gradients) is where non-finite steps are skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_half import _in_place
from optax_half._util import is_float

__all__ = ["clip_by_global_norm"]

# The norm optax's clip_by_global_norm takes: optax.tree.norm, or before
# optax had it (pyproject allows optax >= 0.2.5), optax.global_norm.
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def _widened_by_xla_cpu(updates) -> bool:
  """Whether XLA:CPU would write an fp32 copy of a leaf for optax's norm: a
  16-bit float leaf, lowered for the CPU (trace time)."""
  return jax.default_backend() == "cpu" and any(
      is_float(x) and jnp.dtype(x.dtype).itemsize == 2 for x in jax.tree.leaves(updates))


class ClipRead(NamedTuple):
  """One step's ``clip_by_global_norm`` of the gradients, for a step that
  clips as it reads them (the native kernel's ``Scalars.clip_div`` and
  ``clip_mul``: ``optax_half.chain`` of this clip and ``adamw_bf16`` or
  ``adam_fp32_master``), and the same clip in framework ops (``apply``).

  ``trigger``: the global norm is below ``max_norm`` (the gradients are
  kept); ``norm``: the global norm, in JAX's promoted dtype of the leaves.
  """
  trigger: jax.Array
  norm: jax.Array
  max_norm: jax.typing.ArrayLike

  def apply(self, updates):
    """The clipped gradients: ``clip_by_global_norm``'s ``update``."""
    return jax.tree.map(lambda t: _clip_leaf(t, self), updates)

  def folds(self, dtype) -> bool:
    """Whether a step may clip a gradient of ``dtype`` as it reads it (trace
    time): bf16 or fp32, clipped in its own dtype (``max_norm`` a Python
    float or an array of that dtype; one that promotes makes optax's select
    fail). XLA:CPU computes the clip of those as the kernel reads it: a
    true division for fp32, a product with the norm's fp32 reciprocal for
    bf16, then the product with ``max_norm``, each rounded to the dtype; an
    fp16 gradient's division it may turn into a multiplication by the norm's
    reciprocal rounded to fp16, depending on the graph around it, so fp16
    gradients are clipped by ``apply`` (docs/algorithms.md#gradient-clipping)."""
    dtype = jnp.dtype(dtype)
    return (dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
            and jnp.result_type(dtype, self.max_norm) == dtype)

  def factors(self, dtype) -> tuple:
    """``(clip_div, clip_mul)`` of a gradient of ``dtype`` (fp32 scalars):
    the norm and ``max_norm`` rounded to ``dtype`` as ``_clip_leaf``
    rounds them, or 1 and 1 where the gradients are kept."""
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

  A drop-in for ``optax.clip_by_global_norm``: the same math, dtypes,
  errors and results bit for bit, and an empty state. On CPU, 16-bit
  gradients are not widened into an fp32 temporary (see the module
  docstring).

  Args:
    max_norm: the largest global norm the updates may have (a float or a
      scalar array).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``optax.EmptyState``.
    Before ``adamw_bf16`` or ``adam_fp32_master`` in ``optax_half.chain``,
    the in-place step (``optax_half.update_and_apply``) has the kernel clip
    each gradient as it reads it: no clipped copy of the gradients, the
    same bits.

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
      # The scaling reads the barrier's output, not `updates`: XLA then has no
      # widening with two readers to write once into an fp32 temporary.
      updates = jax.lax.optimization_barrier(updates)
    return clip.apply(updates), state

  # An optax.GradientTransformationExtraArgs whose clip a following kernel
  # step can apply as it reads the gradients (optax_half.chain).
  out = _in_place.ClipTransformation(optax.init_empty_state, update_fn)
  out.read = lambda updates: read(updates, max_norm)
  return out
