"""Moving an optimizer's state between optax_half and torch_bridge, so a run can
continue in the other framework.

    # JAX -> torch: load the state into a torch optimizer over the same params
    convert.optax_state_to_torch(opt_state, params, optimizer, scaler=None)
    # torch -> JAX: the state of optimizer, in the structure of a JAX state
    opt_state = convert.torch_state_to_optax(optimizer, params, tx.init(params), scaler=None)

``params`` is the JAX params tree; its float leaves, in flatten order, are the
torch optimizer's params in ``param_groups`` order (the convention of the
random bits and of ``torch_bridge.parity``). The params themselves are not
moved (``torch_bridge.dlpack`` does that). Everything else is: moments,
master weights (fp32 copies and split int16 low halves), Kahan buffers,
ScaledAdam's buffers and clipping statistics, step counts, random seeds, the
``skip_nonfinite`` counters and, with ``scaler``, the loss scale. With the
same params, a step taken after the move is the step the other framework
would have taken (within the parity tolerances: the elementwise optimizers
are bit-exact across frameworks, docs/algorithms.md#parity-harness).

What maps to what (the JAX state may sit inside ``optax.chain`` next to
stateless transformations, and inside ``dynamic_loss_scale`` and
``skip_nonfinite``):

==================================================  =====================================
optax_half                                          torch_bridge
==================================================  =====================================
``adamw_bf16(compensation=...)``, ``adam_fp32_master``,  ``LowPrecisionAdamW`` of the same
``scale_by_adamw``                                  factory and compensation
``scaled_adam``                                     ``ScaledAdam`` (one param group)
``master_weights`` / ``kahan_summation`` /          the same wrapper, around the
``stochastic_rounding`` / ``round_to_nearest``      optimizer that maps to the inner one
``optax.adam`` / ``optax.adamw`` (inside a wrapper  ``torch.optim.Adam`` / ``AdamW``
or alone)
``dynamic_loss_scale``                              ``DynamicLossScaler`` (``scaler=``)
==================================================  =====================================

A state that does not match the optimizer (another optimizer, compensation,
dtype, shape or number of params) raises a ``ValueError`` naming what
differs, before anything is loaded: torch optimizers are loaded through their
own ``load_state_dict``, which checks everything first (nothing
half-loaded), and JAX states are immutable. Arrays cross through DLPack:
JAX -> torch without a copy (the torch optimizer then copies them into its
own buffers, which it updates in place); torch -> JAX from a copy (JAX
arrays are immutable, torch's buffers keep changing). Sharded JAX states
are gathered to the host first; sharded torch states (FSDP2 DTensors) are
not taken (gather them, or checkpoint each framework on its own).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import optax_half as oh
from optax_half import _flat
from optax_half.compensation import BUFFER_FIELDS, COMPENSATIONS
from torch_bridge import _dist, dlpack
from torch_bridge.adam import LowPrecisionAdamW
from torch_bridge.loss_scale import DynamicLossScaler
from torch_bridge.scaled_adam import ScaledAdam
from torch_bridge.wrappers import LowPrecisionWrapper

__all__ = ["optax_state_to_torch", "torch_state_to_optax"]

_CLIPPING = oh.ScaledAdamClippingState._fields
_NONFINITE = ("notfinite_count", "last_finite", "total_notfinite")


class _Leaves:
  """The float leaves of the params tree: where each torch param's state lives
  in a JAX state tree (``flatten_up_to`` with the params' structure)."""

  def __init__(self, params, optimizer):
    leaves, self.treedef = jax.tree.flatten(params)
    self.positions = [i for i, x in enumerate(leaves) if oh._util.is_float(x)]
    self.names = [jax.tree_util.keystr(path) for path, _ in
                  jax.tree_util.tree_flatten_with_path(params)[0]]
    torch_params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(torch_params) != len(self.positions):
      raise ValueError(
          f"convert: the optimizer has {len(torch_params)} params; the params tree has "
          f"{len(self.positions)} float leaves (they must be the same, in order).")
    for k, p in enumerate(torch_params):  # FSDP2: state sharded like the params
      _check_local(p, f"the torch param of {self.name(k)}")

  def get(self, tree) -> list:
    """Per torch param (in order), its entry of a tree shaped like the params."""
    flat = self.treedef.flatten_up_to(tree)
    return [flat[i] for i in self.positions]

  def put(self, tree, values: list):
    """``tree`` with the entries of the torch params replaced by ``values``
    (None: keep the entry)."""
    flat = list(self.treedef.flatten_up_to(tree))
    for i, v in zip(self.positions, values):
      if v is not None:
        flat[i] = v
    return jax.tree.unflatten(self.treedef, flat)

  def name(self, k: int) -> str:
    return "params" + self.names[self.positions[k]]


def _present(x) -> bool:
  return x is not None and not isinstance(x, optax.MaskedNode)


def _to_torch(x) -> torch.Tensor:
  """A JAX array as a torch tensor: shared through DLPack when it lives on
  one device, gathered to the host otherwise."""
  x = jnp.asarray(x)
  if len(x.sharding.device_set) == 1:
    return dlpack.to_torch(x, allow_copy=True)
  host = np.asarray(x)
  if host.dtype == jnp.bfloat16:
    return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
  return torch.from_numpy(host.copy())


def _check_local(t: torch.Tensor, what: str) -> torch.Tensor:
  if _dist.is_dtensor(t):
    raise ValueError(
        f"convert: {what} is sharded (a DTensor, FSDP2); convert takes whole tensors. "
        "Gather it (full_tensor()) or checkpoint each framework on its own.")
  return t


def _to_jax(t: torch.Tensor, like, what: str) -> jax.Array:
  """A torch tensor as a JAX array of ``like``'s dtype, shape and sharding (a copy:
  torch keeps updating its buffers in place)."""
  t = _check_local(t.detach(), what).cpu().contiguous().clone()
  x = dlpack.to_jax(t, allow_copy=True)
  like = jnp.asarray(like) if not hasattr(like, "dtype") else like
  if x.dtype != like.dtype or tuple(x.shape) != tuple(np.shape(like)):
    raise ValueError(
        f"convert: {what} is {x.dtype}{list(x.shape)} in torch and "
        f"{like.dtype}{list(np.shape(like))} in the JAX state.")
  sharding = getattr(like, "sharding", None)
  return jax.device_put(x, sharding) if sharding is not None else x


def _scalar(t) -> int:
  return int(t.item()) if torch.is_tensor(t) else int(t)


# ----------------------------------------------------------------------------
# Outer layers: optax.chain, skip_nonfinite, dynamic_loss_scale.
# ----------------------------------------------------------------------------

def _optimizer_part(state):
  """The one stateful part of an ``optax.chain`` state (the others are
  stateless, e.g. ``clip_by_global_norm``), and its index (None if not a chain)."""
  if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
    stateful = [i for i, s in enumerate(state) if jax.tree.leaves(s)]
    if len(stateful) != 1:
      raise ValueError(
          "convert: an optax.chain state maps to one torch optimizer when exactly one of "
          f"its parts holds state; {len(stateful)} of its {len(state)} parts do.")
    return state[stateful[0]], stateful[0]
  return state, None


def _find_loss_scale(state) -> tuple:
  """(the DynamicLossScaleState or None, the state inside it / the state)."""
  part, index = _optimizer_part(state)
  if isinstance(part, oh.DynamicLossScaleState):
    return part, part.inner_state
  return None, state


def _replace_part(state, index, part):
  if index is None:
    return part
  out = list(state)
  out[index] = part
  return type(state)(out)


# ----------------------------------------------------------------------------
# JAX -> torch
# ----------------------------------------------------------------------------

def optax_state_to_torch(opt_state, params, optimizer: torch.optim.Optimizer,
                         scaler: Optional[DynamicLossScaler] = None) -> None:
  """Loads ``opt_state`` (an optax_half state for ``params``) into ``optimizer``
  (and its loss scale into ``scaler``), in place.

  Args:
    opt_state: the JAX optimizer state, e.g. ``tx.init(params)`` after steps.
    params: the JAX params tree it belongs to; its float leaves, in flatten
      order, are ``optimizer``'s params.
    optimizer: the torch_bridge optimizer (or wrapper, or ``torch.optim.Adam``/
      ``AdamW``) built like ``tx`` over the same params (see the module table).
    scaler: the ``DynamicLossScaler`` to take ``dynamic_loss_scale``'s state;
      required exactly when ``opt_state`` has one.

  Raises:
    ValueError: the state does not fit the optimizer (nothing is loaded).

  Example:
    >>> import jax.numpy as jnp, optax, torch, optax_half as oh, torch_bridge as tb
    >>> from torch_bridge import convert, dlpack
    >>> params, grads = {"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.ones(2, jnp.bfloat16)}
    >>> tx = oh.adamw_bf16(1e-3, weight_decay=1e-2)  # torch's default
    >>> updates, state = tx.update(grads, tx.init(params), params)  # a step in JAX
    >>> params = optax.apply_updates(params, updates)
    >>> p = torch.nn.Parameter(dlpack.to_torch(params["w"]).clone())
    >>> opt = tb.adamw_bf16([p], lr=1e-3)
    >>> convert.optax_state_to_torch(state, params, opt)
    >>> opt.state[p]["step"].item(), opt.state[p]["mu"].tolist()
    (1, [0.10009765625, 0.10009765625])
    >>> p.grad = torch.ones_like(p)  # the next step, in torch and in JAX
    >>> opt.step()
    >>> updates, state = tx.update(grads, state, params)
    >>> torch.equal(p.detach(), dlpack.to_torch(optax.apply_updates(params, updates)["w"]))
    True
  """
  _check_not_flat(opt_state)
  loss_scale, state = _find_loss_scale(opt_state)
  _check_scaler(loss_scale, scaler)
  leaves = _Leaves(params, optimizer)
  state_dict = _state_dict(_optimizer_part(state)[0], optimizer, leaves)
  if scaler is not None:
    scaler_dict = scaler.state_dict()
    scaler_dict.update(scale=float(loss_scale.scale),
                       _growth_tracker=int(loss_scale.growth_tracker),
                       skipped_steps=int(loss_scale.skipped_steps),
                       last_finite=bool(loss_scale.last_finite))
  optimizer.load_state_dict(state_dict)
  if scaler is not None:
    scaler.load_state_dict(scaler_dict)


def _check_not_flat(opt_state) -> None:
  flat = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _flat.Flat))
  if any(isinstance(x, _flat.Flat) for x in flat):
    raise ValueError("convert: a flat_state=True state is not converted (torch keeps one "
                     "state tensor per param); optax_half.relayout_state(state, tx, params), with "
                     "tx the same optimizer with flat_state=False, gives the per-param layout "
                     "(the same values) to convert.")


