"""The AdamW core and the named optimizers against independent references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from suite_helpers import default_or_slow
from conftest import bitwise_equal, random_tree

SHAPES = {"a": (8, 16), "b": (16,), "c": ()}


def numpy_adamw_reference(params, grads_seq, lr, b1, b2, eps, wd):
  """docs/algorithms.md#adamw-core, written in NumPy float32, op by op."""
  f = np.float32
  b1, b2, eps, wd, lr = f(b1), f(b2), f(eps), f(wd), f(lr)
  x = {k: np.asarray(v, np.float32) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in x.items()}
  v = {k: np.zeros_like(v) for k, v in x.items()}
  for t, grads in enumerate(grads_seq, start=1):
    inv_bc1 = f(1) / (f(1) - b1 ** f(t))
    inv_bc2 = f(1) / (f(1) - b2 ** f(t))
    for k in x:
      g = np.asarray(grads[k], np.float32)
      m[k] = b1 * m[k] + (f(1) - b1) * g
      v[k] = b2 * v[k] + (f(1) - b2) * (g * g)
      u = (m[k] * inv_bc1) / (np.sqrt(v[k] * inv_bc2) + eps)
      u = u + wd * x[k]
      x[k] = x[k] + (-lr) * u
  return x


def _grads_seq(n, dtype=jnp.float32):
  return [random_tree(100 + t, SHAPES, dtype) for t in range(n)]


@pytest.mark.parametrize("in_place, dtype", default_or_slow(
    [(i, d) for i in (False, True) for d in (jnp.bfloat16, jnp.float16)],
    default=[(False, jnp.bfloat16), (True, jnp.float16)]))
def test_adam_fp32_master_matches_numpy_spec_bitwise_op_by_op(in_place, dtype):
  """On unit-normal weights, many crossing zero, the master follows the NumPy spec at
  every step, never rounded; in place the params are its rounding at every step, through
  tx.update + apply_updates wherever p + u reaches it (docs/algorithms.md#landing-exactly)."""
  params = random_tree(0, SHAPES, dtype)
  grads = _grads_seq(50, dtype)
  tx = oh.adam_fp32_master(1e-2, weight_decay=0.1)
  p = params
  ref = numpy_adamw_reference(params, grads, 1e-2, 0.9, 0.999, 1e-8, 0.1)
  with jax.disable_jit():
    s = tx.init(p)
    for g in grads:
      if in_place:
        p, s = oh.update_and_apply(tx, g, s, p)
      else:
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
  crossed = 0
  for k in SHAPES:
    # The NumPy powers b**t may round differently from XLA's pow by 1 ULP.
    np.testing.assert_allclose(np.asarray(s.master[k]), ref[k], rtol=2e-6, atol=0)
    crossed += int((np.sign(ref[k]) != np.sign(np.asarray(params[k], np.float32))).sum())
    rounded = s.master[k].astype(dtype)
    if in_place:
      assert bitwise_equal(p[k], rounded)
    else:
      assert (np.asarray(p[k], np.float32) != np.asarray(rounded, np.float32)).mean() < 0.05
  assert crossed > 0


def test_adam_fp32_master_on_fp32_params_tracks_optax_adamw():
  """Within 1e-6 relative of optax.adamw over 300 jitted steps.

  optax is given its hyperparameters as fp32 arrays, so that it forms 1 - b in
  fp32 like we do (docs/algorithms.md#adamw-core); what is left is
  FMA contraction inside XLA fusions.
  """
  f32 = jnp.float32
  params = random_tree(0, SHAPES, jnp.float32)
  tx = oh.adam_fp32_master(1e-3, weight_decay=1e-2)
  rtx = optax.adamw(f32(1e-3), b1=f32(0.9), b2=f32(0.999), eps=f32(1e-8),
                    weight_decay=f32(1e-2))
  step = jax.jit(lambda t, g, s, p: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(
      t.update(g, s, p)), static_argnums=0)
  ours, ref = params, params
  s, rs = tx.init(ours), rtx.init(ref)
  err = 0.0
  for g in _grads_seq(300):
    ours, s = step(tx, g, s, ours)
    ref, rs = step(rtx, g, rs, ref)
    err = max(err, *(float(np.max(np.abs(np.asarray(ours[k]) - np.asarray(ref[k]))
                                  / np.maximum(np.abs(np.asarray(ref[k])), 1e-3)))
                      for k in SHAPES))
  assert err <= 1e-6, err


