"""``clip_by_global_norm``: optax's, without an fp32 copy of 16-bit gradients.

``optax.clip_by_global_norm(max_norm)`` reads the gradients twice: once for
their global norm (each leaf widened to fp32, squared and summed) and once to
scale them. With bf16 or fp16 gradients XLA:CPU then writes the fp32 widening
of every gradient to a temporary for the norm to read (4 bytes a param, on
top of the 2-byte gradients, allocated afresh each step): on this project's
CPU machines clipping 16.8M bf16 gradients took 27 ms with optax's and 4.5
ms with this one (docs/algorithms.md section 14). This one computes the same
ops in the same order, so the same bits (tests/test_clipping.py compares
them with optax's), but hands the scaling an ``optimization_barrier`` of the
gradients: the norm is then the widening's only reader, and XLA fuses the
widening into the reduction, which reads the 16-bit gradients.

Math (optax's, for a tree of gradients ``g``)::

  norm    = sqrt(sum over leaves of sum(g_i ** 2))     optax.tree.norm
  g_i'    = g_i                               if norm < max_norm
            (g_i / norm) * max_norm           otherwise, in g_i's dtype

A NaN or Inf gradient makes ``norm`` NaN or Inf, and the second branch then
makes every gradient NaN (NaN norm) or zero or NaN (Inf norm), as optax
does; ``skip_nonfinite`` (docs/algorithms.md, section 8) is where
non-finite steps are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm) -> optax.GradientTransformation:
  """Clips the gradients to a global norm of at most ``max_norm``.

  A drop-in for ``optax.clip_by_global_norm``: the same math, dtypes and
  results bit for bit, and an empty state. It differs in what XLA compiles:
  16-bit gradients are not widened into an fp32 temporary (see the module
  docstring), which on CPU makes the clipping of 16.8M bf16 gradients
  about 6x faster (docs/algorithms.md section 14).

  Args:
    max_norm: the largest global norm the updates may have (a float or a
      scalar array).

  Returns:
    An ``optax.GradientTransformation`` with ``optax.EmptyState``.
  """

  def update_fn(updates, state, params=None):
    del params
    g_norm = optax.tree.norm(updates)
    trigger = jnp.squeeze(g_norm < max_norm)
    if jnp.ndim(trigger) != 0:
      raise ValueError(f"max_norm must be a scalar, got shape {jnp.shape(max_norm)}")
    # The scaling reads the barrier's output, not `updates`: XLA then has no
    # one value with two readers to widen once into an fp32 temporary.
    scaled_input = jax.lax.optimization_barrier(updates)

    def clip_leaf(t):
      return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

    return jax.tree.map(clip_leaf, scaled_input), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
