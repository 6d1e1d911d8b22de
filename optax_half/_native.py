"""optax_half's side of the native CPU kernel (``optax_half_native``): XLA custom calls
with the composed transformation's bits (docs/algorithms.md#the-jax-entry).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_half_native as native
from optax_half import _flat, _gpu, _in_place, _pallas, _tpu, rounding
from optax_half import compensation as compensation_lib
from optax_half._coefficients import coefficients
from optax_half._util import (check_state_fits, compiled_init, decay_mask, is_float,
                              leaf_indices, transformation, unscaled, unscaled_all_finite)
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


_NO_DERIVATIVE = (
    "optax_half: the native CPU kernel ({target}) has no derivative, and this step was "
    "traced before JAX differentiated it (a jitted step or lax.scan traced outside "
    "jax.grad, then differentiated). optax_half takes the differentiable composed path "
    "when the step is traced under jax.grad/jvp/vjp: call jax.grad outside the jit or "
    "scan, or turn the kernel off with OPTAX_HALF_NATIVE=0 (set before importing "
    "optax_half). docs/algorithms.md#the-jax-entry")


def differentiating() -> bool:
  """Whether JAX is differentiating what is being traced now (``jax.grad``, ``jvp``, ``vjp``,
  ``linearize``, also around the jit or scan being traced): the kernel, which has no
  derivative, is then not taken (docs/algorithms.md#the-jax-entry)."""
  try:
    from jax._src import core as jax_core  # noqa: PLC0415 (JAX's internals, read only here)
    from jax._src.interpreters import ad  # noqa: PLC0415
    trace = jax_core.trace_ctx.trace
  except (ImportError, AttributeError):  # another JAX: the custom calls' own error guards
    return False
  kinds = tuple(k for k in (getattr(ad, "JVPTrace", None), getattr(ad, "LinearizeTrace", None))
                if k is not None)
  while trace is not None:
    if isinstance(trace, kinds):
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


def _ffi_call(target, results, **kwargs):
  """``jax.ffi.ffi_call(target, results, **kwargs)`` whose derivative is a clear error
  naming the fix, not JAX's generic one."""
  call = jax.ffi.ffi_call(target, results, **kwargs)

  def bound(*args, **attrs):
    @jax.custom_jvp
    def run(*operands):
      return call(*operands, **attrs)

    @run.defjvp
    def _no_jvp(primals, tangents):
      raise ValueError(_NO_DERIVATIVE.format(target=target))

    return run(*args)

  return bound




_EMPTY = np.zeros((0,), np.float32)


# Leaves per call: short compiles at no cost per step (docs/algorithms.md#the-jax-entry).
_LEAVES_PER_CALL = 32


def _call(target, mode: str, state_rounding: str, scalars, keys, leaves, grads, states,
          in_place: bool):
  """One call of ``target`` (``TARGET``: state arrays per leaf, ``FLAT_TARGET``: per field) over
  leaves sharing dtypes; ``states``: (mu, nu, buffer or None) lists. Returns the new params
  (mode ``"update"``: fp32 updates; 16-bit params: updates in their dtype, or with ``in_place``
  the landed params in their buffers), state (in place) and the master mode's new marks per
  leaf (``MasterWeightsState.missed``: 0 in place)."""
  n = len(leaves)
  sr = rounding._stochastic_moments(states[0][0].dtype, states[1][0].dtype, state_rounding)
  states = [[jnp.asarray(_EMPTY) if x is None else x for x in field] for field in states]
  out_dtype = jnp.float32 if mode == "update" else leaves[0].dtype
  state_arrays = [x for field in states for x in field]
  # Operands: scalars, keys, p..., g..., state...; results: p_out..., state...
  aliases = {2 + 2 * n + j: n + j for j in range(len(state_arrays))}  # the state in place
  for k, (p, g) in enumerate(zip(leaves, grads)):
    if in_place:
      # Nothing is copied if the params are donated; else XLA copies p first.
      assert out_dtype == p.dtype, mode
      aliases[2 + k] = k
    elif g.dtype == out_dtype:
      # Into the gradient's buffer, not a fresh temporary (docs/algorithms.md#the-jax-entry).
      aliases[2 + n + k] = k
  marked = mode == "master" and not in_place  # the update's marks, summed by the kernel
  results = ([jax.ShapeDtypeStruct(p.shape, out_dtype) for p in leaves]
             + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_arrays]
             + ([jax.ShapeDtypeStruct((n,), jnp.uint32)] if marked else []))
  call = _ffi_call(target, results, input_output_aliases=aliases,
                          vmap_method="sequential")
  out = call(scalars, keys, *leaves, *grads, *state_arrays, mode=np.int32(native.MODES[mode]),
             sr=bool(sr), update=not in_place, nthreads=np.int32(native.cpus()))
  per_field = len(states[0])
  new_states = tuple(list(out[n + f * per_field:n + (f + 1) * per_field]) for f in range(3))
  marks = out[-1] if marked else jnp.zeros((n,), jnp.uint32)
  return list(out[:n]), new_states, marks


