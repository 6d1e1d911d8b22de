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

import jax
import jax.numpy as jnp
import optax

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
    An ``optax.GradientTransformation`` with ``optax.EmptyState``.

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
    g_norm = _tree_norm(updates)
    trigger = jnp.squeeze(g_norm < max_norm)
    if jnp.ndim(trigger) != 0:
      raise ValueError(f"max_norm must be a scalar, got shape {jnp.shape(max_norm)}")
    if _widened_by_xla_cpu(updates):
      # The scaling reads the barrier's output, not `updates`: XLA then has no
      # widening with two readers to write once into an fp32 temporary.
      updates = jax.lax.optimization_barrier(updates)

    def clip_fn(t):
      return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

    return jax.tree.map(clip_fn, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
