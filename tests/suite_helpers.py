"""Helpers that keep ``make test`` short on a 2-core machine.

``default_or_slow``: a parametrization whose listed cases run in ``make test``
and the rest under the ``slow`` marker (``make test-slow``, run by CI after
``make test``), so every case still runs in CI.

``once``: a module-scoped fixture runs once in *each* xdist worker that gets
a test of its module, and ``-n 2`` can spread a module's tests over both
workers: the demo's 500-step runs, the 8-device sharding run and the training
runs would each run twice. ``once`` runs the work in the first worker that
asks and keeps its JSON result in the session's shared temporary directory;
the other workers wait for it (a file lock) and read it. Without xdist it
simply runs.

``one_torch_thread``: torch steps small tensors on as many threads as the
machine has cores; with two workers doing so on two cores, its threads wait
for each other and a small step costs many times its work (300 steps of
examples/train_mlp_torch.py: 18 s of CPU on 2 threads, 0.3 s on one). Tests that train with torch in the worker use one thread.

``host_work``: what one call makes on the host: the Python calls whose code is
in ``torch_bridge`` and the torch ops it dispatches.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib

import pytest


def default_or_slow(cases, default):
  """``cases`` as pytest params: those in ``default`` run in ``make test``, the
  others are marked ``slow``. A case is one argument or a tuple of arguments;
  its id joins the arguments' ``__name__`` (or ``str``) with "-"."""
  assert set(default) <= set(cases), set(default) - set(cases)
  def ident(x):
    return getattr(x, "__name__", str(x))
  return [pytest.param(*(c if isinstance(c, tuple) else (c,)),
                       id="-".join(map(ident, c)) if isinstance(c, tuple) else ident(c),
                       marks=() if c in default else pytest.mark.slow) for c in cases]


def shared_dir(tmp_path_factory) -> pathlib.Path:
  """A directory that every worker of this test session sees."""
  root = tmp_path_factory.getbasetemp()
  return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def once(tmp_path_factory, name: str, compute):
  """``compute(directory)``'s JSON-able result, computed once per session.

  ``directory`` is a fresh directory shared by the workers, for files the
  tests read too. Every worker gets the result as JSON gives it back (tuples
  as lists). A failure is kept as well: the other workers fail with its
  message instead of running it again.
  """
  root = shared_dir(tmp_path_factory)
  result, lock = root / f"{name}.json", root / f"{name}.lock"
  with open(lock, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
    if not result.exists():
      directory = root / name
      directory.mkdir(exist_ok=True)
      try:
        value = {"value": compute(directory)}
      except BaseException as e:  # noqa: BLE001 - kept for the other workers, re-raised
        result.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
      result.write_text(json.dumps(value))
    value = json.loads(result.read_text())
  if "error" in value:
    pytest.fail(f"{name} failed in another worker: {value['error']}", pytrace=False)
  return value["value"]


@contextlib.contextmanager
def one_torch_thread():
  """torch on one intra-op thread inside the block (restored after it)."""
  import torch  # noqa: PLC0415 - only the tests that train with torch need it
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(threads)


def host_work(run, skip=("_triton_kernels",)) -> tuple:
  """``(calls, ops)`` of ``run()``: Counters of the Python functions of
  ``torch_bridge`` it calls (files named in ``skip`` aside) and of the torch
  ops it dispatches (a ``TorchDispatchMode``: an allocation or a scalar read
  is an op)."""
  import collections  # noqa: PLC0415
  import sys  # noqa: PLC0415

  from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

  class Ops(TorchDispatchMode):
    def __init__(self):
      super().__init__()
      self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
      self.ops[str(func)] += 1
      return func(*args, **(kwargs or {}))

  calls = collections.Counter()

  def profile(frame, event, arg):
    name = frame.f_code.co_filename
    if event == "call" and "torch_bridge" in name and not any(s in name for s in skip):
      calls[frame.f_code.co_name] += 1

  mode = Ops()
  with mode:
    sys.setprofile(profile)
    try:
      run()
    finally:
      sys.setprofile(None)
  return calls, mode.ops