def all_finite(tree, inv_scale=None) -> jax.Array:
  """``_util.unscaled_all_finite(tree, inv_scale)``; on CPU one native pass per leaf
  (``oh::all_finite_range``, docs/algorithms.md#dynamic-loss-scaling)."""
  def framework():
    return unscaled_all_finite(tree, inv_scale)

  floats = [jnp.asarray(x) for x in jax.tree.leaves(tree) if is_float(x)]
  if (not floats or jax.default_backend() != "cpu" or _maybe_sharded(tree) or not available()
      or any(x.dtype not in (jnp.bfloat16, jnp.float32)
             and not (x.dtype == jnp.float16 and has_f16()) for x in floats)):
    return framework()
  scale = jnp.ones((1,), jnp.float32) if inv_scale is None else jnp.reshape(
      jnp.asarray(inv_scale, jnp.float32), (1,))
  # A bool of the gradients: no derivative to pass on (the kernel has none).
  floats, scale = jax.lax.stop_gradient((floats, scale))
  call = _ffi_call(FINITE_TARGET, jax.ShapeDtypeStruct((), jnp.bool_),
                   vmap_method="sequential")

  def kernel():
    checks = [call(x, scale, nthreads=np.int32(native.cpus())) for x in floats]
    return jnp.all(jnp.stack(checks))

  return jax.lax.platform_dependent(cpu=kernel, default=framework)


def has_f16() -> bool:
  """Whether the FFI library steps fp16 params (``_takes_f16``; built where
  the CPU has F16C)."""
  return available() and native.has_f16(native.ffi_library(jax.ffi.include_dir()))


def _mode(compensation: Compensation, dtype) -> str:
  """The kernel's mode (``native.MODES`` key): ``"update"`` for fp32 params (the wrappers
  hand them to the core as they are), else the compensation's for ``dtype``."""
  if jnp.dtype(dtype) == jnp.float32:
    return "update"
  return compensation.for_dtype(dtype).name


def _takes(compensation, params, grads, core) -> bool:
  """Whether the kernel takes this tree (trace time): bf16 and fp32 leaves, and fp16
  params as ``_takes_f16`` allows."""
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
          == len(jax.tree.leaves(core.nu))
          and _steps_loaded(compensation, [jnp.asarray(p).dtype for p in leaves]))


def _steps_loaded(compensation: Compensation, dtypes) -> bool:
  """Whether the kernel's steps of 16-bit params of ``dtypes`` in ``compensation``'s modes are
  loaded (``native.ffi_steps``: each built on first use, at trace time)."""
  pairs = {(jnp.dtype(d).name, _mode(compensation, d)) for d in dtypes
           if jnp.dtype(d) != jnp.float32}
  return native.ffi_steps(jax.ffi.include_dir(), sorted(pairs))


def _takes_f16(grad_dtype, moment_dtypes) -> bool:
  """Whether the kernel steps an fp16 param with these gradient and moment dtypes
  (``dispatch`` in adamw_ffi.cc: fp16 or fp32 each, where the library has fp16)."""
  ok = (jnp.float16, jnp.float32)
  return grad_dtype in ok and all(d in ok for d in moment_dtypes) and has_f16()


def on_cpu(params) -> bool:
  """Whether a step over ``params`` may call the kernel: on the CPU backend, unsharded (the
  custom calls have no partitioning rule) and not differentiated (they have no derivative;
  docs/algorithms.md#the-jax-entry)."""
  return not (params is None or jax.default_backend() != "cpu" or _maybe_sharded(params)
              or not available() or differentiating())


