"""On a GPU: the steps that run there equal the CPU steps, and they do not sync.

CI has no GPU, so every test here is skipped there; on a machine with one
(``jax[cuda]`` and a CUDA build of torch) they run with the rest. The CPU
side of each comparison is the reference: there JAX runs the composed
transformation on XLA:CPU (with a GPU as the default backend the native
kernel is not taken), which the native kernel equals bit for bit
(test_native), and torch its CPU step, equal to the JAX one (test_parity).
On the GPU JAX runs the composed transformation on XLA:GPU, or, for
adamw_bf16 in place and with a flat state, its Pallas kernels
(docs/algorithms.md#pallas-kernels: IEEE division and square root, expected
to give the CPU's bits; not yet run on a GPU), and torch_bridge its eager or
compiled (Triton) step.

Over 12 steps scaled_adam's params, the JAX adamw_bf16 steps with kahan,
stochastic and no compensation (no implicit host transfer in them), and every
eager torch step, equal the CPU steps bit for bit. GPU-compiled code does not
always: the fp32 master of adam_fp32_master (JAX, and torch compiled with
Triton) may be up to 10 ULP off, a Kahan buffer up to 2 ULP, and the low
halves of split's master up to 28 (JAX on an H200). The cause is not
established (docs/algorithms.md#on-gpu). Those cases are marked ``xfail``
(not strict), so that they run and report.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from benchmarks.gpu_static import IEEE_XLA_FLAGS
from tests.conftest import bitwise_equal, ulp_diff

JAX_GPU = jax.default_backend() == "gpu"
jax_gpu = pytest.mark.skipif(not JAX_GPU, reason="JAX has no GPU here")

GPU_COMPILED = ("GPU-compiled fp32 arithmetic differs from the CPU's "
                "(docs/algorithms.md#on-gpu): JAX's fp32 master up to 10 ULP, "
                "Kahan buffer up to 2 ULP, split's low halves up to 28; torch's "
                "compiled bf16 params up to 13 ULP")
# The configurations measured to differ (the others were bitwise equal); with
# IEEE_XLA_FLAGS (IEEE division and square root in XLA:GPU) none should.
IEEE = IEEE_XLA_FLAGS in os.environ.get("XLA_FLAGS", "")
JAX_DIFFERS = set() if IEEE else {"adam_fp32_master", "loss_scale(adamw_bf16)",
                                  "adamw_bf16/split"}
TORCH_COMPILED_DIFFERS = {"adamw_bf16/kahan", "adamw_bf16/split", "adam_fp32_master",
                          "adamw_bf16/stochastic", "adamw_bf16/none+nearest"}

SHAPES = {"w": (96, 64), "b": (64,), "block": (5, 7, 3), "one": (1,), "scalar": ()}
STEPS = 12


def _params(dtype):
  rng = np.random.default_rng(0)
  return {k: rng.standard_normal(s).astype(np.float32).astype(dtype) for k, s in SHAPES.items()}


def _grads(step, dtype):
  rng = np.random.default_rng(100 + step)
  return {k: (0.1 * rng.standard_normal(s)).astype(np.float32).astype(dtype)
          for k, s in SHAPES.items()}


JAX_CASES = {
    "adamw_bf16/kahan": lambda: oh.adamw_bf16(1e-3, weight_decay=0.1),
    "adamw_bf16/kahan flat_state": lambda: oh.adamw_bf16(1e-3, weight_decay=0.1,
                                                         flat_state=True),
    "adamw_bf16/split": lambda: oh.adamw_bf16(1e-3, weight_decay=0.1, compensation="split"),
    "adamw_bf16/stochastic": lambda: oh.adamw_bf16(1e-3, weight_decay=0.1,
                                                   compensation="stochastic"),
    "adamw_bf16/none+nearest": lambda: oh.adamw_bf16(1e-3, compensation="none",
                                                     state_rounding="nearest"),
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-3, weight_decay=0.1),
    "loss_scale(adamw_bf16)": lambda: oh.dynamic_loss_scale(oh.adamw_bf16(1e-3),
                                                            init_scale=2.0 ** 10),
}


def _run_jax(make, device, in_place):
  tx = make()
  with jax.default_device(device):
    params = jax.device_put(_params(jnp.bfloat16), device)
    state = jax.jit(tx.init)(params)

    def step(params, state, grads):
      if in_place:
        return oh.update_and_apply(tx, grads, state, params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    for t in range(STEPS):
      grads = jax.device_put(_grads(t, jnp.bfloat16), device)
      with jax.transfer_guard("disallow"):  # no implicit host <-> device copy in a step
        params, state = step(params, state, grads)
    return jax.device_get((params, state))


def _distance(a, b) -> int:
  """ULPs between float arrays; for integers the largest difference; else
  whether they differ."""
  if not np.issubdtype(a.dtype, np.number):
    return int(not bitwise_equal(a, b))
  if np.issubdtype(a.dtype, np.integer):
    return int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max(initial=0))
  return ulp_diff(a, b)


@jax_gpu
@pytest.mark.parametrize("in_place", [False, True], ids=["update", "in_place"])
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=GPU_COMPILED)) if n in JAX_DIFFERS else n
    for n in JAX_CASES])
def test_jax_step_on_gpu_equals_cpu(name, in_place):
  gpu = _run_jax(JAX_CASES[name], jax.devices("gpu")[0], in_place)
  cpu = _run_jax(JAX_CASES[name], jax.devices("cpu")[0], in_place)
  with_path, g_def = jax.tree_util.tree_flatten_with_path(gpu)
  c_leaves, c_def = jax.tree.flatten(cpu)
  assert g_def == c_def
  # int16 leaves (split's low halves): the integer distance, which is the
  # fp32 master's distance in its ULPs where the bf16 halves are equal
  worst = {jax.tree_util.keystr(path): _distance(np.asarray(a), np.asarray(b))
           for (path, a), b in zip(with_path, c_leaves)}
  print("\nGPUCHECK", name, in_place, max(worst.values()), worst)
  unequal = [k for (k, a), b in zip(with_path, c_leaves) if not bitwise_equal(a, b)]
  assert not unequal, (name, worst)


@jax_gpu
def test_jax_steps_with_ieee_flags_equal_cpu():
  """With IEEE_XLA_FLAGS (set before JAX starts: a fresh process) every JAX
  case equals the CPU bit for bit, through tx.update and in place, the
  cases that differ by default included (docs/algorithms.md#xlagpu-without-a-gpu)."""
  if IEEE:
    pytest.skip("this process runs with the IEEE flags already")
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {IEEE_XLA_FLAGS}"}
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        __file__, "-k", "test_jax_step_on_gpu_equals_cpu"], env=env,
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                       timeout=900)
  print("\nGPUCHECK ieee", run.stdout[-4000:])
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@jax_gpu
def test_jax_scaled_adam_on_gpu_is_close_to_cpu():
  make = lambda: oh.scaled_adam(3e-2, clipping_scale=2.0, clipping_update_period=4)
  gpu = _run_jax(make, jax.devices("gpu")[0], False)
  cpu = _run_jax(make, jax.devices("cpu")[0], False)
  worst = max(ulp_diff(np.asarray(a), np.asarray(b))
              for a, b in zip(jax.tree.leaves(gpu[0]), jax.tree.leaves(cpu[0])))
  print("\nGPUCHECK scaled_adam", worst)
  assert worst <= 2, worst  # its sums may run in another order on a GPU (measured: 0)


