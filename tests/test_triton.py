"""The multi-tensor Triton step (``torch_bridge._triton``) on CPU, in Triton's interpreter.

CI has no GPU, so these tests run the kernels with ``TRITON_INTERPRET=1``
(set per test, so that nothing else in the process is interpreted): the
integer-bit roundings equal torch's conversions, and every mode stepped
through the kernel equals the eager per-tensor step (``fused=False``) bit for
bit in params and every state buffer. On a GPU, tests/test_gpu.py runs the
same comparison compiled.
"""

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch_bridge as tb  # noqa: E402
from conftest import assert_same_torch_runs, torch_bits  # noqa: E402
from suite_helpers import host_work  # noqa: E402
from torch_bridge import _triton, adam, rounding  # noqa: E402

SHAPES = [(1,), (7,), (10, 100), (4099,)]


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
  """Triton's interpreter for this test only."""
  monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
  """Counts the plans run (one launch each, the tensors aligned) by number of tensors."""
  counts = collections.Counter()
  run = _triton.Plan.run

  def counted(self, *args, **kwargs):
    counts[self.n] += 1
    return run(self, *args, **kwargs)
  monkeypatch.setattr(_triton.Plan, "run", counted)
  return counts


def _words(*values):
  """int32 tensor of uint32 bit patterns."""
  return torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int64
                      ).to(torch.int32)


def _edge_values() -> torch.Tensor:
  """fp32 values at every corner of the bf16 and fp16 roundings, both signs."""
  bits = [0, 1, 0x7FFFFF, 0x800000, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF,
          0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7EFFFF, 0x7F7E8000,
          0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # bf16 ties to even, both ways
          0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x477FFFFF,  # fp16 top
          0x38800000, 0x387FFFFF, 0x38000000, 0x33800000, 0x33000000, 0x33000001,  # fp16 small
          0x32FFFFFF, 0x337FFFFF, 0x33C00000, 0x34200000, 0x34400000, 0x34600000,
          0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F802000]  # fp16 ties to even
  # every fp16 subnormal and its midpoints (ties), with neighbours one fp32 ULP away
  sub = torch.arange(0, 2048, dtype=torch.float64) * 2.0**-25
  sub32 = sub.to(torch.float32).view(torch.int32)
  words = torch.cat([_words(*bits), sub32, sub32 + 1, sub32 - 1])
  gen = torch.Generator().manual_seed(0)
  rand = torch.randint(-2**31, 2**31 - 1, (20000,), dtype=torch.int32, generator=gen)
  words = torch.cat([words, rand])
  words = torch.cat([words, words | -2**31])  # both signs
  return words.view(torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
  """Elementwise: equal bits, or both NaN (NaN payloads are not matched)."""
  return (a.view(torch.int16) == b.view(torch.int16)) | (torch.isnan(a) & torch.isnan(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nearest_rounding_equals_torch(dtype):
  x = _edge_values()
  got, want = _triton.round_bits(x, dtype), x.to(dtype)
  bad = ~_same_bits(got, want)
  assert not bad.any(), [(hex(w & 0xFFFFFFFF), v) for w, v in zip(
      x[bad].view(torch.int32).tolist()[:5], x[bad].tolist()[:5])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_equals_rounding(dtype):
  x = _edge_values()
  gen = torch.Generator().manual_seed(1)
  words = torch.randint(-2**31, 2**31 - 1, x.shape, dtype=torch.int32, generator=gen)
  words[:8] = _words(0, 0xFFFFFFFF, 0x8000, 0x7FFF, 0xFFFF0000, 0x0000FFFF, 0x80000000, 1)
  got = _triton.round_bits(x, dtype, words)
  assert _same_bits(got, rounding.stochastic_round(x, dtype, words)).all()


# name -> (factory, param dtype); each factory takes (params, fused)
CASES = {
    "bf16/kahan": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, weight_decay=0.1, fused=f),
                   torch.bfloat16),
    "bf16/split": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, weight_decay=0.1, fused=f,
                                              compensation="split"), torch.bfloat16),
    "bf16/stochastic": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, weight_decay=0.1, fused=f,
                                                   compensation="stochastic"), torch.bfloat16),
    "bf16/none": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, weight_decay=0.1, fused=f,
                                             compensation="none"), torch.bfloat16),
    "bf16/kahan/fp32-moments/maximize": (
        lambda p, f: tb.adamw_bf16(p, lr=1e-2, fused=f, mu_dtype=torch.float32,
                                   nu_dtype=torch.float32, maximize=True), torch.bfloat16),
    "bf16/kahan/nearest-moments": (
        lambda p, f: tb.adamw_bf16(p, lr=1e-2, fused=f, state_rounding="nearest"),
        torch.bfloat16),
    "bf16/adam_fp32_master": (lambda p, f: tb.adam_fp32_master(p, lr=1e-2, weight_decay=0.1,
                                                               fused=f), torch.bfloat16),
    "fp32/scale_by_adamw": (lambda p, f: tb.scale_by_adamw(p, lr=1e-2, weight_decay=0.1,
                                                           fused=f), torch.float32),
    "fp16/kahan": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, weight_decay=0.1, fused=f),
                   torch.float16),
    "fp16/split->master": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, fused=f,
                                                      compensation="split"), torch.float16),
    "fp16/stochastic": (lambda p, f: tb.adamw_bf16(p, lr=1e-2, fused=f,
                                                   compensation="stochastic"), torch.float16),
    "fp16/none/fp16-moments": (
        lambda p, f: tb.adamw_bf16(p, lr=1e-2, fused=f, compensation="none",
                                   mu_dtype=torch.float16, nu_dtype=torch.float16),
        torch.float16),
    "bf16/scale_by_adamw/stochastic-moments": (
        lambda p, f: tb.scale_by_adamw(p, lr=1e-2, fused=f, state_rounding="stochastic"),
        torch.bfloat16),
}