def _check_scaler(loss_scale, scaler) -> None:
  if loss_scale is not None and scaler is None:
    raise ValueError("convert: the JAX state has a dynamic_loss_scale; pass scaler= "
                     "(a torch_bridge.dynamic_loss_scale()) to take its scale.")
  if loss_scale is None and scaler is not None:
    raise ValueError("convert: scaler= was given, but the JAX state has no dynamic_loss_scale.")


def _check_skip(state, optimizer) -> bool:
  """Whether ``optimizer`` skips non-finite steps; the JAX state must agree."""
  skips = getattr(optimizer, "_skip_nonfinite", False)
  if isinstance(state, optax.ApplyIfFiniteState) != skips:
    raise ValueError(
        f"convert: the torch optimizer has skip_nonfinite={skips}; the JAX state "
        f"{'has' if not skips else 'has no'} skip counters (optax.ApplyIfFiniteState).")
  return skips


def _skip_counters(state, optimizer) -> tuple:
  """(the counters of ``skip_nonfinite`` or None, the state inside them)."""
  if not _check_skip(state, optimizer):
    return None, state
  counters = {"notfinite_count": int(state.notfinite_count),
              "last_finite": bool(state.last_finite),
              "total_notfinite": int(state.total_notfinite)}
  return counters, state.inner_state