# ----------------------------------------------------------------------------
# torch_bridge on CUDA.
# ----------------------------------------------------------------------------

try:
  import torch

  import torch_bridge as tb
  from torch_bridge import dlpack
  TORCH_CUDA = torch.cuda.is_available()
except ImportError:
  TORCH_CUDA = False
torch_cuda = pytest.mark.skipif(not TORCH_CUDA, reason="torch has no CUDA here")

TORCH_CASES = {
    "adamw_bf16/kahan": lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, weight_decay=0.1, **kw),
    "adamw_bf16/split": lambda ps, **kw: tb.adamw_bf16(ps, 1e-3, weight_decay=0.1,
                                                       compensation="split", **kw),
    "adamw_bf16/stochastic": lambda ps, **kw: tb.adamw_bf16(
        ps, 1e-3, weight_decay=0.1, compensation="stochastic", **kw),
    "adamw_bf16/none+nearest": lambda ps, **kw: tb.adamw_bf16(
        ps, 1e-3, compensation="none", state_rounding="nearest", **kw),
    "adam_fp32_master": lambda ps, **kw: tb.adam_fp32_master(ps, 1e-3, weight_decay=0.1, **kw),
}


def _run_torch(make, device, fused=None, loss_scale=None, grad_scaler=False):
  """STEPS steps on ``device``; returns the params and optimizer state on the
  host, and the number of synchronizing CUDA calls each step after the first
  made (``torch.cuda.set_sync_debug_mode``). ``loss_scale``: the initial
  scale of a ``dynamic_loss_scale`` (``grad_scaler``: of a ``torch.amp.GradScaler``)."""
  params = [torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16).to(device)
            .requires_grad_() for v in _params(np.float32).values()]
  opt = make(params, fused=fused)
  scaler = (None if loss_scale is None
            else torch.amp.GradScaler(device.type, init_scale=loss_scale) if grad_scaler
            else tb.dynamic_loss_scale(init_scale=loss_scale))
  syncs = []
  for t in range(STEPS):
    for p, g in zip(params, _grads(t, np.float32).values()):
      g = torch.from_numpy(np.asarray(g, np.float32)).to(torch.bfloat16)
      p.grad = (g if loss_scale is None else g * loss_scale).to(device)
    if grad_scaler:
      scaler.scale(torch.ones((), device=device))  # its scale is made lazily
    counted = device.type == "cuda" and t > 0
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      if counted:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
      try:
        if scaler is None:
          opt.step()
        else:
          scaler.step(opt)
          scaler.update()
      finally:
        if counted:
          torch.cuda.set_sync_debug_mode(previous)
    if counted:
      syncs.append(sum("synchroniz" in str(w.message) for w in caught))
  host = [p.detach().cpu() for p in params]
  state = [{k: v.detach().cpu() for k, v in opt.state[p].items() if torch.is_tensor(v)}
           for p in params]
  return host, state, syncs


