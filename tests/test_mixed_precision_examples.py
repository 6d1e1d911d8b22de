"""The mixed-precision examples: a JAX run with each standard policy, and
fp16 gradient accumulation in torch with and without fp32 ``main_grad``."""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("flax")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # three short training runs
def test_jax_policies_pure_bf16_and_amp_match_fp32():
  out = _load("mixed_precision").main(["--steps", "40"])
  ref = out["fp32"]["val"]
  assert out["pure bf16"]["param_dtypes"] == ["bfloat16", "float32"]  # layer norms stay fp32
  assert out["amp"]["param_dtypes"] == ["float32"] and out["amp"]["policy"] == "p=f32,c=f16,o=f32"
  for name in ("pure bf16", "amp"):
    assert abs(out[name]["val"] / ref - 1) < 0.01, out  # measured: 1.000 and 1.000 at 80 steps


@pytest.mark.slow  # three short training runs of 8 micro-batches a step
def test_torch_fp16_accumulation_overflows_without_fp32_main_grad():
  out = _load("torch_fp16_accumulation").main(["--steps", "20"])
  ref = out["fp32"]["val"]
  assert out["fp16"]["skipped"] >= 1 and out["fp16"]["scale"] < 2.0**18  # the fp16 sum overflowed
  fixed = out["fp16 + fp32 accumulation"]
  assert fixed["skipped"] == 0 and fixed["scale"] == 2.0**18
  assert abs(fixed["val"] / ref - 1) < 0.002, out  # measured 1.000 at 40 steps
