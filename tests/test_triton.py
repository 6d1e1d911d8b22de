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
from torch_bridge import _triton, adam, rounding  # noqa: E402

SHAPES = [(1,), (7,), (10, 100), (4099,)]


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
  """Triton's interpreter for this test only."""
  monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
  """Counts step_group calls (one launch each) by number of tensors."""
  counts = collections.Counter()
  step_group = _triton.step_group

  def counted(params, *args, **kwargs):
    counts[len(params)] += 1
    return step_group(params, *args, **kwargs)
  monkeypatch.setattr(_triton, "step_group", counted)
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


def _train(make, dtype, triton: bool, steps=3, shapes=SHAPES):
  gen = torch.Generator().manual_seed(0)
  params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
  opt = make(params, None if triton else False)
  opt._triton = triton
  for _ in range(steps):
    for p in params:
      p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(dtype)
    opt.step()
  return params, opt


@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_eager(name, launches):
  make, dtype = CASES[name]
  triton = _train(make, dtype, True)
  assert launches == {len(SHAPES): 3}  # one launch per step for all tensors
  assert_same_torch_runs(triton, _train(make, dtype, False))
  assert all(int(s["step"]) == 3 for s in triton[1].state.values())


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


def _eager(rows, scalars, mode, step=0, seed=0, inv_scale=None, indices=None):
  comp = None if mode == "direct" else tb.compensation.COMPENSATIONS[mode]
  for leaf, (p, g, mu, nu, buf) in enumerate(rows):
    if inv_scale is not None:
      g = rounding.widen(g) * inv_scale
    keys = adam._leaf_keys(seed, step, leaf, p.device)
    adam.adamw_step(p, g, mu, nu, buf, scalars, keys, comp, "stochastic",
                    0 if indices is None else indices[leaf])


def _kernel(rows, scalars, mode, **kwargs):
  _triton.step_group(*zip(*rows), scalars, mode=mode, state_rounding="stochastic", **kwargs)


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
  scalars = _scalars()
  inv = torch.tensor(2.0**-12)
  ref = _clone(rows)
  _eager(ref, scalars, mode, step=5, seed=3, inv_scale=inv)
  _kernel(rows, scalars, mode, step=5, seed=3, inv_scale=inv)
  _assert_rows_equal(rows, ref)


@pytest.mark.parametrize("found", [torch.tensor(1.0), torch.tensor(True)])
def test_found_inf_skips_in_kernel(found):
  rows = _group("kahan", torch.bfloat16)
  before = _clone(rows)
  _kernel(rows, _scalars(), "kahan", found_inf=found, inv_scale=torch.tensor(0.5))
  _assert_rows_equal(rows, before)
  # found_inf = 0 steps as without it
  ref = _clone(rows)
  _eager(ref, _scalars(), "kahan")
  _kernel(rows, _scalars(), "kahan", found_inf=torch.zeros_like(found))
  _assert_rows_equal(rows, ref)


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
  scalars = _scalars(lr=0.7)
  ref = _clone(rows)
  for step in range(3):
    _eager(ref, scalars, mode, step=step)
    _kernel(rows, scalars, mode, step=step)
  _assert_rows_equal(rows, ref)


def test_tensor_lr_and_shard_offsets():
  """A tensor lr inside one float32 scalars tensor; a shard's random-bit
  counters start at its offset in the whole tensor."""
  rows = _group("stochastic", torch.bfloat16)
  scalars = _scalars(lr=3e-3, t=2)
  ref = _clone(rows)
  indices = [5, 2**32 - 3, 0, 1000]
  _eager(ref, scalars, "stochastic", step=1, indices=indices)
  _kernel(rows, torch.stack(scalars), "stochastic", step=1, indices=indices)
  _assert_rows_equal(rows, ref)


def test_bad_input_is_an_error():
  rows = _group("kahan", torch.bfloat16, shapes=[(3,), (4,)])
  s = _scalars()

  def step(rows, mode="kahan", **kw):
    _triton.step_group(*zip(*rows), s, mode=mode, **kw)

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
  with pytest.raises(ValueError, match="scalars"):
    _triton.step_group(*zip(*rows), s[:8], mode="kahan")
  with pytest.raises(TypeError, match="the grad is a NoneType"):
    step([[r[0], None, *r[2:]] for r in rows])
  with pytest.raises(ValueError, match="3 params"):
    _triton.step_group([rows[0][0]] * 3, [rows[0][1]], [rows[0][2]], [rows[0][3]],
                       [rows[0][4]], s, mode="kahan")


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


# Kernel configurations (P, G, M, V, BUF kinds: 0 fp32, 1 bf16, 2 fp16; mode;
# stochastic moments; maximize; inv_scale; found_inf) compiled for CUDA below.
_CONFIGS = [
    (1, 1, 1, 1, 1, "kahan", True, False, True, True),
    (2, 2, 2, 2, 0, "stochastic", True, True, False, True),
    (0, 0, 0, 0, 0, "direct", False, False, True, False),
]
_SLOW_CONFIGS = [
    (1, 1, 1, 1, 0, "split", True, True, False, False),
    (1, 1, 1, 1, 0, "stochastic", True, False, False, False),
    (1, 1, 0, 0, 0, "master", False, False, False, False),
    (1, 1, 1, 1, 0, "none", False, False, False, False),
    (2, 2, 0, 0, 2, "kahan", False, False, True, False),
    (2, 2, 0, 0, 0, "master", False, False, False, False),
]


@pytest.mark.parametrize("config", _CONFIGS + [
    pytest.param(c, marks=pytest.mark.slow) for c in _SLOW_CONFIGS], ids=str)
def test_compiles_for_cuda_without_fma(config, monkeypatch):
  """Compiled for an H100 (sm_90) without a GPU: the PTX has no fp32 FMA and
  no approximate instruction, and takes IEEE sqrt and division, so a GPU
  computes the interpreter's ops (the bits tested above); with FMA
  contraction on (Triton's default) it would fuse."""
  import re  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  from triton.compiler import ASTSource, compile  # noqa: PLC0415
  import optax_half_native as native_lib  # noqa: PLC0415
  monkeypatch.setenv("TRITON_INTERPRET", "0")
  names = ["P", "G", "M", "V", "BUF", "MODE", "SR_MOMENTS", "MAXIMIZE", "HAS_INV_SCALE",
           "HAS_FOUND_INF"]
  constexprs = dict(zip(names, config), BLOCK=_triton.BLOCK)
  constexprs["MODE"] = native_lib.MODES[constexprs["MODE"]]
  signature = {"table_ptr": "*i64", "blocks_ptr": "*i32", "scalars_ptr": "*fp32",
               "inv_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "key_p": "i32",
               "key_m": "i32", **{n: "constexpr" for n in constexprs}}
  source = ASTSource(fn=_triton._kernels_for(False).adamw_kernel, signature=signature,
                     constexprs=constexprs)
  ptx = compile(source, target=GPUTarget("cuda", 90, 32),
                options={"enable_fp_fusion": False}).asm["ptx"]
  assert not re.search(r"\bfma\.\w*f32", ptx)
  assert "approx" not in ptx
  assert re.search(r"sqrt\.rn\.f32", ptx) and re.search(r"div\.rn\.f32", ptx)
