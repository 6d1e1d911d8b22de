"""optax_half's side of the native CPU kernel (``optax_half_native``).

``fused(...)`` wraps the update of ``adamw_bf16`` and ``adam_fp32_master``:
on CPU the leaves that share their dtypes are stepped by one XLA custom call
(the kernel of ``optax_half_native/adamw.h`` behind an XLA FFI handler,
which splits their elements over XLA's threads) that reads each param,
gradient, moment and buffer once and writes the new param, moments and
buffer in the same pass, where XLA:CPU would run one loop per output and
materialise the fp32 update. The state and the returned updates are those of
the composed transformation (``kahan_summation(scale_by_adamw(...))`` etc.),
bit for bit: the kernel computes what ``scale_by_adamw`` and the wrappers
compute, with the same fp32 scalars (``_coefficients.coefficients``) and the same
random keys. On other platforms, and for trees it does not take (integer
leaves; fp16 params with bf16 moments), the composed
transformation runs: ``lax.platform_dependent``
picks at lowering time, so nothing is decided on the host at run time.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_half_native as native
from optax_half import _flat, _in_place, rounding
from optax_half._coefficients import coefficients
from optax_half._util import (is_float, leaf_indices, transformation, unscaled,
                              unscaled_all_finite)
from optax_half.compensation import Compensation

__all__ = ["available", "fused", "scaled_adam_takes", "scaled_adam_takes_kahan",
           "scaled_adam_sums", "scaled_adam_step", "ScaledAdamStep"]

TARGET = "optax_half_adamw"
FLAT_TARGET = "optax_half_adamw_flat"
FINITE_TARGET = "optax_half_all_finite"
SCALED_SUMS_TARGET = "optax_half_scaled_adam_sums"
SCALED_STEP_TARGET = "optax_half_scaled_adam_step"
_registered: dict = {}


def available() -> bool:
  """Whether the FFI handlers are built and registered (built on first use)."""
  if "ok" not in _registered:
    lib = native.ffi_library(jax.ffi.include_dir())
    if lib is not None:
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.OhAdamw), platform="cpu")
      jax.ffi.register_ffi_target(FLAT_TARGET, jax.ffi.pycapsule(lib.OhAdamwFlat),
                                  platform="cpu")
      jax.ffi.register_ffi_target(FINITE_TARGET, jax.ffi.pycapsule(lib.OhAllFinite),
                                  platform="cpu")
      jax.ffi.register_ffi_target(SCALED_SUMS_TARGET, jax.ffi.pycapsule(lib.OhScaledAdamSums),
                                  platform="cpu")
      jax.ffi.register_ffi_target(SCALED_STEP_TARGET, jax.ffi.pycapsule(lib.OhScaledAdamStep),
                                  platform="cpu")
    _registered["ok"] = lib is not None
  return _registered["ok"]


def _threads() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


_EMPTY = np.zeros((0,), np.float32)


# At most this many leaves per custom call. XLA's compile time grows faster
# than the number of a call's operands (and a call per leaf is slow to compile
# too), while the step time is the same from 32 leaves a call up: 32 keeps
# compiling short at no cost per step (timings:
# benchmarks/README.md#what-bounds-each-row).
_LEAVES_PER_CALL = 32


def _call(target, mode: str, state_rounding: str, scalars, keys, leaves, grads, states,
          in_place: bool):
  """One custom call of ``target`` (``TARGET``: a state array per leaf and
  field; ``FLAT_TARGET``: one per field) over leaves that share their dtypes.
  ``states``: the (mu, nu, buffer) lists, a buffer ``None`` for modes without
  one; the moments are written stochastically where ``state_rounding`` says
  so and one of them is 16-bit. Returns (p_out list, (mu, nu, buffer) lists):
  the new params (or, in mode ``"update"``, the fp32 updates), and the state
  updated in place; with ``in_place`` the new params go into the params'
  buffers."""
  n = len(leaves)
  sr = rounding._stochastic_moments(states[0][0].dtype, states[1][0].dtype, state_rounding)
  states = [[jnp.asarray(_EMPTY) if x is None else x for x in field] for field in states]
  out_dtype = jnp.float32 if mode == "update" else leaves[0].dtype
  state_arrays = [x for field in states for x in field]
  # Operands: scalars, keys, p..., g..., state...; results: p_out..., state...
  aliases = {2 + 2 * n + j: n + j for j in range(len(state_arrays))}  # the state in place
  for k, (p, g) in enumerate(zip(leaves, grads)):
    if in_place:
      # The new param into the param's own buffer: with the params donated to
      # the jitted step nothing is copied; without, XLA copies p first.
      assert out_dtype == p.dtype, mode
      aliases[2 + k] = k
    elif g.dtype == out_dtype:
      # The new param (or fp32 update) into the gradient's buffer: gradients
      # computed in the same jitted step are dead after it, and XLA copies them
      # first where they are not. A fresh temporary would cost page faults on
      # every step with the default allocator (benchmarks/README.md).
      aliases[2 + n + k] = k
  results = ([jax.ShapeDtypeStruct(p.shape, out_dtype) for p in leaves]
             + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_arrays])
  call = jax.ffi.ffi_call(target, results, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(scalars, keys, *leaves, *grads, *state_arrays, mode=np.int32(native.MODES[mode]),
             sr=bool(sr), nthreads=np.int32(_threads()))
  per_field = len(states[0])
  new_states = tuple(list(out[n + f * per_field:n + (f + 1) * per_field]) for f in range(3))
  return list(out[:n]), new_states


def all_finite(tree, inv_scale=None) -> jax.Array:
  """``_util.unscaled_all_finite(tree, inv_scale)``, the gradient check of
  ``dynamic_loss_scale`` and ``skip_nonfinite``.

  On CPU, for bf16, fp32 and (with F16C) fp16 leaves on one device, one
  pass of the native check over each leaf (``oh::all_finite_range``: the same fp32 products,
  each tested for an all-ones exponent), where XLA:CPU's reduction of
  ``isfinite``'s bools runs at a fraction of the memory bandwidth (timings:
  benchmarks/README.md#what-bounds-each-row). Elsewhere XLA's reduction.
  """
  def framework():
    return unscaled_all_finite(tree, inv_scale)

  floats = [jnp.asarray(x) for x in jax.tree.leaves(tree) if is_float(x)]
  if (not floats or jax.default_backend() != "cpu" or _maybe_sharded(tree) or not available()
      or any(x.dtype not in (jnp.bfloat16, jnp.float32)
             and not (x.dtype == jnp.float16 and has_f16()) for x in floats)):
    return framework()
  scale = jnp.ones((1,), jnp.float32) if inv_scale is None else jnp.reshape(
      jnp.asarray(inv_scale, jnp.float32), (1,))
  call = jax.ffi.ffi_call(FINITE_TARGET, jax.ShapeDtypeStruct((), jnp.bool_),
                          vmap_method="sequential")

  def kernel():
    checks = [call(x, scale, nthreads=np.int32(_threads())) for x in floats]
    return jnp.all(jnp.stack(checks))

  return jax.lax.platform_dependent(cpu=kernel, default=framework)


def has_f16() -> bool:
  """Whether the FFI library steps fp16 params (``_takes_f16``; built where
  the CPU has F16C)."""
  return available() and native.has_f16(native.ffi_library(jax.ffi.include_dir()))


def _mode(compensation: Compensation, dtype) -> str:
  """The kernel's mode (a ``native.MODES`` key) for a param of ``dtype``:
  fp32 params take ``"update"`` (the wrappers hand them to the core as they
  are), 16-bit ones their compensation's (``for_dtype``)."""
  if jnp.dtype(dtype) == jnp.float32:
    return "update"
  return compensation.for_dtype(dtype).name


