"""The seed's batched ScaledAdam, ported for timing only (``benchmarks.torch_step``).

ScaledAdam as the seed document (icefall's older ``optim.py``) runs it: each
step stacks the params of one shape (and their gradients) into one tensor,
steps the stack with eager torch ops (one op per line of the algorithm, with
``mul_``/``addcmul_``, ``torch.sqrt`` and Python-float scalars), reads the
clipping factor back to the host, and copies the stack back into the params.
Its numbers are the seed's, not the library's (its clipping scales only the
size update's gradients; docs/algorithms.md#scaledadam-and-eden): it is the
speed baseline that ``tb.scaled_adam`` is measured against, and
tests/test_benchmarks.py checks that it computes ScaledAdam without clipping.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["SeedScaledAdam"]


class SeedScaledAdam(torch.optim.Optimizer):
  """ScaledAdam stepping stacks of same-shaped params (the seed's strategy)."""

  def __init__(self, params, lr=3e-2, clipping_scale=None, betas=(0.9, 0.98),
               scalar_lr_scale=0.1, eps=1e-8, param_min_rms=1e-5, param_max_rms=3.0,
               scalar_max=10.0, size_update_period=4, clipping_update_period=100):
    super().__init__(params, dict(
        lr=lr, clipping_scale=clipping_scale, betas=betas, scalar_lr_scale=scalar_lr_scale,
        eps=eps, param_min_rms=param_min_rms, param_max_rms=param_max_rms,
        scalar_max=scalar_max, size_update_period=size_update_period,
        clipping_update_period=clipping_update_period))

  @torch.no_grad()
  def step(self):
    for group in self.param_groups:
      by_shape = defaultdict(list)
      for p in group["params"]:
        by_shape[(str(p.dtype), *p.shape)].append(p)
      stacks = []
      for key in sorted(by_shape):
        params = by_shape[key]
        stack = torch.stack(params)
        grad = torch.stack([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
        stacks.append((params, stack, grad, self.state[params[0]]))
      factor = 1.0 if not stacks[0][3] else self._clipping_factor(group, stacks)
      for params, stack, grad, state in stacks:
        if not state:
          self._init(group, stack, state)
        self._step_stack(group, stack, grad, state, factor)
        for i, p in enumerate(params):
          p.copy_(stack[i])

  @staticmethod
  def _dims(x):
    return list(range(1, x.ndim))

  def _init(self, group, stack, state):
    state["step"] = 0
    state["delta"] = torch.zeros_like(stack)
    state["exp_avg_sq"] = torch.zeros_like(stack)
    if stack[0].numel() > 1:
      rms = (stack ** 2).mean(dim=self._dims(stack), keepdim=True).sqrt()
      state["param_rms"] = rms
      state["scale_exp_avg_sq"] = torch.zeros_like(rms)
      state["scale_grads"] = torch.zeros(group["size_update_period"], *rms.shape,
                                         dtype=stack.dtype, device=stack.device)

  def _clipping_factor(self, group, stacks) -> float:
    scale, state0 = group["clipping_scale"], stacks[0][3]
    t = state0["step"]
    if scale is None or t == 0:
      return 1.0
    period = group["clipping_update_period"]
    total = torch.zeros((), device=stacks[0][1].device)
    for _, stack, grad, state in stacks:
      total += (grad ** 2).sum() if stack[0].numel() == 1 else (
          (grad * state["param_rms"]) ** 2).sum()
    norm = total.sqrt()
    norms = state0.setdefault("model_norms", torch.zeros(period, device=norm.device))
    norms[t % period] = norm
    if t % period == 0:
      median = norms.sort()[0][min(period - 1, (period // 4) * 2)].item()
      state0["model_norm_threshold"] = scale * median
    if t < period:
      return 1.0
    return min(1.0, (state0["model_norm_threshold"] / (norm + 1e-20)).item())

  def _step_stack(self, group, p, grad, state, factor):
    lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
    period, t = group["size_update_period"], state["step"]
    scaled = grad * factor if factor != 1.0 else grad
    delta = state["delta"]
    delta.mul_(b1)
    exp_avg_sq = state["exp_avg_sq"]
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    if p[0].numel() > 1:
      dims = self._dims(p)
      state["scale_grads"][t % period] = (p * scaled).sum(dim=dims, keepdim=True)
      if t % period == period - 1:
        state["param_rms"].copy_((p ** 2).mean(dim=dims, keepdim=True).sqrt())
        if t > 0:
          self._size_update(group, p, state)
      bc2 = 1 - b2 ** (t + 1)
      v = exp_avg_sq * (1.0 / bc2) if bc2 < 0.99 else exp_avg_sq
      denom = v.sqrt()
      denom += eps
      alpha = -lr * (1 - b1) * state["param_rms"].clamp(min=group["param_min_rms"])
      delta.add_(grad / denom * alpha)
    else:
      size_lr = lr * group["scalar_lr_scale"]
      denom = (exp_avg_sq / (1 - b2 ** (t + 1))).sqrt() + eps
      delta.add_(grad / denom, alpha=-size_lr * (1 - b1))
      p.clamp_(min=-group["scalar_max"], max=group["scalar_max"])
    p.add_(delta)
    state["step"] = t + 1

  def _size_update(self, group, p, state):
    (b1, b2), period, t = group["betas"], group["size_update_period"], state["step"]
    size_lr = group["lr"] * group["scalar_lr_scale"]
    sg, rms = state["scale_grads"], state["param_rms"]
    b2_corr = b2 ** period
    w = state["scale_exp_avg_sq"]
    w.mul_(b2_corr).add_((sg ** 2).mean(dim=0), alpha=1 - b2_corr)
    bc2 = 1 - b2_corr ** ((t + 1) // period)
    step = -size_lr * bc2 ** 0.5 * sg.sum(dim=0) / (w.sqrt() + group["eps"])
    step.masked_fill_(rms < group["param_min_rms"], 0.0)
    step.masked_fill_(rms > group["param_max_rms"], -size_lr * period)
    state["delta"].add_(p * step, alpha=1 - b1)
