"""The native CPU kernel (optax_half_native) against the framework code it replaces.

torch: ``LowPrecisionAdamW`` with ``fused=None`` (the kernel, the default on
CPU) equals ``fused=False`` (the eager per-tensor reference) bit for bit in
params and every state tensor, for every compensation, moment dtype and
rounding, bf16 and fp32 params, bf16 and fp32 gradients, sizes that split
over threads. JAX: ``adamw_bf16`` / ``adam_fp32_master`` with the kernel (one
XLA custom call per group of leaves sharing their dtypes) equal the composed
transformations bit for bit, jitted and op by op. (JAX vs torch with the kernel on both sides: test_parity.)

The JAX matrices run in part in ``make test`` (cases that together take every
path of the kernel and of _native; each says why) and whole with ``make
test-slow`` (marker ``slow``), as CI does.
"""

import itertools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_half as oh
from optax_half import _native as jax_native
import optax_half_native as native_lib

torch = pytest.importorskip("torch")
import torch_bridge as tb  # noqa: E402
from torch_bridge import _native as torch_native  # noqa: E402
from suite_helpers import default_or_slow  # noqa: E402
from conftest import assert_same_torch_runs, jitted_step  # noqa: E402

# The JAX kernel is lowered only where JAX's default backend is the CPU
# (_native.on_cpu); elsewhere these tests would compare the composed
# transformation with itself, or look for custom calls that are not there.
jax_kernel = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the JAX kernel runs where JAX's default backend is the CPU")

# 3 * 2^16 + 5 elements: split over two threads at an odd boundary.
SHAPES = {"big": (3 * 2**16 + 5,), "mat": (37, 29), "vec": (1000,), "scalar": (), "empty": (3, 0)}
STEPS = 4


def _values(seed, shape, scale):
  return np.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, np.float32)




def _same_bits(a, b, what=None):
  """Two lists of arrays (tree leaves): the same dtypes, shapes and bytes."""
  assert len(a) == len(b), what
  for x, y in zip(a, b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), what


def test_the_kernels_build_here():
  assert torch_native.available(), __import__("optax_half_native").build_errors
  assert jax_native.available(), __import__("optax_half_native").build_errors


TORCH_CONFIGS = [
    dict(compensation=c, state_rounding=r, mu_dtype=m, nu_dtype=v)
    for c, r, (m, v) in itertools.product(
        ["kahan", "split", "stochastic", "none"], ["stochastic", "nearest"],
        [(None, None), (torch.float32, None), (None, torch.float32),
         (torch.float32, torch.float32)])]


def _torch_run(make, fused, fp32_leaves=(), loss_scale=False, low=torch.bfloat16):
  """STEPS steps of ``make(params, fused)``: the kernel (``fused=None``) on
  torch's threads, which it splits the big leaf over, the eager reference
  (``fused=False``) on one thread. Its ops are elementwise, their bits those
  of any number of threads, and hundreds of them a step: on cores that
  pytest-xdist's other worker keeps busy, each op's threads would wait (and
  spin) for one of them that is not running."""
  threads = torch.get_num_threads()
  if fused is False:
    torch.set_num_threads(1)
  try:
    return _torch_steps(make, fused, fp32_leaves, loss_scale, low)
  finally:
    torch.set_num_threads(threads)


def _torch_steps(make, fused, fp32_leaves, loss_scale, low):
  params = [torch.nn.Parameter(torch.from_numpy(_values(i, s, 0.5)).to(
      torch.float32 if k in fp32_leaves else low))
            for i, (k, s) in enumerate(SHAPES.items())]
  opt = make(params, fused)
  scaler = tb.dynamic_loss_scale(init_scale=2.0**8) if loss_scale else None
  for t in range(STEPS):
    grads = [torch.from_numpy(_values(100 * t + i, s, 0.1)) for i, s in enumerate(SHAPES.values())]
    if scaler is None:
      for p, g in zip(params, grads):
        p.grad = g.to(p.dtype)
      opt.step()
    else:  # the scaler hands the step fp32 gradients of the bf16 params
      loss = sum((p.float() * g).sum() for p, g in zip(params, grads))
      opt.zero_grad()
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
  return params, opt


@pytest.mark.parametrize("config", TORCH_CONFIGS,
                         ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c.values()))
def test_torch_kernel_equals_the_eager_step(config):
  def make(params, fused):
    return tb.adamw_bf16(params, 1e-2, key=11, fused=fused, **config)
  for fp32_leaves in ((), ("mat", "scalar")):
    assert_same_torch_runs(_torch_run(make, None, fp32_leaves), _torch_run(make, False, fp32_leaves))


@pytest.mark.parametrize("name", ["adam_fp32_master", "scale_by_adamw", "adamw_bf16 + scaler",
                                  "adam_fp32_master + scaler"])
def test_torch_kernel_equals_the_eager_step_named(name):
  factory = {"adam_fp32_master": lambda ps, fused: tb.adam_fp32_master(
                 ps, 1e-2, weight_decay=0.1, fused=fused),
             "scale_by_adamw": lambda ps, fused: tb.scale_by_adamw(
                 ps, 1e-2, weight_decay=0.1, state_rounding="stochastic", key=3, fused=fused)}
  make = factory.get(name.split(" ")[0], lambda ps, fused: tb.adamw_bf16(ps, 1e-2, fused=fused))
  scaled = name.endswith("scaler")
  assert_same_torch_runs(_torch_run(make, None, ("scalar",), scaled),
                      _torch_run(make, False, ("scalar",), scaled))


@pytest.fixture
def torch_f16():
  """Skips where torch's kernel library has no fp16 entry points (no F16C)."""
  if not native_lib.has_f16(native_lib.library()):
    pytest.skip("torch's kernel has fp16 params where the CPU has F16C")


@pytest.fixture
def jax_f16():
  """Skips where JAX's kernel library (the FFI one) has no fp16 params (no F16C)."""
  if not jax_native.has_f16():
    pytest.skip("JAX's kernel has fp16 params where the CPU has F16C")


@pytest.mark.usefixtures("torch_f16")
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaler"])
def test_torch_kernel_steps_fp16_params_of_adam_fp32_master_as_the_eager_step(scaled,
                                                                             monkeypatch):
  """fp16 params (fp32 leaves among them) with fp32 master and moments, fp16
  gradients, with and without the loss scaler: the kernel's bits are the
  eager step's, and the eager step does not run."""
  def make(ps, fused):
    return tb.adam_fp32_master(ps, 1e-2, weight_decay=0.1, fused=fused)
  assert_same_torch_runs(_torch_run(make, None, ("scalar",), scaled, low=torch.float16),
                      _torch_run(make, False, ("scalar",), scaled, low=torch.float16))
  _assert_the_kernel_steps_an_fp16_param(make, monkeypatch)


def _assert_the_kernel_steps_an_fp16_param(make, monkeypatch):
  """One step of ``make([p], None)`` on an fp16 param moves it, and the eager step does not run."""
  from torch_bridge import adam  # noqa: PLC0415
  calls = []
  monkeypatch.setattr(adam, "adamw_step", lambda *a, **k: calls.append(1))
  p = torch.nn.Parameter(torch.ones(5, dtype=torch.float16))
  opt = make([p], None)
  p.grad = torch.ones_like(p)
  opt.step()
  assert calls == [] and float(p.detach()[0]) != 1.0


@pytest.mark.usefixtures("torch_f16")
@pytest.mark.parametrize("config", TORCH_CONFIGS,
                         ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c.values()))
def test_torch_kernel_steps_fp16_params_of_adamw_bf16_as_the_eager_step(config, monkeypatch):
  """fp16 params (an fp32 leaf among them) of adamw_bf16 in every
  compensation, moment dtype (fp16 or fp32) and moment rounding: the
  kernel's bits are the eager step's (fp16 stochastic rounding included),
  and the eager step does not run for them."""
  def make(params, fused):
    return tb.adamw_bf16(params, 1e-2, key=11, fused=fused, **config)
  assert_same_torch_runs(_torch_run(make, None, ("scalar",), low=torch.float16),
                      _torch_run(make, False, ("scalar",), low=torch.float16))
  _assert_the_kernel_steps_an_fp16_param(make, monkeypatch)


_F16_SPECIAL = {
    "adam_fp32_master": lambda ps, fused: tb.adam_fp32_master(ps, 1e-4, fused=fused),
    **{f"adamw_bf16 {c} {r} moments {m}": (
        lambda ps, fused, c=c, r=r, m=m: tb.adamw_bf16(
            ps, 1e-4, key=5, compensation=c, state_rounding=r, fused=fused,
            mu_dtype=None if m == "fp16" else torch.float32))
       for c in ("kahan", "split", "stochastic", "none") for r in ("stochastic", "nearest")
       for m in ("fp16", "fp32")},
}


@pytest.mark.usefixtures("torch_f16")
@pytest.mark.parametrize("name", list(_F16_SPECIAL))
def test_torch_kernel_rounds_fp16_params_subnormals_and_nans_as_the_eager_step(name):
  """fp16 params whose values cross the fp16 subnormal range (6e-8 .. 6e-5)
  and the largest finite values, with NaN gradients at one step (fp16
  moments, Kahan buffers and stochastic roundings reach subnormals too): the
  kernel's params and state equal the eager step's bit for bit, in the wide
  lanes and the tail (4099 elements), a NaN's payload aside
  (``_same_but_nan_bits``: in the tail torch's eager ops wrote 0x7FFFFFFF
  where the kernel's scalar loop carried the gradient's 0x7FC00000)."""
  n = 4099
  w = np.concatenate([_log_uniform(1, n - 3, -9, -3), np.float32([65500.0, -65500.0, 1e-8])])
  grads = [_log_uniform(2 + t, n, -9, 1) for t in range(3)]
  grads[1][[5, 40, 4097]] = np.nan
  runs = []
  for fused in (None, False):
    p = torch.nn.Parameter(torch.from_numpy(w).to(torch.float16))
    opt = _F16_SPECIAL[name]([p], fused)
    for g in grads:
      p.grad = torch.from_numpy(g).to(torch.float16)
      opt.step()
    runs.append([p.detach()] + [v for k, v in opt.state[p].items() if k != "step"])
  for a, b in zip(*runs):
    _same_but_nan_bits(a.numpy(), b.numpy(), a.dtype)
  bits = runs[0][0].numpy().view(np.uint16)
  assert ((bits & 0x7C00) == 0).sum() > ((bits & 0x7FFF) == 0).sum()  # subnormals reached
  assert np.isnan(runs[0][0].numpy()).sum() == 3


def test_torch_kernel_is_used_and_the_eager_step_is_not(monkeypatch):
  from torch_bridge import adam  # noqa: PLC0415
  calls = []
  monkeypatch.setattr(adam, "adamw_step", lambda *a, **k: calls.append(1))
  params = [torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16)),
            torch.nn.Parameter(torch.ones(2, 4, dtype=torch.bfloat16).t())]  # not contiguous
  opt = tb.adamw_bf16(params, 1e-2)
  for p in params:
    p.grad = torch.ones_like(p)
  opt.step()
  assert calls == [1]  # the non-contiguous param only
  assert int(opt.state[params[0]]["step"]) == 1 and not torch.equal(
      opt.state[params[0]]["mu"], torch.zeros(5, dtype=torch.bfloat16))


# -- JAX -------------------------------------------------------------------------

JAX_CONFIGS = {
    **{f"{c}-{r}-{m}": (lambda c=c, r=r, m=m: oh.adamw_bf16(
        1e-2, compensation=c, state_rounding=r, key=11,
        mu_dtype=None if m == "param" else jnp.float32,
        nu_dtype=None if m == "param" else jnp.float32))
       for c, r, m in itertools.product(["kahan", "split", "stochastic", "none"],
                                        ["stochastic", "nearest"], ["param", "fp32"])
       if (r, m) != ("nearest", "fp32")},  # the step of stochastic-fp32: test_fp32_moments_...
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-2, weight_decay=0.1),
    "adam_fp32_master wd=0": lambda: oh.adam_fp32_master(1e-2),
    "schedule": lambda: oh.adamw_bf16(optax.linear_schedule(1e-2, 1e-3, STEPS)),
    "key": lambda: oh.adamw_bf16(1e-2, compensation="stochastic", key=jax.random.key(5)),
}


