"""The torch twin of tests/test_training.py (examples/train_mlp_torch.py)."""

import importlib.util
import pathlib

import pytest

pytest.importorskip("torch")

_EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_mlp_torch.py"
REF = "fp32 torch.optim.AdamW (reference)"
NAIVE = "bf16 torch.optim.AdamW (naive)"
OURS = [
    "bf16 adamw_bf16 kahan",
    "bf16 adamw_bf16 split",
    "bf16 adamw_bf16 stochastic",
    "bf16 adam_fp32_master",
    "bf16 master_weights(torch.optim.AdamW)",
    "bf16 kahan_summation(torch.optim.AdamW)",
]
NEAREST = "bf16 adamw_bf16 kahan, nearest moments"


def _load_example():
  spec = importlib.util.spec_from_file_location("train_mlp_torch", _EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def results():
  return _load_example().compare(steps=1500, lr=3e-4, hidden=128,
                                 only=[REF, NAIVE, NEAREST] + OURS)


def test_naive_bf16_is_clearly_worse(results):
  ref, naive = results[REF][0], results[NAIVE][0]
  print(f"fp32 {ref:.4e}  naive bf16 {naive:.4e} ({naive / ref:.3f}x)")
  assert naive >= 1.25 * ref


@pytest.mark.parametrize("name", OURS)
def test_ours_within_3_percent_of_fp32(results, name):
  ref, loss = results[REF][0], results[name][0]
  print(f"{name}: {loss:.4e} ({loss / ref:.4f}x fp32)")
  assert loss <= 1.03 * ref


def test_stochastic_moment_writes_beat_nearest(results):
  stochastic, nearest = results["bf16 adamw_bf16 kahan"][0], results[NEAREST][0]
  print(f"bf16 moments: stochastic {stochastic:.4e}, nearest {nearest:.4e}")
  assert stochastic < nearest


def test_bytes_per_param(results):
  """Optimizer state bytes/param measured from the buffers (bf16 params)."""
  assert results["bf16 adamw_bf16 kahan"][1] == 6.0      # c, mu, nu
  assert results["bf16 adamw_bf16 split"][1] == 6.0      # lo, mu, nu
  assert results["bf16 adamw_bf16 stochastic"][1] == 4.0
  assert results["bf16 adam_fp32_master"][1] == 12.0
  assert results["bf16 kahan_summation(torch.optim.AdamW)"][1] == 10.0  # c + fp32 moments
