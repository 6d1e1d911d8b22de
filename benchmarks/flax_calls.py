"""What a Flax training step costs per call besides its arithmetic.

    python -m benchmarks.flax_calls [--reps N] [--trees standard,transformer]

The trees' tensors are shrunk to 4 elements each, so the step itself costs
next to nothing and the time of a call is what its wrapper costs: flattening
the arguments (in Python for every ``nnx.Variable``), dispatching, and
writing the results back into the model and optimizer. The gradients are
computed in the step (``jax.grad`` / ``nnx.grad`` of ``step.linear_loss``),
as in a training step. Every row waits for one output of its call (the
optimizer's step counter, or a param), so no row pays for flattening a
module outside the call. Prints the median milliseconds per call.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import optax_half as oh
from benchmarks import common
from benchmarks.step import _Tree, functional_loop, in_step_update, linear_loss

# How the Flax rows call the step: nnx.jit (graph mode, Flax's default), its
# tree mode, nnx.cached_partial, nnx.jit_partial (tree mode), and Flax's
# functional loop (nnx.split once, a jax.jit of merge + update + split).
WRAPPERS = ("nnx.jit", "nnx.jit(graph=False)", "nnx.cached_partial", "nnx.jit_partial",
            "functional")
OPTIMIZERS = {
    "nnx.Optimizer + optax.adamw fp32": (nnx.Optimizer, lambda: optax.adamw(1e-3), jnp.float32),
    "oh.nnx.Optimizer + adamw_bf16": (oh.nnx.Optimizer, lambda: oh.adamw_bf16(1e-3),
                                      jnp.bfloat16),
    "oh.nnx.Optimizer + adamw_bf16 flat_state": (
        oh.nnx.Optimizer, lambda: oh.adamw_bf16(1e-3, flat_state=True), jnp.bfloat16),
}


def ms_per_call(call, reps: int) -> float:
  """The median of ``reps`` timed calls, after 3 untimed ones."""
  for _ in range(3):
    call()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return common.median_ms(times)


def _flax_call(wrapper, model, optimizer, coefficients):
  """A zero-argument call of one step of ``wrapper`` that waits for it."""
  wait = lambda: optimizer.step[...].block_until_ready()
  if wrapper == "functional":
    state, pure = functional_loop(in_step_update, model, optimizer, donate_argnums=0)
    box = [state]

    def call():
      box[0] = pure(box[0], coefficients)
      jax.block_until_ready(box[0][1]["step"])
    return call
  if wrapper == "nnx.jit_partial":
    bound = nnx.jit_partial(in_step_update, model, optimizer, donate_argnums=0, graph=False)
    step = lambda: bound(coefficients)
  elif wrapper == "nnx.cached_partial":
    bound = nnx.cached_partial(nnx.jit(in_step_update, donate_argnums=(0, 1)), model, optimizer)
    step = lambda: bound(coefficients)
  else:
    jitted = nnx.jit(in_step_update, donate_argnums=(0, 1), graph=wrapper == "nnx.jit")
    step = lambda: jitted(model, optimizer, coefficients)
  return lambda: (step(), wait())


def rows(tree_name: str, reps: int) -> dict[str, float]:
  # make_tree's keys (p000, p001, ...), each tensor 4 elements
  keys = [f"p{i:03d}" for i in range(len(common.shapes(tree_name)))]
  coefficients = {k: jnp.full((4,), 0.1, jnp.float32) for k in keys}
  params = lambda dtype: {k: jnp.ones((4,), dtype) for k in keys}
  out = {}

  tx = oh.adamw_bf16(1e-3)
  in_place = jax.jit(lambda p, s, c: oh.update_and_apply(tx, jax.grad(linear_loss)(p, c), s, p),
                     donate_argnums=(0, 1))
  box = [params(jnp.bfloat16)]
  box.append(tx.init(box[0]))

  def update_and_apply():
    box[0], box[1] = in_place(box[0], box[1], coefficients)
    box[0][keys[0]].block_until_ready()
  out["oh.update_and_apply + adamw_bf16 in jax.jit"] = ms_per_call(update_and_apply, reps)

  state = [oh.train_state.TrainState.create(apply_fn=None, params=params(jnp.bfloat16), tx=tx)]
  apply = jax.jit(lambda st, c: st.apply_gradients(grads=jax.grad(linear_loss)(st.params, c)),
                  donate_argnums=0)

  def train_state():
    state[0] = apply(state[0], coefficients)
    state[0].step.block_until_ready()
  out["oh.TrainState + adamw_bf16 in jax.jit"] = ms_per_call(train_state, reps)

  for name, (cls, make_tx, dtype) in OPTIMIZERS.items():
    for wrapper in WRAPPERS:
      model = _Tree(params(dtype))
      optimizer = cls(model, make_tx(), wrt=nnx.Param)
      out[f"{name}, {wrapper}"] = ms_per_call(
          _flax_call(wrapper, model, optimizer, coefficients), reps)
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=200)
  parser.add_argument("--trees", default="standard,transformer")
  args = parser.parse_args(argv)
  trees = args.trees.split(",")
  results = {t: rows(t, args.reps) for t in trees}
  counts = [len(common.shapes(t)) for t in trees]
  names = list(results[trees[0]])
  width = max(map(len, names))
  print(f"{'ms per call (4-element tensors; gradients in the step)':{width}s} "
        + " ".join(f"{f'{c} tensors':>11s}" for c in counts))
  for name in names:
    print(f"{name:{width}s} " + " ".join(f"{results[t][name]:11.2f}" for t in trees))
  return results


if __name__ == "__main__":
  main()
