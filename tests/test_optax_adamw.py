"""adamw_bf16 and adam_fp32_master take optax.adamw's signature and defaults
(eps_root, mask, nesterov included) and, on fp32 params, give optax.adamw's
numbers within fp32 rounding; optax's alias tests (parabola, Rosenbrock) pass."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import _native
from suite_helpers import default_or_slow


def test_adamw_bf16_has_optax_adamws_signature_first():
  ours = list(inspect.signature(oh.adamw_bf16).parameters.values())
  theirs = list(inspect.signature(optax.adamw).parameters.values())
  assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == [
      (p.name, p.kind, p.default) for p in theirs]
  assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])
  # adam_fp32_master: the same order without mu_dtype (its moments are fp32), no decay
  master = inspect.signature(oh.adam_fp32_master).parameters
  assert [n for n in master][:8] == ["learning_rate", "b1", "b2", "eps", "eps_root",
                                     "weight_decay", "mask", "nesterov"]
  assert master["weight_decay"].default == 0.0
  assert master["nesterov"].kind == inspect.Parameter.KEYWORD_ONLY


def _parabola():
  final = jnp.array([1.0, -1.0, 1.0])
  return jnp.array([-1.0, 10.0, 1.0]), final, lambda p: jnp.sum((p - final) ** 2)


def _rosenbrock():
  final = jnp.array([1.0, 1.0])
  return jnp.array([0.0, 0.0]), final, lambda p: (1.0 - p[0]) ** 2 + 100.0 * (
      p[1] - p[0] ** 2) ** 2


def _optimize(tx, target, steps=10000):
  params, _, objective = target()

  @jax.jit
  def run(params):
    def body(_, carry):
      params, state = carry
      updates, state = tx.update(jax.grad(objective)(params), state, params)
      return optax.apply_updates(params, updates), state
    return jax.lax.fori_loop(0, steps, body, (params, tx.init(params)))[0]
  return run(params)


@pytest.mark.parametrize("target", [_parabola, _rosenbrock])
@pytest.mark.parametrize("name", ["adamw_bf16", "adam_fp32_master"])
def test_optax_alias_test_optimization(name, target):
  """optax's alias_test.test_optimization for adamw (lr 0.1, the other defaults)."""
  kw = {"weight_decay": 1e-4} if name == "adam_fp32_master" else {}
  got = _optimize(getattr(oh, name)(1e-1, **kw), target)
  want = _optimize(optax.adamw(1e-1), target)
  _, final, _ = target()
  np.testing.assert_allclose(got, final, rtol=3e-2, atol=3e-2)  # optax's tolerance
  np.testing.assert_allclose(want, final, rtol=3e-2, atol=3e-2)
  if target is _parabola:  # Rosenbrock's valley spreads an ULP over 10k steps to ~1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _loss(params):
  return sum(jnp.sum((v - 0.3) ** 2 * (1.0 + jnp.arange(v.size).reshape(v.shape)))
             for v in jax.tree.leaves(params))


def _run(tx, steps=50):
  params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4),
            "b": jnp.ones(4, jnp.float32)}

  @jax.jit
  def run(params):
    def body(carry, _):
      params, state = carry
      updates, state = tx.update(jax.grad(_loss)(params), state, params)
      return (optax.apply_updates(params, updates), state), None
    return jax.lax.scan(body, (params, tx.init(params)), None, length=steps)[0][0]
  return run(params)


@functools.lru_cache(maxsize=None)
def _optax_run(option):
  return _run(optax.adamw(1e-2, **OPTIONS[option]))


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))