def _jax_run(make, fp32_leaves=(), jit=True, in_place=False, nan_step=None, grad_scale=1.0,
             nan_leaf="vec", low=jnp.bfloat16, grad_dtype=None):
  """STEPS steps: tx.update + optax.apply_updates, or (``in_place``)
  ``oh.update_and_apply``. ``jit``: True jits tx.update (the in-place step:
  the whole step), "step" the whole step, both with the params and state
  donated; False runs op by op. ``nan_step``: that step's gradients hold a NaN
  (in ``nan_leaf``).
  ``grad_scale``: the gradients' values are multiplied by it (a loss scale).
  ``low``: the dtype of the params not in ``fp32_leaves``; ``grad_dtype``: the
  gradients' (default: their param's)."""
  params = {k: jnp.asarray(_values(i, s, 0.5)).astype(
      jnp.float32 if k in fp32_leaves else low) for i, (k, s) in enumerate(SHAPES.items())}
  tx = make()
  state = tx.init(params)
  update = jax.jit(tx.update) if jit is True else tx.update

  def step(params, state, grads):
    if in_place:
      return oh.update_and_apply(tx, grads, state, params)
    u, state = update(grads, state, params)
    return optax.apply_updates(params, u), state

  if (in_place and jit) or jit == "step":
    step = jax.jit(step, donate_argnums=(0, 1))
  for t in range(STEPS):
    grads = {k: jnp.asarray(_values(100 * t + i, s, 0.1 * grad_scale)).astype(
        grad_dtype or params[k].dtype)
             for i, (k, s) in enumerate(SHAPES.items())}
    if t == nan_step:
      grads[nan_leaf] = grads[nan_leaf].at[3].set(jnp.nan)
    params, state = step(params, state, grads)
  return jax.tree.leaves((params, state))


# The tree of the JAX runs: the fp32 leaf "mat" (the kernel's mode "update";
# 1073 elements, wide lanes and a one-element tail) among bf16 leaves (one
# split over threads, a vector, a scalar, an empty one): two dtype groups, the
# bf16 leaves at indices that are not consecutive (their random keys).
MIXED = ("mat",)

# One configuration per compensation (each its own kernel mode, fp32 leaves
# "update"), with bf16 moments written stochastically (kahan, none) and to
# nearest (split), fp32 moments (stochastic; adam_fp32_master): every mode and
# moment path of _native. The others take the same paths in another
# combination, or differ only before the step (the schedule, a key, wd=0):
# make test-slow.
JAX_DEFAULT = ("kahan-stochastic-param", "split-nearest-param", "stochastic-stochastic-fp32",
               "none-stochastic-param", "adam_fp32_master")


@pytest.mark.parametrize("name", default_or_slow(list(JAX_CONFIGS), JAX_DEFAULT))
def test_jax_kernel_and_the_in_place_step_equal_the_composed_transformation(name, monkeypatch):
  """With the kernel, ``tx.update`` (jitted, and op by op) and the in-place
  step (``oh.update_and_apply``, the whole step jitted with the params and the
  state donated) give the bits of the composed transformation's ``tx.update``
  + ``optax.apply_updates``, params and every state leaf, bf16 and fp32 leaves
  mixed. Each composed run is the reference of both checks that run that way.
  Op by op only in make test's cases: every mode runs there, and op by op
  differs from jitted in how the ops are dispatched, which no configuration
  changes. (Off CPU there is no kernel; the in-place step is still checked.)"""
  make = JAX_CONFIGS[name]
  assert oh._in_place.step_of(make()) is not None  # the in-place step, not the fallback
  for jit in (True, False) if name in JAX_DEFAULT else (True,):
    with monkeypatch.context() as m:
      m.setattr(jax_native, "available", lambda: False)
      composed = _jax_run(make, MIXED, jit)
      # (the composed in-place step: a master's lands on its rounding)
      composed_in_place = _jax_run(make, MIXED, in_place=True) if jit else None
    if jax.default_backend() == "cpu":  # elsewhere the composed transformation again
      _same_bits(_jax_run(make, MIXED, jit), composed, f"tx.update, jit={jit}")
    if jit:
      _same_bits(_jax_run(make, MIXED, in_place=True), composed_in_place, "update_and_apply")


def test_jax_kernel_master_misses_in_the_lanes_as_the_composed_transformation(monkeypatch):
  """``adam_fp32_master`` through ``tx.update`` where many lanes of a block miss
  their landing: weights pushed from 1 to 2^-20 (a far miss: the param lands
  on 0, then on its target), weights near 0 pushed across it, NaN and Inf
  params, beside lanes that land. Three steps of the kernel's lanes (three
  blocks of 16 or six of 8) give the composed transformation's bits, bf16 and
  fp16: params, master and the missed marks (the write's and the read
  check's, both hashed in the lanes)."""
  lr = 1.0 - 2.0**-20  # Adam's first step is -lr * sign(g): from 1 to 2^-20
  n = 48
  kind = np.arange(n) % 4
  p0 = np.select([kind == 0, kind == 1, kind == 2], [1.0, 1e-3, -2.0], 0.5).astype(np.float32)
  p0[[5, 17, 30]] = [np.nan, np.inf, -np.inf]
  rng = np.random.default_rng(3)
  grads = [np.where(kind == 2, -1.0, 1.0), rng.standard_normal(n), np.zeros(n)]

  def run():
    params = {"w": jnp.asarray(p0, jnp.bfloat16), "h": jnp.asarray(p0, jnp.float16)}
    tx = oh.adam_fp32_master(lr)
    state = tx.init(params)
    update = jax.jit(tx.update)
    missed = []
    for g in grads:
      u, state = update({k: jnp.asarray(g, v.dtype) for k, v in params.items()}, state, params)
      params = optax.apply_updates(params, u)
      missed.append(int(state.missed["w"]))
    return jax.tree.leaves((params, state)), missed

  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed, _ = run()
  kernel, missed = run()
  assert missed[0] != 0  # the first step missed, and the marks say where
  # NaN sign and payload are outside the bit-exact claim (docs/algorithms.md#bit-exactness):
  # the kernel writes 0x7FC0 where XLA's cast keeps inf - inf's sign.
  for a, b in zip(kernel, composed):
    a, b = np.array(a), np.array(b)
    nan = np.isnan(a.astype(np.float32))
    assert np.array_equal(nan, np.isnan(b.astype(np.float32)))
    a[nan], b[nan] = 0, 0
    _same_bits([a], [b])


@pytest.mark.parametrize("low", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)],
                         ids=["bf16", "fp16"])  # fp16: for JAX_F16_ADAMW, whose cases are slow
def test_fp32_moments_ignore_state_rounding(low, monkeypatch):
  """With both moments fp32 nothing is rounded: ``state_rounding="nearest"``
  lowers to the very step of ``"stochastic"``, with the kernel and without,
  for bf16 and fp16 params (fp32 leaves among them), in every compensation.
  So the configurations above have no X-nearest-fp32 of their own: it would
  compile and run X-stochastic-fp32's program again."""
  params = {k: jnp.zeros(s, jnp.float32 if k in MIXED else low) for k, s in SHAPES.items()}

  def lowered(compensation, state_rounding):
    tx = oh.adamw_bf16(1e-2, compensation=compensation, state_rounding=state_rounding, key=11,
                       mu_dtype=jnp.float32, nu_dtype=jnp.float32)

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    state = jax.eval_shape(tx.init, params)
    return jax.jit(step).lower(params, state, params).as_text(debug_info=False)

  for kernel in (True, False):
    with monkeypatch.context() as m:
      if not kernel:
        m.setattr(jax_native, "available", lambda: False)
      for compensation in ("kahan", "split", "stochastic", "none"):
        text = lowered(compensation, "stochastic")
        assert (jax_native.TARGET in text) == (
            kernel and jax.default_backend() == "cpu" and (low == jnp.bfloat16
                                                           or jax_native.has_f16()))
        assert text == lowered(compensation, "nearest"), (kernel, compensation)


# Kahan's moments and stochastic's params draw their random bits with the
# same per-leaf keys (_native._keys): the second in make test-slow.
@jax_kernel
@pytest.mark.parametrize("compensation", default_or_slow(["kahan", "stochastic"], ["kahan"]))
def test_jax_kernel_over_calls_of_many_leaves_equals_the_composed_transformation(
    compensation, monkeypatch):
  """40 leaves (bf16 and fp32 mixed, so two dtype groups, the 36 bf16 ones over
  a call of _LEAVES_PER_CALL leaves and a second): every leaf keeps its own
  random keys (its index among the leaves), in place and through tx.update.
  (XLA's compile of the composed step grows with its leaves: no more than
  the second call takes.)"""
  assert jax_native._LEAVES_PER_CALL == 32
  shapes = [(i % 7 + 1, 3 + i % 5) for i in range(40)]
  dtypes = [jnp.float32 if i % 9 == 4 else jnp.bfloat16 for i in range(40)]
  # Converted by NumPy (round to nearest even, as XLA): eager converts of 35
  # shapes would compile an op each.
  params = {f"w{i:02d}": jnp.asarray(_values(i, s, 0.5).astype(d))
            for i, (s, d) in enumerate(zip(shapes, dtypes))}
  grads = [{k: jnp.asarray(_values(100 * t + i, v.shape, 0.1).astype(v.dtype))
            for i, (k, v) in enumerate(params.items())} for t in range(2)]
  state = jax.jit(oh.adamw_bf16(1e-2, compensation=compensation).init)(params)

  def run(in_place):
    tx = oh.adamw_bf16(1e-2, compensation=compensation)

    step = jitted_step(tx, in_place)  # once per run, not per step

    p, s = params, state
    if in_place and jax_native.available():  # 32 + 4 bf16 leaves, 4 fp32 ones
      assert step.lower(p, s, grads[0]).as_text().count(jax_native.TARGET) == 3
    for g in grads:
      p, s = step(p, s, g)
    return jax.tree.leaves((p, s))

  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed = {False: run(False)}
    # The composed in-place step has tx.update's bits but for a master (split's).
    composed[True] = run(True) if compensation == "split" else composed[False]
  for in_place in (False, True):
    _same_bits(run(in_place), composed[in_place], in_place)


def _custom_calls(tx, params):
  """The kernel's custom calls in ``jax.jit(tx.update)`` lowered for ``params``
  (gradients alike). The state is only traced: an eager ``tx.init`` compiles
  its ops for every new leaf shape."""
  state = jax.eval_shape(tx.init, params)
  return jax.jit(tx.update).lower(params, state, params).as_text().count(jax_native.TARGET)


@jax_kernel
def test_jax_kernel_is_one_custom_call_per_dtype_group_where_it_applies():
  """The leaves that share their dtypes go into one call: the bf16 leaves
  "a" and "c" in one, the fp32 leaf "b" in another; 40 bf16 leaves in two
  (at most _LEAVES_PER_CALL = 32 a call)."""
  tree = {"a": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.ones(5), "c": jnp.ones((), jnp.bfloat16)}
  assert _custom_calls(oh.adamw_bf16(1e-3), tree) == 2
  assert _custom_calls(oh.adam_fp32_master(1e-3, skip_nonfinite=True), tree) == 2
  assert _custom_calls(oh.dynamic_loss_scale(oh.adamw_bf16(1e-3)), tree) == 2
  many = {f"w{i}": jnp.ones((i + 1,), jnp.bfloat16) for i in range(40)}
  assert jax_native._LEAVES_PER_CALL == 32
  assert _custom_calls(oh.adamw_bf16(1e-3), many) == 2
  assert _custom_calls(oh.adamw_bf16(1e-3), dict(list(many.items())[:32])) == 1
  # Gradients of two dtypes (the bf16 params' grads in bf16 and fp32): two groups.
  state = jax.eval_shape(oh.adamw_bf16(1e-3).init, many)
  grads = {k: v.astype(jnp.float32) if k in ("w3", "w7") else v for k, v in many.items()}
  text = jax.jit(oh.adamw_bf16(1e-3).update).lower(grads, state, many).as_text()
  assert text.count(jax_native.TARGET) == 3  # 38 leaves in two calls, 2 in one
  # fp16 leaves: a third group where the kernel has fp16, else the composed
  # transformation for the whole tree, as for integer leaves and moments of
  # another dtype (fp16 moments of bf16 params).
  with_f16 = {**tree, "h": jnp.ones(3, jnp.float16)}
  assert _custom_calls(oh.adamw_bf16(1e-3), with_f16) == (3 if jax_native.has_f16() else 0)
  assert _custom_calls(oh.adamw_bf16(1e-3), {**tree, "i": jnp.ones(3, jnp.int32)}) == 0
  assert _custom_calls(oh.adamw_bf16(1e-3, mu_dtype=jnp.float16), tree) == 0
  assert _custom_calls(oh.scale_by_adamw(1e-3), tree) == 0  # the bare core stays framework code


