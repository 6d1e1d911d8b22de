"""torch's own GradScaler tests, run on ``tb.dynamic_loss_scale`` and on torch_bridge optimizers.

A port of PyTorch's ``test_grad_scaling_*`` cases (``_run_scaling_case``: two
``Linear(8, 8)`` layers, 4 batches, an inf written into one gradient at
iteration 2, ``init_scale=128``, ``growth_interval=1``, enabled and
disabled), with both scalers (ours and ``torch.amp.GradScaler``) driving
``torch.optim.SGD`` and torch_bridge optimizers, in fp32 and bf16:

* the scaled run ends where the unscaled control run ends (params,
  gradients left unscaled in ``p.grad``, every state tensor), within torch's
  tolerances, and with the scale ``128 * 2**unskipped * 0.5**skipped``;
* our scaler's scaled run equals ``torch.amp.GradScaler``'s bit for bit;
* GradScaler's public API: getters and setters, ``enabled=False``, state
  dicts both ways, pickling between iterations.
"""

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

import torch_bridge as tb  # noqa: E402
from test_torch_optim import _snapshot  # noqa: E402

SCALERS = {
    "torch_bridge": lambda **kw: tb.dynamic_loss_scale(**kw),
    "GradScaler": lambda **kw: torch.amp.GradScaler("cpu", **kw),
}
OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1.0),
    "adamw_bf16": lambda ps: tb.adamw_bf16(ps, lr=1e-2),
    "adam_fp32_master": lambda ps: tb.adam_fp32_master(ps, lr=1e-2),
    "master_weights(Adam)": lambda ps: tb.master_weights(torch.optim.Adam(ps, lr=1e-2)),
    "kahan_summation(SGD)": lambda ps: tb.kahan_summation(
        torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    "scaled_adam": lambda ps: tb.scaled_adam(ps, lr=1e-2, clipping_scale=2.0),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# torch's assertEqual tolerances (rtol, atol): its default for bf16, the
# test's own atol for fp32 (given per case).
BF16_TOL = (1.6e-2, 1e-5)
SKIP_ITER = 2


class Case:
  """``_create_scaling_case``: a control and a scaling model, their optimizers, data."""

  def __init__(self, make_opt, dtype, n_models=1, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def model():
      layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
      with torch.no_grad():
        for layer in layers:
          layer.weight.copy_(torch.randn(8, 8, generator=gen) * 0.3)
          layer.bias.copy_(torch.randn(8, generator=gen) * 0.1)
      return torch.nn.Sequential(*layers).to(dtype)
    self.control = [model() for _ in range(n_models)]
    self.scaling = [copy.deepcopy(m) for m in self.control]
    self.opt_control = [make_opt(list(m.parameters())) for m in self.control]
    self.opt_scaling = [make_opt(list(m.parameters())) for m in self.scaling]
    self.data = [(torch.randn(8, 8, generator=gen).to(dtype),
                  torch.randn(8, 8, generator=gen).to(dtype)) for _ in range(4)]
    self.loss_fn = torch.nn.MSELoss()


def _run_scaling_case(run, unskipped, skipped, scaler_name, opt_name, dtype, atol,
                      n_models=1):
  """Both passes (scaler enabled and disabled) of torch's ``_run_scaling_case``;
  returns the enabled pass's scaled models and optimizers."""
  out = None
  for enabled in (True, False):
    case = Case(OPTIMIZERS[opt_name], DTYPES[dtype], n_models)
    scaler = SCALERS[scaler_name](init_scale=128.0, growth_factor=2.0, enabled=enabled,
                                  growth_interval=1)
    run(case, case.control, case.opt_control, scaler, try_scaling_api=False)
    scaler = run(case, case.scaling, case.opt_scaling, scaler, try_scaling_api=True) or scaler
    if enabled:
      assert scaler.get_scale() == 128.0 * 2.0 ** unskipped * 0.5 ** skipped
      out = case
    else:
      assert scaler.get_scale() == 1.0
    rtol, tol = (1e-5, atol) if dtype == "float32" else BF16_TOL
    for mc, ms, oc, os in zip(case.control, case.scaling, case.opt_control, case.opt_scaling):
      for c, s in zip(mc.parameters(), ms.parameters()):
        torch.testing.assert_close(s.grad, c.grad, rtol=rtol, atol=tol)  # unscaled in place
        torch.testing.assert_close(s, c, rtol=rtol, atol=tol)
      for a, b in zip(_states(os), _states(oc)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=tol)
  return out


def _states(opt):
  """Every floating state tensor of ``opt`` (and of the optimizer it wraps)."""
  out = []
  for o in (opt, getattr(opt, "inner", None)):
    for state in (o.state.values() if o is not None else ()):
      out += [state[k] for k in sorted(state)
              if torch.is_tensor(state[k]) and state[k].is_floating_point()]
  return out


def _finish(loss, i, model, opt, scaler, try_scaling_api, scaled_clip=None, unscaled_clip=None):
  """Backward and step as the cases do: the scaled run writes an inf into one
  gradient at ``SKIP_ITER`` (if the scaler is enabled) and lets the scaler
  skip; the control run leaves that step out. ``scaled_clip`` runs on the
  scaled run's gradients before the inf, ``unscaled_clip`` on the control's
  (and on the scaled run's after ``unscale_``, when given alone)."""
  if try_scaling_api:
    scaler.scale(loss).backward()
    if scaled_clip is not None:
      scaled_clip(model)
    if i == SKIP_ITER and scaler.is_enabled():
      model[1].weight.grad.fill_(float("inf"))
    if unscaled_clip is not None and scaled_clip is None:
      scaler.unscale_(opt)
      unscaled_clip(model, error_if_nonfinite=False)
    scaler.step(opt)
    scaler.update()
  else:
    loss.backward()
    if unscaled_clip is not None:
      unscaled_clip(model)
    if not scaler.is_enabled() or i != SKIP_ITER:
      opt.step()


def _default(case, models, opts, scaler, try_scaling_api):
  (model,), (opt,) = models, opts
  for i, (x, y) in enumerate(case.data):
    opt.zero_grad()
    _finish(case.loss_fn(model(x), y), i, model, opt, scaler, try_scaling_api)


def _autocast(case, models, opts, scaler, try_scaling_api):
  """The forward pass under bf16 autocast in the scaled run; the scaler is
  pickled and unpickled after every iteration (torch's autocast case)."""
  (model,), (opt,) = models, opts
  for i, (x, y) in enumerate(case.data):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=try_scaling_api):
      loss = case.loss_fn(model(x), y)
    _finish(loss, i, model, opt, scaler, try_scaling_api)
    if try_scaling_api:
      scaler = pickle.loads(pickle.dumps(scaler))
  return scaler


MAX_NORM = 0.2


def _clip(model, max_norm=MAX_NORM, **kw):
  torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, **kw)