def _train(make, dtype, triton: bool, steps=3, shapes=SHAPES, misaligned=False, write=None):
  """``steps`` steps; gradients written into the same tensors (so the Triton
  plans replay after the first step). ``misaligned``: every other param a
  view 2 bytes into its storage; ``write``: at that step the params are
  written from outside first."""
  gen = torch.Generator().manual_seed(0)
  params = []
  for k, s in enumerate(shapes):
    p = torch.randn(s, generator=gen).to(dtype)
    if misaligned and k % 2:
      p = torch.empty(p.numel() + 1, dtype=dtype)[1:].view(s).copy_(p)
    params.append(p.requires_grad_())
  opt = make(params, None if triton else False)
  opt._triton = triton
  for step in range(steps):
    for p in params:
      g = (torch.randn(p.shape, generator=gen) * 0.1).to(dtype)
      if p.grad is None:
        p.grad = g
      else:
        p.grad.copy_(g)
    if step == write:
      with torch.no_grad():
        for p in params:
          p.mul_(0.5)
    opt.step()
  return params, opt


@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_eager(name, launches):
  make, dtype = CASES[name]
  triton = _train(make, dtype, True)
  assert launches == {len(SHAPES): 3}  # one launch per step for all tensors
  assert triton[1]._replay is not None  # the last two steps replayed the plans
  assert_same_torch_runs(triton, _train(make, dtype, False))
  assert all(int(s["step"]) == 3 for s in triton[1].state.values())


@pytest.mark.parametrize("name", ["bf16/kahan", "bf16/adam_fp32_master", "fp16/stochastic"])
def test_misaligned_and_outside_writes_step_as_eager(name, launches):
  """Tensors not 16-byte aligned take the kernel's scalar path (a second
  launch of the same plan); params written from outside between steps end
  the replay, and the full step re-seeds the buffers as the eager one does."""
  make, dtype = CASES[name]
  triton = _train(make, dtype, True, steps=4, misaligned=True, write=2)
  assert launches == {len(SHAPES): 4}
  assert [c["ALIGNED"] for *_, c in triton[1]._replay.plans[0][0].launches] == [True, False]
  assert_same_torch_runs(triton, _train(make, dtype, False, steps=4, misaligned=True, write=2))


