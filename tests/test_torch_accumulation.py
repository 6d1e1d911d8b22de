"""fp32 gradient accumulation for 16-bit params (``tb.accumulate_in_fp32``, NeMo's ``main_grad``)."""

import copy

import pytest

torch = pytest.importorskip("torch")

import torch_bridge as tb  # noqa: E402
from torch_bridge.accumulation import MainGradAlias  # noqa: E402

MICRO = 8


def _backward_micro_batches(p, value, n=MICRO):
  """``n`` backward passes whose gradient of every element of ``p`` is ``value``."""
  for _ in range(n):
    (p.float() * value).sum().backward()


def test_eight_scaled_fp16_gradients_sum_exactly_in_fp32():
  p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
  _backward_micro_batches(p, 8192.0)
  assert torch.isinf(p.grad).all()  # 65536 overflows fp16
  q = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
  handle = tb.accumulate_in_fp32([q])
  _backward_micro_batches(q, 8192.0)
  assert q.main_grad.dtype == torch.float32 and q.main_grad.tolist() == [65536.0] * 3
  assert isinstance(q.grad, MainGradAlias) and q.grad.main is q.main_grad
  # bf16 sums lose low bits at every add; fp32 keeps them.
  b = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
  tb.accumulate_in_fp32([b])
  c = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
  for value in [256.0] + [1.0] * 7:
    (b.float() * value).sum().backward()
    (c.float() * value).sum().backward()
  assert b.main_grad.item() == 263.0 and c.grad.item() == 256.0
  handle.remove()
  _backward_micro_batches(q, 1.0, n=1)  # after remove(): back to p.grad
  assert q.grad.tolist() == [1.0] * 3 and q.main_grad.tolist() == [65536.0] * 3


def test_only_16_bit_trainable_params_get_hooks():
  params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)),
            torch.zeros(2, dtype=torch.float16)]  # fp32, bf16, not requiring grad
  handle = tb.accumulate_in_fp32(params)
  assert handle.params == [params[1]]
  with pytest.raises(TypeError, match="not a tensor"):
    tb.accumulate_in_fp32([3.0])


def _run(make_opt, fp32_accumulation, steps=3, init_scale=2.0**13):
  """A loss-scaled fp16 param, MICRO micro-batches a step, gradient 1 each:
  the scaled sum is 8 * 8192 = 65536 (inf in fp16)."""
  p = torch.nn.Parameter(torch.full((4,), 0.5, dtype=torch.float16))
  opt = make_opt([p])
  scaler = tb.dynamic_loss_scale(init_scale=init_scale, growth_interval=1000)
  if fp32_accumulation:
    tb.accumulate_in_fp32([p])
  for _ in range(steps):
    for _ in range(MICRO):
      scaler.scale((p.float() * 1.0).sum()).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
  return p, opt, scaler


