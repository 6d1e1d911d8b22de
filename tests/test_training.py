"""A small training run: naive bf16 stalls, ours match fp32 (examples/train_mlp.py)."""

import importlib.util
import pathlib

import pytest

_EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_mlp.py"


def _load_example():
  spec = importlib.util.spec_from_file_location("train_mlp", _EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def results():
  return _load_example().compare(steps=1500, lr=3e-4, hidden=128)


def test_naive_bf16_is_clearly_worse(results):
  ref = results["fp32 optax.adamw (reference)"][0]
  naive = results["bf16 optax.adamw (naive)"][0]
  print(f"fp32 {ref:.4e}  naive bf16 {naive:.4e} ({naive / ref:.3f}x)")
  assert naive >= 1.25 * ref


@pytest.mark.parametrize("name", [
    "bf16 adamw_bf16 kahan",
    "bf16 adamw_bf16 split",
    "bf16 adamw_bf16 stochastic",
    "bf16 adamw_bf16 kahan, fp32 moments",
    "bf16 adam_fp32_master",
])
def test_ours_within_3_percent_of_fp32(results, name):
  ref = results["fp32 optax.adamw (reference)"][0]
  loss = results[name][0]
  print(f"{name}: {loss:.4e} ({loss / ref:.4f}x fp32)")
  assert loss <= 1.03 * ref


def test_stochastic_moment_writes_beat_nearest(results):
  stochastic = results["bf16 adamw_bf16 kahan"][0]
  nearest = results["bf16 adamw_bf16 kahan, nearest moments"][0]
  print(f"bf16 moments: stochastic {stochastic:.4e}, nearest {nearest:.4e}")
  assert stochastic < nearest
