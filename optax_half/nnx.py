"""Flax NNX helpers: a mixed-precision policy applied to a model's layers.

Imported on demand (``optax_half.nnx``), so ``optax_half`` itself does not
need Flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from optax_half.policy import Policy, get_policy

__all__ = ["apply_policy", "NORMS"]

# Normalization layers: their statistics and scales stay fp32 by default
# (a variance in bf16 or fp16 loses what the normalization is for).
NORMS = (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)


def apply_policy(model: nnx.Module, policy, *, keep_fp32=NORMS) -> nnx.Module:
  """Stores ``model``'s params in the policy's param dtype and computes in its compute dtype.

  Every submodule with Flax's mixed-precision attributes, ``param_dtype``
  (the dtype new params are made in) and ``dtype`` (the dtype it computes
  in: ``nnx.Linear``, ``Conv``, ``ConvTranspose``, ``Embed``, ``Einsum``,
  ``LinearGeneral``, ``MultiHeadAttention``, the normalization layers, ...)
  gets them set, and every ``nnx.Param`` of floating dtype is cast, in
  place, without editing the model's code. Instances of ``keep_fp32`` (by
  default the normalization layers, ``NORMS``) keep fp32 params and compute.
  Layers without those attributes (a hand-written ``x @ w``) keep computing
  in the dtype of what they are given; outputs come in the compute dtype:
  ``policy.cast_to_output(model(x))`` gives the output dtype.

  Args:
    model: a Flax NNX module (changed in place and returned).
    policy: a ``Policy`` or a string for ``get_policy`` (``"p=bf16,c=bf16,o=f32"``).
    keep_fp32: module types that keep fp32 params and compute; ``()`` for none.

  Returns:
    ``model``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import optax_half.nnx
    >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    >>> model = optax_half.nnx.apply_policy(model, "p=bf16,c=bf16,o=f32")
    >>> model.layers[0].kernel[...].dtype, model.layers[1].scale[...].dtype
    (dtype(bfloat16), dtype('float32'))
    >>> model(jnp.ones((2, 3))).dtype  # the LayerNorm computes in fp32
    dtype('float32')
  """
  if isinstance(policy, str):
    policy = get_policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(f"apply_policy takes a Policy or a policy string; got {type(policy).__name__}.")
  keep = tuple(keep_fp32)
  kept_paths = set()
  iter_modules = getattr(nnx, "iter_modules", None)  # the function in newer Flax
  modules = iter_modules(model) if iter_modules else model.iter_modules()
  for path, module in modules:
    fp32 = bool(keep) and isinstance(module, keep)
    if fp32:
      kept_paths.add(tuple(path))
    if hasattr(module, "param_dtype"):
      module.param_dtype = jnp.float32 if fp32 else policy.param_dtype
    if hasattr(module, "dtype"):
      module.dtype = jnp.float32 if fp32 else policy.compute_dtype

  def cast(path, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    owner = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    fp32 = any(owner[:len(p)] == p for p in kept_paths)
    return x.astype(jnp.float32 if fp32 else policy.param_dtype)

  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree_util.tree_map_with_path(cast, params))
  return model