def _on(backend: str, variable: str, params) -> bool:
  """Whether a step over ``params`` takes a backend's Pallas kernels where it is compiled
  for it: on that backend (``variable=1``: from any backend, as a deviceless compile
  needs; ``0``: never), unsharded and not differentiated (a ``pallas_call`` has no
  partitioning rule or derivative here)."""
  mode = os.environ.get(variable, "auto")
  if mode == "0" or (mode != "1" and jax.default_backend() != backend):
    return False
  return not (params is None or _maybe_sharded(params) or differentiating())


def on_tpu(params) -> bool:
  """``_on`` for ``_tpu``'s kernels (``OPTAX_HALF_TPU_KERNEL``)."""
  return _on("tpu", "OPTAX_HALF_TPU_KERNEL", params)


def on_gpu(params) -> bool:
  """``_on`` for ``_gpu``'s kernels on an NVIDIA GPU (``OPTAX_HALF_GPU_KERNEL``)."""
  return _on("gpu", "OPTAX_HALF_GPU_KERNEL", params)


def _maybe_sharded(params) -> bool:
  """Whether the params may be sharded: JAX has several devices, a mesh is
  set (``jax.set_mesh``), or a leaf's type carries a mesh (explicit sharding)."""
  if jax.device_count() > 1 or not jax.sharding.get_abstract_mesh().empty:
    return True
  return any(not getattr(getattr(jax.typeof(p).sharding, "mesh", None), "empty", True)
             for p in jax.tree.leaves(params))


def _takes_flat(compensation: Compensation, params, grads, state) -> bool:
  """Whether one flat call (``_flat_update``) takes this tree and flat state
  (docs/algorithms.md#flat-state)."""
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
  buffer_dtype = compensation.for_dtype(dtype).buffer_dtype_of(dtype)
  want = [] if buffer_dtype is None else [buffer_dtype]
  buffer = dtypes(compensation.buffers(state)) if compensation.buffer else []
  return buffer == want and _steps_loaded(compensation, [dtype])