# The optimizers whose fp16 params take the kernel's mode "master" (fp32
# master and moments): adam_fp32_master, and adamw_bf16's split with fp32
# moments (master_weights(split=True) keeps a full fp32 master of fp16 params).
JAX_F16_CONFIGS = {
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-2, weight_decay=0.1),
    "adamw_bf16 split fp32-moments": lambda: oh.adamw_bf16(
        1e-2, compensation="split", mu_dtype=jnp.float32, nu_dtype=jnp.float32, key=5),
}


# Both optimizers step fp16 params in the same mode with the same buffers
# (only the composed transformation around the kernel differs): make test
# runs each pair of (optimizer, loss scale, gradient dtype) values once, make
# test-slow the other combinations.
_F16_MASTER_CASES = [(name, scaled, grads) for name in JAX_F16_CONFIGS
                     for scaled in ("plain", "dynamic_loss_scale") for grads in ("fp16", "fp32")]
_F16_MASTER_DEFAULT = [("adam_fp32_master", "plain", "fp16"),
                       ("adam_fp32_master", "dynamic_loss_scale", "fp32"),
                       ("adamw_bf16 split fp32-moments", "plain", "fp32")]


@jax_kernel
@pytest.mark.usefixtures("jax_f16")
@pytest.mark.parametrize("name, scaled, grads",
                         default_or_slow(_F16_MASTER_CASES, _F16_MASTER_DEFAULT))
def test_jax_kernel_steps_fp16_params_in_master_mode_as_the_composed_transformation(
    name, scaled, grads, monkeypatch):
  """fp16 params (fp32 leaves among them) with fp32 master and moments, fp16
  or fp32 gradients, alone and in dynamic_loss_scale (the kernel unscales
  the gradients as it reads them), with a NaN step: the kernel's bits,
  through tx.update and in place, are the composed transformation's (one run
  of tx.update + apply_updates, the reference of both), and the kernel runs
  (one call per dtype group)."""
  loss_scaled = scaled == "dynamic_loss_scale"

  def make():
    tx = JAX_F16_CONFIGS[name]()
    return oh.dynamic_loss_scale(tx, init_scale=3000.0) if loss_scaled else tx

  def run(in_place=False):
    return _jax_run(make, ("mat",), jit="step", in_place=in_place,
                    nan_step=2 if loss_scaled else None,
                    grad_scale=3000.0 if loss_scaled else 1.0, low=jnp.float16,
                    grad_dtype=jnp.float32 if grads == "fp32" else None)

  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed = {in_place: run(in_place) for in_place in (False, True)}
  for in_place in (False, True):
    _same_bits(run(in_place), composed[in_place], f"in_place={in_place}")
  tree = {"h": jnp.ones((4, 3), jnp.float16), "b": jnp.ones(5), "c": jnp.ones((), jnp.float16)}
  assert _custom_calls(make(), tree) == 2
  # Gradients of the other dtype: the same calls.
  state = jax.eval_shape(make().init, tree)
  other = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  assert jax.jit(make().update).lower(other, state, tree).as_text().count(jax_native.TARGET) == 2


JAX_F16_ADAMW = {
    f"{c}-{r}-{m}": (lambda c=c, r=r, m=m: oh.adamw_bf16(
        1e-2, compensation=c, state_rounding=r, key=11,
        mu_dtype=None if m == "fp16" else jnp.float32,
        nu_dtype=None if m == "fp16" else jnp.float32))
    for c, r, m in itertools.product(["kahan", "split", "stochastic", "none"],
                                     ["stochastic", "nearest"], ["fp16", "fp32"])
    if (r, m) != ("nearest", "fp32")}  # the step of stochastic-fp32: test_fp32_moments_...


# Each of the kernel's modes for fp16 params (kahan with an fp16 buffer; split:
# "master"; stochastic), fp16 moments written stochastically and to nearest,
# fp32 ones; fp16 params in mode "none" are in the subnormal test's default
# cases, every other combination in make test-slow.
_F16_ADAMW_DEFAULT = ("kahan-stochastic-fp16", "split-nearest-fp16", "stochastic-stochastic-fp32")


@jax_kernel
@pytest.mark.usefixtures("jax_f16")
@pytest.mark.parametrize("name", default_or_slow(list(JAX_F16_ADAMW), _F16_ADAMW_DEFAULT))
def test_jax_kernel_steps_fp16_params_of_adamw_bf16_as_the_composed_transformation(
    name, monkeypatch):
  """fp16 params (an fp32 leaf among them) of adamw_bf16 in every
  compensation, moment dtype and moment rounding, through tx.update (jitted
  and op by op) and in place: the kernel's bits are the composed
  transformation's (the jitted composed run is the reference of both jitted
  kernel runs; op by op in make test's cases, as in the bf16 test above), and
  the kernel runs (one call per dtype group)."""
  make = JAX_F16_ADAMW[name]
  for jit in ("step", False) if name in _F16_ADAMW_DEFAULT else ("step",):
    in_places = (False, True) if jit else (False,)
    with monkeypatch.context() as m:
      m.setattr(jax_native, "available", lambda: False)
      composed = {in_place: _jax_run(make, ("scalar",), jit=jit, in_place=in_place,
                                     low=jnp.float16) for in_place in in_places}
    for in_place in in_places:
      _same_bits(_jax_run(make, ("scalar",), jit=jit, in_place=in_place, low=jnp.float16),
                 composed[in_place], (jit, in_place))
  tree = {"h": jnp.ones((4, 3), jnp.float16), "b": jnp.ones(5), "c": jnp.ones((), jnp.float16)}
  assert _custom_calls(make(), tree) == 2


_JAX_F16_SPECIAL = {
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-4),
    **{f"adamw_bf16 {c} {r} moments {m}": (
        lambda c=c, r=r, m=m: oh.adamw_bf16(1e-4, key=5, compensation=c, state_rounding=r,
                                            mu_dtype=None if m == "fp16" else jnp.float32))
       for c in ("kahan", "split", "stochastic", "none") for r in ("stochastic", "nearest")
       for m in ("fp16", "fp32")},
}


# Every mode of fp16 params (master with fp32 and with fp16 moments, kahan,
# stochastic, none), fp16 moments written stochastically and to nearest, an
# fp32 mu beside a stochastically written fp16 nu: make test-slow, every other.
_F16_SPECIAL_DEFAULT = ("adam_fp32_master", "adamw_bf16 kahan stochastic moments fp16",
                        "adamw_bf16 split nearest moments fp16",
                        "adamw_bf16 stochastic stochastic moments fp32",
                        "adamw_bf16 none nearest moments fp16")


@jax_kernel
@pytest.mark.usefixtures("jax_f16")
@pytest.mark.parametrize("name", default_or_slow(list(_JAX_F16_SPECIAL), _F16_SPECIAL_DEFAULT))
def test_jax_kernel_rounds_fp16_params_subnormals_and_nans_as_the_composed_transformation(
    name, monkeypatch):
  """The JAX twin of the torch test above: fp16 params across the fp16
  subnormal range and at +-65500, gradients from 1e-9 to 10 with NaNs at
  one step: the kernel's params and state, through tx.update and in place,
  equal the composed transformation's (tx.update + apply_updates) bit for bit
  (all jitted, so all see XLA's treatment of fp32 subnormals), in the wide
  lanes and the tail. In place, one documented exception
  (docs/algorithms.md#landing-exactly): a new param of -0.0 from a positive
  one (a tiny weight rounding to zero), which the kernel writes as it is and
  ``apply_updates``' ``p + (-p)`` can only give as +0.0."""
  n = 4099
  w = np.concatenate([_log_uniform(1, n - 3, -9, -3), np.float32([65500.0, -65500.0, 1e-8])])
  grads = [_log_uniform(2 + t, n, -9, 1) for t in range(3)]
  grads[1][[5, 40, 4097]] = np.nan

  def run(in_place, kernel=True):
    tx = _JAX_F16_SPECIAL[name]()

    step = jitted_step(tx, in_place)  # once per run, not per step

    params = {"w": jnp.asarray(w, jnp.float16)}
    state = tx.init(params)
    if kernel:
      assert jax_native.TARGET in step.lower(params, state, params).as_text()
    for g in grads:
      params, state = step(params, state, {"w": jnp.asarray(g, jnp.float16)})
    return jax.tree.leaves((params, state))

  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed = {in_place: run(in_place, kernel=False) for in_place in (False, True)}
  for in_place in (False, True):
    composed_p, *composed_state = composed[in_place]
    b = np.asarray(composed_p).view(np.uint16)
    kernel_p, *kernel_state = run(in_place)
    _same_bits(kernel_state, composed_state, (name, in_place))
    a = np.asarray(kernel_p).view(np.uint16)
    differ = a != b
    if not in_place:
      assert not differ.any(), name
    # Only zeros of the other sign: -0.0 in place, +0.0 through apply_updates.
    assert ((a[differ] == 0x8000) & (b[differ] == 0)).all(), (name, a[differ], b[differ])
    assert ((a & 0x7C00) == 0).sum() > ((a & 0x7FFF) == 0).sum()  # subnormals reached
    assert np.isnan(np.asarray(kernel_p, np.float32)).sum() == 3


@jax_kernel
def test_jax_kernel_takes_fp16_params_but_not_with_bf16_moments():
  """fp16 params take the kernel with fp16 or fp32 moments (where it has
  fp16); with a bf16 moment they take the composed transformation, as
  torch_bridge's kernel has no entry point for them either."""
  tree = {"h": jnp.ones((4, 3), jnp.float16), "c": jnp.ones((), jnp.float16)}
  for tx in (oh.adamw_bf16(1e-3, mu_dtype=jnp.bfloat16),
             oh.adamw_bf16(1e-3, compensation="stochastic", nu_dtype=jnp.bfloat16)):
    assert _custom_calls(tx, tree) == 0
  for tx in (oh.adamw_bf16(1e-3), oh.adamw_bf16(1e-3, compensation="split"),
             oh.adamw_bf16(1e-3, compensation="stochastic", mu_dtype=jnp.float32)):
    assert _custom_calls(tx, tree) == (1 if jax_native.has_f16() else 0)
  # torch_bridge picks the same mode for the same param (its _kernel_mode).
  from optax_half.compensation import COMPENSATIONS as jax_rules  # noqa: PLC0415
  from torch_bridge import adam as torch_adam  # noqa: PLC0415
  from torch_bridge.compensation import COMPENSATIONS as torch_rules  # noqa: PLC0415
  for kind in ("kahan", "split", "stochastic", "none"):
    for jdt, tdt in ((jnp.bfloat16, torch.bfloat16), (jnp.float16, torch.float16)):
      assert jax_native._mode(jax_rules[kind], jdt) == torch_adam._kernel_mode(
          torch_adam._param_compensation(torch_rules[kind], tdt))


@jax_kernel
def test_jax_kernel_updates_the_state_in_place_when_it_is_donated():
  """No copy of the moments or the Kahan buffer: the custom call's results
  alias its operands, and with the state donated XLA adds no copy; the new
  param goes into the buffer of the gradient computed in the step."""
  tx = oh.adamw_bf16(1e-3)
  params = {"w": jnp.ones((256, 128), jnp.bfloat16)}
  state = tx.init(params)

  def step(p, s, c):
    g = jax.grad(lambda p: jnp.vdot(p["w"].astype(jnp.float32), c).astype(jnp.float32))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  c = jnp.ones((256, 128), jnp.float32)
  hlo = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, c).compile().as_text()
  lines = hlo.splitlines()
  entry = lines[next(i for i, line in enumerate(lines) if line.startswith("ENTRY")):]
  entry = entry[:entry.index("}")]
  big_copies = [line for line in entry
                if " copy(" in line and "[256,128]" in line.split("copy(")[0]]
  assert big_copies == []
  assert hlo.count("custom-call(") == 1
  # new param -> the gradient's buffer; mu, nu, compensation -> their own.
  assert "output_to_operand_aliasing={{0}: (3, {}), {1}: (4, {}), {2}: (5, {}), {3}: (6, {})}" in hlo


