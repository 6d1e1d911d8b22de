"""JAX optimizer step time, as ratios to optax.adamw fp32 in the same process.

    python -m benchmarks.step [--tree standard|many|quick] [--quick] [--reps N]
                              [--only A,B] [--grads input|in-step] [--heap-malloc]
                              [--gc on|freeze|off] [--settle-ms MS] [--json PATH]

Every optimizer runs jitted (``tx.update`` + ``optax.apply_updates``, and
for the native-kernel optimizers also ``oh.update_and_apply``, which writes
the params in place) with donated params, state and gradients (a copy made
before each step, untimed: a training step's gradients are dead after the
update, and XLA may reuse their buffers), interleaved (every run once per
repetition, in an order shuffled each repetition), the median of the
repetitions after a warm-up; compile time is reported separately ("setup
s"). Bytes/param count the params, one gradient and the optimizer state
actually allocated; "moved" is the algorithm's minimum traffic
(benchmarks/common.py) and "xla B/p" what XLA's ``cost_analysis()`` says the
compiled step accesses (custom calls count as 0 there); the temporaries XLA
allocates for each step (``memory_analysis()``) are printed per param after the
table. Findings: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import optax_half as oh
import optax_half.nnx  # noqa: F401 - oh.nnx.Optimizer
import optax_half.train_state  # noqa: F401 - oh.train_state.TrainState
import optax_half_native as native
from benchmarks import common


def make_tree(tree: str):
  key = jax.random.key(0)
  return {f"p{i:03d}": jax.random.normal(jax.random.fold_in(key, i), s) * 0.02
          for i, s in enumerate(common.shapes(tree))}


def candidates(lr=1e-3):
  bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
  return {
      "optax.adamw fp32 (reference)": (f32, optax.adamw(lr)),
      "optax.adamw bf16 (naive)": (bf16, optax.adamw(lr)),
      "adamw_bf16 kahan": (bf16, oh.adamw_bf16(lr)),
      "adamw_bf16 kahan flat_state": (bf16, oh.adamw_bf16(lr, flat_state=True)),
      "adamw_bf16 split": (bf16, oh.adamw_bf16(lr, compensation="split")),
      "adamw_bf16 stochastic": (bf16, oh.adamw_bf16(lr, compensation="stochastic")),
      "adam_fp32_master": (bf16, oh.adam_fp32_master(lr)),
      "adam_fp32_master flat_state": (bf16, oh.adam_fp32_master(lr, flat_state=True)),
      "adam_fp32_master fp16": (f16, oh.adam_fp32_master(lr)),
      "adamw_bf16 kahan fp16": (f16, oh.adamw_bf16(lr)),
      "kahan_summation(scale_by_adamw) (no kernel)": (
          bf16, oh.kahan_summation(oh.scale_by_adamw(lr, weight_decay=1e-2))),
      "master_weights(scale_by_adamw) (no kernel)": (
          bf16, oh.master_weights(oh.scale_by_adamw(lr, mu_dtype=f32, nu_dtype=f32,
                                                    state_rounding="nearest"))),
      "dynamic_loss_scale(adamw_bf16 kahan)": (bf16, oh.dynamic_loss_scale(oh.adamw_bf16(lr))),
      "dynamic_loss_scale(adam_fp32_master) fp16": (
          f16, oh.dynamic_loss_scale(oh.adam_fp32_master(lr))),
      "scaled_adam": (bf16, oh.scaled_adam(lr)),
      "scaled_adam clip 2.0 fp32": (f32, oh.scaled_adam(lr, clipping_scale=2.0)),
      "scaled_adam clip 2.0": (bf16, oh.scaled_adam(lr, clipping_scale=2.0)),
      "kahan_summation(scaled_adam clip 2.0)": (
          bf16, oh.kahan_summation(oh.scaled_adam(lr, clipping_scale=2.0))),
  }


# Stepped with oh.update_and_apply (the kernel writes the new params into their
# donated buffers) instead of tx.update + optax.apply_updates.
IN_PLACE = ("adamw_bf16 kahan", "adamw_bf16 kahan flat_state", "adamw_bf16 split",
            "adamw_bf16 stochastic", "adam_fp32_master", "adam_fp32_master flat_state",
            "adam_fp32_master fp16", "adamw_bf16 kahan fp16",
            "dynamic_loss_scale(adamw_bf16 kahan)", "dynamic_loss_scale(adam_fp32_master) fp16",
            "scaled_adam clip 2.0 fp32", "scaled_adam clip 2.0",
            "kahan_summation(scaled_adam clip 2.0)")
IN_PLACE_SUFFIX = " (update_and_apply)"


# JAX's cost per array: a step that returns the donated params and state of
# adamw_bf16 kahan untouched (it also takes the gradients), i.e. the same
# arrays in and out and no work. Its time is the floor of that tree layout.
FLOOR = "floor: adamw_bf16 kahan's arrays returned untouched"

# Gradient clipping before the Kahan step, in place: optax's clip_by_global_norm
# and optax_half's (the same bits, no fp32 copy of the bf16 gradients).
# (oh.chain of the two; no commas in the names: --only splits at them)
CLIPPED = {f"{module}.clip_by_global_norm + kahan{IN_PLACE_SUFFIX}":
           clip for module, clip in (("optax", optax.clip_by_global_norm),
                                     ("oh", oh.clip_by_global_norm))}


# The steps Flax users write: nnx.Optimizer.update(model, grads) in an
# nnx.jit with the model, optimizer and gradients donated, and
# TrainState.apply_gradients in a jax.jit with the state and gradients
# donated; with Flax's classes (tx.update + optax.apply_updates) and with
# optax_half's drop-ins (oh.nnx.Optimizer, oh.train_state.TrainState:
# update_and_apply). The name's first word is the class.
FLAX = {
    "nnx.Optimizer optax.adamw fp32": (jnp.float32, lambda lr: optax.adamw(lr), "nnx"),
    "nnx.Optimizer adamw_bf16 kahan": (jnp.bfloat16, lambda lr: oh.adamw_bf16(lr), "nnx"),
    "oh.nnx.Optimizer adamw_bf16 kahan": (jnp.bfloat16, lambda lr: oh.adamw_bf16(lr), "oh.nnx"),
    "oh.nnx.Optimizer adamw_bf16 stochastic": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr, compensation="stochastic"), "oh.nnx"),
    "oh.nnx.Optimizer adam_fp32_master": (jnp.bfloat16, lambda lr: oh.adam_fp32_master(lr),
                                          "oh.nnx"),
    "oh.nnx.Optimizer oh.chain(oh.clip_by_global_norm + kahan)": (
        jnp.bfloat16, lambda lr: oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(lr)),
        "oh.nnx"),
    "oh.nnx.Optimizer dynamic_loss_scale(adamw_bf16 kahan)": (
        jnp.bfloat16, lambda lr: oh.dynamic_loss_scale(oh.adamw_bf16(lr)), "oh.nnx"),
    "oh.nnx.Optimizer kahan_summation(scaled_adam clip 2.0)": (
        jnp.bfloat16, lambda lr: oh.kahan_summation(oh.scaled_adam(lr, clipping_scale=2.0)),
        "oh.nnx"),
    "oh.nnx.Optimizer adamw_bf16 kahan (cached_partial)": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr), "oh.nnx cached"),
    # flat_state=True: three state arrays instead of three a param, fewer
    # Variables for nnx.jit to traverse
    "oh.nnx.Optimizer adamw_bf16 kahan flat_state": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr, flat_state=True), "oh.nnx"),
    "oh.nnx.Optimizer adamw_bf16 kahan flat_state (cached_partial)": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr, flat_state=True), "oh.nnx cached"),
    "oh.nnx.Optimizer kahan_summation(scaled_adam clip 2.0) (cached_partial)": (
        jnp.bfloat16, lambda lr: oh.kahan_summation(oh.scaled_adam(lr, clipping_scale=2.0)),
        "oh.nnx cached"),
    # Flax's functional training loop: nnx.split once, a jax.jit of a pure
    # step (merge, update, split), so the object graph is traversed when the
    # step is traced, not on every call
    "oh.nnx.Optimizer adamw_bf16 kahan (functional)": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr), "oh.nnx functional"),
    # nnx.jit_partial (Flax >= 0.12.5), tree mode: the model and optimizer
    # flattened once into a list of Variables, passed donated on every call
    "nnx.Optimizer optax.adamw fp32 (jit_partial)": (
        jnp.float32, lambda lr: optax.adamw(lr), "nnx jit_partial"),
    "oh.nnx.Optimizer adamw_bf16 kahan (jit_partial)": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr), "oh.nnx jit_partial"),
    "oh.nnx.Optimizer kahan_summation(scaled_adam clip 2.0) (jit_partial)": (
        jnp.bfloat16, lambda lr: oh.kahan_summation(oh.scaled_adam(lr, clipping_scale=2.0)),
        "oh.nnx jit_partial"),
    "oh.nnx.Optimizer adamw_bf16 kahan flat_state (jit_partial)": (
        jnp.bfloat16, lambda lr: oh.adamw_bf16(lr, flat_state=True), "oh.nnx jit_partial"),
    "oh.nnx.Optimizer oh.chain(oh.clip_by_global_norm + kahan) (jit_partial)": (
        jnp.bfloat16, lambda lr: oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(lr)),
        "oh.nnx jit_partial"),
    "TrainState optax.adamw fp32": (jnp.float32, lambda lr: optax.adamw(lr), "train_state"),
    "oh.TrainState adamw_bf16 kahan": (jnp.bfloat16, lambda lr: oh.adamw_bf16(lr),
                                       "oh.train_state"),
    "oh.TrainState kahan_summation(scaled_adam clip 2.0)": (
        jnp.bfloat16, lambda lr: oh.kahan_summation(oh.scaled_adam(lr, clipping_scale=2.0)),
        "oh.train_state"),
}


FLAX_MODES = ("nnx", "oh.nnx", "oh.nnx cached", "oh.nnx functional", "nnx jit_partial",
              "oh.nnx jit_partial", "train_state", "oh.train_state")


def _flax_has(mode: str) -> bool:
  """Whether this Flax has what a Flax mode calls (jit_partial: Flax >= 0.12.5)."""
  needs = {"jit_partial": "jit_partial", "cached": "cached_partial"}
  return all(hasattr(nnx, fn) for key, fn in needs.items() if mode.endswith(key))


def all_candidates(lr=1e-3):
  """(dtype, tx, mode) by name: every candidate (mode False: tx.update and
  apply_updates), then the in-place steps (True: update_and_apply), the
  clipped in-place steps, the floor ("identity"), then the Flax steps (mode:
  one of FLAX_MODES)."""
  out = {name: (dtype, tx, False) for name, (dtype, tx) in candidates(lr).items()}
  for name in IN_PLACE:
    out[name + IN_PLACE_SUFFIX] = (*out[name][:2], True)
  for name, clip in CLIPPED.items():
    out[name] = (jnp.bfloat16, oh.chain(clip(1.0), oh.adamw_bf16(lr)), True)
  out[FLOOR] = (*out["adamw_bf16 kahan"][:2], "identity")
  for name, (dtype, make, mode) in FLAX.items():
    if _flax_has(mode):
      out[name] = (dtype, make(lr), mode)
  return out


def _pure_params(model):
  """The model's params as arrays, ordered as ``linear_loss``'s coefficients."""
  return {k: getattr(model, k)[...] for k in sorted(vars(model)) if k.startswith("p")}


class _Tree(nnx.Module):
  """An NNX module whose params are a tree's leaves, by the tree's keys."""

  def __init__(self, tree):
    for k, v in tree.items():
      setattr(self, k, nnx.Param(v))


def linear_loss(params, coefficients):
  """sum(p * c) over the leaves, in fp32: its gradient is the coefficients,
  a pass that writes the gradients as a backward pass would (--grads in-step)."""
  return sum(jnp.vdot(a.astype(jnp.float32), b) for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(coefficients))).astype(jnp.float32)


def in_step_update(model, optimizer, coefficients):
  """``optimizer.update`` with the gradients of ``linear_loss`` taken in the
  step (``nnx.grad``), as a training step takes them."""
  grads = nnx.grad(lambda m: linear_loss(_pure_params(m), coefficients))(model)
  optimizer.update(model, grads)


def functional_loop(update, model, optimizer, donate_argnums):
  """Flax's functional training loop: ``nnx.split`` once, then a ``jax.jit``
  of merge, ``update(model, optimizer, x)`` and split. Returns ``(state,
  step)``; ``step(state, x)`` returns the next state."""
  graphdef, state = nnx.split((model, optimizer))

  def pure(state, x):
    m, o = nnx.merge(graphdef, state)
    update(m, o, x)
    return nnx.state((m, o))
  return state, jax.jit(pure, donate_argnums=donate_argnums)


def flax_step(mode, tx, params, grads, in_step=False):
  """(params-like, state-like, grads, step, lowered, ready) of a Flax step:
  the harness calls ``step(a, b, g)`` and gets back the next ``(a, b)``, then
  ``ready(a, b)``, which waits for one output of the step (all of a step's
  outputs are ready together; waiting on the module itself would also time
  flattening it, which a training loop does not do). With ``in_step``,
  ``grads`` are the coefficients of ``linear_loss`` and the step takes the
  gradients of it (``nnx.grad``, ``jax.grad``), as a training step does."""
  if mode.startswith(("nnx", "oh.nnx")):
    model = _Tree(params)
    cls = nnx.Optimizer if mode.startswith("nnx") else oh.nnx.Optimizer
    optimizer = cls(model, tx, wrt=nnx.Param)
    ready = lambda m, o: o.step[...].block_until_ready()
    if in_step:
      g, update = grads, in_step_update
    elif mode.endswith("jit_partial"):  # takes no Variables: the gradients as arrays
      g = grads

      def update(m, o, g):
        o.update(m, nnx.state(_Tree(g), nnx.Param))
    else:
      g = nnx.state(_Tree(grads), nnx.Param)

      def update(m, o, g):
        o.update(m, g)
    if mode == "oh.nnx functional":
      state, pure = functional_loop(update, model, optimizer, donate_argnums=(0, 1))
      return (state, None, g, lambda st, _, g: (pure(st, g), None), pure.lower(state, g),
              lambda st, _: jax.block_until_ready(st[1]["step"]))
    if mode.endswith("jit_partial"):
      # the partial args (model, optimizer) are the jitted function's first
      # argument, one list of Variables; donated with the gradients
      jitted = nnx.jit_partial(update, model, optimizer, donate_argnums=(0, 1), graph=False)

      def step(m, o, g):
        jitted(g)
        return m, o
      return model, optimizer, g, step, jitted.lower(g), ready
    jitted = nnx.jit(update, donate_argnums=(0, 1, 2))
    lowered = jitted.lower(model, optimizer, g)
    if mode == "oh.nnx cached":
      # Flax's cache of the model's and optimizer's traversal: the call
      # takes only the gradients.
      cached = nnx.cached_partial(jitted, model, optimizer)

      def step(m, o, g):
        cached(g)
        return m, o
    else:
      def step(m, o, g):
        jitted(m, o, g)
        return m, o
    return model, optimizer, g, step, lowered, ready
  cls = oh.train_state.TrainState if mode == "oh.train_state" else train_state.TrainState
  state = cls.create(apply_fn=None, params=params, tx=tx)

  def apply(st, g):
    if in_step:
      g = jax.grad(linear_loss)(st.params, g)
    return st.apply_gradients(grads=g)
  jitted = jax.jit(apply, donate_argnums=(0, 1))
  return (state, None, grads, lambda st, _, g: (jitted(st, g), None), jitted.lower(state, grads),
          lambda st, _: st.step.block_until_ready())


# The yardsticks' steps, each writing into a donated buffer. The copy's
# destination y is unused by its computation: without keep_unused, jit drops
# it, and the copy goes to a fresh 256 MB buffer each call, faulted in page by
# page at a fraction of the rate into y's buffer (benchmarks/README.md).
_scale = jax.jit(lambda x: x * 1.0000001, donate_argnums=0)
_copy = jax.jit(lambda y, x: x + 0.0, donate_argnums=0, keep_unused=True)


def bandwidth() -> dict:
  """Streaming bandwidth into donated buffers (no fresh allocation timed)."""
  bufs = dict(x=jnp.ones(common.BANDWIDTH_BYTES // 4, jnp.float32))
  bufs["y"] = jnp.zeros_like(bufs["x"])

  def scale():
    bufs["x"] = _scale(bufs["x"]).block_until_ready()

  def copy():
    bufs["y"] = _copy(bufs["y"], bufs["x"]).block_until_ready()

  return {name: common.best_gb_per_s(run, 2 * common.BANDWIDTH_BYTES)
          for name, run in (("in-place scale", scale), ("copy", copy))}


def fresh(tree):
  """A copy of the gradients to donate to one step, as a training step's
  gradients are computed in it and dead after the update."""
  return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# The rows whose memory is measured (each in a fresh process, ``--memory``):
# resident bytes and transient peaks of making the state and of a step.
MEMORY_ROWS = ("optax.adamw fp32 (reference)", "optax.adamw bf16 (naive)", "adamw_bf16 kahan",
               "adamw_bf16 kahan (update_and_apply)", "adamw_bf16 kahan flat_state",
               "adamw_bf16 kahan flat_state (update_and_apply)", "adamw_bf16 split",
               "adamw_bf16 stochastic (update_and_apply)", "adam_fp32_master",
               "adam_fp32_master (update_and_apply)", "adam_fp32_master flat_state",
               "kahan_summation(scale_by_adamw) (no kernel)",
               "dynamic_loss_scale(adamw_bf16 kahan) (update_and_apply)",
               "kahan_summation(scaled_adam clip 2.0) (update_and_apply)",
               "oh.nnx.Optimizer adamw_bf16 kahan (jit_partial)",
               "oh.TrainState adamw_bf16 kahan")
QUICK_MEMORY_ROWS = ("optax.adamw fp32 (reference)", "adamw_bf16 kahan",
                     "adamw_bf16 kahan (update_and_apply)")


def memory_row(name: str, tree_name: str) -> dict:
  """Bytes per param of one row, in this process (fresh, ``common.MEMORY_ENV``): the
  state, the resident params + gradients + state, and the high-water mark above that
  while making the state (``tx.init``, or the Flax object that calls it; compiled
  before, on the same shapes) and during a donated step after two warm-up steps;
  "kept": what making the state left resident beyond the state's arrays."""
  dtype, tx, mode = all_candidates()[name]
  tree32 = make_tree(tree_name)
  n = sum(x.size for x in jax.tree.leaves(tree32))
  params = jax.block_until_ready(jax.tree.map(lambda x: x.astype(dtype), tree32))
  grads = jax.block_until_ready(jax.tree.map(lambda x: (x * 0.1).astype(dtype), tree32))
  del tree32
  state_bytes = nbytes(jax.eval_shape(tx.init, params))
  jax.block_until_ready(tx.init(params))  # compiles the init: not a per-call cost
  flax_mode = mode in FLAX_MODES
  base = common.resident_bytes()
  common.reset_peak()
  if mode in ("oh.nnx jit_partial", "oh.nnx", "nnx", "nnx jit_partial"):
    made = (oh.nnx.Optimizer if mode.startswith("oh.") else nnx.Optimizer)(
        _Tree(params), tx, wrt=nnx.Param)
  elif flax_mode:
    made = (oh.train_state.TrainState if mode.startswith("oh.") else train_state.TrainState
            ).create(apply_fn=None, params=params, tx=tx)
  else:
    state = made = tx.init(params)
  jax.block_until_ready(jax.tree.leaves(made))
  init_peak, kept = common.peak_bytes() - base, common.resident_bytes() - base
  del made

  def step(p, s, g):
    if mode:
      return oh.update_and_apply(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    if flax_mode:
      a, b, g, fn, lowered, ready = flax_step(mode, tx, params, grads)
      del params
    else:
      a, b, g = params, state, grads
      fn = jax.jit(step, donate_argnums=(0, 1, 2))
      ready = lambda p, _: jax.block_until_ready(p)  # noqa: E731
      del params, state
    for _ in range(2):
      a, b = fn(a, b, fresh(g))
      ready(a, b)
    fresh_g = fresh(g)
    before = common.resident_bytes()
    common.reset_peak()
    a, b = fn(a, b, fresh_g)
    ready(a, b)
    step_peak = common.peak_bytes() - before
  grad_bytes = nbytes(grads)  # the params' too: the same dtypes
  return dict(state=state_bytes / n, resident=(2 * grad_bytes + state_bytes) / n,
              init_peak=(init_peak - state_bytes) / n, init_kept=(kept - state_bytes) / n,
              step_peak=step_peak / n)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--tree", choices=list(common.TREES), default=None)
  parser.add_argument("--quick", action="store_true", help="small tree, few repetitions")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--only", default=None, help="comma-separated candidate names (+ reference)")
  parser.add_argument("--grads", choices=["input", "in-step"], default="input",
                      help="gradients given to the step, or computed in it (the gradient of "
                           "a linear loss: a pass that produces them, as a backward pass would)")
  parser.add_argument("--json", default=None)
  common.add_settle_argument(parser)
  common.add_gc_argument(parser)
  parser.add_argument("--heap-malloc", action="store_true",
                      help="rerun with glibc serving large allocations from the heap "
                           "(common.HEAP_MALLOC_ENV)")
  parser.add_argument("--memory", choices=["on", "off"], default="on",
                      help="measure MEMORY_ROWS' resident bytes and peaks, each in a fresh "
                           "process (Linux; default on)")
  parser.add_argument("--memory-row", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--split", type=int, default=0, metavar="K",
                      help="also what a step pays apart (the optax rows): device_ms, K steps "
                           "in one jit (a fori_loop over a donated carry), and host_ms, the "
                           "time a call takes to return before its work is done")
  args = parser.parse_args(argv)
  tree_name = args.tree or ("quick" if args.quick else "standard")
  if args.memory_row:
    print(json.dumps(memory_row(args.memory_row, tree_name)))
    return None
  if args.heap_malloc:
    common.rerun_with_heap_malloc(argv)
  heap_malloc = common.heap_malloc_active()
  reps = args.reps or (3 if args.quick else 15)
  tree32 = make_tree(tree_name)
  n = sum(x.size for x in jax.tree.leaves(tree32))
  bw = bandwidth()
  chosen = all_candidates()
  if args.only:
    keep = {"optax.adamw fp32 (reference)", *args.only.split(",")}
    chosen = {k: v for k, v in chosen.items() if k in keep}

  runs = {}
  for name, (dtype, tx, in_place) in chosen.items():
    params = jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), tree32)
    grads = jax.tree.map(lambda x: (x * 0.1).astype(
        jnp.float32 if args.grads == "in-step" else dtype), tree32)
    state = tx.init(params)
    persistent = nbytes(params) + nbytes(state)

    def step(p, s, g, tx=tx, in_place=in_place):
      if args.grads == "in-step":  # g: fp32 coefficients c of the loss sum(p * c)
        g = jax.grad(linear_loss)(p, g)
      if in_place == "identity":
        return p, s
      if in_place:
        return oh.update_and_apply(tx, g, s, p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    flax_mode = in_place in FLAX_MODES
    start = time.perf_counter()
    with warnings.catch_warnings():
      # Gradients are donated so that their memory is free for the step's
      # outputs; where no output has their dtype and shape (the identity
      # step, every step whose params and state are donated as well) they
      # simply die, which is what a training step does with them too.
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      if flax_mode:
        a, b, g, fn, lowered, ready = flax_step(in_place, tx, params, grads,
                                                in_step=args.grads == "in-step")
        compiled = lowered.compile()
        for _ in range(2):  # warm-up; nnx.jit and jax.jit compile again on the first call
          a, b = fn(a, b, fresh(g))
        params, state, grads = a, b, g
      else:
        fn = compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
            params, state, grads).compile()
        ready = lambda p, _: jax.block_until_ready(p)
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    runs[name] = dict(fn=fn, params=params, state=state, grads=grads, times=[], ready=ready,
                      step=None if flax_mode else step,
                      setup_s=compile_s, bytes_per_param=(persistent + nbytes(grads)) / n,
                      # clipped: the norm reads the gradients once more
                      moved_per_param=0.0 if in_place == "identity" else (
                          2 * persistent + nbytes(grads) * (2 if "clip" in name else 1)) / n,
                      extra=dict(xla_bytes_accessed_per_param=float(cost.get("bytes accessed", 0))
                                 / n,
                                 xla_temp_bytes_per_param=(
                                     compiled.memory_analysis().temp_size_in_bytes / n)))
    r = runs[name]
    for _ in range(0 if flax_mode else 2):  # warm-up (the Flax steps': above)
      r["params"], r["state"] = fn(r["params"], r["state"], fresh(grads))
    jax.block_until_ready(r["params"])

  with common.garbage_collection(args.gc):
    for r in common.interleaved(runs, reps):
      g = fresh(r["grads"])  # untimed: a step's gradients are its own, dead after it
      common.settle(args.settle_ms)
      start = time.perf_counter()
      r["params"], r["state"] = r["fn"](r["params"], r["state"], g)
      r["ready"](r["params"], r["state"])
      r["times"].append(time.perf_counter() - start)

  if args.split:
    split_times(runs, args.split, reps, tree_name)

  memory = {}
  if args.memory == "on" and common.memory_supported():
    names = [k for k in (QUICK_MEMORY_ROWS if args.quick else MEMORY_ROWS) if k in chosen]
    memory = common.memory_rows("benchmarks.step", names, ["--tree", tree_name])
  out = common.report(f"JAX {jax.__version__} ({jax.default_backend()}), tree {tree_name}"
                      f"{', heap-only malloc' if heap_malloc else ''}"
                      f"{'' if args.gc == 'on' else f', gc {args.gc}'}",
                      runs, "optax.adamw fp32 (reference)", n, bw, args.json,
                      extra=dict(framework="jax", tree=tree_name, reps=reps, grads=args.grads,
                                 heap_malloc=heap_malloc, settle_ms=args.settle_ms,
                                 gc=args.gc, memory_bytes_per_param=memory),
                      # on a GPU the kernel is not taken: nothing to build for the report
                      kernel_library=native.ffi_library(jax.ffi.include_dir())
                      if jax.default_backend() == "cpu" else None)
  print("\nXLA cost_analysis bytes accessed per param: " + ", ".join(
      f"{k}: {v['xla_bytes_accessed_per_param']:.1f}" for k, v in out["runs"].items()))
  print("\nXLA temporaries (memory_analysis, allocated each step) bytes per param: " + ", ".join(
      f"{k}: {v['xla_temp_bytes_per_param']:.1f}" for k, v in out["runs"].items()))
  if args.split:
    print(f"\n{'what a step pays (' + jax.default_backend() + ')':56s} {'device ms':>9s} "
          f"{'vs ref':>7s} {'host ms':>8s}")
    for k, v in out["runs"].items():
      if "device_ms" in v:
        print(f"{k:56s} {v['device_ms']:9.3f} {v['device_ratio']:6.2f}x {v['host_ms']:8.3f}")
  if memory:
    common.print_memory(memory)
  return out


