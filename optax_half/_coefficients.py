"""The fp32 scalars of one AdamW step, shared by the composed core
(``optax_half.adam``) and the native kernel's entry (``optax_half._native``)."""

from __future__ import annotations

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


def coefficients(learning_rate, b1, b2, eps, weight_decay, count) -> Coefficients:
  """The scalars of the step that follows ``count`` steps."""
  b1_, b2_ = _f32(b1), _f32(b2)
  lr = _f32(learning_rate(count) if callable(learning_rate) else learning_rate)
  t = optax.safe_increment(count)
  # The run-time zero of no_fma (no FMA, as in torch): docs/algorithms.md#determinism-and-jit
  zero = rounding.opaque_zero(t)
  # fp32 reciprocals (as XLA runs `a / s`) of 1 - b ** t, no pow: docs/algorithms.md#adamw-core
  inv_bc1 = 1 / rounding.one_minus_pow(b1_, t, zero)
  inv_bc2 = 1 / rounding.one_minus_pow(b2_, t, zero)
  return Coefficients(lr, b1_, b2_, 1 - b1_, 1 - b2_, inv_bc1, inv_bc2, _f32(eps),
                      _f32(weight_decay), zero)