def _ulp(a, b) -> int:
  """Largest ULP distance of two host tensors (integers: ``_distance``)."""
  if not a.is_floating_point():
    return _distance(a.numpy(), b.numpy())
  return ulp_diff(dlpack.to_jax(a.contiguous()), dlpack.to_jax(b.contiguous()))


@torch_cuda
@pytest.mark.parametrize("fused", [None, False, True], ids=["default", "eager", "compiled"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_step_on_cuda_equals_cpu(name, fused, request):
  if fused and name in TORCH_COMPILED_DIFFERS:
    request.applymarker(pytest.mark.xfail(reason=GPU_COMPILED))
  gpu, gpu_state, _ = _run_torch(TORCH_CASES[name], torch.device("cuda"), fused)
  cpu, cpu_state, _ = _run_torch(TORCH_CASES[name], torch.device("cpu"), fused)
  worst = max(_ulp(a, b) for a, b in zip(gpu, cpu))
  worst_state = {k: max(_ulp(s[k], c[k]) for s, c in zip(gpu_state, cpu_state))
                 for k in gpu_state[0]}
  print("\nGPUCHECK", name, fused, "params", worst, "state", worst_state)
  assert worst == 0 and not any(worst_state.values()), (worst, worst_state)


# torch.optim.AdamW's keywords and dtypes that take the per-tensor or grouped step.
TORCH_KEYWORD_CASES = {
    "amsgrad bf16 kahan": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, amsgrad=True,
                                                       fused=f), torch.bfloat16),
    "float64": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, fused=f), torch.float64),
    "complex64": (lambda ps, f: tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1, fused=f),
                  torch.complex64),
}


