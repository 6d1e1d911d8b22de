"""Plumbing shared by the torch_bridge optimizers (the ``_util.py`` of this side).

* ``LowPrecisionOptimizer``: the base class of every torch_bridge optimizer
  and wrapper. It holds what they share: the fp32 gradients a loss scaler
  hands over (``step_grad``), ``step(closure)`` with ``skip_nonfinite``,
  ``state_dict``/``load_state_dict`` (bit for bit, checked before anything is
  written, with torch's state-dict hooks), pickling and ``deepcopy``, torch's
  spellings of the hyperparameters (``lr``, ``betas``) and the re-seeding of
  a param's buffer after the param was written from outside;
* host-side fp32 scalars: every hyperparameter enters the math as an fp32
  value, like ``optax_half`` (which makes them fp32 arrays);
* ``seed_from_key``: the uint32 seed of an integer key;
* ``prepare_load``: ``Optimizer.load_state_dict`` without its casts. torch
  casts every floating state tensor to its param's dtype on load, which
  would round an fp32 master or fp32 moments of a bf16 param to bf16. Here each
  saved tensor is copied into the live buffer of the same dtype, bit for bit,
  and a dtype or shape mismatch is an error. Everything is checked before
  anything is written; a ``"kind"`` entry names the optimizer that saved it.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np
import torch

from optax_half_native import checks
from optax_half_native.checks import f32, float64_message
from torch_bridge import _dist

__all__ = ["f32", "seed_from_key",
           "prepare_load", "check_kind", "stale_state_message", "step_count",
           "TORCH_ADAMW_KEYS", "check_torch_keys", "check_tensor_lr", "check_no_grad_hyperparams",
           "check_fused_devices", "optimizer_kind", "check_param", "check_grad",
           "step_grad", "run_step", "init_skip_nonfinite", "load_nonfinite",
           "stepping_params", "torch_spellings", "LowPrecisionOptimizer"]


def seed_from_key(key) -> int:
  """``None`` -> 0, an int -> ``key mod 2**32``: the seed ``optax_half`` derives."""
  if key is None:
    return 0
  if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
    raise TypeError(f"key must be None or an integer seed; got {type(key).__name__}.")
  return int(key) % 2**32


def check_param(p: torch.Tensor, position: int) -> None:
  if not isinstance(p, torch.Tensor):
    raise TypeError(f"param {position} is a {type(p).__name__}, not a tensor.")
  if not p.is_floating_point():
    raise ValueError(
        f"param {position} has dtype {p.dtype}: only floating-point params can be "
        "optimized (keep integer buffers out of the optimizer).")


def check_no_float64(p: torch.Tensor, position: int, name: str) -> None:
  """The check of ``optax_half._util.check_no_float64``, same message."""
  if p.dtype == torch.float64:
    raise ValueError(float64_message(name, f"param {position}", "a torch.optim optimizer"))


def check_grad(grad: torch.Tensor, position: int) -> None:
  if grad.is_sparse:
    raise RuntimeError(
        f"param {position} has a sparse gradient; torch_bridge optimizers need dense "
        "gradients (use torch.optim.SparseAdam for sparse embeddings).")


def stale_state_message(p: torch.Tensor, position: int, state: dict, layout_of,
                        shaped=("mu", "nu")) -> str:
  """The error for a param whose dtype or shape changed after its state was
  made (``model.to(dtype)`` after a step or a load). ``layout_of(dtype)``:
  the dtype of each state tensor (``step`` aside) a param of ``dtype`` gets,
  which names the dtype(s) the state was made for; ``shaped``: the keys of
  tensors shaped like the param."""
  held = {k: v for k, v in state.items() if k != "step" and torch.is_tensor(v)}
  dtypes = {k: v.dtype for k, v in held.items()}
  made = [str(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                           torch.complex64, torch.complex128) if layout_of(d) == dtypes]
  was = "a " + " or ".join(made) if made else "another dtype's"
  shapes = sorted({tuple(held[k].shape) for k in shaped if k in held})
  if shapes and shapes != [tuple(p.shape)]:
    was += f" param of shape {' or '.join(str(list(s)) for s in shapes)}"
  else:
    was += " param"
  listed = ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in held.items()) or "no buffers"
  return (f"param {position} is {p.dtype}{list(p.shape)}, but its optimizer state "
          f"({listed}) was made for {was}: the param's dtype or shape changed after its "
          "state was made (e.g. model.to(dtype) after a step or a load_state_dict). Build "
          "the optimizer after model.to(dtype), or load a state dict saved for "
          f"{p.dtype} params.")


def step_count(state: dict) -> torch.Tensor:
  """``state["step"]`` as the CPU int64 0-dim tensor the steps advance in
  place (a number set from outside, or a tensor elsewhere, replaced by one)."""
  step = state["step"]
  if not (torch.is_tensor(step) and step.dtype == torch.int64 and step.is_cpu
          and step.dim() == 0):
    step = state["step"] = torch.tensor(int(step), dtype=torch.int64)
  return step


def step_grad(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
  """The gradient a step of ``optimizer`` uses for ``p``.

  ``torch_bridge`` optimizers keep a dict ``_unscaled_grads`` that a
  ``DynamicLossScaler.unscale_`` fills with the fp32 unscaled gradients of
  16-bit params (``p.grad`` keeps the scaled 16-bit value); otherwise ``p.grad``.
  """
  g = getattr(optimizer, "_unscaled_grads", {}).get(p)
  return grad_of(p) if g is None else g


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
  """``p``'s gradient: its fp32 ``main_grad`` where ``accumulate_in_fp32``
  keeps one, else ``p.grad`` (None: no gradient, the param is not stepped)."""
  main = getattr(p, "main_grad", None)
  return p.grad if main is None else main


def grads_of(params) -> list:
  """``grad_of`` each param, in one comprehension (no Python call per param)."""
  return [p.grad if m is None else m for p, m in
          zip(params, [getattr(p, "main_grad", None) for p in params])]


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
  """What wrote a state_dict: a torch_bridge optimizer's ``_kind()`` (its class, and
  for a wrapper the wrapped optimizer's kind), or the class name of any other one."""
  kind = getattr(optimizer, "_kind", None)
  return kind() if callable(kind) else type(optimizer).__name__