def _takes(compensation, params, grads, core) -> bool:
  """Whether the kernel takes this tree (trace time: dtypes and shapes only):
  bf16 and fp32 leaves, and fp16 params with fp16 or fp32 gradients and
  moments (``_takes_f16``)."""
  ok = (jnp.bfloat16, jnp.float32)
  leaves = jax.tree.leaves(params)
  if not leaves or params is None:
    return False
  for p, g, m, v in zip(leaves, jax.tree.leaves(grads), jax.tree.leaves(core.mu),
                        jax.tree.leaves(core.nu)):
    dtypes = [jnp.asarray(x).dtype for x in (p, g, m, v)]
    if np.shape(g) != np.shape(p):
      return False
    if dtypes[0] == jnp.float16:
      if not _takes_f16(dtypes[1], dtypes[2:]):
        return False
      continue
    if any(d not in ok for d in dtypes):
      return False
    if dtypes[0] == jnp.float32 and dtypes[1:] != [jnp.float32] * 3:
      return False
  return (len(jax.tree.leaves(grads)) == len(leaves) == len(jax.tree.leaves(core.mu))
          == len(jax.tree.leaves(core.nu)))


def _takes_f16(grad_dtype, moment_dtypes) -> bool:
  """Whether the kernel steps an fp16 param with these gradient and moment
  dtypes (``dispatch`` in adamw_ffi.cc: fp16 or fp32 each, in every
  compensation fp16 params take, where the library has fp16)."""
  ok = (jnp.float16, jnp.float32)
  return grad_dtype in ok and all(d in ok for d in moment_dtypes) and has_f16()


