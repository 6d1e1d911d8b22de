"""Cross-framework parity: the same optimizer in optax_half (jitted) and torch_bridge.

    report = compare("adamw_bf16", params, steps=1000, dtype="bf16")
    print(report.table()); assert report.ok, report.failures()

``compare`` starts both frameworks from the same params, feeds both the same
gradient at every step and, after every step, measures each buffer the two
sides share: the params, the moments ``mu``/``nu``, the fp32 ``master`` (for
``compensation="split"`` the fp32 value the bf16 param and int16 low half
encode), the Kahan ``compensation``, the step ``count`` and, with
``loss_scale=``, the scaler's ``loss_scale``, ``growth_tracker`` and
``skipped_steps``. Per step and leaf it records the max absolute error, the
max relative error ``|a - b| / max(|a|, |b|)``, the max distance in ULPs of
the buffer's own dtype (its bits read as ordered integers: +0 and -0 are 0
apart) and the number of bitwise-equal elements. ``TOLERANCES`` holds the
bounds every check uses (docs/algorithms.md#parity-harness).

Arrays cross the boundary through ``torch_bridge.dlpack``: zero-copy, and a
copy it cannot avoid (a non-contiguous torch leaf, a misaligned buffer) is
made but listed in ``ParityReport.copies``. Two copies are deliberate, since
torch writes in place and JAX memory is immutable: torch's params are clones
of the initial JAX params, and with a loss scaler torch's gradients are clones
too (``unscale_`` works in place); without one the gradients are shared.

The command line runs every configuration in ``CONFIGS``:

    python -m torch_bridge.parity [--optimizer NAME|all] [--steps N]
        [--dtype bf16|fp16|fp32|all] [--seed S] [--json PATH]

prints one row per optimizer and dtype and exits with status 1 if any
tolerance is broken.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import optax_half as oh
import optax_half_native as native_lib
from optax_half._util import is_float
from optax_half.compensation import BUFFER_FIELDS, COMPENSATIONS
from optax_half.scaled_adam import leaf_names as leaf_names_of
import torch_bridge as tb
from torch_bridge import dlpack

__all__ = ["CONFIGS", "DTYPES", "TOLERANCES", "ParityReport", "Tolerance", "compare",
           "default_params", "main"]


# ----------------------------------------------------------------------------
# Tolerances: the one place they live.
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Bounds on one buffer, checked at every recorded step and leaf.

  ``max_rel``: max relative error; ``max_ulp``: max distance in ULPs of the
  buffer's dtype; ``min_equal``: min fraction of bitwise-equal elements (over
  the whole buffer, all leaves, at each step); ``max_tensor_rel``: max error
  of a leaf relative to the largest magnitude the leaf has had at any
  recorded step so far (for buffers whose reductions or order of operations
  differ between the frameworks, where an element near 0, or a momentum
  crossing 0, says nothing). ``None``: not checked.

  Example:
    >>> import jax.numpy as jnp
    >>> from torch_bridge import parity
    >>> parity.TOLERANCES["16bit"]
    Tolerance(max_rel=None, max_ulp=1, min_equal=0.999, max_tensor_rel=None)
    >>> bitwise = {"16bit": parity.Tolerance(max_ulp=0, min_equal=1.0)}  # equal bits only
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> parity.compare("scale_by_adamw", params, steps=2, tolerances=bitwise).ok
    True
  """
  max_rel: Optional[float] = None
  max_ulp: Optional[float] = None
  min_equal: Optional[float] = None
  max_tensor_rel: Optional[float] = None


TOLERANCES = {
    # fp32 buffers: master weights, fp32 moments, fp32 params.
    "fp32": Tolerance(max_rel=1e-6),
    # bf16/fp16 buffers: 16-bit params, moments and Kahan buffers.
    "16bit": Tolerance(max_ulp=1, min_equal=0.999),
    # Equal bits: params written by stochastic rounding (same random bits on
    # both sides), step counts and the loss scaler's state.
    "exact": Tolerance(max_ulp=0, min_equal=1.0),
    # Kahan buffers: reported, not bounded. Where a param rounds the other way
    # its residual changes sign, so the residual's own ULP or relative error
    # says nothing; the param's bound covers the pair.
    "residual": Tolerance(),
    # Optimizers whose frameworks sum in different orders (ScaledAdam's
    # reductions: the clipping norm, sum(p * g), the RMS) or order their
    # elementwise operations differently (torch.optim's Adam and SGD against
    # optax's): per leaf, relative to its largest element; fp32 buffers, and
    # 16-bit ones (one rounding the other way is 2^-8 of an element in bf16).
    "per-tensor": Tolerance(max_tensor_rel=1e-4),
    "per-tensor 16bit": Tolerance(max_tensor_rel=2 ** -6),
    # ScaledAdam's clipping statistics (ParityReport.clipping): the gradient
    # norm, factor and threshold; the number clipped and the dominant
    # parameter must be equal.
    "clipping": Tolerance(max_rel=1e-5),
}


# The Kahan remainders: buffers in the param's dtype.
_RESIDUALS = {c.buffer for c in COMPENSATIONS.values() if c.buffer_dtype == "param"}


def _kind(buffer: str, dtype, compensation: Optional[str], per_tensor: bool = False) -> str:
  if buffer in ("count", "loss_scale", "growth_tracker", "skipped_steps"):
    return "exact"
  if buffer in _RESIDUALS:
    return "residual"
  if per_tensor:
    return "per-tensor" if np.dtype(dtype).itemsize >= 4 else "per-tensor 16bit"
  if (buffer == "params" and compensation is not None
      and COMPENSATIONS[compensation].draws_bits and np.dtype(dtype).itemsize < 4):
    return "exact"
  return "fp32" if np.dtype(dtype).itemsize >= 4 else "16bit"


# ----------------------------------------------------------------------------
# Optimizers: one factory per framework, the same keywords.
# ----------------------------------------------------------------------------

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

_NAMES = ("adam_fp32_master", "adamw_bf16", "scale_by_adamw", "scaled_adam")
# Wrappers around an optimizer of either framework: "master_weights(adam)"
# wraps optax.adam and torch.optim.Adam, "kahan_summation(scaled_adam)" the
# two ScaledAdams. Stock optimizers and their keywords in each framework.
_WRAPPERS = ("master_weights", "kahan_summation")
_STOCK = {
    "adam": (lambda hp: optax.adam(hp["learning_rate"], b1=hp.get("b1", 0.9),
                                   b2=hp.get("b2", 0.999), eps=hp.get("eps", 1e-8)),
             lambda ps, hp: torch.optim.Adam(ps, lr=hp["learning_rate"], betas=(
                 hp.get("b1", 0.9), hp.get("b2", 0.999)), eps=hp.get("eps", 1e-8))),
    "sgd": (lambda hp: optax.sgd(hp["learning_rate"], momentum=hp.get("momentum")),
            lambda ps, hp: torch.optim.SGD(ps, lr=hp["learning_rate"],
                                           momentum=hp.get("momentum") or 0.0)),
}
# torch state keys -> the JAX buffer names they are compared with, per optimizer.
_TORCH_BUFFERS = {"adam": {"exp_avg": "mu", "exp_avg_sq": "nu"},
                  "sgd": {"momentum_buffer": "trace"},
                  "scaled_adam": {k: k for k in ("delta", "exp_avg_sq", "param_rms",
                                                 "scale_exp_avg_sq", "scale_grads")}}
