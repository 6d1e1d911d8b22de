"""torch_bridge optimizers: numbers against references, and the torch.optim contract.

One table (``OPTIMIZERS``) describes every torch_bridge optimizer once; the
behavioural tests (resume, skipped params, schedulers, compile) run on all.
"""

import copy
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

import optax_half as oh  # noqa: E402
import torch_bridge as tb  # noqa: E402
from conftest import ulp_diff  # noqa: E402
from suite_helpers import default_or_slow  # noqa: E402

SHAPES = [(33, 17), (64,), (5, 3, 2)]


def _adam(ps):
  return torch.optim.Adam(ps, lr=1e-2)


OPTIMIZERS = {
    "adamw_bf16 kahan": lambda ps: tb.adamw_bf16(ps, 1e-2),
    "adamw_bf16 split": lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="split"),
    "adamw_bf16 stochastic": lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="stochastic", key=3),
    "adamw_bf16 none": lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="none"),
    "adamw_bf16 fp32 moments": lambda ps: tb.adamw_bf16(
        ps, 1e-2, mu_dtype=torch.float32, nu_dtype=torch.float32),
    "adam_fp32_master": lambda ps: tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1),
    "scale_by_adamw": lambda ps: tb.scale_by_adamw(ps, 1e-2),
    "master_weights(Adam)": lambda ps: tb.master_weights(_adam(ps)),
    "master_weights(Adam, split)": lambda ps: tb.master_weights(_adam(ps), split=True),
    "master_weights(Adam, foreach)": lambda ps: tb.master_weights(_adam(ps), foreach=True),
    "master_weights(Adam, split, foreach)": lambda ps: tb.master_weights(
        _adam(ps), split=True, foreach=True),
    "kahan_summation(Adam)": lambda ps: tb.kahan_summation(_adam(ps)),
    "kahan_summation(Adam, foreach)": lambda ps: tb.kahan_summation(_adam(ps), foreach=True),
    "stochastic_rounding(Adam)": lambda ps: tb.stochastic_rounding(_adam(ps), key=5),
    "stochastic_rounding(Adam, foreach)": lambda ps: tb.stochastic_rounding(
        _adam(ps), key=5, foreach=True),
    "round_to_nearest(Adam)": lambda ps: tb.round_to_nearest(_adam(ps)),
    "round_to_nearest(Adam, foreach)": lambda ps: tb.round_to_nearest(_adam(ps), foreach=True),
    "scaled_adam": lambda ps: tb.scaled_adam(ps, clipping_scale=2.0, clipping_update_period=3),
    "kahan_summation(scaled_adam)": lambda ps: tb.kahan_summation(
        tb.scaled_adam(ps, clipping_scale=2.0, clipping_update_period=3)),
    "master_weights(scaled_adam)": lambda ps: tb.master_weights(
        tb.scaled_adam(ps, clipping_scale=2.0, clipping_update_period=3)),
    "master_weights(scaled_adam, foreach)": lambda ps: tb.master_weights(
        tb.scaled_adam(ps, clipping_scale=2.0, clipping_update_period=3), foreach=True),
    "kahan_summation(scaled_adam, foreach)": lambda ps: tb.kahan_summation(
        tb.scaled_adam(ps, clipping_scale=2.0, clipping_update_period=3), foreach=True),
}


def _params(dtype=torch.bfloat16, seed=0):
  gen = torch.Generator().manual_seed(seed)
  return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _grads(n, dtype=torch.bfloat16, seed=1):
  gen = torch.Generator().manual_seed(seed)
  return [[(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in SHAPES] for _ in range(n)]


def _run(opt, params, grads):
  for g in grads:
    for p, x in zip(params, g):
      p.grad = x.clone()
    opt.step()


def _bits(t):
  return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _snapshot(opt, params):
  """Every param and state tensor, as raw bits (inner optimizer included)."""
  out = [_bits(p) for p in params]
  for o in (opt, getattr(opt, "inner", None)):
    if o is None:
      continue
    for state in o.state.values():
      for k in sorted(state):
        v = state[k]
        if torch.is_tensor(v):
          out.append(_bits(v) if v.is_floating_point() else v.clone())
  return out


def _same(a, b):
  return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------
# Numbers.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, make", [
    ("Adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("SGD momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
])
@pytest.mark.parametrize("dtype, split", [(torch.bfloat16, False), (torch.bfloat16, True),
                                          (torch.float16, False)])
def test_master_weights_trajectory_is_fp32_torch_optim(name, make, dtype, split):
  """200 steps on unit-normal weights, many of which cross zero: the master (the fp32
  copy, or split's high and low halves) is bitwise torch.optim on fp32 params fed the
  same (upcast) grads, and the 16-bit params are its rounding bitwise at every step
  (docs/algorithms.md#landing-exactly: a step writes the target, the master is never
  rounded)."""
  lowp = _params(dtype)
  ref = [p.detach().float().requires_grad_() for p in lowp]
  opt, ref_opt = tb.master_weights(make(lowp), split=split), make(ref)
  signs = [torch.sign(r.detach()) for r in ref]
  for g in _grads(200):
    for p, r, x in zip(lowp, ref, g):
      p.grad, r.grad = x.to(dtype), x.to(dtype).float()
    opt.step()
    ref_opt.step()
    for p, r in zip(lowp, ref):
      master, want = opt.state[p]["master"], r.detach().to(dtype)
      if master.dtype == torch.int16:  # split: the high half rounds ties away from zero
        master, want = tb.rounding.join_f32(p.detach(), master), tb.rounding.split_f32(r.detach())[0]
      assert torch.equal(_bits(master), _bits(r.detach()))
      assert torch.equal(_bits(p), _bits(want))
  crossed = sum(int((torch.sign(r.detach()) != s).sum()) for r, s in zip(ref, signs))
  assert crossed > 0  # weights did cross zero


def test_master_weights_moves_existing_state():
  """State the inner optimizer built on the bf16 params moves to the masters."""
  lowp = _params()
  inner = torch.optim.SGD(lowp, lr=1e-2, momentum=0.9)
  for p, g in zip(lowp, _grads(1)[0]):
    p.grad = g
  inner.step()
  buf = [inner.state[p]["momentum_buffer"].float() for p in lowp]
  opt = tb.master_weights(inner)
  assert opt.param_groups is inner.param_groups  # one set of groups, holding the model params
  assert all(a is b for a, b in zip(inner.param_groups[0]["params"], lowp))
  masters = [opt.state[p]["master"] for p in lowp]
  assert all(m.dtype == torch.float32 for m in masters)
  assert all(torch.equal(inner.state[m]["momentum_buffer"], b) for m, b in zip(masters, buf))
  assert all(p not in inner.state for p in lowp)
  _run(opt, lowp, _grads(3))


