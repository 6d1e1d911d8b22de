"""NaN/Inf gradients: what every optimizer does with them, in both frameworks.

* ``skip_nonfinite=True`` (adamw_bf16, adam_fp32_master, scaled_adam): a step
  whose gradients hold a NaN or Inf changes nothing, step counts included, and
  is counted; the run then equals one that never saw that step, bit for bit.
* Without it (the default) the poison spreads as
  docs/algorithms.md#non-finite-gradients says: the elementwise AdamW family
  loses exactly the element whose gradient was bad; ScaledAdam loses that
  element at once, its whole tensor at the next size update, and every param
  once clipping starts.
* With a loss scaler the step is skipped and counted whatever the optimizer.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half._util import maybe_skip_nonfinite
from suite_helpers import default_or_slow

torch = pytest.importorskip("torch")
import torch_bridge as tb  # noqa: E402

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
NAMES = list(SHAPES)  # torch param order = JAX flatten order of the dict (sorted keys)
NAMES.sort()


def _values(seed):
  rng = np.random.default_rng(seed)
  return {k: np.asarray(rng.standard_normal(s) * 0.5, np.float32) for k, s in SHAPES.items()}


def _grads(step, bad=None):
  g = _values(100 + step)
  if bad is not None:
    g["w"] = g["w"].copy()
    g["w"][0, 0] = bad
  return g


# name -> (JAX factory, torch factory taking a param list); lr etc. shared.
# JAX's adamw_bf16 takes torch's weight decay here (its default is optax.adamw's 1e-4).
OPTIMIZERS = {
    "adamw_bf16 kahan": (lambda **kw: oh.adamw_bf16(1e-3, weight_decay=1e-2, **kw),
                         lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, **kw)),
    "adamw_bf16 split": (lambda **kw: oh.adamw_bf16(1e-3, weight_decay=1e-2,
                                                    compensation="split", **kw),
                         lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, compensation="split", **kw)),
    "adamw_bf16 stochastic": (
        lambda **kw: oh.adamw_bf16(1e-3, weight_decay=1e-2, compensation="stochastic", key=3,
                                    **kw),
        lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, compensation="stochastic", key=3, **kw)),
    "adamw_bf16 none": (lambda **kw: oh.adamw_bf16(1e-3, weight_decay=1e-2,
                                                   compensation="none", **kw),
                        lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, compensation="none", **kw)),
    "adam_fp32_master": (lambda **kw: oh.adam_fp32_master(1e-3, weight_decay=0.1, **kw),
                         lambda ps, **kw: tb.adam_fp32_master(ps, 1e-3, weight_decay=0.1, **kw)),
    "scaled_adam": (lambda **kw: oh.scaled_adam(0.03, **kw),
                    lambda ps, **kw: tb.scaled_adam(ps, 0.03, **kw)),
    "scaled_adam clipping": (
        lambda **kw: oh.scaled_adam(0.03, clipping_scale=2.0, clipping_update_period=4, **kw),
        lambda ps, **kw: tb.scaled_adam(ps, 0.03, clipping_scale=2.0,
                                        clipping_update_period=4, **kw)),
}


def _bits(x):
  x = np.atleast_1d(np.asarray(x))
  return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint8)


def _jax_run(name, grads, history=None, **kw):
  """Params (bf16) and state after feeding ``grads``, jitted; ``history`` (a
  list) receives the params after every step."""
  tx = OPTIMIZERS[name][0](**kw)
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _values(0).items()}
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for g in grads:
    params, state = step(params, state, {k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()})
    if history is not None:
      history.append(params)
  return params, state


def _torch_run(name, grads, history=None, **kw):
  params = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16)) for k in NAMES]
  opt = OPTIMIZERS[name][1](params, **kw)
  for g in grads:
    for p, k in zip(params, NAMES):
      p.grad = torch.from_numpy(g[k]).to(torch.bfloat16)
    opt.step()
    if history is not None:
      history.append([p.detach().clone() for p in params])
  return params, opt


def _nonfinite_count(x) -> int:
  return int(np.sum(~np.isfinite(np.asarray(x, np.float32))))


@pytest.mark.parametrize("name", default_or_slow(list(OPTIMIZERS), [
    "adamw_bf16 kahan", "adamw_bf16 stochastic", "adam_fp32_master", "scaled_adam clipping"]))
def test_skip_nonfinite_equals_a_run_without_those_steps(name):
  good = [_grads(i) for i in range(5)]
  bad = [_grads(9, np.nan), _grads(10, np.inf), _grads(11, -np.inf)]
  # A NaN step inside the run, then two bad steps in a row at its end.
  with_bad = good[:2] + bad[:1] + good[2:] + bad[1:]
  # JAX: the skipped steps change nothing; later steps equal the clean run bitwise.
  clean_p, clean_s = _jax_run(name, good, skip_nonfinite=True)
  p, s = _jax_run(name, with_bad, skip_nonfinite=True)
  for a, b in zip(jax.tree.leaves((clean_p, clean_s.inner_state)),
                  jax.tree.leaves((p, s.inner_state))):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert int(clean_s.total_notfinite) == 0
  assert (int(s.notfinite_count), bool(s.last_finite), int(s.total_notfinite)) == (2, False, 3)
  # torch: the same, and the same bits as JAX for the elementwise optimizers.
  clean_tp, clean_opt = _torch_run(name, good, skip_nonfinite=True)
  tp, opt = _torch_run(name, with_bad, skip_nonfinite=True)
  for a, b in zip(clean_tp, tp):
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
  assert opt.nonfinite == {"notfinite_count": 2, "last_finite": False, "total_notfinite": 3}
  assert clean_opt.nonfinite["total_notfinite"] == 0
  for a, b in zip(clean_opt.state.values(), opt.state.values()):
    for k in a:
      assert torch.equal(a[k], b[k]), k
  if not name.startswith("scaled_adam"):  # ScaledAdam matches within ULPs (test_parity)
    for t, k in zip(tp, NAMES):
      np.testing.assert_array_equal(
          _bits(p[k]), t.detach().view(torch.int16).numpy().view(np.uint16))
  # The counters are saved and loaded with the optimizer.
  params = [torch.nn.Parameter(torch.zeros(SHAPES[k], dtype=torch.bfloat16)) for k in NAMES]
  fresh = OPTIMIZERS[name][1](params, skip_nonfinite=True)
  fresh.load_state_dict(opt.state_dict())
  assert fresh.nonfinite == opt.nonfinite


# Without skip_nonfinite: which params are poisoned after a bad gradient
# element in w[0, 0] at step 1 (0-based), per step, as documented.
def _expected_poisoned(name, step):
  if step < 1:
    return {"b": 0, "s": 0, "w": 0}
  if not name.startswith("scaled_adam"):
    return {"b": 0, "s": 0, "w": 1}  # only the element itself
  if step < 3:  # ScaledAdam: the element, until the size update at step S - 1 = 3
    return {"b": 0, "s": 0, "w": 1}
  if name == "scaled_adam clipping" and step >= 4:  # clipping from step P = 4 on
    return {"b": 3, "s": 1, "w": 12}
  return {"b": 0, "s": 0, "w": 12}  # the whole tensor from the size update on


@pytest.mark.parametrize("name,bad", [(n, np.nan) for n in OPTIMIZERS] + [
    ("adamw_bf16 kahan", np.inf), ("scaled_adam clipping", np.inf)])
def test_without_skip_the_poison_spreads_as_documented(name, bad):
  grads = [_grads(i, bad if i == 1 else None) for i in range(6)]
  jax_history, torch_history = [], []
  p, _ = _jax_run(name, grads, jax_history)
  _torch_run(name, grads, torch_history)
  for step, (jp, tp) in enumerate(zip(jax_history, torch_history)):
    expected = _expected_poisoned(name, step)
    assert {k: _nonfinite_count(v) for k, v in jp.items()} == expected, step
    got = {k: _nonfinite_count(t.float().numpy()) for t, k in zip(tp, NAMES)}
    assert got == expected, step
  # The element-wise family: the other elements equal a run whose bad element was 0.
  if not name.startswith("scaled_adam"):
    zeroed = [_grads(i, 0.0 if i == 1 else None) for i in range(6)]
    p_ref, _ = _jax_run(name, zeroed)
    w, w_ref = np.asarray(p["w"], np.float32), np.asarray(p_ref["w"], np.float32)
    np.testing.assert_array_equal(w.ravel()[1:], w_ref.ravel()[1:])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_loss_scaler_skips_and_counts_for_every_optimizer(name):
  """With a loss scaler nothing changes on a non-finite step and the skip is counted."""
  tx = oh.dynamic_loss_scale(OPTIMIZERS[name][0](), init_scale=2.0**4)
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _values(0).items()}
  state = tx.init(params)
  g = {k: jnp.asarray(v * 2.0**4, jnp.bfloat16) for k, v in _grads(0, np.nan).items()}
  u, new_state = jax.jit(tx.update)(g, state, params)
  new_params = optax.apply_updates(params, u)
  for a, b in zip(jax.tree.leaves((params, state.inner_state)),
                  jax.tree.leaves((new_params, new_state.inner_state))):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert int(new_state.skipped_steps) == 1 and float(new_state.scale) == 2.0**3

  tparams = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16))
             for k in NAMES]
  before = [p.detach().clone() for p in tparams]
  opt = OPTIMIZERS[name][1](tparams)
  scaler = tb.dynamic_loss_scale(init_scale=2.0**4)
  loss = sum((p.float() * torch.from_numpy(_grads(0, np.nan)[k])).sum()
             for p, k in zip(tparams, NAMES))
  scaler.scale(loss).backward()
  scaler.step(opt)
  scaler.update()
  for a, b in zip(before, tparams):
    assert torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
  assert all(not s or int(s.get("step", 0)) == 0 for s in opt.state.values())
  assert int(scaler.counters()["skipped_steps"]) == 1 and scaler.get_scale() == 2.0**3


def test_skip_nonfinite_must_be_a_bool():
  with pytest.raises(TypeError, match="skip_nonfinite must be True or False; got 1"):
    oh.adamw_bf16(1e-3, skip_nonfinite=1)
  with pytest.raises(TypeError, match="skip_nonfinite must be True or False; got 1"):
    tb.adamw_bf16([torch.nn.Parameter(torch.ones(2))], 1e-3, skip_nonfinite=1)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_skipped_step_keeps_negative_zero_weights(name):
  """A skipped step returns -0.0 updates (JAX) or touches nothing (torch): a
  -0.0 weight stays -0.0 (p + 0.0 would make it +0.0)."""
  values = _values(0)
  values["w"][1, :] = -0.0
  values["b"][0] = -0.0
  bad = [_grads(0, np.nan)]
  tx = OPTIMIZERS[name][0](skip_nonfinite=True)
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in values.items()}
  state = tx.init(params)
  for jit in (True, False):
    update = jax.jit(tx.update) if jit else tx.update
    u, s = update({k: jnp.asarray(v, jnp.bfloat16) for k, v in bad[0].items()}, state, params)
    new = optax.apply_updates(params, u)
    for k in NAMES:
      np.testing.assert_array_equal(_bits(new[k]), _bits(params[k]))
    assert np.signbit(np.asarray(new["w"][1], np.float32)).all()
    assert int(s.total_notfinite) == 1
  tparams = [torch.nn.Parameter(torch.from_numpy(values[k]).to(torch.bfloat16)) for k in NAMES]
  before = [p.detach().clone() for p in tparams]
  opt = OPTIMIZERS[name][1](tparams, skip_nonfinite=True)
  for p, k in zip(tparams, NAMES):
    p.grad = torch.from_numpy(bad[0][k]).to(torch.bfloat16)
  opt.step()
  for a, b in zip(before, tparams):
    assert torch.equal(a.view(torch.int16), b.detach().view(torch.int16))
  assert opt.nonfinite["total_notfinite"] == 1


@pytest.mark.parametrize("name", ["adamw_bf16 kahan", "scaled_adam"])
def test_loading_a_dict_without_counters_starts_them_afresh(name):
  """A state_dict saved before the counters existed resets them, as a fresh
  optimizer has them; it does not keep the live ones."""
  tparams = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16))
             for k in NAMES]
  opt = OPTIMIZERS[name][1](tparams, skip_nonfinite=True)
  old = opt.state_dict()
  del old["nonfinite"]
  for p, k in zip(tparams, NAMES):
    p.grad = torch.from_numpy(_grads(0, np.nan)[k]).to(torch.bfloat16)
  opt.step()
  assert opt.nonfinite["total_notfinite"] == 1
  opt.load_state_dict(old)
  assert opt.nonfinite == {"notfinite_count": 0, "last_finite": True, "total_notfinite": 0}


# Inner optimizers that skip: ScaledAdam (coupled params), and the bare AdamW
# core with a skip around it (torch: the LowPrecisionAdamW class itself, which
# the wrappers accept; otherwise stepped param by param in chunks).
SKIPPING_INNER = {
    "scaled_adam": (lambda: oh.scaled_adam(0.03, skip_nonfinite=True),
                    lambda ps: tb.scaled_adam(ps, 0.03, skip_nonfinite=True)),
    "core": (lambda: maybe_skip_nonfinite(oh.scale_by_adamw(1e-3), True),
             lambda ps: tb.LowPrecisionAdamW(ps, 1e-3, compensation="none",
                                             skip_nonfinite=True)),
}


@pytest.mark.parametrize("inner", list(SKIPPING_INNER))
@pytest.mark.parametrize("wrapper", ["kahan_summation", "master_weights"])
def test_a_wrapped_optimizer_that_skips_skips_the_whole_step(wrapper, inner, monkeypatch):
  """A wrapper steps an inner optimizer with skip_nonfinite=True on all params at
  once (not in chunks), so one bad gradient skips every param, and the counters
  say so once; as in JAX, where the inner update sees the whole tree."""
  import torch_bridge.wrappers as tbw  # noqa: PLC0415
  monkeypatch.setattr(tbw, "CHUNK_NUMEL", 1)  # one chunk per param, were it chunked
  make_jax, make_torch = SKIPPING_INNER[inner]
  good, bad = _grads(0), _grads(1, np.nan)
  tx = getattr(oh, wrapper)(make_jax())
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _values(0).items()}
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update({k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()}, s, p)))
  params, state = step(params, state, good)
  after_good = params
  params, state = step(params, state, bad)
  for k in NAMES:
    np.testing.assert_array_equal(_bits(params[k]), _bits(after_good[k]))
  counters = state.inner_state
  assert (int(counters.notfinite_count), int(counters.total_notfinite)) == (1, 1)
  assert int(counters.inner_state.count) == 1

  tparams = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16))
             for k in NAMES]
  inner_opt = make_torch(tparams)
  opt = getattr(tb, wrapper)(inner_opt)
  history = []
  for g in (good, bad):
    for p, k in zip(tparams, NAMES):
      p.grad = torch.from_numpy(g[k]).to(torch.bfloat16)
    opt.step()
    history.append([p.detach().clone() for p in tparams])
  for a, b in zip(*history):
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
  assert inner_opt.nonfinite == {"notfinite_count": 1, "last_finite": False,
                                 "total_notfinite": 1}
  # The good step was taken on every param, the bad one on none.
  assert [int(s["step"]) for s in inner_opt.state.values()] == [1] * len(NAMES)


@pytest.mark.parametrize("found_nonfinite", [False, True])
def test_loss_scaler_with_skip_nonfinite_reads_one_bool(found_nonfinite, monkeypatch):
  """Under a loss scaler the optimizer's own finiteness check is not run again:
  the scaler has just found every gradient finite (or skipped the step). Its
  counters then match optax_half's inner ApplyIfFiniteState."""
  from torch_bridge import _optim  # noqa: PLC0415
  calls = []
  original = _optim._grads_finite
  monkeypatch.setattr(_optim, "_grads_finite", lambda opt: calls.append(1) or original(opt))
  tparams = [torch.nn.Parameter(torch.from_numpy(_values(0)[k]).to(torch.bfloat16))
             for k in NAMES]
  opt = tb.adamw_bf16(tparams, 1e-3, skip_nonfinite=True)
  opt.nonfinite.update(notfinite_count=3, last_finite=False, total_notfinite=3)
  scaler = tb.dynamic_loss_scale(init_scale=2.0**4)
  bad = np.nan if found_nonfinite else None
  loss = sum((p.float() * torch.from_numpy(_grads(0, bad)[k])).sum()
             for p, k in zip(tparams, NAMES))
  scaler.scale(loss).backward()
  scaler.step(opt)
  scaler.update()
  assert calls == []
  expected = ({"notfinite_count": 3, "last_finite": False, "total_notfinite": 3}
              if found_nonfinite else
              {"notfinite_count": 0, "last_finite": True, "total_notfinite": 3})
  assert opt.nonfinite == expected
  # A skipped first step makes no state (made at a param's first step).
  assert int(opt.state[tparams[0]].get("step", 0)) == (0 if found_nonfinite else 1)
  assert not hasattr(opt, "_grads_checked_finite")
  # Without the scaler the optimizer checks for itself: one call a step.
  for p, k in zip(tparams, NAMES):
    p.grad = torch.from_numpy(_grads(1)[k]).to(torch.bfloat16)
  opt.step()
  assert calls == [1]

  # optax_half: the inner counters are kept on a scaler-skipped step, reset on a good one.
  tx = oh.dynamic_loss_scale(oh.adamw_bf16(1e-3, skip_nonfinite=True), init_scale=2.0**4)
  params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _values(0).items()}
  state = tx.init(params)
  inner = state.inner_state._replace(notfinite_count=jnp.int32(3), last_finite=jnp.array(False),
                                     total_notfinite=jnp.int32(3))
  state = state._replace(inner_state=inner)
  g = {k: jnp.asarray(v * 2.0**4, jnp.bfloat16) for k, v in _grads(0, bad).items()}
  _, state = jax.jit(tx.update)(g, state, params)
  c = state.inner_state
  assert {"notfinite_count": int(c.notfinite_count), "last_finite": bool(c.last_finite),
          "total_notfinite": int(c.total_notfinite)} == expected