_DTYPE_KEYWORDS = ("mu_dtype", "nu_dtype")
_SCALED_ADAM_CLIP = {"clipping_scale": 2.0, "clipping_update_period": 10}


def _parts(name: str) -> tuple:
  """``"kahan_summation(scaled_adam)"`` -> ``("kahan_summation", "scaled_adam")``;
  a bare name -> ``(None, name)``; None if ``name`` is neither."""
  wrapper, _, rest = name.partition("(")
  if rest:
    inner = rest.removesuffix(")")
    ok = wrapper in _WRAPPERS and rest.endswith(")") and (inner in _NAMES or inner in _STOCK)
    return (wrapper, inner) if ok else None
  return (None, name) if name in _NAMES else None

# name -> (optimizer, hyperparameters, loss-scale keywords or None)
CONFIGS: dict[str, tuple[str, dict, Optional[dict]]] = {
    "adam_fp32_master": ("adam_fp32_master", {"weight_decay": 0.1}, None),
    "adamw_bf16": ("adamw_bf16", {"weight_decay": 0.1}, None),
    "adamw_bf16/split": ("adamw_bf16", {"weight_decay": 0.1, "compensation": "split"}, None),
    "adamw_bf16/stochastic": ("adamw_bf16", {"weight_decay": 0.1,
                                             "compensation": "stochastic"}, None),
    "adamw_bf16/none": ("adamw_bf16", {"weight_decay": 0.1, "compensation": "none"}, None),
    "adamw_bf16/fp32-moments": ("adamw_bf16", {"weight_decay": 0.1, "mu_dtype": "float32",
                                               "nu_dtype": "float32"}, None),
    "adamw_bf16/nearest-moments": ("adamw_bf16", {"weight_decay": 0.1,
                                                  "state_rounding": "nearest"}, None),
    "scale_by_adamw": ("scale_by_adamw", {"weight_decay": 0.1}, None),
    "adamw_bf16+loss_scale": ("adamw_bf16", {"weight_decay": 0.1},
                              {"init_scale": 2.0 ** 10, "growth_interval": 20}),
    "adam_fp32_master+loss_scale": ("adam_fp32_master", {"weight_decay": 0.1},
                                    {"init_scale": 2.0 ** 10, "growth_interval": 20}),
    "scaled_adam": ("scaled_adam", {}, None),
    "scaled_adam/clip": ("scaled_adam", _SCALED_ADAM_CLIP, None),
    "kahan_summation(scaled_adam)/clip": ("kahan_summation(scaled_adam)", _SCALED_ADAM_CLIP,
                                          None),
    "master_weights(scaled_adam)/clip": ("master_weights(scaled_adam)", _SCALED_ADAM_CLIP,
                                         None),
    "master_weights(adam)": ("master_weights(adam)", {}, None),
    "kahan_summation(sgd)": ("kahan_summation(sgd)", {"momentum": 0.9}, None),
}
# The configurations whose frameworks compute the same bits (the AdamW family,
# its wrappers and loss scaling); the others are held to per-tensor bounds.
BITWISE = tuple(c for c, (name, _, _) in CONFIGS.items() if _parts(name)[0] is None
                and name != "scaled_adam")


def _framework_hyperparams(hyperparams: dict, dtypes) -> dict:
  out = dict(hyperparams)
  out.setdefault("learning_rate", 1e-3)
  for k in _DTYPE_KEYWORDS:
    if out.get(k) is not None:
      out[k] = dtypes(_dtype_name(out[k]))
  return out


def _dtype_name(d) -> str:
  """"bf16", "bfloat16", jnp.bfloat16 or torch.bfloat16 -> "bfloat16"."""
  if isinstance(d, torch.dtype):
    return str(d).removeprefix("torch.")
  return jnp.dtype(DTYPES.get(d, d) if isinstance(d, str) else d).name


def _jax_optimizer(name: str, hyperparams: dict, loss_scale: Optional[dict]):
  wrapper, inner = _parts(name)
  hp = _framework_hyperparams(hyperparams, jnp.dtype)
  if inner not in _STOCK and "weight_decay" not in hp:
    # The defaults may differ (adamw_bf16: optax.adamw's 1e-4, torch.optim.AdamW's 1e-2):
    # both frameworks run torch's.
    default = inspect.signature(getattr(tb, inner)).parameters.get("weight_decay")
    if default is not None:
      hp["weight_decay"] = default.default
  tx = _STOCK[inner][0](hp) if inner in _STOCK else getattr(oh, inner)(**hp)
  tx = getattr(oh, wrapper)(tx) if wrapper else tx
  return oh.dynamic_loss_scale(tx, **loss_scale) if loss_scale is not None else tx


def _torch_optimizer(name: str, params: list, hyperparams: dict, loss_scale: Optional[dict],
                     torch_options: Optional[dict] = None):
  wrapper, inner = _parts(name)
  hp = _framework_hyperparams(hyperparams, lambda n: getattr(torch, n))
  if inner in _STOCK:
    optimizer = _STOCK[inner][1](params, hp)
  else:
    optimizer = getattr(tb, inner)(params, **hp, **(torch_options or {}))
  optimizer = getattr(tb, wrapper)(optimizer) if wrapper else optimizer
  scaler = tb.dynamic_loss_scale(**loss_scale) if loss_scale is not None else None
  return optimizer, scaler


# ----------------------------------------------------------------------------
# Error measures.
# ----------------------------------------------------------------------------

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _ordered(a: np.ndarray) -> np.ndarray:
  """Float bits as integers ordered like the values (+0 and -0 both 0)."""
  width = a.dtype.itemsize * 8
  u = a.view(_UINT[a.dtype.itemsize]).astype(np.int64) if width < 64 else \
      a.view(np.int64)
  sign = (u >> (width - 1)) & 1
  magnitude = u & ((1 << (width - 1)) - 1)
  return np.where(sign == 1, -magnitude, magnitude)