OPTIONS = {
    "defaults": {},
    "mask tree": {"weight_decay": 0.1, "mask": {"w": True, "b": False}},
    "mask callable": {"weight_decay": 0.1,
                      "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)},
    "eps_root": {"eps_root": 1e-2},
    "nesterov": {"nesterov": True},
    "all": {"weight_decay": 0.1, "nesterov": True, "eps_root": 1e-3,
            "mask": {"w": False, "b": True}},
}


@pytest.mark.parametrize("name,option", [(n, o) for n in ("adamw_bf16", "adam_fp32_master")
                                         for o in OPTIONS]
                         + [("adamw_bf16 flat", "mask tree")])
def test_fp32_params_follow_optax_adamw(name, option):
  kw = dict(OPTIONS[option])
  want = _optax_run(option)
  if name == "adam_fp32_master":
    kw.setdefault("weight_decay", 1e-4)
  factory = getattr(oh, name.split()[0])
  if name.endswith("flat"):
    kw["flat_state"] = True
  got = _run(factory(1e-2, **kw))
  assert _max_diff(got, want) <= 1e-5
  # the option matters: optax without it is far off
  if option != "defaults":
    assert _max_diff(_optax_run("defaults"), want) > 1e-3


@pytest.mark.parametrize("compensation,flat", default_or_slow(
    [("kahan", False), ("kahan", True), ("stochastic", False)], [("kahan", True)]))
def test_a_mask_keeps_the_kernel_bits(compensation, flat, monkeypatch):
  """bf16 params, a mask: the kernel (a call per weight-decay setting), in place and not,
  equals the composed XLA step."""
  params = {"w": jnp.linspace(-1.0, 1.0, 96, dtype=jnp.bfloat16).reshape(8, 12),
            "b": jnp.linspace(0.5, 1.5, 12, dtype=jnp.bfloat16)}
  grads = jax.tree.map(lambda p: (p * 0.25 + 0.01).astype(p.dtype), params)
  tx = oh.adamw_bf16(1e-2, weight_decay=0.5, mask={"w": True, "b": False},
                     compensation=compensation, flat_state=flat)
  state = tx.init(params)
  in_place = jax.jit(lambda g, s, p: oh.update_and_apply(tx, g, s, p))
  updates, _ = jax.jit(tx.update)(grads, state, params)
  text = jax.jit(tx.update).lower(grads, state, params).as_text()
  assert text.count("optax_half_adamw") >= (1 if flat else 2)  # the kernel steps both
  new_params, _ = in_place(grads, state, params)
  with monkeypatch.context() as m:
    m.setattr(_native, "available", lambda: False)
    composed, _ = jax.jit(tx.update)(grads, state, params)
  for k in params:
    np.testing.assert_array_equal(updates[k], composed[k])
    np.testing.assert_array_equal(new_params[k], optax.apply_updates(params, updates)[k])
  # the masked-out leaf took no decay: the same as weight_decay=0 there
  nodecay = oh.adamw_bf16(1e-2, weight_decay=0.0, compensation=compensation,
                          flat_state=flat)
  ref, _ = jax.jit(nodecay.update)(grads, nodecay.init(params), params)
  np.testing.assert_array_equal(updates["b"], ref["b"])
  assert not np.array_equal(updates["w"], ref["w"])


def test_eps_root_and_nesterov_step_in_xla_with_the_kernels_bits_otherwise():
  """Options the kernel lacks go to XLA; eps_root=0 and nesterov=False are the kernel's bits."""
  params = {"w": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.bfloat16)}
  grads = {"w": jnp.linspace(0.5, -0.5, 64, dtype=jnp.bfloat16)}
  for kw in ({"eps_root": 1e-8}, {"nesterov": True}):
    tx = oh.adamw_bf16(1e-3, **kw)
    text = jax.jit(tx.update).lower(grads, tx.init(params), params).as_text()
    assert "optax_half_adamw" not in text, kw
  tx = oh.adamw_bf16(1e-3)
  assert "optax_half_adamw" in jax.jit(tx.update).lower(grads, tx.init(params),
                                                        params).as_text()


def test_bad_eps_root_and_nesterov_are_refused():
  with pytest.raises(ValueError, match="eps_root must be >= 0"):
    oh.adamw_bf16(1e-3, eps_root=-1.0)
  with pytest.raises(TypeError, match="nesterov must be True or False"):
    oh.adam_fp32_master(1e-3, nesterov="yes")