def check_kind(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
  """A clear error when ``state_dict`` says another kind of optimizer saved it.

  A state dict without ``"kind"`` (kept as only ``state`` and
  ``param_groups`` by a checkpointing tool) is checked by its structure alone
  (``prepare_load``).
  """
  mine, saved = optimizer_kind(optimizer), state_dict.get("kind")
  if saved is not None and saved != mine:
    raise ValueError(
        f"this state_dict was saved by {saved}; this optimizer is {mine}. Load it into "
        "the same kind of optimizer.")


def _as_tensor_like(name: str, value, current):
  """A Python number saved where the optimizer holds a 0-dim tensor (a
  ``step`` in older torch formats) as a tensor of the live one's dtype (a
  ``step`` with no live tensor yet: int64); anything else as it is."""
  if name == "step" and isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if not isinstance(value, (int, float, np.number)) or isinstance(value, bool):
    return value
  if torch.is_tensor(current) and current.dim() == 0:
    return torch.tensor(value, dtype=current.dtype)
  if current is None and name == "step":
    return torch.tensor(int(value), dtype=torch.int64)
  return value


@torch.no_grad()
def prepare_load(optimizer: torch.optim.Optimizer, state_dict: dict, template=None):
  """Checks ``state_dict`` against ``optimizer`` and returns a function that loads it.

  Each saved param state must have the keys, dtypes and shapes of the state
  the optimizer holds for that param, or, where it holds none yet (state made
  on the first step), of ``template(group, param)`` when that is not None.
  Every check runs before anything is written, so a mismatch (the first one is named)
  leaves the optimizer untouched: nothing is half-loaded. Loading copies each
  saved tensor into the optimizer's live buffer of the same dtype and shape
  (tensors shared with other objects, such as a wrapped optimizer's param
  lists, keep their identity); ``step`` counters stay on the CPU, other new
  tensors go to their param's device; a param without saved state loses the
  state it had, as in ``torch.optim``.
  """
  groups = optimizer.param_groups
  saved_groups = state_dict["param_groups"]
  if len(groups) != len(saved_groups):
    raise ValueError(
        f"state_dict has {len(saved_groups)} param groups; the optimizer has {len(groups)}.")
  for i, (g, s) in enumerate(zip(groups, saved_groups)):
    if len(g["params"]) != len(s["params"]):
      raise ValueError(
          f"param group {i}: state_dict has {len(s['params'])} params; the optimizer "
          f"has {len(g['params'])}.")
  id_map = {old: p for g, s in zip(groups, saved_groups)
            for old, p in zip(s["params"], g["params"])}
  group_of = {old: g for g, s in zip(groups, saved_groups) for old in s["params"]}
  saved_state = {}
  for old, saved in state_dict["state"].items():
    if old not in id_map:
      raise ValueError(f"state_dict has state for param id {old}, which no group lists.")
    state = optimizer.state.get(id_map[old]) or {}  # .get: no empty entries on a failed load
    if not state and template is not None:
      state = template(group_of[old], id_map[old]) or {}
    saved = saved_state[old] = {name: _as_tensor_like(name, value, state.get(name))
                                for name, value in saved.items()}
    if state and set(saved) != set(state):
      raise ValueError(
          f"state of param {old}: saved {sorted(saved)}, the optimizer holds {sorted(state)}.")
    for name, value in saved.items():
      current = state.get(name)
      if torch.is_tensor(value) and torch.is_tensor(current) and (
          current.dtype != value.dtype or current.shape != value.shape):
        raise ValueError(
            f"state {name!r} of param {old}: saved {value.dtype}{tuple(value.shape)}, "
            f"the optimizer holds {current.dtype}{tuple(current.shape)}.")
      if torch.is_tensor(value) and torch.is_tensor(current) and (
          _dist.layout(value) != _dist.layout(current)):
        raise ValueError(
            f"state {name!r} of param {old}: saved {_dist.layout(value)}, the optimizer "
            f"holds {_dist.layout(current)}. Load each rank's own state_dict into the "
            "same sharding (FSDP2), or a whole-tensor one into unsharded params.")

  @torch.no_grad()
  def load() -> None:
    for old, p in id_map.items():
      if old not in saved_state:
        optimizer.state.pop(p, None)
    for old, saved in saved_state.items():
      p = id_map[old]
      state = optimizer.state[p]
      for name, value in saved.items():
        current = state.get(name)
        if torch.is_tensor(value) and torch.is_tensor(current):
          current.copy_(value)
        elif torch.is_tensor(value):
          # Step counts on the CPU (read on the host every step), as saved by torch.optim.
          device = torch.device("cpu") if name == "step" else p.device
          state[name] = value.to(device=device, copy=True)
        else:
          state[name] = copy.deepcopy(value)
    # The groups as they are now (a wrapper's inner load may have replaced them).
    for g, s in zip(optimizer.param_groups, saved_groups):
      g.update({k: copy.deepcopy(v) for k, v in s.items() if k != "params"})

  return load


_NONFINITE_START = {"notfinite_count": 0, "last_finite": True, "total_notfinite": 0}


def init_skip_nonfinite(optimizer: torch.optim.Optimizer, skip_nonfinite: bool) -> None:
  """Sets up ``skip_nonfinite`` and its counters (``optax.ApplyIfFiniteState``'s
  names: ``notfinite_count`` in a row, ``last_finite``, ``total_notfinite``)."""
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be True or False; got {skip_nonfinite!r}.")
  optimizer._skip_nonfinite = skip_nonfinite
  optimizer.nonfinite = dict(_NONFINITE_START)


def load_nonfinite(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
  """The skip counters of ``state_dict``; a dict without them (kept as only
  ``state`` and ``param_groups`` by a tool) starts them afresh, as a new
  optimizer would."""
  optimizer.nonfinite = {**_NONFINITE_START, **state_dict.get("nonfinite", {})}


def stepping_params(optimizer: torch.optim.Optimizer) -> list:
  """``(position, param)`` of every param a step updates (every one with a
  gradient, ``requires_grad`` or not, as in ``torch.optim``), position counted
  over all params; a sparse gradient is refused (``check_grad``)."""
  out = []
  position = 0
  for group in optimizer.param_groups:
    for p in group["params"]:
      grad = grad_of(p)
      if grad is not None:
        check_grad(grad, position)
        out.append((position, p))
      position += 1
  return out


def _grads_finite(optimizer: torch.optim.Optimizer) -> bool:
  """Whether every gradient the step would use is finite: one host read.

  A sparse gradient is refused first, with the message the step itself would
  give. Sharded gradients (DTensors) are checked shard by shard and the
  answer is combined over the ranks, so every rank skips the same steps.
  """
  params = [p for _, p in stepping_params(optimizer)]
  checks = [torch.isfinite(_dist.local(step_grad(optimizer, p))).all() for p in params]
  if not checks:
    return True
  bad = ~torch.stack([c.to(checks[0].device) for c in checks]).all()
  return not bool(_dist.any_rank(bad, params))


def run_step(optimizer: torch.optim.Optimizer, closure, step_all) -> Optional[torch.Tensor]:
  """``Optimizer.step(closure)`` as every torch_bridge optimizer runs it.

  ``closure`` (optional) re-evaluates the loss with gradients enabled; then
  ``step_all()`` updates the params, unless ``skip_nonfinite`` is on and a
  gradient holds a NaN or Inf: then nothing changes (step counts included) and
  the skip is counted in ``optimizer.nonfinite``. That check reads one bool on
  the host, as ``torch.amp.GradScaler.step`` does; a loss scaler that has just
  found every gradient finite says so (``_grads_checked_finite``) and nothing
  more is read. The fp32 gradients a loss
  scaler handed over (``_unscaled_grads``) are dropped afterwards, even if the
  step raised.
  """
  loss = None
  if closure is not None:
    with torch.enable_grad():
      loss = closure()
  try:
    if getattr(optimizer, "_skip_nonfinite", False):
      finite = (optimizer.__dict__.pop("_grads_checked_finite", False)
                or _grads_finite(optimizer))
      counters = optimizer.nonfinite
      counters["last_finite"] = finite
      if not finite:
        counters["notfinite_count"] = min(counters["notfinite_count"] + 1, 2**31 - 1)
        counters["total_notfinite"] = min(counters["total_notfinite"] + 1, 2**31 - 1)
        return loss
      counters["notfinite_count"] = 0
    step_all()
  finally:
    optimizer._unscaled_grads.clear()
  return loss


def _betas(betas) -> tuple:
  try:
    b1, b2 = betas
  except (TypeError, ValueError):
    raise ValueError(f"betas must be a pair (b1, b2); got {betas!r}.") from None
  return (b1, b2)


def check_no_grad_hyperparams(where: str, values: dict) -> None:
  """Hyperparameters (``values``: name -> value or tuple) given as tensors
  that require grad: refused, since the step reads them as numbers and they
  would get no gradient (torch.optim.AdamW(differentiable=True) gives one)."""
  for name, value in values.items():
    if any(isinstance(v, torch.Tensor) and v.requires_grad
           for v in (value if isinstance(value, (tuple, list)) else (value,))):
      raise ValueError(
          f"{where}: {name} is a tensor that requires grad, but the step reads its "
          "hyperparameters as fp32 numbers, so it would get no gradient. Pass it detached, "
          "or differentiate through torch.optim.AdamW(differentiable=True).")


def check_tensor_lr(lr) -> None:
  """A tensor lr must hold one element: torch.optim.AdamW's error, word for word."""
  if isinstance(lr, torch.Tensor) and lr.numel() != 1:
    raise ValueError("Tensor lr must be 1-element")


def check_torch_adamw_args(lr, b1, b2, eps, weight_decay, *, betas_given: bool,
                           foreach, capturable, fused, differentiable) -> None:
  """torch.optim.AdamW's argument checks with its words (its OptimizerInfo error
  tests match them), then the checks shared with JAX (``check_adamw_args``),
  whose message follows torch's words where both refuse a value."""
  if isinstance(lr, torch.Tensor) and foreach and not capturable:
    raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
  check_tensor_lr(lr)
  if betas_given:  # torch's spelling: its types
    if not (all(isinstance(b, float) for b in (b1, b2))
            or all(isinstance(b, torch.Tensor) for b in (b1, b2))):
      raise ValueError("betas must be either both floats or both Tensors")
    for i, beta in enumerate((b1, b2)):
      if isinstance(beta, torch.Tensor):
        if not capturable and foreach:
          raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                           "and foreach=True")
        if beta.numel() != 1:
          raise ValueError(f"Tensor betas[{i}] must be 1-element")
  if fused and differentiable:
    raise RuntimeError("`fused` does not support `differentiable`")
  if fused and foreach:
    raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
  try:
    checks.check_adamw_args(lr, b1, b2, eps, weight_decay)
  except ValueError as e:
    torch_words = [words for bad, words in (
        (not callable(lr) and not 0.0 <= lr, f"Invalid learning rate: {lr}"),
        (not 0.0 <= eps, f"Invalid epsilon value: {eps}"),
        (not 0.0 <= b1 < 1.0, f"Invalid beta parameter at index 0: {b1}"),
        (not 0.0 <= b2 < 1.0, f"Invalid beta parameter at index 1: {b2}"),
        (not 0.0 <= weight_decay, f"Invalid weight_decay value: {weight_decay}")) if bad]
    raise ValueError(f"{torch_words[0]}: {e}" if torch_words else str(e)) from None


def check_fused_devices(optimizer: torch.optim.Optimizer) -> None:
  """``fused=True``: every param about to get its state (its first step) is on
  a device torch's fused optimizers support (not ``meta``), with torch's
  error (``torch.optim.AdamW(fused=True)`` checks at the same point)."""
  from torch.optim.optimizer import _device_dtype_check_for_fused  # noqa: PLC0415
  for group in optimizer.param_groups:
    for p in group["params"]:
      if grad_of(p) is not None and not optimizer.state.get(p):
        _device_dtype_check_for_fused(_dist.local(p))


def torch_spellings(name: str, learning_rate, lr, b1, b2, betas, default_betas) -> tuple:
  """``(learning_rate, b1, b2)`` from optax_half's keywords or torch's (``lr=``,
  ``betas=``); giving both spellings of one hyperparameter is an error."""
  check_no_grad_hyperparams(name, dict(learning_rate=learning_rate, lr=lr, b1=b1, b2=b2,
                                       betas=betas))
  if lr is not None:
    if learning_rate is not None:
      raise TypeError(f"{name}: pass learning_rate or torch's lr, not both.")
    learning_rate = lr
  if learning_rate is None:
    raise TypeError(f"{name}() needs a learning rate: pass learning_rate=... (or torch's lr=...).")
  check_tensor_lr(learning_rate)
  if betas is not None:
    pair = _betas(betas)
    if (b1, b2) != tuple(default_betas) and (b1, b2) != pair:
      raise TypeError(f"{name}: pass b1/b2 or torch's betas, not both.")
    b1, b2 = pair
  return learning_rate, b1, b2


# torch.optim.AdamW's keywords and group keys besides the hyperparameters,
# with the values the AdamW optimizers honour (maximize, amsgrad, differentiable: both).
TORCH_ADAMW_KEYS = ("maximize", "amsgrad", "foreach", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay")
_REFUSED = {
    "capturable": "the step reads each param's step count on the host, which a CUDA graph "
                  "cannot capture; for that use torch.optim.AdamW(capturable=True)",
}


def check_torch_keys(where: str, values: dict, weight_decay=0.0) -> None:
  """torch.optim.AdamW's ``values`` (keywords or group keys, ``TORCH_ADAMW_KEYS``):
  ``foreach`` and ``fused`` None or a bool (how torch would run the step; a
  group's are not used: the optimizer's ``fused=`` picks the step), the others
  bools, True only for ``maximize``, ``amsgrad``, ``differentiable`` and
  ``decoupled_weight_decay`` (False,
  torch.optim.Adam's, only where ``weight_decay`` is 0)."""
  for key, value in values.items():
    if key in ("foreach", "fused"):
      if value is not None and not isinstance(value, bool):
        raise TypeError(f"{where}: {key} must be None, True or False; got {value!r}.")
    elif not isinstance(value, bool):
      raise TypeError(f"{where}: {key} must be True or False; got {value!r}.")
    elif key == "decoupled_weight_decay" and not value and weight_decay:
      raise ValueError(
          f"{where}: decoupled_weight_decay=False (torch.optim.Adam's weight decay, added to "
          "the gradient) is not supported: these optimizers decay weights as AdamW does. Pass "
          "decoupled_weight_decay=True (AdamW's), or weight_decay=0.")
    elif value and key in _REFUSED:
      raise ValueError(f"{where}: {key}=True is not supported: {_REFUSED[key]}. Pass "
                       f"{key}=False (the default).")


# The mark of a param whose buffers were loaded (or copied with the optimizer): they belong
# to the weights they were saved with, which the user may write after the load (a
# checkpoint's model loaded after its optimizer), so the next step reads them as they are.
_LOADED = "loaded"


def _mark(p: torch.Tensor) -> tuple:
  """What changes when anything writes ``p``: its version counter (every
  in-place op, ``copy_`` from ``load_state_dict`` included) and its storage
  (``p.data = ...``)."""
  local = _dist.local(p)
  return (local._version, local.data_ptr())


# Group keys holding hyperparameters (check_no_grad_hyperparams).
_HYPERPARAMS = ("lr", "learning_rate", "betas", "b1", "b2", "eps", "weight_decay")
# Keys torch's LR and momentum schedulers write into param groups themselves.
_SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum",
                             "swa_lr"})