def _jax_trajectory(tx, p0, grads, dtype):
  params = {str(i): jnp.asarray(x.float().numpy()).astype(dtype) for i, x in enumerate(p0)}
  with jax.disable_jit():
    state = tx.init(params)
    for g in grads:
      jg = {str(i): jnp.asarray(x.float().numpy()).astype(dtype) for i, x in enumerate(g)}
      # In place, as torch steps (update + apply_updates: the same bits but where a
      # master's p + u misses: tests/test_landing.py).
      params, state = oh.update_and_apply(tx, jg, state, params)
  return [np.asarray(params[str(i)]) for i in range(len(p0))], state


@pytest.mark.parametrize("dtype, compensation", default_or_slow(
    [(d, c) for d in ("bfloat16", "float16") for c in ("kahan", "split", "stochastic", "none")],
    default=[("bfloat16", c) for c in ("kahan", "split", "stochastic", "none")]
    + [("float16", "kahan")]))
def test_adamw_bf16_bitwise_equals_jax_op_by_op(compensation, dtype):
  """Same keywords, same numbers: 30 steps of torch_bridge.adamw_bf16 and of
  optax_half.adamw_bf16 run op by op (no XLA fusion, so no FMA contraction)
  agree bit for bit in the params and in both moments."""
  tdt = getattr(torch, dtype)
  params, grads = _params(tdt), _grads(30, tdt)
  p0 = [p.detach().clone() for p in params]
  opt = tb.adamw_bf16(params, 1e-2, weight_decay=0.1, compensation=compensation, key=7)
  _run(opt, params, grads)
  jp, js = _jax_trajectory(oh.adamw_bf16(1e-2, weight_decay=0.1, compensation=compensation,
                                         key=7), p0, grads, getattr(jnp, dtype))
  core = js.inner_state
  for i, p in enumerate(params):
    assert ulp_diff(jp[i], p.detach().float().numpy().astype(jp[i].dtype)) == 0
    st = opt.state[p]
    for name, mine in (("mu", st["mu"]), ("nu", st["nu"])):
      theirs = np.asarray(getattr(core, name)[str(i)])
      assert ulp_diff(theirs, mine.float().numpy().astype(theirs.dtype)) == 0, name
  if compensation == "kahan":
    for i, p in enumerate(params):
      c = np.asarray(js.compensation[str(i)])
      assert ulp_diff(c, opt.state[p]["compensation"].float().numpy().astype(c.dtype)) == 0


def test_adam_fp32_master_equals_jax_op_by_op():
  params, grads = _params(), _grads(30)
  p0 = [p.detach().clone() for p in params]
  opt = tb.adam_fp32_master(params, 1e-2, weight_decay=0.1)
  _run(opt, params, grads)
  jp, js = _jax_trajectory(oh.adam_fp32_master(1e-2, weight_decay=0.1), p0, grads, jnp.bfloat16)
  for i, p in enumerate(params):
    master = np.asarray(js.master[str(i)])
    assert np.array_equal(master.view(np.uint32),
                          opt.state[p]["master"].numpy().view(np.uint32))
    assert ulp_diff(jp[i], p.detach().float().numpy().astype(jp[i].dtype)) == 0


def _errors_against_float64_adamw(params, grads, **kwargs):
  """Max abs errors against torch.optim.AdamW in float64 of adamw_bf16 on
  ``params`` (fp32, stepped in place) and of torch.optim.AdamW in fp32."""
  ref32 = [p.detach().clone().requires_grad_() for p in params]
  ref64 = [p.detach().double().requires_grad_() for p in params]
  opt = tb.adamw_bf16(params, 1e-3, weight_decay=0.1, **kwargs)
  opt32 = torch.optim.AdamW(ref32, lr=1e-3, weight_decay=0.1, **kwargs)
  opt64 = torch.optim.AdamW(ref64, lr=1e-3, weight_decay=0.1, **kwargs)
  for g in grads:
    for p, r, q, x in zip(params, ref32, ref64, g):
      p.grad, r.grad, q.grad = x, x.clone(), x.double()
    for o in (opt, opt32, opt64):
      o.step()
  ours = max((p.double() - q).abs().max().item() for p, q in zip(params, ref64))
  torch32 = max((r.double() - q).abs().max().item() for r, q in zip(ref32, ref64))
  return ours, torch32


def test_fp32_params_as_accurate_as_torch_adamw():
  """fp32 params: adamw_bf16 is plain AdamW. Against torch.optim.AdamW run in
  float64 (the reference), 300 steps, it is at least as accurate as
  torch.optim.AdamW in fp32 (measured: max abs error 4.2e-6 vs torch's 2.5e-5
  on params of size <= 4; torch rescales p by (1 - lr*wd) in fp32 every step)."""
  params, grads = _params(torch.float32), _grads(300, torch.float32)
  ours, torch32 = _errors_against_float64_adamw(params, grads)
  print(f"max abs error vs float64 AdamW: ours {ours:.2e}, torch fp32 AdamW {torch32:.2e}")
  assert ours <= torch32
  assert ours <= 1e-5


N_TINY = 10_000


def _tiny(make_wrapper, n=N_TINY):
  """n updates of exactly +1e-4 (SGD, lr 1e-4, grad -1) to bf16 params of 1.0."""
  p = torch.ones(256, dtype=torch.bfloat16, requires_grad=True)
  opt = make_wrapper(torch.optim.SGD([p], lr=1e-4))
  g = torch.full((256,), -1.0, dtype=torch.bfloat16)
  for _ in range(n):
    p.grad = g
    opt.step()
  return p.detach().float(), opt


def test_tiny_updates_naive_kahan_split():
  naive, _ = _tiny(tb.round_to_nearest)
  assert torch.all(naive == 1.0)
  kahan, opt = _tiny(tb.kahan_summation)
  comp = opt.state[opt.param_groups[0]["params"][0]]["compensation"].float()
  assert torch.all((kahan - 2.0).abs() <= 0.03 * 2.0), kahan[:4]
  assert torch.all((kahan + comp - 2.0).abs() <= 0.03 * 2.0)
  split, opt = _tiny(lambda o: tb.master_weights(o, split=True))
  p = opt.param_groups[0]["params"][0]
  exact = tb.rounding.join_f32(p.detach(), opt.state[p]["master"])
  assert torch.all((exact - 2.0).abs() <= 0.0005 * 2.0), exact[:4]
  sr, _ = _tiny(lambda o: tb.stochastic_rounding(o, key=0))
  assert abs(sr.mean().item() - 2.0) <= 0.01, sr.mean()