OPTIMIZERS = {
    "adam_fp32_master": lambda ps: tb.adam_fp32_master(ps, lr=1e-3),
    "adamw_bf16": lambda ps: tb.adamw_bf16(ps, lr=1e-3),
    "master_weights(Adam)": lambda ps: tb.master_weights(torch.optim.Adam(ps, lr=1e-3)),
    "scaled_adam": lambda ps: tb.scaled_adam(ps, lr=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_loss_scaled_accumulation_skips_in_fp16_and_steps_in_fp32(name):
  """Without fp32 accumulation the 16-bit sum overflows and every step at that
  scale is skipped; with it the step sees the exact fp32 sum, unscaled."""
  _, _, scaler = _run(OPTIMIZERS[name], fp32_accumulation=False, steps=1)
  assert scaler.state_dict()["skipped_steps"] == 1
  p, opt, scaler = _run(OPTIMIZERS[name], fp32_accumulation=True)
  assert scaler.state_dict()["skipped_steps"] == 0
  assert not torch.equal(p, torch.full((4,), 0.5, dtype=torch.float16))
  assert getattr(p, "main_grad", None) is None  # zero_grad() freed it


def test_the_step_equals_fp32_adam_on_the_fp32_sum():
  """adam_fp32_master on the accumulated, unscaled main_grad is fp32 Adam on the true sum."""
  p, opt, _ = _run(OPTIMIZERS["adam_fp32_master"], fp32_accumulation=True)
  ref = torch.nn.Parameter(torch.full((4,), 0.5))
  ref_opt = torch.optim.Adam([ref], lr=1e-3)
  for _ in range(3):
    ref.grad = torch.full((4,), float(MICRO))
    ref_opt.step()
  assert torch.equal(opt.state[p]["master"], ref.detach())


def test_zero_grad_frees_or_zeroes_main_grad_and_clipping_reads_it():
  p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
  opt = tb.adamw_bf16([p], lr=1e-3)
  tb.accumulate_in_fp32([p])
  _backward_micro_batches(p, 3.0, n=2)
  scaler = tb.dynamic_loss_scale(enabled=False)
  norm = scaler.clip_grad_norm_(opt, 1.0)  # clips main_grad: norm 2 * 3 * sqrt(4) = 12
  assert float(norm) == 12.0
  assert torch.allclose(p.main_grad, torch.full((4,), 0.5), atol=1e-6)
  opt.zero_grad(set_to_none=False)
  assert p.main_grad.tolist() == [0.0] * 4
  opt.zero_grad()
  assert getattr(p, "main_grad", None) is None


def test_a_plain_optimizer_under_the_scaler_is_told_to_wrap():
  p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
  opt = torch.optim.SGD([p], lr=0.1)
  tb.accumulate_in_fp32([p])
  scaler = tb.dynamic_loss_scale()
  scaler.scale(p.float().sum()).backward()
  with pytest.raises(TypeError, match="main_grad.*master_weights"):
    scaler.step(opt)


def test_resume_with_accumulation_is_exact():
  """main_grad is not optimizer state: a checkpoint taken between steps resumes bit for bit."""
  def make():
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6).to(torch.bfloat16))
    return p, tb.adamw_bf16([p], lr=1e-2)

  def steps(p, opt, start, n):
    tb_handle = tb.accumulate_in_fp32([p])
    for t in range(start, start + n):
      for k in range(4):
        (p.float() * (0.1 * (t + 1) + 0.01 * k)).sum().backward()
      opt.step()
      opt.zero_grad()
    tb_handle.remove()

  p, opt = make()
  steps(p, opt, 0, 3)
  ckpt = copy.deepcopy({"p": p.detach().clone(), "opt": opt.state_dict()})
  steps(p, opt, 3, 3)
  q, opt2 = make()
  with torch.no_grad():
    q.copy_(ckpt["p"])
  opt2.load_state_dict(ckpt["opt"])
  steps(q, opt2, 3, 3)
  assert torch.equal(p, q)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_model_accumulates_in_fp32(backend):
  """The hooks stay on the leaf params; a compiled forward and backward
  (inductor: the C++ code torch.compile generates on CPU) leave them to
  autograd's gradient accumulation, where they fire."""
  model = torch.nn.Linear(4, 1).to(torch.float16)
  handle = tb.accumulate_in_fp32(model.parameters())
  compiled = torch.compile(model, backend=backend)
  for _ in range(MICRO):
    compiled(torch.ones(2, 4, dtype=torch.float16)).float().sum().mul(4096.0).backward()
  assert model.weight.grad.main is model.weight.main_grad
  assert model.weight.main_grad.tolist() == [[MICRO * 2 * 4096.0] * 4]
  handle.remove()


