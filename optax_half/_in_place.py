"""``update_and_apply``: one optimizer step that may write the params in place
(docs/algorithms.md#in-place-steps)."""

from __future__ import annotations

import jax
import optax

__all__ = ["chain", "update_and_apply"]


class InPlaceTransformation(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` with in-place steps (set by ``register``);
  one wrapped in ``optax.chain`` or ``optax.masked`` is a plain one (same bits)."""
  update_and_apply = None  # (updates, state, params, **kw) -> (params, state): update + apply
  scaled = None  # (in_place, updates, inv_scale, state, params, **kw): reads unscaled(...)
  clipped = None  # (updates, clip, state, params, **kw): in place, reads clip.apply(updates)


class ClipTransformation(optax.GradientTransformationExtraArgs):
  """A gradient clip (``clip_by_global_norm``) whose ``read(updates)``, a ``clipping.ClipRead``,
  the next in-place step in ``chain`` applies as it reads the gradients."""
  read = None  # set on each instance


def register(tx, step, scaled=None, clipped=None) -> InPlaceTransformation:
  """``tx`` as an ``InPlaceTransformation`` with these in-place, scaled and clipped steps."""
  out = InPlaceTransformation(tx.init, tx.update)
  out.update_and_apply = step
  out.scaled = scaled
  out.clipped = clipped
  return out


def step_of(tx):
  """``tx``'s in-place step, or None."""
  return tx.update_and_apply if isinstance(tx, InPlaceTransformation) else None


def scaled_of(tx):
  """``tx``'s scaled step (``InPlaceTransformation.scaled``), or None."""
  return tx.scaled if isinstance(tx, InPlaceTransformation) else None


def clipped_of(tx):
  """``tx``'s clipped step (``InPlaceTransformation.clipped``), or None."""
  return tx.clipped if isinstance(tx, InPlaceTransformation) else None


def update_and_apply(tx, updates, opt_state, params, **extra_args):
  """``tx.update`` followed by ``optax.apply_updates``, in one step.

  The same bits as the two calls (exceptions: docs/algorithms.md#in-place-steps).
  With the kernel's optimizers on CPU (also in ``dynamic_loss_scale``, or last
  in ``optax_half.chain``) the new params go into the params' buffers: donate
  params and state to the jitted step, the params first (the results' order).

  Args:
    tx: an ``optax.GradientTransformation``.
    updates: the gradients (a tree like ``params``).
    opt_state: ``tx``'s state.
    params: the params; the update of every optimizer here needs them.
    **extra_args: passed on to ``tx.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.adamw_bf16(1e-3)
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> grads = {"w": jnp.full(3, 0.5, jnp.bfloat16)}
    >>> new_params, new_state = oh.update_and_apply(tx, grads, tx.init(params), params)
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> bool((new_params["w"] == optax.apply_updates(params, updates)["w"]).all())
    True
    >>> bool((new_state.compensation["w"] == state.compensation["w"]).all())
    True
  """
  step = step_of(tx)
  if step is not None:
    return step(updates, opt_state, params, **extra_args)
  new_updates, new_state = tx.update(updates, opt_state, params, **extra_args)
  return optax.apply_updates(params, new_updates), new_state


def chain(*transforms) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(*transforms)`` whose ``update_and_apply`` reaches the last
  transformation's in-place step.

  ``optax.chain``'s ``init``, ``update``, state and bits; in place, a
  ``clip_by_global_norm`` just before the kernel's optimizer is applied as the
  kernel reads the gradients (docs/algorithms.md#in-place-steps).

  A compensated optimizer (``adamw_bf16``, ``adam_fp32_master``, the wrappers) must come
  last: its update is made to land exactly on the 16-bit params, so a transformation after
  it that rescales it (``optax.scale``, ``optax.contrib.reduce_on_plateau``) would stall
  bf16 weights; ``init`` refuses that order (nest the transformation inside instead).

  Args:
    *transforms: the transformations, applied in order (at least one).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``optax.chain``'s state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import optax_half as oh
    >>> tx = oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> grads = {"w": jnp.full(3, 10.0, jnp.bfloat16)}
    >>> new_params, state = oh.update_and_apply(tx, grads, tx.init(params), params)
    >>> ref = optax.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))
    >>> updates, _ = ref.update(grads, ref.init(params), params)
    >>> bool((new_params["w"] == optax.apply_updates(params, updates)["w"]).all())
    True
    >>> len(state)  # optax.chain's state: one per transformation
    2
  """
  if not transforms:
    raise ValueError("chain needs at least one transformation.")
  inner = [optax.with_extra_args_support(t) for t in transforms]
  chained = optax.chain(*inner)

  def init(params):
    state = chained.init(params)
    for k, s in enumerate(state[:-1]):
      _check_nothing_after_compensation(k, len(state), s)
    return state
  tx = optax.GradientTransformationExtraArgs(init, chained.update)

  # The clip's norm is taken here, the clipping left to the step that reads the gradients.
  fold_clip = (len(inner) >= 2 and isinstance(inner[-2], ClipTransformation)
               and clipped_of(inner[-1]) is not None)

  def step(updates, state, params, **extra_args):
    if len(state) != len(inner):
      raise ValueError(f"chain of {len(inner)} transformations got a state of {len(state)}: "
                       "a state of another chain.")
    new_state = []
    last_updates = len(inner) - (2 if fold_clip else 1)
    for t, s in zip(inner[:last_updates], state[:last_updates]):
      updates, s = t.update(updates, s, params, **extra_args)
      new_state.append(s)
    if fold_clip:
      clip = inner[-2].read(updates)
      # Traced only: op by op, XLA's division differs (docs/algorithms.md#gradient-clipping).
      leaves = jax.tree.leaves(updates)
      if all(isinstance(g, jax.core.Tracer) and clip.folds(g.dtype) for g in leaves):
        params, last = clipped_of(inner[-1])(updates, clip, state[-1], params, **extra_args)
        return params, tuple(new_state) + (state[-2], last)
      updates, s = inner[-2].update(updates, state[-2], params, **extra_args)
      new_state.append(s)
    params, last = update_and_apply(inner[-1], updates, state[-1], params, **extra_args)
    return params, tuple(new_state) + (last,)

  return register(tx, step)


def _check_nothing_after_compensation(k: int, n: int, state) -> None:
  """Refuse the state of a compensated optimizer at position ``k`` of a chain of ``n``."""
  def compensated(x):  # the wrapper states (optax_half.compensation) say so
    return getattr(type(x), "lands_exactly", False)
  found = [x for x in jax.tree.leaves(state, is_leaf=compensated) if compensated(x)]
  if found:
    raise ValueError(
        f"chain: transformation {k} (with a {type(found[0]).__name__}) is a compensated "
        f"optimizer, followed by {n - 1 - k} more. Its update is made to land exactly on the "
        "16-bit params; a transformation after it (optax.scale, "
        "optax.contrib.reduce_on_plateau) would change it, and bf16 weights would stall. "
        "Put the transformation inside the compensation, e.g. "
        "oh.kahan_summation(optax.chain(optax.adamw(lr), optax.contrib.reduce_on_plateau())), "
        "or, for a transformation of the gradients (clipping), before the optimizer.")
