"""``update_and_apply``: one optimizer step that may write the params in place.

``optax.apply_updates(params, updates)`` is a pass of its own over the params
and the updates after ``tx.update``. For the optimizers whose step is one
native kernel (``adamw_bf16``, ``adam_fp32_master``, ``scaled_adam`` and
``kahan_summation(scaled_adam)`` on CPU) that pass costs
about as much again as the kernel's reads and writes of the param, and the
kernel can write the new param itself: ``update_and_apply`` lets it, into the
params' own buffers (donate the params to the jitted step, or XLA copies them
first). Any other transformation runs ``tx.update`` then
``optax.apply_updates``. Either way the result is the same bits (two
exceptions in ``update_and_apply``'s docstring).
"""

from __future__ import annotations

import jax
import optax

__all__ = ["chain", "update_and_apply"]


class InPlaceTransformation(optax.GradientTransformationExtraArgs):
  """An ``optax.GradientTransformationExtraArgs`` that carries an in-place step.

  ``update_and_apply(updates, state, params, **extra_args) -> (params,
  state)``: the bits of ``update`` followed by ``optax.apply_updates``.
  ``scaled(in_place, updates, inv_scale, state, params, **extra_args)``, or
  None: the bits of ``update`` (``in_place`` False) or of the in-place step
  (True) given the gradients ``_util.unscaled(updates, inv_scale)``, for a
  step that unscales the gradients as it reads them (``dynamic_loss_scale``).
  ``clipped(updates, clip, state, params, **extra_args)``, or None: the
  bits of the in-place step given the gradients ``clip.apply(updates)``
  (``clipping.ClipRead``), for a step that clips the gradients as it reads
  them (``chain`` of ``clip_by_global_norm`` and this transformation).
  A transformation built around one (``optax.chain``, ``optax.masked``)
  is a plain one: it runs ``update`` and ``optax.apply_updates``, with the
  same bits.
  """
  update_and_apply = None  # set on each instance by `register`
  scaled = None
  clipped = None


class ClipTransformation(optax.GradientTransformationExtraArgs):
  """A gradient clip that the in-place step after it in ``chain`` can apply
  as it reads the gradients (``clip_by_global_norm``): ``read(updates)`` is
  the step's clip (``clipping.ClipRead``), whose ``apply`` is ``update``'s
  result."""
  read = None  # set on each instance


def register(tx, step, scaled=None, clipped=None) -> InPlaceTransformation:
  """``tx``'s ``init`` and ``update`` as an ``InPlaceTransformation`` with
  in-place step ``step`` (and scaled step ``scaled``, clipped step ``clipped``)."""
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

  Returns ``(new_params, new_opt_state)``, bit for bit what

      updates, new_opt_state = tx.update(updates, opt_state, params, **extra_args)
      new_params = optax.apply_updates(params, updates)

  returns. For ``adamw_bf16``, ``adam_fp32_master`` (also with
  ``skip_nonfinite=True``), ``scaled_adam`` and ``kahan_summation(scaled_adam)``
  on CPU (also inside ``dynamic_loss_scale`` and last in ``optax_half.chain``,
  not inside an ``optax.chain``), the native kernel writes the new params into the params'
  buffers and no ``apply_updates`` pass runs: jit the step with the params and
  the state donated (``donate_argnums``) so XLA has nothing to copy, and
  take the params before the state in the jitted function's arguments, the
  order of the results: ``jax.jit`` pairs donated inputs with outputs in
  order, and with the state first it hands the new params the state's
  buffers, so XLA copies every array in and out of the kernel (several
  times slower). Elsewhere, and for any other transformation, the two calls
  above run.

  Args:
    tx: an ``optax.GradientTransformation``.
    updates: the gradients (a tree like ``params``).
    opt_state: ``tx``'s state.
    params: the params; the update of every optimizer here needs them.
    **extra_args: passed on to ``tx.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Example:
    The same bits as ``tx.update`` and ``optax.apply_updates``:

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

  ``init`` and ``update`` are ``optax.chain``'s own (the same state: a tuple
  of the transformations' states, so checkpoints and ``torch_bridge.convert``
  take either). ``update_and_apply(chain(...), grads, state, params)`` runs
  the ``update`` of every transformation but the last, then
  ``update_and_apply`` of the last: with ``adamw_bf16`` or
  ``adam_fp32_master`` last (e.g. after ``clip_by_global_norm``), the
  kernel writes the params in place, where ``optax.chain`` would run the
  optimizer's ``update`` and a separate ``optax.apply_updates`` pass. An
  ``optax_half.clip_by_global_norm`` just before such an optimizer is
  computed by the kernel as it reads each bf16 or fp32 gradient (jitted; the
  chain takes the norm): no clipped copy of the gradients
  (docs/algorithms.md#gradient-clipping). The same bits either way.

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
  tx = optax.chain(*inner)

  # clip_by_global_norm then a step that clips as it reads the gradients:
  # the clip's norm is taken here and the clipping left to that step.
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
      # Traced (under jit) only: op by op, XLA divides by a scalar through its
      # reciprocal (fp32: other bits), which the kernel's division would not match.
      leaves = jax.tree.leaves(updates)
      if all(isinstance(g, jax.core.Tracer) and clip.folds(g.dtype) for g in leaves):
        params, last = clipped_of(inner[-1])(updates, clip, state[-1], params, **extra_args)
        return params, tuple(new_state) + (state[-2], last)
      updates, s = inner[-2].update(updates, state[-2], params, **extra_args)
      new_state.append(s)
    params, last = update_and_apply(inner[-1], updates, state[-1], params, **extra_args)
    return params, tuple(new_state) + (last,)

  return register(tx, step)