def _clipping(case, models, opts, scaler, try_scaling_api):
  """Clipping the scaled gradients at ``max_norm * scale``."""
  (model,), (opt,) = models, opts
  for i, (x, y) in enumerate(case.data):
    opt.zero_grad()
    _finish(case.loss_fn(model(x), y), i, model, opt, scaler, try_scaling_api,
            scaled_clip=lambda m: _clip(m, MAX_NORM * scaler.get_scale()), unscaled_clip=_clip)


def _clipping_separate_unscale(case, models, opts, scaler, try_scaling_api):
  """GradScaler's documented recipe: ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``."""
  (model,), (opt,) = models, opts
  for i, (x, y) in enumerate(case.data):
    opt.zero_grad()
    _finish(case.loss_fn(model(x), y), i, model, opt, scaler, try_scaling_api,
            unscaled_clip=_clip)


def _penalty(case, models, opts, scaler, try_scaling_api):
  """A gradient penalty: ``autograd.grad`` of the scaled loss, unscaled by hand."""
  (model,), (opt,) = models, opts
  for i, (x, y) in enumerate(case.data):
    opt.zero_grad()
    loss = case.loss_fn(model(x), y)
    params = list(model.parameters())
    if try_scaling_api:
      grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
      inv_scale = 1.0 / scaler.get_scale()
      grads = [g * inv_scale for g in grads]
    else:
      grads = torch.autograd.grad(loss, params, create_graph=True)
    grad_norm = sum(g.float().pow(2).sum() for g in grads).sqrt()
    _finish(loss + grad_norm, i, model, opt, scaler, try_scaling_api)


def _accumulation(case, models, opts, scaler, try_scaling_api):
  """Two micro-batches a step, no inf."""
  (model,), (opt,) = models, opts
  accumulate = 2
  for i, (x, y) in enumerate(case.data):
    loss = case.loss_fn(model(x), y) / accumulate
    if try_scaling_api:
      scaler.scale(loss).backward()
    else:
      loss.backward()
    if (i + 1) % accumulate == 0:
      if try_scaling_api:
        scaler.step(opt)
        scaler.update()
      else:
        opt.step()
      opt.zero_grad()