def test_split_with_fp32_moments_is_exact_fp32_adamw():
  """adamw_bf16(split, fp32 moments) == the same core on fp32 params, bitwise."""
  params = random_tree(0, SHAPES, jnp.bfloat16)
  grads = _grads_seq(30, jnp.bfloat16)
  kw = dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32, state_rounding="nearest")
  tx = oh.adamw_bf16(1e-2, weight_decay=1e-2, compensation="split", **kw)
  core = oh.scale_by_adamw(1e-2, weight_decay=1e-2, **kw)
  p, x = params, jax.tree.map(lambda v: v.astype(jnp.float32), params)
  with jax.disable_jit():
    s, cs = tx.init(p), core.init(x)
    for g in grads:
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
      u, cs = core.update(jax.tree.map(lambda v: v.astype(jnp.float32), g), cs, x)
      x = optax.apply_updates(x, u)
  for k in SHAPES:
    assert bitwise_equal(oh.rounding.join_f32(p[k], s.master[k]), x[k])


def _state_bytes(state):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim > 0)


@pytest.mark.parametrize("make, expected", [
    (lambda: oh.adamw_bf16(1e-3), 6),                                # c, mu, nu
    (lambda: oh.adamw_bf16(1e-3, compensation="split"), 6),         # lo, mu, nu
    (lambda: oh.adamw_bf16(1e-3, compensation="stochastic"), 4),    # mu, nu
    (lambda: oh.adamw_bf16(1e-3, compensation="none"), 4),
    (lambda: oh.adam_fp32_master(1e-3), 12),                         # master, mu, nu
])
def test_optimizer_state_bytes_per_param(make, expected):
  params = {"w": jnp.zeros((64, 32), jnp.bfloat16), "b": jnp.zeros((32,), jnp.bfloat16)}
  n = 64 * 32 + 32
  assert _state_bytes(make().init(params)) == expected * n
  # With the bf16 param and grad: 10 bytes/param for kahan and split.


def test_moment_dtypes_default_to_param_dtype_and_can_be_overridden():
  params = {"w": jnp.zeros((4,), jnp.bfloat16)}
  core = oh.adamw_bf16(1e-3).init(params).inner_state
  assert core.mu["w"].dtype == jnp.bfloat16 and core.nu["w"].dtype == jnp.bfloat16
  core = oh.adamw_bf16(1e-3, mu_dtype=jnp.float32, nu_dtype=jnp.float32).init(params).inner_state
  assert core.mu["w"].dtype == jnp.float32 and core.nu["w"].dtype == jnp.float32
  master = oh.adam_fp32_master(1e-3).init(params).inner_state
  assert master.mu["w"].dtype == jnp.float32 and master.nu["w"].dtype == jnp.float32


def test_b2_stays_fp32_with_bf16_params():
  """(1 - b2) g^2 with b2 = fp32(0.999), not bf16(0.999) = 1.0."""
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  g = {"w": jnp.full((4,), 2.0, jnp.bfloat16)}
  tx = oh.adamw_bf16(1e-3, nu_dtype=jnp.float32)
  _, s = tx.update(g, tx.init(params), params)
  expected = (np.float32(1) - np.float32(0.999)) * np.float32(4.0)
  assert np.all(np.asarray(s.inner_state.nu["w"]) == expected)


def test_bf16_moments_do_not_go_stale_with_stochastic_writes():
  """nu += (1 - b2) g^2 at b2 = 0.999 is below half a bf16 ULP: nearest drops it."""
  params = {"w": jnp.ones((4096,), jnp.bfloat16)}

  def final_nu(state_rounding):
    tx = oh.adamw_bf16(0.0, state_rounding=state_rounding)

    @jax.jit
    def run():
      def body(s, t):
        # grad 1 for 100 steps, then grad 2: nu should move from ~0.095 to 4.
        g = jnp.where(t < 100, 1.0, 2.0) * jnp.ones((4096,), jnp.bfloat16)
        return tx.update({"w": g}, s, params)[1], None
      return jax.lax.scan(body, tx.init(params), jnp.arange(1100))[0]
    return np.asarray(run().inner_state.nu["w"], np.float64)

  exact = 0.999 ** 1000 * (1 - 0.999 ** 100) + 4 * (1 - 0.999 ** 1000)
  nearest, stochastic = final_nu("nearest"), final_nu("stochastic")
  assert abs(nearest.mean() - exact) > 0.1 * exact      # stale
  assert abs(stochastic.mean() - exact) < 0.01 * exact  # tracks the fp32 value


