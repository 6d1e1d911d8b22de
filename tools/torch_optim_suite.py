"""Run PyTorch's OptimizerInfo tests on CPU with AdamW swapped for a torch_bridge optimizer.

Usage (from the repo root; a measuring tool, not part of the test suite)::

    .venv/bin/python tools/torch_optim_suite.py PATH/TO/test_optim.py \
        [--optimizer adamw_bf16|adam_fp32_master] [--torch] [--lenient] [-n 2] [PYTEST_ARGS...]

PATH/TO/test_optim.py: PyTorch's test/test_optim.py matching the installed
torch's ``torch.testing._internal.common_optimizers`` (needs expecttest,
hypothesis; pytest-xdist for ``-n``); the test/optim/ modules it imports are
stubbed when absent. Only ``TestOptimRenewedCPU``'s AdamW OptimizerInfo tests
run (SELECT). Before collection, optim_db's ``torch.optim.AdamW`` entry gets
``optim_cls = AdamW``: a function of that name (the test ids keep it) that
returns ``tb.<optimizer>(params, **kwargs)`` with the test's torch keywords as
they are. ``--torch``: the same tests unpatched (baseline). ``--lenient``: a
diagnostic that looks past the configs torch_bridge refuses by design
(capturable=True, CUDA-only configs): torch.optim.AdamW itself steps those.
Prints passed/failed/skipped/error counts and each failing id with a one-line
reason. The file is also the pytest plugin (``-p torch_optim_suite``, so that
``-n`` workers patch too), active when $TB_OPTIM_SUITE names an optimizer.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import suite_runner

ENV = "TB_OPTIM_SUITE"
SELECT = "TestOptimRenewedCPU and AdamW_cpu"  # ids end in _AdamW_cpu_<dtype>
OPTIMIZERS = ("adamw_bf16", "adam_fp32_master")
REFUSED = ("capturable",)  # keywords torch_bridge refuses when True


def _stub_sibling_modules(test_dirs) -> None:
  """test_optim.py imports three test classes from test/optim/; stub them if missing."""
  sys.path[:0] = [d for d in test_dirs if d not in sys.path]
  try:
    importlib.import_module("optim.test_optim")
    return
  except ImportError:
    pass
  from torch.testing._internal.common_utils import TestCase
  package = types.ModuleType("optim")
  package.__path__ = []
  sys.modules["optim"] = package
  for module, cls in (("test_lrscheduler", "TestLRScheduler"),
                      ("test_optim", "TestDifferentiableOptimizer"),
                      ("test_swa_utils", "TestSWAUtils")):
    stub = types.ModuleType(f"optim.{module}")
    setattr(stub, cls, type(cls, (TestCase,), {}))
    sys.modules[stub.__name__] = stub
    setattr(package, module, stub)


def patch_optim_db(name: str, lenient: bool = False) -> None:
  """Point the AdamW OptimizerInfo at ``tb.<name>`` (``lenient``: see ``--lenient``)."""
  import torch
  from torch.testing._internal.common_optimizers import optim_db

  import torch_bridge as tb
  factory = getattr(tb, name)

  def AdamW(params, **kwargs):  # this name makes the test ids
    if lenient:
      params = list(params) if hasattr(params, "__next__") else params  # a generator
      groups = [kwargs] + ([g for g in params if isinstance(g, dict)]
                           if isinstance(params, list) else [])
      if any(g.get(k) is True for g in groups for k in REFUSED):
        return torch.optim.AdamW(params, **kwargs)
    return factory(params, **kwargs)

  infos = [info for info in optim_db if info.optim_cls is torch.optim.AdamW]
  assert len(infos) == 1, "expected one AdamW entry in optim_db"
  infos[0].optim_cls = AdamW


def pytest_configure(config):  # runs in the controller and in every -n worker
  _stub_sibling_modules([os.path.dirname(os.path.abspath(str(a).split("::")[0]))
                         for a in config.args])
  name, _, lenient = os.environ.get(ENV, "").partition(":")
  if name:
    patch_optim_db(name, lenient == "lenient")


def main(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-"):
    print(__doc__)
    return 2
  path, rest = os.path.abspath(argv[0]), argv[1:]
  baseline, lenient = "--torch" in rest, "--lenient" in rest
  name = "adamw_bf16"
  if "--optimizer" in rest:
    i = rest.index("--optimizer")
    name = rest[i + 1]
    del rest[i:i + 2]
  if name not in OPTIMIZERS:
    raise SystemExit(f"--optimizer must be one of {OPTIMIZERS}; got {name!r}")
  rest = [a for a in rest if a not in ("--torch", "--lenient")]
  mode = ("torch.optim.AdamW (baseline)" if baseline
          else f"tb.{name}" + (" (lenient)" if lenient else ""))
  env = {ENV: "" if baseline else name + (":lenient" if lenient else "")}
  return suite_runner.run(path, "torch_optim_suite", SELECT, env,
                          f"PyTorch AdamW OptimizerInfo tests on CPU with {mode}", rest)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
