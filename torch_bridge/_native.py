"""torch_bridge's side of the native CPU kernel (``optax_half_native``).

``Batch`` collects the CPU tensors of one ``LowPrecisionAdamW`` step and steps
them with one kernel call per configuration (param, grad, mu, nu dtypes, mode,
moment rounding), on ``torch.get_num_threads()`` threads, the GIL released.
The kernel computes what ``adam.adamw_step`` computes, bit for bit (its random
keys from the same seed, step and leaf, its scalars from the same fp32
values), so a tensor it cannot take (another device, an fp16 param with
bf16 moments, a non-contiguous view, a dtype it was not built for)
goes through ``adamw_step`` with no change in the numbers.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

import optax_half_native as native

__all__ = ["Batch", "available"]

# The kernel's type codes; fp16 ("H") params with fp16 or fp32 gradients and
# moments (native.kernel finds no other fp16 entry point, and none without F16C).
_CODES = {torch.bfloat16: "B", torch.float32: "F", torch.float16: "H"}
_KERNELS: dict = {}  # ((dtypes, mode), stochastic moments) -> kernel or None


def available() -> bool:
  """Whether the kernel library is built (it is built on first use)."""
  return native.library() is not None


class Batch:
  """The native part of one optimizer step: ``add`` each tensor, then ``run``."""

  def __init__(self, seed: int, state_rounding: str):
    self._seed = seed
    self._stochastic = state_rounding == "stochastic"
    self._configs: dict = {}  # kernel name -> (kernel, [(tensors, step tensor, leaf, scalars)])
    self._scalars: dict = {}  # id of the scalar tensors -> the fp32 values as floats

  def add(self, tensors, mode: str, step: torch.Tensor, leaf: int,
          scalars: Callable[[], tuple], index=0) -> bool:
    """Takes ``(param, grad, mu, nu, buffer)`` for the kernel; False if it cannot.

    ``index``: the random-bit counter of element 0 (a shard's offset in the
    whole tensor); a tensor of counters (a strided shard) is not taken.
    """
    p, grad, mu, nu, buffer = tensors
    if torch.is_tensor(index) or not all(
        t is None or (t.is_cpu and t.is_contiguous()) for t in tensors):
      return False  # checked first: no CPU tensor, no build
    config = (p.dtype, grad.dtype, mu.dtype, nu.dtype, mode)
    fn = _KERNELS.get((config, self._stochastic), False)
    if fn is False:  # looked up once per configuration
      codes = [_CODES.get(d) for d in config[:4]]
      fn = None if None in codes else native.kernel(*codes, mode, self._stochastic)
      _KERNELS[(config, self._stochastic)] = fn
    if fn is None:
      return False
    values = scalars()
    host = self._scalars.get(id(values))
    if host is None:
      host = self._scalars[id(values)] = (values, [float(v) for v in values])
    self._configs.setdefault(fn.__name__, (fn, []))[1].append(
        (tensors, step, leaf, host[1], index))
    return True

  def run(self) -> None:
    """Steps every tensor added, then advances their step counts."""
    threads = torch.get_num_threads()
    steps = []
    for fn, rows in self._configs.values():
      table = np.zeros(len(rows), native.TENSOR_DTYPE)
      tensors = [r[0] for r in rows]
      table["numel"] = [t[0].numel() for t in tensors]
      for k, name in enumerate(("p", "g", "mu", "nu")):
        table[name] = [t[k].data_ptr() for t in tensors]
      table["p_out"] = table["p"]  # in place
      table["buffer"] = [0 if t[4] is None else t[4].data_ptr() for t in tensors]
      # The AdamW scalars, then the gradient read's: no unscaling, no clipping here.
      table["scalars"] = [r[3] + [1.0] * (len(native.ADAMW_SCALARS) - len(r[3])) for r in rows]
      table["keys"] = native.leaf_keys(self._seed, [int(r[1]) for r in rows],
                                       [r[2] for r in rows])
      table["index"] = [r[4] for r in rows]
      fn(table.ctypes.data, len(rows), threads)
      steps.extend(r[1] for r in rows)
      # Written through raw pointers: tell autograd, as an in-place op would
      # (a param saved for backward and then stepped is an error, not stale).
      torch.autograd.graph.increment_version(
          [t for tensors in (r[0] for r in rows) for k, t in enumerate(tensors)
           if t is not None and k != 1])
    if steps:
      torch._foreach_add_(steps, 1)
