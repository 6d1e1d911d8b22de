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
from torch_bridge import _dist
from torch_bridge.compensation import COMPENSATIONS

__all__ = ["Batch", "available"]

# The kernel's type codes; fp16 ("H") params with fp16 or fp32 gradients and
# moments (native.kernel finds no other fp16 entry point, and none without F16C).
_CODES = {torch.bfloat16: "B", torch.float32: "F", torch.float16: "H"}
_KERNELS: dict = {}  # ((dtypes, mode), stochastic moments) -> kernel or None


def available() -> bool:
  """Whether the kernel library is built (it is built on first use)."""
  return native.library() is not None


_GRAD_SCALE = native.ADAMW_SCALARS.index("grad_scale")  # the AdamW scalars come before it
_MAX_INDEX = 2**63  # the counter of element 0, and the counts, fit in int64


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_cpu(t) -> bool:
  """Whether the kernel may step ``t`` through its address: a dense,
  contiguous CPU tensor, not a lazily negated view, not a DTensor (a
  conjugate view is complex: no kernel takes its dtype)."""
  if type(t) not in _PLAIN and not (isinstance(t, torch.Tensor) and not _dist.is_dtensor(t)):
    return False
  return dense_cpu([t])


def dense_cpu(tensors) -> bool:
  """Whether every tensor is dense, contiguous, on the CPU and not lazily negated
  (``_plain_cpu`` past its type check), in one comprehension: no Python call per
  tensor (a replayed step's)."""
  return all([t.is_cpu and t.layout is torch.strided and t.is_contiguous() and not t.is_neg()
              for t in tensors])


def _count(value) -> bool:
  """Whether ``value`` is a non-negative Python or numpy integer below 2^63."""
  return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
          and 0 <= value < _MAX_INDEX)


class Batch:
  """The native part of one optimizer step: ``add`` each tensor, then ``run``."""

  def __init__(self, seed: int, state_rounding: str):
    self._seed = seed
    self._stochastic = state_rounding == "stochastic"
    self._configs: dict = {}  # kernel name -> (kernel, [(tensors, step tensor, leaf, scalars)])
    self._scalars: dict = {}  # id of the scalar tensors -> the fp32 values as floats
    self._taken: set = set()  # addresses of the params added since the last run
    self.ran: list = []  # per kernel call run: (kernel, table, rows), for Replay

  def add(self, tensors, mode: str, step: torch.Tensor, leaf: int,
          scalars: Callable[[], tuple], index=0, maximize: bool = False) -> bool:
    """Takes ``(param, grad, mu, nu, buffer)`` for the kernel; False if it cannot.

    ``scalars()``: the AdamW scalars (``ADAMW_SCALARS`` up to the gradient
    read's); ``index``: the random-bit counter of element 0 (a shard's offset
    in the whole tensor); a tensor of counters (a strided shard) is not
    taken. ``maximize``: the gradient is read negated (``grad_scale`` -1,
    an exact negation).
    Everything the kernel reads through an address is checked here (tensors,
    dtypes, sizes, the buffer the mode reads, the step count): what does not
    fit is not taken (the eager step then runs, or raises), never passed on.
    """
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 5):
      return False
    p, grad, mu, nu, buffer = tensors
    known = isinstance(mode, str) and (mode == "direct" or mode in COMPENSATIONS)
    if not known or not _count(index) or not _count(leaf) or not isinstance(maximize, bool):
      return False
    if not (_plain_cpu(p) and _plain_cpu(grad) and _plain_cpu(mu) and _plain_cpu(nu)):
      return False  # checked first: no CPU tensor, no build
    numel = p.numel()
    if numel == 0:
      return False
    # The buffer the mode reads (the master: fp32 here), or none.
    wants = None if mode == "direct" else COMPENSATIONS[mode].buffer_dtype_of(p.dtype)
    if wants is None:
      if buffer is not None:
        return False
    elif not (_plain_cpu(buffer) and buffer.dtype == wants):
      return False
    if not (grad.numel() == mu.numel() == nu.numel() == numel
            and (buffer is None or buffer.numel() == numel)):
      return False
    if numel >= _MAX_INDEX - index:
      return False
    if not (torch.is_tensor(step) and step.is_cpu and step.dim() == 0
            and step.dtype == torch.int64 and int(step) >= 0):
      return False  # advanced in place by run (a number is the eager step's)
    try:
      address = p.data_ptr()
    except RuntimeError:  # a tensor without storage (fake, functional)
      return False
    if address in self._taken:
      return False  # the same param twice in one call: the caller runs the first (before)
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
      floats = [float(v) for v in values]
      if len(floats) != _GRAD_SCALE:
        return False
      host = self._scalars[id(values)] = (values, floats)
    self._taken.add(address)
    self._configs.setdefault(fn.__name__, (fn, []))[1].append(
        (tuple(tensors), step, leaf, host[1], index, -1.0 if maximize else 1.0))
    return True

  def before(self, p: torch.Tensor) -> None:
    """Called before ``p``'s step count is read: a param listed twice in the
    optimizer steps twice, in order (its first step is run here)."""
    if self._taken:
      p = _dist.local(p)
      if p.is_cpu and p.layout == torch.strided and p.data_ptr() in self._taken:
        self.run()

  def run(self) -> None:
    """Steps every tensor added, then advances their step counts."""
    configs, self._configs = self._configs, {}
    self._taken.clear()
    threads = torch.get_num_threads()
    steps = []
    for fn, rows in configs.values():
      table = np.zeros(len(rows), native.TENSOR_DTYPE)
      tensors = [r[0] for r in rows]
      table["numel"] = [t[0].numel() for t in tensors]
      for k, name in enumerate(("p", "g", "mu", "nu")):
        table[name] = [t[k].data_ptr() for t in tensors]
      table["p_out"] = table["p"]  # in place
      table["buffer"] = [0 if t[4] is None else t[4].data_ptr() for t in tensors]
      # The AdamW scalars, then the gradient read's: no unscaling (a sign for
      # maximize), no clipping here.
      table["scalars"] = [r[3] + [r[5]] + [1.0] * (len(native.ADAMW_SCALARS) - _GRAD_SCALE - 1)
                          for r in rows]
      table["keys"] = native.leaf_keys(self._seed, [int(r[1]) for r in rows],
                                       [r[2] for r in rows])
      table["index"] = [r[4] for r in rows]
      fn(table.ctypes.data, len(rows), threads)
      self.ran.append((fn, table, rows))
      steps.extend(r[1] for r in rows)
      # Written through raw pointers: tell autograd, as an in-place op would
      # (a param saved for backward and then stepped is an error, not stale).
      torch.autograd.graph.increment_version(
          [t for tensors in (r[0] for r in rows) for k, t in enumerate(tensors)
           if t is not None and k != 1])
    if steps:
      torch._foreach_add_(steps, 1)
