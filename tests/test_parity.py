"""torch_bridge.parity: jitted optax_half and torch_bridge agree step by step.

Covers the harness (errors it measures, tolerances, copies it reports, the
CLI, the pytest fixture) and the targets: every optimizer and dtype at a
small size, and 1000-step runs. The two fixes that make the frameworks agree
are tested with the rounding primitives (``no_fma`` in test_rounding.py,
``one_minus_pow`` in test_torch_rounding.py).
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge import parity  # noqa: E402


# -- error measures ------------------------------------------------------------

def test_stats_measure_abs_rel_ulp_and_equal_elements():
  a = np.array([1.0, 2.0, 0.0, -0.0, np.nan, np.inf, 3.0], np.float32)
  b = a.copy()
  b[1] = np.nextafter(np.float32(2.0), np.float32(3.0))  # 1 ULP
  b[2] = -0.0          # same value, other bits: 0 ULP, not bitwise equal
  assert parity._stats(a, a) == (0.0, 0.0, 0.0, 7)
  max_abs, max_rel, max_ulp, n_equal = parity._stats(a, b)
  assert max_ulp == 1 and n_equal == 5
  assert max_abs == pytest.approx(2.0 ** -22) and max_rel == pytest.approx(2.0 ** -22 / 2.0, 0.01)
  b[6] = np.nan
  assert parity._stats(a, b)[2] == np.inf
  bf = jnp.asarray([1.0, 1.0], jnp.bfloat16)
  assert parity._stats(np.asarray(bf), np.asarray(bf.at[1].set(1.0078125)))[2] == 1


# -- every optimizer and dtype, small ------------------------------------------

@pytest.mark.parametrize("config", list(parity.CONFIGS))
@pytest.mark.parametrize("dtype", list(parity.DTYPES))
def test_every_optimizer_and_dtype_is_bitwise(config, dtype):
  report = parity.run_config(config, dtype, steps=40)
  assert report.ok, report.table()
  # Stricter than the tolerances: no FMA and no pow leave nothing to differ.
  for buffer in report.buffers:
    worst = report.worst(buffer)
    assert worst["max_ulp"] == 0 and worst["equal"] == 1.0, (buffer, report.table())
  expected = {"params", "mu", "nu", "count"}
  name, hyper, loss_scale = parity.CONFIGS[config]
  if dtype != "fp32":
    expected |= {"adam_fp32_master": {"master"}, "scale_by_adamw": set()}.get(name, set())
    expected |= {"kahan": {"compensation"}, "split": {"master"}}.get(
        hyper.get("compensation", "kahan") if name == "adamw_bf16" else None, set())
  if loss_scale is not None:
    expected |= {"loss_scale", "growth_tracker", "skipped_steps"}
  assert expected <= set(report.buffers), (expected, set(report.buffers))
  assert not report.copies


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_fused_torch_step_is_bitwise_too(compensation):
  report = parity.compare("adamw_bf16", parity.default_params(1), steps=30, dtype="bf16",
                          compensation=compensation, weight_decay=0.1,
                          torch_options={"fused": True})
  assert report.ok and all(report.worst(b)["equal"] == 1.0 for b in report.buffers), \
      report.table()


def test_loss_scale_run_skips_steps_on_both_sides():
  report = parity.run_config("adamw_bf16+loss_scale", "fp16", steps=200)
  assert report.ok, report.table()
  # Random grads x scale overflow fp16 once the scale has grown, plus a NaN
  # every 97 steps: the counters moved, and agreed at every step.
  c = report.counters
  assert c["skipped_steps"] >= 2 and c["count"] == 200 - c["skipped_steps"]
  assert c["loss_scale"] != 2.0 ** 10
  assert report.errors["skipped_steps"].shape == (200, 1, 4)
  assert report.worst("skipped_steps")["equal"] == 1.0


# -- the targets at 1000 steps ----------------------------------------------

@pytest.mark.parametrize("config, dtype", [
    ("adam_fp32_master", "bf16"), ("adam_fp32_master", "fp32"), ("adamw_bf16/fp32-moments", "bf16"),
    ("adamw_bf16", "bf16"), ("adamw_bf16/none", "bf16"), ("adamw_bf16/stochastic", "bf16"),
    ("adamw_bf16", "fp16")])
def test_targets_after_1000_steps(config, dtype):
  name, hyper, _ = parity.CONFIGS[config]
  report = parity.compare(name, parity.default_params(3), steps=1000, dtype=dtype, seed=3,
                          record_every=100, **hyper)
  assert report.ok, report.table()
  for buffer, (kind, _) in report.buffers.items():
    worst = report.worst(buffer)
    if kind == "fp32":
      assert worst["max_rel"] <= 1e-6
      series = report.series(buffer, "max_rel")
      assert series[-1] <= max(series[0], 1e-6)  # no drift
    elif kind == "16bit":
      assert worst["max_ulp"] <= 1 and worst["equal"] >= 0.999
    elif kind == "exact":
      assert worst["max_ulp"] == 0


# -- the harness itself ---------------------------------------------------------

def test_a_real_difference_fails(monkeypatch):
  make = parity._torch_optimizer

  def other_lr(name, params, hyperparams, loss_scale, torch_options=None):
    return make(name, params, {**hyperparams, "learning_rate": 1.01e-3}, loss_scale)

  monkeypatch.setattr(parity, "_torch_optimizer", other_lr)
  report = parity.compare("adamw_bf16", parity.default_params(), steps=30, dtype="bf16",
                          learning_rate=1e-3)
  assert not report.ok
  assert any(f.startswith("params (bfloat16, 16bit)") for f in report.failures())
  assert "FAIL" in report.table() and report.summary()["verdict"] == "FAIL"
  # Looser tolerances (the one override point) accept it.
  loose = parity.Tolerance(max_ulp=1e9, min_equal=0.0, max_rel=2.0)  # rel <= 2 always
  report = parity.compare("adamw_bf16", parity.default_params(), steps=5, dtype="bf16",
                          learning_rate=1e-3, tolerances={"16bit": loose, "fp32": loose})
  assert report.ok


def test_grads_as_sequence_or_callable_and_torch_params_with_copies():
  rng = np.random.default_rng(5)
  # A strided slice: JAX imports only compact buffers, so it is copied and reported.
  params = {"w": torch.randn(4, 12)[:, ::2], "b": torch.randn(4), "steps": torch.tensor(3)}
  grads = [{"w": rng.standard_normal((4, 6)).astype(np.float32),
            "b": rng.standard_normal(4).astype(np.float32), "steps": None} for _ in range(20)]
  seq = parity.compare("adam_fp32_master", params, grads, steps=20, dtype="bf16")
  assert seq.ok and any("['w']" in c for c in seq.copies), seq.copies
  assert seq.leaves["params"] == ["['b']", "['w']"]  # the integer leaf is ignored
  calls = []

  def from_model(step, p):
    calls.append(step)
    assert p["w"].dtype == jnp.bfloat16
    return grads[step]

  fn = parity.compare("adam_fp32_master", params, from_model, steps=20, dtype="bf16")
  assert calls == list(range(20))
  assert np.array_equal(fn.errors["params"], seq.errors["params"])


@pytest.mark.parametrize("call, message", [
    (lambda: parity.compare("adam", {"w": jnp.ones(3)}), "compare\\(\\) knows"),
    (lambda: parity.compare("adamw_bf16", {"w": jnp.ones(3)}, steps=0), "steps"),
    (lambda: parity.compare("adamw_bf16", {"n": jnp.ones(3, jnp.int32)}), "float leaf"),
    (lambda: parity.compare("adamw_bf16", {"w": jnp.ones(3)}, key=jax.random.key(0)),
     "integer key"),
    (lambda: parity.compare("adamw_bf16", {"w": jnp.ones(3)}, [{"w": jnp.ones(3)}], steps=2),
     "1 trees for 2 steps"),
    (lambda: parity.compare("adamw_bf16", {"w": jnp.ones(3)}, lambda t, p: {"w": jnp.ones(4)}),
     "gradient \\['w'\\] has shape"),
])
def test_bad_calls_say_what_is_wrong(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_cli_table_json_and_exit_status(tmp_path, capsys, monkeypatch):
  out = tmp_path / "parity.json"
  code = parity.main(["--optimizer", "adamw_bf16/split", "--dtype", "bf16", "--steps", "15",
                      "--json", str(out)])
  printed = capsys.readouterr().out
  assert code == 0 and "adamw_bf16/split" in printed and "1/1 within tolerance" in printed
  [row] = json.loads(out.read_text())
  assert row["verdict"] == "ok" and row["param_max_ulp"] == 0 and row["param_equal"] == 1.0
  assert len(row["buffers"]["master"]["max_ulp_per_step"]) == 15
  with pytest.raises(SystemExit):
    parity.main(["--optimizer", "nope"])
  make = parity._torch_optimizer
  monkeypatch.setattr(parity, "_torch_optimizer", lambda n, p, h, ls, o=None: make(
      n, p, {**h, "weight_decay": 0.2}, ls))
  assert parity.main(["--optimizer", "adamw_bf16", "--dtype", "fp32", "--steps", "5"]) == 1
  assert "FAIL" in capsys.readouterr().out


def test_cli_runs_as_a_module():
  done = subprocess.run([sys.executable, "-m", "torch_bridge.parity", "--optimizer",
                         "adam_fp32_master", "--dtype", "fp16", "--steps", "5"],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "1/1 within tolerance" in done.stdout


def test_pytest_fixture_on_a_mixed_tree(parity):
  tree = {"embed": jnp.ones((5, 3), jnp.bfloat16) * 0.5, "norm": jnp.ones(3, jnp.float32),
          "head": {"w": jnp.full((3, 2), 0.25, jnp.float16), "step": jnp.int32(0)}}
  report = parity("adamw_bf16", tree, steps=25, weight_decay=0.1)
  assert report.dtype == "mixed" and report.summary()["param_equal"] == 1.0


@pytest.mark.parametrize("grads_from", ["jax", "torch"])
def test_example_flax_torch_pair(grads_from, capsys):
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "parity.py"
  spec = importlib.util.spec_from_file_location("parity_example", path)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  assert example.main(["--quick", "--grads-from", grads_from]) == 0
  out = capsys.readouterr().out
  forward = float(out.split("max |flax - torch| = ")[1].split()[0])
  assert forward < 1e-5  # the same weights: the two models compute the same function
  assert "60 steps: ok" in out and "100.0000%" in out
  first, last = (float(v) for v in out.split("batch loss ")[1].split()[::2][:2])
  assert last < 0.5 * first  # it trains