def on_cpu(params) -> bool:
  """Whether a step over ``params`` may call the kernel: off CPU
  (``jax.default_backend()``) nothing is built and the framework code is what
  would be lowered anyway; with several devices, or under a mesh, the params
  may be sharded, and the custom calls have no partitioning rule: the
  framework code, which XLA partitions elementwise, runs there."""
  return not (params is None or jax.default_backend() != "cpu" or _maybe_sharded(params)
              or not available())


def _maybe_sharded(params) -> bool:
  """Whether the params may be sharded: JAX has several devices, a mesh is
  set (``jax.set_mesh``), or a leaf's type carries a mesh (explicit sharding)."""
  if jax.device_count() > 1 or not jax.sharding.get_abstract_mesh().empty:
    return True
  return any(not getattr(getattr(jax.typeof(p).sharding, "mesh", None), "empty", True)
             for p in jax.tree.leaves(params))


def _takes_flat(compensation: Compensation, params, grads, state) -> bool:
  """Whether one flat call (``_flat_update``) takes this tree and flat state:
  every leaf a param of one 16-bit dtype (bf16, or fp16 as ``_takes_f16``
  allows) with one gradient dtype, one dtype per flat buffer (the mode's buffer of the
  dtype the kernel reads)."""
  params, grads = jax.tree.leaves(params), jax.tree.leaves(grads)
  core = state.inner_state
  if not params or len(grads) != len(params):
    return False
  dtype = jnp.asarray(params[0]).dtype
  if dtype not in (jnp.bfloat16, jnp.float16) or any(
      jnp.asarray(p).dtype != dtype or np.shape(g) != np.shape(p) for p, g in zip(params, grads)):
    return False
  grad_dtype = jnp.asarray(grads[0]).dtype
  if len({jnp.asarray(g).dtype for g in grads}) != 1 or grad_dtype not in (dtype, jnp.float32):
    return False

  def dtypes(flat):
    return [x.dtype for x in flat.arrays.values()]
  if len(dtypes(core.mu)) != 1 or len(dtypes(core.nu)) != 1:
    return False
  moments = dtypes(core.mu) + dtypes(core.nu)
  if dtype == jnp.float16:
    if not _takes_f16(grad_dtype, moments):
      return False
  elif any(d not in (jnp.bfloat16, jnp.float32) for d in moments):
    return False
  # The buffer the kernel reads (buffer_type in adamw_ffi.cc).
  buffer_dtype = compensation.for_dtype(dtype).buffer_dtype
  want = [] if buffer_dtype is None else [dtype if buffer_dtype == "param" else buffer_dtype]
  buffer = dtypes(compensation.buffers(state)) if compensation.buffer else []
  return buffer == want