def test_resume_equals_uninterrupted():
  """A Triton run saved and loaded into a new optimizer (whose plans are made
  again) steps as the run that went on."""
  make, dtype = CASES["bf16/stochastic"]
  whole = _train(make, dtype, True, steps=4)
  half = _train(make, dtype, True, steps=2)
  params = [p.detach().clone().requires_grad_() for p in half[0]]
  opt = make(params, None)
  opt._triton = True
  opt.load_state_dict(half[1].state_dict())
  gen = torch.Generator().manual_seed(0)
  for s in SHAPES:  # the same draws as _train's: the initial params, then the gradients
    torch.randn(s, generator=gen)
  for step in range(4):
    grads = [(torch.randn(p.shape, generator=gen) * 0.1).to(dtype) for p in params]
    if step >= 2:
      for p, g in zip(params, grads):
        p.grad = g
      opt.step()
  assert_same_torch_runs(whole, (params, opt))


def _host_step(n: int, monkeypatch, scaler=None) -> tuple:
  """Python calls in torch_bridge, torch ops and launches of one replayed
  ``opt.step()`` of ``n`` bf16 tensors (the launches recorded, not run);
  ``scaler``: ``grad_scale`` and ``found_inf`` set on the optimizer, as
  GradScaler sets them."""
  gen = torch.Generator().manual_seed(0)
  params = [torch.randn(64 + k, generator=gen).to(torch.bfloat16).requires_grad_()
            for k in range(n)]
  opt = tb.adamw_bf16(params, lr=1e-2, weight_decay=0.1)
  opt._triton = True
  for p in params:
    p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
  for name, value in (scaler or {}).items():
    setattr(opt, name, value)
  opt.step()
  launched = []
  with monkeypatch.context() as patch:
    patch.setattr(_triton, "_launch", lambda kernel, grid, *a, **k: launched.append(
        kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__))
    calls, ops = host_work(opt.step)
  return calls, ops, launched


def test_host_step_is_the_same_for_any_number_of_tensors(monkeypatch):
  """A replayed step makes the same Python calls whatever the number of
  tensors, no torch op but the profiler's record_function of
  torch.optim's step wrapper (so no allocation and no scalar read), and two
  launches: the step and the step counts' advance."""
  small, large = _host_step(8, monkeypatch), _host_step(40, monkeypatch)
  assert small[0] == large[0] and sum(small[0].values()) < 40, (small[0], large[0])
  for calls, ops, launched in (small, large):
    assert set(ops) <= {"profiler._record_function_enter_new.default",
                        "profiler._record_function_exit._RecordFunction"}, ops
    assert launched == ["adamw_kernel", "advance_kernel"]


def test_host_step_with_a_grad_scaler_is_the_same(monkeypatch):
  """GradScaler's ``grad_scale`` and ``found_inf`` (set on the optimizer for
  its step) go to the kernel as they are: the replayed step still makes the
  same Python calls whatever the number of tensors, and no torch op."""
  scaler = dict(grad_scale=torch.full((), 1024.0), found_inf=torch.zeros(()))
  small, large = (_host_step(n, monkeypatch, scaler) for n in (8, 40))
  assert small[0] == large[0] and sum(small[0].values()) < 45, (small[0], large[0])
  for calls, ops, launched in (small, large):
    assert set(ops) <= {"profiler._record_function_enter_new.default",
                        "profiler._record_function_exit._RecordFunction"}, ops
    assert launched == ["adamw_kernel", "advance_kernel"]


def _scaled_grads(params, gen, scale: float, step: int, inf_at: int):
  grads = []
  for i, p in enumerate(params):
    g = torch.randn(p.shape, generator=gen) * 0.1
    if step == inf_at and i == 1:
      g[3] = float("inf")
    grads.append((g * scale).to(p.dtype))  # a backward of the scaled loss
  return grads