def _stats(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float, int, float]:
  """(max abs, max rel, max ULP, number bitwise equal, max abs relative to the
  largest element) of two same-dtype arrays.

  The relative error is ``|a - b| / max(|a|, |b|, tiny)`` with ``tiny`` the
  dtype's smallest normal number, so that an ULP among subnormals near 0 is
  not a relative error of 1; the last measure divides the max abs error by
  ``max(max |a|, max |b|, tiny)`` instead.
  """
  if a.size == 0:
    return 0.0, 0.0, 0.0, 0, 0.0
  n_equal = int(np.sum(a.view(_UINT[a.dtype.itemsize]) == b.view(_UINT[b.dtype.itemsize])))
  if n_equal == a.size:
    return 0.0, 0.0, 0.0, n_equal, 0.0
  if jnp.issubdtype(a.dtype, jnp.floating):  # also ml_dtypes' bfloat16, float8_*
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    nan_a, nan_b = np.isnan(a64), np.isnan(b64)
    same = (a64 == b64) | (nan_a & nan_b)  # equal values (incl. +-0, both inf, both NaN)
    tiny = float(jnp.finfo(a.dtype).smallest_normal)
    with np.errstate(invalid="ignore", over="ignore"):
      diff = np.where(same, 0.0, np.abs(a64 - b64))
      scale = np.maximum(np.maximum(np.abs(a64), np.abs(b64)), tiny)
      rel = np.where(same, 0.0, diff / scale)
      ulp = np.where(same, 0, np.abs(_ordered(a) - _ordered(b))).astype(np.float64)
    bad = (nan_a != nan_b) | (np.isinf(a64) & ~same) | (np.isinf(b64) & ~same)
    diff, rel, ulp = (np.where(bad, np.inf, x) for x in (diff, rel, ulp))
    finite = np.where(np.isfinite(scale), scale, 0.0)
    largest = max(float(finite.max()), tiny)
    return float(diff.max()), float(rel.max()), float(ulp.max()), n_equal, \
        float(diff.max()) / largest
  a64, b64 = a.astype(np.int64), b.astype(np.int64)
  diff = np.abs(a64 - b64).astype(np.float64)
  scale = np.maximum(np.abs(a64), np.abs(b64)).astype(np.float64)
  rel = np.where(diff == 0, 0.0, diff / np.where(scale == 0, 1.0, scale))
  return float(diff.max()), float(rel.max()), float(diff.max()), n_equal, \
      float(diff.max()) / max(float(scale.max()), 1.0)


# ----------------------------------------------------------------------------
# The report.
# ----------------------------------------------------------------------------

_COLUMNS = ("max_abs", "max_rel", "max_ulp", "n_equal", "tensor_rel")