def _codec(optimizer) -> tuple:
  """(JAX state -> state_dict, torch optimizer -> JAX state) for ``optimizer``."""
  _no_amsgrad(optimizer)  # every codec, the wrapped optimizers' too
  for kind, to_torch, to_jax in _CODECS:
    if isinstance(optimizer, kind):
      return to_torch, to_jax
  raise TypeError(f"convert: no mapping for a {type(optimizer).__name__} (see the table in "
                  "torch_bridge.convert).")


def _state_dict(state, optimizer, leaves: _Leaves) -> dict:
  """The ``state_dict`` of ``optimizer`` holding the values of the JAX ``state``."""
  return _codec(optimizer)[0](state, optimizer, leaves)


def _expect(state, kind, what: str):
  if not isinstance(state, kind):
    raise ValueError(f"convert: {what} needs a {kind.__name__} in the JAX state; found "
                     f"{type(state).__name__}.")
  return state


def _core_of(state, compensation: str, what: str):
  """(wrapper state or None, ScaleByAdamWState) of a LowPrecisionAdamW's JAX twin."""
  if compensation == "none" and isinstance(state, oh.ScaleByAdamWState):
    return None, state  # scale_by_adamw alone
  wrapper = _expect(state, COMPENSATIONS[compensation].state_type, what)
  return wrapper, _expect(wrapper.inner_state, oh.ScaleByAdamWState, what)