def _ddp_worker(rank, port, out):
  import os  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=2)
  torch.manual_seed(0)
  model = torch.nn.Linear(4, 1).to(torch.bfloat16)
  ddp = torch.nn.parallel.DistributedDataParallel(model)
  handle = tb.accumulate_in_fp32(model.parameters())
  opt = tb.adamw_bf16(model.parameters(), lr=1e-2)
  x = torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.bfloat16) / 16
  with ddp.no_sync():  # nothing is reduced per micro-batch: the fp32 sums are, once
    for k in range(2):
      ddp(x[rank * 2 + k:rank * 2 + k + 1]).float().sum().backward()
  handle.all_reduce()
  out[rank] = model.weight.main_grad.clone()
  opt.step()
  dist.destroy_process_group()


def _two_processes(worker) -> dict:
  """``worker(rank, port, out)`` run in 2 processes; ``out`` as they left it."""
  import socket  # noqa: PLC0415
  import torch.multiprocessing as mp  # noqa: PLC0415
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  out = mp.Manager().dict()
  mp.spawn(worker, args=(port, out), nprocs=2, join=True)
  return dict(out)


@pytest.mark.slow  # two processes (gloo)
def test_ddp_no_sync_then_all_reduce_averages_the_fp32_sums():
  out = _two_processes(_ddp_worker)
  x = (torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.bfloat16) / 16).float()
  expected = x.sum(0) / 2  # each rank's two rows summed, averaged over the ranks
  assert torch.equal(out[0], out[1])
  assert torch.allclose(out[0][0], expected)


def _fsdp_worker(rank, port, out):
  import os  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
  from torch.distributed.tensor import DTensor  # noqa: PLC0415
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=2)
  torch.set_num_threads(1)
  torch.manual_seed(0)
  model = torch.nn.Linear(4, 2).to(torch.float16)
  fully_shard(model)
  handle = tb.accumulate_in_fp32(model.parameters())
  opt = tb.adam_fp32_master(model.parameters(), lr=1e-2)
  scaler = tb.dynamic_loss_scale(init_scale=2.0 ** 13)
  x = torch.ones(8, 4, dtype=torch.float16)
  for k in range(8):  # 8 micro-batches, scaled gradients of 8192 each: 65536 in all
    scaler.scale(model(x[k:k + 1]).float().sum()).backward()
  grad = model.weight.grad  # the alias: a DTensor laid out like the param
  out[f"alias{rank}"] = (isinstance(grad, DTensor) and grad.placements == model.weight.placements
                         and isinstance(grad._local_tensor, MainGradAlias)
                         and grad.dtype == torch.float16)
  out[f"main_grad{rank}"] = model.weight.main_grad.full_tensor().clone()
  try:
    handle.all_reduce()
  except ValueError as e:
    out[f"all_reduce{rank}"] = str(e)
  scaler.step(opt)
  scaler.update()
  out[f"skipped{rank}"] = scaler.state_dict()["skipped_steps"]
  out[f"weight{rank}"] = model.weight.detach().full_tensor().clone()
  opt.zero_grad()
  out[f"freed{rank}"] = getattr(model.weight, "main_grad", None) is None
  dist.destroy_process_group()


@pytest.mark.slow  # two processes (gloo)
def test_fsdp2_reduces_each_micro_batch_and_main_grad_sums_the_shards_in_fp32():
  """Under fully_shard the hooks fire on the sharded params: each rank's fp32
  main_grad shard sums the 8 reduce-scattered micro-batch gradients (8192
  each: 65536, inf in fp16), the loss scaler unscales and checks them, and the
  step is taken (not skipped), the same on both ranks."""
  out = _two_processes(_fsdp_worker)
  expected = torch.full((2, 4), 8 * 8192.0)
  assert torch.equal(out["main_grad0"], expected) and torch.equal(out["main_grad1"], expected)
  assert out["alias0"] and out["alias1"]
  assert "already reduce-scattered" in out["all_reduce0"]
  assert out["skipped0"] == out["skipped1"] == 0
  assert torch.equal(out["weight0"], out["weight1"])
  torch.manual_seed(0)
  w0 = torch.nn.Linear(4, 2).to(torch.float16).weight.detach()
  assert (out["weight0"] != w0).all()  # every element stepped
  assert out["freed0"] and out["freed1"]


