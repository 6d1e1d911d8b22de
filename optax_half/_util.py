"""Small tree helpers shared by the wrappers and the AdamW core."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_half import _in_place, rounding
from optax_half_native.checks import float64_message


def is_abstract(tree) -> bool:
  """Whether any leaf of ``tree`` is a ``jax.ShapeDtypeStruct``."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def check_no_complex(name: str, params) -> None:
  """Refuses complex params, naming the first leaf (docs/algorithms.md#named-optimizers)."""
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
      raise ValueError(
          f"{name}: params{jax.tree_util.keystr(path)} is {np.dtype(dtype).name}; complex "
          "params are not supported. Keep the real and imaginary parts as two real leaves, "
          "or step this leaf with another optimizer (optax.multi_transform).")


def transformation(init, update,
                   name: str | None = None) -> optax.GradientTransformationExtraArgs:
  """``GradientTransformationExtraArgs(init, update)``; ``init`` of abstract params gives the
  abstract state (docs/algorithms.md#jax-sharding); with ``name`` it refuses complex ones."""
  def init_any(params):
    if name is not None:
      check_no_complex(name, params)
    return jax.eval_shape(init, params) if is_abstract(params) else init(params)
  return optax.GradientTransformationExtraArgs(init_any, update)

# Params below this many bytes are initialised eagerly: there a compile (~0.1 s) costs
# more than the temporaries it saves.
COMPILED_INIT_BYTES = 1 << 20


def compiled_init(init):
  """``init`` run as one jitted computation on concrete params, so no full-tree temporary
  (an fp32 view, fp32 zeros cast down, a concatenation's pieces) is ever allocated: the
  state is made in place in its own buffers (docs/algorithms.md#memory). Traced or
  abstract params, leaves JAX cannot take as arrays, leaves on different sets of devices
  (one jit cannot take them) and trees under ``COMPILED_INIT_BYTES`` go to ``init`` itself."""
  jitted = jax.jit(init)

  def run(params):
    leaves = jax.tree.leaves(params)
    if not leaves or not all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float))
                             and not isinstance(x, jax.core.Tracer) for x in leaves):
      return init(params)
    placed = {frozenset(x.sharding.device_set) for x in leaves
              if isinstance(x, jax.Array) and x.committed}
    if len(placed) > 1 or sum(np.asarray(x).nbytes if not isinstance(x, jax.Array) else x.nbytes
                              for x in leaves) < COMPILED_INIT_BYTES:
      return init(params)
    return jitted(params)
  return run