def _entry(hlo: str) -> list:
  lines = hlo.splitlines()
  entry = lines[next(i for i, line in enumerate(lines) if line.startswith("ENTRY")):]
  return entry[:entry.index("}")]


@jax_kernel
def test_update_and_apply_writes_the_new_params_into_their_own_buffers():
  """``oh.update_and_apply`` with the params donated: the custom call's new
  param aliases the param, and nothing else touches a param-sized buffer but
  the gradient's own computation (no copy, no apply_updates pass; the
  update + apply_updates step has one more fusion)."""
  tx = oh.adamw_bf16(1e-3)
  params = {"w": jnp.ones((256, 128), jnp.bfloat16)}
  state = tx.init(params)
  c = jnp.ones((256, 128), jnp.float32)

  def grads(p, c):
    return jax.grad(lambda p: jnp.vdot(p["w"].astype(jnp.float32), c).astype(jnp.float32))(p)

  def in_place(p, s, c):
    return oh.update_and_apply(tx, grads(p, c), s, p)

  def protocol(p, s, c):
    u, s = tx.update(grads(p, c), s, p)
    return optax.apply_updates(p, u), s

  def big_ops(step):
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, c).compile().as_text()
    ops = [re.match(r"\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9-]*)\(", line)
           for line in _entry(hlo)]
    return hlo, sorted(op[2] for op in ops if op and "bf16[256,128]" in op[1]
                       and op[2] not in ("parameter", "get-tuple-element", "tuple"))

  hlo, ops = big_ops(in_place)
  assert ops == ["custom-call", "fusion"], ops  # the kernel, and the gradient's convert
  assert "output_to_operand_aliasing={{0}: (2, {}), {1}: (4, {}), {2}: (5, {}), {3}: (6, {})}" in hlo
  _, ops = big_ops(protocol)
  assert ops == ["custom-call", "fusion", "fusion"], ops  # + the apply_updates pass


# adam_fp32_master's in-place step is skipped by the same wrapper as
# adamw_bf16's (and runs inside dynamic_loss_scale in the test after): make test-slow.
@pytest.mark.parametrize("name", default_or_slow(
    ["adamw_bf16 skip_nonfinite", "adam_fp32_master skip_nonfinite", "loss scale",
     "loss scale, op by op"], ["adamw_bf16 skip_nonfinite", "loss scale", "loss scale, op by op"]))
def test_update_and_apply_skips_nonfinite_steps_as_update_then_apply_updates(name, monkeypatch):
  """The wrappers that skip non-finite steps (a lax.cond under jit) step in
  place too, and give the bits of tx.update + optax.apply_updates (a master's:
  of the composed in-place step, which lands on its rounding), a skipped step (a
  NaN in the second step's gradients) included."""
  make, jit = {
      "adamw_bf16 skip_nonfinite": (lambda: oh.adamw_bf16(1e-2, skip_nonfinite=True), "step"),
      "adam_fp32_master skip_nonfinite": (
          lambda: oh.adam_fp32_master(1e-2, skip_nonfinite=True), "step"),
      "loss scale": (lambda: oh.dynamic_loss_scale(oh.adamw_bf16(1e-2)), "step"),
      "loss scale, op by op": (lambda: oh.dynamic_loss_scale(oh.adamw_bf16(1e-2)), False),
  }[name]
  tx = make()
  params = {"w": jnp.ones((256,), jnp.bfloat16)}
  step = jax.jit(lambda p, s, g: oh.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  # The kernel, in place (the op-by-op case's step is "loss scale"'s, checked there).
  if jit and jax.default_backend() == "cpu" and jax_native.available():
    calls = step.lower(params, tx.init(params), params).compile().as_text()
    assert "output_to_operand_aliasing={{0}: (2, {})" in calls
  a = _jax_run(make, ("mat",), jit=jit, in_place=True, nan_step=1)
  if "master" in name:
    with monkeypatch.context() as m:
      m.setattr(jax_native, "available", lambda: False)
      b = _jax_run(make, ("mat",), jit=jit, in_place=True, nan_step=1)
  else:
    b = _jax_run(make, ("mat",), jit=jit, nan_step=1)
  _same_bits(a, b, name)
  skipped = [x for x in a if np.asarray(x).dtype == np.int32 and np.asarray(x).shape == ()]
  assert 1 in [int(x) for x in skipped]  # the skip was counted


LOSS_SCALED = {
    "kahan": lambda: oh.adamw_bf16(1e-2, key=3),
    "split, fp32 moments": lambda: oh.adamw_bf16(1e-2, compensation="split",
                                                 mu_dtype=jnp.float32, nu_dtype=jnp.float32),
    "stochastic, nearest moments": lambda: oh.adamw_bf16(1e-2, compensation="stochastic",
                                                         state_rounding="nearest"),
    "none": lambda: oh.adamw_bf16(1e-2, compensation="none"),
    "adam_fp32_master": lambda: oh.adam_fp32_master(1e-2, weight_decay=0.1),
    "kahan skip_nonfinite": lambda: oh.adamw_bf16(1e-2, skip_nonfinite=True),
}


# The unscaling is the kernel's, whatever its mode (one multiply as it reads
# a gradient); the check and the skip are dynamic_loss_scale's: a Kahan
# optimizer (bf16 moments) in make test; adam_fp32_master (mode master, fp32
# moments), a skip_nonfinite one inside it and the other modes: make
# test-slow (fp16 params in master mode inside dynamic_loss_scale: below).
_LOSS_SCALED_DEFAULT = ("kahan",)


@jax_kernel
@pytest.mark.parametrize("name", default_or_slow(list(LOSS_SCALED), _LOSS_SCALED_DEFAULT))
def test_loss_scale_unscales_in_the_kernel_as_the_composed_transformation(name, monkeypatch):
  """``dynamic_loss_scale`` around a kernel optimizer hands the kernel the
  scaled gradients as they are and 1 / scale, which it multiplies each
  element by as it reads it (no fp32 copy of the gradients); the composed
  transformation is given the fp32 unscaled copies: the same bits, through
  tx.update and in place (one composed run of tx.update + apply_updates, the
  reference of both), with a scale whose inverse is inexact (3000), bf16 and
  fp32 leaves mixed, and a NaN step (skipped, the scale halved) in between,
  the NaN in an fp32 leaf of 196613 elements (XLA:CPU's fp32 max-reduction
  of that many skips NaNs: the check must not be one)."""
  def make():
    return oh.dynamic_loss_scale(LOSS_SCALED[name](), init_scale=3000.0)

  assert oh._in_place.scaled_of(LOSS_SCALED[name]()) is not None
  scaled_calls = []
  native_update = jax_native._native_update

  def spy(*args, grad_scale=None, **kwargs):
    scaled_calls.append(grad_scale is not None)
    return native_update(*args, grad_scale=grad_scale, **kwargs)

  def run(in_place=False, fp32_leaves=("mat", "big")):
    return _jax_run(make, fp32_leaves, jit="step", in_place=in_place, nan_step=2,
                    grad_scale=3000.0, nan_leaf="big")

  # Every leaf 16-bit: tx.update's branch returns the new params and the
  # updates are formed after it (loss_scale's _all_16_bit path).
  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed_16 = run(fp32_leaves=())
  _same_bits(run(fp32_leaves=()), composed_16, "16-bit leaves only, tx.update")
  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composed = {in_place: run(in_place) for in_place in (False, True)}
  for in_place in (False, True):
    scaled_calls.clear()
    with monkeypatch.context() as m:
      m.setattr(jax_native, "_native_update", spy)
      native = run(in_place)
    assert scaled_calls and all(scaled_calls)  # the kernel unscaled (traced once per branch)
    _same_bits(native, composed[in_place], f"in_place={in_place}")
    scales = [float(x) for x in native if np.asarray(x).dtype == np.float32
              and np.asarray(x).shape == () and float(x) in (3000.0, 1500.0)]
    assert scales == [1500.0]  # one skip, counted


@jax_kernel
def test_loss_scale_never_forms_fp32_copies_of_the_gradients():
  """``update_and_apply(dynamic_loss_scale(adamw_bf16), ...)`` jitted with the
  params and state donated compiles to a step with no fp32 array of a param's
  size anywhere (the branch included): the finiteness check reads the
  scaled bf16 gradient as it is, the kernel unscales as it reads it and
  writes the new param into the param's buffer. Before, the unscaled fp32
  gradients were a pass and a fresh array of their own."""
  tx = oh.dynamic_loss_scale(oh.adamw_bf16(1e-3))
  params = {"w": jnp.ones((256, 128), jnp.bfloat16)}
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: oh.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  hlo = step.lower(params, state, params).compile().as_text()
  # The step and the finiteness check (one pass over the gradient).
  assert hlo.count(f'custom_call_target="{jax_native.TARGET}"') == 1
  assert hlo.count(f'custom_call_target="{jax_native.FINITE_TARGET}"') == 1
  assert "output_to_operand_aliasing={{0}: (2, {})" in hlo  # in place
  # Every buffer of the step: the results of the entry computation's and the
  # branches' instructions (a fusion's inner values live in registers).
  computations = [c for c in hlo.split("\n\n") if not c.lstrip().startswith(
      ("%fused_computation", "%wrapped_"))]
  assert any("custom-call(" in c for c in computations)
  assert not [line for c in computations for line in c.splitlines()
              if re.match(r"\s*(ROOT )?%\S+ = [^=]*f32\[256,128\]", line)]


@pytest.mark.parametrize("name", ["optax.adam", "chain"])
def test_update_and_apply_of_anything_else_is_update_then_apply_updates(name):
  """Transformations without an in-place step give what tx.update +
  optax.apply_updates give."""
  make = {"optax.adam": lambda: optax.adam(1e-2),
          "chain": lambda: optax.chain(optax.clip(1.0), oh.adamw_bf16(1e-2))}[name]
  assert oh._in_place.step_of(make()) is None
  a = _jax_run(make, ("mat",), jit="step", in_place=True)
  b = _jax_run(make, ("mat",), jit="step")
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_update_and_apply_falls_back_for_an_update_that_is_not_a_weak_key():
  """An update the registry cannot look up (unhashable, or without weak
  references) takes tx.update + optax.apply_updates instead of failing."""
  inner = optax.sgd(0.1)

  class Update:  # __eq__ without __hash__ (unhashable), __slots__ (no weak references)
    __slots__ = ()

    def __eq__(self, other):
      return self is other

    def __call__(self, updates, state, params=None):
      return inner.update(updates, state, params)

  tx = optax.GradientTransformation(inner.init, Update())
  params = {"w": jnp.arange(4.0)}
  state = tx.init(params)
  new, _ = oh.update_and_apply(tx, params, state, params)
  np.testing.assert_array_equal(new["w"], optax.apply_updates(params, tx.update(params, state)[0])["w"])
  assert np.asarray(new["w"]).tolist() != np.asarray(params["w"]).tolist()


@jax_kernel
def test_a_skipped_in_place_step_keeps_subnormal_params():
  """A skipped step leaves every param bit as it was, subnormals included
  (XLA:CPU's apply_updates flushes a subnormal p + (-0.0) to zero; the
  in-place step never adds)."""
  tx = oh.adamw_bf16(1e-2, skip_nonfinite=True)
  bits = np.array([11, 32779, 0x8000, 0x3F80, 0x0080], np.uint16)
  params = {"w": jnp.asarray(bits).view(jnp.bfloat16)}
  state = tx.init(params)
  grads = {"w": jnp.full((5,), jnp.nan, jnp.bfloat16)}
  new, new_state = jax.jit(oh.update_and_apply, static_argnums=0)(tx, grads, state, params)
  assert (np.asarray(new["w"]).view(np.uint16) == bits).all()
  assert int(new_state.total_notfinite) == 1


def test_update_and_apply_leaves_params_it_was_not_given_to_keep_alone():
  """Not donated (op by op, or jitted without donate_argnums), the caller's
  params are left as they were: XLA copies before the kernel writes."""
  tx = oh.adamw_bf16(1e-2)
  params = {"w": jnp.asarray(_values(0, (1000,), 0.5)).astype(jnp.bfloat16)}
  before = np.asarray(params["w"]).tobytes()
  state = tx.init(params)
  grads = {"w": jnp.asarray(_values(1, (1000,), 0.1)).astype(jnp.bfloat16)}
  for run in (lambda: oh.update_and_apply(tx, grads, state, params),
              lambda: jax.jit(oh.update_and_apply, static_argnums=0)(tx, grads, state, params)):
    new, _ = run()
    assert np.asarray(params["w"]).tobytes() == before
    assert np.asarray(new["w"]).tobytes() != before


_WITHOUT_KERNEL = r"""
import warnings
import jax, jax.numpy as jnp, numpy as np, optax
import optax_half as oh, torch, torch_bridge as tb
import optax_half_native
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert optax_half_native.library() is None
assert "OPTAX_HALF_NATIVE=0" in str(caught[0].message), [str(w.message) for w in caught]
tx = oh.adamw_bf16(1e-2)
w = np.linspace(-1, 1, 7).astype(np.float32)
p = {"w": jnp.asarray(w).astype(jnp.bfloat16)}
s = tx.init(p)
assert "optax_half_adamw" not in jax.jit(tx.update).lower(p, s, p).as_text()
u, s = jax.jit(tx.update)(p, s, p)
tp = torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16))
opt = tb.adamw_bf16([tp], 1e-2)
tp.grad = tp.detach().clone()
opt.step()
j = np.asarray(optax.apply_updates(p, u)["w"]).view(np.uint16)
assert (j == tp.detach().view(torch.int16).numpy().view(np.uint16)).all()
print("ok")
"""


def test_without_the_kernel_everything_runs_the_framework_code(tmp_path):
  script = tmp_path / "without.py"
  script.write_text(_WITHOUT_KERNEL)
  env = dict(os.environ, OPTAX_HALF_NATIVE="0")
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


_STEPS_LOADED = r"""
import jax, jax.numpy as jnp, numpy as np, optax_half as oh, optax_half_native as n
from optax_half import _native
trees = {"bf16": {"w": jnp.ones((300,), jnp.bfloat16)},
         "mixed": {"w": jnp.ones((300,), jnp.bfloat16), "h": jnp.ones((30,), jnp.float16),
                   "f": jnp.ones((3,), jnp.float32)}}
params = trees[TREE]
tx = oh.adamw_bf16(1e-3, compensation=COMPENSATION)
jax.jit(tx.update)(params, tx.init(params), params)
print(sorted(name for name, lib in n._libs.items() if lib is not None))
# A step not loaded: the handlers refuse it by name (optax_half loads each before it traces).
p = jnp.ones((40,), jnp.bfloat16)
mode = "split" if COMPENSATION != "split" else "kahan"
buffer = jnp.zeros((40,), jnp.int16 if mode == "split" else jnp.bfloat16)
scalars, keys = jnp.zeros((len(n.ADAMW_SCALARS),), jnp.float32), jnp.zeros((1, 3), jnp.uint32)
try:
  jax.jit(lambda p: _native._call(_native.TARGET, mode, "nearest", scalars, keys, [p], [p],
                                  ([p], [p], [buffer]), in_place=False)[0])(p)
except Exception as e:
  print(type(e).__name__, str(e).splitlines()[0][:300])
"""


@pytest.mark.parametrize("tree,compensation,steps", [
    ("bf16", "kahan", ["bfloat16 kahan"]),
    ("mixed", "split", ["bfloat16 split", "float16 master"])])
def test_a_jax_step_builds_and_loads_only_the_kernel_steps_it_takes(tree, compensation, steps,
                                                                   tmp_path):
  """The JAX library is its handlers plus a library per 16-bit param dtype and mode
  (native.FFI_STEPS), each built and loaded as the first step that takes it is traced (an
  fp32 leaf takes the handlers' own); a call of a step not loaded is an error naming it."""
  if "float16 master" in steps and not jax_native.has_f16():
    steps = steps[:1]
  script = tmp_path / "steps.py"
  script.write_text(f"TREE, COMPENSATION = {tree!r}, {compensation!r}\n" + _STEPS_LOADED)
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  loaded, refused = out.stdout.strip().splitlines()[-2:]
  assert eval(loaded) == ["adamw_ffi.cc", *(f"adamw_ffi.cc[{s}]" for s in steps)], out.stdout
  assert "no step of this param dtype and mode is loaded" in refused, refused


def test_ffi_steps_refuses_a_step_it_has_not():
  with pytest.raises(ValueError, match="no FFI step for"):
    native_lib.ffi_steps(jax.ffi.include_dir(), [("float16", "split")])
  assert native_lib.ffi_steps(jax.ffi.include_dir(), [("bfloat16", "kahan")])


def _same_but_nan_bits(a: np.ndarray, b: np.ndarray, what):
  """Equal bits, except that a NaN only has to be a NaN: its sign and payload
  are outside the bit-exact claim (torch's vectorised cast writes 0xFFFF, XLA
  keeps the sign, the kernel writes 0x7FC0)."""
  fa, fb = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.array_equal(np.isnan(fa), np.isnan(fb)), what
  keep = ~np.isnan(fa)
  assert np.asarray(a)[keep].tobytes() == np.asarray(b)[keep].tobytes(), what


@pytest.mark.parametrize("compensation", ["kahan", "split", "stochastic", "none"])
def test_nonfinite_gradients_poison_the_same_elements(compensation, monkeypatch):
  g0 = _values(7, (300,), 0.1)
  g0[3], g0[10], g0[20] = np.nan, np.inf, -np.inf
  grads = [g0, _values(8, (300,), 0.1)]
  w = _values(9, (300,), 0.5)
  # torch: kernel vs eager.
  runs = []
  for fused in (None, False):
    p = torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16))
    opt = tb.adamw_bf16([p], 1e-2, compensation=compensation, fused=fused)
    for g in grads:
      p.grad = torch.from_numpy(g).to(torch.bfloat16)
      opt.step()
    runs.append([p.detach()] + [v for k, v in opt.state[p].items() if k != "step"])
  for a, b in zip(*runs):
    _same_but_nan_bits(a.float().numpy(), b.float().numpy(), compensation)
  # JAX: kernel vs composed.
  out = []
  for native in (True, False):
    with monkeypatch.context() as m:
      if not native:
        m.setattr(jax_native, "available", lambda: False)
      tx = oh.adamw_bf16(1e-2, compensation=compensation)
      params = {"w": jnp.asarray(w).astype(jnp.bfloat16)}
      state = tx.init(params)
      for g in grads:
        u, state = jax.jit(tx.update)({"w": jnp.asarray(g).astype(jnp.bfloat16)}, state, params)
        params = optax.apply_updates(params, u)
      out.append(jax.tree.leaves((params, state)))
  for a, b in zip(*out):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or a.dtype == jnp.bfloat16:
      _same_but_nan_bits(a, b, compensation)
    else:
      assert a.tobytes() == b.tobytes()
  assert np.isnan(np.asarray(out[0][0], np.float32)[[3, 10, 20]]).all()