def test_compensated_adamw_is_10x_closer_than_naive():
  """1000 Adam steps on bf16 params vs the same Adam on fp32: the weight that
  Kahan (p + c) and split (join(p, lo)) hold is at least 10x closer to fp32
  than naive bf16's weight (as in tests/test_compensation.py)."""
  grads = _grads(1000, torch.bfloat16, seed=4)
  ref = [p.detach().float().requires_grad_() for p in _params()]
  ref_opt = tb.adamw_bf16(ref, 1e-3, weight_decay=0.0)
  _run(ref_opt, ref, [[x.float() for x in g] for g in grads])
  errors = {}
  for comp in ("none", "kahan", "split"):
    params = _params()
    opt = tb.adamw_bf16(params, 1e-3, weight_decay=0.0, compensation=comp,
                        mu_dtype=torch.float32, nu_dtype=torch.float32)
    _run(opt, params, grads)
    def weight(p):
      state = opt.state[p]
      if comp == "kahan":
        return p.detach().double() + state["compensation"].double()
      if comp == "split":
        return tb.rounding.join_f32(p.detach(), state["master"]).double()
      return p.detach().double()
    errors[comp] = max((weight(p) - r.detach().double()).abs().max().item()
                       for p, r in zip(params, ref))
  print(errors)
  assert errors["kahan"] * 10 <= errors["none"]
  assert errors["split"] * 10 <= errors["none"]


# ---------------------------------------------------------------------------
# The torch.optim contract, for every optimizer in the table.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_is_a_torch_optimizer_with_lr(name):
  params = _params()
  opt = OPTIMIZERS[name](params)
  assert isinstance(opt, torch.optim.Optimizer)
  assert all("lr" in g for g in opt.param_groups)
  assert [p for g in opt.param_groups for p in g["params"]] == params
  opt.zero_grad()
  assert all(p.grad is None for p in params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bitwise(name):
  """100 steps == 50 steps, torch.save/load into a fresh optimizer, 50 steps."""
  grads = _grads(100)
  params = _params()
  opt = OPTIMIZERS[name](params)
  _run(opt, params, grads)
  full = _snapshot(opt, params)

  params = _params()
  opt = OPTIMIZERS[name](params)
  _run(opt, params, grads[:50])
  buf = io.BytesIO()
  torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
  buf.seek(0)
  ckpt = torch.load(buf, weights_only=False)
  params = [p.detach().clone().requires_grad_() for p in ckpt["params"]]
  opt = OPTIMIZERS[name](params)
  opt.load_state_dict(ckpt["opt"])
  _run(opt, params, grads[50:])
  assert _same(full, _snapshot(opt, params))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_params_without_a_grad_are_untouched(name):
  """A param with no gradient is not stepped; one with a gradient is, even
  with requires_grad=False (torch.optim steps every param that has a .grad)."""
  params = _params()
  params[1].requires_grad_(False)
  opt = OPTIMIZERS[name](params)
  before = _snapshot(opt, params)
  for p, g in zip(params, _grads(1)[0]):
    p.grad = g
  params[2].grad = None  # no gradient this step
  opt.step()
  after = _snapshot(opt, params)
  assert torch.equal(before[2], after[2])
  assert not torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_closure_and_sparse_grads(name):
  params = _params()
  opt = OPTIMIZERS[name](params)

  def closure():
    loss = sum((p.float() ** 2).sum() for p in params)
    opt.zero_grad()
    loss.backward()
    return loss
  loss = opt.step(closure)
  assert torch.is_tensor(loss) and loss.item() > 0
  params[0].grad = torch.zeros_like(params[0]).to_sparse()
  with pytest.raises(RuntimeError, match="sparse"):
    opt.step()


def test_bad_input_errors():
  with pytest.raises(ValueError, match="floating-point"):
    tb.adamw_bf16([torch.zeros(3, dtype=torch.int32)], 1e-3)
  with pytest.raises(ValueError, match="floating-point"):
    tb.master_weights(torch.optim.SGD([torch.zeros(3, dtype=torch.int64)], lr=0.1))
  with pytest.raises(ValueError, match="b2"):
    tb.adamw_bf16(_params(), 1e-3, b2=1.0)
  with pytest.raises(ValueError, match="learning_rate"):
    tb.adam_fp32_master(_params(), -1.0)
  with pytest.raises(ValueError, match="compensation"):
    tb.adamw_bf16(_params(), 1e-3, compensation="fp32")
  with pytest.raises(ValueError, match="state_rounding"):
    tb.adamw_bf16(_params(), 1e-3, state_rounding="up")
  with pytest.raises(TypeError, match="key"):
    tb.adamw_bf16(_params(), 1e-3, key="seed")
  with pytest.raises(TypeError, match="torch.optim.Optimizer"):
    tb.kahan_summation(_params())
  with pytest.raises(ValueError, match="split"):
    tb.master_weights(torch.optim.SGD(_params(), lr=0.1), master_dtype=torch.float64,
                      split=True)
  ps = _params()
  opt = tb.adamw_bf16(ps, 1e-3, mu_dtype=torch.float32)
  _run(opt, ps, _grads(1))  # state is made at the first step, as in torch.optim
  sd = opt.state_dict()
  fresh = tb.adamw_bf16(_params(), 1e-3)  # bf16 moments: a different layout
  with pytest.raises(ValueError, match="mu"):
    fresh.load_state_dict(sd)


def test_fp32_and_mixed_params():
  """fp32 params get no buffer; each dtype keeps its dtype."""
  params = [torch.randn(4, requires_grad=True),
            torch.randn(4, dtype=torch.float16, requires_grad=True),
            torch.randn(4, dtype=torch.bfloat16, requires_grad=True)]
  for make in OPTIMIZERS.values():
    ps = [p.detach().clone().requires_grad_() for p in params]
    opt = make(ps)
    _run(opt, ps, [[torch.randn(4, dtype=p.dtype) for p in ps]] * 3)
    assert [p.dtype for p in ps] == [p.dtype for p in params]
    assert "compensation" not in opt.state[ps[0]] and "master" not in opt.state[ps[0]]
    assert all(torch.isfinite(p).all() for p in ps)


# ---------------------------------------------------------------------------
# Schedules, LR schedulers, torch.compile.
# ---------------------------------------------------------------------------


def test_preheat_schedule_matches_jax():
  jax_sched = oh.preheat_decay_schedule(1e-3, preheat_steps=100)
  torch_sched = tb.preheat_decay_schedule(1e-3, preheat_steps=100)
  counts = np.arange(0, 1000)
  j = np.asarray(jax.vmap(jax_sched)(jnp.asarray(counts))).astype(np.float32)
  t = np.array([torch_sched(int(c)) for c in counts], np.float32)
  assert ulp_diff(j, t) <= 1


def test_lambda_lr_equals_schedule_as_learning_rate():
  """LambdaLR(preheat_decay_schedule(1.0)) on lr=peak and the schedule passed
  as learning_rate give the same lr at every step up to the fp32 rounding of
  LambdaLR's float64 product, and params within one bf16 ULP."""
  grads = _grads(20)
  a, b = _params(), _params()
  opt_a = tb.adamw_bf16(a, tb.preheat_decay_schedule(1e-2, preheat_steps=10))
  opt_b = tb.adamw_bf16(b, 1e-2)
  sched = torch.optim.lr_scheduler.LambdaLR(opt_b, tb.preheat_decay_schedule(1.0, 10))
  for g in grads:
    for p, q, x in zip(a, b, g):
      p.grad, q.grad = x, x.clone()
    opt_a.step()
    opt_b.step()
    lr_a, lr_b = opt_a.param_groups[0]["lr"], opt_b.param_groups[0]["lr"]
    assert abs(lr_a - lr_b) <= 2**-23 * lr_a
    sched.step()
  for p, q in zip(a, b):
    assert ulp_diff(p.detach().float().numpy().astype(jnp.bfloat16),
                    q.detach().float().numpy().astype(jnp.bfloat16)) <= 1


@pytest.mark.parametrize("name", ["adam_fp32_master", "master_weights(Adam)"])
def test_step_lr_scheduler_drives_the_update(name):
  params = _params()
  opt = OPTIMIZERS[name](params)
  sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
  _run(opt, params, _grads(1))
  sched.step()
  assert opt.param_groups[0]["lr"] == 0.0
  before = _snapshot(opt, params)[: len(params)]
  _run(opt, params, _grads(1, seed=9))
  after = _snapshot(opt, params)[: len(params)]
  assert _same(before, after)  # lr 0: the weights do not move


def _model(dtype):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                             torch.nn.Linear(32, 4)).to(dtype)