@dataclasses.dataclass
class ParityReport:
  """Per-step, per-leaf errors between optax_half and torch_bridge.

  Attributes:
    name: the configuration (optimizer name, or a ``CONFIGS`` key).
    dtype: the param dtype(s), e.g. ``"bfloat16"`` (``"mixed"`` if several).
    steps: the steps run; ``recorded``: the (1-based) steps measured.
    hyperparams, loss_scale: what both optimizers were built with.
    buffers: buffer name -> ``(kind, dtype name)``; kind keys ``tolerances``.
    leaves: buffer name -> leaf names (tree paths).
    sizes: buffer name -> elements per leaf.
    errors: buffer name -> float64 array ``[len(recorded), n_leaves, 5]`` of
      (max abs, max rel, max ULP, number of bitwise-equal elements, max abs
      relative to the largest magnitude of the leaf at any recorded step so far).
    tolerances: kind -> ``Tolerance``.
    copies: arrays that could not cross the boundary without a copy.
    counters: the JAX side's scalar state at the last step (``count``,
      ``loss_scale``, ``growth_tracker``, ``skipped_steps``), for context.
    seconds: wall time of the run.
    clipping: with a clipping ScaledAdam, its statistics side by side
      (``_clipping_summary``): the worst relative differences of the gradient
      norm, clipping factor and threshold over the recorded steps (bounded
      by ``tolerances["clipping"]``), how many of them JAX clipped, at how
      many of them the number clipped
      and the dominant parameter agree (all must), and the last step's
      statistics of both sides; None otherwise.

  Example:
    >>> import jax.numpy as jnp
    >>> from torch_bridge import parity
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> report = parity.compare("scale_by_adamw", params, steps=3)
    >>> report.recorded, report.buffers["params"]
    ([1, 2, 3], ('16bit', 'bfloat16'))
    >>> report.errors["params"].shape  # (recorded steps, leaves, 5 measures)
    (3, 1, 5)
    >>> print(report.table())
    scale_by_adamw [bfloat16], 3 steps: ok
      buffer            dtype     kind                 max abs    max rel  max ULP    bitwise  tensor rel
      params            bfloat16  16bit                      0          0        0  100.0000%           0
      mu                bfloat16  16bit                      0          0        0  100.0000%           0
      nu                bfloat16  16bit                      0          0        0  100.0000%           0
      count             int64     exact                      0          0        0  100.0000%           0
  """
  name: str
  dtype: str
  steps: int
  hyperparams: dict
  loss_scale: Optional[dict]
  recorded: list
  buffers: dict
  leaves: dict
  sizes: dict
  errors: dict
  tolerances: dict
  copies: list
  counters: dict = dataclasses.field(default_factory=dict)
  seconds: float = 0.0
  clipping: Optional[dict] = None

  def _keys(self, buffer: str) -> list:
    """``buffer`` itself, or its per-dtype entries (``params[bfloat16]``, ...)."""
    if buffer in self.errors:
      return [buffer]
    keys = [k for k in self.errors if k.startswith(buffer + "[")]
    if not keys:
      raise KeyError(f"no buffer {buffer!r}; have {sorted(self.errors)}")
    return keys

  def worst(self, buffer: str) -> dict:
    """Worst values of a buffer over all recorded steps and leaves.

    ``buffer``: a key of ``buffers``, or a name such as ``"params"`` whose
    dtypes have separate entries (then all of them). ``equal``: the smallest
    fraction of bitwise-equal elements at any step (over all its leaves);
    ``equal_final``: that fraction at the last step.
    """
    keys = self._keys(buffer)
    e = np.concatenate([self.errors[k] for k in keys], axis=1)
    total = int(sum(np.sum(self.sizes[k]) for k in keys))
    frac = e[:, :, 3].sum(axis=1) / total if total else np.ones(e.shape[0])
    return {"max_abs": float(e[:, :, 0].max(initial=0.0)),
            "max_rel": float(e[:, :, 1].max(initial=0.0)),
            "max_ulp": float(e[:, :, 2].max(initial=0.0)),
            "tensor_rel": float(e[:, :, 4].max(initial=0.0)),
            "equal": float(frac.min(initial=1.0)),
            "equal_final": float(frac[-1]) if len(frac) else 1.0}

  def series(self, buffer: str, column: str = "max_ulp") -> np.ndarray:
    """One error column of a buffer per recorded step, worst over leaves
    (``n_equal`` is summed over leaves)."""
    e = np.concatenate([self.errors[k] for k in self._keys(buffer)], axis=1)
    e = e[:, :, _COLUMNS.index(column)]
    return e.sum(axis=1) if column == "n_equal" else e.max(axis=1, initial=0.0)

  def failures(self) -> list:
    """One line per broken tolerance: buffer, measure, worst value and where."""
    out = []
    for buffer, (kind, dtype) in self.buffers.items():
      tol, e = self.tolerances[kind], self.errors[buffer]
      if not e.size:
        continue
      worst = self.worst(buffer)
      for column, bound in (("max_rel", tol.max_rel), ("max_ulp", tol.max_ulp),
                            ("tensor_rel", tol.max_tensor_rel)):
        if bound is None:
          continue
        values = e[:, :, _COLUMNS.index(column)]
        if values.max() > bound:
          s, leaf = np.unravel_index(np.argmax(values), values.shape)
          out.append(f"{buffer} ({dtype}, {kind}): {column} {values.max():.3g} > {bound:g} "
                     f"at step {self.recorded[s]}, leaf {self.leaves[buffer][leaf]}")
      if tol.min_equal is not None and worst["equal"] < tol.min_equal:
        out.append(f"{buffer} ({dtype}, {kind}): {100 * worst['equal']:.4f}% bitwise equal "
                   f"< {100 * tol.min_equal:g}%")
    c, bound = self.clipping, self.tolerances["clipping"].max_rel
    if c is not None:
      for measure in ("grad_norm", "clipping_factor", "threshold"):
        if c[f"{measure}_max_rel"] > bound:
          out.append(f"clipping: {measure} differs by {c[measure + '_max_rel']:.3g} > {bound:g}")
      for measure in ("num_clipped", "dominant_parameter"):
        if c[f"{measure}_equal"] < c["steps"]:
          out.append(f"clipping: {measure} differs at {c['steps'] - c[measure + '_equal']} "
                     f"of {c['steps']} recorded steps")
    return out

  @property
  def ok(self) -> bool:
    return not self.failures()

  def summary(self) -> dict:
    """The command line's row: worst param ULP, % bitwise-equal params at the
    last step, worst relative error of any fp32 buffer, verdict."""
    params = self.worst("params")
    fp32 = [self.worst(b)["max_rel"] for b, (k, _) in self.buffers.items() if k == "fp32"]
    per_tensor = [self.worst(b)["tensor_rel"] for b, (k, _) in self.buffers.items()
                  if k.startswith("per-tensor")]
    return {"optimizer": self.name, "dtype": self.dtype, "steps": self.steps,
            "param_max_ulp": params["max_ulp"], "param_equal": params["equal_final"],
            "fp32_max_rel": max(fp32) if fp32 else None,
            "tensor_rel": max(per_tensor) if per_tensor else None,
            "verdict": "ok" if self.ok else "FAIL"}

  def table(self) -> str:
    """Worst error per buffer over all steps and leaves, one line each."""
    lines = [f"{self.name} [{self.dtype}], {self.steps} steps: "
             + ("ok" if self.ok else "FAIL"),
             f"  {'buffer':<18}{'dtype':<10}{'kind':<17}{'max abs':>11}{'max rel':>11}"
             f"{'max ULP':>9}{'bitwise':>11}{'tensor rel':>12}"]
    for buffer, (kind, dtype) in self.buffers.items():
      w = self.worst(buffer)
      lines.append(f"  {buffer:<18}{dtype:<10}{kind:<17}{w['max_abs']:>11.3g}"
                   f"{w['max_rel']:>11.3g}{w['max_ulp']:>9.3g}{100 * w['equal']:>10.4f}%"
                   f"{w['tensor_rel']:>12.3g}")
    c = self.clipping
    if c is not None:
      lines.append(
          f"  clipping, {c['steps']} recorded steps ({c['clipped_steps']} clipped): max rel "
          f"grad norm "
          f"{c['grad_norm_max_rel']:.3g}, factor {c['clipping_factor_max_rel']:.3g}, "
          f"threshold {c['threshold_max_rel']:.3g}; num clipped equal at "
          f"{c['num_clipped_equal']}, dominant parameter at {c['dominant_parameter_equal']}")
      last = c["last"]
      for key in ("grad_norm", "clipping_factor", "model_norm_threshold", "num_clipped",
                  "percent_clipped", "dominant_parameter"):
        lines.append(f"    {key:<22}JAX {last['jax'][key]!s:<24}torch {last['torch'][key]!s}")
    lines += [f"  FAIL {f}" for f in self.failures()]
    lines += [f"  copied: {c}" for c in self.copies]
    return "\n".join(lines)

  def to_dict(self) -> dict:
    """Strict JSON: the summary, worst values per buffer and per-step series.
    Infinite or NaN errors are written as strings, non-JSON hyperparameters
    (dtypes, schedules) by ``str``."""
    return _jsonable({
        **self.summary(), "hyperparams": self.hyperparams, "loss_scale": self.loss_scale,
        "counters": self.counters, "seconds": self.seconds, "copies": list(self.copies),
        "clipping": self.clipping,
        "failures": self.failures(),
        "tolerances": {k: dataclasses.asdict(v) for k, v in self.tolerances.items()},
        "recorded": list(self.recorded),
        "buffers": {b: {"kind": k, "dtype": d, **self.worst(b),
                        "max_ulp_per_step": self.series(b, "max_ulp").tolist(),
                        "max_rel_per_step": self.series(b, "max_rel").tolist()}
                    for b, (k, d) in self.buffers.items()}})


def _largest(a: np.ndarray, b: np.ndarray) -> float:
  """The largest finite magnitude in ``a`` or ``b``."""
  both = np.abs(np.concatenate([a.ravel(), b.ravel()]).astype(np.float64))
  both = both[np.isfinite(both)]
  return float(both.max()) if both.size else 0.0


def _clipping_summary(records: Optional[list]) -> Optional[dict]:
  """``ParityReport.clipping`` from ``(step, JAX stats, torch stats)`` records."""
  if not records:
    return None
  def rel(key, name=None):
    return max(abs(j[key] - t[key]) / max(abs(j[key]), abs(t[key]), 1e-30)
               for _, j, t in records)
  return {"steps": len(records), "clipped_steps": sum(j["clipping_factor"] < 1
                                                     for _, j, _ in records),
          "grad_norm_max_rel": rel("grad_norm"),
          "clipping_factor_max_rel": rel("clipping_factor"),
          "threshold_max_rel": rel("model_norm_threshold"),
          "num_clipped_equal": sum(j["num_clipped"] == t["num_clipped"] for _, j, t in records),
          "dominant_parameter_equal": sum(j["dominant_parameter"] == t["dominant_parameter"]
                                          for _, j, t in records),
          "last": {"step": records[-1][0], "jax": records[-1][1], "torch": records[-1][2]}}


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not np.isfinite(x):
    return str(x)
  if x is None or isinstance(x, (str, int, float, bool)):
    return x
  return str(x)


# ----------------------------------------------------------------------------
# Moving arrays.
# ----------------------------------------------------------------------------

