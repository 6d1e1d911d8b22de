"""master_weights: the master trajectory is fp32 Adam's, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import rounding
from conftest import bitwise_equal, jitted_step, random_tree, ulp_diff
from suite_helpers import default_or_slow

SHAPES = {"w16": (17, 5), "v16": (33,), "s16": ()}
LR = 1e-2


def _tree():
  # bf16 and fp16 leaves in one tree: one trajectory checks both dtypes.
  bf = random_tree(0, SHAPES, jnp.bfloat16)
  hf = random_tree(1, SHAPES, jnp.float16)
  return {"bf16": bf, "fp16": hf}


def _grads(t, params):
  key = jax.random.fold_in(jax.random.key(7), t)
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape).astype(p.dtype),
      params)


def _to32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _rounded(master, params, split):
  """The params a master's rounding gives: the high half for split's bf16 leaves (ties away
  from zero), else round to nearest even."""
  def one(m, p):
    if split and p.dtype == jnp.bfloat16:
      return rounding.split_f32(m)[0]
    return m.astype(p.dtype)
  return jax.tree.map(one, master, params)


def _master(state, params, split):
  if not split:
    return state.master
  return jax.tree.map(
      lambda p, m: rounding.join_f32(p, m) if p.dtype == jnp.bfloat16 else m,
      params, state.master)


@pytest.mark.parametrize("split, in_place, steps", default_or_slow(
    [(False, False, 200), (False, True, 200), (True, True, 200), (False, False, 50),
     (True, True, 50)], default=[(True, True, 50)]))
def test_master_trajectory_bitwise_op_by_op(split, in_place, steps):
  """Op by op on unit-normal weights, many crossing zero: the master is optax.adam on fp32
  params bit for bit at every step, never rounded (docs/algorithms.md#landing-exactly).
  In place (update_and_apply) the params are its rounding at every step. Through
  tx.update + apply_updates a param misses it only where p + u cannot reach it (a weight
  crossing zero far); the master is kept there, and the next step puts the param right.
  (split's bf16 high half is its param: it holds no other master, so it is stepped in
  place here; its update path is in tests/test_landing.py.)"""
  params = _tree()
  tx = oh.master_weights(optax.adam(LR), split=split)
  ref_tx = optax.adam(LR)
  ref = _to32(params)
  signs = jax.tree.map(jnp.sign, ref)
  missed_total = 0
  with jax.disable_jit():
    state, ref_state = tx.init(params), ref_tx.init(ref)
    missed_before = jax.tree.map(lambda p: np.zeros(p.shape, bool), params)
    for t in range(steps):
      g = _grads(t, params)
      u, ref_state = ref_tx.update(_to32(g), ref_state, ref)
      ref = optax.apply_updates(ref, u)
      if in_place:
        params, state = oh.update_and_apply(tx, g, state, params)
      else:
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
      master = _master(state, params, split)
      for m, r in zip(jax.tree.leaves(master), jax.tree.leaves(ref)):
        assert bitwise_equal(m, r), f"step {t}: {ulp_diff(m, r)} ULP"
      want = _rounded(ref, params, split)
      missed_now = jax.tree.map(lambda p, w: np.asarray(rounding.widen(p) != rounding.widen(w)),
                                params, want)
      for off, before in zip(jax.tree.leaves(missed_now), jax.tree.leaves(missed_before)):
        if in_place:
          assert not off.any(), f"step {t}"
        assert off.mean() < 0.05
      missed_total += sum(int(o.sum()) for o in jax.tree.leaves(missed_now))
      missed_before = missed_now
  crossed = sum(int((jnp.sign(r) != s).sum())
                for r, s in zip(jax.tree.leaves(ref), jax.tree.leaves(signs)))
  assert crossed > 10
  if not in_place and steps >= 50:
    assert missed_total > 0  # the update path missed somewhere, and the master held


def test_a_missed_param_is_put_right_and_outside_writes_are_taken_up():
  """One element lands off the master through tx.update (a weight crossing zero far): the
  next update takes the master there, not the param, and lands the param on its rounding.
  A param written from outside before a step is taken up, also in a leaf where the last
  update missed."""
  tx = oh.master_weights(optax.sgd(1.0))
  params = {"w": jnp.asarray([1e-3, 2.0, 3.0], jnp.bfloat16)}
  state = tx.init(params)
  p0 = np.float32(params["w"][0])
  g = {"w": jnp.asarray([p0 + np.float32(2e-5), 0.0, 0.0], jnp.float32)}
  u, state = tx.update(g, state, params)  # 1e-3 -> -2e-5: p + u cannot reach its rounding
  params = optax.apply_updates(params, u)
  master = np.asarray(state.master["w"])
  assert master[0] == p0 - np.float32(p0 + np.float32(2e-5))  # the fp32 step, not rounded
  assert float(params["w"][0]) != float(master[0].astype(jnp.bfloat16))  # it missed
  assert int(state.missed["w"]) != 0
  zero = {"w": jnp.zeros(3, jnp.float32)}
  u2, state2 = tx.update(zero, state, params)
  assert np.array_equal(np.asarray(state2.master["w"]), master)  # kept, not the param
  p2 = optax.apply_updates(params, u2)
  assert np.array_equal(np.asarray(p2["w"]), master.astype(jnp.bfloat16))  # put right
  assert int(state2.missed["w"]) == 0
  # From far (1 -> 2^-20: p + u lands on 2^-8, out of reach of 2^-20 too) the miss lands
  # on 0, and the next step is there.
  far = {"w": jnp.asarray([1.0, 2.0, 3.0], jnp.bfloat16)}
  s_far = tx.init(far)
  u_far, s_far = tx.update({"w": jnp.asarray([1.0 - 2.0**-20, 0.0, 0.0])}, s_far, far)
  far = optax.apply_updates(far, u_far)
  assert float(far["w"][0]) == 0.0 and float(s_far.master["w"][0]) == 2.0**-20
  far = optax.apply_updates(far, tx.update(zero, s_far, far)[0])
  assert float(far["w"][0]) == float(jnp.asarray(2.0**-20, jnp.bfloat16))
  # Written from outside: element 2 loaded with 7.0 after the missed step.
  loaded = {"w": params["w"].at[2].set(7.0)}
  u3, state3 = tx.update(zero, state, loaded)
  m3 = np.asarray(state3.master["w"])
  assert m3[2] == 7.0 and m3[1] == 2.0
  assert m3[0] == float(params["w"][0])  # the leaf was written: it follows the params


def test_fp32_leaves_carry_no_copy_and_follow_inner_exactly():
  params = {"a": jnp.ones((4,), jnp.float32), "b": jnp.ones((4,), jnp.bfloat16)}
  tx = oh.master_weights(optax.adam(LR))
  state = tx.init(params)
  assert isinstance(state.master["a"], optax.MaskedNode)
  assert state.master["b"].dtype == jnp.float32
  g = {"a": jnp.full((4,), 0.3), "b": jnp.full((4,), 0.3, jnp.bfloat16)}
  u, _ = tx.update(g, state, params)
  ref_u, _ = optax.adam(LR).update({"a": g["a"]}, optax.adam(LR).init({"a": params["a"]}),
                                    {"a": params["a"]})
  assert bitwise_equal(u["a"], ref_u["a"])


def test_split_memory_is_two_bytes_per_param():
  params = {"w": jnp.ones((128,), jnp.bfloat16), "h": jnp.ones((8,), jnp.float16)}
  state = oh.master_weights(optax.sgd(0.1), split=True).init(params)
  assert state.master["w"].dtype == jnp.int16  # low half only
  assert state.master["h"].dtype == jnp.float32  # fp16 falls back to a full copy


def test_split_requires_fp32_master():
  with pytest.raises(ValueError, match="master_dtype=float32"):
    oh.master_weights(optax.sgd(0.1), master_dtype=jnp.bfloat16, split=True)


def test_update_without_params_is_a_clear_error():
  tx = oh.master_weights(optax.sgd(0.1))
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match="needs the current params"):
    tx.update(params, tx.init(params))


def test_mismatched_trees_are_a_clear_error():
  tx = oh.master_weights(optax.sgd(0.1))
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match="does not match the params tree"):
    tx.update({"v": jnp.ones(3, jnp.bfloat16)}, tx.init(params), params)


def test_wrapping_a_non_transformation_is_a_clear_error():
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    oh.master_weights(lambda g: g)


def test_bf16_masters_of_fp8_params_may_be_kahan_compensated():
  """master_weights with a 16-bit master_dtype may wrap another low-precision
  wrapper (fp8 params, bf16 masters kept by kahan_summation): the inner one has
  16-bit params of its own to keep. JAX and torch agree bit for bit on the fp8
  params, the bf16 masters and the Kahan buffers over 20 steps, and the masters
  move where fp8 alone would not."""
  torch = pytest.importorskip("torch")
  import torch_bridge as tb  # noqa: PLC0415
  f8 = jnp.float8_e4m3fn
  rng = np.random.default_rng(0)
  w0 = rng.standard_normal((4, 5)).astype(np.float32)
  grads = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(20)]

  tx = oh.master_weights(oh.kahan_summation(oh.scale_by_adamw(1e-2)), master_dtype=jnp.bfloat16)
  params = {"w": jnp.asarray(w0).astype(f8)}
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    # optax.apply_updates will not add bf16 updates to fp8 params (no implicit
    # promotion for 8-bit floats): add in fp32 and round, as it would.
    return jax.tree.map(lambda a, b: (a.astype(jnp.float32) + b.astype(jnp.float32))
                        .astype(a.dtype), p, u), s

  for g in grads:
    params, state = step(params, state, {"w": jnp.asarray(g).astype(f8)})

  p = torch.nn.Parameter(torch.from_numpy(w0).to(torch.float8_e4m3fn))
  opt = tb.master_weights(tb.kahan_summation(tb.scale_by_adamw([p], 1e-2)),
                          master_dtype=torch.bfloat16)
  for g in grads:
    p.grad = torch.from_numpy(g).to(torch.float8_e4m3fn)
    opt.step()

  def raw(x):
    x = np.asarray(x)
    return x.view(np.uint8 if x.dtype.itemsize == 1 else np.uint16)

  master = opt.state[p]["master"]
  compensation = opt.inner.state[master]["compensation"]
  np.testing.assert_array_equal(raw(params["w"]), p.detach().view(torch.uint8).numpy())
  np.testing.assert_array_equal(raw(state.master["w"]),
                                master.view(torch.int16).numpy().view(np.uint16))
  np.testing.assert_array_equal(raw(state.inner_state.compensation["w"]),
                                compensation.view(torch.int16).numpy().view(np.uint16))
  assert np.any(np.asarray(state.inner_state.compensation["w"], np.float32) != 0)
  assert np.any(raw(params["w"]) != raw(jnp.asarray(w0).astype(f8)))


def test_nested_low_precision_is_refused_with_fp32_masters():
  with pytest.raises(ValueError, match="already keeps low-precision params"):
    oh.master_weights(oh.kahan_summation(optax.adam(1e-3))).init({"w": jnp.ones(3, jnp.bfloat16)})


# ---------------------------------------------------------------------------
# The master follows the param (docs/algorithms.md#wrappers): params written
# from outside after init are taken up, not reverted.
# ---------------------------------------------------------------------------

def _follow_run(make, in_place, loaded_at=3, steps=5):
  """bf16 params stepped ``steps`` times; before step ``loaded_at`` half of
  every leaf's elements are replaced from outside (as a checkpoint loaded into
  the model). Returns (params before the load, the loaded params, after)."""
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.standard_normal((33, 17)), jnp.bfloat16),
            "b": jnp.asarray(rng.standard_normal(17), jnp.bfloat16)}
  tx = make()
  state = tx.init(params)

  step = jitted_step(tx, in_place)

  before = loaded = None
  for t in range(steps):
    if t == loaded_at:
      before = params
      loaded = jax.tree.map(
          lambda x: jnp.where(jnp.arange(x.size).reshape(x.shape) % 2 == 0,
                              (x.astype(jnp.float32) * 3 + 1).astype(jnp.bfloat16), x), params)
      params = loaded
    grads = jax.tree.map(lambda x: jnp.asarray(
        rng.standard_normal(x.shape) * 0.1, jnp.bfloat16), params)
    params, state = step(params, state, grads)
  return before, loaded, params, state


FOLLOWING = {
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-3, weight_decay=0.1),
    "adam_fp32_master flat_state": lambda: oh.adam_fp32_master(1e-3, flat_state=True),
    "dynamic_loss_scale(adam_fp32_master)": lambda: oh.dynamic_loss_scale(
        oh.adam_fp32_master(1e-3), init_scale=1.0),
    "master_weights(sgd)": lambda: oh.master_weights(optax.sgd(1e-3, momentum=0.9)),
}


@pytest.mark.parametrize("name", list(FOLLOWING))
def test_params_loaded_after_init_are_followed_not_reverted(name, monkeypatch):
  from optax_half import _native  # noqa: PLC0415
  runs = {}
  for path, in_place in (("kernel", False), ("kernel in place", True), ("composed", False)):
    with monkeypatch.context() as m:
      if path == "composed":
        m.setattr(_native, "available", lambda: False)
      runs[path] = _follow_run(FOLLOWING[name], in_place)
  before, loaded, after, state = runs["composed"]
  for leaf_before, leaf_loaded, leaf_after in zip(*(jax.tree.leaves(t) for t in (
      before, loaded, after))):
    moved = np.asarray(leaf_loaded, np.float32) != np.asarray(leaf_before, np.float32)
    assert moved.any()
    # two steps of lr 1e-3 from the loaded values (Adam moves each element by
    # about lr a step; 3x + 1 is far from the old value), not from the stale master
    gap = np.abs(np.asarray(leaf_after, np.float32) - np.asarray(leaf_loaded, np.float32))
    assert gap[moved].max() < 0.05, gap[moved].max()
  # the kernel's master mode follows the same way, bit for bit
  for path in ("kernel", "kernel in place"):
    for a, b in zip(jax.tree.leaves(runs[path][2:]), jax.tree.leaves(runs["composed"][2:])):
      assert bitwise_equal(a, b), (name, path)


def test_without_outside_writes_following_changes_no_bit():
  """A run the optimizer alone writes: the master equals a run whose master is
  never compared (the master read as it is), bit for bit."""
  rng = np.random.default_rng(5)
  params = {"w": jnp.asarray(rng.standard_normal((64, 9)), jnp.bfloat16)}
  grads = [{"w": jnp.asarray(rng.standard_normal((64, 9)) * 0.1, jnp.bfloat16)}
           for _ in range(6)]
  ref = optax.adam(1e-3)  # the fp32 reference the master follows exactly
  tx = oh.master_weights(optax.adam(1e-3))
  p, s = params, tx.init(params)
  master, ref_state = _to32(params), ref.init(_to32(params))
  for g in grads:
    u, s = tx.update(g, s, p)
    p = optax.apply_updates(p, u)
    ru, ref_state = ref.update(_to32(g), ref_state, master)
    master = optax.apply_updates(master, ru)
  assert np.array_equal(np.asarray(s.master["w"]), np.asarray(master["w"]))


def test_an_in_place_step_after_a_miss_clears_every_mark(monkeypatch):
  """After a ``tx.update`` that missed (a mark in one leaf), a jitted in-place step writes
  each leaf's mark 0, keeps the master where it missed and lands on its rounding: XLA's
  step (its marks cleared as one vector, compensation.kept_leaves) with the kernel's bits."""
  from optax_half import _native as jax_native  # noqa: PLC0415
  tx = oh.adam_fp32_master(1.0 - 2.0**-20)  # Adam's first step, -lr * sign(g): 1 -> 2^-20
  params = {"v": jnp.asarray([0.5, 1.5, -4.0], jnp.bfloat16),
            "w": jnp.asarray([1.0, 2.0, 3.0], jnp.bfloat16)}
  state = tx.init(params)
  g = {"v": jnp.asarray([1.0, -1.0, 0.5], jnp.bfloat16), "w": jnp.ones(3, jnp.bfloat16)}
  u, state = jax.jit(tx.update)(g, state, params)  # w[0] misses far: it lands on 0
  params = optax.apply_updates(params, u)
  assert int(state.missed["w"]) != 0

  def in_place():
    p, s = jax.jit(lambda g, s, p: oh.update_and_apply(tx, g, s, p))(g, state, params)
    assert [int(m) for m in jax.tree.leaves(s.missed)] == [0, 0]
    for k in p:
      np.testing.assert_array_equal(np.asarray(p[k]), np.asarray(s.master[k].astype(p[k].dtype)))
    return jax.tree.leaves((p, s))

  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed = in_place()
  for a, b in zip(in_place(), composed):
    assert bitwise_equal(a, b)


