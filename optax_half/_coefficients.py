"""The fp32 scalars of one AdamW step and its math on one leaf, shared by the composed core
(``optax_half.adam``), the native kernel's entry (``optax_half._native``) and the TPU
kernel (``optax_half._tpu``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_half import rounding


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


class Coefficients(NamedTuple):
  """The fp32 scalars of one AdamW step as ``torch_bridge`` forms them (``Scalars``'s order in
  ``adamw.h``), and ``zero``, the run-time zero of ``rounding.no_fma``."""
  lr: jax.Array
  b1: jax.Array
  b2: jax.Array
  one_minus_b1: jax.Array
  one_minus_b2: jax.Array
  inv_bc1: jax.Array
  inv_bc2: jax.Array
  eps: jax.Array
  weight_decay: jax.Array
  zero: jax.Array


def coefficients(learning_rate, b1, b2, eps, weight_decay, count,
                 invert: bool = True) -> Coefficients:
  """The scalars of the step that follows ``count`` steps; ``invert=False``: ``inv_bc1``
  and ``inv_bc2`` hold ``1 - b ** t`` uninverted (``invert_bias_corrections``, in a kernel)."""
  b1_, b2_ = _f32(b1), _f32(b2)
  lr = _f32(learning_rate(count) if callable(learning_rate) else learning_rate)
  t = optax.safe_increment(count)
  # The run-time zero of no_fma (no FMA, as in torch): docs/algorithms.md#determinism-and-jit
  zero = rounding.opaque_zero(t)
  # fp32 reciprocals (as XLA runs `a / s`) of 1 - b ** t, no pow: docs/algorithms.md#adamw-core
  bc1, bc2 = rounding.one_minus_pow(b1_, t, zero), rounding.one_minus_pow(b2_, t, zero)
  c = Coefficients(lr, b1_, b2_, 1 - b1_, 1 - b2_, bc1, bc2, _f32(eps), _f32(weight_decay), zero)
  return invert_bias_corrections(c) if invert else c


def invert_bias_corrections(c: Coefficients, div=None) -> Coefficients:
  """``c`` of ``coefficients(..., invert=False)`` with ``inv_bc1 = 1 / (1 - b1 ** t)`` and
  ``inv_bc2`` in place: fp32 division, ``div`` where given (a GPU kernel's IEEE op)."""
  div = div or jnp.divide
  one = jnp.ones((), jnp.float32)
  return c._replace(inv_bc1=div(one, c.inv_bc1), inv_bc2=div(one, c.inv_bc2))


def _is_zero(v) -> bool:
  return isinstance(v, (int, float)) and v == 0


def adamw_leaf(c: Coefficients, g, m, v, x, decay: bool, eps_root=0.0, inv_bc1_next=None,
               div=None, sqrt=None):
  """``scale_by_adamw``'s fp32 step of one leaf (any shape: a whole leaf, or a block of it
  in a kernel): ``(u, m32, v32)``, the update before the param dtype and the moments before
  their storage rounding. ``decay``: the weight-decay term (``c.weight_decay`` 0 at run time
  adds none); ``inv_bc1_next``: Nesterov's, at the next step's bias correction; ``div``,
  ``sqrt``: the IEEE ops a GPU kernel spells out (default ``/`` and ``jnp.sqrt``)."""
  root = None if _is_zero(eps_root) else jnp.asarray(eps_root, jnp.float32)
  return _adamw_leaf(c, g, m, v, x, root, inv_bc1_next, bool(decay), div, sqrt)


# Traced once per shape and dtype of its arrays, as rounding's helpers (rounding._traced_once).
@functools.partial(rounding._traced_once, static_argnums=(7, 8, 9))
def _adamw_leaf(c: Coefficients, g, m, v, x, eps_root, inv_bc1_next, decay: bool, div, sqrt):
  div = div or jnp.divide
  sqrt = sqrt or jnp.sqrt
  def rounded(product):
    return rounding.no_fma(product, c.zero)
  # rounding.widen: exact upcasts that XLA cannot fold into excess precision.
  g = rounding.widen(g)
  m32 = rounded(c.b1 * rounding.widen(m)) + rounded(c.one_minus_b1 * g)
  v32 = rounded(c.b2 * rounding.widen(v)) + rounded(c.one_minus_b2 * (g * g))
  if inv_bc1_next is not None:  # optax's mu_hat reads m at the next step's bias correction
    m_hat = rounded(c.b1 * (m32 * inv_bc1_next)) + rounded(c.one_minus_b1 * (g * c.inv_bc1))
  else:
    m_hat = m32 * c.inv_bc1
  v_hat = v32 * c.inv_bc2
  if eps_root is not None:
    v_hat = v_hat + eps_root
  u = div(m_hat, sqrt(v_hat) + c.eps)
  if decay:  # none at 0, also a traced 0 (the kernel's)
    u = jnp.where(c.weight_decay == 0, u, u + rounded(c.weight_decay * rounding.widen(x)))
  return rounded(-c.lr * u), m32, v32