def _multiple(case, models, opts, scaler, try_scaling_api):
  """Two models, two optimizers, one scaler; an inf in the second's gradients
  skips only the second."""
  (m0, m1), (o0, o1) = models, opts
  for i, (x, y) in enumerate(case.data):
    o0.zero_grad()
    o1.zero_grad()
    out0, out1 = m0(x), m1(x)
    loss0 = case.loss_fn(0.3 * out0 + 0.7 * out1, y)
    loss1 = case.loss_fn(0.6 * out0 - 0.4 * out1, y)
    if try_scaling_api:
      scaler.scale(loss0).backward(retain_graph=True)
      scaler.scale(loss1).backward()
      if i == SKIP_ITER and scaler.is_enabled():
        m1[1].weight.grad.fill_(float("inf"))
      scaler.unscale_(o0)  # unscale_ on one optimizer only, as torch's case does
      scaler.step(o0)
      scaler.step(o1)
      scaler.update()
    else:
      loss0.backward(retain_graph=True)
      loss1.backward()
      o0.step()
      if not scaler.is_enabled() or i != SKIP_ITER:
        o1.step()


# name -> (run, unskipped, skipped, fp32 atol, models)
CASES = {
    "default": (_default, 3, 1, 1e-7, 1),
    "clipping": (_clipping, 3, 1, 1e-5, 1),
    "clipping_separate_unscale": (_clipping_separate_unscale, 3, 1, 1e-7, 1),
    "penalty": (_penalty, 3, 1, 1e-7, 1),
    "accumulation": (_accumulation, 2, 0, 1e-7, 1),
    "multiple": (_multiple, 3, 1, 1e-7, 2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scaled_run_equals_control_and_grad_scaler(case, opt_name, dtype):
  run, unskipped, skipped, atol, n_models = CASES[case]
  ours = _run_scaling_case(run, unskipped, skipped, "torch_bridge", opt_name, dtype, atol,
                           n_models)
  theirs = _run_scaling_case(run, unskipped, skipped, "GradScaler", opt_name, dtype, atol,
                             n_models)
  # Our scaler drives the optimizer exactly as torch.amp.GradScaler does.
  for ms, mt, os, ot in zip(ours.scaling, theirs.scaling, ours.opt_scaling, theirs.opt_scaling):
    params_s, params_t = list(ms.parameters()), list(mt.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params_s, params_t))
    assert all((a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
               for a, b in zip(params_s, params_t))
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(os, params_s),
                                                  _snapshot(ot, params_t)))


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_autocast_and_pickled_scaler_equal_grad_scaler(opt_name):
  """bf16 autocast, the scaler pickled every iteration: ours and GradScaler
  step fp32 params to the same bits (the scaled run differs from the fp32
  control by autocast's rounding, as in torch's own test)."""
  runs = []
  for scaler_name in SCALERS:
    case = Case(OPTIMIZERS[opt_name], torch.float32)
    scaler = SCALERS[scaler_name](init_scale=128.0, growth_factor=2.0, growth_interval=1)
    scaler = _autocast(case, case.scaling, case.opt_scaling, scaler, try_scaling_api=True)
    assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5
    params = list(case.scaling[0].parameters())
    runs.append([p.detach().clone() for p in params] + _snapshot(case.opt_scaling[0], params))
  assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("opt_name", [n for n in OPTIMIZERS if n != "SGD"])
def test_grads_invalidated_between_unscale_and_step_reach_the_params(scaler_name, opt_name):
  """After ``unscale_`` the scaler's decision is made: grads overwritten with
  inf or NaN afterwards are stepped (torch's test: the params go non-finite)."""
  case = Case(OPTIMIZERS[opt_name], torch.float32)
  model, opt = case.scaling[0], case.opt_scaling[0]
  scaler = SCALERS[scaler_name](init_scale=128.0)
  for j, (x, y) in enumerate(case.data):
    opt.zero_grad()
    scaler.scale(case.loss_fn(model(x), y)).backward()
    scaler.unscale_(opt)
    for p in model.parameters():
      p.grad.fill_(float("inf") if j % 2 else float("nan"))
    scaler.step(opt)
    scaler.update()
  assert all(not torch.isfinite(p).all() for p in model.parameters())