def fused(compensation: Compensation, hyperparams: tuple, state_rounding: str, tx_init,
          tx_update, flat_state: bool, name: str) -> _in_place.InPlaceTransformation:
  """``wrap(compensation, scale_by_adamw(*hyperparams, ...))`` (``tx_init``,
  ``tx_update``) with the kernel on CPU: ``adamw_bf16`` or
  ``adam_fp32_master``, as an ``InPlaceTransformation`` whose in-place,
  scaled and clipped steps the kernel takes (the same bits as ``tx_update``,
  which runs elsewhere). With ``flat_state`` the state is in ``_flat``'s
  layout: one call of the flat kernel where it takes the tree
  (``_takes_flat``), else the tree layout's step between an unpack and a
  pack (docs/algorithms.md#the-jax-entry)."""

  def native(updates, state, params) -> bool:
    return on_cpu(params) and _takes(compensation, params, updates, state.inner_state)

  def step(in_place, updates, state, params, extra_args, inv_scale=None, clip=None):
    if (inv_scale is not None or clip is not None) and not native(updates, state, params):
      # No kernel, or one that cannot read these gradients as they are (an
      # fp32 param's bf16 gradient): unscaled or clipped first, as
      # dynamic_loss_scale or clip_by_global_norm would.
      return step(in_place, _read(updates, inv_scale, clip), state, params, extra_args)

    def elsewhere():
      grads = _read(updates, inv_scale, clip)
      new_updates, new_state = tx_update(grads, state, params, **extra_args)
      if in_place:
        return optax.apply_updates(params, new_updates), new_state
      return new_updates, new_state

    if not native(updates, state, params):
      return elsewhere()
    return jax.lax.platform_dependent(
        cpu=lambda: _native_update(compensation, hyperparams, state_rounding, updates, state, params,
                                   in_place=in_place, grad_scale=inv_scale, clip=clip),
        default=elsewhere)

  def flat_step(in_place, updates, state, params, extra_args, inv_scale=None, clip=None):
    if params is None:
      raise ValueError("flat_state=True needs params in update (they give the state's layout).")
    like = _flat.template(tx_init, params)
    _flat.check(state, like)

    def via_tree():
      out, new_state = step(in_place, updates, _flat.unpack(state, like), params, extra_args,
                            inv_scale, clip)
      return out, _flat.pack(new_state)

    if not (on_cpu(params) and _takes_flat(compensation, params, updates, state)):
      return via_tree()
    return jax.lax.platform_dependent(
        cpu=lambda: _flat_update(compensation, hyperparams, state_rounding, updates, state, params,
                                 in_place=in_place, grad_scale=inv_scale, clip=clip),
        default=via_tree)

  if not isinstance(flat_state, bool):
    raise TypeError(f"flat_state must be True or False; got {flat_state!r}.")
  run = flat_step if flat_state else step

  def init(params):
    return _flat.pack(tx_init(params)) if flat_state else tx_init(params)

  def update(updates, state, params=None, **extra_args):
    return run(False, updates, state, params, extra_args)

  def update_and_apply(updates, state, params, **extra_args):
    return run(True, updates, state, params, extra_args)

  def scaled(in_place, updates, inv_scale, state, params, **extra_args):
    return run(in_place, updates, state, params, extra_args, jnp.asarray(inv_scale, jnp.float32))

  def clipped(updates, clip, state, params, **extra_args):
    return run(True, updates, state, params, extra_args, clip=clip)

  return _in_place.register(transformation(init, update, name), update_and_apply, scaled,
                            clipped)


def _read(updates, inv_scale, clip):
  """The gradients a step given ``inv_scale`` or ``clip`` (at most one) reads,
  in framework ops: ``unscaled(updates, inv_scale)`` or ``clip.apply(updates)``."""
  assert inv_scale is None or clip is None
  if inv_scale is not None:
    return unscaled(updates, inv_scale)
  return updates if clip is None else clip.apply(updates)


def _scalars(hyperparams, count, grad_scale, clip=None, grad_dtype=None) -> jax.Array:
  """The kernel's ``Scalars`` (adamw.h; ``native.ADAMW_SCALARS``) of the step
  after ``count``, reading gradients of ``grad_dtype`` unscaled by
  ``grad_scale`` or clipped by ``clip`` (``clipping.ClipRead``), or neither."""
  c = coefficients(*hyperparams, count)
  one = jnp.ones((), jnp.float32)
  grad_scale = one if grad_scale is None else grad_scale
  clip_div, clip_mul = (one, one) if clip is None else clip.factors(grad_dtype)
  values = dict(c._asdict(), grad_scale=grad_scale, clip_div=clip_div, clip_mul=clip_mul)
  return jnp.stack([values[name] for name in native.ADAMW_SCALARS]).astype(jnp.float32)