@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_grad_scaler_unscales_and_skips_in_the_kernel(dtype, schedule):
  """torch.amp.GradScaler with the Triton step (``_step_supports_amp_scaling``):
  the gradients stay scaled (fp16 ones too, which GradScaler.unscale_ refuses),
  the kernel multiplies them by f32(1 / scale) and skips the step where one
  is not finite. Bit for bit the eager step fed ``widen(g) * inv_scale``,
  and not stepped where the scaler found an inf; with an lr schedule the
  skip is read on the host, so the group count stays too."""
  gen = torch.Generator().manual_seed(0)
  init = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
  lr = (lambda count: 1e-2 / (1 + count)) if schedule else 1e-2
  runs, counts, scales = [], [], []
  for triton in (True, False):
    gen = torch.Generator().manual_seed(1)
    params = [p.clone().requires_grad_() for p in init]
    opt = tb.adamw_bf16(params, learning_rate=lr, weight_decay=0.1,
                        fused=None if triton else False)
    opt._triton = triton
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    assert opt._step_supports_amp_scaling is triton
    for step in range(6):
      scaler.scale(torch.ones(()))  # as a loss is scaled (the scale is made lazily)
      scale = scaler.get_scale() if triton else scales[step]
      scales.append(scale)
      grads = _scaled_grads(params, gen, scale, step, inf_at=2)
      if triton:
        for p, g in zip(params, grads):
          p.grad = g
        scaler.step(opt)
        assert all(torch.equal(torch_bits(p.grad), torch_bits(g)) for p, g in zip(params, grads))
        scaler.update()
      else:  # the reference: unscaled by hand, no step on an inf
        inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        unscaled = [g.float() * inv for g in grads]
        finite = all(torch.isfinite(u).all() for u in unscaled)
        for p, u in zip(params, unscaled):
          p.grad, p.main_grad = None, u
        if finite:
          opt.step()
    runs.append((params, opt))
    counts.append(opt.param_groups[0]["count"])
  assert_same_torch_runs(*runs)
  assert int(runs[0][1].state[runs[0][0][0]]["step"]) == 5
  assert scales[:6] == [2.0**12, 2.0**12, 2.0**13, 2.0**12, 2.0**12, 2.0**13]  # grew, backed off
  # the skipped step: counted on the device path unless the schedule needs it read
  assert counts == ([5, 5] if schedule else [6, 5])


@pytest.mark.parametrize("clip", [False, True])
def test_dynamic_loss_scale_in_the_kernel_equals_its_host_path(clip):
  """torch_bridge.dynamic_loss_scale on fp16 params: handing the scale to the
  kernel (the Triton step) or unscaling into fp32 copies (the host path) gives
  the same bits; ``clip_grad_norm_`` unscales first, and the kernel then gets
  the unscaled copies and only ``found_inf``."""
  gen = torch.Generator().manual_seed(0)
  init = [torch.randn(s, generator=gen).to(torch.float16) for s in SHAPES]
  runs = []
  for triton in (True, False):
    gen = torch.Generator().manual_seed(1)
    params = [p.clone().requires_grad_() for p in init]
    opt = _opted_in(tb.adam_fp32_master(params, lr=1e-2)) if triton else tb.adam_fp32_master(
        params, lr=1e-2, fused=False)
    scaler = tb.dynamic_loss_scale(init_scale=2.0**10, growth_interval=2)
    for step in range(5):
      for p, g in zip(params, _scaled_grads(params, gen, float(scaler._scale), step, inf_at=2)):
        p.grad = g
      if clip:
        scaler.clip_grad_norm_(opt, 1.0)
      scaler.step(opt)
      scaler.update()
    runs.append((params, opt))
  assert_same_torch_runs(*runs)