def test_fp16_grads_stay_scaled_and_are_guarded():
  """fp16 gradients (GradScaler refuses them) are handed to the step in
  fp32; ``p.grad`` keeps the scaled value, and clipping it after
  ``unscale_`` is an error that names ``scaler.clip_grad_norm_``."""
  p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
  opt = tb.adam_fp32_master([p], lr=1e-2)
  scaler = tb.dynamic_loss_scale(init_scale=2.0**10)
  scaler.scale((p.float() * 1e-6).sum()).backward()
  scaler.unscale_(opt)
  assert p.grad[0].item() == pytest.approx(1e-6 * 2**10, rel=1e-3)
  assert opt._unscaled_grads[p][0].item() == pytest.approx(1e-6, rel=1e-3)
  torch.nn.utils.clip_grad_norm_([p], 1e-9)
  with pytest.raises(RuntimeError, match="scaler.clip_grad_norm_"):
    scaler.step(opt)
  grad_scaler = torch.amp.GradScaler("cpu")
  grad_scaler.scale(torch.ones(()))
  with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
    grad_scaler.unscale_(opt)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sparse_gradients_of_a_plain_optimizer_as_grad_scaler(dtype):
  """``nn.Embedding(sparse=True)`` under a plain optimizer: the sparse values
  are unscaled and checked as GradScaler does (an inf in one skips the step),
  the same bits with either scaler; fp16 is refused with GradScaler's error."""
  ends = {}
  for name, make in SCALERS.items():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True).to(DTYPES[dtype])
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    scaler = make(init_scale=64.0, growth_interval=1)
    for i, idx in enumerate(([1, 4], [2, 2, 5], [0], [3, 1])):
      opt.zero_grad()
      loss = emb(torch.tensor(idx)).float().pow(2).sum() * (float("inf") if i == 2 else 1.0)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
    ends[name] = (emb.weight.detach().clone(), scaler.get_scale())
  (w_a, scale_a), (w_b, scale_b) = ends.values()
  assert torch.equal(w_a, w_b) and scale_a == scale_b == 64.0 * 2 * 2 / 2 * 2
  emb = torch.nn.Embedding(4, 2, sparse=True).half()
  emb(torch.tensor([1])).float().sum().backward()
  for make in SCALERS.values():
    scaler = make()
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
      scaler.unscale_(torch.optim.SGD(emb.parameters(), lr=0.1))


FUSED = {
    "AdamW(fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "Adam(fused)": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "SGD(fused)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
}


@pytest.mark.parametrize("unscale", [False, True])
@pytest.mark.parametrize("opt_name", list(FUSED))
def test_optimizers_that_unscale_inside_their_step_as_grad_scaler(opt_name, unscale):
  """GradScaler's ``_step_supports_amp_scaling`` contract (torch's fused
  optimizers unscale and skip inside their kernel): the gradients stay
  scaled unless ``unscale_`` was called, an inf skips the step, and params,
  gradients, optimizer state and scale equal GradScaler's bit for bit."""
  ends = {}
  for name, make in SCALERS.items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    opt = FUSED[opt_name](model.parameters())
    scaler = make(init_scale=128.0, growth_interval=1)
    for i in range(4):
      opt.zero_grad()
      loss = model(torch.randn(6, 5)).pow(2).sum()
      scaler.scale(loss * (float("inf") if i == 2 else 1.0)).backward()
      if unscale:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
      scaler.step(opt)
      assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
      scaler.update()
    ends[name] = (_snapshot(opt, list(model.parameters())),
                  [p.grad.clone() for p in model.parameters()], scaler.get_scale())
  (snap_a, grads_a, scale_a), (snap_b, grads_b, scale_b) = ends.values()
  assert scale_a == scale_b == 128.0 * 2 * 2 / 2 * 2
  assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
  assert len(snap_a) == len(snap_b) and all(torch.equal(a, b) for a, b in zip(snap_a, snap_b))