def _keys(compensation: Compensation, state, leaf) -> jax.Array:
  """The leaf keys (param stream, moment stream) of leaf index ``leaf`` (a
  scalar, or a vector of them: one row each). The param stream is the
  wrapper's where it draws bits, the core's otherwise."""
  core = state.inner_state
  p_seed, p_count = compensation.param_stream(state) or (core.seed, core.count)
  return jnp.stack([rounding._leaf_key(p_seed, p_count, rounding.STREAM_PARAMS, leaf),
                    rounding._leaf_key(core.seed, core.count, rounding.STREAM_MOMENTS, leaf)],
                   axis=-1)


def _fp32_update(p_out, p) -> jax.Array:
  """The wrappers' fp32 update from the kernel's new param: optax.apply_updates(p, u)
  lands on p_out exactly."""
  return rounding.widen(p_out).astype(jnp.float32) - rounding.widen(p).astype(jnp.float32)


def _stepped(compensation: Compensation, state, mu, nu, buffers):
  """``state`` after one step: the new moments and buffers, the counts advanced."""
  core = state.inner_state
  new_core = core._replace(count=optax.safe_increment(core.count), mu=mu, nu=nu)
  return compensation.next_state(state, buffers, new_core)


def _flat_update(compensation, hyperparams, state_rounding, updates, state, params,
                 in_place=False, grad_scale=None, clip=None):
  """``_native_update`` for a flat state (``_takes_flat``): every leaf in one
  call of ``FLAT_TARGET``, whose operands are the leaves' params and
  gradients and the flat moments and buffer, updated in place."""
  leaves, treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, params))
  grads = jax.tree.leaves(updates)
  core = state.inner_state
  flats = [core.mu, core.nu, compensation.buffers(state)]
  states = [[None] if f is None else list(f.arrays.values()) for f in flats]
  # Every leaf is a float leaf: its leaf index is its position.
  keys = _keys(compensation, state, jnp.arange(len(leaves), dtype=jnp.uint32))
  scalars = _scalars(hyperparams, core.count, grad_scale, clip, grads[0].dtype)
  p_out, new = _call(FLAT_TARGET, _mode(compensation, leaves[0].dtype), state_rounding, scalars, keys,
                     leaves, grads, states, in_place)
  if in_place:
    result = jax.tree.unflatten(treedef, p_out)
  else:
    result = jax.tree.unflatten(treedef, [_fp32_update(q, p) for q, p in zip(p_out, leaves)])
  mu, nu, buffer = (None if f is None else _flat.Flat(dict(zip(f.arrays, x)))
                    for f, x in zip(flats, new))
  return result, _stepped(compensation, state, mu, nu, buffer)


