"""Sharded params (FSDP2's DTensors) for the torch_bridge optimizers.

Under ``torch.distributed.fsdp.fully_shard`` (or any ``DTensor`` param) each
rank holds a shard of every param, gradient and state tensor. The optimizers
step the local shards with the same code as plain tensors; three things need
the whole tensor, and are done here:

* the random-bit counter of stochastic rounding is an element's row-major
  index in the *whole* tensor (``index``), so a sharded run draws the same
  bits as an unsharded one, element for element;
* reductions over a param (ScaledAdam's RMS, scale gradients and clipping
  norm, the loss scaler's gradient norm) add the local partial sums over the
  ranks holding shards of it (``sum_over_shards``);
* a decision that must be the same everywhere (skip a step with a non-finite
  gradient) combines every rank's local answer (``any_rank``).

DDP needs none of this: its params are whole on every rank and its gradients
are already averaged, so every rank computes the same step.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist

try:  # torch.distributed may be built without DTensor
  from torch.distributed.tensor import DTensor, Shard
  from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - depends on the torch build
  DTensor = None

__all__ = ["is_dtensor", "local", "layout", "like", "held", "wrap_as", "index", "sum_over_shards",
           "norm_over_shards", "any_rank"]


def is_dtensor(t) -> bool:
  return DTensor is not None and isinstance(t, DTensor)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
  """The local shard of a DTensor (sharing its storage: writing it writes the
  DTensor), or ``t`` itself."""
  return t.to_local() if is_dtensor(t) else t


def layout(t: torch.Tensor) -> str:
  """How ``t`` is laid out over ranks, for messages and checks: "a whole
  tensor", or the placements and mesh shape of a DTensor."""
  if not is_dtensor(t):
    return "a whole tensor"
  return f"a DTensor {tuple(t.placements)} over a mesh of {tuple(t.device_mesh.shape)}"


def like(local_tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
  """``local_tensor`` (a shard of ``param``'s shape) as a DTensor laid out like
  ``param``, or as it is when ``param`` is a plain tensor."""
  if not is_dtensor(param):
    return local_tensor
  return DTensor.from_local(local_tensor, param.device_mesh, param.placements, run_check=False,
                            shape=param.shape, stride=param.stride())


def held(t: torch.Tensor) -> torch.Tensor:
  """The tensor a DTensor holds, as it is (``to_local`` applies a view op, which
  a tensor subclass may answer with another type), or ``t`` itself."""
  return t._local_tensor if is_dtensor(t) else t


def wrap_as(local_tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
  """``local_tensor``, with ``param``'s local shape, dtype and strides, wrapped
  without an op on it as a DTensor with ``param``'s layout."""
  return DTensor(local_tensor, param._spec, requires_grad=False)


def index(param: torch.Tensor) -> Union[int, torch.Tensor]:
  """The random-bit counter of the local elements of ``param``: their row-major
  indices in the whole tensor (``docs/algorithms.md#counter-based-random-bits``).

  An int (the index of the first local element) when the local shard is a
  contiguous range of the whole tensor (a plain tensor: 0; FSDP2's ``Shard(0)``:
  its first row times the row size), else an int64 tensor of the local shape.
  """
  if not is_dtensor(param):
    return 0
  shape = tuple(param.shape)
  local_shape, offset = compute_local_shape_and_global_offset(
      param.shape, param.device_mesh, param.placements)
  strides = [1] * len(shape)
  for d in range(len(shape) - 2, -1, -1):
    strides[d] = strides[d + 1] * shape[d + 1]
  partial = [d for d in range(len(shape)) if local_shape[d] != shape[d]]
  first = partial[0] if partial else len(shape)
  if all(local_shape[d] == shape[d] for d in range(first + 1, len(shape))) and all(
      local_shape[d] == 1 for d in range(first)):
    return int(sum(o * s for o, s in zip(offset, strides)))
  device = param.to_local().device
  out = torch.zeros(local_shape, dtype=torch.int64, device=device)
  for d, (o, n, s) in enumerate(zip(offset, local_shape, strides)):
    view = [1] * len(shape)
    view[d] = n
    out = out + ((o + torch.arange(n, dtype=torch.int64, device=device)) * s).view(view)
  return out


def _key(p):
  """(device mesh, its mesh dims that shard ``p``), or None for a plain or
  wholly replicated param."""
  if not is_dtensor(p):
    return None
  dims = tuple(i for i, pl in enumerate(p.placements) if isinstance(pl, Shard))
  return (id(p.device_mesh), dims) if dims else None


def _groups(params) -> dict:
  """``_key`` -> the process groups of those mesh dims: the ranks whose partial
  results add up (replicated mesh dims hold equal copies and are left out)."""
  out: dict = {}
  for p in params:
    key = _key(p)
    if key is not None and key not in out:
      out[key] = [p.device_mesh.get_group(i) for i in key[1]]
  return out


def sum_over_shards(values: torch.Tensor, params, op=None) -> torch.Tensor:
  """Row ``k`` of ``values`` (this rank's partial sum over its shard of
  ``params[k]``) summed over every rank holding a shard of that param, in
  place; one collective per sharding of the params (one under FSDP2). Rows of
  plain params are left as they are. ``op``: another ``dist.ReduceOp`` (MAX,
  MIN) instead of the sum. Every rank must call it with the same params."""
  op = dist.ReduceOp.SUM if op is None else op
  params = list(params)
  rows: dict = {}
  for k, p in enumerate(params):
    key = _key(p)
    if key is not None:
      rows.setdefault(key, []).append(k)
  groups = _groups(params)
  for key, ks in rows.items():
    if len(ks) == len(params):
      sub = values
    else:
      index_rows = torch.tensor(ks, device=values.device)
      sub = values.index_select(0, index_rows)
    for group in groups[key]:
      dist.all_reduce(sub, op=op, group=group)
    if sub is not values:
      values.index_copy_(0, index_rows, sub)
  return values


def norm_over_shards(norms: torch.Tensor, params, norm_type: float) -> torch.Tensor:
  """Row ``k`` of ``norms``, the ``norm_type``-norm of this rank's shard of
  ``params[k]``, made the norm of the whole tensor (max / min of the shards'
  for +-inf, the sum of their counts for 0, ``(sum |n|^p)^(1/p)`` otherwise).
  Rows of plain params keep their value, bit for bit. Same collectives on every rank."""
  params = list(params)
  if all(_key(p) is None for p in params):
    return norms
  if math.isinf(norm_type):
    op = dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN
    return sum_over_shards(norms, params, op)
  if norm_type == 0:
    return sum_over_shards(norms, params)
  sharded = torch.tensor([_key(p) is not None for p in params], device=norms.device)
  total = sum_over_shards(torch.where(sharded, norms ** norm_type, norms), params)
  return torch.where(sharded, total ** (1.0 / norm_type), norms)


def any_rank(flag: torch.Tensor, params) -> torch.Tensor:
  """A bool tensor that is True if it is True on any rank holding a shard of
  one of ``params`` (as it is when none is sharded). Same collectives on every rank."""
  groups = [g for gs in _groups(params).values() for g in gs]
  if not groups:
    return flag
  out = flag.to(torch.int32)
  for group in groups:
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
  return out.bool()