@torch_cuda
@pytest.mark.parametrize("fused", [None, False], ids=["default", "eager"])
@pytest.mark.parametrize("name", list(TORCH_KEYWORD_CASES))
def test_torch_keywords_and_dtypes_on_cuda_equal_cpu(name, fused):
  make, dtype = TORCH_KEYWORD_CASES[name]

  def run(device):
    gen = torch.Generator().manual_seed(0)
    real = dtype if dtype.is_complex else torch.float32
    ps = [torch.randn(s, generator=gen, dtype=real).to(dtype).to(device).requires_grad_()
          for s in ((64, 33), (129,), ())]
    opt = make(ps, fused if device.type == "cuda" else False)
    for _ in range(STEPS):
      for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen, dtype=real) * 0.1).to(dtype).to(device)
      opt.step()
    return [t.detach().cpu() for p in ps for t in (p, *(v for k, v in opt.state[p].items()
                                                       if k != "step"))]
  for a, b in zip(run(torch.device("cuda")), run(torch.device("cpu"))):
    assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8)), name


@torch_cuda
@pytest.mark.parametrize("wrapper", ["master_weights", "kahan_summation", "stochastic_rounding"])
def test_wrappers_batch_on_cuda_with_the_per_param_bits(wrapper):
  """On CUDA the wrappers take their batched step by default
  (``foreach=None``): bit for bit the per-param step (``foreach=False``) on
  the same device, with ``torch.optim.AdamW(fused=True)`` inside."""
  runs = []
  buffer = {"master_weights": "master", "kahan_summation": "compensation",
            "stochastic_rounding": "step"}[wrapper]
  make = {"stochastic_rounding": lambda o, foreach: tb.stochastic_rounding(
      o, key=3, foreach=foreach)}.get(wrapper, getattr(tb, wrapper))
  for foreach in (None, False):
    gen = torch.Generator().manual_seed(0)
    ps = [(torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16).cuda().requires_grad_()
          for s in ((64, 33), (129,), (7,))]
    opt = make(torch.optim.AdamW(ps, lr=1e-3, fused=True), foreach=foreach)
    for _ in range(STEPS):
      for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16).cuda()
      opt.step()
    assert ("_batched" in opt.__dict__) == (foreach is None)
    runs.append([t.detach().cpu() for p in ps for t in (p, opt.state[p][buffer])])
  bits = {2: torch.int16, 4: torch.int32}
  for a, b in zip(*runs):
    if a.is_floating_point():
      a, b = a.view(bits[a.element_size()]), b.view(bits[b.element_size()])
    assert torch.equal(a, b)


@torch_cuda
@pytest.mark.parametrize("fused", [None, True], ids=["default", "compiled"])
def test_torch_step_on_cuda_does_not_sync(fused):
  # Before the scalars and keys were filled on the device (rounding.device_scalar),
  # a step made 19 syncs here: 9 scalars and 2 keys per param, each copied from the host.
  _, _, syncs = _run_torch(TORCH_CASES["adamw_bf16/stochastic"], torch.device("cuda"), fused)
  print("\nGPUCHECK syncs", fused, syncs)
  assert not any(syncs), syncs


@torch_cuda
@pytest.mark.parametrize("grad_scaler", [False, True], ids=["dynamic_loss_scale", "GradScaler"])
def test_torch_loss_scaler_on_cuda_equals_cpu(grad_scaler):
  make = TORCH_CASES["adamw_bf16/kahan"]
  gpu, gpu_state, syncs = _run_torch(make, torch.device("cuda"), loss_scale=2.0 ** 10,
                                     grad_scaler=grad_scaler)
  cpu, cpu_state, _ = _run_torch(make, torch.device("cpu"), loss_scale=2.0 ** 10,
                                 grad_scaler=grad_scaler)
  worst = max(_ulp(a, b) for a, b in zip(gpu, cpu))
  worst_state = {k: max(_ulp(s[k], c[k]) for s, c in zip(gpu_state, cpu_state))
                 for k in gpu_state[0]}
  print("\nGPUCHECK loss scaler", grad_scaler, worst, worst_state, "syncs", syncs)
  assert worst == 0 and not any(worst_state.values()), (worst, worst_state)
  # The Triton step reads grad_scale and found_inf on the device
  # (_step_supports_amp_scaling): no host read; elsewhere one bool a step.
  assert max(syncs) <= (0 if tb._triton.available() else 1), syncs


