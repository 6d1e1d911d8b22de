"""torch_bridge.parity: jitted optax_half and torch_bridge agree step by step.

Covers the harness (errors it measures, tolerances, copies it reports, the
CLI, the pytest fixture) and the targets: every optimizer and dtype at a
small size, and 1000-step runs (marked ``slow``: ``make test-slow``). The two
fixes that make the frameworks agree are tested with the rounding primitives
(``no_fma`` in test_rounding.py, ``one_minus_pow`` in test_torch_rounding.py).
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from suite_helpers import default_or_slow  # noqa: E402
from torch_bridge import parity  # noqa: E402


# -- error measures ------------------------------------------------------------

def test_stats_measure_abs_rel_ulp_and_equal_elements():
  a = np.array([1.0, 2.0, 0.0, -0.0, np.nan, np.inf, 3.0], np.float32)
  b = a.copy()
  b[1] = np.nextafter(np.float32(2.0), np.float32(3.0))  # 1 ULP
  b[2] = -0.0          # same value, other bits: 0 ULP, not bitwise equal
  assert parity._stats(a, a) == (0.0, 0.0, 0.0, 7, 0.0)
  max_abs, max_rel, max_ulp, n_equal, tensor_rel = parity._stats(a, b)
  assert tensor_rel == pytest.approx(2.0 ** -22 / 3.0, 0.01)  # of the largest finite element
  assert max_ulp == 1 and n_equal == 5
  assert max_abs == pytest.approx(2.0 ** -22) and max_rel == pytest.approx(2.0 ** -22 / 2.0, 0.01)
  b[6] = np.nan
  assert parity._stats(a, b)[2] == np.inf
  bf = jnp.asarray([1.0, 1.0], jnp.bfloat16)
  assert parity._stats(np.asarray(bf), np.asarray(bf.at[1].set(1.0078125)))[2] == 1


# -- every optimizer and dtype, small ------------------------------------------

# fp16 adamw_bf16+loss_scale runs for 200 steps below: the same run, longer
# (the same seed, so its first 40 steps are these), checked the same way.
LOSS_SCALE_RUN = ("adamw_bf16+loss_scale", "fp16")
SMALL_RUNS = [(config, dtype) for dtype in parity.DTYPES for config in parity.BITWISE
              if (config, dtype) != LOSS_SCALE_RUN]
PER_TENSOR_RUNS = [(config, dtype) for dtype in parity.DTYPES for config in parity.CONFIGS
                   if config not in parity.BITWISE]
# make test runs each configuration once; the other dtypes are slow.
PER_TENSOR_DEFAULT = [("scaled_adam", "fp32"), ("scaled_adam/clip", "bf16"),
                      ("kahan_summation(scaled_adam)/clip", "bf16"),
                      ("master_weights(scaled_adam)/clip", "fp16"), ("master_weights(adam)", "bf16"),
                      ("kahan_summation(sgd)", "fp32")]


# make test runs every configuration on bf16 and the kernel's fp16 and fp32
# entries (adam_fp32_master, adamw_bf16, with loss scaling); every pair in
# make test-slow.
SMALL_DEFAULT = [(c, d) for c, d in SMALL_RUNS if d == "bf16" or c in (
    "adam_fp32_master+loss_scale", "adamw_bf16", "adamw_bf16+loss_scale")]


@pytest.mark.parametrize("config, dtype", [
    pytest.param(*p.values, id=f"{p.values[1]}-{p.values[0]}", marks=p.marks)
    for p in default_or_slow(SMALL_RUNS, SMALL_DEFAULT)])
def test_every_optimizer_and_dtype_is_bitwise(config, dtype):
  _assert_bitwise(parity.run_config(config, dtype, steps=40), config, dtype)


def _assert_bitwise(report, config, dtype):
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
  report = parity.run_config(*LOSS_SCALE_RUN, steps=200)
  _assert_bitwise(report, *LOSS_SCALE_RUN)  # every buffer at every step, as above
  # Random grads x scale overflow fp16 once the scale has grown, plus a NaN
  # every 97 steps: the counters moved, and agreed at every step.
  c = report.counters
  assert c["skipped_steps"] >= 2 and c["count"] == 200 - c["skipped_steps"]
  assert c["loss_scale"] != 2.0 ** 10
  assert report.errors["skipped_steps"].shape == (200, 1, 5)
  assert report.worst("skipped_steps")["equal"] == 1.0


# -- ScaledAdam and wrappers of stock optimizers: per-tensor bounds ----------------

_PER_TENSOR_BUFFERS = {
    "scaled_adam": {"delta", "exp_avg_sq", "param_rms", "scale_exp_avg_sq", "scale_grads",
                    "count"},
    "adam": {"mu", "nu", "count"}, "sgd": {"trace"}}


@pytest.mark.parametrize("config, dtype", default_or_slow(PER_TENSOR_RUNS, PER_TENSOR_DEFAULT))
def test_scaled_adam_and_wrapped_stock_optimizers_within_per_tensor_bounds(config, dtype):
  """ScaledAdam (its reductions are summed in other orders) and the wrappers
  around optax's and torch.optim's own Adam and SGD (their elementwise
  operations are ordered differently) are held to the per-tensor kinds;
  every buffer both sides keep is compared, with the wrapper's own."""
  report = parity.run_config(config, dtype, steps=50)
  assert report.ok, report.table()
  name, hyper, _ = parity.CONFIGS[config]
  wrapper, inner = parity._parts(name)
  expected = {"params"} | _PER_TENSOR_BUFFERS[inner]
  if dtype != "fp32":
    expected |= {"master_weights": {"master"}, "kahan_summation": {"compensation"}}.get(
        wrapper, set())
  assert expected <= set(report.buffers), (expected, set(report.buffers))
  kinds = {kind for kind, _ in report.buffers.values()}
  assert kinds <= {"per-tensor", "per-tensor 16bit", "exact", "residual"}, kinds
  # Not bitwise in fp32 (a real bound): ScaledAdam's one-element leaves, XLA's and torch's ops.
  assert min(report.worst(b)["equal"] for b in report.buffers) < 1.0 or dtype != "fp32"
  if hyper.get("clipping_scale"):  # the statistics side by side, and clipping happened
    c = report.clipping
    assert c["steps"] == 50 and c["num_clipped_equal"] == c["dominant_parameter_equal"] == 50
    assert c["clipped_steps"] >= 1  # the 10x gradients of step 45 (23 is before the threshold)
    assert "clipping, 50 recorded steps" in report.table()
  else:
    assert report.clipping is None