def _buffers(wrapper, leaves: _Leaves) -> tuple:
  """(torch state key, per torch param the JAX buffer or None) of a wrapper state."""
  field = BUFFER_FIELDS.get(type(wrapper))
  if field is not None:
    return field, leaves.get(getattr(wrapper, field))
  return None, [None] * len(leaves.positions)


def _groups_with(state_dict: dict, **values) -> dict:
  for group in state_dict["param_groups"]:
    group.update(values)
  return state_dict


def _adamw_dict(state, optimizer: LowPrecisionAdamW, leaves: _Leaves) -> dict:
  what = f"a LowPrecisionAdamW (compensation={optimizer._compensation.name!r})"
  counters, state = _skip_counters(state, optimizer)
  wrapper, core = _core_of(state, optimizer._compensation.name, what)
  count, seed = int(core.count), int(core.seed)
  if isinstance(wrapper, oh.StochasticRoundingState) and (
      int(wrapper.seed) != seed or int(wrapper.rng_count) != count):
    raise ValueError("convert: the stochastic-rounding seed or count differs from the "
                     "moments' (torch_bridge keeps one of each).")
  key, buffers = _buffers(wrapper, leaves)
  out = copy.copy(optimizer.state_dict())
  out["state"] = {}
  for k, (mu, nu, buf) in enumerate(zip(leaves.get(core.mu), leaves.get(core.nu), buffers)):
    entry = {"step": torch.tensor(count, dtype=torch.int64), "mu": _to_torch(mu),
             "nu": _to_torch(nu)}
    if _present(buf):
      entry[key] = _to_torch(buf)
    out["state"][k] = entry
  out["seed"] = seed
  if counters is not None:
    out["nonfinite"] = counters
  return _groups_with(out, count=count)


def _one_group(optimizer: ScaledAdam) -> None:
  if len(optimizer.param_groups) != 1:
    raise ValueError("convert: scaled_adam keeps one clipping state for all params; the "
                     f"torch ScaledAdam has {len(optimizer.param_groups)} param groups.")


