"""oh.nnx.Optimizer and oh.train_state.TrainState: drop-ins for Flax's, whose
step runs oh.update_and_apply (the kernel writes the params in place).

Each is compared with the Flax class it replaces, stepping the same model with
the same gradients under jit with donation: the same bits in params and
state, the same state pytree (a checkpoint of one loads into the other), and
a compiled step in which the native kernel writes the params (XLA's cost
analysis counts no bytes for the custom call, where the parent's
apply_updates pass reads and writes every param).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import optax_half as oh
from optax_half._util import find_states
from conftest import bitwise_equal
from suite_helpers import default_or_slow

STEPS = 4


def _txs():
  return {
      "adamw_bf16 kahan": lambda: oh.adamw_bf16(1e-2, weight_decay=0.1),
      "adamw_bf16 stochastic": lambda: oh.adamw_bf16(1e-2, compensation="stochastic"),
      "adamw_bf16 kahan flat_state": lambda: oh.adamw_bf16(1e-2, weight_decay=0.1,
                                                           flat_state=True),
      "adam_fp32_master": lambda: oh.adam_fp32_master(1e-2),
      "dynamic_loss_scale(adamw_bf16)": lambda: oh.dynamic_loss_scale(oh.adamw_bf16(1e-2)),
      "oh.chain(clip, adamw_bf16)": lambda: oh.chain(oh.clip_by_global_norm(0.5),
                                                     oh.adamw_bf16(1e-2)),
      "kahan_summation(scaled_adam)": lambda: oh.kahan_summation(
          oh.scaled_adam(1e-2, clipping_scale=2.0)),
      "optax.adam (no kernel)": lambda: optax.adam(1e-2),
  }


TXS = _txs()


class _Model(nnx.Module):

  def __init__(self, dtype):
    self.dense = nnx.Linear(6, 5, param_dtype=dtype, rngs=nnx.Rngs(0))
    self.out = nnx.Linear(5, 1, param_dtype=dtype, rngs=nnx.Rngs(1))
    self.count = nnx.Variable(jnp.zeros((), jnp.int32))  # not a Param: left alone

  def __call__(self, x):
    return self.out(jax.nn.relu(self.dense(x)))


def _batches(dtype):
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.standard_normal((8, 6)), dtype) for _ in range(STEPS)]


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert bitwise_equal(x, y), (x, y)


def _nnx_run(optimizer_cls, make_tx, dtype):
  model = _Model(dtype)
  optimizer = optimizer_cls(model, make_tx(), wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, x):
    loss = lambda m: (m(x).astype(jnp.float32) ** 2).mean()
    grads = nnx.grad(loss)(model)
    return optimizer.update(model, grads)

  changes = []
  for x in _batches(dtype):
    before = jax.tree.map(jnp.copy, nnx.as_pure(nnx.state(model, nnx.Param)))
    changes.append((before, train_step(model, optimizer, x)))
  return model, optimizer, changes, train_step


@functools.cache
def _our_run(name, dtype):
  """``_nnx_run(oh.nnx.Optimizer, TXS[name], dtype)``, once per module: the
  reference of every test here that runs it (they only read it)."""
  return _nnx_run(oh.nnx.Optimizer, TXS[name], dtype)


@pytest.mark.parametrize("name", default_or_slow(list(TXS), [
    "adamw_bf16 kahan", "dynamic_loss_scale(adamw_bf16)", "oh.chain(clip, adamw_bf16)",
    "kahan_summation(scaled_adam)", "optax.adam (no kernel)"]))
def test_nnx_optimizer_equals_flax_optimizer(name):
  dtype = jnp.float16 if name.startswith("dynamic") else jnp.bfloat16
  ref_model, ref_opt, ref_updates, _ = _nnx_run(nnx.Optimizer, TXS[name], dtype)
  model, opt, changes, _ = _our_run(name, dtype)
  assert isinstance(opt, nnx.Optimizer)
  if find_states(nnx.state(opt), oh.MasterWeightsState):
    # A master's in-place step lands on its rounding; Flax's p + u may miss it, and the
    # runs part by about an update (docs/algorithms.md#landing-exactly).
    for a, b in zip(_leaves(nnx.state(model)), _leaves(nnx.state(ref_model))):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=0, atol=1e-2)
  else:
    _same(nnx.state(model), nnx.state(ref_model))
    _same(nnx.state(opt), nnx.state(ref_opt))
  assert int(opt.step[...]) == STEPS
  # the same state pytree: a Flax optimizer's state loads into ours
  assert (jax.tree.structure(nnx.state(opt)) == jax.tree.structure(nnx.state(ref_opt)))
  # update returns each param's change, which lands on the new param
  after = nnx.as_pure(nnx.state(model, nnx.Param))
  before, last = changes[-1]
  landed = jax.tree.map(lambda p, c: (p.astype(jnp.float32) + c).astype(p.dtype), before, last)
  _same(landed, after)
  # and the parent's updates apply to the same params (a master's: its own run's)
  if not find_states(nnx.state(opt), oh.MasterWeightsState):
    ref_before, ref_last = ref_updates[-1]
    _same(optax.apply_updates(ref_before, ref_last), after)


def test_nnx_optimizer_state_loads_from_a_flax_optimizer_and_resumes_bit_for_bit():
  make_tx = TXS["adamw_bf16 kahan"]
  ref_model, ref_opt, _, ref_step = _nnx_run(nnx.Optimizer, make_tx, jnp.bfloat16)
  model = _Model(jnp.bfloat16)
  opt = oh.nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  nnx.update(model, jax.tree.map(jnp.copy, nnx.state(ref_model)))
  nnx.update(opt, jax.tree.map(jnp.copy, nnx.state(ref_opt)))
  _, _, _, step = _nnx_run(oh.nnx.Optimizer, make_tx, jnp.bfloat16)
  x = _batches(jnp.bfloat16)[0]
  ref_step(ref_model, ref_opt, x)
  step(model, opt, x)
  _same(nnx.state(model), nnx.state(ref_model))
  _same(nnx.state(opt), nnx.state(ref_opt))


def _bytes_accessed_per_param(optimizer_cls):
  model = nnx.Linear(256, 256, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  optimizer = optimizer_cls(model, oh.adamw_bf16(1e-2), wrt=nnx.Param)
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  # the gradients donated too, as in a step that computes them: nnx.jit
  # hands its arguments' state back, and the kernel reuses the gradients' buffers
  step = nnx.jit(lambda m, o, g: o.update(m, g) and None, donate_argnums=(0, 1, 2))
  cost = step.lower(model, optimizer, grads).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("bytes accessed", 0)) / (257 * 256)


def _fast_loop(how, model, optimizer):
  """``train_step(x)`` in one of Flax's ways to skip ``nnx.jit``'s per-call
  graph traversal (or part of it), donating the model and the optimizer."""
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: (m(x).astype(jnp.float32) ** 2).mean())(model)
    optimizer.update(model, grads)

  if how == "cached_partial":
    return nnx.cached_partial(nnx.jit(step, donate_argnums=(0, 1)), model, optimizer)
  if how.startswith("jit_partial"):  # Flax >= 0.12.5; the partial args are one donated list
    return nnx.jit_partial(step, model, optimizer, donate_argnums=0,
                           graph=how.endswith("graph"), graph_updates=False)
  jitted = nnx.jit(step, donate_argnums=(0, 1), graph=False)  # tree mode: Flax >= 0.12.4
  return lambda x: jitted(model, optimizer, x)


_FAST_LOOPS = ["cached_partial", "jit_partial tree", "jit_partial graph", "jit tree"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel runs on CPU")
@pytest.mark.parametrize("name,how", default_or_slow(
    [(name, how) for name in ("adamw_bf16 kahan", "adamw_bf16 kahan flat_state",
                              "dynamic_loss_scale(adamw_bf16)", "kahan_summation(scaled_adam)")
     for how in _FAST_LOOPS],
    [("adamw_bf16 kahan", how) for how in _FAST_LOOPS] + [
        (name, "jit_partial tree") for name in (
            "adamw_bf16 kahan flat_state", "dynamic_loss_scale(adamw_bf16)",
            "kahan_summation(scaled_adam)")]))
def test_nnx_optimizer_in_flax_fast_loops_steps_in_place_same_bits(name, how):
  """Flax's ways to cut ``nnx.jit``'s per-call traversal of the model and
  optimizer (``nnx.cached_partial`` of a donating ``nnx.jit`` step,
  ``nnx.jit_partial`` in tree or graph mode, ``nnx.jit(graph=False)``) keep
  the bits of the plain ``nnx.jit`` step and the in-place write: the params
  stay in their buffers."""
  if how.startswith("jit_partial") and not hasattr(nnx, "jit_partial"):
    pytest.skip("nnx.jit_partial: Flax >= 0.12.5")
  if how == "jit tree" and not hasattr(nnx, "set_graph_mode"):
    pytest.skip("nnx.jit(graph=False): Flax >= 0.12.4")
  ref_model, ref_opt, _, _ = _our_run(name, jnp.bfloat16)
  model = _Model(jnp.bfloat16)
  optimizer = oh.nnx.Optimizer(model, TXS[name](), wrt=nnx.Param)
  train_step = _fast_loop(how, model, optimizer)
  pointer = model.dense.kernel[...].unsafe_buffer_pointer()
  for x in _batches(jnp.bfloat16):
    train_step(x)
  assert model.dense.kernel[...].unsafe_buffer_pointer() == pointer
  _same(nnx.state(model), nnx.state(ref_model))
  _same(nnx.state(optimizer), nnx.state(ref_opt))
  assert int(optimizer.step[...]) == STEPS


def test_nnx_optimizer_steps_through_the_kernel_without_an_apply_updates_pass():
  ours = _bytes_accessed_per_param(oh.nnx.Optimizer)
  parent = _bytes_accessed_per_param(nnx.Optimizer)
  # the parent's apply_updates (and the copies of the kernel's outputs) read
  # and write every param in XLA ops; in ours the kernel (a custom call, not
  # counted) writes the params, and XLA does only per-leaf scalars and counters
  assert parent >= 8, parent
  assert ours < 0.5, ours


def _train_state_run(state_cls, make_tx, dtype, owg=False):
  params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((6, 3)) * 0.3, dtype)}
  if owg:
    params = {"params": params, flax_train_state.OVERWRITE_WITH_GRADIENT: {"s": jnp.ones(())}}
  state = state_cls.create(apply_fn=lambda p, x: x @ p["w"], params=params, tx=make_tx())

  @jax.jit
  def train_step(state, x):
    def loss(p):
      inner = p["params"] if owg else p
      return (state.apply_fn(inner, x).astype(jnp.float32) ** 2).mean()
    grads = jax.grad(loss)(state.params)
    if owg:
      grads = {"params": grads["params"],
               flax_train_state.OVERWRITE_WITH_GRADIENT: {"s": state.step + 7.0}}
    return state.apply_gradients(grads=grads)

  step = jax.jit(train_step, donate_argnums=0)
  for x in _batches(dtype):
    state = step(state, x)
  return state


@pytest.mark.parametrize("name", ["adamw_bf16 kahan", "adam_fp32_master",
                                  "oh.chain(clip, adamw_bf16)", "optax.adam (no kernel)"])
def test_train_state_equals_flax_train_state(name):
  ref = _train_state_run(flax_train_state.TrainState, TXS[name], jnp.bfloat16)
  ours = _train_state_run(oh.train_state.TrainState, TXS[name], jnp.bfloat16)
  assert isinstance(ours, flax_train_state.TrainState)
  assert jax.tree.structure(ours.params) == jax.tree.structure(ref.params)
  assert jax.tree.structure(ours.opt_state) == jax.tree.structure(ref.opt_state)
  assert int(ours.step) == STEPS
  if name != "adam_fp32_master":
    _same(ours.params, ref.params)
    _same(ours.opt_state, ref.opt_state)
    return
  # A master's in-place step lands on its rounding; Flax's p + u may miss it where a weight
  # jumps far (the master is kept, docs/algorithms.md#landing-exactly), and the gradients
  # of that step's params differ: the runs part by about an update.
  for p_ours, p_ref, m, m_ref in zip(*(_leaves(t) for t in (
      ours.params, ref.params, ours.opt_state.master, ref.opt_state.master))):
    assert bitwise_equal(p_ours, jnp.asarray(m).astype(p_ours.dtype))
    np.testing.assert_allclose(np.asarray(m), np.asarray(m_ref), rtol=0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(p_ours, np.float32), np.asarray(p_ref, np.float32),
                               rtol=0, atol=1e-2)


def test_train_state_overwrite_with_gradient():
  make_tx = TXS["adamw_bf16 kahan"]
  ref = _train_state_run(flax_train_state.TrainState, make_tx, jnp.bfloat16, owg=True)
  ours = _train_state_run(oh.train_state.TrainState, make_tx, jnp.bfloat16, owg=True)
  _same(ours.params, ref.params)
  key = flax_train_state.OVERWRITE_WITH_GRADIENT
  assert float(ours.params[key]["s"]) == STEPS - 1 + 7.0


def test_scaled_adam_stats_names_nnx_params_without_value():
  model = _Model(jnp.float32)
  optimizer = oh.nnx.Optimizer(model, oh.scaled_adam(0.03, clipping_scale=2.0), wrt=nnx.Param)
  x = _batches(jnp.float32)[0]
  grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
  optimizer.update(model, grads)
  names = {"dense.kernel", "dense.bias", "out.kernel", "out.bias"}
  assert oh.scaled_adam_stats(optimizer.opt_state)["dominant_parameter"] in names
  assert oh.scaled_adam_stats(nnx.as_pure(optimizer.opt_state))["dominant_parameter"] in names


def test_nnx_checkpoint_recipe_resumes_bit_for_bit(tmp_path):
  """The recipe: save nnx.state(model) and nnx.state(optimizer) with
  oh.checkpoint.save; in a new process, build the model and optimizer as
  before, restore each into its own state (the target gives structure, dtypes
  and shardings) and nnx.update them. 2 + 2 steps equal 4 steps, bit for bit."""
  make_tx = TXS["adamw_bf16 kahan"]
  xs = _batches(jnp.bfloat16)

  def build():
    model = _Model(jnp.bfloat16)
    return model, oh.nnx.Optimizer(model, make_tx(), wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, x):
    grads = nnx.grad(lambda m: (m(x).astype(jnp.float32) ** 2).mean())(model)
    optimizer.update(model, grads)

  ref_model, ref_opt = build()
  for x in xs:
    train_step(ref_model, ref_opt, x)

  model, optimizer = build()
  for x in xs[:2]:
    train_step(model, optimizer, x)
  oh.checkpoint.save(tmp_path / "model", nnx.state(model))
  oh.checkpoint.save(tmp_path / "optimizer", nnx.state(optimizer))
  del model, optimizer

  model, optimizer = build()  # a fresh start: other weights, step 0
  nnx.update(model, oh.checkpoint.restore(tmp_path / "model", nnx.state(model)))
  nnx.update(optimizer, oh.checkpoint.restore(tmp_path / "optimizer", nnx.state(optimizer)))
  assert int(optimizer.step[...]) == 2
  for x in xs[2:]:
    train_step(model, optimizer, x)
  _same(nnx.state(model), nnx.state(ref_model))
  _same(nnx.state(optimizer), nnx.state(ref_opt))


def test_state_readers_take_nnx_state_of_the_optimizer():
  """scaled_adam_stats, find_loss_scale_state and loss_scale read nnx.state(optimizer)
  (NamedTuples as dicts, leaves as Variables) as they read optimizer.opt_state."""
  model = nnx.Linear(3, 2, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
  tx = oh.dynamic_loss_scale(oh.scaled_adam(0.1, clipping_scale=2.0), init_scale=2.0**8)
  optimizer = oh.nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**8, p.dtype), nnx.state(model, nnx.Param))
  optimizer.update(model, grads)
  state = nnx.state(optimizer)
  assert float(oh.loss_scale(state)) == float(oh.loss_scale(optimizer.opt_state)) == 2.0**8
  found = oh.find_loss_scale_state(state)
  assert int(found.growth_tracker) == 1 and int(found.skipped_steps) == 0
  stats = oh.scaled_adam_stats(state)
  assert stats == oh.scaled_adam_stats(optimizer.opt_state)
  assert stats["grad_norm"] > 0 and stats["clipping_factor"] == 1.0
  assert stats["dominant_parameter"] in ("bias", "kernel")
  with pytest.raises(ValueError, match="no ScaledAdamState"):
    oh.scaled_adam_stats(nnx.state(oh.nnx.Optimizer(model, oh.adamw_bf16(1e-3), wrt=nnx.Param)))
