"""Gradient accumulation in fp32 for 16-bit params (NeMo's ``main_grad``).

Backward into a 16-bit ``p.grad`` adds micro-batch gradients in 16 bits:
8 scaled fp16 gradients of 8192 sum to 65536, which is inf in fp16 (the
whole step is then skipped), and bf16 sums lose low bits at every add.
``accumulate_in_fp32(params)`` registers a post-accumulate-grad hook on each
16-bit param that adds the fresh ``p.grad`` into an fp32 ``p.main_grad`` and
then makes ``p.grad`` an alias of it (``MainGradAlias``: the param's grad
dtype and shape, ``main_grad``'s values), so every micro-batch's gradient is
rounded once, into fp32, and later micro-batches are added into the fp32 sum
by autograd itself.

torch_bridge's optimizers and wrappers step ``p.main_grad`` where a param
has one (``_optim.grad_of``); the loss scaler unscales it in place, checks it
for infs and clips it (``scaler.clip_grad_norm_``). Whatever reads or
scales ``p.grad`` acts on the same fp32 sum: ``torch.nn.utils.clip_grad_norm_``
(what Lightning's ``gradient_clip_val``, the HF Trainer's ``max_grad_norm``
and accelerate call) returns its norm and clips it in place.
``optimizer.zero_grad()`` frees it (or zeroes it, with ``set_to_none=False``);
``model.zero_grad()`` drops the alias, and the next backward starts a new sum.
A plain ``torch.optim`` optimizer does not read ``main_grad``: wrap it
(``master_weights(optimizer)``).

Under DDP, run every micro-batch in ``model.no_sync()`` and call
``handle.all_reduce()`` before the step: the fp32 sums are averaged over the
ranks once per step (without ``no_sync`` DDP would reduce each 16-bit
micro-batch gradient after this hook has moved it). Under FSDP2
(``fully_shard``: DTensor params) FSDP2 reduce-scatters each micro-batch's
16-bit gradient (averaged over the ranks, in its ``MixedPrecisionPolicy``'s
``reduce_dtype``) and adds the shard into the sharded param's ``p.grad``: a
DTensor holding the alias of the fp32 ``main_grad`` shard. So what is summed
in fp32 is the reduced micro-batch gradients, nothing is left to all-reduce,
and ``clip_grad_norm_`` takes the norm over every shard. Keep gradient sync
on for every micro-batch (``set_requires_gradient_sync(False)`` makes FSDP2
sum the unreduced micro-batches in 16 bits itself and run the hook once).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from torch_bridge import _dist

__all__ = ["accumulate_in_fp32", "FP32Accumulation", "MainGradAlias"]


class MainGradAlias(torch.Tensor):
  """``p.grad`` under ``accumulate_in_fp32``: a tensor with the metadata of
  ``p``'s gradient (dtype, shape, device) whose values are ``p.main_grad``.

  Every op on it runs on the fp32 ``main`` (``tensor.main``): in-place ops
  (``mul_`` of ``clip_grad_norm_``, ``zero_``, ``copy_``, autograd's ``+=``)
  write it, other ops return plain fp32 tensors (``linalg.vector_norm`` is
  the fp32 sum's norm). So ``torch.nn.utils.clip_grad_norm_`` and
  everything else that reads or scales ``p.grad`` acts on the gradient the
  step uses.
  """

  main: torch.Tensor

  @staticmethod
  def __new__(cls, main: torch.Tensor, dtype: torch.dtype):
    out = torch.Tensor._make_wrapper_subclass(
        cls, main.shape, strides=main.stride(), dtype=dtype, device=main.device,
        requires_grad=False)
    out.main = main
    return out

  __torch_function__ = torch._C._disabled_torch_function_impl

  @classmethod
  def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
    def unwrap(t):
      return t.main if isinstance(t, MainGradAlias) else t
    out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
    name = func.overloadpacket.__name__
    if name.endswith("_") and not name.startswith("_foreach") and args and \
        isinstance(args[0], MainGradAlias):
      return args[0]  # an in-place op wrote main: the alias is its result
    return out

  def __repr__(self):
    return f"MainGradAlias(dtype={self.dtype}, main={self.main!r})"

  def tolist(self):
    return self.main.tolist()

  def __reduce_ex__(self, protocol):
    # Pickled and deep-copied as the fp32 values (e.g. a deepcopy of a model mid-accumulation).
    return (torch.Tensor.clone, (self.main,))


def _alias(p: torch.Tensor) -> torch.Tensor:
  """``p.main_grad``'s alias, a DTensor laid out like ``p`` for a sharded param."""
  alias = MainGradAlias(_dist.held(p.main_grad), p.dtype)
  # Wrapped as is: `DTensor.from_local` takes a view, which the alias makes an fp32 tensor.
  return _dist.wrap_as(alias, p) if _dist.is_dtensor(p) else alias


def _is_alias(grad: torch.Tensor, main) -> bool:
  """Whether ``grad`` is the alias of ``main`` (both DTensors for a sharded param)."""
  local = _dist.held(grad)
  return (main is not None and isinstance(local, MainGradAlias)
          and local.main is _dist.held(main))


def _accumulate(p: torch.Tensor) -> None:
  """The hook: ``p.main_grad = f32(p.grad)``, then ``p.grad`` becomes the alias
  of ``p.main_grad``, into which the next micro-batch's gradient is added."""
  grad = p.grad
  if grad is None:
    return
  main = getattr(p, "main_grad", None)
  if _is_alias(grad, main):
    # Autograd (or FSDP2, into the sharded alias's local tensor) added this
    # micro-batch into main through the alias: fp32 += widen(16-bit).
    return
  with torch.no_grad():
    # A p.grad that is not main's alias (a plain 16-bit grad) starts a new sum
    # when the alias was dropped (model.zero_grad(), p.grad = None) since.
    local = _dist.held(grad)
    local = local.main if isinstance(local, MainGradAlias) else local
    p.main_grad = _dist.like(local.to(torch.float32, copy=True), p)
  p.grad = _alias(p)


class FP32Accumulation:
  """What ``accumulate_in_fp32`` registered: ``remove()`` takes the hooks off,
  ``all_reduce()`` averages ``main_grad`` over a process group (DDP).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    >>> handle = tb.accumulate_in_fp32([p])
    >>> handle.params == [p]
    True
    >>> handle.remove()
  """

  def __init__(self, params: list, hooks: list):
    self.params = params
    self._hooks = hooks

  def remove(self) -> None:
    """Removes the hooks; ``main_grad`` already accumulated stays, ``p.grad``
    (its alias) is set to None, so backward writes a plain ``p.grad`` again."""
    for hook in self._hooks:
      hook.remove()
    self._hooks = []
    for p in self.params:
      if isinstance(_dist.held(p.grad), MainGradAlias):  # a sharded param's too
        p.grad = None

  @torch.no_grad()
  def all_reduce(self, group=None) -> None:
    """Averages every ``p.main_grad`` over ``group`` (default: the world), in fp32."""
    import torch.distributed as dist  # noqa: PLC0415
    grads = [p.main_grad for p in self.params if getattr(p, "main_grad", None) is not None]
    if not grads:
      return
    if any(_dist.is_dtensor(g) for g in grads):
      raise ValueError(
          "all_reduce: these params are sharded (FSDP2 DTensors), whose gradients FSDP2 has "
          "already reduce-scattered before they were added to main_grad; step without it.")
    world = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
      g.copy_(flat[offset:offset + g.numel()].view_as(g))
      offset += g.numel()


def accumulate_in_fp32(params) -> FP32Accumulation:
  """Accumulates the gradients of 16-bit ``params`` in fp32 ``p.main_grad``.

  Params of 32 bits or more, and params that do not require gradients, are
  left as they are (their ``p.grad`` already accumulates in their dtype).

  Args:
    params: an iterable of tensors (``model.parameters()``).

  Returns:
    An ``FP32Accumulation`` handle (``remove()``, ``all_reduce()``).

  Example:
    >>> import torch, torch_bridge as tb
    >>> p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))
    >>> handle = tb.accumulate_in_fp32([p])
    >>> for _ in range(8):   # 8 scaled micro-batch gradients of 8192
    ...   (p.float() * 8192).sum().backward()
    >>> p.main_grad.item(), p.grad.dtype   # 65536: inf in fp16, exact in fp32
    (65536.0, torch.float16)
    >>> torch.nn.utils.clip_grad_norm_([p], 1.0).item(), p.main_grad.item()  # p.grad is main_grad
    (65536.0, 1.0)

  References:
    NVIDIA NeMo's ``MainParamsOptimizerWrapper`` (``main_grad``); Micikevicius
    et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, ICLR 2018.
  """
  chosen, hooks = [], []
  for position, p in enumerate(params):
    if not isinstance(p, torch.Tensor):
      raise TypeError(f"param {position} is a {type(p).__name__}, not a tensor.")
    if not p.requires_grad or not p.is_floating_point() or p.element_size() >= 4:
      continue
    chosen.append(p)
    hooks.append(p.register_post_accumulate_grad_hook(_accumulate))
  return FP32Accumulation(chosen, hooks)