def test_per_tensor_bound_catches_a_real_difference(monkeypatch):
  make = parity._torch_optimizer

  def other_lr(name, params, hyperparams, loss_scale, torch_options=None):
    return make(name, params, {**hyperparams, "learning_rate": 1.001e-3}, loss_scale)

  monkeypatch.setattr(parity, "_torch_optimizer", other_lr)
  report = parity.run_config("scaled_adam/clip", "fp32", steps=30)
  assert not report.ok
  assert any(", per-tensor): tensor_rel" in f for f in report.failures()), report.failures()


# -- the targets at 1000 steps ----------------------------------------------
# Long runs (make test-slow): the small runs above already require the same bits
# at every step; these show that nothing drifts in 1000.

@pytest.mark.slow
@pytest.mark.parametrize("config, dtype", [
    ("adam_fp32_master", "bf16"), ("adam_fp32_master", "fp32"), ("adamw_bf16/fp32-moments", "bf16"),
    ("adamw_bf16", "bf16"), ("adamw_bf16/none", "bf16"), ("adamw_bf16/stochastic", "bf16"),
    ("adamw_bf16", "fp16")])
def test_targets_after_1000_steps(config, dtype):
  name, hyper, _ = parity.CONFIGS[config]
  report = parity.compare(name, parity.default_params(3), steps=1000, dtype=dtype, seed=3,
                          record_every=100, **hyper)
  assert report.ok, report.table()
  # The tolerances are the targets; what we measure is stricter: the
  # same bits in every buffer at every recorded step, hence no drift.
  for buffer in report.buffers:
    assert report.worst(buffer)["equal"] == 1.0, report.table()
    assert not report.series(buffer, "max_ulp").any()