# Inductor compiles the model's forward and backward in about 15-30 s on a cold
# cache (make test-slow); aot_eager traces the same graphs and breaks without codegen.
@pytest.mark.parametrize("name, backend", default_or_slow(
    [(n, b) for n in ("adamw_bf16 kahan", "kahan_summation(Adam)") for b in ("aot_eager", "inductor")],
    [("adamw_bf16 kahan", "aot_eager"), ("kahan_summation(Adam)", "aot_eager")]))
def test_compiled_training_step_equals_eager(name, backend):
  """torch.compile of a whole training step (forward, backward, opt.step):
  the optimizer step runs outside the graph and the result is bitwise eager."""
  x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
  y = torch.randn(64, 4, generator=torch.Generator().manual_seed(2)).bfloat16()
  results = []
  for compiled in (False, True):
    model = _model(torch.bfloat16)
    opt = OPTIMIZERS[name](list(model.parameters()))

    def train_step():
      loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
      loss.backward()
      opt.step()
      opt.zero_grad()
      return loss
    fn = torch.compile(train_step, backend=backend) if compiled else train_step
    for _ in range(5):
      fn()
    results.append([_bits(p) for p in model.parameters()])
  assert _same(*results)


def test_fused_step_equals_eager():
  """fused=True (the step compiled by torch.compile) is bitwise the eager step."""
  grads = _grads(5)
  out = []
  for fused in (False, True):
    params = _params()
    opt = tb.adamw_bf16(params, 1e-2, weight_decay=0.1, fused=fused)
    _run(opt, params, grads)
    out.append(_snapshot(opt, params))
  assert _same(*out)


@pytest.mark.parametrize("make", [
    lambda ps, fused: tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1, fused=fused),
    lambda ps, fused: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, fused=fused),
    lambda ps, fused: tb.adamw_bf16(ps, 1e-2, compensation="stochastic", fused=fused)],
    ids=["adam_fp32_master", "adamw_bf16 kahan", "adamw_bf16 stochastic"])
def test_fused_step_of_fp16_params_equals_eager(make):
  """fp16 params, which the native kernel does not take: fused=True compiles
  the per-tensor step on CPU too, with the eager step's bits (the README's
  advice for fp16 on CPU, where fused=None steps them eagerly)."""
  grads = _grads(5, torch.float16)
  out = []
  for fused in (False, True):
    params = _params(torch.float16)
    opt = make(params, fused)
    _run(opt, params, grads)
    out.append(_snapshot(opt, params))
  assert _same(*out)
  assert not _same([_bits(p) for p in _params(torch.float16)], out[0][:len(SHAPES)])


@pytest.mark.parametrize("wrap", [tb.kahan_summation, tb.round_to_nearest,
                                  lambda o: tb.master_weights(o, split=True),
                                  lambda o: tb.stochastic_rounding(o, key=1)])
def test_wrappers_keep_no_fp32_copy_and_chunks_do_not_change_results(wrap, monkeypatch):
  """Between steps the fp32 stand-ins hold no storage; stepping in chunks of
  one param (CHUNK_NUMEL=1) gives the same bits as one chunk."""
  gen = torch.Generator().manual_seed(3)
  grads = [g + [torch.randn(7, generator=gen)] for g in _grads(10)]
  p32 = torch.randn(7, generator=gen)
  out = []
  for chunk in (tb.wrappers.CHUNK_NUMEL, 1):
    monkeypatch.setattr(tb.wrappers, "CHUNK_NUMEL", chunk)
    params = _params() + [p32.clone().requires_grad_()]  # and one fp32 param
    opt = wrap(torch.optim.Adam(params, lr=1e-2))
    _run(opt, params, grads)
    stand_ins = [opt._work[p] for p in params]
    assert [w.numel() for w in stand_ins[:3]] == [0, 0, 0]
    assert stand_ins[3] is params[3]
    out.append(_snapshot(opt, params))
  assert _same(*out)


def test_wrapped_torch_bridge_optimizer_keeps_its_schedule_count():
  """A wrapper copies the user's hyperparameters into the wrapped optimizer
  before each step, but not its step count: a scheduled scale_by_adamw inside
  kahan_summation follows its schedule (the count was reset to 0 before)."""
  p = [torch.ones(4, dtype=torch.bfloat16, requires_grad=True)]
  schedule = tb.preheat_decay_schedule(1e-2, preheat_steps=10)
  opt = tb.kahan_summation(tb.scale_by_adamw(p, schedule))
  for _ in range(5):
    p[0].grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
  assert opt.inner.param_groups[0]["count"] == 5
  assert opt.inner.param_groups[0]["lr"] == schedule(4)


# ---------------------------------------------------------------------------
# State made at the first step; params whose dtype changes.
# ---------------------------------------------------------------------------

