"""torch_bridge.dynamic_loss_scale against torch.amp.GradScaler and optax_half.

* the scale / growth-tracker trajectory of torch.amp.GradScaler("cpu"),
  torch_bridge's scaler and optax_half's transformation are identical;
* a non-finite element anywhere changes no param or state bit, for every
  torch_bridge optimizer;
* fp16 grads reach torch_bridge optimizers unscaled in fp32 (GradScaler refuses
  them), and the result equals optax_half's, bit for bit;
* several optimizers per scaler, clipping, accumulation, state_dict.
"""

import copy
import io

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
from test_loss_scale import BAD_ARGS  # noqa: E402
from test_torch_optim import OPTIMIZERS, SHAPES, _bits, _snapshot, _same  # noqa: E402


def _pattern(seed, n=300):
  """Finite/non-finite flags: bursts of infs, lone infs and long finite runs."""
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < n:
    kind = rng.integers(4)
    if kind == 0:
      out += [False] * int(rng.integers(2, 6))          # a burst
    elif kind == 1:
      out += [False]                                     # a lone inf
    else:
      out += [True] * int(rng.integers(1, 40))           # a finite run
  return out[:n]


SCALER_CONFIGS = [
    dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=7),
    dict(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.75, growth_interval=3),
    dict(init_scale=2.0**120, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
]


@pytest.mark.parametrize("config", SCALER_CONFIGS, ids=["pow2", "non-pow2", "near-overflow"])
def test_scale_trajectory_equals_grad_scaler(config):
  """300 steps of bursts and long finite runs across many growth intervals:
  (scale, growth_tracker) identical at every step in all three scalers
  (min_scale low enough never to bind)."""
  flags = _pattern(hash(tuple(config.values())) % 2**32)
  grads = [torch.tensor([1.0, 2.0, 3.0]) if ok else torch.tensor([1.0, float("nan"), 3.0])
           for ok in flags]

  def torch_run(scaler):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    seen = []
    for g in grads:
      scaler.scale(torch.ones(()))
      p.grad = g.clone()
      scaler.step(opt)
      scaler.update()
      seen.append((float(scaler._scale), int(scaler._growth_tracker)))
    return seen

  reference = torch_run(torch.amp.GradScaler("cpu", **config))
  ours_torch = torch_run(tb.dynamic_loss_scale(min_scale=2.0**-100, **config))
  tx = oh.dynamic_loss_scale(optax.sgd(0.0), min_scale=2.0**-100, **config)
  params = {"w": jnp.zeros(3)}
  state, update, ours_jax = tx.init(params), jax.jit(tx.update), []
  for g in grads:
    _, state = update({"w": jnp.asarray(g.numpy())}, state, params)
    ours_jax.append((float(state.scale), int(state.growth_tracker)))
  assert ours_torch == reference
  assert ours_jax == reference
  assert sum(not f for f in flags) >= 20 and len({s for s, _ in reference}) > 5


def _full_snapshot(opt, params):
  """_snapshot plus the host-side group counters (``count``, ``lr``)."""
  groups = [torch.tensor([g.get("count", -1), g["lr"]], dtype=torch.float64)
            for o in (opt, getattr(opt, "inner", None)) if o is not None
            for g in o.param_groups]
  return _snapshot(opt, params) + groups


def _step(scaler, opt, params, grads):
  for p, g in zip(params, grads):
    p.grad = g.clone()
  scaler.step(opt)
  scaler.update()