@pytest.mark.slow
@pytest.mark.parametrize("config, dtype", [
    ("scaled_adam/clip", "fp32"), ("scaled_adam/clip", "bf16"),
    ("kahan_summation(scaled_adam)/clip", "bf16"), ("master_weights(scaled_adam)/clip", "fp16"),
    ("master_weights(adam)", "bf16"), ("kahan_summation(sgd)", "bf16")])
def test_per_tensor_configs_after_1000_steps(config, dtype):
  report = parity.run_config(config, dtype, steps=1000)
  assert report.ok, report.table()


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
  gen = torch.Generator().manual_seed(5)
  # A strided slice: JAX imports only compact buffers, so it is copied and reported.
  params = {"w": torch.randn(4, 12, generator=gen)[:, ::2], "b": torch.randn(4, generator=gen),
            "steps": torch.tensor(3)}
  grads = [{"w": rng.standard_normal((4, 6)).astype(np.float32),
            "b": rng.standard_normal(4).astype(np.float32), "steps": None} for _ in range(20)]
  seq = parity.compare("adam_fp32_master", params, grads, steps=20, dtype="bf16")
  assert seq.ok and any("['w']" in c for c in seq.copies), seq.copies
  assert seq.leaves["params"] == ["['b']", "['w']"]  # the integer leaf is ignored
  # The callable sees the JAX params before each step: they must be those of
  # an independent run fed the same gradients in the same order, stepped in place as the
  # harness steps (a master's params land on its rounding; through tx.update +
  # apply_updates a landing that misses differs there until the next step).
  import optax_half as oh
  seen = []

  def from_model(step, p):
    seen.append(p)
    return grads[step]

  fn = parity.compare("adam_fp32_master", params, from_model, steps=20, dtype="bf16")
  assert fn.ok and len(seen) == 20
  tx = oh.adam_fp32_master(1e-3)
  p = {"w": jnp.asarray(params["w"].numpy(), jnp.bfloat16),
       "b": jnp.asarray(params["b"].numpy(), jnp.bfloat16), "steps": jnp.int32(3)}
  s = tx.init(p)
  for t in range(20):
    for k in ("w", "b"):
      assert np.array_equal(np.asarray(seen[t][k]), np.asarray(p[k])), (t, k)
    assert int(seen[t]["steps"]) == 3  # the integer leaf is left alone
    g = {k: jnp.asarray(grads[t][k], jnp.bfloat16) for k in ("w", "b")}
    g["steps"] = jnp.int32(0)
    p, s = oh.update_and_apply(tx, g, s, p)


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


@pytest.mark.slow  # a fresh process: torch and JAX imported again
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


def test_loss_scale_true_turns_the_scaler_on():
  report = parity.compare("adamw_bf16", parity.default_params(), steps=5, dtype="fp16",
                          loss_scale=True)
  assert report.loss_scale == {} and report.counters["loss_scale"] == 2.0 ** 16
  assert {"loss_scale", "growth_tracker", "skipped_steps"} <= set(report.buffers)


def test_mixed_dtypes_get_their_own_tolerance(monkeypatch):
  tree = {"a": jnp.ones((8, 8), jnp.bfloat16), "b": jnp.ones(8, jnp.float32)}
  report = parity.compare("adamw_bf16", tree, steps=3)
  assert report.buffers["params[bfloat16]"] == ("16bit", "bfloat16")
  assert report.buffers["params[float32]"] == ("fp32", "float32")
  assert report.worst("params")["equal"] == 1.0 and report.summary()["param_equal"] == 1.0
  make = parity._torch_optimizer
  monkeypatch.setattr(parity, "_torch_optimizer", lambda n, p, h, ls, o=None: make(
      n, p, {**h, "learning_rate": 1.5e-3}, ls))
  failures = parity.compare("adamw_bf16", tree, steps=3).failures()
  assert any(f.startswith("params[float32] (float32, fp32): max_rel") for f in failures)
  assert any(f.startswith("params[bfloat16] (bfloat16, 16bit)") for f in failures)