NAMED = ["adamw_bf16 kahan", "adamw_bf16 split", "adamw_bf16 stochastic", "adamw_bf16 none",
         "adamw_bf16 fp32 moments", "adam_fp32_master", "scale_by_adamw"]


def _module_params(dtype, seed=0):
  """Params of a module (``model.to(dtype)`` casts them in place)."""
  ps = [torch.nn.Parameter(p.detach()) for p in _params(dtype, seed)]
  return ps, torch.nn.ParameterList(ps)


@pytest.mark.parametrize("name", NAMED)
def test_state_is_made_at_the_first_step_as_in_torch_optim(name):
  """Like torch.optim.AdamW: no state before a param's first step, and a
  state dict saved then holds none."""
  params = _params()
  opt = OPTIMIZERS[name](params)
  ref = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params])
  assert len(opt.state) == 0 and opt.state_dict()["state"] == ref.state_dict()["state"] == {}
  params[1].grad = torch.ones_like(params[1])
  opt.step()
  assert list(opt.state) == [params[1]] and int(opt.state[params[1]]["step"]) == 1


@pytest.mark.parametrize("cast", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                  (torch.float32, torch.float16), (torch.bfloat16, torch.float16)],
                         ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_model_to_dtype_before_the_first_step_just_works(name, cast):
  """``model.to(dtype)`` between building the optimizer and its first step:
  the steps of an optimizer built after the cast, bit for bit (the kernel
  path used to get no buffer for the new dtype: a segfault)."""
  before, after = cast
  runs = []
  for build_first in (True, False):
    params, model = _module_params(before)
    if build_first:
      opt = OPTIMIZERS[name](params)
      model.to(after)
    else:
      model.to(after)
      opt = OPTIMIZERS[name](params)
    _run(opt, params, _grads(3, dtype=after))
    assert all(p.dtype == after for p in params)
    runs.append(_snapshot(opt, params))
  assert _same(*runs)


STALE = {
    **{f"{name}, fused={fused}": (lambda ps, name=name, fused=fused: OPTIMIZERS[name](ps)
                                  if fused is None else _eager(OPTIMIZERS[name](ps)))
       for name in ("adamw_bf16 kahan", "adamw_bf16 split", "adam_fp32_master",
                    "adamw_bf16 stochastic") for fused in (None, False)},
    **{name: OPTIMIZERS[name] for name in (
        "scale_by_adamw", "adamw_bf16 fp32 moments", "master_weights(Adam)",
        "kahan_summation(Adam)", "stochastic_rounding(Adam)", "round_to_nearest(Adam)",
        "master_weights(scaled_adam)", "scaled_adam")},
}


def _eager(opt):
  opt._fused = False  # what fused=False sets: the eager per-tensor step
  return opt


@pytest.mark.parametrize("name", list(STALE))
def test_a_dtype_change_after_the_state_is_made_is_named(name):
  """A param cast after its state was made (here by a step) is an error at
  the step naming the param, both dtypes and the fix; nothing is stepped
  (the eager step used to fail on a missing buffer, the kernel to segfault,
  a bf16 to fp32 cast to step with bf16 moments)."""
  params = _params()
  opt = STALE[name](params)
  _run(opt, params, _grads(1))
  with torch.no_grad():
    params[2].data = params[2].data.float()  # what model.to(torch.float32) does
  before = _snapshot(opt, params)
  grads = _grads(1, seed=2)
  grads[0][2] = grads[0][2].float()
  with pytest.raises(ValueError, match=re.escape("param 2 is torch.float32[5, 3, 2]")) as e:
    _run(opt, params, grads)
  assert "torch.bfloat16" in str(e.value) and "after model.to(dtype)" in str(e.value)
  assert _same(before, _snapshot(opt, params))  # params 0 and 1 were not stepped either
  with torch.no_grad():
    params[2].data = torch.zeros(6, 5, dtype=torch.bfloat16)  # another shape
  grads[0][2] = torch.ones(6, 5, dtype=torch.bfloat16)
  with pytest.raises(ValueError, match=re.escape("param 2 is torch.bfloat16[6, 5]")):
    _run(opt, params, grads)


def test_a_complex_param_cast_after_its_state_is_made_is_named():
  p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
  opt = tb.adamw_bf16([p], amsgrad=True)
  p.grad = torch.ones_like(p)
  opt.step()
  p.data = p.data.to(torch.complex128)
  p.grad = torch.ones_like(p)
  with pytest.raises(ValueError, match=re.escape(
      "param 0 is torch.complex128[3], but its optimizer state (mu torch.complex64[3], nu "
      "torch.complex64[3], nu_max torch.complex64[3]) was made for a torch.complex64 param")):
    opt.step()


@pytest.mark.parametrize("into", ["a fresh optimizer", "a stepped optimizer", "state set by hand"])
@pytest.mark.parametrize("how", ["int", "float", "numpy int", "numpy 0-dim"])
def test_a_number_as_step_resumes_bitwise_on_the_kernel_path(how, into, monkeypatch):
  """A state dict whose ``step`` is a number (torch's older format; tools
  that save ints) loads as a CPU int64 tensor and the kernel path (bf16
  params on the CPU, fused=None) continues bit for bit as from the saved
  tensors (the kernel path used to fail advancing a number)."""
  from torch_bridge import _native, adam  # noqa: PLC0415
  if not _native.available():
    pytest.skip("no native kernel here")
  number = {"int": int, "float": lambda t: float(int(t)), "numpy int": lambda t: np.int64(t),
            "numpy 0-dim": lambda t: np.array(int(t))}[how]
  grads = _grads(6)
  params = _params()
  opt = tb.adamw_bf16(params, 1e-2, weight_decay=0.1)
  _run(opt, params, grads[:3])
  saved = [p.detach().clone() for p in params]
  state_dict = copy.deepcopy(opt.state_dict())  # state_dict() shares the live tensors
  _run(opt, params, grads[3:])
  full = _snapshot(opt, params)
  for s in state_dict["state"].values():
    s["step"] = number(s["step"])
  params = [p.clone().requires_grad_() for p in saved]
  opt = tb.adamw_bf16(params, 1e-2, weight_decay=0.1)
  if into == "a stepped optimizer":
    _run(opt, params, _grads(1, seed=7))
    with torch.no_grad():
      for p, s in zip(params, saved):
        p.copy_(s)
  if into == "state set by hand":
    opt.load_state_dict({**state_dict, "state": {
        k: {**v, "step": torch.tensor(0)} for k, v in state_dict["state"].items()}})
    for p, s in zip(params, state_dict["state"].values()):
      opt.state[p]["step"] = s["step"]
  else:
    opt.load_state_dict(state_dict)
    for p in params:
      step = opt.state[p]["step"]
      assert torch.is_tensor(step) and step.dtype == torch.int64 and step.device.type == "cpu"
  monkeypatch.setattr(adam, "adamw_step", None)  # the kernel steps every param
  _run(opt, params, grads[3:])
  assert _same(full, _snapshot(opt, params))