def test_torch_kernel_counts_as_an_in_place_write_for_autograd():
  """A param saved for backward and then stepped: an error, as with the eager step."""
  for fused in (None, False):
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = tb.adamw_bf16([p], 1e-2, fused=fused)
    loss = (p * p).sum()  # saves p
    p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
      loss.backward()


def test_torch_kernel_param_groups_with_their_own_hyperparameters():
  def make(params, fused):
    return tb.adamw_bf16([{"params": params[:2], "lr": 3e-2, "weight_decay": 0.0},
                          {"params": params[2:], "b1": 0.8, "eps": 1e-6}], 1e-2, fused=fused)
  assert_same_torch_runs(_torch_run(make, None, ("vec",)), _torch_run(make, False, ("vec",)))


@jax_kernel
def test_the_custom_call_checks_its_operands():
  """A mistaken call is an error, not an out-of-bounds write."""
  assert jax_native.available()  # registers the handlers
  p = jnp.ones(8, jnp.bfloat16)
  import optax_half_native as native  # noqa: PLC0415
  scalars = jnp.zeros(len(native.ADAMW_SCALARS), jnp.float32)
  keys = jnp.zeros((1, 3), jnp.uint32)

  def call(leaves, states, mode="kahan", target=jax_native.TARGET, scalars=scalars, keys=keys):
    return jax_native._call(target, mode, "nearest", scalars, keys, leaves, leaves, states, False)

  with pytest.raises(Exception, match="the mode's buffer\\) must have the param's size"):
    call([p], [[p], [p], [None]])
  with pytest.raises(Exception, match="the mode's buffer is mistyped"):
    call([p], [[p], [p], [jnp.zeros(8, jnp.int16)]], mode="master")
  with pytest.raises(Exception, match="must have the param's size"):
    call([p], [[jnp.ones(4, jnp.bfloat16)], [p], [p]])
  with pytest.raises(Exception, match=rf"scalars must be f32\[{len(native.ADAMW_SCALARS)}\]"):
    call([p], [[p], [p], [p]], scalars=jnp.zeros(9, jnp.float32))
  with pytest.raises(Exception, match="operands p..., g..., mu..., nu..., buffer..."):
    call([p], [[p], [p], [p]], keys=jnp.zeros((2, 3), jnp.uint32))
  if jax_native.has_f16():  # a clipped read of fp16 gradients: refused, not ignored
    h = jnp.ones(8, jnp.float16)
    clipping = scalars.at[native.ADAMW_SCALARS.index("clip_div")].set(2.0)
    with pytest.raises(Exception, match="a clipped read takes bf16 or fp32 gradients"):
      jax_native._call(jax_native.TARGET, "kahan", "nearest", clipping, keys, [h], [h],
                       [[h], [h], [h]], False)
  with pytest.raises(Exception, match="p_out p's dtype"):  # an fp32 param's bf16 p_out
    q = jnp.ones(8, jnp.float32)
    jax.ffi.ffi_call(jax_native.TARGET, [jax.ShapeDtypeStruct((8,), jnp.bfloat16)] + [
        jax.ShapeDtypeStruct((8,), jnp.float32)] * 2 + [jax.ShapeDtypeStruct((0,), jnp.float32)],
        vmap_method="sequential")(scalars, keys, q, q, q, q, jnp.zeros(0, jnp.float32),
                                  mode=np.int32(6), sr=False, update=False,
                                  nthreads=np.int32(1))
  with pytest.raises(Exception, match="the leaves of one call share dtypes"):
    q = jnp.ones(8, jnp.float32)
    call([p, q], [[p, p], [p, p], [p, p]], keys=jnp.zeros((2, 3), jnp.uint32))
  with pytest.raises(Exception, match="must hold every leaf's elements"):
    call([p, p], [[p], [p], [p]], target=jax_native.FLAT_TARGET,
         keys=jnp.zeros((2, 3), jnp.uint32))


