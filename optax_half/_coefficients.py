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
  """The fp32 scalars of one AdamW step, formed as ``torch_bridge`` forms them
  (the order of ``Scalars`` in ``optax_half_native/adamw.h``), and ``zero``,
  the run-time zero of ``rounding.no_fma``."""
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
  # Products that are later added pass through no_fma: XLA would contract
  # them into FMAs, torch rounds them first
  # (docs/algorithms.md#determinism-and-jit).
  zero = rounding.opaque_zero(t)
  # Reciprocals of the bias corrections, formed once in fp32: XLA rewrites
  # `array / scalar` as `array * (1 / scalar)` anyway, so this is what runs,
  # and torch_bridge computes the same products (docs/algorithms.md#adamw-core).
  # 1 - b ** t without pow, the same bits in both frameworks.
  inv_bc1 = 1 / rounding.one_minus_pow(b1_, t, zero)
  inv_bc2 = 1 / rounding.one_minus_pow(b2_, t, zero)
  return Coefficients(lr, b1_, b2_, 1 - b1_, 1 - b2_, inv_bc1, inv_bc2, _f32(eps),
                      _f32(weight_decay), zero)
