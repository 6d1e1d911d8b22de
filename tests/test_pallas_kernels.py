"""``adamw_bf16``'s Pallas kernels run in Pallas's interpreter on CPU: the XLA step's bits,
in place and through ``tx.update``. TPU (``optax_half._tpu``): a kernel per leaf in 2-D
blocks of its layout. GPU (``optax_half._gpu``, Triton): a kernel per leaf in 1-D blocks,
over the tree layout and over a flat state stepped where it lies.

The interpreter divides and takes square roots as the CPU does; the GPU kernels compiled
for a GPU spell out the IEEE instructions for both (``div.rn.f32``, ``sqrt.rn.f32``). What
the compilers make of the kernels (one pass over memory, no copies, no approximate
instruction) is asserted where libtpu or the CUDA plugin is installed, by
tests/test_tpu_static.py and tests/test_gpu_static.py (``make test-tpu-static``,
``make test-gpu-static``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import _gpu, _native, _tpu
from optax_half.compensation import COMPENSATIONS
from conftest import bitwise_equal, jitted_step
from suite_helpers import default_or_slow

# TPU: blocks of every kind (_tpu._block): one block; leading dimensions as rows; rows over
# two blocks, the last partial; a last dimension over WIDE in column blocks, the last
# partial; 1-D leaves over WIDE (one row, one block); a scalar. GPU: a leaf over three
# blocks, the last partial; leaves of one partial block; a leaf of exactly one block; a
# scalar.
SHAPES = {"tpu": [(64, 256), (2, 3, 4, 8), (1000, 96), (3, 8960), (6000,), (3, 7), ()],
          "gpu": [(3, 1000), (2, 3, 4, 8), (_gpu.BLOCK,), (64, 33), (3, 7), ()]}
MODULES = {"tpu": _tpu, "gpu": _gpu}
STEPS = 3
HYPER = dict(learning_rate=1e-2, weight_decay=0.1)
HYPER_TUPLE = (HYPER["learning_rate"], 0.9, 0.999, 1e-8, HYPER["weight_decay"])

CONFIGS = {
    "kahan": {},
    "stochastic": dict(compensation="stochastic", key=3),
    "none": dict(compensation="none"),
    "split": dict(compensation="split"),
    "nearest moments, fp32 nu": dict(state_rounding="nearest", nu_dtype=jnp.float32),
    "mask": dict(mask=lambda p: {k: k != "p2" for k in p}),
}


def _params(backend):
  rng = np.random.default_rng(0)
  # Weights near zero: some landings miss (docs/algorithms.md#landing-exactly).
  return {f"p{i}": jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16)
          for i, s in enumerate(SHAPES[backend])}


def _grads(params, step, dtype):
  rng = np.random.default_rng(10 + step)
  return {k: jnp.asarray(rng.standard_normal(v.shape) * 0.1, dtype) for k, v in params.items()}


def _step(layout, compensation, kwargs, in_place, decays):
  """The kernels' jitted step (params, state, grads) -> (params, state), in the
  interpreter: ``layout`` "tpu", "gpu", or "gpu flat" (a flat state)."""
  rounding = kwargs.get("state_rounding", "stochastic")

  @jax.jit
  def kernels(p, s, g):
    if layout == "gpu flat":
      out, s = _native._gpu_flat_update(compensation, HYPER_TUPLE, rounding, g, s, p,
                                        in_place, interpret=True)
    else:
      update = _native._tpu_update if layout == "tpu" else _native._gpu_update
      out, s = update(compensation, HYPER_TUPLE, rounding, g, s, p, in_place, decays=decays,
                      interpret=True)
    return (out if in_place else optax.apply_updates(p, out)), s
  return kernels


# Every layout and configuration in place with bf16 gradients; through tx.update the
# compensations; fp32 gradients (read in the kernels as given) on a few: CI's slow run short.
LAYOUTS = ("tpu", "gpu", "gpu flat")
CASES = [(b, n, True, "bfloat16") for b in LAYOUTS for n in CONFIGS
         # a flat state with a mask: the tree step; split: not on TPU
         if not (b == "gpu flat" and n == "mask") and not (b == "tpu" and n == "split")] + [
    (b, n, False, "bfloat16") for b in LAYOUTS for n in ("kahan", "stochastic")] + [
    ("gpu", "split", False, "bfloat16"), ("gpu", "kahan", False, "float32"),
    ("gpu", "stochastic", False, "float32"), ("tpu", "stochastic", False, "float32")]


@pytest.mark.parametrize("layout, name, in_place, grad_dtype", default_or_slow(CASES, [
    ("tpu", "kahan", True, "bfloat16"), ("gpu", "stochastic", False, "float32"),
    ("gpu flat", "kahan", True, "bfloat16"), ("gpu flat", "stochastic", False, "bfloat16")]))
def test_kernels_step_with_the_xla_steps_bits(layout, name, in_place, grad_dtype, monkeypatch):
  """Over STEPS steps, params and the whole state equal the XLA step's on CPU bit for bit
  (a flat state: the tree steps XLA takes on it, unpacked and packed again; the kernels
  read and write each leaf's slice of the flat arrays, masked to the leaf)."""
  kwargs = CONFIGS[name]
  backend = layout.split()[0]
  tx = oh.adamw_bf16(**HYPER, **kwargs, flat_state=layout == "gpu flat")
  compensation = COMPENSATIONS[kwargs.get("compensation", "kahan")]
  params = _params(backend)
  assert MODULES[backend].takes(compensation, params, params,
                                oh.adamw_bf16(**HYPER, **kwargs).init(params).inner_state)
  decays = [k != "p2" for k in params] if "mask" in kwargs else None
  monkeypatch.setattr(_native, "available", lambda: False)  # the XLA step on CPU too
  xla, kernels = jitted_step(tx, in_place), _step(layout, compensation, kwargs, in_place, decays)
  state = tx.init(params)
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


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernels_take_only_what_they_step(backend):
  """bf16 params with bf16 or fp32 gradients and moments, Kahan, stochastic or no
  compensation (GPU: split too; TPU: leaves _tpu._block can block); anything else takes
  the XLA step."""
  takes = MODULES[backend].takes
  params = _params(backend)
  state = oh.adamw_bf16(1e-3).init(params).inner_state
  kahan = COMPENSATIONS["kahan"]
  assert takes(kahan, params, params, state)
  assert not takes(COMPENSATIONS["master"], params, params, state)
  assert takes(COMPENSATIONS["split"], params, params, state) == (backend == "gpu")
  half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  assert not takes(kahan, half, half, oh.adamw_bf16(1e-3).init(half).inner_state)
  wide = {"w": jnp.zeros((4, 5000), jnp.bfloat16)}  # a last dimension no TPU block holds
  assert takes(kahan, wide, wide, oh.adamw_bf16(1e-3).init(wide).inner_state) == (
      backend == "gpu")
  assert not takes(kahan, params, {**params, "p0": params["p1"]}, state)
  if backend == "gpu":  # a program's start is an int32 index into a leaf or flat array
    def abstract(**sizes):
      tree = {k: jax.ShapeDtypeStruct((n,), jnp.bfloat16) for k, n in sizes.items()}
      return tree, jax.eval_shape(oh.adamw_bf16(1e-3).init, tree).inner_state
    each = _gpu.MAX_ELEMENTS // 2 + 1
    two, two_state = abstract(a=each, b=each)
    assert takes(kahan, two, two, two_state)
    assert not takes(kahan, two, two, two_state, flat=True)
    one, one_state = abstract(w=_gpu.MAX_ELEMENTS)
    assert not takes(kahan, one, one, one_state)


@pytest.mark.parametrize("backend, variable", [("tpu", "OPTAX_HALF_TPU_KERNEL"),
                                               ("gpu", "OPTAX_HALF_GPU_KERNEL")])
def test_kernels_only_where_the_step_is_compiled_for_their_backend(backend, variable,
                                                                   monkeypatch):
  """On by default on their backend only; the variable at 1 also elsewhere (a deviceless
  compile), 0 never; never for a differentiated step."""
  on = getattr(_native, f"on_{backend}")
  params = _params(backend)
  monkeypatch.delenv(variable, raising=False)
  assert on(params) == (jax.default_backend() == backend)
  monkeypatch.setenv(variable, "1")
  assert on(params)
  seen = []
  jax.grad(lambda x: (seen.append(on(params)), x)[1])(1.0)
  assert seen == [False]
  monkeypatch.setenv(variable, "0")
  assert not on(params)


def _kernels_in(tx, in_place, params) -> int:
  """The ``pallas_call``s in the jaxpr of ``tx``'s step (every platform's branch)."""
  step = jitted_step(tx, in_place)
  return str(jax.make_jaxpr(step)(params, tx.init(params), params)).count("pallas_call")


@pytest.mark.parametrize("backend, variable", [("tpu", "OPTAX_HALF_TPU_KERNEL"),
                                               ("gpu", "OPTAX_HALF_GPU_KERNEL")])
def test_steps_the_kernels_lack_are_xlas(backend, variable, monkeypatch):
  """A step is built with a branch of kernels, a leaf each, for the compensations they
  step; Nesterov, ``eps_root`` and a master are XLA's alone, ``split`` on a TPU too. On a GPU,
  through ``tx.update`` only a flat state takes them (docs/algorithms.md#pallas-kernels)."""
  monkeypatch.setenv(variable, "1")
  params = {"w": jnp.zeros((16, 128), jnp.bfloat16), "b": jnp.zeros((128,), jnp.bfloat16)}
  n = len(params)
  assert _kernels_in(oh.adamw_bf16(1e-3), True, params) == n
  assert _kernels_in(oh.adamw_bf16(1e-3), False, params) == (n if backend == "tpu" else 0)
  assert _kernels_in(oh.adamw_bf16(1e-3, flat_state=True), False, params) == n
  for lacking in (dict(nesterov=True), dict(eps_root=1e-8)):
    assert _kernels_in(oh.adamw_bf16(1e-3, **lacking), True, params) == 0, lacking
    assert _kernels_in(oh.adamw_bf16(1e-3, **lacking, flat_state=True), True, params) == 0
  split = oh.adamw_bf16(1e-3, compensation="split")  # its int16 low half: the GPU's only
  assert _kernels_in(split, True, params) == (n if backend == "gpu" else 0)
  assert _kernels_in(oh.adam_fp32_master(1e-3), True, params) == 0