@jax_kernel
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "op by op"])
def test_the_native_finiteness_check_equals_xlas(jit):
  """``_native.all_finite`` (one pass of the kernel's check over each
  gradient, on CPU) is XLA's ``all(isfinite(widen(g) * inv_scale))``: a NaN
  or an Inf at the first element, either side of a 16-lane step, either
  side of the threads' 65536-element chunks, the last element, the scalar
  tail of a 37-element leaf; finite values whose product overflows,
  subnormals; inverse scales of 1, 1/3000, 2, Inf and a subnormal; bf16,
  fp32 and (where the kernel has them) fp16 leaves."""
  from optax_half import _util  # noqa: PLC0415
  rng = np.random.default_rng(3)
  base = {"a": rng.standard_normal(200003).astype(np.float32),
          "b": rng.standard_normal(37).astype(np.float32)}
  check = jax.jit(jax_native.all_finite) if jit else jax_native.all_finite
  reference = jax.jit(lambda t, s: _util.all_finite(_util.unscaled(t, s)))
  spots = [("a", 0), ("a", 15), ("a", 16), ("a", 65535), ("a", 65536), ("a", 200002), ("b", 36)]
  values = [np.nan, np.inf, -np.inf, 3e38, 1e-40]
  inverses = [1.0, 1 / 3000, 2.0, np.inf, 1e-45] if jit else [1 / 3000, 2.0]
  seen = {True: 0, False: 0}
  f16 = jax_native.has_f16()
  for dtypes in ((jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                 *([(jnp.float16, jnp.float32)] if f16 else [])):
    tree = {k: jnp.asarray(v, d) for (k, v), d in zip(base.items(), dtypes)}
    if jit:
      assert jax_native.FINITE_TARGET in check.lower(tree, 1.0).as_text()
    assert bool(check(tree, 1.0)) and bool(check(tree))
    for (leaf, where), value in itertools.product(spots, values):
      if not jit and value in (3e38, 1e-40):
        continue
      poisoned = dict(tree)
      poisoned[leaf] = tree[leaf].at[where].set(value)
      for inv in inverses:
        inv = np.float32(inv)
        want = bool(reference(poisoned, inv))
        assert bool(check(poisoned, inv)) == want, (dtypes, leaf, where, value, inv)
        seen[want] += 1
  assert seen[False] > 10 and (seen[True] > 10 or not jit)  # op by op: NaNs and Infs only
  # fp16 leaves: the kernel's check where it has fp16 (F16C), else XLA's reduction.
  fp16 = {"h": jnp.ones(8, jnp.float16)}
  assert (jax_native.FINITE_TARGET in jax.jit(jax_native.all_finite).lower(fp16).as_text()) == f16


def test_a_library_whose_struct_differs_from_tensor_dtype_is_refused(monkeypatch):
  """The loader compares the C struct's size and every field's offset with
  TENSOR_DTYPE: the keep flag before the keys keeps the size (128 bytes,
  padding) but moves both, and is refused."""
  import optax_half_native as native  # noqa: PLC0415
  names = list(native.TENSOR_DTYPE.names)
  k = names.index("keys")
  names[k], names[k + 1] = names[k + 1], names[k]
  shifted = np.dtype([(n, *native.TENSOR_DTYPE.fields[n][:1]) for n in names], align=True)
  assert shifted.itemsize == native.TENSOR_DTYPE.itemsize
  # The FFI library's own load (a build the cache has: no compile here; the
  # torch library's plain build would be one more).
  assert jax_native.available()
  args = (native._compiler(), "adamw_ffi.cc", (jax.ffi.include_dir(),), ())
  assert native._build_and_load(*args) is not None
  monkeypatch.setattr(native, "TENSOR_DTYPE", shifted)
  with pytest.raises(RuntimeError, match="struct layout differs from TENSOR_DTYPE"):
    native._build_and_load(*args)


def _log_uniform(seed, n, lo, hi):
  rng = np.random.default_rng(seed)
  signs = np.where(rng.random(n) < 0.5, -1.0, 1.0)
  return np.asarray(signs * 10.0 ** rng.uniform(lo, hi, n), np.float32)


@pytest.mark.parametrize("config", [
    dict(compensation=c, state_rounding=r, mu_dtype=m)
    for c in ("kahan", "split", "stochastic", "none") for r in ("nearest", "stochastic")
    for m in (None, torch.float32)], ids=str)
def test_torch_kernel_rounds_subnormals_and_nans_as_the_eager_step(config):
  """The kernel's wide lanes round to bf16 with vcvtneps2bf16, which reads
  subnormals as 0 and writes NaNs of its own; lanes holding either take the
  exact integer rounding. Params, gradients and lr here keep the values
  rounded (params, Kahan residuals, moments) around the fp32 subnormal range
  (1e-45 .. 1e-25), in 4099 elements (256 wide blocks and a tail), and a few
  gradients are NaN: every bit equals the eager step's, and every NaN the
  kernel writes to a bf16 buffer is 0x7FC0, in the wide lanes and the tail."""
  n = 4099
  w = _log_uniform(1, n, -45, -25)
  grads = [_log_uniform(2 + t, n, -45, -25) for t in range(3)]
  grads[1][[5, 40, 4097]] = np.nan
  runs = []
  for fused in (None, False):
    p = torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16))
    opt = tb.adamw_bf16([p], 1e-6, key=5, fused=fused, **config)
    for g in grads:
      p.grad = torch.from_numpy(g).to(torch.bfloat16)
      opt.step()
    runs.append([p.detach()] + [v for k, v in opt.state[p].items() if k != "step"])
  subnormal = 0
  for a, b in zip(*runs):
    _same_but_nan_bits(a.float().numpy(), b.float().numpy(), config)
    if a.dtype == torch.bfloat16:
      bits = a.view(torch.int16).numpy().view(np.uint16)
      nan = np.isnan(a.float().numpy())
      assert (bits[nan] == 0x7FC0).all(), config
      subnormal += int(((bits & 0x7F80) == 0).sum() - (bits & 0x7FFF == 0).sum())
  assert subnormal > 0, subnormal  # the run reached the subnormal range


@pytest.mark.parametrize("lr", [1e-2, 1e36], ids=["lr 1e-2", "lr 1e36"])
def test_torch_kernel_writes_kahan_params_at_the_edges_as_the_eager_step(lr):
  """Kahan's write rounds the new fp32 param x and its residual x - round(x)
  with one NaN check for both (Pairs8: a NaN residual is a NaN or an
  infinite x). Params at bf16's largest finite value, Infs and NaNs, in the
  wide lanes and the tail; with lr 1e36 the updates (about +-1e36) push
  params past the largest value, whose roundings overflow to an Inf with the
  opposite Inf as residual, then make Inf - Inf in the next step. Every bit
  of the param, buffer and moments equals the eager step's (a NaN only has
  to be a NaN)."""
  n = 4099
  w = _values(21, (n,), 0.5)
  big = float(torch.finfo(torch.bfloat16).max)
  w[[0, 17, 100, 4098]] = big
  w[[1, 33]] = -big
  w[[2, 50, 4097]] = np.inf
  w[[3, 51]] = -np.inf
  w[[4, 70]] = np.nan
  grads = [_values(22 + t, (n,), 0.1) for t in range(3)]
  runs = []
  for fused in (None, False):
    p = torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16))
    opt = tb.adamw_bf16([p], lr, weight_decay=0.0, compensation="kahan", fused=fused)
    steps = []
    for g in grads:
      p.grad = torch.from_numpy(g).to(torch.bfloat16)
      opt.step()
      steps.append([p.detach().clone()] + [
          v.clone() for k, v in opt.state[p].items() if k != "step"])
    runs.append(steps)
  for t, (a, b) in enumerate(zip(*runs)):
    for x, y in zip(a, b):
      _same_but_nan_bits(x.float().numpy(), y.float().numpy(), (lr, t))
      if x.dtype == torch.bfloat16:  # the kernel's NaNs are round_nearest's
        nan = torch.isnan(x.float()).numpy()
        assert (x.view(torch.int16).numpy().view(np.uint16)[nan] == 0x7FC0).all(), (lr, t)
  if lr > 1:  # the first step's overflows: an Inf param from a finite one, an Inf buffer
    first = [x.float().numpy() for x in runs[0][0]]
    assert (np.isinf(first[0]) & np.isfinite(w)).sum() >= 1
    assert any(np.isinf(buf).any() for buf in first[1:])


@pytest.mark.parametrize("compensation", ["kahan", "stochastic", "none"])
def test_torch_kernel_steps_spans_that_start_at_odd_elements(compensation):
  """The kernel splits the concatenated elements between its threads at
  multiples of 256; after a one-element tensor, a span of the next one
  starts at an odd element, whose random-bit counter is odd (Pairs8 steps
  that element alone and its blocks from the next, even, counter). Two
  threads, stochastic moments (and, with compensation "stochastic",
  stochastic params): every bit equals the eager step's."""
  shapes = [(), (2**17 + 10,), (3,), (1001,)]
  threads = torch.get_num_threads()
  runs = []
  for fused in (None, False):
    torch.set_num_threads(2 if fused is None else 1)
    try:
      params = [torch.nn.Parameter(torch.from_numpy(_values(40 + k, s, 0.5)).to(torch.bfloat16))
                for k, s in enumerate(shapes)]
      opt = tb.adamw_bf16(params, 1e-2, key=3, compensation=compensation, fused=fused)
      for t in range(3):
        for k, p in enumerate(params):
          p.grad = torch.from_numpy(_values(50 + 10 * t + k, p.shape, 0.1)).to(torch.bfloat16)
        opt.step()
    finally:
      torch.set_num_threads(threads)
    runs.append((params, opt))
  assert_same_torch_runs(*runs)


_FALLBACK = r"""
import glob, os, sys
import optax_half_native as native
lib = native._load("adamw_cpu.cc", extra=("-fno-such-flag-optax-half",))
assert lib is not None, native.build_errors
cache = os.environ["OPTAX_HALF_CACHE"]
assert len(glob.glob(os.path.join(cache, "*.failed"))) == 1, os.listdir(cache)
assert len(glob.glob(os.path.join(cache, "*.so"))) == 1, os.listdir(cache)
print("ok")
"""


@pytest.mark.slow  # another build of the kernel (the plain one, in an empty cache)
def test_a_build_with_extra_flags_that_fails_falls_back_and_is_remembered(tmp_path):
  """The OpenMP build is tried first; if it cannot be built (here: a flag the
  compiler refuses) the plain library is built and loaded, and the failure is
  remembered in the cache, so the next process does not compile it again."""
  script = tmp_path / "fallback.py"
  script.write_text(_FALLBACK)
  env = dict(os.environ, OPTAX_HALF_CACHE=str(tmp_path / "cache"))
  for _ in range(2):  # the second run finds the marker and the plain build
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_tensors_the_kernel_cannot_take_build_nothing(monkeypatch):
  """Non-CPU (here: meta) or non-contiguous tensors go to the eager step
  before any kernel is looked up, so a GPU run never compiles the CPU library."""
  def no_build(*args):
    raise AssertionError("the CPU kernel was looked up")
  monkeypatch.setattr(torch_native.native, "kernel", no_build)
  batch = torch_native.Batch(0, "stochastic")
  meta = [torch.empty(4, dtype=torch.bfloat16, device="meta") for _ in range(4)]
  assert not batch.add((*meta, None), "kahan", torch.tensor(0), 0, lambda: ())
  strided = [torch.zeros(4, 4, dtype=torch.bfloat16).t() for _ in range(4)]
  assert not batch.add((*strided, None), "kahan", torch.tensor(0), 0, lambda: ())