def test_grad_scaler_contract_only_where_every_param_takes_the_kernel():
  """GradScaler unscales on the host (its usual path) for steps that would
  not go whole through the Triton step."""
  p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
  assert not tb.adamw_bf16([p])._step_supports_amp_scaling  # CPU, not opted in
  opt = tb.adamw_bf16([p])
  opt._triton = True
  assert opt._step_supports_amp_scaling
  assert not _opted_in(tb.adamw_bf16([p], amsgrad=True))._step_supports_amp_scaling
  assert not _opted_in(tb.adamw_bf16([p], fused=False))._step_supports_amp_scaling
  p.main_grad = torch.zeros(4)
  assert not opt._step_supports_amp_scaling  # accumulate_in_fp32: GradScaler never sees it


def _opted_in(opt):
  opt._triton = True
  return opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_main_grads_step_as_eager(dtype, launches):
  """accumulate_in_fp32's fp32 ``main_grad`` of 16-bit params: stepped in the
  one launch, with the eager step's bits."""
  runs = []
  for triton in (True, False):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    opt = tb.adamw_bf16(params, lr=1e-2, weight_decay=0.1, fused=None if triton else False)
    opt._triton = triton
    for _ in range(3):
      for p in params:
        p.main_grad = torch.randn(p.shape, generator=gen) * 0.1  # not 16-bit values
      opt.step()
    runs.append((params, opt))
  assert launches == {len(SHAPES): 3}
  assert_same_torch_runs(*runs)


def _scalars(lr=1e-2, t=1, device="cpu"):
  opt = tb.adamw_bf16([torch.zeros(1, dtype=torch.bfloat16)], lr=lr, weight_decay=0.1)
  return opt._scalars(opt.param_groups[0], t, lr, torch.device(device), {})


def _group(mode, dtype, seed=0, shapes=SHAPES):
  gen = torch.Generator().manual_seed(seed)
  out = []
  comp = None if mode == "direct" else tb.compensation.COMPENSATIONS[mode]
  for s in shapes:
    p = torch.randn(s, generator=gen).to(dtype)
    g = (torch.randn(s, generator=gen) * 0.1).to(dtype)
    mdt = adam.moment_dtype(dtype)
    mu = (torch.randn(s, generator=gen) * 0.01).to(mdt)
    nu = (torch.rand(s, generator=gen) * 1e-4).to(mdt)
    buf = None if comp is None else comp.init_buffer(p)
    if mode == "kahan":
      buf = (torch.randn(s, generator=gen) * 1e-4).to(dtype)
    out.append([p, g, mu, nu, buf])
  return out


HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def _eager(rows, scalars, mode, step=0, seed=0, inv_scale=None, indices=None, leaf0=0):
  comp = None if mode == "direct" else tb.compensation.COMPENSATIONS[mode]
  for leaf, (p, g, mu, nu, buf) in enumerate(rows, leaf0):
    if inv_scale is not None:
      g = rounding.widen(g) * inv_scale
    keys = adam._leaf_keys(seed, step, leaf, p.device)
    adam.adamw_step(p, g, mu, nu, buf, scalars, keys, comp, "stochastic",
                    0 if indices is None else indices[leaf - leaf0])


def _kernel(rows, mode, step=0, lr=1e-2, **kwargs):
  """The rows stepped by step_group from step count ``step``; returns the counts after."""
  steps = [torch.tensor(step) for _ in rows]
  _triton.step_group(*zip(*rows), steps, lr=lr, **HYPER, mode=mode, state_rounding="stochastic",
                     **kwargs)
  return steps


def _clone(rows):
  return [[None if t is None else t.clone() for t in r] for r in rows]


def _assert_rows_equal(a, b):
  for ra, rb in zip(a, b):
    for k, (ta, tb_) in enumerate(zip(ra, rb)):
      if ta is not None:
        assert torch.equal(torch_bits(ta), torch_bits(tb_)), k


@pytest.mark.parametrize("mode", ["stochastic", "split"])
def test_inv_scale_unscales(mode):
  rows = _group(mode, torch.bfloat16)
  inv = torch.tensor(2.0**-12)
  ref = _clone(rows)
  _eager(ref, _scalars(t=6), mode, step=5, seed=3, inv_scale=inv)
  steps = _kernel(rows, mode, step=5, seed=3, inv_scale=inv)
  _assert_rows_equal(rows, ref)
  assert [int(s) for s in steps] == [6] * len(rows)


