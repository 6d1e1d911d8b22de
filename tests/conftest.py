"""Shared helpers: numeric comparisons in ULPs, bitwise ones of torch runs, random trees."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import optax
import pytest

# The `parity` fixture, loaded the way users opt in to it. Only with torch
# installed: without it the JAX-only tests still run (the torch ones skip).
if importlib.util.find_spec("torch") is not None:
  pytest_plugins = ["torch_bridge.pytest_plugin"]



# Most tests build a fresh optimizer and jit it: the same XLA program again, under a new
# Python function. JAX's persistent compilation cache is keyed by the program, so each
# distinct program compiles once per run instead of once per test (about 0.25 s each on
# 2 CPU cores). One folder per run: made by the first process (pytest-xdist's workers
# inherit it from the controller) and removed by it at the end.
# OPTAX_HALF_TEST_XLA_CACHE=0 turns it off.
_CACHE_VAR = "OPTAX_HALF_TEST_XLA_CACHE_DIR"
_OWN_CACHE = False
if os.environ.get("OPTAX_HALF_TEST_XLA_CACHE", "1") != "0":
  if _CACHE_VAR not in os.environ:
    os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="optax_half_test_xla_cache_")
    _OWN_CACHE = True
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VAR])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ.pop(_CACHE_VAR), ignore_errors=True)


def pytest_configure(config):
  """Under pytest-xdist, the controller builds the kernel's libraries
  (optax_half_native: torch's, and JAX's handlers with every step) before the
  workers start, all at once, into the cache the workers then load from;
  otherwise each worker would build them on first use, at the same time as
  the other. A failed build is left for the tests to report."""
  if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
    return
  builds = ["import optax_half_native as n; n.library()",
            "import jax, optax_half_native as n; n.ffi_steps(jax.ffi.include_dir())"]
  for proc in [subprocess.Popen([sys.executable, "-c", code]) for code in builds]:
    proc.wait()


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: np.int16, 4: np.int32}


def ordered_bits(x) -> np.ndarray:
  """Float bits mapped to integers that are monotone in the value (int64)."""
  x = np.asarray(x)
  n = x.dtype.itemsize
  i = x.view(_INT[n]).astype(np.int64)
  return np.where(i < 0, -(i & (2 ** (8 * n - 1) - 1)), i)


def ulp_diff(a, b) -> int:
  """Largest distance, in units in the last place of the dtype, between a and b."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype, (a.dtype, b.dtype)
  if a.size == 0:
    return 0
  return int(np.abs(ordered_bits(a) - ordered_bits(b)).max())


def bitwise_equal(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
      a.view(_UINT[a.dtype.itemsize]), b.view(_UINT[b.dtype.itemsize]))


def torch_bits(t):
  """A torch tensor's bytes, as a flat uint8 tensor."""
  import torch  # noqa: PLC0415 (torch is optional here)
  return t.detach().reshape(-1).view(torch.uint8)


def assert_same_torch_runs(a, b):
  """Two ``(params, optimizer)`` runs: every param and every state tensor
  with the same dtype and bits, the same state keys, the other state values
  equal."""
  import torch  # noqa: PLC0415
  (params_a, opt_a), (params_b, opt_b) = a, b
  assert len(params_a) == len(params_b)
  for pa, pb in zip(params_a, params_b):
    assert pa.dtype == pb.dtype and torch.equal(torch_bits(pa), torch_bits(pb))
    sa, sb = opt_a.state[pa], opt_b.state[pb]
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
      if torch.is_tensor(v):
        assert v.dtype == sb[k].dtype and torch.equal(torch_bits(v), torch_bits(sb[k])), k
      else:
        assert v == sb[k], k


def random_tree(seed, shapes, dtype):
  key = jax.random.key(seed)
  return {name: jax.random.normal(jax.random.fold_in(key, i), shape).astype(dtype)
          for i, (name, shape) in enumerate(shapes.items())}


def jit_step(tx):
  """One jitted step of ``tx``: ``(params, state, grads) -> (params, state)``."""
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


@pytest.fixture
def rng():
  return np.random.default_rng(0)


def jitted_step(tx, in_place: bool):
  """A jitted training step ``(params, state, grads) -> (params, state)``:
  ``oh.update_and_apply`` (``in_place``) or ``tx.update`` + ``optax.apply_updates``."""
  import optax_half as oh  # noqa: PLC0415

  def step(p, s, g):
    if in_place:
      return oh.update_and_apply(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step)