_FUZZ = r"""
import torch
import torch_bridge as tb
from torch_bridge import _native

B, F, H = torch.bfloat16, torch.float32, torch.float16
SCALARS = tuple(torch.tensor(v) for v in (1e-2, 0.9, 0.999, 0.1, 0.001, 10.0, 1000.0, 1e-8, 0.1))


def row(p=B, g=None, mu=None, nu=None, buf="param", n=8):
  g, mu, nu = g or p, mu or p, nu or p
  buf = p if buf == "param" else buf
  out = [torch.ones(n, dtype=p), torch.full((n,), 0.5, dtype=g), torch.zeros(n, dtype=mu),
         torch.zeros(n, dtype=nu), None if buf is None else torch.zeros(n, dtype=buf)]
  return out


def with_(k, t, base=None):
  out = base or row()
  out[k] = t
  return out


meta = lambda dtype=B: torch.zeros(8, dtype=dtype, device="meta")
strided = lambda dtype=B: torch.zeros(16, dtype=dtype)[::2]
empty = lambda dtype=B: torch.zeros(0, dtype=dtype)
step = torch.tensor(0)
cases = {
    "kahan, no buffer": (row(buf=None), "kahan"),
    "split, no buffer": (row(buf=None), "split"),
    "master, no buffer": (row(buf=None), "master"),
    "kahan, fp32 buffer": (row(buf=F), "kahan"),
    "split, bf16 buffer": (row(), "split"),
    "master, bf16 buffer": (row(), "master"),
    "master, int16 buffer": (row(buf=torch.int16), "master"),
    "none with a buffer": (row(), "none"),
    "stochastic with a buffer": (row(), "stochastic"),
    "direct with a buffer": (row(p=F), "direct"),
    "fp16 param, bf16 moments": (row(p=H, mu=B, nu=B, buf=H), "kahan"),
    "float64 param": (row(p=torch.float64, buf=None), "direct"),
    "int grad": (with_(1, torch.ones(8, dtype=torch.int32)), "kahan"),
    "unknown mode": (row(), "update"),
    "no mode": (row(), None),
    "zero-size": ([empty(), empty(), empty(), empty(), empty()], "kahan"),
    "zero-size buffer": (with_(4, empty()), "kahan"),
    "grad shorter": (with_(1, torch.ones(7, dtype=B)), "kahan"),
    "mu longer": (with_(2, torch.zeros(9, dtype=B)), "kahan"),
    "nu shorter": (with_(3, torch.zeros(1, dtype=B)), "kahan"),
    "buffer shorter": (with_(4, torch.zeros(4, dtype=B)), "kahan"),
    "same numel, other shape": None,  # taken: the kernel steps flat elements
    "no param": (with_(0, None), "kahan"),
    "no grad": (with_(1, None), "kahan"),
    "no mu": (with_(2, None), "kahan"),
    "a list, not a tensor": (with_(3, [0.0] * 8), "kahan"),
    "four tensors": (row()[:4], "none"),
    "sparse grad": (with_(1, torch.ones(8, dtype=B).to_sparse()), "kahan"),
    "negated view": (with_(1, torch._neg_view(torch.ones(8, dtype=B))), "kahan"),
}
for k, name in enumerate(("param", "grad", "mu", "nu", "buffer")):
  cases[f"{name} on meta"] = (with_(k, meta()), "kahan")
  cases[f"{name} not contiguous"] = (with_(k, strided()), "kahan")
bad_args = {
    "step a number": dict(step=0), "step fp32": dict(step=torch.tensor(0.0)),
    "step of one element": dict(step=torch.tensor([0])), "step negative": dict(step=torch.tensor(-1)),
    "step on meta": dict(step=torch.tensor(0, device="meta")),
    "leaf negative": dict(leaf=-1), "leaf a float": dict(leaf=1.0), "leaf a bool": dict(leaf=True),
    "index negative": dict(index=-3), "index a tensor": dict(index=torch.arange(8)),
    "index a float": dict(index=0.0), "index past 2^63": dict(index=2**63),
    "maximize not a bool": dict(maximize=1),
}
for name, case in cases.items():
  if case is None:
    continue
  tensors, mode = case
  batch = _native.Batch(0, "stochastic")
  assert batch.add(tuple(tensors), mode, step, 0, lambda: SCALARS) is False, name
  batch.run()
for name, kwargs in bad_args.items():
  args = dict(step=torch.tensor(0), leaf=0, index=0, maximize=False)
  args.update(kwargs)
  batch = _native.Batch(0, "stochastic")
  assert batch.add(tuple(row()), "kahan", args["step"], args["leaf"], lambda: SCALARS,
                   args["index"], args["maximize"]) is False, name
  batch.run()
batch = _native.Batch(0, "stochastic")
assert batch.add(tuple(row()), "kahan", torch.tensor(0), 0, lambda: SCALARS[:8]) is False
assert batch.add(tuple(row()), "kahan", torch.tensor(0), 0, lambda: SCALARS + SCALARS[:1]) is False
batch.run()

# What fits is taken and stepped, once per param per call.
batch = _native.Batch(0, "stochastic")
tensors = row()
tensors[1] = tensors[1].view(2, 4)  # the same numel in another shape
counts = [torch.tensor(0), torch.tensor(0)]
assert batch.add(tuple(tensors), "kahan", counts[0], 0, lambda: SCALARS)
assert not batch.add(tuple(tensors), "kahan", counts[1], 1, lambda: SCALARS)  # twice: refused
batch.before(tensors[0])  # runs the first
assert int(counts[0]) == 1 and not torch.equal(tensors[0], torch.ones(8, dtype=B))
assert batch.add(tuple(tensors), "kahan", counts[1], 1, lambda: SCALARS)
batch.run()
assert int(counts[1]) == 1
for mode, buf in (("split", torch.int16), ("master", F), ("stochastic", None), ("none", None)):
  batch = _native.Batch(0, "nearest")
  assert batch.add(tuple(row(buf=buf)), mode, torch.tensor(0), 0, lambda: SCALARS), mode
  assert batch.add(tuple(row(p=F, buf=None)), "direct", torch.tensor(0), 1, lambda: SCALARS, 0,
                   True), mode
  batch.run()

# The optimizers: a model cast after the optimizer was built, state that no
# longer fits its param, a state dict's Python-number step.
for make in (lambda ps: tb.adamw_bf16(ps, lr=1e-2), lambda ps: tb.adam_fp32_master(ps, lr=1e-2),
             lambda ps: tb.adamw_bf16(ps, lr=1e-2, compensation="split")):
  for before, after in ((F, B), (F, H), (B, F), (B, H), (H, B)):
    model = torch.nn.Linear(4, 3).to(before)
    opt = make(model.parameters())
    model.to(after)
    for p in model.parameters():
      p.grad = torch.ones_like(p)
    opt.step()
    model.to(before)
    try:
      opt.step()
    except ValueError as e:
      assert "param 0" in str(e) and "model.to(dtype)" in str(e), e
    opt = make(model.parameters())
    opt.step()
    for p in model.parameters():
      for key in [k for k in opt.state[p] if k != "step"]:
        broken = make(model.parameters())
        broken.load_state_dict(opt.state_dict())
        del broken.state[p][key]
        try:
          broken.step()
        except ValueError as e:
          assert "changed after its state was made" in str(e), e
        else:
          raise AssertionError(f"state without {key} was stepped")
print("ok")
"""


def test_the_torch_entry_refuses_what_it_cannot_take_and_never_crashes(tmp_path):
  """``_native.Batch.add`` passes the kernel addresses only of what it steps:
  a missing or mistyped buffer, dtypes with no kernel, non-contiguous,
  zero-size, mismatched or non-CPU tensors, and bad counts are refused (the
  eager step then runs or raises), never passed on. Also the optimizers
  whose params changed dtype around their state (the crash this guards
  against). In a process of its own: a failure may be a segfault."""
  script = tmp_path / "fuzz.py"
  script.write_text(_FUZZ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=root)
  assert out.returncode == 0 and out.stdout.strip() == "ok", (
      f"exit {out.returncode}: " + out.stderr[-3000:])


def _cpu_flags() -> set:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def test_the_kernel_steps_as_many_lanes_as_the_cpu_has():
  """16 elements a step with AVX-512 (F, BW, DQ, BF16), 8 with AVX2 (or when
  OPTAX_HALF_NATIVE_FLAGS turns AVX-512 off), else 1."""
  import optax_half_native as native  # noqa: PLC0415
  flags = _cpu_flags()
  if not flags:
    pytest.skip("no /proc/cpuinfo flags")
  no512 = "-mno-avx512f" in os.environ.get("OPTAX_HALF_NATIVE_FLAGS", "")
  if not no512 and {"avx512f", "avx512bw", "avx512dq", "avx512_bf16"} <= flags:
    want = 16
  elif "avx2" in flags:
    want = 8
  else:
    want = 1
  assert native.lanes() == want
  # fp16 params where the CPU has F16C, in both libraries (otherwise every
  # fp16 test would skip).
  f16c = "f16c" in flags and "-mno-f16c" not in os.environ.get("OPTAX_HALF_NATIVE_FLAGS", "")
  assert native.has_f16(native.library()) == f16c
  assert jax_native.has_f16() == f16c


@pytest.mark.slow  # two more builds of the kernel
@pytest.mark.skipif(not {"avx2", "avx512f"} <= _cpu_flags(),
                    reason="needs a CPU with AVX-512 (the default lanes) and AVX2")
def test_the_avx2_lanes_have_the_same_bits(tmp_path):
  """The AVX2 build (Lanes8, for CPUs without AVX-512) runs the bit-exactness
  tests above in a process of its own. The lanes are adamw.h's, the same
  templates in both libraries (torch's and JAX's FFI one; the code around
  them is the same source in either build), so the torch tests, which take
  every entry point (param, gradient and moment types, mode, moment
  rounding), run the lanes of every one, subnormals and NaNs included: torch
  kernel == eager step in every configuration, bf16 and fp16 params. JAX
  runs what only its library has: mode "update" (fp32 leaves, beside a Kahan
  group), the finiteness check, jitted and op by op, and the clip the
  kernel reads (oh.chain of clip_by_global_norm: both reads, bf16 and fp32
  gradients, edge values, NaN and Inf). ScaledAdam's kernel
  (scaled_adam.h: the sums' generic lanes, the step's Lanes8) against the
  eager step in torch, its sums against exact sums, and JAX's FFI path."""
  # OMP_WAIT_POLICY: torch's OpenMP threads wait without spinning, so on
  # cores the other pytest-xdist worker keeps busy they do not take its time
  # (spinning, the torch tests below took many times as long).
  env = dict(os.environ, OPTAX_HALF_CACHE=str(tmp_path / "cache"),
             OPTAX_HALF_NATIVE_FLAGS="-mno-avx512f", OMP_WAIT_POLICY="PASSIVE")
  # pyproject's addopts deselect the slow cases: make test's ones run.
  scaled_adam_tests = os.path.join(os.path.dirname(__file__), "test_scaled_adam.py")
  clipping_tests = os.path.join(os.path.dirname(__file__), "test_clipping.py")
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
       scaled_adam_tests, clipping_tests, "-k",
       "lanes_as_the_cpu or torch_kernel or folded_clip or "
       "(jax_kernel_and_the_in_place_step and (kahan-stochastic-param or adam_fp32_master)) or "
       "master_misses_in_the_lanes or finiteness_check or "
       "native_step_equals_the_eager_step or native_sums_are_float64 or "
       "jax_native_path_equals"],
      env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(__file__))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-2000:]
  assert "skipped" not in out.stdout, out.stdout[-2000:]  # the fp16 ones need F16C: it is here


def test_chain_steps_its_last_optimizer_in_place():
  """``oh.chain(clip, adamw_bf16)``: ``optax.chain``'s state and update, and
  an ``update_and_apply`` whose kernel writes the params in place (no
  apply_updates pass), with the bits of ``optax.chain`` + ``optax.apply_updates``;
  nested chains and extra args too."""
  params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((256, 128)), jnp.bfloat16),
            "b": jnp.zeros((128,), jnp.float32)}
  grads = [jax.tree.map(lambda p, k=k: jnp.asarray(
      np.random.default_rng(k).standard_normal(p.shape) * 3.0, p.dtype), params)
      for k in range(1, 4)]

  def make(chain):
    return chain(optax.clip_by_global_norm(1.0),
                 chain(optax.scale(0.5), oh.adamw_bf16(1e-2, skip_nonfinite=True)))

  ref_tx, tx = make(optax.chain), make(oh.chain)
  assert oh._in_place.step_of(tx) is not None
  assert jax.tree.structure(ref_tx.init(params)) == jax.tree.structure(tx.init(params))

  def protocol(p, s, g):
    u, s = ref_tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  in_place = jax.jit(lambda p, s, g: oh.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  protocol = jax.jit(protocol)
  a = (jax.tree.map(jnp.copy, params), tx.init(params))  # donated
  b = (params, tx.init(params))
  for g in grads:
    a, b = in_place(*a, g), protocol(*b, g)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))
  assert not np.array_equal(np.asarray(a[0]["w"]), np.asarray(params["w"]))

  state = tx.init(params)
  hlo = in_place.lower(params, state, grads[0]).compile().as_text()  # the step compiled above
  calls = [line for line in hlo.splitlines()  # in the skip's branch
           if jax_native.TARGET in line and "custom-call(" in line]
  assert len(calls) == 2 * (jax.default_backend() == "cpu" and jax_native.available())
  if calls:  # the bf16 param: the kernel's new param into the param's buffer (operand 2)
    w_call = next(c for c in calls if "bf16[256,128]" in c)
    assert "output_to_operand_aliasing={{0}: (2, {})" in w_call
  with pytest.raises(ValueError, match="at least one"):
    oh.chain()
  with pytest.raises(ValueError, match="a state of another chain"):
    oh.update_and_apply(tx, grads[0], state[:1], params)


