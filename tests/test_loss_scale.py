"""optax_half.dynamic_loss_scale: unscale in fp32, skip non-finite steps bitwise,
GradScaler's scale arithmetic, compositions (clipping, MultiSteps, nnx), helpers.

The scale trajectory against ``torch.amp.GradScaler`` is in
``test_torch_loss_scale.py`` (it needs torch)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from conftest import bitwise_equal
from suite_helpers import default_or_slow
from optax_half import _util
from test_trees import OPTIMIZERS, mixed_grads, mixed_params

# The module (optax_half.loss_scale is also the name of a function).
loss_scale_module = importlib.import_module("optax_half.loss_scale")


def _leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return all(bitwise_equal(x, y) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
             else np.array_equal(x, y) for x, y in zip(la, lb))


def _scaled(grads, scale):
  return jax.tree.map(
      lambda g: (g.astype(jnp.float32) * scale).astype(g.dtype)
      if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)


def _poison(grads, path_index, value, rng):
  """``grads`` with one element of the float leaf number ``path_index`` set to value."""
  leaves, treedef = jax.tree.flatten(grads)
  float_ids = [i for i, g in enumerate(leaves)
               if jnp.issubdtype(g.dtype, jnp.floating) and g.size > 0]
  i = float_ids[path_index % len(float_ids)]
  flat = np.array(leaves[i]).reshape(-1)
  flat[rng.integers(flat.size)] = value
  leaves[i] = jnp.asarray(flat.reshape(leaves[i].shape))
  return jax.tree.unflatten(treedef, leaves), len(float_ids)


TRANSFORMS = dict(OPTIMIZERS)
# Plain optax transformations cannot take the float0 gradients of integer
# leaves; they get the mixed tree without its integer leaves.
PLAIN_OPTAX = {
    "optax.adam": lambda: optax.adam(1e-2),
    "chain(clip, adam_fp32_master)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), oh.adam_fp32_master(1e-2)),
}
TRANSFORMS.update(PLAIN_OPTAX)


@pytest.mark.parametrize("name", default_or_slow(sorted(TRANSFORMS), [
    n for n in sorted(TRANSFORMS) if n not in ("adam_fp32_master", "adamw_bf16_none",
                                               "adamw_bf16_split")]))
def test_a_nonfinite_element_anywhere_changes_nothing(name):
  """NaN, +Inf or -Inf in one element of any one leaf: every param and every
  inner state leaf (moments, masters, Kahan buffers, counters) is bitwise
  unchanged after apply_updates, -0.0 included; the skip is counted."""
  tx = oh.dynamic_loss_scale(TRANSFORMS[name](), init_scale=2.0**10)
  update = jax.jit(tx.update)
  params = mixed_params()
  if name in PLAIN_OPTAX:
    del params["step"], params["ids"]
  state = tx.init(params)
  for t in range(3):  # non-trivial state first
    updates, state = update(_scaled(mixed_grads(params, t), 2.0**10), state, params)
    params = optax.apply_updates(params, updates)
  params["bf16"] = params["bf16"].at[0, 0].set(-0.0)  # x + 0.0 would turn it into +0.0
  params["fp16"] = params["fp16"].at[1].set(-0.0)
  rng = np.random.default_rng(0)
  n_float = _poison(mixed_grads(params, 0), 0, 0.0, rng)[1]
  k = 0
  for leaf in range(n_float):
    for value in (np.nan, np.inf, -np.inf):
      bad, _ = _poison(_scaled(mixed_grads(params, 10 + k), state.scale), leaf, value, rng)
      updates, new_state = update(bad, state, params)
      new_params = optax.apply_updates(params, updates)
      assert _leaves_equal(new_params, params), (name, leaf, value)
      assert _leaves_equal(new_state.inner_state, state.inner_state), (name, leaf, value)
      assert int(new_state.skipped_steps) == int(state.skipped_steps) + 1
      assert not bool(new_state.last_finite)
      assert float(new_state.scale) == max(float(state.scale) / 2, 1.0)
      assert int(new_state.growth_tracker) == 0
      state = new_state
      k += 1
  assert k >= 15 and float(state.scale) == 1.0  # floored at min_scale
  # and the next finite step is taken from exactly where it stopped
  updates, state = update(_scaled(mixed_grads(params, 99), state.scale), state, params)
  assert bool(state.last_finite)
  assert not _leaves_equal(optax.apply_updates(params, updates), params)


@pytest.mark.parametrize("tree, name", default_or_slow(
    [(t, n) for n in ("adamw_bf16_kahan", "adamw_bf16_stochastic", "adam_fp32_master")
     for t in ("mixed", "kernel")],
    default=[("kernel", "adamw_bf16_kahan"), ("mixed", "adam_fp32_master")]))
def test_the_select_used_off_cpu_equals_the_branch_used_on_cpu(name, tree, monkeypatch):
  """Off CPU the skip is a select of both results (no branch picked by the
  device's runtime), on CPU a lax.cond (the native kernel, which takes the
  bf16/fp32 tree, updates the state in place inside it; the mixed tree, with
  fp16 and integer leaves, runs the composed transformation): the same bits,
  a skipped step included. (Plain optax inner transformations may differ in
  the last bit: XLA contracts their a*b+c into FMAs differently inside and
  outside a branch; ours never contract.)"""
  selects = []

  def run():
    tx = oh.dynamic_loss_scale(TRANSFORMS[name](), init_scale=2.0**10)
    if tree == "mixed":
      params = mixed_params()
    else:
      rng = np.random.default_rng(1)
      params = {"a": jnp.asarray(rng.standard_normal((7, 3)), jnp.bfloat16),
                "b": jnp.asarray(rng.standard_normal(5), jnp.float32)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    kernel = "optax_half_adamw" in update.lower(params, state, params).as_text()
    assert kernel == (tree == "kernel")
    rng = np.random.default_rng(0)
    for t in range(4):
      grads = _scaled(mixed_grads(params, t), state.scale) if tree == "mixed" else {
          k: (jnp.asarray(rng.standard_normal(v.shape)) * 0.1 * state.scale).astype(v.dtype)
          for k, v in params.items()}
      if t == 2:
        grads, _ = _poison(grads, 0, np.nan, rng)
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
    assert int(state.skipped_steps) == 1
    return params, state

  branch = run()
  with monkeypatch.context() as m:
    def select_only(finite, apply, skip, elsewhere="cond", branch_on_cpu=True):
      assert elsewhere == "select"
      selects.append(1)
      return _util.select(finite, apply, skip)
    m.setattr(loss_scale_module, "if_finite", select_only)
    selected = run()
  assert selects  # the select ran
  assert _leaves_equal(branch, selected)


def test_fp16_grads_unscale_in_fp32_for_optax_half_and_in_their_dtype_for_plain_optax():
  """optax_half's transformations get fp16 gradients unscaled exactly in fp32, also below
  fp16's smallest subnormal (2^-24); a plain optax one gets them in fp16, as
  GradScaler.unscale_ leaves them, so its updates keep the param dtype."""
  g_hat = jnp.asarray([2.0**-10, 3 * 2.0**-12, -1.5, 65504.0], jnp.float16)
  expected = np.asarray(g_hat, np.float64) / 2.0**16
  assert np.all(np.asarray(expected, np.float16)[:2] == 0)  # fp16 unscaling flushes these
  params = {"w": jnp.zeros(4, jnp.float16)}
  plain = oh.dynamic_loss_scale(optax.identity(), init_scale=2.0**16)
  updates, _ = jax.jit(plain.update)({"w": g_hat}, plain.init(params), params)
  assert updates["w"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(expected, np.float16))
  ours = oh.dynamic_loss_scale(oh.master_weights(optax.sgd(1.0)), init_scale=2.0**16)
  _, state = jax.jit(ours.update)({"w": g_hat}, ours.init(params), params)
  master = np.asarray(state.inner_state.master["w"], np.float64)
  assert np.array_equal(master, -expected)  # exact in fp32


def test_state_is_fp32_int32_under_jit_for_fp16_params():
  """jmp's two bugs cannot happen: the scale stays fp32 (2^16 and 2^17 are not
  fp16 numbers) and min_scale survives jit (it is part of the transformation)."""
  params = {"w": jnp.ones(3, jnp.float16)}
  tx = oh.dynamic_loss_scale(oh.master_weights(optax.sgd(1e-3)), init_scale=2.0**16,
                             growth_interval=2, min_scale=2.0**14)
  update = jax.jit(tx.update)
  state = tx.init(params)
  good = {"w": jnp.ones(3, jnp.float16)}
  bad = {"w": jnp.asarray([1, np.inf, 1], jnp.float16)}
  scales = []
  for g in [good, good, bad, bad, bad, bad, good, good]:
    _, state = update(g, state, params)
    assert state.scale.dtype == jnp.float32 and state.growth_tracker.dtype == jnp.int32
    assert state.skipped_steps.dtype == jnp.int32 and state.last_finite.dtype == jnp.bool_
    scales.append(float(state.scale))
  assert scales == [2.0**16, 2.0**17, 2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**14, 2.0**15]
  assert int(state.skipped_steps) == 4


def test_growth_only_when_the_grown_scale_is_finite():
  tx = oh.dynamic_loss_scale(optax.identity(), init_scale=2.0**126, growth_interval=1)
  state = tx.init({"w": jnp.zeros(2)})
  update = jax.jit(tx.update)
  seen = []
  for _ in range(4):
    _, state = update({"w": jnp.zeros(2)}, state, {"w": jnp.zeros(2)})
    seen.append((float(state.scale), int(state.growth_tracker)))
  assert seen == [(2.0**127, 0)] * 4


def test_clipping_inside_sees_unscaled_gradients():
  """dynamic_loss_scale(chain(clip, adam_fp32_master)) on bf16 params with
  scaled grads is bitwise chain(clip, adam_fp32_master) on the true grads
  (upcast to fp32, which is what the scaler hands on); clipping outside the
  scaler clips the scaled grads (a different result)."""
  inner = lambda: optax.chain(optax.clip_by_global_norm(1.0), oh.adam_fp32_master(1e-2))
  scale = 2.0**12
  params0 = {"a": jnp.ones((16, 8), jnp.bfloat16), "b": jnp.zeros(8, jnp.bfloat16)}

  def run(tx, gscale, dtype=jnp.bfloat16):
    params, state = params0, tx.init(params0)
    update = jax.jit(tx.update)
    for t in range(20):
      g = jax.tree.map(lambda p: (jnp.cos(jnp.arange(p.size, dtype=jnp.float32) * (t + 1))
                                  .reshape(p.shape) * 3 * gscale).astype(jnp.bfloat16)
                       .astype(dtype), params)
      updates, state = update(g, state, params)
      params = optax.apply_updates(params, updates)
    return params

  reference = run(inner(), 1.0, jnp.float32)
  assert _leaves_equal(run(oh.dynamic_loss_scale(inner(), init_scale=scale), scale), reference)
  outside = optax.chain(optax.clip_by_global_norm(1.0),
                        oh.dynamic_loss_scale(oh.adam_fp32_master(1e-2), init_scale=scale))
  assert not _leaves_equal(run(outside, scale), reference)


def _accumulation_grads(t, params):
  return jax.tree.map(lambda p: (jnp.sin(jnp.arange(p.size, dtype=jnp.float32) * 0.7 + t)
                                 .reshape(p.shape) * 0.1).astype(p.dtype), params)


class _MyMultiSteps(optax.MultiSteps):
  def init(self, params):
    return super().init(params)


@pytest.mark.parametrize("nest", ["direct", "chain", "subclass", "eval_shape", "gradient_transformation"])
def test_multisteps_outside_the_scaler_is_refused_naming_the_order(nest):
  """MultiSteps(dynamic_loss_scale(...)) is refused at init, however it is
  reached, with an error naming the order that works."""
  params = {"w": jnp.ones(4, jnp.float16)}
  dls = oh.dynamic_loss_scale(oh.adam_fp32_master(1e-2))
  init = {
      "direct": lambda: optax.MultiSteps(dls, 2).init(params),
      "chain": lambda: optax.MultiSteps(optax.chain(optax.identity(), dls), 2).init(params),
      "subclass": lambda: _MyMultiSteps(dls, 2).init(params),
      "eval_shape": lambda: jax.eval_shape(optax.MultiSteps(dls, 2).init, params),
      "gradient_transformation":
          lambda: optax.MultiSteps(dls, 2).gradient_transformation().init(params),
  }[nest]
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(optax.MultiSteps\(inner, k"):
    init()


def test_multisteps_outside_the_scaler_is_refused_under_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float16)
  tx = optax.MultiSteps(oh.dynamic_loss_scale(oh.adam_fp32_master(1e-2)), 2)
  with pytest.raises(ValueError, match="Put MultiSteps inside the scaler"):
    nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_multisteps_resets_by_multiplying_which_is_why_it_goes_inside():
  """Pins the optax behaviour behind the refusal: after one non-finite
  micro-batch MultiSteps' accumulator stays NaN for good ((1 - emit) * acc,
  0 * inf). If this fails, optax changed its reset and the refusal in
  dynamic_loss_scale can be lifted."""
  k = 2
  params = {"w": jnp.ones(4, jnp.float32)}
  tx = optax.MultiSteps(optax.sgd(1e-2), k)
  state = tx.init(params)
  feed = [{"w": jnp.ones(4).at[1].set(jnp.inf)}] + [{"w": jnp.ones(4)}] * (4 * k - 1)
  for g in feed:
    _, state = jax.jit(tx.update)(g, state, params)
  assert bool(jnp.isnan(state.acc_grads["w"][1]))
  assert not bool(jnp.isnan(state.acc_grads["w"][0]))


def test_multisteps_inside_drops_only_the_bad_microbatch():
  """dynamic_loss_scale(MultiSteps(inner, k, accumulator_dtype=f32)): unscaled
  fp32 accumulation; a non-finite micro-batch is dropped on its own (the
  window goes on with the next finite ones)."""
  k, scale = 2, 2.0**8
  params = {"w": jnp.ones(6, jnp.bfloat16)}
  tx = oh.dynamic_loss_scale(
      optax.MultiSteps(oh.adam_fp32_master(1e-2), k, accumulator_dtype=jnp.float32),
      init_scale=scale)
  ref = optax.MultiSteps(oh.adam_fp32_master(1e-2), k, accumulator_dtype=jnp.float32)
  s, s_ref = tx.init(params), ref.init(params)
  p, p_ref = params, params
  good = [_accumulation_grads(t, params) for t in range(10)]
  feed = good[:1] + [{"w": good[1]["w"].at[0].set(jnp.inf)}] + good[1:]
  update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
  for g in feed:
    u, s = update(_scaled(g, float(oh.loss_scale(s))), s, p)
    p = optax.apply_updates(p, u)
  for g in good:
    u, s_ref = ref_update(g, s_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
  assert _leaves_equal(p, p_ref)
  assert int(s.skipped_steps) == 1 and float(s.scale) == scale / 2


def test_helpers_find_the_state_anywhere():
  params = {"w": jnp.ones(3, jnp.float16)}
  dls = oh.dynamic_loss_scale(oh.adam_fp32_master(1e-3), init_scale=2.0**20)
  nested = [
      dls,
      optax.chain(optax.add_decayed_weights(0.0), dls),
      oh.dynamic_loss_scale(optax.MultiSteps(oh.adam_fp32_master(1e-3), 4), init_scale=2.0**20),
      optax.chain(optax.identity(), optax.chain(dls)),
  ]
  for tx in nested:
    state = tx.init(params)
    assert float(oh.loss_scale(state)) == 2.0**20
    scaled = oh.scale_loss(jnp.float16(10.0), state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 10.0 * 2.0**20  # not fp16 inf
  with pytest.raises(ValueError, match="holds no DynamicLossScaleState"):
    oh.loss_scale(optax.adam(1e-3).init(params))
  two = optax.multi_transform({"a": dls, "b": dls}, {"w": "a", "v": "b"})
  with pytest.raises(ValueError, match="holds 2 DynamicLossScaleStates"):
    oh.scale_loss(1.0, two.init({"w": jnp.ones(2), "v": jnp.ones(2)}))
  with pytest.raises(TypeError, match="float"):
    oh.scale_loss(jnp.int32(3), dls.init(params))


def test_value_and_scaled_grad():
  def loss(p, x):
    return jnp.sum((p["w"].astype(jnp.float32) * x) ** 2), {"n": x.size}
  params = {"w": jnp.asarray([0.5, -2.0, 1e-3], jnp.float16)}
  x = jnp.asarray([1.0, 2.0, 3.0])
  state = oh.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10).init(params)
  (value, aux), grads = oh.value_and_scaled_grad(loss, has_aux=True)(state, params, x)
  (v_ref, _), g_ref = jax.value_and_grad(loss, has_aux=True)(params, x)
  assert float(value) == float(v_ref) and aux == {"n": 3}
  assert grads["w"].dtype == jnp.float16
  assert np.array_equal(np.asarray(grads["w"], np.float32),
                        np.asarray(g_ref["w"], np.float32) * 2.0**10)
  (_, _), gx = oh.value_and_scaled_grad(loss, argnums=-1, has_aux=True)(state, params, x)
  assert np.array_equal(np.asarray(gx), np.asarray(
      jax.grad(lambda x: loss(params, x)[0])(x)) * 2.0**10)
  with pytest.raises(ValueError, match="out of range"):
    oh.value_and_scaled_grad(loss, argnums=2, has_aux=True)(state, params, x)


def test_flax_nnx_optimizer_skips_bitwise():
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 3, rngs=rngs, param_dtype=jnp.float16, dtype=jnp.float16)

    def __call__(self, x):
      return self.lin(x)

  model = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(model, oh.dynamic_loss_scale(oh.adam_fp32_master(1e-2), init_scale=2.0**8),
                      wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x):
    def loss_fn(model):
      return oh.scale_loss(jnp.mean(model(x).astype(jnp.float32) ** 2), opt.opt_state)
    grads = nnx.grad(loss_fn)(model)
    opt.update(model, grads)

  x = jnp.ones((2, 4), jnp.float16)
  step(model, opt, x)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  step(model, opt, x.at[0, 0].set(jnp.inf))
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  assert _leaves_equal(before, after)
  assert float(oh.loss_scale(opt.opt_state)) == 2.0**7
  step(model, opt, x)
  assert not _leaves_equal(before, jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))


BAD_ARGS = [
    (dict(init_scale=0.0), ValueError, "init_scale must be > 0"),
    (dict(init_scale=1e39), ValueError, "init_scale must be finite in fp32"),
    (dict(min_scale=0.0), ValueError, "min_scale must be > 0"),
    (dict(min_scale=4.0, init_scale=2.0), ValueError, r"min_scale \(4.0\) must be <= init_scale"),
    (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor must be in \(0, 1\)"),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), ValueError, "growth_interval must be an integer >= 1"),
    (dict(growth_interval=2.5), ValueError, "growth_interval must be an integer >= 1"),
    (dict(init_scale="big"), TypeError, "init_scale must be a Python number"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_ARGS)
def test_bad_arguments(kwargs, error, message):
  with pytest.raises(error, match=message):
    oh.dynamic_loss_scale(optax.identity(), **kwargs)



@pytest.mark.parametrize("inner", ["adamw_bf16", "adam_fp32_master"])
def test_tx_update_of_16_bit_params_returns_the_composed_updates_bit_for_bit(inner, monkeypatch):
  """dynamic_loss_scale(native optimizer).update on 16-bit params forms the
  updates after its branch: the same fp32 updates as the composed
  transformation, on a finite step and on a skipped one (-0.0: a -0.0 param
  stays -0.0), jitted."""
  from optax_half import _native  # noqa: PLC0415

  params = {"w": jnp.asarray([-0.0, 0.0, 1.5, -2.25, 3e-3, 7.0], jnp.bfloat16),
            "v": jnp.linspace(-1, 1, 33).astype(jnp.float16 if inner == "adam_fp32_master"
                                                 else jnp.bfloat16)}
  finite = jax.tree.map(lambda x: jnp.full_like(x, 0.75 * 1024), params)
  bad = {"w": finite["w"].at[2].set(jnp.inf), "v": finite["v"]}

  def run():
    tx = oh.dynamic_loss_scale(getattr(oh, inner)(1e-2), init_scale=1024.0)
    state = tx.init(params)
    out = []
    for g in (finite, bad, finite):
      updates, state = jax.jit(tx.update)(g, state, params)
      out.append(updates)
    return out

  with monkeypatch.context() as m:
    m.setattr(_native, "available", lambda: False)
    composed = run()
  native = run()
  for a, b in zip(jax.tree.leaves(native), jax.tree.leaves(composed)):
    assert bitwise_equal(a, b)
  skipped = native[1]
  assert all(bool((jnp.signbit(u) & (u == 0)).all()) for u in jax.tree.leaves(skipped))
  landed = optax.apply_updates(params, skipped)
  for a, b in zip(jax.tree.leaves(landed), jax.tree.leaves(params)):
    assert bitwise_equal(a, b)