def _grads_scaled(n, dtype, scale, seed=1):
  gen = torch.Generator().manual_seed(seed)
  return [[(torch.randn(s, generator=gen) * 0.1 * scale).to(dtype) for s in SHAPES]
          for _ in range(n)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_nonfinite_element_anywhere_changes_nothing(name, dtype):
  """NaN, +Inf, -Inf in one element of one param's grad: every param, every
  state tensor (moments, masters, Kahan buffers, step counts, the inner
  optimizer's state) is bitwise unchanged; the scale backs off."""
  gen = torch.Generator().manual_seed(0)
  params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
  with torch.no_grad():
    params[0].view(-1)[0] = -0.0
  opt = OPTIMIZERS[name](params)
  scaler = tb.dynamic_loss_scale(init_scale=2.0**8)
  for grads in _grads_scaled(3, dtype, 2.0**8):
    _step(scaler, opt, params, grads)
  rng = np.random.default_rng(0)
  k = 0
  for i in range(len(params)):
    for value in (np.nan, np.inf, -np.inf):
      grads = _grads_scaled(1, dtype, scaler.get_scale(), seed=2 + k)[0]
      grads[i].view(-1)[rng.integers(grads[i].numel())] = value
      before = _full_snapshot(opt, params)
      scale = scaler.get_scale()
      _step(scaler, opt, params, grads)
      assert _same(_full_snapshot(opt, params), before), (name, i, value)
      assert scaler.get_scale() == max(scale / 2, 1.0)  # min_scale 1
      assert scaler.get_growth_tracker() == 0
      k += 1
  assert scaler.state_dict()["skipped_steps"] == k == 3 * len(params)
  assert scaler.get_scale() == 1.0  # 2^8 backed off 9 times, floored
  assert not scaler.state_dict()["last_finite"]
  assert opt._unscaled_grads == {}  # nothing kept between steps
  before = _snapshot(opt, params)
  _step(scaler, opt, params, _grads_scaled(1, dtype, scaler.get_scale(), seed=99)[0])
  assert not _same(_snapshot(opt, params), before)


def test_fp16_grads_reach_the_step_in_fp32():
  """GradScaler refuses fp16 grads; ours hands widen(g) * (1/scale) to the
  step in fp32, exact below fp16's smallest subnormal, and leaves p.grad as it was."""
  p = torch.zeros(4, dtype=torch.float16, requires_grad=True)
  g_hat = torch.tensor([2.0**-10, 3 * 2.0**-12, -1.5, 65504.0], dtype=torch.float16)
  ref = torch.amp.GradScaler("cpu")
  ref.scale(torch.ones(()))
  p.grad = g_hat.clone()
  with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
    ref.unscale_(torch.optim.Adam([p]))

  opt = tb.adam_fp32_master([p], 1e-3)
  scaler = tb.dynamic_loss_scale()
  scaler.unscale_(opt)
  g32 = opt._unscaled_grads[p]
  assert g32.dtype == torch.float32
  assert np.array_equal(g32.numpy().astype(np.float64),
                        g_hat.numpy().astype(np.float64) / 2.0**16)
  assert torch.equal(p.grad, g_hat)
  plain = torch.optim.Adam([p])
  with pytest.raises(ValueError, match=r"master_weights\(optimizer\)"):
    tb.dynamic_loss_scale().unscale_(plain)


@pytest.mark.parametrize("dtype, compensation", default_or_slow(
    [(d, c) for c in ("kahan", "stochastic") for d in ("bfloat16", "float16")],
    default=[("bfloat16", "kahan"), ("float16", "stochastic")]))
def test_bitwise_equal_to_optax_half_with_skips(dtype, compensation):
  """adamw_bf16 under each framework's scaler, 20 steps with two non-finite
  ones, JAX op by op: params, moments and the scale agree bit for bit."""
  tdt, scale = getattr(torch, dtype), 2.0**4
  gen = torch.Generator().manual_seed(0)
  params = [torch.randn(s, generator=gen).to(tdt).requires_grad_() for s in SHAPES]
  p0 = [p.detach().clone() for p in params]
  grads = _grads_scaled(20, tdt, scale)
  for k in (4, 11):
    grads[k][k % 3].view(-1)[k] = float("inf")
  opt = tb.adamw_bf16(params, 1e-2, weight_decay=0.1, compensation=compensation, key=7)
  scaler = tb.dynamic_loss_scale(init_scale=scale, growth_interval=5)
  for g in grads:
    _step(scaler, opt, params, g)

  tx = oh.dynamic_loss_scale(
      oh.adamw_bf16(1e-2, weight_decay=0.1, compensation=compensation, key=7),
      init_scale=scale, growth_interval=5)
  jdt = getattr(jnp, dtype)
  jparams = {str(i): jnp.asarray(x.float().numpy()).astype(jdt) for i, x in enumerate(p0)}
  with jax.disable_jit():
    state = tx.init(jparams)
    for g in grads:
      jg = {str(i): jnp.asarray(x.float().numpy()).astype(jdt) for i, x in enumerate(g)}
      u, state = tx.update(jg, state, jparams)
      jparams = optax.apply_updates(jparams, u)
  assert scaler.get_scale() == float(state.scale)
  assert scaler.state_dict()["skipped_steps"] == int(state.skipped_steps) == 2
  core = state.inner_state.inner_state
  for i, p in enumerate(params):
    mine = p.detach().float().numpy().astype(jparams[str(i)].dtype)
    assert ulp_diff(np.asarray(jparams[str(i)]), mine) == 0
    for name in ("mu", "nu"):
      theirs = np.asarray(getattr(core, name)[str(i)])
      assert ulp_diff(theirs, opt.state[p][name].float().numpy().astype(theirs.dtype)) == 0
    if compensation == "kahan":
      c = np.asarray(state.inner_state.compensation[str(i)])
      assert ulp_diff(c, opt.state[p]["compensation"].float().numpy().astype(c.dtype)) == 0


def test_master_weights_fp16_equals_fp32_adam_on_unscaled_grads():
  """master_weights(Adam) on fp16 params with the scaler: the fp32 master is
  bitwise torch.optim.Adam on fp32 params fed the exact unscaled grads, on unit-normal
  weights that cross zero (a step writes the master's rounding)."""
  scale = 2.0**12
  gen = torch.Generator().manual_seed(0)
  p16 = [torch.randn(s, generator=gen).half().requires_grad_() for s in SHAPES]
  p32 = [p.detach().float().requires_grad_() for p in p16]
  opt16 = tb.master_weights(torch.optim.Adam(p16, lr=1e-2))
  opt32 = torch.optim.Adam(p32, lr=1e-2)
  scaler = tb.dynamic_loss_scale(init_scale=scale, growth_interval=1000)
  for grads in _grads_scaled(30, torch.float16, scale):
    _step(scaler, opt16, p16, grads)
    for p, g in zip(p32, grads):
      p.grad = g.float() / scale
    opt32.step()
  masters = [opt16.state[p]["master"] for p in p16]
  for m, p, q in zip(masters, p32, p16):
    assert torch.equal(_bits(m), _bits(p))
    assert torch.equal(_bits(q), _bits(p.detach().half()))


def test_several_optimizers_share_one_scaler_like_grad_scaler():
  """The GAN case: two optimizers, one scaler; an inf in one optimizer's grads
  skips that optimizer only and backs the scale off once. fp32 params, so
  torch.amp.GradScaler is a live reference: every param bitwise equal."""
  def make():
    gen = torch.Generator().manual_seed(0)
    d = [torch.randn(5, 3, generator=gen).requires_grad_()]
    g = [torch.randn(7, generator=gen).requires_grad_()]
    return d, g, torch.optim.Adam(d, lr=1e-2), torch.optim.AdamW(g, lr=1e-2)

  def run(scaler):
    d, g, opt_d, opt_g = make()
    gen = torch.Generator().manual_seed(1)
    for t in range(40):
      scaler.scale(torch.ones(()))
      for ps, opt, bad in ((d, opt_d, t % 7 == 3), (g, opt_g, t % 11 == 5)):
        for p in ps:
          p.grad = torch.randn(p.shape, generator=gen) * scaler.get_scale()
          if bad:
            p.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
      scaler.update()
    return [_bits(p) for p in d + g], scaler.get_scale()

  config = dict(init_scale=2.0**10, growth_interval=4)
  ref_params, ref_scale = run(torch.amp.GradScaler("cpu", **config))
  our_params, our_scale = run(tb.dynamic_loss_scale(**config))
  assert our_scale == ref_scale
  assert all(torch.equal(a, b) for a, b in zip(our_params, ref_params))


def test_clip_grad_norm_clips_what_the_step_uses():
  """fp32 params: scaler.clip_grad_norm_ equals GradScaler.unscale_ +
  torch.nn.utils.clip_grad_norm_ (to 1 fp32 ULP). fp16 params: it clips the
  fp32 grads handed to the step; clipping p.grad instead is caught."""
  gen = torch.Generator().manual_seed(0)
  grads = [torch.randn(s, generator=gen) * 4 for s in SHAPES]
  a = [torch.zeros(s, requires_grad=True) for s in SHAPES]
  b = [torch.zeros(s, requires_grad=True) for s in SHAPES]
  ref, ours = torch.amp.GradScaler("cpu", init_scale=2.0**8), tb.dynamic_loss_scale(2.0**8)
  for ps, scaler in ((a, ref), (b, ours)):
    scaler.scale(torch.ones(()))
    for p, g in zip(ps, grads):
      p.grad = g * 2.0**8
  ref.unscale_(torch.optim.SGD(a, lr=1.0))
  ref_norm = torch.nn.utils.clip_grad_norm_(a, 1.0)
  our_norm = ours.clip_grad_norm_(torch.optim.SGD(b, lr=1.0), 1.0)
  assert ulp_diff(our_norm.numpy(), ref_norm.numpy()) <= 1
  for x, y in zip(a, b):
    assert ulp_diff(x.grad.numpy(), y.grad.numpy()) <= 1

  p16 = [torch.zeros(s, dtype=torch.float16, requires_grad=True) for s in SHAPES]
  opt = tb.adamw_bf16(p16, 1e-2)
  for p, g in zip(p16, grads):
    p.grad = (g * 2.0**8).half()
  norm = ours.clip_grad_norm_(opt, 1.0)
  handed = [opt._unscaled_grads[p] for p in p16]
  assert abs(float(torch.linalg.vector_norm(torch.cat([h.view(-1) for h in handed]))) - 1) < 1e-5
  assert float(norm) > 10
  ours.step(opt)
  ours.update()
  for p, g in zip(p16, grads):
    p.grad = (g * ours.get_scale()).half()
  ours.unscale_(opt)
  torch.nn.utils.clip_grad_norm_(p16, 1.0)
  before = _snapshot(opt, p16)
  with pytest.raises(RuntimeError, match="clip_grad_norm_"):
    ours.step(opt)
  assert _same(_snapshot(opt, p16), before)


def test_accumulate_then_step_skips_the_whole_window():
  """Two backward passes into p.grad (fp16 model, master_weights(Adam)), then
  one scaler.step: close to the fp32 model trained the same way; an inf in one
  micro-batch skips the accumulated step and leaves every bit in place."""
  def model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).to(dtype)

  def train(dtype, poison_step=None, steps=60):
    net = model(dtype)
    opt = tb.master_weights(torch.optim.Adam(net.parameters(), lr=1e-2))
    scaler = tb.dynamic_loss_scale(init_scale=2.0**10)
    gen = torch.Generator().manual_seed(1)
    snapshots = []
    for t in range(steps):
      opt.zero_grad()
      for micro in range(2):
        x = torch.randn(16, 8, generator=gen)
        y = x.sum(1, keepdim=True).sin()
        if t == poison_step and micro == 1:
          x[3, 3] = float("inf")
        loss = ((net(x.to(dtype)).float() - y) ** 2).mean() / 2
        scaler.scale(loss).backward()
      snapshots.append(_snapshot(opt, list(net.parameters())))
      scaler.step(opt)
      scaler.update()
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(9))
    y = x.sum(1, keepdim=True).sin()
    with torch.no_grad():
      final = float(((net(x.to(dtype)).float() - y) ** 2).mean())
    return final, snapshots, _snapshot(opt, list(net.parameters())), scaler

  loss32, _, _, _ = train(torch.float32)
  loss16, _, _, scaler = train(torch.float16)
  assert abs(loss16 / loss32 - 1) < 0.05, (loss16, loss32)
  assert scaler.state_dict()["skipped_steps"] == 0
  _, snaps, _, scaler = train(torch.float16, poison_step=30, steps=31)
  _, _, after, _ = train(torch.float16, poison_step=30, steps=31)
  assert _same(after, snaps[30])
  assert scaler.get_scale() == 2.0**9 and scaler.state_dict()["skipped_steps"] == 1