def _jax_leaf(x, name: str, copies: list) -> jax.Array:
  """A leaf of the user's tree as a JAX array; float torch tensors go through DLPack
  (other torch leaves are not optimized: a plain host copy)."""
  if isinstance(x, torch.Tensor) and not x.is_floating_point():
    return jnp.asarray(x.detach().cpu().numpy())
  if isinstance(x, torch.Tensor):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", dlpack.DLPackCopyWarning)
      out = dlpack.to_jax(x, allow_copy=True)
    copies += [f"{name}: {w.message}" for w in caught
               if issubclass(w.category, dlpack.DLPackCopyWarning)]
    return out
  return jnp.asarray(x)


def _numpy(x, name: str, copies: list) -> np.ndarray:
  """Host view of a JAX array or (through DLPack) a torch tensor."""
  if isinstance(x, torch.Tensor):
    x = _jax_leaf(x, name, copies)
  return np.asarray(x)


def default_params(seed: int = 0, dtype: str = "bfloat16") -> dict:
  """The CLI's random tree: a matrix, a vector, a 3-d block, a 1-element vector
  and a scalar (16,555 elements), N(0, 1) rounded to ``dtype``.

  Example:
    >>> from torch_bridge import parity
    >>> params = parity.default_params(seed=0, dtype="bfloat16")
    >>> {k: v.shape for k, v in params.items()}
    {'w': (256, 64), 'b': (64,), 'block': (7, 5, 3), 'one': (1,), 'scalar': ()}
    >>> sum(v.size for v in params.values()), params["w"].dtype
    (16555, dtype(bfloat16))
  """
  rng = np.random.default_rng(seed)
  shapes = {"w": (256, 64), "b": (64,), "block": (7, 5, 3), "one": (1,), "scalar": ()}
  return {k: jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype)
          for k, s in shapes.items()}


# ----------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------

def _jax_buffers(state, treedef, positions) -> dict:
  """Buffer name -> list (one entry per float leaf) of the JAX state's arrays."""
  out: dict = {}

  def per_leaf(name, tree):
    flat = treedef.flatten_up_to(tree)
    out[name] = [flat[i] if isinstance(flat[i], jax.Array) else None for i in positions]

  def visit(s):
    if isinstance(s, (oh.ScaleByAdamWState, optax.ScaleByAdamState)):
      per_leaf("mu", s.mu)
      per_leaf("nu", s.nu)
      out["count"] = [s.count] * len(positions)
    elif isinstance(s, oh.ScaledAdamState):
      for field in _TORCH_BUFFERS["scaled_adam"]:
        per_leaf(field, getattr(s, field))
      out["count"] = [s.count] * len(positions)
    elif isinstance(s, optax.TraceState):
      per_leaf("trace", s.trace)
    elif type(s) in BUFFER_FIELDS:
      per_leaf(BUFFER_FIELDS[type(s)], getattr(s, BUFFER_FIELDS[type(s)]))
    elif isinstance(s, oh.DynamicLossScaleState):
      out["loss_scale"] = [s.scale]
      out["growth_tracker"] = [s.growth_tracker]
      out["skipped_steps"] = [s.skipped_steps]
    if isinstance(s, (tuple, list)):
      for child in s:
        visit(child)

  visit(state)
  return out


def _torch_buffers(optimizer, scaler, params: list, inner_name: str = "") -> dict:
  """Buffer name -> per param tensor, named as the JAX side names them; a
  wrapper's own buffers from its state, the wrapped optimizer's from its
  state of the param's stand-in."""
  out: dict = {}
  inner = getattr(optimizer, "inner", None)
  renames = _TORCH_BUFFERS.get(inner_name, {})
  for i, p in enumerate(params):
    state = optimizer.state[p]
    for name in ("mu", "nu", *native_lib.BUFFERS):
      out.setdefault(name, [None] * len(params))[i] = state.get(name)
    if inner is not None:
      state = inner.state.get(optimizer._work.get(p, p), {})
    for key, name in renames.items():
      out.setdefault(name, [None] * len(params))[i] = state.get(key)
    # A host-side int64 counter (JAX would store it as int32: no DLPack here).
    step = state.get("step")
    out.setdefault("count", [None] * len(params))[i] = \
        None if step is None else np.asarray(int(step), np.int64)
  if scaler is not None:
    c = scaler.counters()
    out["loss_scale"] = [c["scale"]]
    out["growth_tracker"] = [c["growth_tracker"]]
    out["skipped_steps"] = [c["skipped_steps"]]
  return out


def _split_master(param, master, copies: list):
  """The fp32 master of a bf16 param stored as an int16 low half, joined; any
  other master (fp32, e.g. for fp16 params) as it is."""
  if master is None or master.dtype not in (jnp.int16, torch.int16):
    return master
  hi = param.detach() if isinstance(param, torch.Tensor) else param
  return oh.rounding.join_f32(_jax_leaf(hi, "param", copies), _jax_leaf(master, "master", copies))


def _random_grads(seed: int, nonfinite_every: Optional[int], spike_every: Optional[int] = None):
  rng = np.random.default_rng([seed, 1])

  def grads(step, params, scale=1.0):
    if spike_every and step % spike_every == spike_every - 1:
      scale = scale * 10.0
    def one(p):
      if not is_float(p):
        return None
      g = np.asarray(rng.standard_normal(np.shape(p)), np.float32) * np.float32(0.1 * scale)
      g = np.asarray(g, np.float32)  # a 0-d array, not a numpy scalar, so it can be written
      if nonfinite_every and step % nonfinite_every == nonfinite_every - 1 and g.size:
        g.reshape(-1)[rng.integers(g.size)] = np.nan
      return g
    return jax.tree.map(one, params)
  return grads


class _Setup(NamedTuple):
  """compare's arguments resolved: the optimizer, its keywords and loss scaling, and
  what they decide about the buffers (their tolerance kinds)."""
  name: str
  hyperparams: dict
  loss_scale: Optional[dict]
  inner_name: str
  per_tensor: bool
  compensation: Optional[str]


class _Tree(NamedTuple):
  """The params tree's structure and where its float leaves (the optimized ones) are."""
  treedef: Any
  names: list  # every leaf's tree path
  positions: list  # the float leaves' indices
  leaf_names: list  # the float leaves' paths, "<root>" for a bare array
  dtype_label: str

  def unflatten(self, leaves: list):
    """A tree of this structure holding ``leaves``."""
    return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass
class _Sides:
  """Both frameworks mid-run: JAX's jitted step, state and current leaves, torch's
  params (mutable clones) and optimizer; the steps replace or update them in place."""
  jax_step: Any
  state: Any
  leaves: list
  tparams: list
  optimizer: Any
  scaler: Any


