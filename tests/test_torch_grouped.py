"""The grouped eager step (``fused=None`` off the CPU): the bits of stepping
each tensor alone, in a number of ops that does not grow with the tensors.

Off the CPU (CUDA), ``LowPrecisionAdamW``'s default concatenates the tensors
of one configuration and steps them with one ``adamw_step``. CI has no GPU,
so these tests take that path on the CPU: the native kernel is told to take
nothing and ``adam._groups_on`` to group CPU tensors. The reference is
``fused=False``, every tensor stepped alone by the same eager code.
"""

import collections

import pytest

torch = pytest.importorskip("torch")

import torch_bridge as tb  # noqa: E402
from conftest import assert_same_torch_runs, torch_bits  # noqa: E402
from torch_bridge import _native, adam  # noqa: E402

SHAPES = [(7, 5), (3,), (), (4, 4, 2), (1,), (33,)]


@pytest.fixture
def grouped_on_cpu(monkeypatch):
  """CPU tensors take the grouped step instead of the native kernel."""
  monkeypatch.setattr(_native.Batch, "add", lambda *a, **k: False)
  monkeypatch.setattr(adam, "_groups_on", lambda device: True)
  runs = collections.Counter()
  step = adam._Grouped._step

  def counted(self, config, entry):
    runs[len(entry[1])] += 1
    return step(self, config, entry)
  monkeypatch.setattr(adam._Grouped, "_step", counted)
  return runs


def _train(make, fused, dtype=torch.bfloat16, steps=4, no_grad_at=None, shapes=SHAPES):
  gen = torch.Generator().manual_seed(0)
  real = dtype if dtype.is_complex else torch.float32  # complex params: both parts random
  params = [torch.randn(s, generator=gen, dtype=real).to(dtype).requires_grad_() for s in shapes]
  opt = make(params, fused)
  for t in range(steps):
    for i, p in enumerate(params):
      p.grad = None if no_grad_at == (t, i) else (
          torch.randn(p.shape, generator=gen, dtype=real) * 0.1).to(dtype)
    opt.step()
  return params, opt


CASES = {
    "kahan": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, fused=f), torch.bfloat16),
    "split": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, compensation="split",
                                          fused=f), torch.bfloat16),
    "stochastic": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, compensation="stochastic", key=5,
                                               fused=f), torch.bfloat16),
    "none, nearest moments": (lambda ps, f: tb.adamw_bf16(
        ps, 1e-2, compensation="none", state_rounding="nearest", fused=f), torch.bfloat16),
    "adam_fp32_master": (lambda ps, f: tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1, fused=f),
                         torch.bfloat16),
    "adam_fp32_master fp16": (lambda ps, f: tb.adam_fp32_master(ps, 1e-2, fused=f),
                              torch.float16),
    "kahan fp16": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, fused=f), torch.float16),
    "fp32 params": (lambda ps, f: tb.scale_by_adamw(ps, 1e-2, weight_decay=0.1, fused=f),
                    torch.float32),
    "float64 params": (lambda ps, f: tb.adamw_bf16(ps, 1e-2, weight_decay=0.1, fused=f),
                       torch.float64),
    "complex64 params": (lambda ps, f: tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1, fused=f),
                         torch.complex64),
    "param groups": (lambda ps, f: tb.adamw_bf16(
        [{"params": ps[:3], "lr": 1e-2}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.1}],
        lr=1e-2, fused=f), torch.bfloat16),
}


