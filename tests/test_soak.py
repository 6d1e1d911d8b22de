"""Long-run soak: every optimizer, both frameworks, 100k steps.

Not part of the default run (marked ``soak``; ``pyproject.toml`` deselects the
marker). Run it with ``make soak``, or
``pytest -m soak -s tests/test_soak.py`` (``SOAK_STEPS`` sets the number of
steps, default 100000; ``SOAK_CHECK_EVERY`` the distance between check
points, default 1000; ``SOAK_REPORT=path`` appends one JSON line per run).

Each run trains a small bf16 tree (fp16 for loss scaling) towards a fixed
target: the gradient of ``0.5 * |p - target|^2`` plus noise, read from 256
precomputed fixed-seed sets (a quarter of them scaled by 1e-6, in runs of 16
steps, so the updates fall far below half an ULP of the weights and the Kahan
buffers and masters carry them). JAX steps are jitted with donated buffers and
driven by a Python loop, torch steps are eager (``fused=False``): the real usage
patterns, so dispatch and allocation leaks show. At every check point:

* every param and state leaf is finite, the loss stays bounded (and falls for
  the compensated optimizers);
* Kahan: ``c = round(x' - p')`` where ``x' - p'`` is the exact rounding error of
  ``p' = round(x')`` (``docs/algorithms.md#wrappers``), so ``|x' - p'| <=
  ulp(p')/2`` with ``ulp`` the spacing above ``|p'|`` (below a power of two the
  error is at most half the smaller spacing). ``ulp(p)/2`` is a power of two,
  so rounding ``x' - p'`` to the buffer dtype cannot exceed it; we still allow
  one ULP of ``c``'s own dtype at the bound, and report the largest
  ``|c| / (ulp(p)/2)`` seen;
* split master: ``join(p, lo)`` is a finite fp32 within ``ulp(p)/2`` of ``p``
  (``p`` is its nearest rounding, ties away from zero);
* fp32 master: ``p == round_nearest(master)`` bit for bit;
* loss scaling: the step before each check point gets an inf or NaN gradient,
  and is checked to be skipped (no bit of params or master changes, the scale
  halves down to ``min_scale``, ``skipped_steps`` grows by one); the scale stays
  in ``[min_scale, 2^24]``;
* memory, between the first check point (the warm-up) and the end: JAX
  ``jax.live_arrays()`` count and bytes equal; torch, the count and bytes of
  every params/grads/optimizer state tensor equal and the process RSS (or, on
  CUDA, ``torch.cuda.memory_allocated``) grows by less than ``RSS_SLACK``.
"""

import gc
import json
import os
import resource
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_half as oh

pytestmark = pytest.mark.soak

STEPS = int(os.environ.get("SOAK_STEPS", "100000"))
CHECK_EVERY = int(os.environ.get("SOAK_CHECK_EVERY", "1000"))
# Loss scaling: a non-finite gradient every INJECT_EVERY steps, the last step
# before each check point among them.
INJECT_EVERY = CHECK_EVERY // 2
RSS_SLACK = 4 * 2**20

SHAPES = {"w": (64, 33), "b": (33,), "s": ()}
N_SETS = 256
LR = 3e-4
SCALED_LR = 3e-3
MIN_SCALE = 1.0
MAX_SCALE = 2.0**24
GROWTH_INTERVAL = 200

# name: (kind, param dtype, compensation or None)
CONFIGS = {
    "adamw_bf16-kahan": ("adamw_bf16", "bfloat16", "kahan"),
    "adamw_bf16-split": ("adamw_bf16", "bfloat16", "split"),
    "adamw_bf16-stochastic": ("adamw_bf16", "bfloat16", "stochastic"),
    "adamw_bf16-none": ("adamw_bf16", "bfloat16", "none"),
    "adam_fp32_master": ("adam_fp32_master", "bfloat16", None),
    "scaled_adam": ("scaled_adam", "bfloat16", None),
    "kahan_summation-scaled_adam": ("kahan_scaled_adam", "bfloat16", None),
    "dynamic_loss_scale-adam_fp32_master-fp16": ("loss_scale", "float16", None),
}
# Bounded, but not expected to learn: their updates are added to bf16 params
# rounding to nearest, and mostly fall below half an ULP (stale weights).
STALE = {"adamw_bf16-none", "scaled_adam"}