def fused(compensation: Compensation, hyperparams: tuple, state_rounding: str, tx_init,
          tx_update, flat_state: bool, name: str, mask=None,
          kernel: bool = True, tx_apply=None) -> _in_place.InPlaceTransformation:
  """``adamw_bf16`` or ``adam_fp32_master`` (``tx_init``, ``tx_update``, and ``tx_apply`` its
  in-place step) with the kernel on CPU:
  an ``InPlaceTransformation`` with ``tx_update``'s bits; with ``flat_state`` in ``_flat``'s
  layout (docs/algorithms.md#the-jax-entry, docs/algorithms.md#flat-state). ``mask``: the
  weight-decay mask (``_util.decay_mask``), a kernel call per setting; ``kernel=False``:
  options the kernel lacks (eps_root, nesterov), always ``tx_update``."""

  def native(updates, state, params) -> bool:
    return kernel and on_cpu(params) and _takes(compensation, params, updates,
                                                state.inner_state)

  def decays(updates, params):
    """Per leaf of ``params`` (flattened), whether weight decay applies, or None (all)."""
    tree = decay_mask(mask, updates)
    return None if tree is None else jax.tree.structure(params).flatten_up_to(tree)

  def step(in_place, updates, state, params, extra_args, inv_scale=None, clip=None):
    if (inv_scale is not None or clip is not None) and not native(updates, state, params):
      # No kernel for these gradients as they are (an fp32 param's bf16 one): unscale/clip first.
      return step(in_place, _read(updates, inv_scale, clip), state, params, extra_args)

    def elsewhere():
      grads = _read(updates, inv_scale, clip)
      if in_place and tx_apply is not None:
        return tx_apply(grads, state, params, **extra_args)
      new_updates, new_state = tx_update(grads, state, params, **extra_args)
      if in_place:
        return optax.apply_updates(params, new_updates), new_state
      return new_updates, new_state

    branches = {}
    if native(updates, state, params):
      branches["cpu"] = lambda: _native_update(
          compensation, hyperparams, state_rounding, updates, state, params, in_place=in_place,
          grad_scale=inv_scale, clip=clip, decays=decays(updates, params))
    if kernel and on_tpu(params) and inv_scale is None and clip is None and _tpu.takes(
        compensation, params, updates, state.inner_state):
      branches["tpu"] = lambda: _tpu_update(
          compensation, hyperparams, state_rounding, updates, state, params, in_place,
          decays=decays(updates, params))
    # Through tx.update, XLA:GPU fuses the caller's apply_updates into its step (18 B/param);
    # a kernel cannot (24): docs/algorithms.md#pallas-kernels.
    if (kernel and in_place and on_gpu(params) and inv_scale is None and clip is None
        and _gpu.takes(compensation, params, updates, state.inner_state)):
      branches["cuda"] = lambda: _gpu_update(
          compensation, hyperparams, state_rounding, updates, state, params, in_place,
          decays=decays(updates, params))
    if not branches:
      return elsewhere()
    return jax.lax.platform_dependent(**branches, default=elsewhere)

  def flat_step(in_place, updates, state, params, extra_args, inv_scale=None, clip=None):
    if params is None:
      raise ValueError("flat_state=True needs params in update (they give the state's layout).")
    like = _flat.template(tx_init, params)
    _flat.check(state, like)

    def via_tree():
      out, new_state = step(in_place, updates, _flat.unpack(state, like), params, extra_args,
                            inv_scale, clip)
      return out, _flat.pack(new_state)

    # One flat call has one weight decay: a mask with a leaf off goes leaf by leaf.
    flags = decays(updates, params) if kernel and mask is not None else None
    branches = {}
    if (kernel and on_cpu(params) and _takes_flat(compensation, params, updates, state)
        and (flags is None or all(flags))):
      branches["cpu"] = lambda: _flat_update(
          compensation, hyperparams, state_rounding, updates, state, params,
          in_place=in_place, grad_scale=inv_scale, clip=clip)
    if (kernel and on_gpu(params) and inv_scale is None and clip is None
        and (flags is None or all(flags))
        and _gpu.takes(compensation, params, updates, like.inner_state, flat=True)
        and all(len(f.arrays) == 1 for f in _flat_fields(compensation, state))):
      branches["cuda"] = lambda: _gpu_flat_update(
          compensation, hyperparams, state_rounding, updates, state, params, in_place)
    if not branches:
      return via_tree()
    return jax.lax.platform_dependent(**branches, default=via_tree)

  if not isinstance(flat_state, bool):
    raise TypeError(f"flat_state must be True or False; got {flat_state!r}.")

  @compiled_init
  def init(params):
    return _flat.pack(tx_init(params)) if flat_state else tx_init(params)

  def run(in_place, updates, state, params, extra_args, *args, **kwargs):
    # Trace time: a state made for params of other dtypes is refused, naming the leaf.
    check_state_fits(name, init, state, params)
    return (flat_step if flat_state else step)(in_place, updates, state, params, extra_args,
                                               *args, **kwargs)

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
  """The kernel's ``Scalars`` (``native.ADAMW_SCALARS``) of the step after ``count``, its
  gradients of ``grad_dtype`` read unscaled by ``grad_scale`` or clipped by ``clip``."""
  c = coefficients(*hyperparams, count)
  one = jnp.ones((), jnp.float32)
  grad_scale = one if grad_scale is None else grad_scale
  clip_div, clip_mul = (one, one) if clip is None else clip.factors(grad_dtype)
  values = dict(c._asdict(), grad_scale=grad_scale, clip_div=clip_div, clip_mul=clip_mul)
  return jnp.stack([values[name] for name in native.ADAMW_SCALARS]).astype(jnp.float32)


def _keys(compensation: Compensation, state, leaf, marks=None) -> jax.Array:
  """(param stream key, moment stream key, mark) of leaf index ``leaf`` (or a row per
  index); the param stream is the wrapper's where it draws bits, else the core's; ``marks``
  (master mode: ``MasterWeightsState.missed``), from which the kernel's read makes its
  check (``compensation.kept``; ``set_keeps`` in adamw_ffi.cc), else 0."""
  core = state.inner_state
  p_seed, p_count = compensation.param_stream(state) or (core.seed, core.count)
  key_p = rounding._leaf_key(p_seed, p_count, rounding.STREAM_PARAMS, leaf)
  marks = jnp.zeros_like(key_p) if marks is None else jnp.asarray(marks, jnp.uint32)
  return jnp.stack([key_p, rounding._leaf_key(core.seed, core.count, rounding.STREAM_MOMENTS,
                                              leaf), marks], axis=-1)