def test_the_step_contracts_of_grad_scaler():
  """An optimizer with ``_step_supports_amp_scaling`` sees ``grad_scale`` and
  ``found_inf`` (fp32 tensors) during its step, with scaled gradients; one
  whose step takes ``grad_scaler`` gets the scaler, with a FutureWarning."""
  class Seeing(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None):
      self.seen.append((self.grad_scale.item(), self.found_inf.dtype, self.found_inf.item(),
                        self.param_groups[0]["params"][0].grad.item()))

  class Taking(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
      self.seen.append(grad_scaler)

  for make in SCALERS.values():
    p = torch.nn.Parameter(torch.ones(()))
    opt = Seeing([p], lr=0.1)
    opt.seen = []
    scaler = make(init_scale=8.0)
    for factor in (1.0, float("inf")):
      scaler.scale(p * 3.0 * factor).backward()
      scaler.step(opt)
      scaler.update()
      p.grad = None
    assert opt.seen == [(8.0, torch.float32, 0.0, 24.0), (8.0, torch.float32, 1.0, float("inf"))]
    opt = Taking([p], lr=0.1)
    opt.seen = []
    scaler.scale(p * 3.0).backward()
    with pytest.warns(FutureWarning):
      scaler.step(opt)
    assert opt.seen == [scaler]


# ---------------------------------------------------------------------------
# The rest of GradScaler's API.
# ---------------------------------------------------------------------------


def test_getters_and_setters_match_grad_scaler():
  kw = dict(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
  ours, theirs = tb.dynamic_loss_scale(**kw), torch.amp.GradScaler("cpu", **kw)
  for name in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval",
               "is_enabled", "_get_growth_tracker"):
    assert getattr(ours, name)() == getattr(theirs, name)(), name
  for s in (ours, theirs):
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(5)
  for name in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
    assert getattr(ours, name)() == getattr(theirs, name)(), name
  with pytest.raises(ValueError, match="growth_factor must be > 1"):
    ours.set_growth_factor(0.5)
  with pytest.raises(ValueError, match="growth_interval"):
    ours.set_growth_interval(0)
  ours.set_min_scale(0.5)
  assert ours.get_min_scale() == 0.5


def test_a_disabled_scaler_is_a_no_op_like_grad_scaler():
  for scaler in (tb.dynamic_loss_scale(enabled=False),
                 torch.amp.GradScaler("cpu", enabled=False)):
    p = torch.nn.Parameter(torch.ones(3))
    opt = tb.adamw_bf16([p], lr=0.1)
    loss = (p * p).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    grad = p.grad.clone()
    assert scaler.unscale_(opt) is None
    assert torch.equal(p.grad, grad)
    calls = []
    assert scaler.step(opt, lambda: calls.append(1) or loss).item() == loss.item()
    assert calls == [1] and not torch.equal(p, torch.ones(3))  # the closure ran, p stepped
    scaler.update()
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 5.0})  # ignored
    assert scaler.get_scale() == 1.0
    pickle.loads(pickle.dumps(scaler))


def test_state_dicts_load_both_ways():
  s0 = tb.dynamic_loss_scale(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5,
                             growth_interval=2)
  for s1 in (torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0,
                                  backoff_factor=0.8, growth_interval=1),
             tb.dynamic_loss_scale(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8,
                                   growth_interval=1)):
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(),
            s1.get_growth_interval()) == (3.0, 4.0, 0.5, 2)
  ours = tb.dynamic_loss_scale(init_scale=6.0)
  ours.load_state_dict(torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0,
                                            growth_interval=2).state_dict())
  assert (ours.get_scale(), ours.get_growth_factor(), ours.get_growth_interval()) == (3.0, 4.0, 2)


def test_pickles_between_iterations_only():
  scaler = tb.dynamic_loss_scale(init_scale=3.0, growth_factor=4.0, growth_interval=2)
  p = torch.nn.Parameter(torch.ones(3))
  opt = tb.adamw_bf16([p], lr=0.1)
  scaler.scale((p * p).sum()).backward()
  scaler.unscale_(opt)
  with pytest.raises(RuntimeError, match="only be pickled at the beginning of an iteration"):
    pickle.dumps(scaler)
  scaler.step(opt)
  scaler.update()
  copy_ = pickle.loads(pickle.dumps(scaler))
  assert copy_.state_dict() == scaler.state_dict()
  assert copy_.scale(torch.tensor([4.0])).item() == 12.0


def test_scale_takes_nested_iterables_like_grad_scaler():
  scaler = tb.dynamic_loss_scale(init_scale=2.0)
  t = torch.full((1,), 4.0)
  out = scaler.scale([t, (t, [t])])
  assert isinstance(out, list) and isinstance(out[1], tuple)
  assert out[1][1][0].item() == 8.0
  assert [o.item() for o in scaler.scale(iter([t, t]))] == [8.0, 8.0]
  with pytest.raises(TypeError, match="iterable of tensors"):
    scaler.scale(4.0)


def test_grad_scale_will_not_overflow():
  model = torch.nn.Linear(5, 1)
  opt = tb.adamw_bf16(model.parameters(), lr=1e-3)
  scaler = tb.dynamic_loss_scale(growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
  opt.zero_grad()
  x = torch.randn(1, 5)
  y = 1e-30 * torch.randn(1, 1)
  scaler.scale(((model(x) - y) ** 2).mean()).backward()
  scaler.step(opt)
  scaler.update()
  assert torch.isfinite(scaler.counters()["scale"])
