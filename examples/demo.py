"""Stale bf16 weights and their cure: a byte-level transformer, in JAX and in PyTorch.

    python examples/demo.py                   # both frameworks, every run (about 7 minutes)
    python examples/demo.py --quick           # the CI version (about 3 minutes)
    python examples/demo.py --framework jax --runs fp32,naive,kahan --steps 2000

A small transformer language model learns the source code of Python's own
standard library (``examples/charlm_data.py``; nothing is downloaded). Every
run starts from the same fp32 weights (drawn once by Flax and handed to the
torch twin through DLPack), rounded once to its storage precision, and sees
the same batches in the same order. The math is fp32 in every run, so the
runs differ only in how the weights are stored and updated:

  fp32         AdamW on fp32 weights: the reference
  naive        AdamW on bf16 weights and bf16 moments: updates below half a ULP of
               the weight vanish, and so does weight decay (lr * wd * w is far below
               it); nu * 0.999 rounds back to nu in bf16, so nu barely decays
  kahan        adamw_bf16, compensation="kahan" (a bf16 buffer keeps what rounding lost)
  stochastic   adamw_bf16, compensation="stochastic" (unbiased rounding, no extra buffer)
  master       adam_fp32_master on bf16 weights (an fp32 copy of every weight)
  fp16         adam_fp32_master on fp16 weights, with dynamic loss scaling (at the
               default initial scale 2**16 no gradient of this model overflows, so
               no step is skipped; examples/flax_train_state.py shows skipping)
  scaled_adam_fp32  scaled_adam on fp32 weights (icefall's ScaledAdam): its reference
  scaled_adam  kahan_summation(scaled_adam) on bf16 weights

ScaledAdam runs at its own learning rate (it scales steps by each tensor's
RMS), so its bf16 run is measured against fp32 ScaledAdam, not fp32 AdamW:
each run's ratio is to its own fp32 reference (``REFERENCE``).

Prints a table (final train/val loss, ratio to the run's fp32 reference,
optimizer bytes/param, ms/step, skipped steps) and writes
``demo_out/loss_curves.png`` (top: the loss curves; bottom: each run's loss
over its reference's, step by step) and ``demo_out/results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import charlm_data  # noqa: E402

QUICK = dict(steps=500, eval_every=100, d_model=32, context=32)  # --quick
DEFAULTS = dict(steps=800, eval_every=100, d_model=64, context=64)

RUNS = {
    "fp32": "fp32 AdamW (reference)",
    "naive": "bf16 AdamW (naive)",
    "kahan": "bf16 adamw_bf16 kahan",
    "stochastic": "bf16 adamw_bf16 stochastic",
    "master": "bf16 adam_fp32_master",
    "fp16": "fp16 adam_fp32_master + loss scaling",
    "scaled_adam_fp32": "fp32 scaled_adam (reference)",
    "scaled_adam": "bf16 kahan(scaled_adam)",
}
# Each run's fp32 reference: same optimizer, same hyperparameters, fp32 weights.
REFERENCE = {run: "fp32" for run in RUNS}
REFERENCE.update(scaled_adam="scaled_adam_fp32", scaled_adam_fp32="scaled_adam_fp32")
# Every other run stores bf16.
DTYPE = {"fp32": "float32", "fp16": "float16", "scaled_adam_fp32": "float32"}


@dataclasses.dataclass
class Result:
  framework: str
  run: str
  train_curve: list  # batch loss at every step
  val_curve: list    # (step, val loss)
  train_loss: float  # mean batch loss over the last 10% of steps
  val_loss: float
  state_bytes_per_param: float  # optimizer state (moments, masters, buffers)
  ms_per_step: float
  skipped_steps: int
  data_order: str  # a hash of the batch offsets: equal in runs that saw the same data


class Progress:
  """What the demo does around each training step: evaluations, the bar, the clock.

  The clock counts training steps only, leaving out step 0 (compilation,
  warm-up) and evaluations. ``sync`` waits for the work queued so far: JAX
  (and torch on GPU) return before the step has run, so the clock is read
  only after a sync, and only at evaluation points.
  """

  def __init__(self, args, bar, evaluate, sync):
    self.args, self.bar, self.evaluate, self.sync = args, bar, evaluate, sync
    self.val_curve, self.seconds, self.mark = [(0, evaluate())], 0.0, 0.0

  def after_step(self, step: int) -> None:
    if step == 0:
      self.sync()
      self.mark = time.perf_counter()
    if (step + 1) % self.args.eval_every == 0 or step + 1 == self.args.steps:
      self.sync()
      self.seconds += time.perf_counter() - self.mark
      self.val_curve.append((step + 1, self.evaluate()))
      self.bar.set_postfix(val=f"{self.val_curve[-1][1]:.3f}")
      self.mark = time.perf_counter()
    self.bar.update()


# ---------------------------------------------------------------------- JAX


def jax_optimizer(run: str, args):
  """The optax transformation of ``run`` (all get the same AdamW hyperparameters)."""
  import optax

  import optax_half as oh

  adamw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=args.weight_decay)
  return {
      "fp32": lambda: optax.adamw(args.lr, **adamw),
      "naive": lambda: optax.adamw(args.lr, **adamw),
      "kahan": lambda: oh.adamw_bf16(args.lr, compensation="kahan", **adamw),
      "stochastic": lambda: oh.adamw_bf16(args.lr, compensation="stochastic", **adamw),
      "master": lambda: oh.adam_fp32_master(args.lr, **adamw),
      "fp16": lambda: oh.dynamic_loss_scale(oh.adam_fp32_master(args.lr, **adamw)),
      "scaled_adam_fp32": lambda: oh.scaled_adam(args.scaled_adam_lr, clipping_scale=2.0),
      "scaled_adam": lambda: oh.kahan_summation(
          oh.scaled_adam(args.scaled_adam_lr, clipping_scale=2.0)),
  }[run]()


def train_jax(run: str, args, data, bar) -> Result:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import charlm_flax
  import optax_half as oh

  cfg, (train, val) = args.config, data
  model = charlm_flax.create(cfg, jnp.dtype(DTYPE.get(run, "bfloat16")), seed=args.seed)
  optimizer = nnx.Optimizer(model, jax_optimizer(run, args), wrt=nnx.Param)
  loss_scaling = run == "fp16"

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      loss = charlm_flax.loss_fn(model, x, y)
      # The fp16 run differentiates scale * loss; its optimizer unscales.
      return (oh.scale_loss(loss, optimizer.opt_state) if loss_scaling else loss), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def eval_step(model, x, y):
    return charlm_flax.loss_fn(model, x, y)

  # Bind the model and optimizer once: nnx.jit then skips re-walking their
  # graphs on every call (nnx.jit_partial skips more: benchmarks/README.md).
  train_step = nnx.cached_partial(train_step, model, optimizer)
  eval_step = nnx.cached_partial(eval_step, model)

  def evaluate():
    return float(np.mean([eval_step(x, y) for x, y in val]))

  starts = charlm_data.batch_starts(len(train), args.steps, args.batch, cfg.context, args.seed)
  losses = []
  progress = Progress(args, bar, evaluate, sync=lambda: jax.block_until_ready(losses[-1]))
  for step in range(args.steps):
    x, y = charlm_data.windows(train, starts[step], cfg.context)
    losses.append(train_step(x, y))  # no host sync in the loop
    progress.after_step(step)

  state = nnx.state(optimizer, nnx.optimizer.OptState)
  n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  state_bytes = sum(a.nbytes for a in jax.tree.leaves(state) if a.ndim > 0)
  skipped = int(oh.find_loss_scale_state(optimizer.opt_state).skipped_steps) if loss_scaling else 0
  return _result("jax", run, jax.device_get(losses), progress, state_bytes / n_params,
                 skipped, starts)


# -------------------------------------------------------------------- torch


def torch_optimizer(run: str, params, args):
  """``(optimizer, loss scaler or None)`` of ``run``: the torch twin of ``jax_optimizer``."""
  import torch

  import torch_bridge as tb

  adamw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=args.weight_decay)
  torch_adamw = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
  if run in ("fp32", "naive"):
    return torch.optim.AdamW(params, **torch_adamw), None
  if run in ("kahan", "stochastic"):
    return tb.adamw_bf16(params, args.lr, compensation=run, **adamw), None
  if run == "master":
    return tb.adam_fp32_master(params, args.lr, **adamw), None
  if run == "fp16":
    return tb.adam_fp32_master(params, args.lr, **adamw), tb.dynamic_loss_scale()
  if run == "scaled_adam_fp32":
    return tb.scaled_adam(params, args.scaled_adam_lr, clipping_scale=2.0), None
  if run == "scaled_adam":
    return tb.kahan_summation(tb.scaled_adam(params, args.scaled_adam_lr, clipping_scale=2.0)), None
  raise ValueError(run)


def train_torch(run: str, args, data, bar, init_params) -> Result:
  import torch

  import charlm_torch

  cfg, (train, val) = args.config, data
  model = charlm_torch.CharTransformer(cfg)
  charlm_torch.load_flax_params(model, init_params)  # the same fp32 draw as JAX
  model.to(getattr(torch, DTYPE.get(run, "bfloat16")))
  # named_parameters: scaled_adam names its clipping statistics after them.
  optimizer, scaler = torch_optimizer(run, model.named_parameters(), args)

  def batch(x, y):
    return torch.from_numpy(x), torch.from_numpy(y).long()

  @torch.no_grad()
  def evaluate():
    return float(np.mean([charlm_torch.loss_fn(model, *batch(x, y)).item() for x, y in val]))

  starts = charlm_data.batch_starts(len(train), args.steps, args.batch, cfg.context, args.seed)
  losses = []
  progress = Progress(args, bar, evaluate, sync=lambda: losses[-1].item())
  for step in range(args.steps):
    x, y = batch(*charlm_data.windows(train, starts[step], cfg.context))
    loss = charlm_torch.loss_fn(model, x, y)
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
      loss.backward()
      optimizer.step()
    else:  # fp16: backward through scale * loss, skip steps whose gradients overflow
      scaler.scale(loss).backward()
      scaler.step(optimizer)
      scaler.update()
    losses.append(loss.detach())
    progress.after_step(step)

  n_params = sum(p.numel() for p in model.parameters())
  state_bytes = _tensor_bytes(optimizer.state_dict())  # a wrapper's holds its inner's
  skipped = int(scaler.state_dict()["skipped_steps"]) if scaler is not None else 0
  return _result("torch", run, torch.stack(losses).tolist(), progress, state_bytes / n_params,
                 skipped, starts)


# ------------------------------------------------------------------- report


def _tensor_bytes(obj) -> int:
  """Bytes of the non-scalar tensors anywhere in a (nested) torch state_dict."""
  import torch

  if isinstance(obj, torch.Tensor):
    return obj.numel() * obj.element_size() if obj.ndim > 0 else 0
  if isinstance(obj, dict):
    return sum(_tensor_bytes(v) for v in obj.values())
  if isinstance(obj, (list, tuple)):
    return sum(_tensor_bytes(v) for v in obj)
  return 0


def _result(framework, run, losses, progress, bytes_per_param, skipped, starts):
  losses = [float(v) for v in losses]
  tail = max(1, len(losses) // 10)
  ms_per_step = 1e3 * progress.seconds / max(1, len(losses) - 1)
  return Result(framework, run, losses, progress.val_curve, float(np.mean(losses[-tail:])),
                progress.val_curve[-1][1], bytes_per_param, ms_per_step, skipped,
                hashlib.sha256(np.ascontiguousarray(starts).tobytes()).hexdigest()[:16])


def _reference(results: list[Result], r: Result):
  """The result of ``r``'s fp32 reference in the same framework, or None if not run."""
  return next((q for q in results
               if q.framework == r.framework and q.run == REFERENCE[r.run]), None)