@pytest.mark.parametrize("no_grad_at", [None, (1, 0)], ids=["every grad", "a missing grad"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_step_has_the_bits_of_each_tensor_alone(case, no_grad_at, grouped_on_cpu):
  make, dtype = CASES[case]
  grouped = _train(make, None, dtype, no_grad_at=no_grad_at)
  assert sum(n * k for n, k in grouped_on_cpu.items()) > 0 and max(grouped_on_cpu) > 1
  assert_same_torch_runs(grouped, _train(make, False, dtype, no_grad_at=no_grad_at))


def test_grouped_step_splits_at_its_element_cap(monkeypatch, grouped_on_cpu):
  # A tensor of the cap or more steps alone; the others fill groups up to it.
  monkeypatch.setattr(adam, "_GROUP_ELEMENTS", 40)
  calls = []
  step = adam.adamw_step
  monkeypatch.setattr(adam, "adamw_step", lambda *a, **k: (calls.append(a[0].numel()),
                                                          step(*a, **k))[1])
  make, dtype = CASES["stochastic"]
  shapes = SHAPES + [(6, 7)]  # 42 elements: above the cap, stepped by itself
  grouped = _train(make, None, dtype, shapes=shapes)
  assert max(grouped_on_cpu) > 1 and 42 in calls and max(calls) == 42
  assert all(n <= 40 for n in calls if n != 42)
  calls.clear()
  assert_same_torch_runs(grouped, _train(make, False, dtype, shapes=shapes))


def _is_step_counter(x):
  return torch.is_tensor(x) and x.dim() == 0 and x.dtype == torch.int64


def _ops_per_step(make, fused, n):
  """The ops of one step that would run on the params' device: views and
  the host-side step counters (0-dim int64 CPU tensors) left out."""
  from torch.utils._python_dispatch import TorchDispatchMode

  class Count(TorchDispatchMode):
    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
      tensors = [a for a in args if torch.is_tensor(a)]
      if not func.is_view and not (tensors and all(map(_is_step_counter, tensors))):
        Count.ops += 1
      return func(*args, **(kwargs or {}))
  params, opt = _train(make, fused, shapes=[(16,)] * n, steps=1)
  for p in params:
    p.grad = torch.full_like(p, 0.01)
  with Count():
    opt.step()
  return Count.ops


def test_grouped_step_runs_a_number_of_ops_that_does_not_grow_with_the_tensors(
    grouped_on_cpu):
  # A GPU runs each op as a kernel launch: about 70 a tensor stepped alone.
  make, _ = CASES["kahan"]
  alone = [_ops_per_step(make, False, n) for n in (4, 16)]
  grouped = [_ops_per_step(make, None, n) for n in (4, 16)]
  per_tensor_alone = (alone[1] - alone[0]) / 12
  per_tensor_grouped = (grouped[1] - grouped[0]) / 12
  assert per_tensor_alone > 40, alone
  assert per_tensor_grouped == 0, grouped
  assert grouped[1] < alone[1] / 8, (grouped, alone)


def test_grouped_step_resumes_after_deepcopy_pickle_and_state_dict(grouped_on_cpu):
  import copy
  import io
  make, dtype = CASES["stochastic"]
  params, opt = _train(make, None, dtype, steps=2)
  twin_params = [p.detach().clone().requires_grad_() for p in params]
  twin = make(twin_params, None)
  twin.load_state_dict(opt.state_dict())
  copied = copy.deepcopy(opt)  # holds the grouped step's index tensors
  buffer = io.BytesIO()
  torch.save(opt, buffer)
  for o, ps in ((opt, params), (twin, twin_params), (copied, copied.param_groups[0]["params"])):
    for i, p in enumerate(ps):
      p.grad = torch.full_like(p, 0.01 * (i + 1))
    o.step()
  for a, b, c in zip(params, twin_params, copied.param_groups[0]["params"]):
    assert torch.equal(torch_bits(a), torch_bits(b)) and torch.equal(torch_bits(a), torch_bits(c))
  buffer.seek(0)
  assert isinstance(torch.load(buffer, weights_only=False), type(opt))


def test_grouped_step_steps_what_it_took_when_a_later_param_is_refused(grouped_on_cpu):
  # A sparse gradient is refused when the loop reaches it; the params before
  # it were taken and are stepped, with their step counts, as fused=False does.
  make, dtype = CASES["kahan"]
  results = []
  for fused in (None, False):
    params, opt = _train(make, fused, dtype, steps=1)
    for p in params:
      p.grad = torch.full_like(p, 0.01)
    params[-1].grad = params[-1].grad.to_sparse()
    with pytest.raises(Exception, match="sparse"):
      opt.step()
    results.append((params, opt))
  assert_same_torch_runs(*results)
  steps = [int(results[0][1].state[p]["step"]) for p in results[0][0]]
  assert steps == [2] * (len(SHAPES) - 1) + [1], steps


def test_a_param_listed_twice_steps_twice_in_order(grouped_on_cpu):
  make, dtype = CASES["stochastic"]
  results = []
  for fused in (None, False):
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES[:3]]
    with pytest.warns(UserWarning):
      opt = make(params + params[:1], fused)
    for p in params:
      p.grad = torch.full_like(p, 0.01)
    opt.step()
    results.append((params, opt))
  assert_same_torch_runs(*results)
  assert int(results[0][1].state[results[0][0][0]]["step"]) == 2
