"""``flat_state=True``: the same optimizer with each param-shaped state tree
stored as one 1-D array per dtype (``optax_half._flat``).

Its params and (unpacked) state equal the tree layout's bit for bit: through
``tx.update`` + ``optax.apply_updates`` and ``update_and_apply``, with bf16 and
fp32 gradients, inside ``dynamic_loss_scale`` and with ``skip_nonfinite``, on
the one-call native path (CPU, every leaf bf16) and on the tree path it falls
back to (mixed trees; off CPU, tested here with the kernel unavailable).
``make test`` runs part of a parametrized test's cases (each says which and
why), ``make test-slow`` (marker ``slow``, as CI does) the others.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import _flat
from optax_half import _native as jax_native
from conftest import bitwise_equal, jitted_step
from suite_helpers import default_or_slow

# 3 * 2^16 + 5 elements: the one call splits the leaves' concatenation over
# threads at an odd boundary inside a leaf.
SHAPES = [(3 * 2**16 + 5,), (37, 29), (), (1000,), (3, 0), (64, 16)]
STEPS = 4

CONFIGS = {
    "kahan": lambda **k: oh.adamw_bf16(1e-2, **k),
    "split": lambda **k: oh.adamw_bf16(1e-2, compensation="split", **k),
    "stochastic": lambda **k: oh.adamw_bf16(1e-2, compensation="stochastic", key=3, **k),
    "none": lambda **k: oh.adamw_bf16(1e-2, compensation="none", **k),
    "fp32-moments": lambda **k: oh.adamw_bf16(1e-2, mu_dtype=jnp.float32, nu_dtype=jnp.float32,
                                              state_rounding="nearest", **k),
    "adam_fp32_master": lambda **k: oh.adam_fp32_master(1e-2, weight_decay=0.1, **k),
}


def _tree(seed, scale, dtypes=None):
  rng = np.random.default_rng(seed)
  dtypes = dtypes or [jnp.bfloat16] * len(SHAPES)
  return {f"p{i}": jnp.asarray(rng.standard_normal(s) * scale, d)
          for i, (s, d) in enumerate(zip(SHAPES, dtypes))}




def _pairwise(names):
  """Two (name, in_place, gradients) cases per name, alternating so that
  every pair of values (name and in_place, name and gradients, in_place and
  gradients) is in one: ``i`` picks the gradients of the in-place case."""
  return [c for i, n in enumerate(names)
          for c in ((n, True, i % 2), (n, False, 1 - i % 2))]


def _run(tx, params, grads, in_place, scale=1.0, state=None):
  step = jitted_step(tx, in_place)
  state = tx.init(params) if state is None else state
  for g in grads:
    params, state = step(params, state, jax.tree.map(lambda x: x * jnp.asarray(scale, x.dtype), g))
  return params, state


def _grads(dtype, dtypes=None, steps=STEPS):
  return [jax.tree.map(lambda x: x.astype(dtype) if x.dtype != jnp.int32 else x,
                       _tree(10 + t, 0.1, dtypes)) for t in range(steps)]


def _same(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
  for x, y in zip(la, lb):
    assert bitwise_equal(x, y)


def _unpacked(tx_tree, params, flat_state):
  return _flat.unpack(flat_state, _flat.template(tx_tree.init, params))


@functools.cache
def _tree_run(name, in_place, grad_dtype):
  """``CONFIGS[name]``'s tree-layout run from ``_tree(0, 1.0)`` with
  ``_grads(grad_dtype)``: the reference of every test here that runs it."""
  return _run(CONFIGS[name](), _tree(0, 1.0), _grads(grad_dtype), in_place)


def _flat_calls(tx, params) -> tuple:
  """(flat calls, per-leaf calls) in the jitted in-place step's HLO (the
  state only traced: an eager init compiles its ops for each new shape)."""
  state = jax.eval_shape(tx.init, params)
  text = jax.jit(lambda p, s, g: oh.update_and_apply(tx, g, s, p)).lower(
      params, state, params).as_text()
  flat = text.count(jax_native.FLAT_TARGET)
  return flat, text.count(jax_native.TARGET) - flat


_GRADS = (jnp.bfloat16, jnp.float32)
_CASES = [(n, i, g) for n in CONFIGS for i in (False, True) for g in _GRADS]


# Every buffer of the flat kernel (each compensation, fp32 moments, the fp32
# master) through tx.update and in place, bf16 and fp32 gradients: each pair
# of these in make test, every combination in make test-slow.
@pytest.mark.parametrize("name, in_place, grad_dtype", default_or_slow(
    _CASES, [(n, i, _GRADS[g]) for n, i, g in _pairwise(CONFIGS)]))
def test_flat_state_steps_equal_the_tree_layout(name, in_place, grad_dtype):
  params, grads = _tree(0, 1.0), _grads(grad_dtype)
  tree_p, tree_s = _tree_run(name, in_place, grad_dtype)
  flat_p, flat_s = _run(CONFIGS[name](flat_state=True), params, grads, in_place)
  _same(flat_p, tree_p)
  _same(_unpacked(CONFIGS[name](), params, flat_s), tree_s)
  # The flat layout: one 1-D array per param-shaped tree and dtype.
  n_tree, n_flat = len(jax.tree.leaves(tree_s)), len(jax.tree.leaves(flat_s))
  buffers = 2 + (name not in ("stochastic", "none"))
  assert n_tree - n_flat == buffers * (len(SHAPES) - 1)
  assert all(x.ndim == 1 for x in jax.tree.leaves(flat_s) if x.size > 1)


@pytest.mark.skipif(not jax_native.available() or jax.default_backend() != "cpu",
                    reason="the native kernel runs on CPU")
def test_one_native_call_steps_every_leaf_of_a_flat_state():
  params = _tree(0, 1.0)
  assert _flat_calls(oh.adamw_bf16(1e-3, flat_state=True), params) == (1, 0)
  assert _flat_calls(oh.adam_fp32_master(1e-3, flat_state=True, skip_nonfinite=True),
                     params) == (1, 0)
  assert _flat_calls(oh.dynamic_loss_scale(oh.adamw_bf16(1e-3, flat_state=True)), params) == (1, 0)
  # The tree layout: one call for every leaf (one dtype group).
  assert _flat_calls(oh.adamw_bf16(1e-3), params) == (0, 1)
  # A mixed tree: the tree layout's step (one call per dtype group, bf16 and
  # fp32) between unpack and pack.
  mixed = {**params, "h": jnp.ones(3, jnp.float32)}
  assert _flat_calls(oh.adamw_bf16(1e-3, flat_state=True), mixed) == (0, 2)


F16_CONFIGS = {
    "kahan": CONFIGS["kahan"],
    "stochastic": CONFIGS["stochastic"],
    "adam_fp32_master": CONFIGS["adam_fp32_master"],
    "split fp32-moments": lambda **k: oh.adamw_bf16(
        1e-2, compensation="split", mu_dtype=jnp.float32, nu_dtype=jnp.float32, key=4, **k),
}


_F16_GRADS = (jnp.float16, jnp.float32)
_F16_CASES = [(n, i, g) for n in F16_CONFIGS for i in (False, True) for g in _F16_GRADS]


@pytest.mark.skipif(not jax_native.available() or jax.default_backend() != "cpu",
                    reason="the native kernel runs on CPU")
@pytest.mark.parametrize("name, in_place, grad_dtype", default_or_slow(
    _F16_CASES, [(n, i, _F16_GRADS[g]) for n, i, g in _pairwise(F16_CONFIGS)]))
def test_fp16_params_step_a_flat_state_in_one_call(name, in_place, grad_dtype):
  """fp16 params (fp16 or fp32 moments, an fp16 Kahan buffer or an fp32
  master, where the kernel has fp16): one flat call, the tree layout's bits.
  (The calls are those of the in-place case: its gradients do not change them.)"""
  if not jax_native.has_f16():
    pytest.skip("JAX's kernel has fp16 params where the CPU has F16C")
  dtypes = [jnp.float16] * len(SHAPES)
  params, grads = _tree(0, 1.0, dtypes), _grads(grad_dtype, dtypes)
  make = F16_CONFIGS[name]
  tree_p, tree_s = _run(make(), params, grads, in_place)
  flat_p, flat_s = _run(make(flat_state=True), params, grads, in_place)
  _same(flat_p, tree_p)
  _same(_unpacked(make(), params, flat_s), tree_s)
  if in_place:
    assert _flat_calls(make(flat_state=True), params) == (1, 0)
    # fp16 beside bf16: two dtypes, the tree layout's calls between unpack and pack.
    mixed = {**params, "b": jnp.ones(3, jnp.bfloat16)}
    assert _flat_calls(make(flat_state=True), mixed) == (0, 2)


# The kernel's run of an all-bf16 tree is the one flat call, which
# test_flat_state_steps_equal_the_tree_layout runs from the same params and
# gradients (kahan and adam_fp32_master, in place, fp32 gradients): not again.
# The mixed tree without the kernel takes the same unpack / step / pack path
# as with it and as the all-bf16 tree without it: make test-slow.
@pytest.mark.parametrize("kernel, tree", default_or_slow(
    [("kernel", "mixed"), ("no kernel", "bf16"), ("no kernel", "mixed")],
    [("kernel", "mixed"), ("no kernel", "bf16")]))
def test_mixed_trees_and_the_path_without_the_kernel_equal_the_tree_layout(kernel, tree,
                                                                           monkeypatch):
  """fp32, fp16 and integer leaves beside bf16 ones (the flat arrays hold one
  dtype each, integer leaves none), and every leaf bf16 with the kernel
  unavailable: the unpack / tree step / pack path that runs off CPU."""
  if kernel == "no kernel":
    monkeypatch.setattr(jax_native, "available", lambda: False)
  d = [jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.bfloat16] if (
      tree == "mixed") else None
  params = _tree(0, 1.0, d)
  grads = _grads(jnp.float32, d, steps=3)
  for make in (CONFIGS["kahan"], CONFIGS["adam_fp32_master"]):
    tree_p, tree_s = _run(make(), params, grads, True)
    flat_p, flat_s = _run(make(flat_state=True), params, grads, True)
    _same(flat_p, tree_p)
    _same(_unpacked(make(), params, flat_s), tree_s)


_WRAPPED = {
    "dynamic_loss_scale": (lambda **k: oh.dynamic_loss_scale(oh.adamw_bf16(1e-2, **k),
                                                              init_scale=2.0**10), 2.0**10),
    "skip_nonfinite": (lambda **k: oh.adam_fp32_master(1e-2, skip_nonfinite=True, **k), 1.0),
}


# The flat call scales and skips as the tree one, in place or not (the test
# above has both): make test shows each wrapper once, make test-slow the rest.
@pytest.mark.parametrize("wrapper, in_place", default_or_slow(
    [(w, i) for w in _WRAPPED for i in (False, True)],
    [("dynamic_loss_scale", True), ("skip_nonfinite", False)]))
def test_dynamic_loss_scale_and_skip_nonfinite_with_a_flat_state(wrapper, in_place):
  params = _tree(0, 1.0)
  grads = _grads(jnp.bfloat16)
  grads[1] = {**grads[1], "p3": grads[1]["p3"].at[7].set(jnp.nan)}  # skipped
  make, scale = _WRAPPED[wrapper]
  tree_p, tree_s = _run(make(), params, grads, in_place, scale)
  flat_p, flat_s = _run(make(flat_state=True), params, grads, in_place, scale)
  _same(flat_p, tree_p)
  _same(_unpacked(make(), params, flat_s), tree_s)
  assert not all(bitwise_equal(a, b) for a, b in
                 zip(jax.tree.leaves(flat_p), jax.tree.leaves(params)))


def test_flat_state_needs_params_and_takes_empty_trees():
  tx = oh.adamw_bf16(1e-3, flat_state=True)
  params = _tree(0, 1.0)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))
  state = tx.init({})
  updates, new_state = tx.update({}, state, {})
  assert updates == {} and int(new_state.inner_state.count) == 1


def test_convert_refuses_a_flat_state_clearly():
  torch = pytest.importorskip("torch")
  import torch_bridge as tb  # noqa: PLC0415
  from torch_bridge import convert  # noqa: PLC0415
  params = {"a": jnp.ones((4,), jnp.bfloat16)}
  state = oh.adamw_bf16(1e-3, flat_state=True).init(params)
  opt = tb.adamw_bf16([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], 1e-3)
  with pytest.raises(ValueError, match="flat_state=True state is not converted"):
    convert.optax_state_to_torch(state, params, opt)
  with pytest.raises(ValueError, match="flat_state=True state is not converted"):
    convert.torch_state_to_optax(opt, params, state)


# relayout_state moves every param-shaped tree of a state alike: a Kahan
# state's shows it in make test (adam_fp32_master's master also in the
# multi_transform test below), the others in make test-slow.
@pytest.mark.parametrize("name", default_or_slow(
    [("kahan",), ("stochastic",), ("adam_fp32_master",)], [("kahan",)]))
def test_relayout_state_continues_the_same_run_in_the_other_layout(name):
  params, grads = _tree(0, 1.0), _grads(jnp.bfloat16)
  tree_tx, flat_tx = CONFIGS[name](), CONFIGS[name](flat_state=True)
  half = STEPS // 2
  # The same steps in one layout: in place, then through tx.update (a master's differ).
  want_p, want_s = _run(tree_tx, params, grads[:half], in_place=True)
  want_p, want_s = _run(tree_tx, want_p, grads[half:], in_place=False, state=want_s)
  for first, second in ((tree_tx, flat_tx), (flat_tx, tree_tx)):
    p, s = _run(first, params, grads[:half], in_place=True)
    s = oh.relayout_state(s, second, p)
    assert jax.tree.structure(s) == jax.tree.structure(second.init(params))
    p, s = _run(second, p, grads[half:], in_place=False, state=s)
    _same(p, want_p)
    _same(oh.relayout_state(s, tree_tx, p), want_s)
    _same(oh.relayout_state(s, second, p), s)  # already in that layout: unchanged


@pytest.mark.parametrize("wrap", ["dynamic_loss_scale", "optax.chain", "oh.chain",
                                  "inject_hyperparams"])
def test_relayout_state_reaches_into_wrapped_states(wrap):
  def make(**k):
    if wrap == "dynamic_loss_scale":
      return oh.dynamic_loss_scale(oh.adamw_bf16(1e-2, **k))
    if wrap == "optax.chain":
      return optax.chain(optax.scale(1.0), oh.adamw_bf16(1e-2, **k))
    if wrap == "oh.chain":
      return oh.chain(optax.scale(1.0), oh.adamw_bf16(1e-2, **k))
    return optax.inject_hyperparams(oh.adamw_bf16, hyperparam_dtype=jnp.float32)(
        learning_rate=1e-2, **k)

  params, grads = _tree(0, 1.0), _grads(jnp.bfloat16, steps=2)
  _, tree_s = _run(make(), params, grads, in_place=False)
  flat_s = oh.relayout_state(tree_s, make(flat_state=True), params)
  assert any(isinstance(x, _flat.Flat) for x in jax.tree.leaves(
      flat_s, is_leaf=lambda x: isinstance(x, _flat.Flat)))
  assert jax.tree.structure(flat_s) == jax.tree.structure(make(flat_state=True).init(params))
  _same(oh.relayout_state(flat_s, make(), params), tree_s)


def test_relayout_state_refuses_another_optimizer_or_params_tree():
  params = {"a": jnp.ones((4,), jnp.bfloat16), "b": jnp.ones((6,), jnp.bfloat16)}
  flat_tx = oh.adamw_bf16(1e-3, flat_state=True)
  with pytest.raises(ValueError, match="a MasterWeightsState where the target optimizer has a "
                                       "KahanSummationState"):
    oh.relayout_state(oh.adam_fp32_master(1e-3).init(params), flat_tx, params)
  with pytest.raises(ValueError, match="flat array of another params tree"):
    oh.relayout_state(flat_tx.init(params), oh.adamw_bf16(1e-3),
                      {"a": params["a"], "b": jnp.ones((7,), jnp.bfloat16)})
  with pytest.raises(ValueError, match="does not fit tx.init"):  # tree to tree: fp32 moments
    oh.relayout_state(oh.adamw_bf16(1e-3, mu_dtype=jnp.float32).init(params),
                      oh.adamw_bf16(1e-3), params)
  with pytest.raises(ValueError, match="2 elements"):
    oh.relayout_state((flat_tx.init(params),), optax.chain(optax.identity(), flat_tx), params)
  # Packing: the field is named (fp32 moments where the target's are bf16; another tree).
  with pytest.raises(ValueError, match=r"state\.inner_state\.mu holds \['float32_"):
    oh.relayout_state(oh.adamw_bf16(1e-3, mu_dtype=jnp.float32).init(params), flat_tx, params)
  other = {"a": params["a"], "b": jnp.ones((7,), jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"state\.compensation holds .* another params tree"):
    oh.relayout_state(oh.adamw_bf16(1e-3).init(other), flat_tx, params)
  labels = {"a": "x", "b": "x"}
  with pytest.raises(ValueError, match="target's keys"):
    oh.relayout_state(optax.multi_transform({"y": flat_tx}, {"a": "y", "b": "y"}).init(params),
                      optax.multi_transform({"x": flat_tx}, labels), params)


def test_relayout_state_reaches_into_multi_transform():
  """optax.multi_transform keeps its inner states in a dict: each moves
  layout, and the run continues bit for bit."""
  params, grads = _tree(0, 1.0), _grads(jnp.bfloat16)
  labels = {k: ("first" if i % 2 else "second") for i, k in enumerate(params)}

  def make(**k):
    return optax.multi_transform({"first": oh.adamw_bf16(1e-2, **k),
                                  "second": oh.adam_fp32_master(1e-2, **k)}, labels)
  want_p, want_s = _run(make(), params, grads, in_place=False)
  p, s = _run(make(), params, grads[:2], in_place=False)
  s = oh.relayout_state(s, make(flat_state=True), p)
  assert jax.tree.structure(s) == jax.tree.structure(make(flat_state=True).init(params))
  p, s = _run(make(flat_state=True), p, grads[2:], in_place=False, state=s)
  _same(p, want_p)
  _same(oh.relayout_state(s, make(), p), want_s)


def test_a_state_of_another_layout_or_params_tree_is_refused_clearly():
  from optax_half import checkpoint  # noqa: PLC0415
  tx = oh.adamw_bf16(1e-3, flat_state=True)
  params = {"a": jnp.ones((4,), jnp.bfloat16), "b": jnp.ones((6,), jnp.bfloat16)}
  swapped = {"a": jnp.ones((6,), jnp.bfloat16), "b": jnp.ones((4,), jnp.bfloat16)}
  # The same sizes per dtype, other leaves: other array names.
  other = tx.init(swapped)
  assert [x.shape for x in jax.tree.leaves(other)] == [
      x.shape for x in jax.tree.leaves(tx.init(params))]
  with pytest.raises(ValueError, match="not in the flat layout of these params"):
    tx.update(params, other, params)
  with pytest.raises(ValueError, match="checkpoint has no"):
    checkpoint.check(other, tx.init(params))
  checkpoint.check(tx.init(params), tx.init(params))  # the same layout passes
  # A state built with flat_state=False (resuming an old run with the new flag).
  with pytest.raises(ValueError, match="flat_state=False"):
    jax.jit(lambda s: oh.update_and_apply(tx, params, s, params))(
        oh.adamw_bf16(1e-3).init(params))
  with pytest.raises(TypeError, match="flat_state must be True or False"):
    oh.adamw_bf16(1e-3, flat_state="no")
  with pytest.raises(TypeError, match="flat_state must be True or False"):
    oh.adam_fp32_master(1e-3, flat_state=1)