def test_state_dict_round_trip_and_grad_scaler_compatibility():
  scaler = tb.dynamic_loss_scale(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.75,
                                 growth_interval=3, min_scale=0.5)
  p = torch.zeros(2, requires_grad=True)
  opt = torch.optim.SGD([p], lr=0.0)
  flags = _pattern(3, 50)
  for ok in flags[:25]:
    p.grad = torch.tensor([1.0, 1.0 if ok else float("nan")])
    scaler.step(opt)
    scaler.update()
  buf = io.BytesIO()
  torch.save(scaler.state_dict(), buf)
  buf.seek(0)
  resumed = tb.dynamic_loss_scale()
  resumed.load_state_dict(torch.load(buf))
  assert resumed.state_dict() == scaler.state_dict()
  for s in (scaler, resumed):
    for ok in flags[25:]:
      p.grad = torch.tensor([1.0, 1.0 if ok else float("nan")])
      s.step(opt)
      s.update()
  assert resumed.state_dict() == scaler.state_dict()
  expected_keys = set(torch.amp.GradScaler("cpu").state_dict())
  assert expected_keys <= set(scaler.state_dict())
  ref = torch.amp.GradScaler("cpu")
  ref.load_state_dict(scaler.state_dict())
  ref.scale(torch.ones(()))
  assert ref.state_dict() == {k: scaler.state_dict()[k] for k in expected_keys}
  theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=9)
  ours = tb.dynamic_loss_scale()
  ours.load_state_dict(theirs.state_dict())
  assert ours.get_scale() == 8.0 and ours.state_dict()["growth_interval"] == 9


