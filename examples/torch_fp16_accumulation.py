"""fp16 training with gradient accumulation in PyTorch: fp32 ``main_grad`` vs 16-bit ``p.grad``.

    python examples/torch_fp16_accumulation.py            # 300 steps per run
    python examples/torch_fp16_accumulation.py --quick    # 40 steps per run, for the tests

The byte-level transformer of ``examples/demo.py``, 8 micro-batches of 2
sequences per step, three runs from the same weights:

* ``fp32``: fp32 weights, ``torch.optim.AdamW`` (the reference);
* ``fp16``: fp16 weights, ``torch_bridge.adam_fp32_master`` and the loss
  scaler at 2^18, a scale at which every micro-batch's scaled gradient fits
  in fp16; backward accumulates them in the fp16 ``p.grad``, where their sum
  overflows (65504): those steps are skipped and the scale backs off;
* ``fp16 + fp32 accumulation``: the same with
  ``torch_bridge.accumulate_in_fp32(model.parameters())``: every micro-batch
  gradient is added into an fp32 ``p.main_grad`` (NeMo's recipe), which the
  scaler unscales and the optimizer steps: no step is skipped, and the run
  matches fp32.

Measured (``--quick``, 40 steps): fp32 2.9054; fp16 2.9322 (1.009x) with 2
skipped steps and the scale backed off to 2^16; fp16 with fp32 accumulation
2.9054 (1.000x), 0 skipped, the scale still 2^18.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charlm_data  # noqa: E402
import charlm_torch  # noqa: E402
from charlm_flax import Config  # noqa: E402

import torch_bridge as tb  # noqa: E402

MICRO, PER_MICRO = 8, 2  # 8 micro-batches of 2 sequences: a batch of 16


def run(name: str, steps: int, train, val_batches, init: dict) -> dict:
  cfg = Config()
  dtype = torch.float32 if name == "fp32" else torch.float16
  model = charlm_torch.CharTransformer(cfg)
  model.load_state_dict(init)
  model.to(dtype)
  if name == "fp32":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = tb.dynamic_loss_scale(enabled=False)
  else:
    opt = tb.adam_fp32_master(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = tb.dynamic_loss_scale(init_scale=2.0**18)
  if name == "fp16 + fp32 accumulation":
    tb.accumulate_in_fp32(model.parameters())
  starts = charlm_data.batch_starts(len(train), steps, MICRO * PER_MICRO, cfg.context, seed=0)
  for step in range(steps):
    x, y = charlm_data.windows(train, starts[step], cfg.context)
    for k in range(MICRO):
      part = slice(k * PER_MICRO, (k + 1) * PER_MICRO)
      loss = charlm_torch.loss_fn(model, torch.from_numpy(x[part]),
                                  torch.from_numpy(y[part]).long()) / MICRO
      scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
  with torch.no_grad():
    val = float(np.mean([charlm_torch.loss_fn(model, torch.from_numpy(x),
                                              torch.from_numpy(y).long()).item()
                         for x, y in val_batches]))
  skipped = scaler.state_dict().get("skipped_steps", 0)
  return {"val": val, "skipped": skipped, "scale": scaler.get_scale()}


def main(argv=None) -> dict:
  steps, train, val_batches = charlm_data.example_setup(argv, quick_steps=40, steps=300)
  torch.manual_seed(0)
  init = charlm_torch.CharTransformer(Config()).state_dict()
  results = {name: run(name, steps, train, val_batches, init)
             for name in ("fp32", "fp16", "fp16 + fp32 accumulation")}
  ref = results["fp32"]["val"]
  for name, r in results.items():
    print(f"{name:26s} val loss {r['val']:.4f} ({r['val'] / ref:.3f}x fp32), "
          f"{r['skipped']} skipped steps, final scale {r['scale']:g}")
  return results


if __name__ == "__main__":
  main()