@pytest.mark.parametrize("found", [torch.tensor(1.0), torch.tensor(True)])
def test_found_inf_skips_in_kernel(found):
  rows = _group("kahan", torch.bfloat16)
  before = _clone(rows)
  steps = _kernel(rows, "kahan", step=2, found_inf=found, inv_scale=torch.tensor(0.5))
  _assert_rows_equal(rows, before)
  assert [int(s) for s in steps] == [2] * len(rows)  # the counts stay, as fused AdamW's
  # found_inf = 0 steps as without it
  ref = _clone(rows)
  _eager(ref, _scalars(), "kahan")
  steps = _kernel(rows, "kahan", found_inf=torch.zeros_like(found))
  _assert_rows_equal(rows, ref)
  assert [int(s) for s in steps] == [1] * len(rows)


@pytest.mark.parametrize("mode,dtype", [
    ("kahan", torch.bfloat16), ("split", torch.bfloat16), ("master", torch.bfloat16),
    ("stochastic", torch.bfloat16), ("none", torch.bfloat16), ("kahan", torch.float16),
    ("master", torch.float16), ("stochastic", torch.float16), ("direct", torch.float32)])
def test_landing_across_binades(mode, dtype):
  """Steps far larger than the weights: signs change, binades are crossed, and
  the param lands away from its target (docs/algorithms.md#landing-exactly)."""
  rows = _group(mode, dtype, seed=4, shapes=[(3000,)])
  for r in rows:
    r[0].mul_(1e-3)
    if mode == "master":
      r[4].copy_(r[0])
  ref = _clone(rows)
  for step in range(3):
    _eager(ref, _scalars(lr=0.7, t=step + 1), mode, step=step)
    _kernel(rows, mode, step=step, lr=0.7)
  _assert_rows_equal(rows, ref)


def test_tensor_lr_and_shard_offsets():
  """A tensor lr read on the device; a shard's random-bit counters start at
  its offset in the whole tensor; step counts that differ within a launch
  (the bias corrections and keys are each tensor's)."""
  rows = _group("stochastic", torch.bfloat16)
  ref = _clone(rows)
  indices = [5, 2**32 - 3, 0, 1000]
  counts = [1, 7, 1000, 0]
  for leaf, count in enumerate(counts):
    _eager(ref[leaf:leaf + 1], _scalars(lr=3e-3, t=count + 1), "stochastic", step=count,
           indices=indices[leaf:leaf + 1], leaf0=leaf)
  steps = [torch.tensor(c) for c in counts]
  _triton.step_group(*zip(*rows), steps, lr=torch.tensor(3e-3), **HYPER, mode="stochastic",
                     state_rounding="stochastic", indices=indices)
  _assert_rows_equal(rows, ref)
  assert [int(s) for s in steps] == [c + 1 for c in counts]