def test_a_param_listed_twice_steps_twice_in_order_on_the_kernel_path():
  """The kernel steps a param listed twice once per listing, in order, as the
  eager step does (one kernel call took both listings at the same step count)."""
  runs = []
  for fused in (None, False):
    params = _params()
    with pytest.warns(UserWarning):
      opt = tb.adamw_bf16(params + params[:1], 1e-2, compensation="stochastic", key=4,
                          fused=fused)
    _run(opt, params, _grads(2))
    assert int(opt.state[params[0]]["step"]) == 4
    runs.append(_snapshot(opt, params))
  assert _same(*runs)


# ---------------------------------------------------------------------------
# torch.optim.AdamW's other keywords.
# ---------------------------------------------------------------------------

ADAMW_FACTORIES = {
    "adamw_bf16": lambda ps, **k: tb.adamw_bf16(ps, 1e-2, **k),
    "adam_fp32_master": lambda ps, **k: tb.adam_fp32_master(ps, 1e-2, **k),
    "scale_by_adamw": lambda ps, **k: tb.scale_by_adamw(ps, 1e-2, **k),
    "LowPrecisionAdamW": lambda ps, **k: tb.LowPrecisionAdamW(ps, 1e-2, **k),
}


@pytest.mark.parametrize("name", list(ADAMW_FACTORIES))
def test_torch_adamw_keywords_are_taken_and_refused_with_the_fix(name):
  make = ADAMW_FACTORIES[name]
  for foreach in (None, True, False):
    make(_params(), amsgrad=False, foreach=foreach, maximize=False, capturable=False,
         differentiable=False)
  for key, fix in (("capturable", "torch.optim.AdamW(capturable=True)"),):
    with pytest.raises(ValueError, match=re.escape(f"{key}=True is not supported")) as e:
      make(_params(), **{key: True})
    assert fix in str(e.value) and f"Pass {key}=False" in str(e.value)
    with pytest.raises(ValueError, match=re.escape(f"param group: {key}=True")):
      make([{"params": _params(), key: True}])
  with pytest.raises(TypeError, match="maximize must be True or False"):
    make(_params(), maximize="yes")
  with pytest.raises(TypeError, match="foreach must be None, True or False"):
    make(_params(), foreach=1)
  with pytest.raises(TypeError, match="amsgrad must be True or False"):
    make(_params(), amsgrad=1)


def test_param_groups_copied_from_torch_optimizers_are_taken():
  """torch.optim.AdamW's and Adam's group keys (amsgrad, foreach, fused,
  capturable, differentiable, decoupled_weight_decay) are taken as the
  keywords are; maximize stays a group key, saved with the group."""
  ps = _params()
  groups = [dict(torch.optim.AdamW(ps[:1], lr=1e-2, weight_decay=0.1).param_groups[0]),
            dict(torch.optim.Adam(ps[1:2], lr=1e-2).param_groups[0]),
            {**torch.optim.AdamW(ps[2:], lr=1e-2, maximize=True).param_groups[0]}]
  assert {"fused", "foreach", "capturable", "differentiable", "amsgrad",
          "decoupled_weight_decay"} <= set(groups[0])
  opt = tb.adamw_bf16(groups, 1e-2)
  assert [g["maximize"] for g in opt.param_groups] == [False, False, True]
  assert all(set(g) == set(opt.param_groups[0]) for g in opt.param_groups)
  ref = [p.detach().clone().requires_grad_() for p in ps]
  ref_opt = tb.adamw_bf16([{"params": ref[:1], "weight_decay": 0.1},
                           {"params": ref[1:2], "weight_decay": 0.0},
                           {"params": ref[2:], "maximize": True}], 1e-2)
  grads = _grads(3)
  _run(opt, ps, grads)
  _run(ref_opt, ref, grads)
  assert _same(_snapshot(opt, ps), _snapshot(ref_opt, ref))
  assert opt.state_dict()["param_groups"][2]["maximize"] is True
  with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
    tb.adamw_bf16([dict(torch.optim.Adam(_params(), weight_decay=0.1).param_groups[0])], 1e-2)
  opt = tb.adamw_bf16([dict(torch.optim.AdamW(_params(), amsgrad=True).param_groups[0])], 1e-2)
  assert opt.param_groups[0]["amsgrad"] is True


# ---------------------------------------------------------------------------
# AMSGrad (torch.optim.AdamW(amsgrad=True)).
# ---------------------------------------------------------------------------

def _amsgrad_grads(n, dtype, seed=3):
  """Gradients whose size falls after a large first one, so that the running
  max of nu, not nu itself, sets the denominator."""
  gen = torch.Generator().manual_seed(seed)
  return [[(torch.randn(s, generator=gen) * (3.0 if t == 0 else 0.05)).to(dtype)
           for s in SHAPES] for t in range(n)]


@pytest.mark.parametrize("factory", ["adam_fp32_master", "scale_by_adamw"])
def test_amsgrad_fp32_params_follow_torch_adamw(factory):
  """fp32 params: the step of torch.optim.AdamW(amsgrad=True) within a few
  ULP, nu_max its max_exp_avg_sq, and far from the step without amsgrad."""
  grads = _amsgrad_grads(12, torch.float32)
  runs = {}
  kw = dict(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.1)  # nu decays fast: the max matters
  for name, make in (("torch", lambda ps, a: torch.optim.AdamW(ps, **kw, amsgrad=a)),
                     ("ours", lambda ps, a: getattr(tb, factory)(ps, **kw, amsgrad=a))):
    for amsgrad in (True, False):
      ps = _params(torch.float32)
      opt = make(ps, amsgrad)
      _run(opt, ps, grads)
      runs[name, amsgrad] = (ps, opt)
  (ref, ref_opt), (ps, opt) = runs["torch", True], runs["ours", True]
  for p, r in zip(ps, ref):
    torch.testing.assert_close(p, r, rtol=4e-6, atol=1e-6)
    # (1 - b2) is f32(1) - f32(b2) here, as in optax; torch rounds 1 - b2 from a double
    torch.testing.assert_close(opt.state[p]["nu_max"], ref_opt.state[r]["max_exp_avg_sq"],
                               rtol=2e-5, atol=0)
    # the max mostly holds the first step's large second moment; nu decayed below it
    nu_max, nu = opt.state[p]["nu_max"], opt.state[p]["nu"]
    assert (nu_max >= nu).all() and (nu_max > nu).float().mean() > 0.9
  plain = runs["ours", False][0]
  assert min((p - q).abs().max().item() for p, q in zip(ps, plain)) > 1e-3


