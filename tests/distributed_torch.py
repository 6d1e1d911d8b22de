"""torch_bridge optimizers under FSDP2 and DDP (gloo, 2 processes on CPU).

Run as a script (tests/test_distributed.py does): it spawns 2 ranks with
``torch.multiprocessing``; rank 0 also runs every configuration in one
process, without ``torch.distributed``, as the reference, and prints one JSON
line per check:

* ``fsdp``: a bf16 model under ``fully_shard`` (params are ``Shard(0)``
  DTensors, uneven shards included) steps the same gradients as the
  unsharded reference; params and every state tensor gathered
  (``full_tensor()``) are compared, bit for bit for elementwise optimizers, a
  +inf in one rank's shard skips the step on both ranks;
* ``strided``: the same with params sharded over their last dim
  (``Shard(1)``): the random bits of stochastic rounding follow each
  element's index in the whole tensor there too;
* ``ddp``: a small model trained under ``DistributedDataParallel``, each rank
  on half of each batch, against one process on the whole batch;
* ``fsdp_train``: the same under ``fully_shard`` (forward, backward and
  gradient reduce-scatter by FSDP2);
* ``resume``: under FSDP2, N steps == N/2 + per-rank ``torch.save`` of the
  model and optimizer state dicts + load into a new model and optimizer + N/2;
* ``refusals``: under FSDP2, a whole-tensor state_dict and ``convert`` are
  refused with a clear error, and nothing changes.
"""

from __future__ import annotations

import io
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 6
NONFINITE_STEP = 3
SHAPES = {"w": (6, 4), "odd": (5, 3), "b": (4,), "one": (1,), "wide": (2, 8)}


def _optimizers():
  import torch_bridge as tb  # noqa: PLC0415 (imported in each process)
  return {
      "adamw_bf16/kahan": (lambda ps: tb.adamw_bf16(ps, 1e-2), "bitwise"),
      "adamw_bf16/split": (lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="split"), "bitwise"),
      "adamw_bf16/stochastic": (lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="stochastic",
                                                         key=3), "bitwise"),
      "adamw_bf16/none": (lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="none"), "bitwise"),
      "adamw_bf16/eager": (lambda ps: tb.adamw_bf16(ps, 1e-2, fused=False), "bitwise"),
      "adam_fp32_master+skip": (lambda ps: tb.adam_fp32_master(ps, 1e-2, skip_nonfinite=True),
                                "bitwise"),
      "kahan_summation(Adam)": (lambda ps: tb.kahan_summation(torch.optim.Adam(ps, lr=1e-2)),
                                "bitwise"),
      "master_weights(AdamW)": (lambda ps: tb.master_weights(torch.optim.AdamW(ps, lr=1e-2)),
                                "bitwise"),
      "stochastic_rounding(SGD)": (lambda ps: tb.stochastic_rounding(
          torch.optim.SGD(ps, lr=1e-2, momentum=0.9), key=5), "bitwise"),
      "scaled_adam": (lambda ps: tb.scaled_adam(ps, 1e-2, clipping_scale=1.0,
                                                size_update_period=2,
                                                clipping_update_period=2), "norm"),
      "kahan_summation(scaled_adam)": (lambda ps: tb.kahan_summation(tb.scaled_adam(
          ps, 1e-2, clipping_scale=1.0, size_update_period=2, clipping_update_period=2)),
          "norm"),
      "adamw_bf16+loss_scale+clip": (lambda ps: tb.adamw_bf16(ps, 1e-2), "norm"),
      # The max-norm of a (1,) param whose shard on rank 1 is empty.
      "adamw_bf16+loss_scale+clip_inf": (lambda ps: tb.adamw_bf16(ps, 1e-2), "norm"),
  }


SKIPPING = ("adam_fp32_master+skip", "adamw_bf16+loss_scale+clip",
            "adamw_bf16+loss_scale+clip_inf")