def _native_update(compensation, hyperparams, state_rounding, updates, state, params,
                   in_place=False, grad_scale=None, clip=None):
  """(updates, state), or with ``in_place`` (new params, state). With
  ``grad_scale`` (fp32), the step of the gradients ``unscaled(updates,
  grad_scale)``: the kernel multiplies each gradient element by it as it reads it.
  With ``clip`` (``clipping.ClipRead``), the step of ``clip.apply(updates)``:
  the kernel clips each gradient element as it reads it.
  One call of ``TARGET`` per group of leaves sharing their dtypes (and so
  their mode: fp32 params take ``"update"``), of at most ``_LEAVES_PER_CALL``
  leaves, so a tree of many small leaves is a few calls whose elements are
  split over the threads."""
  leaves, treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, params))
  grads, mus, nus, index = (treedef.flatten_up_to(t) for t in (
      updates, state.inner_state.mu, state.inner_state.nu, leaf_indices(params)))
  if compensation.buffer:
    buffers = treedef.flatten_up_to(compensation.buffers(state))
  else:
    buffers = [optax.MaskedNode()] * len(leaves)
  core = state.inner_state
  groups: dict = {}
  for k, (p, g, m, v, b) in enumerate(zip(leaves, grads, mus, nus, buffers)):
    # Mode "update" (fp32 leaves) reads no buffer; a leaf's buffer, if any, is kept as it is.
    mode = _mode(compensation, p.dtype)
    buffer_dtype = None if mode == "update" or isinstance(b, optax.MaskedNode) else b.dtype
    groups.setdefault((mode, p.dtype, g.dtype, m.dtype, v.dtype, buffer_dtype), []).append(k)
  out, new_mu, new_nu, new_buffers = [None] * len(leaves), list(mus), list(nus), list(buffers)
  calls = [(key, ks[i:i + _LEAVES_PER_CALL]) for key, ks in groups.items()
           for i in range(0, len(ks), _LEAVES_PER_CALL)]
  for (mode, _, grad_dtype, *_, buffer_dtype), ks in calls:
    pick = lambda xs: [xs[k] for k in ks]  # noqa: E731
    scalars = _scalars(hyperparams, core.count, grad_scale, clip, grad_dtype)
    has_buffer = buffer_dtype is not None
    states = [pick(mus), pick(nus), pick(buffers) if has_buffer else [None] * len(ks)]
    keys = _keys(compensation, state, jnp.asarray([index[k] for k in ks], jnp.uint32))
    p_out, (m, v, b) = _call(TARGET, mode, state_rounding, scalars, keys, pick(leaves),
                             pick(grads), states, in_place and mode != "update")
    for j, k in enumerate(ks):
      p = leaves[k]
      if mode == "update":  # p_out is the fp32 update; in place, what apply_updates does
        out[k] = (p + p_out[j]).astype(p.dtype) if in_place else p_out[j]
      else:
        out[k] = p_out[j] if in_place else _fp32_update(p_out[j], p)
      new_mu[k], new_nu[k] = m[j], v[j]
      if has_buffer:
        new_buffers[k] = b[j]
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
  buffers_tree = unflat(new_buffers) if compensation.buffer else None
  return unflat(out), _stepped(compensation, state, unflat(new_mu), unflat(new_nu), buffers_tree)


# -- ScaledAdam (optax_half_native/scaled_adam.h) -------------------------------


def scaled_adam_takes(p, g, v) -> bool:
  """Whether the kernel steps this ScaledAdam leaf (trace time: dtypes and
  shapes): more than one element, and (param, gradient, second moment)
  types in ``optax_half_native.SCALED_ADAM_CONFIGS`` (or its fp16 ones)."""
  if np.size(p) <= 1 or np.shape(g) != np.shape(p) or np.shape(v) != np.shape(p):
    return False
  config = "".join(_CODES.get(jnp.dtype(x.dtype).name, "?") for x in (p, g, v))
  return config in native.SCALED_ADAM_CONFIGS or (
      config in native.SCALED_ADAM_F16_CONFIGS and has_f16())


# The native libraries' type codes.
_CODES = {"float32": "F", "bfloat16": "B", "float16": "H"}


def _groups(leaves, grads) -> list:
  """Positions of the leaves by (param, gradient) dtypes, in chunks of at
  most ``_LEAVES_PER_CALL``: one custom call each."""
  by_config: dict = {}
  for k, (p, g) in enumerate(zip(leaves, grads)):
    by_config.setdefault((p.dtype, g.dtype), []).append(k)
  return [ks[i:i + _LEAVES_PER_CALL] for ks in by_config.values()
          for i in range(0, len(ks), _LEAVES_PER_CALL)]


def scaled_adam_takes_kahan(p, g, c, delta, v) -> bool:
  """Whether the kernel steps this leaf of ``kahan_summation(scaled_adam)``
  whole: a bf16 (or, where the library has it, fp16) param of more than one
  element, its compensation, a gradient of its dtype or fp32, and
  ScaledAdam's fp32 state for ``p + c``."""
  dtype = jnp.dtype(p.dtype)
  if np.size(p) <= 1 or any(np.shape(x) != np.shape(p) for x in (g, c, delta, v)):
    return False
  if dtype != jnp.bfloat16 and not (dtype == jnp.float16 and has_f16()):
    return False
  return (jnp.dtype(c.dtype) == dtype and jnp.dtype(g.dtype) in (dtype, jnp.float32)
          and jnp.dtype(delta.dtype) == jnp.float32 == jnp.dtype(v.dtype))