def _advanced_counts(compensation: Compensation, state) -> list:
  """The counts after a step: the core's, and the wrapper's random-bit count where it draws
  bits."""
  core = state.inner_state
  counts = [core.count] + ([state.rng_count] if compensation.spec.draws_bits else [])
  return [optax.safe_increment(c) for c in counts]


def _stepped(compensation: Compensation, state, mu, nu, buffers, counts=None):
  """``state`` after one step: the new moments and buffers, and ``counts``
  (``_advanced_counts``' values; computed here if None)."""
  counts = _advanced_counts(compensation, state) if counts is None else counts
  new_core = state.inner_state._replace(count=counts[0], mu=mu, nu=nu)
  new = compensation.next_state(state, buffers, new_core)
  return new._replace(rng_count=counts[1]) if len(counts) > 1 else new


def _operands(kernels, compensation, hyperparams, state, params) -> tuple:
  """``_pallas.operands`` of a step: the Pallas kernels' vector (``_keys``' rows of every
  leaf of ``params``, all float leaves: a leaf's index is its position, no marks) and, for
  ``_gpu``'s kernels, the advanced counts read back from it (else None: ``_stepped``
  advances them; on XLA:TPU the vector's barrier grew a step's temporaries)."""
  keys = _keys(compensation, state, jnp.arange(len(jax.tree.leaves(params)), dtype=jnp.uint32))
  counts = _advanced_counts(compensation, state) if kernels is _gpu else []
  ops, counts = _pallas.operands(hyperparams, state.inner_state.count, keys, counts)
  return ops, counts or None


def _pallas_update(kernels, compensation, hyperparams, state_rounding, updates, state, params,
                   in_place, decays=None, interpret=False):
  """(new params or updates, state) of a Pallas kernel per leaf: ``kernels`` ``_tpu`` or
  ``_gpu`` (its ``takes``; docs/algorithms.md#pallas-kernels); ``interpret``: on CPU, in
  Pallas's interpreter."""
  ops, counts = _operands(kernels, compensation, hyperparams, state, params)
  out, mu, nu, buffers = kernels.update(
      compensation, hyperparams, state_rounding, updates, state, params, in_place, ops,
      decays, interpret)
  return out, _stepped(compensation, state, mu, nu, buffers, counts)


def _tpu_update(*args, **kwargs):
  """``_pallas_update`` of ``_tpu``'s kernels."""
  return _pallas_update(_tpu, *args, **kwargs)


def _gpu_update(*args, **kwargs):
  """``_pallas_update`` of ``_gpu``'s kernels."""
  return _pallas_update(_gpu, *args, **kwargs)


def _flat_fields(compensation, state) -> list:
  """A flat state's ``_flat.Flat`` fields a step writes: mu, nu and the buffer, if any."""
  core = state.inner_state
  return [core.mu, core.nu] + ([compensation.buffers(state)] if compensation.buffer else [])


def _gpu_flat_update(compensation, hyperparams, state_rounding, updates, state, params,
                     in_place, interpret=False):
  """``_gpu_update`` for a flat state: each leaf's kernel steps its slice of the flat
  arrays in place (docs/algorithms.md#pallas-kernels)."""
  fields = _flat_fields(compensation, state)
  names = [next(iter(f.arrays)) for f in fields]  # one array a field (flat_step checks)
  ops, counts = _operands(_gpu, compensation, hyperparams, state, params)
  out, flats = _gpu.update_flat(
      compensation.for_dtype(jnp.bfloat16), hyperparams, state_rounding, updates, params,
      [f.arrays[k] for f, k in zip(fields, names)], in_place, ops, interpret)
  mu, nu, *buffers = (_flat.Flat({k: x}) for k, x in zip(names, flats))
  new = _stepped(compensation, state, mu, nu, None, counts)
  if buffers:  # the flat buffer in its field, the compensation's other fields as they were
    new = new._replace(**{k: getattr(state, k) for k in compensation._fields_of(None)})
    new = new._replace(**{compensation.spec.buffer: buffers[0]})
  return out, new