def _layout(tree) -> dict:
  """key path -> (shape, dtype) of each array leaf, None where a MaskedNode or None is."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode))
  return {jax.tree_util.keystr(k): None if v is None or isinstance(v, optax.MaskedNode)
          else (tuple(np.shape(v)), jnp.dtype(v.dtype)) for k, v in leaves}


def check_state_fits(name: str, init, state, params) -> None:
  """Trace time (shapes and dtypes only): refuse a state that ``init`` did not make for
  params of these dtypes (a state made for fp32 params stepped with bf16 ones, or back),
  naming the param leaf, both dtypes and the fix."""
  if params is None:
    return
  try:
    want = _layout(jax.eval_shape(init, params))
  except Exception:  # noqa: BLE001 (params init refuses: update reports them itself)
    return
  got = _layout(state)
  if got.keys() != want.keys():
    return  # another layout altogether (not a dtype change): left to the update's own checks
  for path in want:
    if got[path] == want[path]:
      continue
    have = got[path]
    param_paths = {jax.tree_util.keystr(k): v for k, v in
                   jax.tree_util.tree_flatten_with_path(params)[0]}
    leaf = next((k for k in sorted(param_paths, key=len, reverse=True)
                 if k and path.endswith(k)), None)
    what = (f"params{leaf} is {jnp.dtype(param_paths[leaf].dtype)}" if leaf is not None
            else "the params")
    def show(x):
      return "nothing" if x is None else f"{x[1]}{list(x[0])}"
    raise ValueError(
        f"{name}: the optimizer state was made for params of another dtype or shape: "
        f"{what}, and the state's {path.lstrip('.') or 'leaf'} is {show(have)} where a "
        f"state made for these params has {show(want[path])}. Re-make the state for the "
        "new params (tx.init(params)), or cast the params back to the dtype the state was "
        "made for.")

try:
  from jax.experimental.shard_alike import shard_alike
except ImportError:  # JAX 0.11 has no shard_alike: state then takes XLA's own sharding
  shard_alike = None


def find_states(opt_state, state_type, nested=None) -> list:
  """Every ``state_type`` in ``opt_state``, at any depth: an optimizer state, or Flax's
  ``nnx.state(optimizer)``, where NamedTuples are dicts of their fields and leaves are
  Variables (those come back rebuilt as ``state_type``; ``nested``: field -> NamedTuple type
  of a field to rebuild too)."""
  if type(opt_state).__name__ == "State" and type(opt_state).__module__.startswith("flax.nnx"):
    from flax import nnx
    opt_state = nnx.to_pure_dict(opt_state)
  if isinstance(opt_state, state_type):
    return [opt_state]
  if isinstance(opt_state, dict):
    if set(opt_state) == set(state_type._fields):
      fields = dict(opt_state)
      for name, kind in (nested or {}).items():
        if isinstance(fields[name], dict):
          fields[name] = kind(**fields[name])
      return [state_type(**fields)]
    children = opt_state.values()
  elif isinstance(opt_state, (tuple, list)):
    children = opt_state
  else:  # another pytree node (a leaf has itself as its only leaf)
    children = jax.tree.leaves(opt_state, is_leaf=lambda x: x is not opt_state and isinstance(
        x, (dict, tuple, list, state_type)))
    if len(children) == 1 and children[0] is opt_state:
      return []
  return [s for child in children for s in find_states(child, state_type, nested)]


def decay_mask(mask, updates):
  """Per leaf of ``updates``, whether weight decay applies (a tree of Python bools), or
  None for all: optax's ``masked`` semantics, ``mask`` a tree of bools (a prefix of
  ``updates``) or a callable ``updates -> such a tree``."""
  if mask is None:
    return None
  tree = mask(updates) if callable(mask) else mask
  return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), tree, updates)


def is_float(x) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def like_param(p, x) -> jax.Array:
  """``x`` (of ``p``'s shape) tied to ``p``'s sharding with ``shard_alike`` when traced
  (docs/algorithms.md#jax-sharding)."""
  if shard_alike is not None and (isinstance(p, jax.core.Tracer)
                                  or isinstance(x, jax.core.Tracer)):
    return shard_alike(p, x)[1]
  return x


def zeros_like_param(p, dtype=None) -> jax.Array:
  """Zeros of ``p``'s shape in ``dtype``, sharded like ``p``: per-element state."""
  return like_param(p, jnp.zeros_like(p, dtype))


def seed_from_key(key) -> jax.Array:
  """A uint32 seed from None, an int or a JAX key: docs/algorithms.md#counter-based-random-bits."""
  if key is None:
    return jnp.uint32(0)
  if isinstance(key, int) and not isinstance(key, bool):
    return jnp.uint32(key % 2**32)
  if isinstance(key, bool) or not isinstance(key, (jax.Array, np.ndarray)):
    raise TypeError(
        "key must be None, a Python int or a JAX PRNG key (jax.random.key(...)); "
        f"got {type(key).__name__}.")
  key = jnp.asarray(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.bits(key, (), jnp.uint32)
  if key.dtype == jnp.uint32 and key.shape == (2,):  # raw legacy key
    return jax.random.bits(key, (), jnp.uint32)
  if jnp.issubdtype(key.dtype, jnp.integer) and key.shape == ():
    return key.astype(jnp.uint32)
  raise TypeError(
      "key must be None, a Python int or a JAX PRNG key "
      f"(jax.random.key(...)); got {type(key).__name__} {key.dtype}{key.shape}.")


def check_trees(name: str, updates, params) -> None:
  """A clear error when the gradient tree does not fit the params tree (structure, then
  shapes: the first mismatching leaf by its path; at trace time)."""
  if params is None:
    raise ValueError(
        f"{name} needs the current params: call tx.update(grads, state, params).")
  if jax.tree.structure(updates) != jax.tree.structure(params):
    raise ValueError(
        f"{name}: the gradient tree does not match the params tree.\n"
        f"  grads:  {jax.tree.structure(updates)}\n"
        f"  params: {jax.tree.structure(params)}")
  for (path, g), p in zip(jax.tree_util.tree_flatten_with_path(updates)[0],
                          jax.tree.leaves(params)):
    if np.shape(g) != np.shape(p):
      raise ValueError(
          f"{name}: the gradient of params{jax.tree_util.keystr(path)} has shape "
          f"{tuple(np.shape(g))}; the param has shape {tuple(np.shape(p))}.")


def check_no_float64(name: str, params) -> None:
  """Refuses float64 leaves (fp32 math), naming the first: docs/algorithms.md#named-optimizers."""
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(p, "dtype", None)
    # Canonical: with x64 off a numpy float64 leaf is an fp32 array, and accepted.
    if dtype is not None and jax.dtypes.canonicalize_dtype(dtype) == np.float64:
      raise ValueError(float64_message(name, f"params{jax.tree_util.keystr(path)}",
                                       "an optax optimizer"))


def leaf_indices(params):
  """Each float leaf's index among the float leaves (-1 elsewhere): the random bits' ``leaf``
  (docs/algorithms.md#counter-based-random-bits)."""
  leaves, treedef = jax.tree.flatten(params)
  out, i = [], 0
  for p in leaves:
    out.append(i if is_float(p) else -1)
    i += is_float(p)
  return jax.tree.unflatten(treedef, out)


def unzip(like, tuples, n: int):
  """A tree of n-tuples (at the leaves of ``like``) -> n trees."""
  return tuple(jax.tree.map(lambda _, t, k=k: t[k], like, tuples) for k in range(n))


def all_finite(tree) -> jax.Array:
  """One bool: every element of every float leaf is finite (True if none); eagerly across
  devices, read on the host (docs/algorithms.md#non-finite-gradients)."""
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_float(x)]
  if not checks:
    return jnp.ones((), jnp.bool_)
  devices = {d for c in checks if not isinstance(c, jax.core.Tracer) for d in c.devices()}
  if len(devices) > 1:
    return jnp.asarray(all(bool(c) for c in checks))
  return jnp.all(jnp.stack(checks))


def unscaled(tree, inv_scale):
  """Every float leaf widened exactly to fp32, then times ``inv_scale`` (fp32):
  the gradients ``dynamic_loss_scale`` hands its inner transformation."""
  return jax.tree.map(lambda g: rounding.widen(g) * inv_scale if is_float(g) else g, tree)


def unscaled_all_finite(tree, inv_scale=None) -> jax.Array:
  """``all_finite(unscaled(tree, inv_scale))``: the check of ``dynamic_loss_scale`` and
  ``skip_nonfinite`` (natively on CPU: ``_native.all_finite``); no ``inv_scale``: no unscaling."""
  return all_finite(tree if inv_scale is None else unscaled(tree, inv_scale))


def if_finite(finite, apply, skip, elsewhere: str = "cond", branch_on_cpu: bool = True):
  """``apply()`` if ``finite`` else ``skip()``: a ``lax.cond``, or with ``elsewhere="select"`` a
  select off CPU (everywhere if not ``branch_on_cpu``); docs/algorithms.md#dynamic-loss-scaling."""
  if not isinstance(finite, jax.core.Tracer):
    return apply() if bool(finite) else skip()

  def branch():
    return jax.lax.cond(finite, apply, skip)

  if elsewhere == "cond":
    return branch()
  assert elsewhere == "select", elsewhere
  if not branch_on_cpu:
    return select(finite, apply, skip)
  return jax.lax.platform_dependent(cpu=branch, default=lambda: select(finite, apply, skip))


def select(finite, apply, skip):
  """``jnp.where(finite, apply(), skip())`` leaf by leaf: both computed."""
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), apply(), skip())


