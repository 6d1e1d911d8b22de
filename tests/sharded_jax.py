"""Sharded runs of every optax_half transformation, for tests/test_sharding.py.

Run as a script in its own process: XLA_FLAGS must give the CPU 8 devices
before JAX starts (``--xla_force_host_platform_device_count=8``). For each
configuration in ``CONFIGS`` it runs the same steps on the same params and
gradients on one device (once: the reference of every run of the
configuration) and, for each axis type, sharded FSDP-style over a mesh of 8
(a 4 x 2 mesh for the 2-d configurations), and prints one JSON object per
sharded run (what the test asserts):

* ``init``, ``init_jit``, ``after``: the state leaves (by tree path) whose
  sharding differs from their param's, after an eager ``init``, a jitted
  ``init`` and the jitted steps; ``checked``: how many per-element state
  leaves were compared (so an empty list means something);
* ``params``, ``state``: ``equal`` (every leaf bitwise equal to the
  one-device run), ``max_ulp`` / ``max_rel`` (the worst distance of the
  16-bit / 32-bit leaves);
* ``hlo``: the number of all-gathers and of native custom calls in the
  compiled sharded step;
* ``counters``: skip counters and loss-scale state of both runs;

and, for ``CHECKPOINTED``, a row on resuming a sharded run from an
``optax_half.checkpoint`` and moving a checkpoint between one device and the
mesh.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import optax_half as oh
from conftest import bitwise_equal, ulp_diff

STEPS = 6
NONFINITE_STEP = 3  # a +inf in one shard of one leaf, for the configurations that skip

# name -> (factory, kind); kind "bitwise" (elementwise: equal bits) or "norm"
# (a global norm over shards: the reduction order differs, bounded error).
CONFIGS = {
    "adamw_bf16/kahan": (lambda: oh.adamw_bf16(1e-3), "bitwise"),
    "adamw_bf16/split": (lambda: oh.adamw_bf16(1e-3, compensation="split"), "bitwise"),
    "adamw_bf16/stochastic": (lambda: oh.adamw_bf16(1e-3, compensation="stochastic"),
                              "bitwise"),
    "adamw_bf16/none": (lambda: oh.adamw_bf16(1e-3, compensation="none"), "bitwise"),
    "adamw_bf16/fp32-moments": (lambda: oh.adamw_bf16(1e-3, mu_dtype=jnp.float32,
                                                      nu_dtype=jnp.float32), "bitwise"),
    "adam_fp32_master": (lambda: oh.adam_fp32_master(1e-3, weight_decay=0.1), "bitwise"),
    "adam_fp32_master+skip_nonfinite": (
        lambda: oh.adam_fp32_master(1e-3, skip_nonfinite=True), "bitwise"),
    "scale_by_adamw": (lambda: oh.scale_by_adamw(1e-3, weight_decay=0.1), "bitwise"),
    "master_weights(optax.adam)": (lambda: oh.master_weights(optax.adam(1e-3)), "bitwise"),
    "master_weights(split)": (lambda: oh.master_weights(optax.adamw(1e-3), split=True),
                              "bitwise"),
    "kahan_summation(optax.adamw)": (lambda: oh.kahan_summation(optax.adamw(1e-3)), "bitwise"),
    "stochastic_rounding(optax.sgd)": (
        lambda: oh.stochastic_rounding(optax.sgd(1e-2, momentum=0.9), key=7), "bitwise"),
    "dynamic_loss_scale(adamw_bf16)": (
        lambda: oh.dynamic_loss_scale(oh.adamw_bf16(1e-3), init_scale=2.0 ** 4), "bitwise"),
    "clip_by_global_norm+adamw_bf16": (
        lambda: optax.chain(optax.clip_by_global_norm(0.05), oh.adamw_bf16(1e-3)), "norm"),
    "oh.clip_by_global_norm+adamw_bf16": (
        lambda: optax.chain(oh.clip_by_global_norm(0.05), oh.adamw_bf16(1e-3)), "norm"),
    "scaled_adam": (lambda: oh.scaled_adam(1e-2, clipping_scale=1.0, size_update_period=2,
                                           clipping_update_period=2), "norm"),
    "kahan_summation(scaled_adam)": (
        lambda: oh.kahan_summation(oh.scaled_adam(1e-2, clipping_scale=1.0,
                                                  size_update_period=2,
                                                  clipping_update_period=2)), "norm"),
}
SKIPPING = ("adam_fp32_master+skip_nonfinite", "dynamic_loss_scale(adamw_bf16)")
# Run on a 4 x 2 mesh as well (matrices split over both axes).
MESH_2D = ("adamw_bf16/kahan", "adamw_bf16/stochastic", "scaled_adam")
# FSDP-style: matrices and vectors split over the data axis (dim 0, or dim 1
# where dim 0 does not divide); scalars and odd sizes replicated.
SHAPES = {"w": ((64, 32), jnp.bfloat16), "u": ((6, 32), jnp.bfloat16),
          "b": ((32,), jnp.bfloat16), "f": ((16, 8), jnp.float32),
          "odd": ((5,), jnp.bfloat16), "s": ((), jnp.bfloat16)}


def spec(shape, two_d: bool):
  if two_d and len(shape) == 2 and shape[0] % 4 == 0 and shape[1] % 2 == 0:
    return P("data", "model")
  if len(shape) >= 1 and shape[0] % 8 == 0:
    return P("data")
  if len(shape) == 2 and shape[1] % 8 == 0:
    return P(None, "data")
  return P()


def compare(one, sharded) -> dict:
  """Bitwise equality and worst distance of every leaf, params and state apart.

  16-bit leaves: distance in ULPs; 32-bit floats: relative error. The Kahan
  compensations are residuals (a param rounding the other way flips their
  sign): they count for equality, not for the distances (as in
  ``torch_bridge.parity``).
  """
  out = {}
  for part, a_tree, b_tree in (("params", one[0], sharded[0]), ("state", one[1], sharded[1])):
    equal, max_ulp, max_rel = True, 0, 0.0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(a_tree)[0],
                            jax.tree.leaves(b_tree)):
      a, b = np.asarray(a), np.asarray(b)
      assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
      if bitwise_equal(a, b):
        continue
      equal = False
      if "compensation" in jax.tree_util.keystr(path):
        continue
      if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
        max_ulp = max(max_ulp, ulp_diff(a, b))
      else:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        rel = np.abs(a64 - b64) / np.maximum(np.maximum(np.abs(a64), np.abs(b64)), 1e-30)
        max_rel = max(max_rel, float(rel.max()))
    out[part] = {"equal": equal, "max_ulp": max_ulp, "max_rel": max_rel}
  return out


def misplaced(state, shardings) -> tuple[list, int]:
  """State leaves of a param's shape, under that param's key, sharded otherwise."""
  bad, checked = [], 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = jax.tree_util.keystr(path)
    for key, (shape, _) in SHAPES.items():
      if name.endswith(f"['{key}']") and tuple(leaf.shape) == shape and len(shape):
        checked += 1
        if not leaf.sharding.is_equivalent_to(shardings[key], len(shape)):
          bad.append(f"{name}: {leaf.sharding.spec}, param {shardings[key].spec}")
  return bad, checked


def counters(state) -> dict:
  out = {}
  for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, (optax.ApplyIfFiniteState, oh.DynamicLossScaleState))):
    if isinstance(s, optax.ApplyIfFiniteState):
      out["total_notfinite"] = int(s.total_notfinite)
    if isinstance(s, oh.DynamicLossScaleState):
      out["skipped_steps"] = int(s.skipped_steps)
      out["scale"] = float(s.scale)
  return out


def _inputs(name: str):
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.standard_normal(s), d) for k, (s, d) in SHAPES.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s) * 0.1, d) for k, (s, d) in SHAPES.items()}
           for _ in range(STEPS)]
  if name in SKIPPING:  # in the last shard of "w": only one device sees it
    # (a NaN: a max all-reduce across the shards would drop it, the check must not be one)
    grads[NONFINITE_STEP]["w"] = grads[NONFINITE_STEP]["w"].at[-1, 3].set(jnp.nan)
  return params, grads


_ONE_DEVICE: dict = {}


def one_device(name: str):
  """The reference: the steps of ``name`` on one device (run once per
  configuration; every axis type and mesh compares against it)."""
  if name not in _ONE_DEVICE:
    params, grads = _inputs(name)
    tx = CONFIGS[name][0]()

    @jax.jit
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    p1, s1 = params, tx.init(params)
    for g in grads:
      p1, s1 = step(p1, s1, g)
    _ONE_DEVICE[name] = (p1, s1)
  return _ONE_DEVICE[name]


def run_config(name: str, axis_type, two_d: bool) -> dict:
  make, kind = CONFIGS[name]
  params, grads = _inputs(name)
  tx = make()

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p1, s1 = one_device(name)

  # Sharded.
  axes = ("data", "model") if two_d else ("data",)
  mesh = jax.make_mesh((4, 2) if two_d else (8,), axes, axis_types=(axis_type,) * len(axes))
  shardings = {k: NamedSharding(mesh, spec(s, two_d)) for k, (s, _) in SHAPES.items()}
  put = lambda tree: {k: jax.device_put(v, shardings[k]) for k, v in tree.items()}
  sharded = jax.jit(step)
  with jax.set_mesh(mesh):
    p2 = put(params)
    s2 = tx.init(p2)
    s_jit = jax.jit(tx.init)(p2)
    hlo = sharded.lower(p2, s2, put(grads[0])).compile().as_text()
    for g in grads:
      p2, s2 = sharded(p2, s2, put(g))
  init_bad, checked = misplaced(tx.init(put(params)), shardings)
  init_jit_bad, _ = misplaced(s_jit, shardings)
  after_bad, checked_after = misplaced(s2, shardings)
  param_bad, _ = misplaced({"params": p2}, shardings)
  return {
      "config": name, "axis_type": str(axis_type), "mesh": "4x2" if two_d else "8", "kind": kind,
      "init": init_bad, "init_jit": init_jit_bad,
      "after": after_bad + param_bad, "checked": min(checked, checked_after),
      **compare((p1, s1), (p2, s2)),  # "params" and "state"
      "hlo": {"all_gather": hlo.count("all-gather-start") + hlo.count(" all-gather("),
              "native": hlo.count("optax_half_adamw")},
      "counters": {"one_device": counters(s1), "sharded": counters(s2)},
  }


CHECKPOINTED = ("adamw_bf16/kahan", "adamw_bf16/stochastic", "scaled_adam",
                "dynamic_loss_scale(adamw_bf16)")


def run_checkpoint(name: str, directory: str) -> dict:
  """N sharded steps == N/2 + ``optax_half.checkpoint`` save/restore + N/2,
  and a checkpoint moves between one device and the mesh (Orbax reshards)."""
  from optax_half import checkpoint  # noqa: PLC0415
  make, _ = CONFIGS[name]
  rng = np.random.default_rng(2)
  params = {k: jnp.asarray(rng.standard_normal(s), d) for k, (s, d) in SHAPES.items()}
  grads = [{k: jnp.asarray(rng.standard_normal(s) * 0.1, d) for k, (s, d) in SHAPES.items()}
           for _ in range(STEPS)]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  shardings = {k: NamedSharding(mesh, spec(s, False)) for k, (s, _) in SHAPES.items()}
  put = lambda tree: {k: jax.device_put(v, shardings[k]) for k, v in tree.items()}
  tx = make()

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  with jax.set_mesh(mesh):
    p_full, s_full = put(params), tx.init(put(params))
    for g in grads:
      p_full, s_full = step(p_full, s_full, put(g))
    p, s = put(params), tx.init(put(params))
    for g in grads[:STEPS // 2]:
      p, s = step(p, s, put(g))
    checkpoint.save(os.path.join(directory, "sharded"), s)
    like = make().init(put(params))
    restored = checkpoint.restore(os.path.join(directory, "sharded"), like)
    same_layout = all(a.sharding == b.sharding for a, b in
                      zip(jax.tree.leaves(restored), jax.tree.leaves(like)))
    p_end, s_end = p, restored
    for g in grads[STEPS // 2:]:
      p_end, s_end = step(p_end, s_end, put(g))
  # The sharded checkpoint on one device (outside the mesh), and back onto the mesh.
  single = checkpoint.restore(os.path.join(directory, "sharded"), make().init(params))
  checkpoint.save(os.path.join(directory, "single"), single)
  with jax.set_mesh(mesh):
    back = checkpoint.restore(os.path.join(directory, "single"), like)
  leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]
  return {
      "checkpoint": name,
      "resume": compare((p_full, s_full), (p_end, s_end)),
      "same_layout": same_layout,
      "one_device": all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(single)),
      "round_trip": all(bitwise_equal(a, b) for a, b in zip(leaves(s), leaves(back)))
                    and all(a.sharding == b.sharding for a, b in
                            zip(jax.tree.leaves(back), jax.tree.leaves(like))),
  }


def main(argv) -> None:
  assert jax.device_count() >= 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
  names = argv or list(CONFIGS)
  for name in names:
    runs = [(AxisType.Explicit, False), (AxisType.Auto, False)]
    if name in MESH_2D:
      runs.append((AxisType.Explicit, True))
    for axis_type, two_d in runs:
      print(json.dumps(run_config(name, axis_type, two_d)), flush=True)
  with tempfile.TemporaryDirectory() as directory:
    for name in CHECKPOINTED:
      if name in names:
        print(json.dumps(run_checkpoint(name, os.path.join(directory, name.replace("/", "_")))),
              flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