@dataclasses.dataclass
class _Records:
  """What the measured steps gather: the ``ParityReport`` fields in the making, and
  the largest magnitude of each (buffer, leaf) so far (for the tensor rel)."""
  setup: _Setup
  clipping: Optional[list]  # (step, JAX stats, torch stats) with a clipping ScaledAdam
  dotted: Optional[list]  # the JAX names of the params, which torch names by position
  recorded: list = dataclasses.field(default_factory=list)
  errors: dict = dataclasses.field(default_factory=dict)
  buffers: dict = dataclasses.field(default_factory=dict)
  leaves: dict = dataclasses.field(default_factory=dict)
  sizes: dict = dataclasses.field(default_factory=dict)
  counters: dict = dataclasses.field(default_factory=dict)
  seen: dict = dataclasses.field(default_factory=dict)  # (buffer, leaf) -> largest finite


def _resolve(name: str, hyperparams: dict, loss_scale, steps: int,
             record_every: int) -> _Setup:
  """compare's arguments checked, a ``CONFIGS`` key replaced by its optimizer, keywords
  and loss scaling (the arguments override them), ``loss_scale`` made None or a dict."""
  if name in CONFIGS and name not in _NAMES:  # a bare optimizer name keeps its defaults
    name, config_hyperparams, config_loss_scale = CONFIGS[name]
    hyperparams = {**config_hyperparams, **hyperparams}
    loss_scale = config_loss_scale if loss_scale is None else loss_scale
  if _parts(name) is None:
    raise ValueError(f"compare() knows {_NAMES}, {' and '.join(_WRAPPERS)} of those or of "
                     f"{tuple(_STOCK)} (e.g. 'master_weights(adam)'), and the CONFIGS "
                     f"{tuple(CONFIGS)}; got {name!r}.")
  inner_name = _parts(name)[1]
  per_tensor = inner_name == "scaled_adam" or inner_name in _STOCK
  if steps < 1 or record_every < 1:
    raise ValueError(f"steps and record_every must be >= 1; got {steps}, {record_every}.")
  if isinstance(hyperparams.get("key"), jax.Array):
    raise ValueError("compare() needs an integer key: torch_bridge cannot take a JAX key.")
  if loss_scale is True:
    loss_scale = {}
  loss_scale = None if loss_scale is None or loss_scale is False else dict(loss_scale)
  compensation = hyperparams.get("compensation", "kahan" if name == "adamw_bf16" else None)
  return _Setup(name, hyperparams, loss_scale, inner_name, per_tensor, compensation)


def _jax_params(params, dtype, copies: list) -> tuple[_Tree, list]:
  """The params as JAX leaves in the requested dtype, and the tree's layout."""
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [jax.tree_util.keystr(path) for path, _ in paths_leaves]
  leaves = [_jax_leaf(x, n, copies) for (_, x), n in zip(paths_leaves, names)]
  if dtype is not None:
    target = jnp.dtype(_dtype_name(dtype))
    leaves = [x.astype(target) if is_float(x) else x for x in leaves]
  positions = [i for i, x in enumerate(leaves) if is_float(x)]
  if not positions:
    raise ValueError("compare() needs at least one float leaf in params.")
  leaf_names = [names[i] or "<root>" for i in positions]
  dtypes = sorted({leaves[i].dtype.name for i in positions})
  dtype_label = dtypes[0] if len(dtypes) == 1 else "mixed"
  return _Tree(treedef, names, positions, leaf_names, dtype_label), leaves


def _jitted_step(tx):
  """``tx``'s step as one jitted ``oh.update_and_apply`` (``tx.update`` and
  ``optax.apply_updates``, or its in-place step, which torch's steps mirror: a master's
  params land on its rounding): (params, state, grads) -> (params, state)."""
  @jax.jit
  def jax_step(p, s, g):
    return oh.update_and_apply(tx, g, s, p)
  return jax_step


def _start(setup: _Setup, tree: _Tree, leaves: list, torch_options: Optional[dict]) -> _Sides:
  """Both optimizers at step 0 on the same params; torch owns mutable clones of them."""
  tx = _jax_optimizer(setup.name, setup.hyperparams, setup.loss_scale)
  state = tx.init(tree.unflatten(leaves))
  tparams = [dlpack.to_torch(leaves[i]).clone().requires_grad_(True) for i in tree.positions]
  optimizer, scaler = _torch_optimizer(setup.name, tparams, setup.hyperparams,
                                       setup.loss_scale, torch_options)
  return _Sides(_jitted_step(tx), state, leaves, tparams, optimizer, scaler)


def _grad_source(grads, steps: int, sides: _Sides, *, scaled: bool, seed: int,
                 nonfinite_every: Optional[int], spike_every: Optional[int]):
  """compare's ``grads`` as a callable ``(step, params) -> tree``; random ones are
  scaled by the JAX side's current loss scale when ``scaled``."""
  if grads is None:
    random = _random_grads(seed, nonfinite_every, spike_every)
    if scaled:
      def next_grads(t, p):
        return random(t, p, float(oh.loss_scale(sides.state)))
    else:
      next_grads = random
  elif callable(grads):
    next_grads = grads
  else:
    sequence = list(grads)
    if len(sequence) < steps:
      raise ValueError(f"grads holds {len(sequence)} trees for {steps} steps.")
    def next_grads(t, p):
      return sequence[t]
  return next_grads


def _jax_grads(g_tree, tree: _Tree, leaves: list, copies: list) -> list:
  """One step's gradient tree as JAX leaves cast to their params' dtypes (the
  non-float leaves: the params' own, unused)."""
  g_flat = tree.treedef.flatten_up_to(g_tree)
  jgrads = list(leaves)
  for i in tree.positions:
    g = _jax_leaf(g_flat[i], tree.names[i], copies)
    if g.shape != leaves[i].shape:
      raise ValueError(f"gradient {tree.names[i] or '<root>'} has shape {g.shape}, "
                       f"param {leaves[i].shape}.")
    jgrads[i] = g.astype(leaves[i].dtype)
  return jgrads


def _step_jax(sides: _Sides, tree: _Tree, jgrads: list) -> None:
  """One jitted JAX step: new leaves and state in ``sides``."""
  jtree, sides.state = sides.jax_step(tree.unflatten(sides.leaves), sides.state,
                                      tree.unflatten(jgrads))
  # Only float leaves are optimized (scale_by_adamw alone would move the rest).
  floats = set(tree.positions)
  sides.leaves = [new if i in floats else old for i, (new, old) in
                  enumerate(zip(tree.treedef.flatten_up_to(jtree), sides.leaves))]


def _step_torch(sides: _Sides, tree: _Tree, jgrads: list) -> None:
  """One torch step on the JAX gradients, read through DLPack (cloned when a
  loss scaler unscales them in place)."""
  for k, i in enumerate(tree.positions):
    g = dlpack.to_torch(jgrads[i])
    sides.tparams[k].grad = g.clone() if sides.scaler is not None else g
  if sides.scaler is not None:
    sides.scaler.step(sides.optimizer)
    sides.scaler.update()
  else:
    sides.optimizer.step()
  for p in sides.tparams:
    p.grad = None


