"""``adamw_bf16``'s TPU kernels (``optax_half._tpu``: a Pallas kernel per leaf) run in
Pallas's interpreter on CPU: the XLA step's bits, in place and through ``tx.update``.

What XLA:TPU makes of them (one pass over HBM, no copies) is asserted where libtpu is
installed, by tests/test_tpu_static.py (``make test-tpu-static``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import _native, _tpu
from optax_half.compensation import COMPENSATIONS
from conftest import bitwise_equal, jitted_step
from suite_helpers import default_or_slow

# Blocks of every kind (_tpu._block): one block; leading dimensions as rows; rows over
# two blocks, the last partial; a last dimension over WIDE in column blocks, the last
# partial; 1-D leaves over WIDE (one row, one block); a scalar.
SHAPES = [(64, 256), (2, 3, 4, 8), (1000, 96), (3, 8960), (6000,), (3, 7), ()]
STEPS = 3
HYPER = dict(learning_rate=1e-2, weight_decay=0.1)

CONFIGS = {
    "kahan": {},
    "stochastic": dict(compensation="stochastic", key=3),
    "none": dict(compensation="none"),
    "nearest moments, fp32 nu": dict(state_rounding="nearest", nu_dtype=jnp.float32),
    "mask": dict(mask=lambda p: {k: k != "p2" for k in p}),
}


def _params():
  rng = np.random.default_rng(0)
  # Weights near zero: some landings miss (docs/algorithms.md#landing-exactly).
  return {f"p{i}": jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16)
          for i, s in enumerate(SHAPES)}


def _grads(params, step, dtype):
  rng = np.random.default_rng(10 + step)
  return {k: jnp.asarray(rng.standard_normal(v.shape) * 0.1, dtype) for k, v in params.items()}


@pytest.mark.parametrize("name, in_place, grad_dtype", default_or_slow(
    [(n, i, g) for n in CONFIGS for i in (True, False) for g in ("bfloat16", "float32")],
    [("kahan", True, "bfloat16"), ("stochastic", False, "float32")]))
def test_tpu_kernels_step_with_the_xla_steps_bits(name, in_place, grad_dtype, monkeypatch):
  kwargs = CONFIGS[name]
  tx = oh.adamw_bf16(**HYPER, **kwargs)
  compensation = COMPENSATIONS[kwargs.get("compensation", "kahan")]
  params = _params()
  state = tx.init(params)
  assert _tpu.takes(compensation, params, params, state.inner_state)
  decays = [k != "p2" for k in params] if "mask" in kwargs else None
  hyper = (HYPER["learning_rate"], 0.9, 0.999, 1e-8, HYPER["weight_decay"])
  monkeypatch.setattr(_native, "available", lambda: False)  # the XLA step on CPU too
  xla = jitted_step(tx, in_place)  # the XLA step: the reference

  @jax.jit
  def kernels(p, s, g):
    out, s = _native._tpu_update(compensation, hyper, kwargs.get("state_rounding", "stochastic"),
                                 g, s, p, in_place, decays=decays, interpret=True)
    return (out if in_place else optax.apply_updates(p, out)), s
  want, got = (params, state), (params, state)
  for t in range(STEPS):
    g = _grads(params, t, jnp.dtype(grad_dtype))
    want, got = xla(*want, g), kernels(*got, g)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert bitwise_equal(a, b)
  moved = [not bitwise_equal(a, b) for a, b in zip(jax.tree.leaves(got[0]),
                                                   jax.tree.leaves(params))]
  assert all(moved[:-1])  # every leaf but the scalar, whose gradient may keep it


def test_tpu_kernels_take_only_what_they_step():
  """bf16 params with bf16 or fp32 gradients and moments, Kahan, stochastic or no
  compensation, leaves _tpu._block can block; anything else takes the XLA step."""
  params = _params()
  state = oh.adamw_bf16(1e-3).init(params).inner_state
  kahan = COMPENSATIONS["kahan"]
  assert _tpu.takes(kahan, params, params, state)
  for other in ("master", "split"):
    assert not _tpu.takes(COMPENSATIONS[other], params, params, state)
  half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  assert not _tpu.takes(kahan, half, half, oh.adamw_bf16(1e-3).init(half).inner_state)
  wide = {"w": jnp.zeros((4, 5000), jnp.bfloat16)}  # a last dimension no block holds
  assert not _tpu.takes(kahan, wide, wide, oh.adamw_bf16(1e-3).init(wide).inner_state)
  assert not _tpu.takes(kahan, params, {**params, "p0": params["p1"]}, state)


def test_tpu_kernels_only_where_the_step_is_compiled_for_a_tpu(monkeypatch):
  """On by default on the TPU backend only; OPTAX_HALF_TPU_KERNEL=1 also elsewhere (a
  deviceless compile for a TPU), 0 never; never for a differentiated step."""
  params = _params()
  monkeypatch.delenv("OPTAX_HALF_TPU_KERNEL", raising=False)
  assert _native.on_tpu(params) == (jax.default_backend() == "tpu")
  monkeypatch.setenv("OPTAX_HALF_TPU_KERNEL", "1")
  assert _native.on_tpu(params)
  seen = []
  jax.grad(lambda x: (seen.append(_native.on_tpu(params)), x)[1])(1.0)
  assert seen == [False]
  monkeypatch.setenv("OPTAX_HALF_TPU_KERNEL", "0")
  assert not _native.on_tpu(params)