def _fsdp_clip_worker(rank, port, out):
  import os  # noqa: PLC0415
  import torch.distributed as dist  # noqa: PLC0415
  from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=2)
  torch.set_num_threads(1)
  full = lambda ts: [t.full_tensor().clone() for t in ts]
  for max_norm in (0.5, 1e9):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    xs = [torch.randn(4, 6).to(torch.bfloat16) for _ in range(4)]
    fully_shard(model)
    handle = tb.accumulate_in_fp32(model.parameters())
    opt = tb.adamw_bf16(model.parameters(), lr=1e-2)
    backward = lambda x: model(x[2 * rank:2 * rank + 2]).float().pow(2).sum().backward()
    backward(xs[0])
    first = full(p.main_grad for p in model.parameters())
    model.zero_grad()  # drops the aliases: the next backward starts a new sum
    backward(xs[0])
    out[f"restarted{rank}"] = all(
        torch.equal(a, b) for a, b in zip(first, full(p.main_grad for p in model.parameters())))
    sums = [p.main_grad for p in model.parameters()]
    for x in xs[1:]:
      backward(x)  # FSDP2 adds each into the alias: the same fp32 sums, no new ones
    out[f"kept{rank}"] = all(p.main_grad is m for p, m in zip(model.parameters(), sums))
    main = full(p.main_grad for p in model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    out[f"{max_norm} main{rank}"] = main
    out[f"{max_norm} norm{rank}"] = norm.full_tensor().clone()
    out[f"{max_norm} clipped{rank}"] = full(p.main_grad for p in model.parameters())
    opt.step()
    handle.remove()
    out[f"removed{rank}"] = all(p.grad is None for p in model.parameters())
  dist.destroy_process_group()


@pytest.mark.slow  # two processes (gloo)
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_fsdp2_torch_clip_grad_norm_clips_what_the_step_uses(fsdp_clip_runs, max_norm):
  """Sharded params get the alias too, as a DTensor laid out like the param:
  torch.nn.utils.clip_grad_norm_ (what accelerate and Lightning call under
  FSDP2) returns the fp32 sums' norm over every shard and scales main_grad, the
  gradient the step reads, by torch's coefficient, bit for bit."""
  out = fsdp_clip_runs
  main, norm, clipped = (out[f"{max_norm} {k}0"] for k in ("main", "norm", "clipped"))
  for k in ("main", "norm", "clipped"):
    a, b = out[f"{max_norm} {k}0"], out[f"{max_norm} {k}1"]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) if k != "norm" else torch.equal(a, b)
  assert norm.dtype == torch.float32
  want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m) for m in main]))
  assert torch.allclose(norm, want, rtol=1e-6)
  coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
  assert all(torch.equal(c, m * coef) for c, m in zip(clipped, main))
  assert (coef < 0.1) if max_norm < 1 else (coef == 1.0)
  assert out["restarted0"] and out["restarted1"] and out["kept0"] and out["kept1"]
  assert out["removed0"] and out["removed1"]  # remove() drops the sharded aliases too


@pytest.fixture(scope="module")
def fsdp_clip_runs():
  return _two_processes(_fsdp_clip_worker)


# ---------------------------------------------------------------------------
# Clipping through p.grad (the alias of main_grad).
# ---------------------------------------------------------------------------


def _micro_batches(model, xs):
  for x in xs:
    model(x).float().pow(2).sum().backward()


def _clip_case():
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
  model[0].to(torch.bfloat16)  # a bf16 layer (accumulated in fp32) and an fp32 layer
  xs = [torch.randn(3, 6) for _ in range(4)]
  return model, xs


def _forward(model):
  return lambda x: model[1](model[0](x.to(torch.bfloat16)).float())