# Hooks are not pickled or deep-copied, as in torch.optim.
_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


class LowPrecisionOptimizer(torch.optim.Optimizer):
  """The base of every torch_bridge optimizer and wrapper: what they share.

  * ``step(closure=None)``: ``closure`` re-evaluates the loss; then
    ``_step_all()`` (the subclass's step) runs, unless ``skip_nonfinite`` finds
    a NaN or Inf gradient (``run_step``);
  * the fp32 gradients a ``DynamicLossScaler`` hands over for 16-bit
    gradients (``_unscaled_grads``, read by ``step_grad``), dropped after
    every step;
  * param groups with torch's keys (``lr``, ``betas``) where the factory
    takes optax_half's (``learning_rate``, ``b1``, ``b2``); a group may give
    either spelling, a callable ``lr`` is that group's schedule
    (``lr_schedule``), and an unknown key is an error;
  * ``state_dict()``/``load_state_dict()``: bit for bit, with a ``"kind"``
    entry, every check made before anything is written, torch's state-dict
    hooks run around them; a Python number as ``step`` (torch's older
    format) loads;
  * ``pickle`` and ``copy.deepcopy``: the whole optimizer (hooks aside, as in
    torch);
  * params written from outside the optimizer (``model.load_state_dict``
    after the optimizer was built) re-seed their buffers at the next step
    (``_follow``); a step with no such write reads two integers per param.
    Buffers loaded by ``load_state_dict`` (or copied with the optimizer) are
    kept at the next step: they belong to the weights saved with them, which
    may be loaded after the optimizer.
  """

  def __init__(self, params, defaults: dict):
    self._unscaled_grads: dict = {}  # filled by DynamicLossScaler.unscale_
    self._marks: dict = {}  # param -> _mark(p) after the optimizer's last write
    super().__init__(params, defaults)

  # -- param groups ------------------------------------------------------------

  def _normalize_group(self, param_group: dict) -> dict:
    """A copy of ``param_group`` with optax_half's spellings turned into torch's."""
    if not isinstance(param_group, dict):
      raise TypeError(f"param_group must be a dict; got {type(param_group).__name__}.")
    group = dict(param_group)
    if "learning_rate" in group:
      if "lr" in group:
        raise ValueError("param group: pass lr or learning_rate, not both.")
      group["lr"] = group.pop("learning_rate")
    if ("b1" in group or "b2" in group) and "betas" in self.defaults:
      if "betas" in group:
        raise ValueError("param group: pass betas or b1/b2, not both.")
      b1, b2 = self.defaults["betas"]
      group["betas"] = (group.pop("b1", b1), group.pop("b2", b2))
    if "betas" in group:
      group["betas"] = _betas(group["betas"])
    check_no_grad_hyperparams("param group", {k: group[k] for k in _HYPERPARAMS if k in group})
    if "lr" in group:
      check_tensor_lr(group["lr"])
    if "lr" in group and "lr_schedule" in self.defaults and "lr_schedule" not in group:
      # A group's own lr replaces the optimizer's schedule; a callable one is its schedule.
      lr = group["lr"]
      group["lr_schedule"] = lr if callable(lr) else None
      if callable(lr):
        group["lr"] = float(lr(0))
    unknown = set(group) - set(self.defaults) - {"params", "param_names"} - _SCHEDULER_KEYS
    if unknown:
      known = sorted(k for k in self.defaults if k not in ("lr_schedule", "count"))
      raise ValueError(
          f"param group: unknown {sorted(unknown)}; {type(self).__name__} groups take "
          f"{known} (and optax_half's learning_rate, b1, b2).")
    return group

  def add_param_group(self, param_group: dict) -> None:
    """``torch.optim.Optimizer.add_param_group``, with the group's keys and
    params checked; a refused group leaves the optimizer as it was."""
    group = self._normalize_group(param_group)
    first = sum(len(g["params"]) for g in self.param_groups)
    torch.optim.Optimizer.add_param_group(self, group)
    group = self.param_groups[-1]
    try:
      self._check_group(group, first)
    except Exception:
      self.param_groups.pop()
      raise
    self._init_group(group)

  def _check_group(self, group: dict, first: int) -> None:
    """Raises if ``group`` (whose first param is param ``first``) cannot be stepped."""

  def _init_group(self, group: dict) -> None:
    """Makes what the optimizer keeps for a new group."""

  def _group_lr(self, group: dict, count: int) -> float:
    """The group's learning rate at ``count``: its schedule's value (written
    into ``group["lr"]``), or ``group["lr"]`` as schedulers left it."""
    schedule = group.get("lr_schedule")
    if schedule is not None:
      group["lr"] = float(schedule(count))
    return group["lr"]

  # -- gradients -----------------------------------------------------------------

  def _takes_fp32_grad(self, p: torch.Tensor) -> bool:
    """Whether the step of ``p`` widens its gradient (so a loss scaler may hand
    over an fp32 one)."""
    return True

  @torch._disable_dynamo
  def zero_grad(self, set_to_none: bool = True) -> None:
    """``torch.optim.Optimizer.zero_grad``, and the same for ``p.main_grad``
    (``accumulate_in_fp32``): freed, or zeroed with ``set_to_none=False``."""
    super().zero_grad(set_to_none)
    for p in self._all_params():
      if getattr(p, "main_grad", None) is not None:
        if set_to_none:
          p.main_grad = None
        else:
          p.main_grad.zero_()

  # -- params written from outside ---------------------------------------------------

  @torch.no_grad()
  def _follow(self, p: torch.Tensor, compensation, buffer) -> None:
    """``compensation.follow`` of ``p``'s buffer where ``p`` was written since
    the optimizer last wrote it (docs/algorithms.md#pytorch-mirror)."""
    mark = self._marks.get(p)
    if buffer is None or mark == _LOADED or mark == _mark(p):
      return
    local, buf = _dist.local(p), _dist.local(buffer)
    if buf.numel() == local.numel():  # a wrapper's stand-in between steps holds no elements
      compensation.follow(local, buf)

  def _remember(self, params) -> None:
    """``params`` hold what the optimizer wrote: no outside write yet."""
    for p in params:
      self._marks[p] = _mark(p)

  def _remember_plain(self, params) -> None:
    """``_remember`` of tensors that are their own local shard (no DTensor), in one
    comprehension: no Python call per param (a replayed step's)."""
    self._marks.update([(p, (p._version, p.data_ptr())) for p in params])

  def _loaded(self, params) -> None:
    """``params``' buffers were loaded: kept at the next step, whatever writes
    the params before it."""
    for p in params:
      self._marks[p] = _LOADED

  def _all_params(self) -> list:
    return [p for g in self.param_groups for p in g["params"]]

  # -- the step ------------------------------------------------------------------------

  @torch.compiler.disable
  @torch.no_grad()
  def step(self, closure=None):
    """One optimizer step; ``closure`` re-evaluates the loss (optional)."""
    return run_step(self, closure, self._checked_step_all)

  def _checked_step_all(self) -> None:
    if getattr(self, "_fused", None):
      check_fused_devices(self)
    self._step_all()

  def _step_all(self) -> None:
    raise NotImplementedError

  # -- checkpoints ---------------------------------------------------------------------

  def _kind(self) -> str:
    """What ``load_state_dict`` checks a state dict was saved by."""
    return type(self).__name__

  def _extra_state(self) -> dict:
    """Entries of ``state_dict()`` besides ``state``, ``param_groups`` and ``kind``."""
    out = {}
    if hasattr(self, "nonfinite"):
      out["nonfinite"] = dict(self.nonfinite)
    return out

  def _pack(self) -> dict:
    """torch's ``state`` and ``param_groups`` entries: params as indices, a
    group's schedule (a function, often not picklable) left out."""
    index: dict = {}
    groups = []
    for g in self.param_groups:
      packed = {k: v for k, v in g.items() if k not in ("params", "lr_schedule")}
      for p in g["params"]:
        index.setdefault(id(p), len(index))
      packed["params"] = [index[id(p)] for p in g["params"]]
      groups.append(packed)
    state = {(index[id(k)] if torch.is_tensor(k) else k): v for k, v in self.state.items()}
    return {"state": state, "param_groups": groups}

  @torch._disable_dynamo
  def state_dict(self) -> dict:
    """torch's ``state`` and ``param_groups``, ``"kind"`` and the optimizer's
    own entries; torch's state-dict pre- and post-hooks run around it."""
    for hook in self._optimizer_state_dict_pre_hooks.values():
      hook(self)
    out = self._pack()
    out.update(self._extra_state())
    out["kind"] = self._kind()
    for hook in self._optimizer_state_dict_post_hooks.values():
      result = hook(self, out)
      if result is not None:
        out = result
    return out

  def _template(self, group: dict, p: torch.Tensor) -> Optional[dict]:
    """The state ``p`` would get at its first step, for checking a load into
    an optimizer that holds none for it yet (None: no such state, no check)."""
    return None

  def _load(self, state_dict: dict) -> None:
    """Checks ``state_dict`` and loads it (nothing is written if a check fails)."""
    prepare_load(self, state_dict, template=self._template)()
    if hasattr(self, "nonfinite"):
      load_nonfinite(self, state_dict)

  @torch._disable_dynamo
  def load_state_dict(self, state_dict: dict) -> None:
    """Loads a ``state_dict()`` of the same kind of optimizer, bit for bit.

    torch's load-state-dict pre-hooks (which may return a new dict) run
    first, its post-hooks last. A mismatch (kind, groups, keys, dtypes,
    shapes, sharding) is an error that names it, before anything is written.
    """
    state_dict = state_dict.copy()
    for hook in self._optimizer_load_state_dict_pre_hooks.values():
      result = hook(self, state_dict)
      if result is not None:
        state_dict = result
    check_kind(self, state_dict)
    self._load(state_dict)
    self._loaded(self._all_params())
    for hook in self._optimizer_load_state_dict_post_hooks.values():
      hook(self)

  # -- pickle and deepcopy -----------------------------------------------------------

  def __getstate__(self) -> dict:
    state = self.__dict__.copy()
    for name in _HOOK_DICTS:
      state.pop(name, None)
    state["_unscaled_grads"] = {}
    state.pop("_grads_checked_finite", None)
    state.pop("_grouped_cache", None)  # LowPrecisionAdamW's device-side index cache
    state.pop("_state_fits", None)  # and its marks of checked states (made again)
    state.pop("_replay", None)  # and its Triton plans (they point at this one's tensors)
    state.pop("_batched", None)  # a wrapper's batched plan (the same)
    return state

  def __setstate__(self, state: dict) -> None:
    had_differentiable = "differentiable" in state.get("defaults", {})
    super().__setstate__(state)  # torch's: fresh hook dicts, the step patched
    # A copy's params are new tensors holding what the original's held.
    self._marks = dict.fromkeys(self._marks, _LOADED)
    if not had_differentiable:  # torch adds it; these optimizers take no such key
      self.defaults.pop("differentiable", None)