_EAGER_SEVERAL_DEVICES = r"""
import jax, jax.numpy as jnp, numpy as np, optax
import optax_half as oh
devices = jax.devices()
assert len(devices) == 2, devices
rng = np.random.default_rng(0)
values = {k: rng.standard_normal(s).astype(np.float32) for k, s in (("a", (4, 3)), ("b", (5,)))}
grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in values.items()}
         for _ in range(4)]
grads[2]["b"][1] = np.nan
for name, tx in [("skip", oh.adamw_bf16(1e-3, skip_nonfinite=True)),
                 ("loss scale", oh.dynamic_loss_scale(oh.adamw_bf16(1e-3), init_scale=1.0))]:
    results = []
    for spread in (False, True):
        params = {k: jnp.asarray(v, jnp.bfloat16) for k, v in values.items()}
        if spread:  # eager, each leaf committed to its own device
            params = {"a": jax.device_put(params["a"], devices[0]),
                      "b": jax.device_put(params["b"], devices[1])}
        update = tx.update if spread else jax.jit(tx.update)
        state = tx.init(params)
        for g in grads:
            g = {k: jax.device_put(jnp.asarray(v, jnp.bfloat16), params[k].devices().pop())
                 for k, v in g.items()}
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        if spread:
            assert params["b"].devices() == {devices[1]}, params["b"].devices()
        results.append((params, state))
    (p0, s0), (p1, s1) = results
    for a, b in zip(jax.tree.leaves((p0, s0)), jax.tree.leaves((p1, s1))):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (name, a, b)
    print(name, "ok")
"""


def test_skip_and_loss_scale_eagerly_on_leaves_on_several_devices(tmp_path):
  """Called op by op on params whose leaves sit on different devices, the
  finiteness check and the skip work, and equal the jitted single-device run."""
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  script = tmp_path / "several_devices.py"
  script.write_text(_EAGER_SEVERAL_DEVICES)
  # XLA:CPU ends a process whose device waits 40 s at a collective: longer
  # on a loaded machine (tests/test_sharding.py).
  # PYTHONPATH: the checkout under test, not an installed copy.
  root = str(Path(__file__).resolve().parents[1])
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2 "
             "--xla_cpu_collective_call_terminate_timeout_seconds=240", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split("\n")[:2] == ["skip ok", "loss scale ok"], out.stdout
