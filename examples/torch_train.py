"""PyTorch: an fp16 transformer with ``torch_bridge``, an LR scheduler and the loss scaler.

    python examples/torch_train.py            # 600 steps
    python examples/torch_train.py --quick    # 80 steps, for the tests

``torch_bridge.adam_fp32_master`` is a ``torch.optim.Optimizer`` (fp32 master
weights, fp32 moments) so ``torch.optim.lr_scheduler`` drives its ``lr``;
``torch_bridge.dynamic_loss_scale()`` is GradScaler's interface, but it also
takes fp16 gradients (``torch.amp.GradScaler`` refuses to unscale them) and
hands them to the optimizer unscaled in fp32. The scale starts too high
(2**24) on purpose: the first steps overflow and are skipped (params and
optimizer state untouched) while the scale backs off.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charlm_data  # noqa: E402
import charlm_torch  # noqa: E402
from charlm_flax import Config  # noqa: E402

import torch_bridge as tb  # noqa: E402


def main(argv=None) -> dict:
  steps, train, val_batches = charlm_data.example_setup(argv)

  torch.manual_seed(0)
  cfg = Config()  # d_model 64, 2 layers, context 64

  def batch(x, y):
    return torch.from_numpy(x), torch.from_numpy(y).long()

  model = charlm_torch.CharTransformer(cfg).half()  # fp16 weights, fp32 math
  optimizer = tb.adam_fp32_master(model.parameters(), learning_rate=2e-3, weight_decay=0.01)
  warmup = max(1, steps // 10)
  scheduler = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, cosine decay
      optimizer, lambda t: min((t + 1) / warmup, 0.5 * (1 + math.cos(math.pi * t / steps))))
  scaler = tb.dynamic_loss_scale(init_scale=2.0**24)
  # The first optimizer.step is skipped (its gradients overflow), which torch's
  # scheduler reports as "lr_scheduler.step() before optimizer.step()"; the
  # same happens with torch.amp.GradScaler. The schedule itself is right.
  warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")

  @torch.no_grad()
  def evaluate():
    return float(np.mean([charlm_torch.loss_fn(model, *batch(x, y)).item()
                          for x, y in val_batches]))

  first = evaluate()
  starts = charlm_data.batch_starts(len(train), steps, 16, cfg.context, seed=0)
  for step in range(steps):
    x, y = batch(*charlm_data.windows(train, starts[step], cfg.context))
    loss = charlm_torch.loss_fn(model, x, y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.clip_grad_norm_(optimizer, 1.0)  # on the unscaled fp32 gradients
    scaler.step(optimizer)                  # skipped if any gradient overflowed
    scaler.update()
    scheduler.step()
    if (step + 1) % max(1, steps // 4) == 0:
      print(f"step {step + 1:4d}  train loss {loss.item():.3f}  "
            f"lr {scheduler.get_last_lr()[0]:.2e}  loss scale {scaler.get_scale():g}")
  last = evaluate()
  skipped = int(scaler.state_dict()["skipped_steps"])
  dtypes = {str(p.dtype) for p in model.parameters()}
  print(f"val loss {first:.3f} -> {last:.3f}; {skipped} overflowing steps skipped; "
        f"weights {dtypes}")
  return {"first": first, "last": last, "skipped": skipped, "dtypes": dtypes}


if __name__ == "__main__":
  main()