def _scaled_adam_dict(state, optimizer: ScaledAdam, leaves: _Leaves) -> dict:
  counters, state = _skip_counters(state, optimizer)
  state = _expect(state, oh.ScaledAdamState, "a ScaledAdam")
  _one_group(optimizer)
  count = int(state.count)
  out = copy.copy(optimizer.state_dict())
  fields = ("delta", "exp_avg_sq", "param_rms", "scale_exp_avg_sq", "scale_grads")
  per_leaf = zip(*(leaves.get(getattr(state, f)) for f in fields))
  out["state"] = {}
  for k, values in enumerate(per_leaf):
    entry = {"step": torch.tensor(count, dtype=torch.int64)}
    entry.update({f: _to_torch(v) for f, v in zip(fields, values) if _present(v)})
    out["state"][k] = entry
  group_state = {"step": count}
  if optimizer.param_groups[0]["clipping_scale"] is not None:
    group_state.update({f: _to_torch(getattr(state.clipping, f)).clone() for f in _CLIPPING})
  out["group_state"] = [group_state]
  if counters is not None:
    out["nonfinite"] = counters
  return out


def _wrapper_dict(state, optimizer: LowPrecisionWrapper, leaves: _Leaves) -> dict:
  compensation = optimizer._compensation
  state = _expect(state, COMPENSATIONS[compensation.name].state_type,
                  f"a {compensation.name} wrapper")
  out = copy.copy(optimizer.state_dict())
  key, buffers = _buffers(state, leaves)
  out["state"] = {}
  for k, buf in enumerate(buffers):
    entry = {}
    if _present(buf):
      entry[key] = _to_torch(buf)
    if isinstance(state, oh.StochasticRoundingState):
      entry["step"] = torch.tensor(int(state.rng_count), dtype=torch.int64)
    if entry:
      out["state"][k] = entry
  if isinstance(state, oh.StochasticRoundingState):
    out["seed"] = int(state.seed)
  with optimizer.stand_ins() as inner:  # the inner optimizer's state is keyed by them
    out["inner"] = _state_dict(_optimizer_part(state.inner_state)[0], inner, leaves)
  return out


def _adam_parts(state):
  """The ScaleByAdamState inside an optax.adam(w) state, and the schedule counts."""
  kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds))
           if isinstance(s, kinds)]
  adam = [s for s in found if isinstance(s, optax.ScaleByAdamState)]
  if len(adam) != 1:
    raise ValueError("convert: torch.optim.Adam/AdamW maps to optax.adam/adamw, whose state "
                     f"holds one ScaleByAdamState; found {len(adam)}.")
  return adam[0], [s for s in found if isinstance(s, optax.ScaleByScheduleState)]


def _no_amsgrad(optimizer) -> None:
  if any(g.get("amsgrad") for g in optimizer.param_groups):
    raise ValueError("convert: amsgrad=True (the running max of the second moment) has no "
                     "counterpart in optax.adam(w) or optax_half's AdamW states.")


def _adam_dict(state, optimizer, leaves: _Leaves) -> dict:
  adam, _ = _adam_parts(state)
  count = int(adam.count)
  out = copy.copy(optimizer.state_dict())
  out["state"] = {}
  for k, (mu, nu) in enumerate(zip(leaves.get(adam.mu), leaves.get(adam.nu))):
    # torch.optim loads tensors by reference: copies, so it never writes JAX memory.
    out["state"][k] = {"step": torch.tensor(float(count), dtype=torch.float32),
                       "exp_avg": _to_torch(mu).clone(), "exp_avg_sq": _to_torch(nu).clone()}
  return out


# ----------------------------------------------------------------------------
# torch -> JAX
# ----------------------------------------------------------------------------