# Each compiled step is a graph of its own, about 30 s to compile on a cold
# cache: make test compiles the default one, make test-slow the others.
_AMSGRAD_CASES = [(c, m, steps) for c in ("kahan", "stochastic") for m in (None, torch.float32)
                  for steps in ("default", "compiled")]


@pytest.mark.parametrize("compensation, moments, steps", default_or_slow(
    _AMSGRAD_CASES, [c for c in _AMSGRAD_CASES if c[2] == "default"] + [("kahan", None, "compiled")]))
def test_amsgrad_bf16_params(compensation, moments, steps):
  """bf16 params: nu_max is the running max of the stored nu (in nu's dtype),
  the eager step gives the default step's (fused=None) and the compiled one's
  (fused=True) bits, and with fp32 moments Kahan tracks
  torch.optim.AdamW(amsgrad=True) on fp32."""
  grads = _amsgrad_grads(8, torch.bfloat16)
  snaps = []
  for fused in (False, None if steps == "default" else True):
    ps = _params()
    opt = tb.adamw_bf16(ps, lr=1e-2, weight_decay=0.1, compensation=compensation, fused=fused,
                        mu_dtype=moments, nu_dtype=moments, amsgrad=True, key=7)
    running = None
    for g in grads:
      _run(opt, ps, [g])
      nus = [opt.state[p]["nu"].clone() for p in ps]
      running = nus if running is None else [torch.maximum(a, b) for a, b in zip(running, nus)]
      assert all(torch.equal(opt.state[p]["nu_max"], r) for p, r in zip(ps, running))
      assert all(opt.state[p]["nu_max"].dtype == opt.state[p]["nu"].dtype for p in ps)
    snaps.append(_snapshot(opt, ps))
  assert _same(snaps[0], snaps[1])
  if compensation == "kahan" and moments is not None:
    ref = [p.detach().float().requires_grad_() for p in _params()]
    _run(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, amsgrad=True), ref,
         [[x.float() for x in g] for g in grads])
    for p, r in zip(ps, ref):  # the weight, param + compensation, near fp32's
      x = p.detach().float() + opt.state[p]["compensation"].float()
      torch.testing.assert_close(x, r.detach(), rtol=2 ** -12, atol=1e-5)


def test_amsgrad_switched_on_later_starts_the_max_and_resumes_bitwise():
  ps = _params()
  opt = tb.adamw_bf16(ps, lr=1e-2)
  grads = _amsgrad_grads(6, torch.bfloat16)
  _run(opt, ps, grads[:2])
  assert "nu_max" not in opt.state[ps[0]]
  opt.param_groups[0]["amsgrad"] = True  # the max starts from this step's nu
  _run(opt, ps, grads[2:3])
  assert all(torch.equal(opt.state[p]["nu_max"], opt.state[p]["nu"]) for p in ps)
  saved = copy.deepcopy(opt.state_dict())
  qs = [p.detach().clone().requires_grad_() for p in ps]
  _run(opt, ps, grads[3:])
  resumed = tb.adamw_bf16(qs, lr=1e-2, amsgrad=True)
  resumed.load_state_dict(saved)
  _run(resumed, qs, grads[3:])
  assert _same(_snapshot(resumed, qs), _snapshot(opt, ps))
  opt.param_groups[0]["amsgrad"] = False  # the max is dropped
  _run(opt, ps, grads[:1])
  assert "nu_max" not in opt.state[ps[0]]


# ---------------------------------------------------------------------------
# differentiable=True (torch.optim.AdamW's: the step recorded by autograd).
# ---------------------------------------------------------------------------

def _differentiable_run(make, steps=3):
  """Params that are a function of a leaf ``w``, gradients too; returns the
  params after ``steps`` steps and d(sum p^2)/dw through every step."""
  gen = torch.Generator().manual_seed(5)
  w = torch.randn(5, 3, generator=gen).requires_grad_()
  p = w * 1.5
  opt = make([p])
  for t in range(steps):
    p.grad = (w ** 3) * (t + 1)
    opt.step()
  (p ** 2).sum().backward()
  return p.detach(), w.grad


def test_differentiable_step_has_torch_adamws_gradient():
  kw = dict(lr=0.1, weight_decay=0.1, differentiable=True)
  ref_p, ref_grad = _differentiable_run(lambda ps: torch.optim.AdamW(ps, **kw))
  for factory in ("adam_fp32_master", "adamw_bf16", "scale_by_adamw"):
    p, grad = _differentiable_run(lambda ps: getattr(tb, factory)(ps, **kw))
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
  # the step's values are those of the plain step, bit for bit, amsgrad too
  for amsgrad in (False, True):
    p, grad = _differentiable_run(lambda ps: tb.adamw_bf16(ps, **kw, amsgrad=amsgrad))
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    plain = [(w * 1.5).requires_grad_()]
    opt = tb.adamw_bf16(plain, lr=0.1, weight_decay=0.1, amsgrad=amsgrad)
    for t in range(3):
      plain[0].grad = (w ** 3) * (t + 1)
      opt.step()
    assert torch.equal(p, plain[0].detach()) and torch.isfinite(grad).all()
  # hyperparameters that require grad would get none: refused
  lr = torch.tensor(0.1, requires_grad=True)
  for make in (lambda ps: tb.adamw_bf16(ps, lr=lr, differentiable=True),
               lambda ps: tb.adamw_bf16(ps, betas=(lr, torch.tensor(0.9))),
               lambda ps: tb.adamw_bf16([{"params": ps, "lr": lr}]),
               lambda ps: tb.scaled_adam(ps, lr=lr)):
    with pytest.raises(ValueError, match="is a tensor that requires grad, but the step reads"):
      make([torch.ones(3, requires_grad=True)])
  # 16-bit params: the rounding has no gradient
  q = [torch.ones(3, dtype=torch.bfloat16).requires_grad_()]
  q[0].grad = torch.ones_like(q[0])
  with pytest.raises(ValueError, match="differentiable=True steps params of 32 bits or more"):
    tb.adamw_bf16(q, lr=0.1, differentiable=True).step()