def test_fp16_split_compares_the_fp32_master_itself(monkeypatch):
  """fp16 params keep a full fp32 master under "split": it must be compared as is."""
  make = parity._torch_optimizer

  def nudged(name, params, hyperparams, loss_scale, torch_options=None):
    optimizer, scaler = make(name, params, hyperparams, loss_scale)
    step = optimizer.step

    def step_then_nudge(*a, **k):
      out = step(*a, **k)
      for p in params:
        optimizer.state[p]["master"].mul_(1 + 1e-4)
      return out
    optimizer.step = step_then_nudge
    return optimizer, scaler

  monkeypatch.setattr(parity, "_torch_optimizer", nudged)
  report = parity.compare("adamw_bf16", parity.default_params(), steps=2, dtype="fp16",
                          compensation="split")
  assert report.buffers["master"] == ("fp32", "float32")
  assert report.worst("master")["max_rel"] > 5e-5 and not report.ok


def test_stats_edge_cases():
  import ml_dtypes
  f8 = np.array([1.0, 0.5], ml_dtypes.float8_e4m3fn)
  g8 = np.array([1.125, 0.5], ml_dtypes.float8_e4m3fn)
  assert parity._stats(f8, g8)[2:4] == (1.0, 1)  # a float, 1 ULP apart, 1 equal
  tiny = np.array([0.0], np.float32)
  sub = np.array([1e-45], np.float32)
  assert parity._stats(tiny, sub)[1] < 1e-6  # an ULP among subnormals is no relative error 1
  assert parity._stats(np.array([5], np.int32), np.array([7], np.int32)) == (
      2.0, 2 / 7, 2.0, 0, 2 / 7)


def test_torch_integer_leaves_are_ignored_without_copies():
  bn = torch.nn.BatchNorm1d(3).state_dict()  # has an int64 num_batches_tracked
  report = parity.compare("scale_by_adamw", bn, steps=3)
  assert report.ok and not report.copies
  assert report.leaves["params"] == ["['weight']", "['bias']", "['running_mean']",
                                     "['running_var']"]  # an OrderedDict keeps its order


def test_json_is_strict_with_dtype_hyperparameters_and_infinities(tmp_path):
  report = parity.compare("adamw_bf16", parity.default_params(), steps=3, dtype="bf16",
                          mu_dtype=torch.float32, nu_dtype=jnp.float32)
  assert report.buffers["mu"] == ("fp32", "float32") and report.ok
  report.errors["params"][0, 0, 2] = np.inf  # as if one side were inf
  text = json.dumps(report.to_dict(), allow_nan=False)
  assert '"inf"' in text and "float32" in text


def test_fixture_fails_the_test_with_the_table(parity, monkeypatch):
  from torch_bridge import parity as parity_module
  make = parity_module._torch_optimizer
  monkeypatch.setattr(parity_module, "_torch_optimizer", lambda n, p, h, ls, o=None: make(
      n, p, {**h, "weight_decay": 0.5}, ls))
  with pytest.raises(pytest.fail.Exception, match="JAX/torch parity broken"):
    parity("adamw_bf16", {"w": jnp.ones((4, 4), jnp.bfloat16)}, steps=5, weight_decay=0.1)


@pytest.mark.parametrize("config", list(parity.CONFIGS))
def test_compare_takes_the_command_lines_configuration_names(config):
  params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}
  report = parity.compare(config, params, steps=3, dtype="bf16")
  base, hyperparams, loss_scale = parity.CONFIGS[config]
  assert report.ok, report.summary()
  if config == base:  # a bare optimizer name: its own defaults, not the CLI's keywords
    assert report.name == base and "weight_decay" not in report.hyperparams
    return
  assert report.name == config
  assert report.hyperparams.items() >= {k: v for k, v in hyperparams.items()}.items()
  assert (report.loss_scale is not None) == (loss_scale is not None)
  explicit = parity.compare(base, params, steps=3, dtype="bf16", loss_scale=loss_scale,
                            **hyperparams)
  assert explicit.summary()["param_max_ulp"] == report.summary()["param_max_ulp"]