def test_every_scaled_adam_configuration_has_its_entry_points():
  """optax_half_native's table of ScaledAdam configurations (which JAX's
  ``scaled_adam_takes`` reads) names entry points the ctypes library has."""
  import optax_half_native as native  # noqa: PLC0415
  if native.library() is None:
    pytest.skip("no kernel library")
  configs = native.SCALED_ADAM_CONFIGS + (
      native.SCALED_ADAM_F16_CONFIGS if native.has_f16(native.library()) else ())
  for config in configs:
    assert native.scaled_adam_kernels(*config) is not None, config
  assert native.scaled_adam_kernels("F", "F", "B") is None


def _landing_edges(n=16 * 48 + 3, seed=31):
  """bf16 params for the landing's one check per wide block (Lanes16.landed_lanes):
  blocks of ordinary weights (every lane lands through the check) and blocks
  with one lane, or all lanes, at its edges: zeros of both signs, subnormals,
  exponents near 2^-126 (a step's t - p may be subnormal, which XLA flushes),
  the tops and bottoms of binades (a step crosses them), the largest
  values, Infs and NaN; then runs of weights near 0 (adamw_range's windows)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(n).astype(np.float32)
  edges = np.float32([0.0, -0.0, 1e-40, -3e-39, 1.5 * 2.0**-126, 2.0**-121, 1.5 * 2.0**-120,
                      -1.75 * 2.0**-120, 2.0**-119, 1.99 * 2.0**-119, 1.5 * 2.0**-118,
                      1.9921875, -1.9921875, 1.0, -1.0, 0.5, 3.3e38, -3.3e38, np.inf,
                      -np.inf, np.nan])
  for k, e in enumerate(edges):  # one odd lane in block 2k + 1, at lane k % 16
    w[16 * (2 * k + 1) + k % 16] = e
  tiny = np.exp2(rng.uniform(-127, -116, 16)) * rng.choice([-1, 1], 16)
  w[16 * 44:16 * 45] = tiny  # a whole block about 2^-119
  w[16 * 45:16 * 46] = np.resize(edges, 16)
  # Then 2048 blocks of weights within a step of 0 and of ordinary ones, in
  # runs: the kernel stops checking where many blocks fail, and checks again.
  near = rng.standard_normal(16 * 2048).astype(np.float32)
  near[:16 * 512] *= 1e-3
  near[16 * 1024:16 * 1536] *= 1e-3
  return np.concatenate([w, near])


# make test: every compensation once and every step size at least once; the rest slow.
_EDGE_CASES = [(c, lr) for c in ("kahan", "split", "stochastic", "none", "master")
               for lr in (2.0**-126, 1e-2, 1.0)]
_EDGE_DEFAULT = [("kahan", 2.0**-126), ("split", 1.0), ("stochastic", 1e-2), ("none", 1.0),
                 ("master", 2.0**-126)]


@pytest.mark.parametrize("compensation, lr", default_or_slow(_EDGE_CASES, _EDGE_DEFAULT))
def test_the_kernel_lands_at_the_edges_of_its_block_check(compensation, lr, monkeypatch):
  """The wide lanes check a block once for an exact landing (t - p has no
  bits below bf16's and p + (t - p) is t), in windows of blocks that stop
  checking where many fail, and take the general write otherwise. At the check's edges
  (``_landing_edges``), with steps of about 2^-126 (t - p subnormal for the
  smallest params), 1e-2 (across binade tops) and 1 (sign changes, jumps):
  torch's kernel equals its eager step, and JAX's kernel, through
  ``tx.update`` and in place, equals the composed transformation, params and
  every state leaf (in place, only a zero's sign may differ,
  docs/algorithms.md#landing-exactly), bit for bit (a NaN only has to be a NaN)."""
  w = _landing_edges()
  grads = [_values(40 + t, w.shape, 0.1) for t in range(3)]
  grads[0][::7] *= 1e-6  # ratios m / sqrt(v) away from 1
  for g in grads:  # zeros stay zeros: -0.0 lands on +0.0 (p + (t - p))
    g[w == 0] = 0.0

  def make_torch(params, fused):
    if compensation == "master":
      return tb.adam_fp32_master(params, lr, weight_decay=0.0, fused=fused)
    return tb.adamw_bf16(params, lr, weight_decay=0.0, compensation=compensation, key=3,
                         fused=fused)
  runs = []
  for fused in (None, False):
    p = torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16))
    opt = make_torch([p], fused)
    for g in grads:
      p.grad = torch.from_numpy(g).to(torch.bfloat16)
      opt.step()
    runs.append([p.detach()] + [v for k, v in opt.state[p].items() if k != "step"])
  for a, b in zip(*runs):
    _same_but_nan_bits(a.float().numpy() if a.dtype == torch.bfloat16 else a.numpy(),
                       b.float().numpy() if b.dtype == torch.bfloat16 else b.numpy(),
                       (compensation, lr))
  if jax.default_backend() != "cpu":
    return

  def make_jax():
    if compensation == "master":
      return oh.adam_fp32_master(lr, weight_decay=0.0)
    return oh.adamw_bf16(lr, weight_decay=0.0, compensation=compensation, key=3)

  def run(in_place):
    step = jitted_step(make_jax(), in_place)
    params = {"w": jnp.asarray(w, jnp.bfloat16)}
    state = make_jax().init(params)
    for g in grads:
      params, state = step(params, state, {"w": jnp.asarray(g, jnp.bfloat16)})
    return [np.asarray(x) for x in jax.tree.leaves((params, state))]

  with monkeypatch.context() as m:
    m.setattr(jax_native, "available", lambda: False)
    composeds = {in_place: run(in_place) for in_place in (False, True)}
  for in_place in (False, True):
    kernel, composed = run(in_place), composeds[in_place]
    for a, b in zip(kernel[1:], composed[1:]):
      _same_but_nan_bits(a.astype(np.float32), b.astype(np.float32), (compensation, lr, in_place))
      assert a.dtype == b.dtype
    for a in kernel:  # the kernel's bf16 NaNs are round_nearest's
      if a.dtype == jnp.bfloat16:
        assert (a.view(np.uint16)[np.isnan(a.astype(np.float32))] == 0x7FC0).all(), (
            compensation, lr, in_place)
    a, b = kernel[0].view(np.uint16), composed[0].view(np.uint16)
    differ = (a != b) & ~(np.isnan(kernel[0].astype(np.float32))
                          & np.isnan(composed[0].astype(np.float32)))
    assert not (differ.any() and not in_place), (compensation, lr)
    assert (((a | b)[differ] & 0x7FFF) == 0).all(), (compensation, lr, in_place)


# -- the torch step's replay (adam._NativeReplay) ----------------------------------

REPLAY_CASES = {
    "bf16/kahan": (lambda ps: tb.adamw_bf16(ps, 1e-2), torch.bfloat16),
    "bf16/stochastic": (lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="stochastic"),
                        torch.bfloat16),
    "bf16/split": (lambda ps: tb.adamw_bf16(ps, 1e-2, compensation="split"), torch.bfloat16),
    "bf16/adam_fp32_master": (lambda ps: tb.adam_fp32_master(ps, 1e-2), torch.bfloat16),
    "fp16/kahan": (lambda ps: tb.adamw_bf16(ps, 1e-2), torch.float16),
    "fp32/scale_by_adamw": (lambda ps: tb.scale_by_adamw(ps, 1e-2), torch.float32),
    "bf16/kahan, two groups, maximize": (lambda ps: tb.adamw_bf16(
        [{"params": ps[:2], "lr": 3e-2, "maximize": True}, {"params": ps[2:], "b1": 0.8}], 1e-2),
        torch.bfloat16),
}
REPLAY_SHAPES = [(33, 17), (5,), (), (70,)]


def _replayed_run(make, dtype, replay: bool, monkeypatch) -> tuple:
  """Twelve steps with what a training loop does between them: gradients
  written into their tensors or made anew, a changed lr and betas, a param
  written from outside, a moment swapped, a step count written through
  ``.data`` (no version left), a moment's storage swapped, a group's params
  reordered, a gradient missing for a step. ``replay=False``: every step the
  full one."""
  from torch_bridge import adam  # noqa: PLC0415
  replayed = []
  with monkeypatch.context() as patch:
    if not replay:
      patch.setattr(adam._NativeReplay, "of", classmethod(lambda cls, *a: None))
    step = adam._NativeReplay.step
    patch.setattr(adam._NativeReplay, "step",
                  lambda self, *a: replayed.append(step(self, *a)) or replayed[-1])
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
              for s in REPLAY_SHAPES]
    opt = make(params)
    for t in range(12):
      grads = [(torch.randn(p.shape, generator=gen) * 0.1).to(dtype) for p in params]
      for p, g in zip(params, grads):
        if p.grad is None or t == 3:
          p.grad = g.clone()  # a new tensor (a new address, most likely)
        else:
          p.grad.copy_(g)
      if t == 2:
        opt.param_groups[0]["lr"] *= 0.5
        opt.param_groups[-1]["betas"] = (0.85, 0.99)
      if t == 4:
        with torch.no_grad():
          params[1].mul_(0.5)
      if t == 5:
        opt.state[params[0]]["mu"] = opt.state[params[0]]["mu"].clone()
      if t == 6:
        opt.state[params[3]]["step"].data.add_(3)
      if t == 7:
        opt.state[params[1]]["nu"].data = opt.state[params[1]]["nu"].data.clone()
      if t == 8:
        opt.param_groups[0]["params"].reverse()
      if t == 9:
        params[2].grad = None
      opt.step()
  return (params, opt), replayed


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_torch_replayed_steps_equal_the_full_step(name, monkeypatch):
  """After a CPU step that took every param, the next steps run the same kernel
  tables again (adam._NativeReplay): bit for bit the full step's params and
  state, taken only where nothing they point at changed."""
  make, dtype = REPLAY_CASES[name]
  if dtype == torch.float16 and not native_lib.has_f16(native_lib.library()):
    pytest.skip("no fp16 kernel on this CPU")
  run, replayed = _replayed_run(make, dtype, True, monkeypatch)
  full, none = _replayed_run(make, dtype, False, monkeypatch)
  assert_same_torch_runs(run, full)
  assert none == []
  # Step 0 makes the tables; 1-3 replay them (2: an lr and betas read anew; 3: new
  # gradient tensors); 4 (a param written) and 5 (a moment swapped) take the full
  # step, which makes them again; 6 replays (the count read anew); 7 (a storage
  # swapped) and 8 (params reordered) take the full step; 9 (a gradient missing)
  # makes no tables, so 10 does not try; 11 replays.
  assert replayed == [True, True, True, False, False, True, False, False, False, True], replayed


def test_torch_replayed_step_checks_the_params_as_the_full_step():
  """A param given another dtype in place of its storage (``.data =`` keeps its
  address and version counter) is the full step's error, not a step of the old
  dtype's kernel."""
  p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
  opt = tb.adamw_bf16([p], 1e-2)
  for _ in range(2):
    p.grad = torch.randn(8).to(torch.bfloat16)
    opt.step()
  p.data = p.data.view(torch.float16)
  p.grad = torch.randn(8).to(torch.float16)
  with pytest.raises(ValueError, match="float16"):
    opt.step()


def test_torch_replayed_step_host_work_does_not_grow_with_tensors():
  """A replayed CPU step makes the same Python calls in torch_bridge for 8 and
  for 40 tensors, and no torch op but the step counts' reads (on the CPU, no
  sync) and their advance."""
  from suite_helpers import host_work  # noqa: PLC0415

  def work(n):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64 + k, generator=gen).to(torch.bfloat16))
              for k in range(n)]
    for p in params:
      p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    opt = tb.adamw_bf16(params, 1e-2)
    opt.step()
    before = [p.clone() for p in params]
    calls, ops = host_work(opt.step)
    assert all(not torch.equal(a, b) for a, b in zip(before, params))  # it stepped
    return calls, ops

  (small, small_ops), (large, large_ops) = work(8), work(40)
  assert small == large and sum(small.values()) < 100, (small, large)
  for n, ops in ((8, small_ops), (40, large_ops)):
    assert {k: v for k, v in ops.items() if "profiler" not in k} == {
        "aten._local_scalar_dense.default": n, "aten._foreach_add_.Scalar": 1}, ops