def _read_buffers(sides: _Sides, tree: _Tree, records: _Records, copies: list) -> tuple:
  """Both sides' buffers by name, JAX's and torch's, one entry per float leaf, with
  the params and (for split params) the fp32 master the two halves encode."""
  positions = tree.positions
  jb = _jax_buffers(sides.state, tree.treedef, positions)
  tbuf = _torch_buffers(sides.optimizer, sides.scaler, sides.tparams, records.setup.inner_name)
  jb["params"] = [sides.leaves[i] for i in positions]
  tbuf["params"] = sides.tparams
  for side in (jb, tbuf):  # split: compare the fp32 master the two halves encode
    side["master"] = [_split_master(p, m, copies) for p, m in
                      zip(side["params"], side.get("master", [None] * len(positions)))]
  return jb, tbuf


def _record_clipping(step: int, sides: _Sides, records: _Records) -> None:
  """Both ScaledAdams' clipping statistics at ``step``, the dominant parameter by
  its JAX name on both sides (torch names params by position)."""
  jstats, tstats = oh.scaled_adam_stats(sides.state), tb.scaled_adam_stats(sides.optimizer)
  index = tstats["dominant_parameter"]
  tstats["dominant_parameter"] = records.dotted[int(index)] if index is not None else None
  records.clipping.append((step, jstats, tstats))


def _leaf_stats(buffer: str, k: int, a, b, records: _Records, copies: list) -> tuple:
  """(host array, ``_stats``) of leaf ``k`` of a buffer, JAX's ``a`` against torch's
  ``b``; the tensor rel is over the leaf's largest magnitude at any recorded step."""
  a_np = _numpy(a, buffer, copies)
  b_np = _numpy(b.detach() if isinstance(b, torch.Tensor) else b, buffer, copies)
  if buffer == "count":
    a_np, b_np = a_np.astype(np.int64), b_np.astype(np.int64)
  if a_np.dtype != b_np.dtype or a_np.shape != b_np.shape:
    raise AssertionError(
        f"{buffer}[{k}]: JAX has {a_np.dtype}{a_np.shape}, torch {b_np.dtype}{b_np.shape}")
  seen = records.seen
  stats = _stats(a_np, b_np)
  if stats[3] < a_np.size and jnp.issubdtype(a_np.dtype, jnp.floating):
    # Over the largest magnitude so far: a momentum crossing 0 is not a relative error of 1.
    largest = _largest(a_np, b_np)
    largest = seen[(buffer, k)] = max(seen.get((buffer, k), 0.0), largest)
    stats = (*stats[:4], stats[0] / max(largest, float(jnp.finfo(a_np.dtype).tiny)))
  elif jnp.issubdtype(a_np.dtype, jnp.floating):
    seen[(buffer, k)] = max(seen.get((buffer, k), 0.0), _largest(a_np, b_np))
  return a_np, stats


def _measure(step: int, sides: _Sides, tree: _Tree, records: _Records, copies: list) -> None:
  """Compares every buffer both sides have after ``step`` and adds the errors,
  the scalar counters and the clipping statistics to ``records``."""
  jb, tbuf = _read_buffers(sides, tree, records, copies)
  if records.clipping is not None:
    _record_clipping(step, sides, records)
  records.recorded.append(step)
  for buffer in ("count", "loss_scale", "growth_tracker", "skipped_steps"):
    if jb.get(buffer):
      records.counters[buffer] = np.asarray(jb[buffer][0]).item()
  rows: dict = {}  # (buffer, dtype) -> [(leaf name, stats, size)]
  for buffer in ["params"] + [b for b in jb if b != "params"]:
    if buffer not in tbuf:
      continue
    pairs = list(zip(jb[buffer], tbuf[buffer]))
    for k, (a, b) in enumerate(pairs):
      if a is None or b is None:
        continue
      a_np, stats = _leaf_stats(buffer, k, a, b, records, copies)
      name = tree.leaf_names[k] if len(pairs) == len(tree.positions) else buffer
      rows.setdefault((buffer, a_np.dtype.name), []).append((name, stats, a_np.size))
  _add_rows(rows, records)


def _add_rows(rows: dict, records: _Records) -> None:
  """One step's ``(buffer, dtype) -> [(leaf, stats, size)]`` into ``records``: one
  entry per buffer, or per buffer and dtype when a tree mixes dtypes."""
  per_buffer: dict = {}
  for buffer, dtype_name in rows:
    per_buffer.setdefault(buffer, []).append(dtype_name)
  compensation, per_tensor = records.setup.compensation, records.setup.per_tensor
  for (buffer, dtype_name), entries in rows.items():
    key = buffer if len(per_buffer[buffer]) == 1 else f"{buffer}[{dtype_name}]"
    records.buffers.setdefault(key, (_kind(buffer, np.dtype(jnp.dtype(dtype_name)),
                                           compensation, per_tensor), dtype_name))
    records.errors.setdefault(key, []).append([e[1] for e in entries])
    records.leaves[key] = [e[0] for e in entries]
    records.sizes[key] = [e[2] for e in entries]