def torch_state_to_optax(optimizer: torch.optim.Optimizer, params, opt_state,
                         scaler: Optional[DynamicLossScaler] = None) -> Any:
  """The state of ``optimizer`` (and ``scaler``) as an optax_half state.

  Args:
    optimizer: the torch_bridge optimizer (see the module table).
    params: the JAX params tree; its float leaves, in flatten order, are the
      optimizer's params.
    opt_state: a state of the JAX optimizer built like ``optimizer`` (e.g.
      ``tx.init(params)``): the structure, dtypes and shardings to fill.
    scaler: the ``DynamicLossScaler`` whose state goes into the
      ``dynamic_loss_scale`` part of ``opt_state`` (required exactly when it has one).

  Returns:
    A new state: ``opt_state`` with every value of the torch optimizer.

  Example:
    >>> import torch, optax_half as oh, torch_bridge as tb
    >>> from torch_bridge import convert, dlpack
    >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = tb.adamw_bf16([p], lr=1e-3)
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()  # a step in torch
    >>> params = {"w": dlpack.to_jax(p.detach().clone())}
    >>> tx = oh.adamw_bf16(1e-3)
    >>> state = convert.torch_state_to_optax(opt, params, tx.init(params))
    >>> type(state).__name__, int(state.inner_state.count)
    ('KahanSummationState', 1)
    >>> state.inner_state.mu["w"].tolist() == opt.state[p]["mu"].tolist()
    True
  """
  _check_not_flat(opt_state)
  loss_scale, inner = _find_loss_scale(opt_state)
  _check_scaler(loss_scale, scaler)
  leaves = _Leaves(params, optimizer)
  part, index = _optimizer_part(inner)
  new_inner = _replace_part(inner, index, _jax_state(part, optimizer, leaves))
  if loss_scale is None:
    return new_inner
  c = scaler.counters()
  new_scale = loss_scale._replace(
      scale=_to_jax(c["scale"], loss_scale.scale, "the loss scale"),
      growth_tracker=_to_jax(c["growth_tracker"], loss_scale.growth_tracker, "growth_tracker"),
      skipped_steps=_to_jax(c["skipped_steps"], loss_scale.skipped_steps, "skipped_steps"),
      last_finite=_to_jax(c["last_finite"], loss_scale.last_finite, "last_finite"),
      inner_state=new_inner)
  outer, outer_index = _optimizer_part(opt_state)
  return _replace_part(opt_state, outer_index, new_scale)


def _jax_state(state, optimizer, leaves: _Leaves):
  """The JAX ``state`` (a template) holding the values of ``optimizer``."""
  return _codec(optimizer)[1](state, optimizer, leaves)


def _with_skip_counters(state, optimizer, fill):
  """``fill(inner state)`` inside the ``skip_nonfinite`` counters, if any."""
  if not _check_skip(state, optimizer):
    return fill(state)
  c = optimizer.nonfinite
  return state._replace(
      notfinite_count=jnp.asarray(c["notfinite_count"], state.notfinite_count.dtype),
      last_finite=jnp.asarray(c["last_finite"], state.last_finite.dtype),
      total_notfinite=jnp.asarray(c["total_notfinite"], state.total_notfinite.dtype),
      inner_state=fill(state.inner_state))


def _one_count(states: list) -> Optional[int]:
  """The step count every param shares (None before the first step)."""
  counts = {_scalar(s["step"]) for s in states if "step" in s}
  if len(counts) > 1:
    raise ValueError(f"convert: the torch params were stepped different numbers of times "
                     f"({sorted(counts)}); the JAX state keeps one count for all.")
  return counts.pop() if counts else None


def _states(optimizer) -> list:
  return [optimizer.state.get(p, {}) for g in optimizer.param_groups for p in g["params"]]


def _from_torch(leaves: _Leaves, states: list, key: str, tree):
  """``tree`` (a params-shaped part of a JAX state) with each param's entry
  replaced by ``states[k][key]``; entries torch has no value for are kept."""
  return leaves.put(tree, [
      _to_jax(s[key], like, f"{key} of {leaves.name(k)}") if key in s and _present(like)
      else None for k, (s, like) in enumerate(zip(states, leaves.get(tree)))])