def test_misuse_gets_clear_errors():
  p = torch.zeros(2, requires_grad=True)
  opt = torch.optim.SGD([p], lr=0.1)
  scaler = tb.dynamic_loss_scale()
  with pytest.raises(RuntimeError, match="No inf checks were recorded"):
    scaler.update()
  p.grad = torch.ones(2)
  scaler.unscale_(opt)
  with pytest.raises(RuntimeError, match="already been called"):
    scaler.unscale_(opt)
  scaler.step(opt)
  with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
    scaler.step(opt)
  with pytest.raises(RuntimeError, match="after step"):
    scaler.unscale_(opt)
  scaler.update()
  with pytest.raises(RuntimeError, match="closures are not supported"):
    scaler.step(opt, closure=lambda: 0.0)
  with pytest.raises(TypeError, match="float loss"):
    scaler.scale(torch.tensor(3))
  with pytest.raises(RuntimeError, match="state dict is empty"):
    scaler.load_state_dict({})
  with pytest.raises(ValueError, match="growth_factor must be > 1"):
    tb.dynamic_loss_scale(growth_factor=0.5)
  emb = torch.nn.Embedding(4, 2, sparse=True)
  emb(torch.tensor([1])).sum().backward()
  with pytest.raises(RuntimeError, match="sparse gradient; torch_bridge optimizers need dense"):
    tb.dynamic_loss_scale().unscale_(tb.master_weights(torch.optim.SGD(emb.parameters(), lr=0.1)))
  scaler = tb.dynamic_loss_scale()
  scaler.unscale_(torch.optim.SGD(emb.parameters(), lr=0.1))  # a plain optimizer: unscaled
  with pytest.raises(RuntimeError, match="sparse"):
    scaler.clip_grad_norm_(torch.optim.SGD(emb.parameters(), lr=0.1), 1.0)