def compare(name: str, params, grads=None, steps: int = 100, *, dtype=None, seed: int = 0,
            loss_scale=None, nonfinite_every: Optional[int] = None,
            spike_every: Optional[int] = None, record_every: int = 1,
            tolerances: Optional[dict] = None, torch_options: Optional[dict] = None,
            **hyperparams) -> ParityReport:
  """Runs optimizer ``name`` in optax_half (jitted) and torch_bridge side by side.

  Args:
    name: ``"adam_fp32_master"``, ``"adamw_bf16"`` or ``"scale_by_adamw"``
      (with their defaults), or another ``CONFIGS`` key, the command line's
      names (``"adamw_bf16/stochastic"``, ``"adamw_bf16+loss_scale"``): its
      optimizer with its keywords and loss scaling, which ``hyperparams`` and
      ``loss_scale`` override.
    params: a pytree of arrays (JAX, numpy or torch tensors, e.g. a Flax
      ``nnx.state(model, nnx.Param)`` or a torch ``state_dict()``). Float
      leaves are optimized; other leaves are ignored.
    grads: ``None`` (N(0, 0.1^2) per step from ``seed``, times the current loss
      scale with ``loss_scale``), a sequence of trees like ``params``, or a
      callable ``grads(step, params) -> tree`` given the 0-based step and the
      current JAX params (so gradients can come from a model). Gradients are
      cast to each param's dtype; both sides get the same values.
    steps: number of optimizer steps.
    dtype: cast every float leaf to this dtype first ("bf16", "fp16",
      "fp32" or a dtype); ``None`` keeps the leaves' dtypes.
    seed: seed of the random gradients.
    loss_scale: ``None``, ``True`` or a dict of ``dynamic_loss_scale``
      keywords: wraps the JAX optimizer in ``optax_half.dynamic_loss_scale``
      and steps torch through ``torch_bridge.dynamic_loss_scale``; gradients
      are then the *scaled* gradients.
    nonfinite_every: with random gradients, put a NaN into one element of
      every ``nonfinite_every``-th step (to exercise skipped steps).
    spike_every: with random gradients, make every ``spike_every``-th step's
      gradients 10 times larger (to exercise gradient clipping).
    record_every: measure every this many steps (and always the last).
    tolerances: overrides of ``TOLERANCES`` (kind -> ``Tolerance``).
    torch_options: torch-only keywords, e.g. ``{"fused": True}``.
    **hyperparams: the optimizer's keywords, the same for both frameworks
      (``learning_rate`` defaults to 1e-3; dtype keywords may be strings).

  Returns:
    A ``ParityReport``.

  Example:
    >>> import jax.numpy as jnp
    >>> from torch_bridge import parity
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> report = parity.compare("adamw_bf16", params, steps=5, weight_decay=0.1)
    >>> report.ok, report.worst("params")["max_ulp"]  # the same bits in both frameworks
    (True, 0.0)
  """
  label = name  # the report's name: the configuration asked for
  setup = _resolve(name, hyperparams, loss_scale, steps, record_every)
  started = time.perf_counter()
  copies: list = []
  tree, leaves = _jax_params(params, dtype, copies)
  sides = _start(setup, tree, leaves, torch_options)
  next_grads = _grad_source(grads, steps, sides, scaled=setup.loss_scale is not None,
                            seed=seed, nonfinite_every=nonfinite_every,
                            spike_every=spike_every)
  clipping = ([] if setup.inner_name == "scaled_adam" and setup.hyperparams.get("clipping_scale")
              else None)
  records = _Records(setup, clipping,
                     leaf_names_of(tree.unflatten(leaves)) if clipping is not None else None)
  for t in range(steps):
    jgrads = _jax_grads(next_grads(t, tree.unflatten(sides.leaves)), tree, sides.leaves, copies)
    _step_jax(sides, tree, jgrads)
    _step_torch(sides, tree, jgrads)
    if (t + 1) % record_every == 0 or t + 1 == steps:
      _measure(t + 1, sides, tree, records, copies)

  return ParityReport(
      name=label, dtype=tree.dtype_label, steps=steps, hyperparams=dict(setup.hyperparams),
      loss_scale=setup.loss_scale, recorded=records.recorded, buffers=records.buffers,
      leaves=records.leaves, sizes=records.sizes,
      errors={b: np.asarray(e, np.float64) for b, e in records.errors.items()},
      tolerances={**TOLERANCES, **(tolerances or {})}, copies=sorted(set(copies)),
      counters=records.counters, seconds=time.perf_counter() - started,
      clipping=_clipping_summary(records.clipping))


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------

def run_config(config: str, dtype: str, steps: int, seed: int = 0, params=None) -> ParityReport:
  """One ``CONFIGS`` entry on ``default_params`` (or ``params``) in ``dtype``:
  random gradients, with a NaN every 97 steps under loss scaling and 10 times
  larger gradients every 23 steps under ScaledAdam's clipping."""
  name, hyperparams, loss_scale = CONFIGS[config]
  params = default_params(seed) if params is None else params
  report = compare(name, params, steps=steps, dtype=dtype, seed=seed, loss_scale=loss_scale,
                   nonfinite_every=97 if loss_scale is not None else None,
                   spike_every=23 if hyperparams.get("clipping_scale") else None, **hyperparams)
  report.name = config
  return report


def _format_row(s: dict) -> str:
  rel = "-" if s["fp32_max_rel"] is None else f"{s['fp32_max_rel']:.2g}"
  tensor = "-" if s["tensor_rel"] is None else f"{s['tensor_rel']:.2g}"
  return (f"{s['optimizer']:<35}{s['dtype']:<10}{s['steps']:>6}{s['param_max_ulp']:>10.3g}"
          f"{100 * s['param_equal']:>11.4f}%{rel:>12}{tensor:>12}  {s['verdict']}")


def main(argv=None) -> int:
  """The command line (``python -m torch_bridge.parity``): the ``CONFIGS`` on
  ``default_params``, one row per optimizer and dtype.

  Args:
    argv: the arguments (``--optimizer``, ``--steps``, ``--dtype``, ``--seed``,
      ``--json``, ``--verbose``); ``None`` reads ``sys.argv``.

  Returns:
    The exit status: 0 if every run is within ``TOLERANCES``, 1 otherwise.

  Example:
    >>> from torch_bridge import parity
    >>> parity.main(["--optimizer", "scale_by_adamw", "--dtype", "bf16", "--steps", "1"])
    optimizer                          dtype      steps worst ULP     bitwise    fp32 rel  tensor rel  verdict
    scale_by_adamw                     bfloat16       1         0   100.0000%           -           -  ok
    <BLANKLINE>
    1/1 within tolerance (params: worst ULP over all steps, ...
    0
  """
  parser = argparse.ArgumentParser(
      prog="python -m torch_bridge.parity",
      description="Run optax_half (jitted) and torch_bridge side by side and compare "
                  "every step. Exits 1 if a tolerance (torch_bridge.parity.TOLERANCES) "
                  "is broken.")
  parser.add_argument("--optimizer", default="all", help="a name from CONFIGS, or all: "
                      + ", ".join(CONFIGS))
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--dtype", default="all", choices=[*DTYPES, "all"])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", default=None, help="write every report here")
  parser.add_argument("--verbose", action="store_true", help="print each buffer")
  args = parser.parse_args(argv)
  if args.optimizer != "all" and args.optimizer not in CONFIGS:
    parser.error(f"unknown optimizer {args.optimizer!r}; choose from: {', '.join(CONFIGS)}")
  if args.steps < 1:
    parser.error("--steps must be >= 1")
  configs = list(CONFIGS) if args.optimizer == "all" else [args.optimizer]
  dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]

  print(f"{'optimizer':<35}{'dtype':<10}{'steps':>6}{'worst ULP':>10}{'bitwise':>12}"
        f"{'fp32 rel':>12}{'tensor rel':>12}  verdict", flush=True)
  reports = []
  for config in configs:
    for dtype in dtypes:
      report = run_config(config, dtype, args.steps, args.seed)
      reports.append(report)
      print(_format_row(report.summary()), flush=True)
      if args.verbose or not report.ok:
        print(report.table(), flush=True)
  failed = sum(not r.ok for r in reports)
  print(f"\n{len(reports) - failed}/{len(reports)} within tolerance "
        "(params: worst ULP over all steps, % bitwise-equal elements at the last step; "
        "fp32 rel: worst relative error of any fp32 buffer; tensor rel: worst error "
        "relative to the largest magnitude of its leaf so far, where the frameworks "
        "sum or order operations differently).")
  if args.json:
    with open(args.json, "w") as f:
      json.dump([r.to_dict() for r in reports], f, indent=1, allow_nan=False)
    print(f"wrote {args.json}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