@torch_cuda
@jax_gpu
def test_dlpack_shares_gpu_memory_both_ways():
  x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6).astype(jnp.bfloat16)
  t = dlpack.to_torch(x)
  assert t.is_cuda and t.data_ptr() == x.unsafe_buffer_pointer()
  src = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6).to(torch.bfloat16)
  y = dlpack.to_jax(src)
  assert y.devices() == {jax.devices("gpu")[0]} and y.unsafe_buffer_pointer() == src.data_ptr()
  assert bitwise_equal(np.asarray(y), np.asarray(x))


@torch_cuda
@jax_gpu
@pytest.mark.parametrize("config", [
    "adamw_bf16", "adamw_bf16/stochastic", "adamw_bf16+loss_scale",
    pytest.param("adam_fp32_master", marks=pytest.mark.xfail(
        reason=GPU_COMPILED + "; the harness compares JAX on the GPU with eager torch"))])
def test_parity_harness_on_gpu(config):
  from torch_bridge import parity
  report = parity.run_config(config, "bfloat16", steps=50)
  print(report.table())
  assert report.ok, report.table()
  assert not report.copies, report.copies


# ----------------------------------------------------------------------------
# The multi-tensor Triton step (torch_bridge._triton, the CUDA default) compiled
# for CUDA. On CPU tests/test_triton.py runs it in Triton's interpreter; here it
# must give the CPU's eager bits too, in one plan a step, with no sync, and
# replay inside a CUDA graph.
# ----------------------------------------------------------------------------

try:
  import triton  # noqa: F401
  HAS_TRITON = True
except ImportError:
  HAS_TRITON = False
triton_cuda = pytest.mark.skipif(not (TORCH_CUDA and HAS_TRITON),
                                 reason="torch has no CUDA or triton is missing here")


def _triton_opt(make):
  def build(ps, **kw):
    opt = make(ps, **kw)
    opt._triton = True
    return opt
  return build


@triton_cuda
def test_triton_rounding_on_cuda_equals_torch_cpu():
  from torch_bridge import _triton
  gen = torch.Generator().manual_seed(0)
  words = torch.randint(-2**31, 2**31 - 1, (1 << 21,), dtype=torch.int32, generator=gen)
  sub = (torch.arange(0, 2048, dtype=torch.float64) * 2.0**-25).float().view(torch.int32)
  words = torch.cat([words, sub, sub + 1, sub - 1, -sub])
  x = words.view(torch.float32)
  for dtype in (torch.bfloat16, torch.float16):
    got = _triton.round_bits(x.cuda(), dtype).cpu()
    want = x.to(dtype)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    print("\nGPUCHECK triton rounding", dtype, int((~same).sum()))
    assert same.all()


@triton_cuda
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_triton_step_on_cuda_equals_cpu(name, monkeypatch):
  from torch_bridge import _triton
  launches = []
  run = _triton.Plan.run
  monkeypatch.setattr(_triton.Plan, "run",
                      lambda self, *a, **k: launches.append(self.n) or run(self, *a, **k))
  gpu, gpu_state, syncs = _run_torch(_triton_opt(TORCH_CASES[name]), torch.device("cuda"))
  cpu, cpu_state, _ = _run_torch(TORCH_CASES[name], torch.device("cpu"), False)
  worst = max(_ulp(a, b) for a, b in zip(gpu, cpu))
  worst_state = {k: max(_ulp(s[k], c[k]) for s, c in zip(gpu_state, cpu_state))
                 for k in gpu_state[0]}
  print("\nGPUCHECK triton", name, "params", worst, "state", worst_state, "syncs", syncs,
        "launches", launches[:3])
  assert launches == [len(SHAPES)] * STEPS  # one launch per step for every tensor
  assert worst == 0 and not any(worst_state.values()), (worst, worst_state)
  assert not any(syncs), syncs