def _flat_update(compensation, hyperparams, state_rounding, updates, state, params,
                 in_place=False, grad_scale=None, clip=None):
  """``_native_update`` for a flat state (``_takes_flat``): one call of ``FLAT_TARGET``."""
  leaves, treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, params))
  grads = jax.tree.leaves(updates)
  core = state.inner_state
  flats = [core.mu, core.nu, compensation.buffers(state)]
  states = [[None] if f is None else list(f.arrays.values()) for f in flats]
  mode = _mode(compensation, leaves[0].dtype)
  marks = jnp.stack(treedef.flatten_up_to(state.missed)) if mode == "master" else None
  # Every leaf is a float leaf: its leaf index is its position.
  keys = _keys(compensation, state, jnp.arange(len(leaves), dtype=jnp.uint32), marks)
  scalars = _scalars(hyperparams, core.count, grad_scale, clip, grads[0].dtype)
  p_out, new, new_marks = _call(FLAT_TARGET, mode, state_rounding, scalars, keys,
                                leaves, grads, states, in_place)
  result = jax.tree.unflatten(treedef, p_out)  # landed params, or updates in their dtype
  mu, nu, buffer = (None if f is None else _flat.Flat(dict(zip(f.arrays, x)))
                    for f, x in zip(flats, new))
  new_state = _stepped(compensation, state, mu, nu, buffer)
  if mode == "master":
    new_state = new_state._replace(missed=jax.tree.unflatten(treedef, list(new_marks)))
  elif hasattr(state, "missed"):  # a flat buffer's state keeps its per-leaf marks as they are
    new_state = new_state._replace(missed=state.missed)
  return result, new_state



def _array(buffer):
  """A leaf buffer's array (a full master's: the master)."""
  return buffer.master if isinstance(buffer, compensation_lib.MasterBuffer) else buffer


def _native_update(compensation, hyperparams, state_rounding, updates, state, params,
                   in_place=False, grad_scale=None, clip=None, decays=None):
  """(updates, state), or with ``in_place`` (new params, state), of the gradients read
  ``unscaled(updates, grad_scale)`` or ``clip.apply(updates)``; one ``TARGET`` call per group
  of up to ``_LEAVES_PER_CALL`` leaves sharing dtypes and, with ``decays`` (per leaf: whether
  weight decay applies), that flag (docs/algorithms.md#the-jax-entry)."""
  leaves, treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, params))
  grads, mus, nus, index = (treedef.flatten_up_to(t) for t in (
      updates, state.inner_state.mu, state.inner_state.nu, leaf_indices(params)))
  if compensation.buffer:
    buffers = treedef.flatten_up_to(compensation.leaf_buffers(state))
  else:
    buffers = [optax.MaskedNode()] * len(leaves)
  core = state.inner_state
  groups: dict = {}
  for k, (p, g, m, v, b) in enumerate(zip(leaves, grads, mus, nus, buffers)):
    # Mode "update" (fp32 leaves) reads no buffer; a leaf's buffer, if any, is kept as it is.
    mode = _mode(compensation, p.dtype)
    buffer_dtype = (None if mode == "update" or isinstance(b, optax.MaskedNode)
                    else _array(b).dtype)
    decay = True if decays is None else decays[k]
    groups.setdefault((decay, mode, p.dtype, g.dtype, m.dtype, v.dtype, buffer_dtype),
                      []).append(k)
  out, new_mu, new_nu, new_buffers = [None] * len(leaves), list(mus), list(nus), list(buffers)
  calls = [(key, ks[i:i + _LEAVES_PER_CALL]) for key, ks in groups.items()
           for i in range(0, len(ks), _LEAVES_PER_CALL)]
  for (decay, mode, _, grad_dtype, *_, buffer_dtype), ks in calls:
    pick = lambda xs: [xs[k] for k in ks]  # noqa: E731
    # Masked-out leaves: weight decay 0 (the core skips the term: u + 0 * x is u, as for
    # weight_decay=0).
    step_hyperparams = hyperparams if decay else (*hyperparams[:4], 0.0)
    scalars = _scalars(step_hyperparams, core.count, grad_scale, clip, grad_dtype)
    has_buffer = buffer_dtype is not None
    states = [pick(mus), pick(nus),
              [_array(buffers[k]) for k in ks] if has_buffer else [None] * len(ks)]
    # A master's marks: the kernel keeps it where the last update missed (and only there).
    marks = jnp.stack([buffers[k].missed for k in ks]) if mode == "master" else None
    keys = _keys(compensation, state, jnp.asarray([index[k] for k in ks], jnp.uint32), marks)
    p_out, (m, v, b), new_marks = _call(TARGET, mode, state_rounding, scalars, keys,
                                        pick(leaves), pick(grads), states,
                                        in_place and mode != "update")
    for j, k in enumerate(ks):
      p = leaves[k]
      if mode == "update":  # p_out is the fp32 update; in place, what apply_updates does
        out[k] = (p + p_out[j]).astype(p.dtype) if in_place else p_out[j]
      else:  # the landed param, or the update in its dtype
        out[k] = p_out[j]
      new_mu[k], new_nu[k] = m[j], v[j]
      if mode == "master":
        new_buffers[k] = compensation_lib.MasterBuffer(b[j], new_marks[j])
      elif has_buffer:
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
  """Whether the kernel steps this leaf of ``kahan_summation(scaled_adam)`` whole
  (docs/algorithms.md#the-scaledadam-kernel)."""
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
    call = _ffi_call(SCALED_SUMS_TARGET, jax.ShapeDtypeStruct((len(ks), 3), jnp.float32),
                            vmap_method="sequential")
    extra = [comps[k] for k in ks] if comps is not None else []
    out = call(jnp.stack([rms[k] for k in ks]), jnp.stack([want[k] for k in ks]),
               *[leaves[k] for k in ks], *[grads[k] for k in ks], *extra,
               kahan=comps is not None, nthreads=np.int32(native.cpus()))
    for j, k in enumerate(ks):
      rows[k] = out[j]
  return jnp.stack(rows)


