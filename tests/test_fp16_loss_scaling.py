"""examples/fp16_loss_scaling.py: fp16 gradients underflow without loss
scaling (the hidden layer's gradients are all 0 and the loss stalls) and with
dynamic loss scaling the run matches fp32, in both frameworks."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import fp16_loss_scaling as example  # noqa: E402

STEPS = 800


def _check(results):
  ref = results["fp32"]["val_loss"]
  naive, scaled = results["fp16, no scaling"], results["fp16 + dynamic_loss_scale"]
  assert results["fp32"]["w1_grads_zero"] == 0.0
  assert naive["w1_grads_zero"] > 0.95          # the gradients underflow
  assert naive["val_loss"] / ref > 1.5          # and training stalls
  assert scaled["w1_grads_zero"] == 0.0
  assert abs(scaled["val_loss"] / ref - 1) < 0.05
  assert scaled["scale"] > 2.0**16              # it grew (growth_interval 100)


@pytest.mark.slow  # a training run (800 steps)
def test_jax():
  _check(example.run_jax(STEPS))


@pytest.mark.slow  # a training run (800 steps)
def test_torch():
  pytest.importorskip("torch")
  _check(example.run_torch(STEPS))