def test_learning_rate_schedule_is_evaluated_at_the_pre_increment_count():
  params = {"w": jnp.zeros((3,), jnp.float32)}
  sched = lambda count: 1e-3 * (count + 1)
  tx = oh.adam_fp32_master(sched)
  s = tx.init(params)
  for t in range(3):
    u, s = tx.update({"w": jnp.ones(3)}, s, params)
    # First Adam step of a constant gradient is -lr * 1/(1 + eps) ~ -lr.
    if t == 0:
      np.testing.assert_allclose(np.asarray(u["w"]), -1e-3, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(u["w"]), -3e-3, rtol=1e-5)


def test_preheat_decay_schedule_matches_reference_formula():
  sched = oh.preheat_decay_schedule(1e-3, preheat_steps=100, decay_power=-0.5)
  for count in [0, 1, 50, 98, 99, 500, 10_000]:
    step = count + 1  # the reference increments before calling its LR
    x = (step + 1) / 100
    expected = 1e-3 * min(x, x ** -0.5)
    np.testing.assert_allclose(float(sched(count)), expected, rtol=1e-6)
  assert sched(jnp.int32(0)).dtype == jnp.float32


def test_inject_hyperparams_changes_lr_without_recompiling():
  params = {"w": jnp.ones((8,), jnp.bfloat16)}
  tx = optax.inject_hyperparams(oh.adamw_bf16, hyperparam_dtype=jnp.float32)(
      learning_rate=1e-2, b2=0.999)
  state = tx.init(params)
  assert state.hyperparams["b2"].dtype == jnp.float32

  @jax.jit
  def step(g, s, p):
    u, s = tx.update(g, s, p)
    return u, s

  g = {"w": jnp.ones((8,), jnp.bfloat16)}
  u1, _ = step(g, state, params)
  state.hyperparams["learning_rate"] = jnp.float32(2e-2)
  u2, _ = step(g, state, params)
  assert step._cache_size() == 1
  ratio = np.asarray(u2["w"], np.float64) / np.asarray(u1["w"], np.float64)
  # Both updates land on bf16 values; the larger step moves further.
  assert np.all(np.abs(u2["w"]) >= np.abs(u1["w"]))
  assert np.all(ratio > 1)


def test_16_bit_hyperparameters_are_rejected_with_the_fix():
  params = {"w": jnp.ones((8,), jnp.bfloat16)}
  tx = optax.inject_hyperparams(oh.adamw_bf16)(learning_rate=1e-2, b2=0.999)
  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    tx.init(params)


@pytest.mark.parametrize("kwargs, match", [
    (dict(compensation="foo"), "compensation must be one of"),
    (dict(learning_rate=-1.0), "learning_rate must be >= 0"),
    (dict(b1=1.0), "b1 must be in"),
    (dict(b2=-0.1), "b2 must be in"),
    (dict(eps=0.0), "eps must be > 0"),
    (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
    (dict(state_rounding="up"), "state_rounding must be one of"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(ValueError, match=match):
    oh.adamw_bf16(**kwargs)


@pytest.mark.parametrize("make", [
    lambda: oh.adamw_bf16(1e-3, weight_decay=0.1),
    lambda: oh.adamw_bf16(1e-3, weight_decay=0.1, compensation="split"),
    lambda: oh.adam_fp32_master(1e-3, weight_decay=0.1),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_jit_equals_op_by_op_bitwise(make, dtype):
  """No FMA contraction and no pow: the jitted step has the bits of the op-by-op one."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((64, 33)), dtype),
            "b": jnp.asarray(rng.standard_normal(33), dtype)}
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 0.1, dtype),
                        params) for _ in range(25)]
  tx = make()

  def run(step):
    p, s = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    return p, s

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  jitted = run(jax.jit(step))
  with jax.disable_jit():
    eager = run(step)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    assert bitwise_equal(a, b)


def test_gradients_flow_through_the_update():
  """no_fma is the identity for derivatives: hypergradients match optax.adamw's."""
  p = {"w": jnp.linspace(-1, 1, 8)}
  g = {"w": jnp.linspace(0.3, -0.2, 8)}

  def loss(lr, make):
    tx = make(lr)
    s, q = tx.init(p), p
    for _ in range(2):
      u, s = tx.update(g, s, q)
      q = optax.apply_updates(q, u)
    return jnp.sum(q["w"] ** 2)

  ours = jax.grad(loss)(1e-2, lambda lr: oh.scale_by_adamw(lr, weight_decay=0.1))
  ref = jax.grad(loss)(1e-2, lambda lr: optax.adamw(lr, weight_decay=0.1))
  assert ours != 0 and abs(ours - ref) <= 1e-4 * abs(ref), (ours, ref)