def test_the_marks_are_checked_for_the_tree_at_once_and_only_where_a_leaf_holds_any():
  """``kept_leaves`` is ``kept`` of each leaf, eagerly and jitted: with a missed landing in
  one leaf and an outside write in another, and with no marks at all. Compiled, the check
  is one conditional for the tree whose other branch reads nothing, so a step after exact
  landings (every in-place step) reads each param and master once."""
  from benchmarks import gpu_static  # noqa: PLC0415 (the HLO reader of the static checks)
  from optax_half import compensation  # noqa: PLC0415
  tx = oh.master_weights(optax.sgd(1.0))
  params = {"v": jnp.asarray([0.5, 1.5, -4.0], jnp.bfloat16),
            "w": jnp.asarray([1e-3, 2.0, 3.0], jnp.bfloat16)}
  state = tx.init(params)
  p0 = np.float32(params["w"][0])
  g = {"v": jnp.zeros(3), "w": jnp.asarray([p0 + np.float32(2e-5), 0.0, 0.0])}
  u, state = tx.update(g, state, params)  # w[0] misses its landing
  params = optax.apply_updates(params, u)
  assert int(state.missed["w"]) != 0 and int(state.missed["v"]) == 0
  loaded = {"v": params["v"].at[1].set(7.0), "w": params["w"]}
  check = jax.jit(compensation.kept_leaves)
  for p, s in [(params, state), (loaded, state), (loaded, tx.init(params)),
               ({"v": params["v"], "w": params["w"].at[2].set(-1.0)}, state)]:
    leaves = [(p[k], s.master[k], s.missed[k]) for k in ("v", "w")]
    want = [bool(compensation.kept(*leaf)) for leaf in leaves]
    for keep, cleared in (compensation.kept_leaves(leaves), check(leaves)):
      assert [bool(x) for x in keep] == want
      # the marks after an in-place step: 0, marked or not
      assert [int(m) for m in cleared] == [0, 0] and all(m.dtype == jnp.uint32 for m in cleared)
  assert [bool(x) for x in check([(params[k], state.master[k], state.missed[k])
                                  for k in ("v", "w")])[0]] == [False, True]
  zero = jax.tree.map(jnp.zeros_like, g)
  _, state2 = jax.jit(tx.update)(zero, state, loaded)
  assert float(state2.master["v"][1]) == 7.0  # taken up
  assert np.array_equal(np.asarray(state2.master["w"]), np.asarray(state.master["w"]))  # kept
  hlo = jax.jit(lambda s, p: oh.update_and_apply(tx, zero, s, p)).lower(state, params).compile()
  conditionals = gpu_static.branches(hlo.as_text())
  assert len(conditionals) == 1, conditionals
  (name,) = conditionals
  # What the branch's kernels read besides constants (its zeros): nothing.
  reads = lambda instrs: [o for i in instrs if i[2] not in gpu_static._NO_KERNEL  # noqa: E731
                          for o in i[3] if not o.startswith("constant")]
  cost, kernels = gpu_static.cheaper_branch(hlo.as_text(), name, lambda i: len(reads(i)))
  assert cost == 0 and len(kernels) <= 1, kernels
