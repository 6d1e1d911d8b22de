"""Flax NNX helpers: an in-place ``nnx.Optimizer`` and ``apply_policy``. Imported on
demand (``optax_half.nnx``), so ``optax_half`` itself does not need Flax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from optax_half._in_place import update_and_apply
from optax_half import rounding
from optax_half.policy import Policy, get_policy

__all__ = ["Optimizer", "apply_policy", "NORMS"]


def _pure(tree):
  as_pure = getattr(nnx, "as_pure", None)  # Variables -> arrays, in newer Flax
  return as_pure(tree) if as_pure is not None else tree


def _changes(new, old):
  """``new - old`` per leaf, in fp32 for 16-bit leaves (exact; ``widen``: also where XLA
  would fold the rounding of ``new`` away)."""
  def change(n, o):
    if jnp.issubdtype(n.dtype, jnp.floating) and jnp.finfo(n.dtype).bits < 32:
      return rounding.widen(n) - rounding.widen(o)
    return n - o
  return jax.tree.map(change, new, old)


class Optimizer(nnx.Optimizer):
  """``flax.nnx.Optimizer`` whose ``update`` steps the params in place.

  ``nnx.Optimizer``'s constructor, attributes, state and bits; ``update`` runs
  ``oh.update_and_apply``, so the kernel's optimizers write the new params into
  the model's buffers on CPU. Donate the model and the optimizer to the jitted
  step, or XLA copies them first; the fastest loop is ``nnx.jit_partial``
  (docs/algorithms.md#in-place-steps). ``update`` returns each param's change
  (``new - old``, fp32 for 16-bit params), free under ``jit`` unless used.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import optax_half as oh
    >>> model = nnx.Linear(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    >>> optimizer = oh.nnx.Optimizer(model, oh.adamw_bf16(1e-3), wrt=nnx.Param)
    >>> @nnx.jit(donate_argnums=(0, 1))
    ... def train_step(model, optimizer, x):
    ...   grads = nnx.grad(lambda m: (m(x).astype(jnp.float32) ** 2).mean())(model)
    ...   optimizer.update(model, grads)
    >>> train_step(model, optimizer, jnp.ones((4, 3), jnp.bfloat16))
    >>> int(optimizer.step[...]), model.kernel[...].dtype
    (1, dtype(bfloat16))
  """

  def update(self, model, grads, /, **kwargs):
    """One step: ``model``'s ``wrt`` params and this optimizer's state.

    Args:
      model: the module whose params are stepped (as for ``nnx.Optimizer``).
      grads: the gradients, from ``nnx.grad`` with the same ``wrt``.
      **kwargs: passed on to ``tx.update``.

    Returns:
      The change of each stepped param (see the class docstring).
    """
    graph = {"graph": self.graph} if hasattr(self, "graph") else {}
    params = _pure(nnx.state(model, self.wrt, **graph))
    grads = _pure(nnx.state(grads, self.wrt, **graph))
    opt_state = _pure(self.opt_state)
    new_params, new_opt_state = update_and_apply(self.tx, grads, opt_state, params,
                                                 **_pure(kwargs))
    changes = _changes(new_params, params)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_opt_state, **graph))
    self.step[...] += 1
    return changes


# Kept fp32 by default: a variance in bf16 or fp16 loses what the normalization is for.
NORMS = (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)


def apply_policy(model: nnx.Module, policy, *, keep_fp32=NORMS) -> nnx.Module:
  """Stores ``model``'s params in the policy's param dtype and computes in its compute dtype.

  Sets Flax's ``param_dtype`` and ``dtype`` on every submodule that has them and
  casts every floating ``nnx.Param``, in place; ``policy.cast_to_output(model(x))`` gives
  the output dtype. Spec:
  docs/algorithms.md#mixed-precision-policies-and-fp32-gradient-accumulation.

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