# ---------------------------------------------------------------------------
# float64 and complex params (torch.optim.AdamW's: complex as pairs of reals).
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("fused", [None, False, True])
@pytest.mark.parametrize("factory", ["adamw_bf16", "adam_fp32_master"])
def test_float64_params_step_in_float64_as_torch_adamw(factory, fused, amsgrad):
  gen = torch.Generator().manual_seed(4)
  w = torch.randn(6, 5, dtype=torch.float64, generator=gen)
  grads = [torch.randn(6, 5, dtype=torch.float64, generator=gen) for _ in range(6)]
  kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
  ours, ref = [w.clone().requires_grad_()], [w.clone().requires_grad_()]
  opt = getattr(tb, factory)(ours, fused=fused, **kw)
  ref_opt = torch.optim.AdamW(ref, **kw)
  for g in grads:
    ours[0].grad, ref[0].grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
  assert {v.dtype for k, v in opt.state[ours[0]].items() if k != "step"} == {torch.float64}
  torch.testing.assert_close(ours[0], ref[0], rtol=1e-14, atol=1e-15)
  # fp32 math would be ~1e-7 off
  assert not torch.equal(ours[0].detach().float().double(), ours[0].detach())


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_params_step_as_their_real_pairs(dtype, fused, amsgrad):
  """A complex param steps as its view_as_real pairs would, bit for bit,
  with state of its dtype, and within a few ULP of torch.optim.AdamW."""
  gen = torch.Generator().manual_seed(2)
  w = torch.randn(4, 3, dtype=dtype, generator=gen)
  grads = [torch.randn(4, 3, dtype=dtype, generator=gen) for _ in range(5)]
  kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
  cplx, pairs, ref = ([w.clone().requires_grad_()],
                      [torch.view_as_real(w).clone().requires_grad_()],
                      [w.clone().requires_grad_()])
  opts = (tb.adam_fp32_master(cplx, fused=fused, **kw), tb.adam_fp32_master(pairs, fused=fused,
                                                                             **kw),
          torch.optim.AdamW(ref, **kw))
  for g in grads:
    cplx[0].grad, pairs[0].grad, ref[0].grad = g.clone(), torch.view_as_real(g).clone(), g.clone()
    for opt in opts:
      opt.step()
  assert torch.equal(torch.view_as_real(cplx[0].detach()), pairs[0].detach())
  state = opts[0].state[cplx[0]]
  assert {k: v.dtype for k, v in state.items() if k != "step"} == {
      k: dtype for k in ("mu", "nu", "nu_max")[:3 if amsgrad else 2]}
  assert torch.equal(torch.view_as_real(state["nu"]), opts[1].state[pairs[0]]["nu"])
  tol = 4e-6 if dtype == torch.complex64 else 1e-14
  torch.testing.assert_close(cplx[0], ref[0], rtol=tol, atol=tol / 4)


def test_params_the_step_cannot_take_are_refused_with_the_fix():
  for dtype in (torch.complex64, torch.float64):
    with pytest.raises(ValueError, match=f"is {dtype}, whose moments are {dtype}"):
      tb.adamw_bf16([torch.zeros(2, dtype=dtype, requires_grad=True)], mu_dtype=torch.bfloat16)
  with pytest.raises(RuntimeError, match="fused=True"):  # torch's own check, as its AdamW
    p = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    p.grad = torch.ones_like(p)
    tb.adamw_bf16([p], fused=True).step()


MAXIMIZE = {
    "adamw_bf16 kahan": lambda ps, f, m: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, fused=f,
                                                       maximize=m),
    "adamw_bf16 split": lambda ps, f, m: tb.adamw_bf16(ps, 1e-2, compensation="split",
                                                       fused=f, maximize=m),
    "adamw_bf16 stochastic, fp32 nu": lambda ps, f, m: tb.adamw_bf16(
        ps, 1e-2, compensation="stochastic", key=2, nu_dtype=torch.float32, fused=f, maximize=m),
    "adamw_bf16 none": lambda ps, f, m: tb.adamw_bf16(ps, 1e-2, compensation="none", fused=f,
                                                      maximize=m),
    "adam_fp32_master": lambda ps, f, m: tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1,
                                                             fused=f, maximize=m),
    "scale_by_adamw": lambda ps, f, m: tb.scale_by_adamw(ps, 1e-2, fused=f, maximize=m),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("path", ["kernel", "eager", "grouped"])
@pytest.mark.parametrize("name", list(MAXIMIZE))
def test_maximize_is_the_step_on_the_negated_gradient(name, path, dtype, monkeypatch):
  """``maximize=True`` reads the gradient negated: the bits (params and
  every state tensor) of the same optimizer stepped on ``-grad``, on every
  path: the kernel (CPU, fused=None), the eager per-tensor step
  (fused=False) and the grouped eager step (the default off the CPU)."""
  from torch_bridge import _native, adam  # noqa: PLC0415
  if path == "grouped":
    monkeypatch.setattr(_native.Batch, "add", lambda *a, **k: False)
    monkeypatch.setattr(adam, "_groups_on", lambda device: True)
  make, fused = MAXIMIZE[name], (False if path == "eager" else None)
  runs = []
  for maximize in (True, False):
    params = _params(dtype)
    opt = make(params, fused, maximize)
    grads = _grads(3, dtype)
    _run(opt, params, grads if maximize else [[-g for g in gs] for gs in grads])
    runs.append(_snapshot(opt, params))
  assert _same(*runs)
  params = _params(dtype)
  _run(make(params, fused, False), params, _grads(3, dtype))  # descent: other params
  assert not _same(runs[0][:len(params)], [_bits(p) for p in params])


def test_maximize_follows_torch_adamw_in_fp32():
  """fp32 params, ``maximize=True``: as close to torch.optim.AdamW(maximize=True)
  in float64 as torch's own fp32 run, as test_fp32_params_as_accurate_as_torch_adamw
  finds for descent; and the params ascend."""
  params, grads = _params(torch.float32), _grads(300, torch.float32)
  start = [p.detach().clone() for p in params]
  ours, torch32 = _errors_against_float64_adamw(params, grads, maximize=True)
  assert ours <= torch32 and ours <= 1e-5
  # Against the gradients' mean direction: the params moved up it.
  mean = [sum(g[k] for g in grads) for k in range(len(params))]
  assert all(((p.detach() - s) * m).sum() > 0 for p, s, m in zip(params, start, mean))


@pytest.mark.slow  # a graph of its own: about 30 s to compile on a cold cache
def test_maximize_compiled_step_equals_eager():
  """fused=True compiles the per-tensor step of what the kernel does not
  take (here: non-contiguous params); with maximize it is the eager step's
  bits too."""
  out = []
  for fused in (False, True):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(17, 9, generator=gen).to(torch.bfloat16).t().requires_grad_()]
    opt = tb.adamw_bf16(params, 1e-2, weight_decay=0.1, fused=fused, maximize=True)
    _run(opt, params, [[(torch.randn(9, 17, generator=gen) * 0.1).to(torch.bfloat16)]
                       for _ in range(3)])
    out.append(_snapshot(opt, params))
  assert _same(*out)