def table(results: list[Result]) -> str:
  head = (f"{'framework':9s} {'run':38s} {'train':>7s} {'val':>7s} {'val/ref':>7s} "
          f"{'opt B/param':>11s} {'ms/step':>8s} {'skipped':>7s}")
  lines = [head, "-" * len(head)]
  for r in results:
    ref = _reference(results, r)
    ratio = f"{r.val_loss / ref.val_loss:7.3f}" if ref else f"{'':7s}"
    lines.append(f"{r.framework:9s} {RUNS[r.run]:38s} {r.train_loss:7.4f} {r.val_loss:7.4f} "
                 f"{ratio} {r.state_bytes_per_param:11.1f} {r.ms_per_step:8.2f} "
                 f"{r.skipped_steps:7d}")
  lines.append("val/ref: val loss over the run's fp32 reference (AdamW, or ScaledAdam for "
               "kahan(scaled_adam)).")
  return "\n".join(lines)


def _smooth(curve, window):
  return np.convolve(np.asarray(curve), np.ones(window) / window, mode="valid")


def plot(results: list[Result], path: pathlib.Path, title: str) -> None:
  """Top: the loss curves. Bottom: each run's loss over its own fp32 reference's,
  where the cures' lie on 1 and the naive run's climbs away from it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  frameworks = sorted({r.framework for r in results})
  fig, axes = plt.subplots(2, len(frameworks), figsize=(6.5 * len(frameworks), 8.5),
                           sharey="row", squeeze=False, height_ratios=(1, 1.1))
  colors = dict(zip(RUNS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  style = {run: "--" if REFERENCE[run] == run else "-" for run in RUNS}  # references dashed
  for col, framework in enumerate(frameworks):
    top, bottom = axes[0][col], axes[1][col]
    for r in (r for r in results if r.framework == framework):
      window = max(1, len(r.train_curve) // 25)
      smooth = _smooth(r.train_curve, window)
      steps, vals = map(np.asarray, zip(*r.val_curve))
      top.plot(np.arange(window, len(r.train_curve) + 1), smooth, color=colors[r.run],
               alpha=0.45, lw=1)
      top.plot(steps, vals, "o" + style[r.run], color=colors[r.run], ms=3, lw=1.5,
               label=f"{RUNS[r.run]}: val {r.val_loss:.3f}")
      ref = _reference(results, r)
      if ref is None or ref is r:
        continue
      ratio = smooth / _smooth(ref.train_curve, window)
      bottom.plot(np.arange(window, len(r.train_curve) + 1), ratio, color=colors[r.run],
                  alpha=0.35, lw=1)
      ref_vals = dict(ref.val_curve)
      bottom.plot(steps, [v / ref_vals[s] for s, v in zip(steps, vals)], "o-",
                  color=colors[r.run], ms=3, lw=1.5,
                  label=f"{RUNS[r.run]} / {RUNS[ref.run].split(' (')[0]}: "
                        f"{r.val_loss / ref.val_loss:.3f}")
    bottom.axhline(1.0, color="black", lw=0.8)
    top.set_title(f"{framework}: {title}", fontsize=10)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7.5)
  axes[0][0].set_ylabel("loss (nats/byte): thin = train (smoothed), dots = val")
  axes[1][0].set_ylabel("loss / its fp32 reference's (1 = as good as fp32)")
  low = min(v for r in results for _, v in r.val_curve)
  axes[0][0].set_ylim(low - 0.1, low + 1.5)  # the start (ln 256 = 5.5) would flatten the rest
  axes[1][0].set_ylim(0.97, 1.12)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  from charlm_flax import Config

  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--framework", choices=["jax", "torch", "both"], default="both")
  parser.add_argument("--runs", default=",".join(RUNS),
                      help=f"comma-separated subset of: {', '.join(RUNS)}")
  parser.add_argument("--steps", type=int, help=f"default {DEFAULTS['steps']}")
  parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (all AdamW runs)")
  parser.add_argument("--scaled-adam-lr", type=float, default=0.03)
  parser.add_argument("--weight-decay", type=float, default=0.01, help="all AdamW runs")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--context", type=int, help=f"default {DEFAULTS['context']}")
  parser.add_argument("--d-model", type=int, help=f"default {DEFAULTS['d_model']}")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--eval-every", type=int, help=f"default {DEFAULTS['eval_every']}")
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="demo_out", help="directory for the plot and the JSON")
  parser.add_argument("--quick", action="store_true",
                      help="for CI: 500 steps of a d_model 32, context 32 model, unless those "
                           "flags are given (about 3 minutes)")
  args = parser.parse_args(argv)
  for name, default in (QUICK if args.quick else DEFAULTS).items():
    if getattr(args, name) is None:  # flags given explicitly win over --quick
      setattr(args, name, default)
  args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  unknown = [r for r in args.runs if r not in RUNS]
  if unknown:
    parser.error(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
  if args.steps < 1:
    parser.error("--steps must be >= 1")
  args.config = Config(context=args.context, d_model=args.d_model, heads=args.heads,
                       layers=args.layers)
  return args


def main(argv=None) -> list[Result]:
  args = parse_args(argv)
  from tqdm import tqdm

  text = charlm_data.corpus()
  train, val = charlm_data.split(text)
  data = (train, charlm_data.eval_batches(val, args.eval_batches, args.batch, args.context))
  frameworks = ["jax", "torch"] if args.framework == "both" else [args.framework]
  title = (f"d_model {args.d_model}, {args.layers} layers, batch {args.batch}x{args.context}, "
           f"lr {args.lr:g}")
  import jax
  print(f"byte-level LM on {len(text) / 1e6:.2f} MB of Python stdlib source; {title}; "
        f"{args.steps} steps per run; JAX on {jax.devices()[0].platform}, torch on cpu\n")

  results = []
  for framework in frameworks:
    if framework == "torch":  # the torch model gets the weights Flax draws (via DLPack)
      import jax.numpy as jnp
      from flax import nnx

      import charlm_flax
      init_params = nnx.state(charlm_flax.create(args.config, jnp.float32, args.seed), nnx.Param)
    for run in args.runs:
      with tqdm(total=args.steps, desc=f"{framework:5s} {RUNS[run]}", ncols=100,
                mininterval=0.1 if sys.stderr.isatty() else 30) as bar:  # quiet in CI logs
        if framework == "jax":
          results.append(train_jax(run, args, data, bar))
        else:
          results.append(train_torch(run, args, data, bar, init_params))

  print()
  print(table(results))
  print("\nopt B/param: optimizer state only (moments, fp32 masters, compensation buffers); "
        "params and grads add 2+2 bytes (bf16/fp16) or 4+4 (fp32).")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  plot(results, out / "loss_curves.png", title)
  with open(out / "results.json", "w") as f:
    json.dump({"args": {k: v for k, v in vars(args).items() if k != "config"},
               "config": dataclasses.asdict(args.config),
               "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
  print(f"\nloss curves: {out / 'loss_curves.png'}\nall numbers: {out / 'results.json'}")
  return results


if __name__ == "__main__":
  main()