class ScaledAdamStep(NamedTuple):
  """What ``scaled_adam_step`` returns, per leaf: the new deltas and second
  moments, with ``comps`` the new compensations (else None), and with
  ``in_place`` the new params, with ``comps`` and not ``in_place`` the updates in the
  param dtype (else None)."""
  deltas: list
  vs: list
  comps: Optional[list]
  params: Optional[list]


def scaled_adam_step(scalars, size, leaves, grads, deltas, vs, comps=None,
                     in_place=False) -> ScaledAdamStep:
  """The kernel's step of ScaledAdam leaves (``scalars`` f32[n, 10], ``size`` int32[n]: whether
  to add the size term), the state in place; with ``comps``, ``kahan_summation``'s step of
  ``p + c``. New params (with ``comps`` or ``in_place``) go into the params' buffers if
  ``in_place``, else into gradients of their dtype (docs/algorithms.md#the-scaledadam-kernel)."""
  n = len(leaves)
  kahan = comps is not None
  fields = ["deltas", "vs"] + (["comps"] if kahan else []) + (
      ["params"] if kahan or in_place else [])
  new = {f: [None] * n for f in fields}
  for ks in _groups(leaves, grads):
    m = len(ks)
    operands = ([leaves[k] for k in ks] + [grads[k] for k in ks] + [deltas[k] for k in ks]
                + [vs[k] for k in ks] + ([comps[k] for k in ks] if kahan else []))
    # Operands: scalars, size, p..., g..., delta..., v..., (c...); results in `fields` order,
    # aliased: state to state, new params to p (in place) or to g of p's dtype.
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
    call = _ffi_call(SCALED_STEP_TARGET, results, input_output_aliases=aliases,
                            vmap_method="sequential")
    out = call(scalars[jnp.asarray(ks)], size[jnp.asarray(ks)], *operands, kahan=kahan,
               update=kahan and not in_place, nthreads=np.int32(native.cpus()))
    for r, f in enumerate(fields):
      for j, k in enumerate(ks):
        new[f][k] = out[r * m + j]
  return ScaledAdamStep(new["deltas"], new["vs"], new.get("comps"), new.get("params"))