SCALED = ("adamw_bf16+loss_scale+clip", "adamw_bf16+loss_scale+clip_inf")
STRIDED = ("adamw_bf16/stochastic", "adamw_bf16/eager", "stochastic_rounding(SGD)")


def _data(name):
  gen = torch.Generator().manual_seed(0)
  params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
  grads = [{k: torch.randn(s, generator=gen) * 0.1 for k, s in SHAPES.items()}
           for _ in range(STEPS)]
  if name in SKIPPING:
    grads[NONFINITE_STEP]["odd"][-1, 1] = float("inf")  # the last rows: rank 1's shard
  return params, grads


class _Model(torch.nn.Module):
  def __init__(self, params):
    super().__init__()
    for k, v in params.items():
      self.register_parameter(k, torch.nn.Parameter(v.to(torch.bfloat16)))


def _step(name, opt, scaler, model, grads, to_grad):
  for p_name, p in model.named_parameters():
    p.grad = to_grad(grads[p_name].to(torch.bfloat16) * (scaler.get_scale() if scaler else 1),
                     p)
  if scaler is None:
    opt.step()
  else:
    scaler.unscale_(opt)
    if name.endswith("clip_inf"):
      scaler.clip_grad_norm_(opt, 0.02, norm_type=float("inf"))
    else:
      scaler.clip_grad_norm_(opt, 0.05)
    scaler.step(opt)
    scaler.update()


def _full(t):
  from torch.distributed.tensor import DTensor  # noqa: PLC0415
  if isinstance(t, DTensor):  # gloo gathers no int16: the split low halves go as int32
    t = t.to(torch.int32).full_tensor().to(t.dtype) if t.dtype == torch.int16 else t.full_tensor()
  return t.detach().clone()


def _snapshot(model, opt) -> dict:
  """Every param and state tensor of the optimizer (and of a wrapped one),
  whole, step counts and ScaledAdam's per-group clipping statistics included."""
  out = {f"param.{k}": _full(p) for k, p in model.named_parameters()}
  names = {id(p): k for k, p in model.named_parameters()}
  for label, o in (("state", opt), ("inner", getattr(opt, "inner", None))):
    if o is None:
      continue
    for position, (p, state) in enumerate(o.state.items()):
      key = names.get(id(p), str(position))
      for k, v in state.items():
        if torch.is_tensor(v) and v.numel() > 0:
          out[f"{label}.{key}.{k}"] = _full(v)
    for g, group_state in enumerate(getattr(o, "group_state", [])):
      for k, v in group_state.items():
        out[f"{label}.group{g}.{k}"] = _full(v) if torch.is_tensor(v) else torch.tensor(v)
  return out


def _compare(a: dict, b: dict) -> dict:
  assert sorted(a) == sorted(b), (sorted(a), sorted(b))
  equal, max_ulp, max_rel, worst = True, 0, 0.0, None
  for k in a:
    x, y = a[k], b[k]
    assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
    if x.dtype.is_floating_point:
      xi = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
      yi = y.view(xi.dtype)
    else:
      xi, yi = x, y
      if not torch.equal(xi, yi):  # counts, indices, flags: exact or wrong
        return {"equal": False, "max_ulp": None, "max_rel": None, "worst": k}
    if torch.equal(xi, yi):
      continue
    equal = False
    if "compensation" in k:  # a residual: its sign flips with its param's rounding
      continue
    if x.element_size() < 4:
      ulp = int((xi.to(torch.int64) - yi.to(torch.int64)).abs().max())
      if ulp > max_ulp:
        max_ulp, worst = ulp, k
    else:
      x64, y64 = x.double(), y.double()
      rel = float(((x64 - y64).abs() / torch.maximum(x64.abs(), y64.abs()).clamp(min=1e-30))
                  .max())
      if rel > max_rel:
        max_rel, worst = rel, k
  return {"equal": equal, "max_ulp": max_ulp, "max_rel": max_rel, "worst": worst}