def test_step_takes_a_none_closure_and_passes_arguments_on():
  """``scaler.step(optimizer, None)`` (accelerate's call) and ``closure=None``
  step as ``scaler.step(optimizer)`` does; other arguments reach
  ``optimizer.step`` as with ``torch.amp.GradScaler``; a closure is refused
  either way, before anything steps."""
  class Recording(torch.optim.SGD):
    def step(self, closure=None, *args, **kwargs):
      self.calls.append((closure, args, kwargs))
      return super().step(closure)

  results = []
  for call in (lambda s, o: s.step(o), lambda s, o: s.step(o, None),
               lambda s, o: s.step(o, closure=None)):
    ps = [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(2)]
    opt = tb.adamw_bf16(ps, lr=0.1)
    scaler = tb.dynamic_loss_scale(init_scale=4.0)
    for _ in range(2):
      scaler.scale((ps[0] * ps[1]).sum()).backward()
      assert call(scaler, opt) is None
      scaler.update()
      opt.zero_grad()
    results.append([_bits(p) for p in ps] + [_bits(opt.state[p]["mu"]) for p in ps])
  assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
  assert not torch.equal(results[0][0], _bits(torch.ones(3, dtype=torch.bfloat16)))
  p = torch.nn.Parameter(torch.ones(2))
  opt = Recording([p], lr=0.1)
  opt.calls = []
  scaler = tb.dynamic_loss_scale()
  for args, kwargs in (((None,), {}), ((None, 7), {"extra": 1}), ((), {"closure": None})):
    scaler.scale(p.sum()).backward()
    scaler.step(opt, *args, **kwargs)
    scaler.update()
    opt.zero_grad()
  assert opt.calls == [(None, (), {}), (None, (7,), {"extra": 1}), (None, (), {})]
  stepped = p.detach().clone()
  assert not torch.equal(stepped, torch.ones(2))
  scaler.scale(p.sum()).backward()
  for refused in (lambda: scaler.step(opt, lambda: 0.0),
                  lambda: scaler.step(opt, closure=lambda: 0.0)):
    with pytest.raises(RuntimeError, match="closures are not supported"):
      refused()
  assert len(opt.calls) == 3 and torch.equal(p.detach(), stepped)
  scaler.step(opt, None)  # the refusals left the scaler's state as it was
  assert len(opt.calls) == 4