def scaled_adam_sums(leaves, grads, rms, want, comps=None) -> jax.Array:
  """f32[n, 3]: per leaf ``sum((g r)^2)``, ``sum(p g)`` and ``mean(p p)``
  (``r = rms[k]``; ``want[k]``: 1 asks for the first, 2 for the last, which
  are 0 otherwise): the kernel's float64 sums, each rounded once. With
  ``comps`` (Kahan compensations) the param is ``p + c``."""
  rows = [None] * len(leaves)
  for ks in _groups(leaves, grads):
    call = jax.ffi.ffi_call(SCALED_SUMS_TARGET, jax.ShapeDtypeStruct((len(ks), 3), jnp.float32),
                            vmap_method="sequential")
    extra = [comps[k] for k in ks] if comps is not None else []
    out = call(jnp.stack([rms[k] for k in ks]), jnp.stack([want[k] for k in ks]),
               *[leaves[k] for k in ks], *[grads[k] for k in ks], *extra,
               kahan=comps is not None, nthreads=np.int32(_threads()))
    for j, k in enumerate(ks):
      rows[k] = out[j]
  return jnp.stack(rows)


class ScaledAdamStep(NamedTuple):
  """What ``scaled_adam_step`` returns, per leaf: the new deltas and second
  moments, with ``comps`` the new compensations (else None), and with
  ``comps`` or ``in_place`` the new params (else None)."""
  deltas: list
  vs: list
  comps: Optional[list]
  params: Optional[list]


def scaled_adam_step(scalars, size, leaves, grads, deltas, vs, comps=None,
                     in_place=False) -> ScaledAdamStep:
  """The kernel's step of ScaledAdam leaves: ``scalars`` f32[n, 10] and
  ``size`` int32[n] per leaf (``ScaledAdamScalars``; whether the step adds
  the size term). The state (with ``comps`` the Kahan compensations too) is
  written into its operands' buffers (donated to the jitted step, nothing is
  copied). The params are only read, or with ``in_place`` the new params are
  written into their buffers (donate them) and returned. With ``comps`` the
  param is ``p + c`` and the step is ``kahan_summation``'s, returning the new
  16-bit params ``p'``; unless ``in_place`` they go into the gradients'
  buffers where those have the params' dtype (as ``adamw``'s ``tx.update``:
  gradients computed in the jitted step are dead after it, and XLA copies
  the others first)."""
  n = len(leaves)
  kahan = comps is not None
  fields = ["deltas", "vs"] + (["comps"] if kahan else []) + (
      ["params"] if kahan or in_place else [])
  new = {f: [None] * n for f in fields}
  for ks in _groups(leaves, grads):
    m = len(ks)
    operands = ([leaves[k] for k in ks] + [grads[k] for k in ks] + [deltas[k] for k in ks]
                + [vs[k] for k in ks] + ([comps[k] for k in ks] if kahan else []))
    # Operands: scalars, size, p..., g..., delta..., v..., (c...); results in
    # `fields` order, the state aliased to its operands, the new params to
    # the params in place, else to the gradients of the params' dtype.
    to_grads = not in_place and grads[ks[0]].dtype == leaves[ks[0]].dtype
    source = {"deltas": 2 * m, "vs": 3 * m, "comps": 4 * m, "params": 0}
    aliases, results = {}, []
    for r, f in enumerate(fields):
      for j in range(m):
        if f != "params" or in_place:
          aliases[2 + source[f] + j] = r * m + j
        elif to_grads:
          aliases[2 + m + j] = r * m + j
        results.append(jax.ShapeDtypeStruct(operands[source[f] + j].shape,
                                            operands[source[f] + j].dtype))
    call = jax.ffi.ffi_call(SCALED_STEP_TARGET, results, input_output_aliases=aliases,
                            vmap_method="sequential")
    out = call(scalars[jnp.asarray(ks)], size[jnp.asarray(ks)], *operands, kahan=kahan,
               nthreads=np.int32(_threads()))
    for r, f in enumerate(fields):
      for j, k in enumerate(ks):
        new[f][k] = out[r * m + j]
  return ScaledAdamStep(new["deltas"], new["vs"], new.get("comps"), new.get("params"))