def test_bad_input_is_an_error():
  rows = _group("kahan", torch.bfloat16, shapes=[(3,), (4,)])

  def step(rows, mode="kahan", steps=None, **kw):
    steps = [torch.tensor(0) for _ in rows] if steps is None else steps
    _triton.step_group(*zip(*rows), steps, lr=1e-2, **HYPER, mode=mode, **kw)

  bad = _clone(rows)
  bad[1][1] = bad[1][1].float()
  with pytest.raises(ValueError, match="grad dtype"):
    step(bad)
  bad = _clone(rows)
  bad[0][2] = torch.zeros(4, dtype=torch.bfloat16)
  with pytest.raises(ValueError, match="shape"):
    step(bad)
  bad = _clone(rows)
  bad[0][0] = torch.zeros(6, dtype=torch.bfloat16)[::2]
  with pytest.raises(ValueError, match="contiguous"):
    step(bad)
  bad = _clone(rows)
  bad[1][3] = torch.zeros(4, dtype=torch.bfloat16, device="meta")
  with pytest.raises(ValueError, match="on meta"):
    step(bad)
  with pytest.raises(ValueError, match="buffer"):
    step([r[:4] + [None] for r in rows])
  with pytest.raises(ValueError, match="16-bit params"):
    step([[t.float() for t in r[:4]] + [None] for r in rows], mode="none")
  with pytest.raises(ValueError, match="mode must be"):
    step(rows, mode="kahn")
  with pytest.raises(ValueError, match="split' is for bfloat16"):
    step([[t.half() if t.dtype == torch.bfloat16 else t for t in r] for r in rows],
         mode="split")
  with pytest.raises(ValueError, match="one-element"):
    step(rows, found_inf=torch.zeros(2))
  with pytest.raises(ValueError, match="step count must be a one-element int64"):
    step(rows, steps=[torch.tensor(0), torch.tensor(0.0)])
  with pytest.raises(ValueError, match="2 params but 1 step counts"):
    step(rows, steps=[torch.tensor(0)])
  with pytest.raises(TypeError, match="the grad is a NoneType"):
    step([[r[0], None, *r[2:]] for r in rows])
  with pytest.raises(ValueError, match="3 params"):
    _triton.step_group([rows[0][0]] * 3, [rows[0][1]], [rows[0][2]], [rows[0][3]],
                       [rows[0][4]], [torch.tensor(0)] * 3, lr=1e-2, **HYPER, mode="kahan")


def test_not_taken_without_interpreter_on_cpu(monkeypatch, launches):
  """On CPU without the interpreter the optimizer keeps its native step."""
  monkeypatch.setenv("TRITON_INTERPRET", "0")
  make, dtype = CASES["bf16/kahan"]
  assert_same_torch_runs(_train(make, dtype, True, steps=2), _train(make, dtype, False, steps=2))
  assert not launches
  with pytest.raises(ValueError, match="CUDA"):
    _triton.round_bits(torch.zeros(3), torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_eager_long(name):
  make, dtype = CASES[name]
  shapes = [(1,), (3, 5), (1024,), (1025,), (64, 65), (5000,)]
  assert_same_torch_runs(_train(make, dtype, True, steps=6, shapes=shapes),
                         _train(make, dtype, False, steps=6, shapes=shapes))


# Kernel modes compiled for an H100 below (benchmarks.gpu_static.TORCH_MODES).
_MODES = ["kahan"]
_SLOW_MODES = ["stochastic", "direct", "split", "none", "master", "kahan-fp16", "master-fp16",
               "stochastic-fp16-moments", "kahan-unaligned"]


@pytest.mark.parametrize("mode", _MODES + [
    pytest.param(m, marks=pytest.mark.slow) for m in _SLOW_MODES])
def test_compiles_for_cuda_at_copy_speed(mode, monkeypatch, tmp_path):
  """Compiled for an H100 (sm_90) without a GPU (``python -m
  benchmarks.gpu_static``): at most 96 registers and no spills; full blocks of
  aligned tensors read and write every stream with vector accesses (16 bytes
  per thread where the block holds 8 elements of a 16-bit tensor), a
  misaligned tensor with scalar ones; no fp32 FMA and no approximate
  instruction, IEEE sqrt and division, so a GPU computes the interpreter's
  ops (the bits tested above)."""
  from benchmarks import gpu_static  # noqa: PLC0415
  monkeypatch.setenv("TRITON_INTERPRET", "0")
  info = gpu_static.torch_kernels(tmp_path, [mode])[mode]
  assert (tmp_path / f"torch-{mode}.ptx").read_text().startswith("//")
  assert info["registers"] <= gpu_static.MAX_REGISTERS and info["spill_bytes"] == 0, info
  if gpu_static.TORCH_MODES[mode][-1]:  # aligned
    assert info["vector_loads"] >= info["streams_read"], info
    assert info["vector_stores"] >= info["streams_written"], info
    if info["block"] == 1024:  # 8 elements per thread
      assert info["bytes_per_vector_access"] == 16, info
  else:
    assert info["vector_loads"] == info["vector_stores"] == 0, info
  assert not info["fma"] and not info["approx"] and info["ieee_sqrt_div"], info