def _reference_grads(model, xs):
  """fp32 params equal to the model's, and per param the fp32 sum of the
  micro-batch gradients backward rounds to the param dtype: what
  accumulate_in_fp32 keeps."""
  ref = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
  sums = [torch.zeros_like(r) for r in ref]
  for x in xs:
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    h = torch.nn.functional.linear(x.to(torch.bfloat16), params[0], params[1]).float()
    torch.nn.functional.linear(h, params[2], params[3]).pow(2).sum().backward()
    for s, p in zip(sums, params):
      s.add_(p.grad.float())
  return ref, sums


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_torch_clip_grad_norm_clips_what_the_step_uses(max_norm):
  """torch.nn.utils.clip_grad_norm_ (Lightning's, the HF Trainer's, accelerate's)
  on accumulated params returns the fp32 sum's norm and clips it in place: the
  step equals the same optimizer on fp32 params with the clipped fp32 sums as
  their gradients, bit for bit."""
  model, xs = _clip_case()
  ref, sums = _reference_grads(model, xs)
  opt = tb.adam_fp32_master(model.parameters(), lr=1e-2)
  tb.accumulate_in_fp32(model.parameters())
  _micro_batches(_forward(model), xs)
  w = model[0].weight
  assert torch.equal(w.main_grad, sums[0])
  for r, s in zip(ref, sums):
    r.grad = s.clone()
  expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
  norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
  assert torch.equal(norm, expected) and norm.dtype == torch.float32
  true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in sums]))
  assert torch.equal(norm, true_norm)
  assert (max_norm < norm) == (not torch.equal(w.main_grad, sums[0]))  # clipped in place
  ref_opt = tb.adam_fp32_master(ref, lr=1e-2)
  opt.step()
  ref_opt.step()
  assert torch.equal(opt.state[w]["master"], ref[0].detach())
  assert torch.equal(model[1].weight.detach(), ref[2].detach())


def test_clipping_changes_the_step():
  """The clip is not a no-op: clipped and unclipped runs step differently."""
  def run(clip):
    model, xs = _clip_case()
    opt = tb.adamw_bf16(model.parameters(), lr=1e-2, weight_decay=0.0)
    tb.accumulate_in_fp32(model.parameters())
    for _ in range(3):
      _micro_batches(_forward(model), xs)
      if clip:
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3) > 1e-3
      opt.step()
      opt.zero_grad()
    return model[0].weight.detach().clone()
  assert not torch.equal(run(True), run(False))


def test_unscale_then_torch_clip_equals_the_scalers_clip():
  """fp16 with loss scaling: scaler.unscale_ then torch.nn.utils.clip_grad_norm_
  is scaler.clip_grad_norm_, norm and step."""
  def run(torch_clip):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.float16)
    opt = tb.adam_fp32_master(model.parameters(), lr=1e-2)
    scaler = tb.dynamic_loss_scale(init_scale=2.0**10)
    tb.accumulate_in_fp32(model.parameters())
    for k in range(MICRO):
      scaler.scale(model(torch.full((2, 4), 1.0 + k, dtype=torch.float16)).float().sum()).backward()
    if torch_clip:
      scaler.unscale_(opt)
      norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
      norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return norm, model.weight.detach().clone(), scaler.state_dict()["skipped_steps"]
  a, b = run(True), run(False)
  assert torch.equal(a[0], b[0]) and float(a[0]) > 1.0
  assert torch.equal(a[1], b[1]) and a[2] == b[2] == 0


def test_model_zero_grad_starts_a_new_sum_and_remove_drops_the_alias():
  p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
  handle = tb.accumulate_in_fp32([p])
  _backward_micro_batches(p, 2.0, n=3)
  assert p.main_grad.tolist() == [6.0] * 3 and p.grad.main is p.main_grad
  p.grad = None  # model.zero_grad(): the next backward starts afresh
  _backward_micro_batches(p, 1.0, n=2)
  assert p.main_grad.tolist() == [2.0] * 3
  p.grad.zero_()  # model.zero_grad(set_to_none=False) zeroes the sum
  assert p.main_grad.tolist() == [0.0] * 3
  handle.remove()
  assert p.grad is None and p.main_grad.tolist() == [0.0] * 3