def _run_optimizer(name, sharded: str):
  """``sharded``: "" (one process), "fsdp" (fully_shard) or "strided" (Shard(1))."""
  import torch_bridge as tb  # noqa: PLC0415
  make, kind = _optimizers()[name]
  params, grads = _data(name)
  model = _Model(params)
  to_grad = lambda g, p: g  # noqa: E731
  if sharded:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh  # noqa: PLC0415
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if sharded == "fsdp":
      from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
      fully_shard(model, mesh=mesh)
    else:
      for k, p in list(model.named_parameters()):
        placement = [Shard(p.dim() - 1)]
        model.register_parameter(k, torch.nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                                         placement)))
    to_grad = lambda g, p: distribute_tensor(g, p.device_mesh, p.placements)  # noqa: E731
  opt = make(list(model.parameters()))
  scaler = tb.dynamic_loss_scale(init_scale=2.0 ** 4) if name in SCALED else None
  for g in grads:
    _step(name, opt, scaler, model, g, to_grad)
  snap = _snapshot(model, opt)
  counters = dict(getattr(opt, "nonfinite", {}))
  if scaler is not None:
    counters["skipped_steps"] = int(scaler.counters()["skipped_steps"])
  return snap, counters, kind


def _train(mode: str, rank: int, world: int):
  """A bf16 MLP, adamw_bf16 (kahan), 8 steps on batches of 16: each rank on
  its part of the batch under DDP ("ddp") or fully_shard ("fsdp"), or one
  process (mode "") that computes the gradient of each part in turn and
  averages them as DDP and FSDP2 do (``g_k / world`` summed in bf16), so
  the gradients, and with them every step, can be the same bits."""
  import torch_bridge as tb  # noqa: PLC0415
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 3)).to(torch.bfloat16)
  gen = torch.Generator().manual_seed(1)
  batches = [(torch.randn(16, 12, generator=gen).to(torch.bfloat16),
              torch.randn(16, 3, generator=gen)) for _ in range(8)]
  net = model
  if mode == "ddp":
    net = torch.nn.parallel.DistributedDataParallel(model)
  elif mode == "fsdp":
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    fully_shard(model)
  opt = tb.adamw_bf16(model.parameters(), 1e-2)
  losses = []
  part = batches[0][0].shape[0] // world
  for x, y in batches:
    if mode:
      x, y = x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]
      loss = ((net(x).float() - y) ** 2).mean()
      loss.backward()
      loss = loss.detach().clone()
      dist.all_reduce(loss)
    else:
      loss, grads = 0.0, None
      for r in range(world):
        part_loss = ((net(x[r * part:(r + 1) * part]).float()
                      - y[r * part:(r + 1) * part]) ** 2).mean()
        part_loss.backward()
        loss = loss + part_loss.detach()
        part_grads = [p.grad / world for p in model.parameters()]
        grads = part_grads if grads is None else [a + b for a, b in zip(grads, part_grads)]
        opt.zero_grad()
      for p, g in zip(model.parameters(), grads):
        p.grad = g
    opt.step()
    opt.zero_grad()
    losses.append(float(loss) / world)
  return {"losses": losses, "params": {k: _full(p) for k, p in model.named_parameters()}}


def _train_compare(a, b) -> dict:
  out = _compare(a["params"], b["params"])
  out["loss_rel"] = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
  return out