def _data():
  """Initial params, target, noise sets and per-set gradient scales (fp32 numpy)."""
  rng = np.random.default_rng(20240610)
  init = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  target = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  noise = {k: (0.5 * rng.standard_normal((N_SETS,) + s)).astype(np.float32)
           for k, s in SHAPES.items()}
  gscale = np.where((np.arange(N_SETS) // 16) % 4 == 3, 1e-6, 1.0).astype(np.float32)
  return init, target, noise, gscale


def _injected(k: int) -> bool:
  return k % INJECT_EVERY == INJECT_EVERY - 1


def _injected_value(k: int) -> float:
  return float("nan") if (k // INJECT_EVERY) % 2 else float("inf")


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize()


# ---------------------------------------------------------------------------
# Checks shared by both frameworks, on numpy copies.
# ---------------------------------------------------------------------------


def _half_ulp(p: np.ndarray) -> np.ndarray:
  """Half the spacing above |p| in p's 16-bit dtype, as float64."""
  bits = np.abs(p).view(np.uint16)
  up = (bits + np.uint16(1)).view(p.dtype)
  return (up.astype(np.float64) - np.abs(p).astype(np.float64)) / 2


def _own_ulp(x: np.ndarray, dtype) -> np.ndarray:
  """One ULP (spacing above) of the float64 values ``x`` in ``dtype``."""
  v = np.abs(x).astype(dtype)
  bits = v.view(np.uint16)
  return (bits + np.uint16(1)).view(dtype).astype(np.float64) - v.astype(np.float64)


def _join(p: np.ndarray, lo: np.ndarray) -> np.ndarray:
  """``rounding.join_f32`` in numpy: bf16 high half + int16 low half."""
  hi = p.view(np.uint16).astype(np.uint32) << np.uint32(16)
  return (hi + lo.astype(np.int32).astype(np.uint32)).view(np.float32)


class Tracker:
  """Runs the checks at each check point and keeps the numbers for the report."""

  def __init__(self, name, framework, target):
    self.name, self.framework = name, framework
    self.target = target
    self.kahan_ratio = 0.0   # max |c| / (ulp(p)/2)
    self.split_ratio = 0.0   # max |join(p, lo) - p| / (ulp(p)/2)
    self.losses = []
    self.checks = 0
    self.skip_checks = 0

  def loss(self, params):
    total = sum(float(np.sum((params[k].astype(np.float64) - self.target[k]) ** 2))
                for k in SHAPES)
    return 0.5 * total / sum(int(np.prod(s)) for s in SHAPES.values())

  def check(self, step, view):
    where = f"{self.framework} {self.name} at step {step}"
    params = view["params"]
    for k, p in params.items():
      assert np.all(np.isfinite(p.astype(np.float32))), f"{where}: param {k} not finite"
    for i, leaf in enumerate(view["state"]):
      assert np.all(np.isfinite(leaf)), f"{where}: state leaf {i} not finite"
    for k, c in view.get("kahan", {}).items():
      p = params[k]
      half = _half_ulp(p)
      c64 = np.abs(c.astype(np.float64))
      slack = _own_ulp(half, c.dtype)
      bad = c64 > half + slack
      assert not bad.any(), (
          f"{where}: Kahan |c| beyond ulp(p)/2 for {k}: p={p[bad][:4]} c={c[bad][:4]}")
      self.kahan_ratio = max(self.kahan_ratio, float(np.max(c64 / half)))
    for k, lo in view.get("split", {}).items():
      p = params[k]
      master = _join(p, lo)
      assert np.all(np.isfinite(master)), f"{where}: split master of {k} not finite"
      err = np.abs(master.astype(np.float64) - p.astype(np.float64))
      half = _half_ulp(p)
      assert np.all(err <= half), f"{where}: split master of {k} beyond ulp(p)/2"
      self.split_ratio = max(self.split_ratio, float(np.max(err / half)))
    for k, m in view.get("master", {}).items():
      p = params[k]
      assert m.dtype == np.float32 and np.all(np.isfinite(m)), f"{where}: master {k}"
      assert np.array_equal(m.astype(p.dtype).view(np.uint16), p.view(np.uint16)), (
          f"{where}: param {k} is not the nearest rounding of its fp32 master")
    if "scale" in view:
      assert MIN_SCALE <= view["scale"] <= MAX_SCALE, f"{where}: scale {view['scale']}"
    loss = self.loss(params)
    assert np.isfinite(loss), where
    self.losses.append(loss)
    self.checks += 1

  def check_skipped(self, step, before, after):
    """The step that just ran had a non-finite gradient: nothing may change."""
    where = f"{self.framework} {self.name} at step {step}"
    for k in SHAPES:
      assert np.array_equal(before["params"][k].view(np.uint16),
                            after["params"][k].view(np.uint16)), f"{where}: {k} moved"
      assert np.array_equal(before["master"][k], after["master"][k]), f"{where}: master {k}"
    assert after["skipped"] == before["skipped"] + 1, (where, before["skipped"],
                                                       after["skipped"])
    assert after["scale"] == max(before["scale"] * 0.5, MIN_SCALE), (
        where, before["scale"], after["scale"])
    assert not after["last_finite"], where
    self.skip_checks += 1

  def finish(self, steps, wall, steady_s, memory):
    """Prints (and with SOAK_REPORT appends) the numbers, then checks the loss."""
    initial, final = self.losses[0], self.losses[-1]
    report = {
        "framework": self.framework, "optimizer": self.name, "steps": steps,
        "wall_s": round(wall, 2),
        # Between the warm-up check point and the end, checks included.
        "us_per_step_steady": round(steady_s / (steps - CHECK_EVERY) * 1e6, 1),
        "kahan_max_ratio": self.kahan_ratio, "split_max_ratio": self.split_ratio,
        "loss_first_check": round(initial, 6), "loss_final": round(final, 6),
        "skipped_steps_checked": self.skip_checks, **memory,
    }
    print(f"\nSOAK {json.dumps(report)}")
    path = os.environ.get("SOAK_REPORT")
    if path:
      with open(path, "a") as f:
        f.write(json.dumps(report) + "\n")
    where = f"{self.framework} {self.name}"
    # Never diverges; the compensated optimizers also keep learning.
    assert max(self.losses) <= 1.5 * max(initial, 1e-3), (where, self.losses[::10])
    if self.name not in STALE:
      # The loss starts near 1 (0.5 * E|p - target|^2 for two N(0, 1) draws);
      # after 20k steps at lr 3e-4 it is at the noise floor (~1e-3).
      bound = 0.05 if steps >= 20_000 else 0.75 * initial
      assert final <= bound, (where, initial, final)
    assert self.checks == steps // CHECK_EVERY, (self.checks, steps)
    return report


# ---------------------------------------------------------------------------
# JAX.
# ---------------------------------------------------------------------------


def _jax_tx(kind, compensation):
  if kind == "adamw_bf16":
    return oh.adamw_bf16(LR, compensation=compensation, key=0)
  if kind == "adam_fp32_master":
    return oh.adam_fp32_master(LR, weight_decay=1e-2)
  if kind == "scaled_adam":
    return oh.scaled_adam(SCALED_LR, clipping_scale=2.0)
  if kind == "kahan_scaled_adam":
    return oh.kahan_summation(oh.scaled_adam(SCALED_LR, clipping_scale=2.0))
  if kind == "loss_scale":
    return oh.dynamic_loss_scale(oh.adam_fp32_master(LR, weight_decay=1e-2),
                                 growth_interval=GROWTH_INTERVAL, min_scale=MIN_SCALE)
  raise ValueError(kind)


def _find(tree, cls):
  return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
          if isinstance(x, cls)]


def _jax_view(params, state):
  # Copies (np.array), never views of buffers the next step donates.
  view = {"params": {k: np.array(v) for k, v in params.items()}}
  view["state"] = [np.array(x).astype(np.float32) for x in jax.tree.leaves(state)
                   if jnp.issubdtype(x.dtype, jnp.floating)]
  for s in _find(state, oh.KahanSummationState):
    view["kahan"] = {k: np.array(v) for k, v in s.compensation.items()}
  for s in _find(state, oh.MasterWeightsState):
    key = "split" if s.master["w"].dtype == jnp.int16 else "master"
    view[key] = {k: np.array(v) for k, v in s.master.items()}
  for s in _find(state, oh.DynamicLossScaleState):
    view["scale"] = float(s.scale)
    view["skipped"] = int(s.skipped_steps)
    view["last_finite"] = bool(s.last_finite)
  return view


def _jax_step(tx, dtype, loss_scaled):
  dtype = jnp.dtype(dtype)

  def step(params, state, k, target, noise, gscale):
    i = k % N_SETS
    g = {n: gscale[i] * ((params[n].astype(jnp.float32) - target[n]) + noise[n][i])
         for n in params}
    if loss_scaled:
      bad = jnp.where((k // INJECT_EVERY) % 2 == 1, jnp.nan, jnp.inf)
      inject = k % INJECT_EVERY == INJECT_EVERY - 1
      g["w"] = g["w"].at[0, 0].set(jnp.where(inject, bad, g["w"][0, 0]))
      scale = oh.loss_scale(state)
      g = {n: (v * scale).astype(dtype) for n, v in g.items()}  # grads of scale * loss
    else:
      g = {n: v.astype(dtype) for n, v in g.items()}
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state, k + 1

  return jax.jit(step, donate_argnums=(0, 1, 2))


def _jax_memory():
  gc.collect()
  arrays = jax.live_arrays()
  out = (len(arrays), sum(a.nbytes for a in arrays))
  del arrays
  return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_jax_soak(name):
  kind, dtype, compensation = CONFIGS[name]
  loss_scaled = kind == "loss_scale"
  init, target, noise, gscale = _data()
  tracker = Tracker(name, "jax", target)
  tx = _jax_tx(kind, compensation)
  consts = ({k: jnp.asarray(v) for k, v in target.items()},
            {k: jnp.asarray(v) for k, v in noise.items()}, jnp.asarray(gscale))
  params = {k: jnp.asarray(v, dtype) for k, v in init.items()}
  state = tx.init(params)
  k = jnp.zeros([], jnp.int32)
  step = _jax_step(tx, dtype, loss_scaled)
  warm = end = None
  start = time.perf_counter()
  for t in range(STEPS):
    checkpoint = (t + 1) % CHECK_EVERY == 0
    if checkpoint and loss_scaled:
      assert _injected(t)
      before = _jax_view(params, state)
    params, state, k = step(params, state, k, *consts)
    if checkpoint:
      if t + 1 in (CHECK_EVERY, STEPS):
        # Counted before any host read: reading a bf16 array (np.array, int)
        # makes JAX keep a converted copy alive as long as the array lives.
        jax.block_until_ready((params, state, k))
        now = time.perf_counter()
        if t + 1 == CHECK_EVERY:
          warm, warm_t = (*_jax_memory(), _rss()), now
        else:
          end, end_t = (*_jax_memory(), _rss()), now
      view = _jax_view(params, state)
      tracker.check(t + 1, view)
      if loss_scaled:
        tracker.check_skipped(t + 1, before, view)
        del before
      del view
  assert int(k) == STEPS
  extra = {"live_arrays_warm": warm[:2], "live_arrays_end": end[:2],
           "rss_growth_bytes": end[2] - warm[2]}
  if loss_scaled:
    extra.update(_loss_scale_numbers(_jax_view(params, state)))
  tracker.finish(STEPS, end_t - start, end_t - warm_t, extra)
  # The same arrays, no more: donated buffers are reused, nothing leaks.
  assert end[:2] == warm[:2], (
      f"jax live arrays (count, bytes) {warm[:2]} after warm-up, {end[:2]} at the end")
  assert end[2] - warm[2] < RSS_SLACK, ("jax RSS grew", warm[2], end[2])


def _loss_scale_numbers(view):
  injected = sum(_injected(t) for t in range(STEPS))
  numbers = {"injected": injected, "skipped_total": view["skipped"],
             "final_scale": view["scale"]}
  # Every injected step was skipped; the rest are fp16 overflows of the scaled
  # gradient, which bound the scale from above.
  assert view["skipped"] >= injected, numbers
  return numbers


# ---------------------------------------------------------------------------
# torch.
# ---------------------------------------------------------------------------


@pytest.fixture
def torch_env():
  torch = pytest.importorskip("torch")
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # a small tree; leave the other cores alone
  device = os.environ.get("SOAK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
  yield torch, torch.device(device)
  torch.set_num_threads(threads)


def _torch_opt(tb, kind, compensation, params):
  named = list(zip(SHAPES, params))
  if kind == "adamw_bf16":
    return tb.adamw_bf16(params, LR, compensation=compensation, key=0, fused=False)
  if kind in ("adam_fp32_master", "loss_scale"):
    return tb.adam_fp32_master(params, LR, weight_decay=1e-2, fused=False)
  if kind == "scaled_adam":
    return tb.scaled_adam(named, SCALED_LR, clipping_scale=2.0)
  if kind == "kahan_scaled_adam":
    return tb.kahan_summation(tb.scaled_adam(named, SCALED_LR, clipping_scale=2.0))
  raise ValueError(kind)


def _np(torch, t):
  t = t.detach().cpu()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy().copy()


def _torch_state_tensors(torch, opt, scaler):
  """Every tensor the optimizer (and the scaler) holds between steps."""
  out = []

  def walk(x):
    if torch.is_tensor(x):
      out.append(x)
    elif isinstance(x, dict):
      for v in x.values():
        walk(v)
    elif isinstance(x, (list, tuple)):
      for v in x:
        walk(v)

  for o in (opt, getattr(opt, "inner", None)):
    if o is None:
      continue
    walk(list(o.state.values()))
    walk([g["params"] for g in o.param_groups])  # wrapper stand-ins: empty between steps
    walk(getattr(o, "group_state", []))
  if scaler is not None:
    walk(scaler.counters())
  return out


def _torch_view(torch, params, opt, scaler):
  view = {"params": {k: _np(torch, p) for k, p in zip(SHAPES, params)}, "state": []}
  for t in _torch_state_tensors(torch, opt, None):
    if t.is_floating_point():
      view["state"].append(_np(torch, t).astype(np.float32))
  for k, p in zip(SHAPES, params):
    st = opt.state[p]
    if "compensation" in st:
      view.setdefault("kahan", {})[k] = _np(torch, st["compensation"])
    if "master" in st:
      m = st["master"]
      view.setdefault("split" if m.dtype == torch.int16 else "master", {})[k] = _np(torch, m)
  if scaler is not None:
    c = scaler.counters()
    view["scale"] = float(c["scale"])
    view["skipped"] = int(c["skipped_steps"])
    view["last_finite"] = bool(c["last_finite"])
  return view


def _torch_memory(torch, device, params, opt, scaler):
  gc.collect()
  tensors = _torch_state_tensors(torch, opt, scaler) + list(params)
  tensors += [p.grad for p in params if p.grad is not None]
  out = {"tensors": len(tensors), "bytes": sum(t.nelement() * t.element_size() for t in tensors),
         "rss": _rss()}
  if device.type == "cuda":
    torch.cuda.synchronize(device)
    out["cuda_allocated"] = torch.cuda.memory_allocated(device)
  return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_soak(name, torch_env):
  torch, device = torch_env
  import torch_bridge as tb
  kind, dtype, compensation = CONFIGS[name]
  loss_scaled = kind == "loss_scale"
  tdtype = getattr(torch, dtype)
  init, target, noise, gscale = _data()
  tracker = Tracker(name, "torch", target)
  targets = [torch.tensor(target[k], device=device) for k in SHAPES]
  noises = [torch.tensor(noise[k], device=device) for k in SHAPES]
  scales = [float(s) for s in gscale]
  params = [torch.nn.Parameter(torch.tensor(init[k], device=device).to(tdtype))
            for k in SHAPES]
  opt = _torch_opt(tb, kind, compensation, params)
  scaler = (tb.dynamic_loss_scale(growth_interval=GROWTH_INTERVAL, min_scale=MIN_SCALE)
            if loss_scaled else None)

  @torch.no_grad()
  def step(t):
    i = t % N_SETS
    for n, (p, tgt, nz) in enumerate(zip(params, targets, noises)):
      g = scales[i] * ((p.float() - tgt) + nz[i])
      if loss_scaled:
        if n == 0 and _injected(t):
          g[0, 0] = _injected_value(t)
        p.grad = scaler.scale(g).to(tdtype)  # the gradient of scale * loss
      else:
        p.grad = g.to(tdtype)
    if loss_scaled:
      scaler.step(opt)
      scaler.update()
    else:
      opt.step()

  warm = None
  start = time.perf_counter()
  for t in range(STEPS):
    checkpoint = (t + 1) % CHECK_EVERY == 0
    if checkpoint and loss_scaled:
      assert _injected(t)
      before = _torch_view(torch, params, opt, scaler)
    step(t)
    if checkpoint:
      if t + 1 == CHECK_EVERY:
        warm, warm_t = _torch_memory(torch, device, params, opt, scaler), time.perf_counter()
      view = _torch_view(torch, params, opt, scaler)
      tracker.check(t + 1, view)
      if loss_scaled:
        tracker.check_skipped(t + 1, before, view)
        del before
      del view
  end_t = time.perf_counter()
  end = _torch_memory(torch, device, params, opt, scaler)
  where = f"torch {name}"
  extra = {"state_tensors_warm": warm["tensors"], "state_tensors_end": end["tensors"],
           "state_bytes_warm": warm["bytes"], "state_bytes_end": end["bytes"],
           "rss_growth_bytes": end["rss"] - warm["rss"]}
  if "cuda_allocated" in warm:
    extra["cuda_allocated_warm"] = warm["cuda_allocated"]
    extra["cuda_allocated_end"] = end["cuda_allocated"]
  if loss_scaled:
    extra.update(_loss_scale_numbers(_torch_view(torch, params, opt, scaler)))
  tracker.finish(STEPS, end_t - start, end_t - warm_t, extra)
  assert (end["tensors"], end["bytes"]) == (warm["tensors"], warm["bytes"]), (where, warm, end)
  assert end["rss"] - warm["rss"] < RSS_SLACK, (where, warm, end)
  if "cuda_allocated" in warm:
    assert end["cuda_allocated"] == warm["cuda_allocated"], (where, warm, end)