@triton_cuda
def test_triton_found_inf_and_inv_scale_on_cuda():
  from torch_bridge import _triton, adam, rounding
  opt = tb.adamw_bf16([torch.zeros(1, dtype=torch.bfloat16)], lr=1e-2, weight_decay=0.1)
  gen = torch.Generator().manual_seed(0)
  rows = []
  for n in (1, 7, 1000, 4099):
    p = torch.randn(n, generator=gen).to(torch.bfloat16)
    rows.append([p, (torch.randn(n, generator=gen) * 64).to(torch.bfloat16),
                 torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16),
                 torch.zeros(n, dtype=torch.bfloat16)])
  cuda = [[t.cuda() for t in r] for r in rows]
  hyper = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
  steps = [torch.zeros((), dtype=torch.int64, device="cuda") for _ in rows]
  before = [[t.clone() for t in r] for r in cuda]
  _triton.step_group(*zip(*cuda), steps, **hyper, mode="kahan", state_rounding="stochastic",
                     found_inf=torch.ones((), device="cuda"),
                     inv_scale=torch.full((), 2.0**-6, device="cuda"))
  assert all(torch.equal(a, b) for ra, rb in zip(cuda, before) for a, b in zip(ra, rb))
  assert [int(s) for s in steps] == [0] * len(rows)
  _triton.step_group(*zip(*cuda), steps, **hyper, mode="kahan", state_rounding="stochastic",
                     found_inf=torch.zeros((), device="cuda"),
                     inv_scale=torch.full((), 2.0**-6, device="cuda"))
  assert [int(s) for s in steps] == [1] * len(rows)
  cpu_scalars = opt._scalars(opt.param_groups[0], 1, 1e-2, torch.device("cpu"), {})
  comp = tb.compensation.COMPENSATIONS["kahan"]
  for leaf, (p, g, mu, nu, c) in enumerate(rows):
    adam.adamw_step(p, rounding.widen(g) * 2.0**-6, mu, nu, c, cpu_scalars,
                    adam._leaf_keys(0, 0, leaf, "cpu"), comp, "stochastic")
  for ra, rb in zip(cuda, rows):
    for a, b in zip(ra, rb):
      assert torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))


@triton_cuda
def test_triton_step_captured_in_a_cuda_graph():
  """``opt.step()`` on CUDA (the Triton plans' replay: no sync, no
  allocation, the step counts on the device) captured in a CUDA graph; its
  replays equal as many eager CPU steps bit for bit (a tensor lr, which a
  captured step reads on the device, as torch's capturable AdamW)."""
  shapes = [(96, 64), (64,), (4099,), (1,)]
  gen = torch.Generator().manual_seed(0)
  init = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
  grads = [[(torch.randn(s, generator=gen) * 0.1).to(torch.bfloat16) for s in shapes]
           for _ in range(6)]

  cpu = [p.clone().requires_grad_() for p in init]
  ref = tb.adamw_bf16(cpu, lr=torch.tensor(1e-2), weight_decay=0.1, fused=False)
  for step_grads in grads:
    for p, g in zip(cpu, step_grads):
      p.grad = g.clone()
    ref.step()

  params = [p.cuda().requires_grad_() for p in init]
  opt = tb.adamw_bf16(params, lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1)
  for p, g in zip(params, grads[0]):
    p.grad = g.cuda()
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):  # warm-up: the plans made, then replayed once
    opt.step()
    for p, g in zip(params, grads[1]):
      p.grad.copy_(g)
    opt.step()
  torch.cuda.current_stream().wait_stream(side)
  assert opt._replay is not None
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    opt.step()
  for step_grads in grads[2:]:
    for p, g in zip(params, step_grads):
      p.grad.copy_(g)
    graph.replay()
  torch.cuda.synchronize()
  for p, q in zip(params, cpu):
    assert torch.equal(p.detach().cpu().view(torch.int16), q.detach().view(torch.int16))
  for p, q in zip(params, cpu):
    for k, v in ref.state[q].items():
      got = opt.state[p][k].cpu()
      assert torch.equal(got.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