def test_scale_keeps_fp16_losses_finite_and_update_accepts_new_scale():
  scaler = tb.dynamic_loss_scale()
  out = scaler.scale(torch.tensor(10.0, dtype=torch.float16))
  assert out.dtype == torch.float32 and float(out) == 655360.0
  outs = scaler.scale([torch.ones(()), torch.ones((), dtype=torch.bfloat16)])
  assert [float(o) for o in outs] == [65536.0, 65536.0]
  scaler.update(new_scale=128.0)
  assert scaler.get_scale() == 128.0
  c = scaler.counters()
  assert c["scale"].dtype == torch.float32 and c["growth_tracker"].dtype == torch.int32
  assert copy.deepcopy(scaler).get_scale() == 128.0


@pytest.mark.parametrize("kwargs, error, message", BAD_ARGS)
def test_bad_arguments_same_messages_as_jax(kwargs, error, message):
  """The argument checks are written once per framework; this keeps them equal."""
  with pytest.raises(error, match=message):
    tb.dynamic_loss_scale(**kwargs)


def test_several_torch_bridge_optimizers_with_fp16_params():
  """Two adamw_bf16 optimizers on fp16 params, one scaler: an inf in one
  skips that one (bitwise) while the other equals a solo run."""
  gen = torch.Generator().manual_seed(0)
  a = [torch.randn(6, 3, generator=gen).half().requires_grad_()]
  b = [torch.randn(5, generator=gen).half().requires_grad_()]
  solo = [b[0].detach().clone().requires_grad_()]
  opt_a, opt_b, opt_solo = (tb.adamw_bf16(ps, 1e-2) for ps in (a, b, solo))
  scaler, solo_scaler = tb.dynamic_loss_scale(2.0**6), tb.dynamic_loss_scale(2.0**6)
  grads = _grads_scaled(1, torch.float16, 2.0**6, seed=5)[0]
  a[0].grad = (torch.randn(6, 3, generator=gen) * 2.0**6).half()
  a[0].grad[1, 1] = float("inf")
  b[0].grad = solo[0].grad = grads[1][:5].clone()
  before_a = _full_snapshot(opt_a, a)
  scaler.step(opt_a)
  scaler.step(opt_b)
  scaler.update()
  solo_scaler.step(opt_solo)
  solo_scaler.update()
  assert _same(_full_snapshot(opt_a, a), before_a)
  assert torch.equal(_bits(b[0]), _bits(solo[0]))
  assert scaler.get_scale() == 2.0**5 and solo_scaler.get_scale() == 2.0**6
  assert opt_a._unscaled_grads == {} and opt_b._unscaled_grads == {}