def _resume(name, rank):
  """Under FSDP2: N steps, and N/2 + torch.save (per rank) + load + N/2."""
  from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
  from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415
  make, _ = _optimizers()[name]
  params, grads = _data(name)

  def build():
    model = _Model(params)
    fully_shard(model)
    return model, make(list(model.parameters()))

  to_grad = lambda g, p: distribute_tensor(g, p.device_mesh, p.placements)  # noqa: E731
  model, opt = build()
  for g in grads:
    _step(name, opt, None, model, g, to_grad)
  full = _snapshot(model, opt)
  model, opt = build()
  for g in grads[:STEPS // 2]:
    _step(name, opt, None, model, g, to_grad)
  buf = io.BytesIO()
  torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
  buf.seek(0)
  ckpt = torch.load(buf, weights_only=False)
  model, opt = build()
  model.load_state_dict(ckpt["model"])
  opt.load_state_dict(ckpt["opt"])
  for g in grads[STEPS // 2:]:
    _step(name, opt, None, model, g, to_grad)
  return _compare(full, _snapshot(model, opt))


def _worker(rank: int, world: int, port: int, out_path: str, names: list):
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  torch.set_num_threads(1)
  rows = []
  # The one-process references, before any process group exists.
  reference = {}
  if rank == 0:
    for name in names:
      reference[name] = _run_optimizer(name, "")
    train_ref = _train("", 0, world)
  # A one-process state_dict, for sharded state to refuse.
  make, _ = _optimizers()["kahan_summation(Adam)"]
  plain = _Model(_data("")[0])
  whole_opt = make(list(plain.parameters()))
  _step("", whole_opt, None, plain, _data("")[1][0], lambda g, p: g)
  whole_state = whole_opt.state_dict()
  dist.init_process_group("gloo", rank=rank, world_size=world)
  try:
    for name in names:
      for sharded in ("fsdp", "strided") if name in STRIDED else ("fsdp",):
        snap, counters, kind = _run_optimizer(name, sharded)
        if rank == 0:
          ref_snap, ref_counters, _ = reference[name]
          rows.append({"check": sharded, "config": name, "kind": kind,
                       **_compare(ref_snap, snap),
                       "counters": {"one_process": ref_counters, "sharded": counters}})
    for mode in ("ddp", "fsdp"):
      result = _train(mode, rank, world)
      if rank == 0:
        rows.append({"check": f"{mode}_train", **_train_compare(result, train_ref)})
    refused = _refusals(whole_state)
    if rank == 0:
      rows.append({"check": "refusals", **refused})
    for name in ("adamw_bf16/stochastic", "kahan_summation(Adam)", "scaled_adam"):
      if name in names:
        result = _resume(name, rank)
        if rank == 0:
          rows.append({"check": "resume", "config": name, **result})
  finally:
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
  if rank == 0:
    with open(out_path, "w") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  # Leave without running C++ static destructors: now and then (1 run in 20
  # here) a gloo thread outlives the destroyed process group and its
  # destructor aborts the process ("terminate called without an active
  # exception") after all the work is done and written.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def _refusals(whole_state: dict) -> dict:
  """Under FSDP2: a whole-tensor state_dict (one process's) loaded into sharded
  state, and convert given DTensor params, are refused and change nothing."""
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  import optax_half as oh  # noqa: PLC0415
  from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
  from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415
  from torch_bridge import convert  # noqa: PLC0415
  make, _ = _optimizers()["kahan_summation(Adam)"]
  params, grads = _data("")
  model = _Model(params)
  fully_shard(model)
  opt = make(list(model.parameters()))
  _step("", opt, None, model, grads[0],
        lambda g, p: distribute_tensor(g, p.device_mesh, p.placements))
  before = {k: v.clone() for k, v in _snapshot(model, opt).items()}
  out = {}
  try:
    opt.load_state_dict(whole_state)
    out["load"] = "loaded"
  except ValueError as e:
    out["load"] = str(e)
  jparams = {k: jnp.asarray(v.numpy()).astype(jnp.bfloat16) for k, v in params.items()}
  tx = oh.kahan_summation(optax.adam(1e-2))
  try:
    convert.optax_state_to_torch(tx.init(jparams), jparams, opt)
    out["convert"] = "loaded"
  except ValueError as e:
    out["convert"] = str(e)
  out["unchanged"] = _compare(before, _snapshot(model, opt))["equal"]
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv) -> None:
  import tempfile  # noqa: PLC0415
  names = argv or list(_optimizers())
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "rows.jsonl")
    mp.spawn(_worker, args=(2, _free_port(), out, names), nprocs=2)
    with open(out) as f:
      sys.stdout.write(f.read())


if __name__ == "__main__":
  main(sys.argv[1:])
