"""A small training run: naive bf16 stalls, ours match fp32 (examples/train_mlp.py).

Run once per session however many xdist workers share the tests (a run's
time is its compile). The runs are the ones only this test has: ``split``
compensation, fp32 moments, and stochastic against round-to-nearest moment
writes (1500 steps: nearest falls behind late, 0.998x fp32 at 300 steps,
1.033x at 1500); the fp32 and naive runs are the yardsticks. Stochastic
compensation and ``adam_fp32_master`` are asserted on the main job
(tests/test_demo.py: within 1% of fp32 in both frameworks) and are not run
again here.
"""

import importlib.util
import pathlib

import pytest

from suite_helpers import once

# 1500 steps of five runs (about 20 s of a worker): a long run, in make test-slow.
pytestmark = pytest.mark.slow

_EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_mlp.py"
REF = "fp32 optax.adamw (reference)"
NAIVE = "bf16 optax.adamw (naive)"
OURS = [
    "bf16 adamw_bf16 kahan",
    "bf16 adamw_bf16 split",
    "bf16 adamw_bf16 kahan, fp32 moments",
]
NEAREST = "bf16 adamw_bf16 kahan, nearest moments"


def _load_example():
  spec = importlib.util.spec_from_file_location("train_mlp", _EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return once(tmp_path_factory, "train_mlp", lambda _: _load_example().compare(
      steps=1500, lr=3e-4, hidden=128, only=[REF, NAIVE, NEAREST] + OURS))


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