def test_min_scale_floor_and_replaced_grads():
  p = [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)]
  opt = tb.adamw_bf16(p, 1e-2)
  scaler = tb.dynamic_loss_scale(init_scale=4.0, min_scale=2.0)
  for _ in range(3):
    p[0].grad = torch.tensor([1.0, float("nan"), 1.0]).bfloat16()
    scaler.step(opt)
    scaler.update()
  assert scaler.get_scale() == 2.0 and scaler.state_dict()["skipped_steps"] == 3
  # bf16 gradients are unscaled in place: a gradient replaced after unscale_
  # is the one stepped, as with GradScaler.
  p[0].grad = torch.ones(3, dtype=torch.bfloat16)
  scaler.unscale_(opt)
  assert p[0].grad.tolist() == [0.5, 0.5, 0.5]
  p[0].grad = torch.zeros(3, dtype=torch.bfloat16)
  scaler.step(opt)
  scaler.update()
  assert p[0].tolist() == [0.0, 0.0, 0.0]
  # fp16 gradients stay scaled and their fp32 copy is stepped: replacing one is an error.
  h = [torch.zeros(3, dtype=torch.float16, requires_grad=True)]
  opt16 = tb.adamw_bf16(h, 1e-2)
  h[0].grad = torch.ones(3, dtype=torch.float16)
  scaler.unscale_(opt16)
  h[0].grad = h[0].grad.clamp(max=0.5)  # a new tensor: not what was unscaled
  with pytest.raises(RuntimeError, match="changed after scaler.unscale_"):
    scaler.step(opt16)


def test_unscale_checks_everything_before_changing_anything():
  """An fp16 grad the optimizer would step in fp16 (a plain optimizer, or a
  master_weights wrapper whose master_dtype is fp16) is refused before any
  other gradient is unscaled."""
  p32 = torch.zeros(2, requires_grad=True)
  p16 = torch.zeros(2, dtype=torch.float16, requires_grad=True)
  for opt in (torch.optim.SGD([p32, p16], lr=0.1),
              tb.master_weights(torch.optim.SGD([p32, p16], lr=0.1),
                                master_dtype=torch.float16)):
    p32.grad = torch.full((2,), 8.0)
    p16.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
      tb.dynamic_loss_scale(init_scale=4.0).unscale_(opt)
    assert torch.equal(p32.grad, torch.full((2,), 8.0))