def split_times(runs: dict, k: int, reps: int, tree_name: str) -> None:
  """Each optax row's ``device_ms`` (``k`` steps inside one jit: a
  ``fori_loop`` over the donated params and state, the gradients read each
  step; the wall time of a call / k, so no per-call dispatch) and
  ``host_ms`` (the median time ``fn(...)`` takes to return, before its work
  is done), into the row's ``extra``."""
  for name, r in runs.items():
    if r["step"] is None:
      continue

    def many(p, s, g, step=r["step"]):
      return jax.lax.fori_loop(0, k, lambda _, c: step(c[0], c[1], g), (p, s))
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      loop = jax.jit(many, donate_argnums=(0, 1))
      r["params"], r["state"] = loop(r["params"], r["state"], r["grads"])  # compiles
    jax.block_until_ready(r["params"])
    device, host = [], []
    for _ in range(reps):
      start = time.perf_counter()
      r["params"], r["state"] = loop(r["params"], r["state"], r["grads"])
      jax.block_until_ready(r["params"])
      device.append((time.perf_counter() - start) / k)
      g = fresh(r["grads"])
      start = time.perf_counter()
      r["params"], r["state"] = r["fn"](r["params"], r["state"], g)
      host.append(time.perf_counter() - start)
      jax.block_until_ready(r["params"])
    r["extra"].update(name=name, tree=tree_name, device_ms=float(np.median(device)) * 1e3,
                      host_ms=float(np.median(host)) * 1e3, device_steps=k,
                      device_timing=f"{k} steps in one jit (fori_loop), wall / {k}")
  ref = runs.get("optax.adamw fp32 (reference)", {}).get("extra", {}).get("device_ms")
  for r in runs.values():
    if ref and "device_ms" in r["extra"]:
      r["extra"]["device_ratio"] = ref / r["extra"]["device_ms"]


if __name__ == "__main__":
  main()