def _adamw_state(state, optimizer: LowPrecisionAdamW, leaves: _Leaves):
  what = f"a LowPrecisionAdamW (compensation={optimizer._compensation.name!r})"

  def fill(state):
    wrapper, core = _core_of(state, optimizer._compensation.name, what)
    states = _states(optimizer)
    count = _one_count(states)
    count = optimizer.param_groups[0]["count"] if count is None else count
    seed = jnp.asarray(optimizer._seed, jnp.uint32)
    new = lambda key, tree: _from_torch(leaves, states, key, tree)  # noqa: E731
    core = core._replace(count=jnp.asarray(count, core.count.dtype), seed=seed,
                         mu=new("mu", core.mu), nu=new("nu", core.nu))
    return core if wrapper is None else _fill_wrapper(wrapper, new, core, seed, count)

  return _with_skip_counters(state, optimizer, fill)


def _scaled_adam_state(state, optimizer: ScaledAdam, leaves: _Leaves):
  _one_group(optimizer)

  def fill(state):
    state = _expect(state, oh.ScaledAdamState, "a ScaledAdam")
    states = _states(optimizer)
    gstate = optimizer.group_state[0]
    new = {f: _from_torch(leaves, states, f, getattr(state, f))
           for f in ("delta", "exp_avg_sq", "param_rms", "scale_exp_avg_sq", "scale_grads")}
    clipping = state.clipping
    if "model_norms" in gstate:
      clipping = clipping._replace(**{f: _to_jax(gstate[f], getattr(clipping, f), f)
                                      for f in _CLIPPING})
    return state._replace(count=jnp.asarray(gstate["step"], state.count.dtype),
                          clipping=clipping, **new)

  return _with_skip_counters(state, optimizer, fill)


def _wrapper_state(state, optimizer: LowPrecisionWrapper, leaves: _Leaves):
  name = optimizer._compensation.name
  state = _expect(state, COMPENSATIONS[name].state_type, f"a {name} wrapper")
  states = _states(optimizer)
  inner, index = _optimizer_part(state.inner_state)
  with optimizer.stand_ins() as wrapped:  # the inner optimizer's state is keyed by them
    new_inner = _replace_part(state.inner_state, index, _jax_state(inner, wrapped, leaves))
  new = lambda key, tree: _from_torch(leaves, states, key, tree)  # noqa: E731
  return _fill_wrapper(state, new, new_inner, optimizer._seed, _one_count(states) or 0)


def _fill_wrapper(wrapper, new, inner_state, seed: int, count: int):
  """A JAX wrapper state holding torch's buffers (``new(key, tree)``), seed
  and count, around ``inner_state``."""
  field = BUFFER_FIELDS.get(type(wrapper))
  if field is not None:
    return wrapper._replace(**{field: new(field, getattr(wrapper, field))},
                            inner_state=inner_state)
  if isinstance(wrapper, oh.StochasticRoundingState):
    return wrapper._replace(seed=jnp.asarray(seed, jnp.uint32),
                            rng_count=jnp.asarray(count, wrapper.rng_count.dtype),
                            inner_state=inner_state)
  return wrapper._replace(inner_state=inner_state)


def _adam_state(state, optimizer, leaves: _Leaves):
  adam, schedules = _adam_parts(state)
  states = _states(optimizer)
  count = _one_count(states) or 0
  new_adam = adam._replace(count=jnp.asarray(count, adam.count.dtype),
                           mu=_from_torch(leaves, states, "exp_avg", adam.mu),
                           nu=_from_torch(leaves, states, "exp_avg_sq", adam.nu))
  replace = {id(adam): new_adam}
  for s in schedules:
    replace[id(s)] = s._replace(count=jnp.asarray(count, s.count.dtype))
  kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
  return jax.tree.map(lambda s: replace.get(id(s), s), state,
                      is_leaf=lambda x: isinstance(x, kinds))


_CODECS = (
    (LowPrecisionAdamW, _adamw_dict, _adamw_state),
    (ScaledAdam, _scaled_adam_dict, _scaled_adam_state),
    (LowPrecisionWrapper, _wrapper_dict, _wrapper_state),
    ((torch.optim.Adam, torch.optim.AdamW), _adam_dict, _adam_state),
)