def skipped(apply, state, first=None):
  """A skipped step's ``(first, state)``, widened to ``apply()``'s types: ``first`` (in-place
  params) as it was, or ``-0.0`` updates (docs/algorithms.md#dynamic-loss-scaling)."""
  first_types, state_types = jax.eval_shape(apply)
  if first is None:
    first = jax.tree.map(
        lambda s: jax.lax.full(s.shape, -0.0 if jnp.issubdtype(s.dtype, jnp.floating) else 0,
                               s.dtype, sharding=getattr(s, "sharding", None)), first_types)
  else:
    first = jax.tree.map(_widened, first_types, first)
  return first, jax.tree.map(_widened, state_types, state)


def _widened(like, x):
  x = jnp.asarray(x)
  if jnp.promote_types(x.dtype, like.dtype) != like.dtype:
    raise TypeError(f"a skipped step would narrow {x.dtype} to {like.dtype}: the inner "
                    "update returns a narrower state than it was given.")
  return x.astype(like.dtype)


def maybe_skip_nonfinite(tx, skip_nonfinite: bool, check=None):
  """``tx``, or ``tx`` skipping non-finite steps (``optax.apply_if_finite`` never giving up), its
  in-place steps too but not its clipped one (docs/algorithms.md#non-finite-gradients)."""
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be True or False; got {skip_nonfinite!r}.")
  if not skip_nonfinite:
    return tx
  update_and_apply, scaled = _in_place.step_of(tx), _in_place.scaled_of(tx)
  inner = optax.with_extra_args_support(tx)
  check = check or unscaled_all_finite

  def init(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def guarded(finite, state, apply, params=None):
    """``apply()`` if ``finite``, else a skip (``params`` or -0.0 updates first)."""
    first, inner_state = if_finite(finite, apply,
                                   lambda: skipped(apply, state.inner_state, params))
    return first, optax.ApplyIfFiniteState(
        notfinite_count=jnp.where(finite, 0, optax.safe_increment(state.notfinite_count)),
        last_finite=finite,
        total_notfinite=jnp.where(finite, state.total_notfinite,
                                  optax.safe_increment(state.total_notfinite)),
        inner_state=inner_state)

  def update(updates, state, params=None, **extra_args):
    return guarded(check(updates), state,
                   lambda: inner.update(updates, state.inner_state, params, **extra_args))

  out = transformation(init, update)
  if update_and_apply is None:
    return out

  def step(updates, state, params, **extra_args):
    return guarded(check(updates), state,
                   lambda: update_and_apply(updates, state.inner_state, params, **extra_args),
                   params)

  def scaled_step(in_place, updates, inv_scale, state, params, **extra_args):
    return guarded(check(updates, inv_scale), state,
                   lambda: scaled(in_place, updates, inv_scale, state.inner_state, params,
                                  **extra_args),
                   params if in_place else None)

  return _in_place.register(out, step, None if scaled is None else scaled_step)
