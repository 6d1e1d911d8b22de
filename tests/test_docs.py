"""Every public function and class has an ``Example`` that runs, the optimizers cite their sources.

The public API is each package's ``__all__`` and the ``__all__`` of its public
modules. Each docstring example runs here as a doctest (``make test`` runs
them all); constants (``STREAM_PARAMS``, tolerance tables) are exempt.
"""

import doctest
import importlib
import inspect

import pytest

pytest.importorskip("torch")

MODULES = ["optax_half", "optax_half.rounding", "optax_half.checkpoint", "optax_half.schedules",
           "optax_half.nnx", "optax_half.train_state",
           "torch_bridge", "torch_bridge.rounding", "torch_bridge.parity", "torch_bridge.convert",
           "torch_bridge.dlpack", "torch_bridge.schedules"]
# The optimizers and wrappers: their docstrings cite the papers and code they port.
CITING = {"adam_fp32_master", "adamw_bf16", "scale_by_adamw", "master_weights", "kahan_summation",
          "stochastic_rounding", "dynamic_loss_scale", "scaled_adam", "eden",
          "preheat_decay_schedule"}


def _public():
  """(module name, name, object) of every public callable."""
  out, seen = [], set()
  for module_name in MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.ismodule(obj) or not callable(obj) or id(obj) in seen:
        continue
      seen.add(id(obj))
      out.append((module_name, name, obj))
  return out


PUBLIC = _public()


@pytest.mark.parametrize("module_name, name, obj", PUBLIC,
                         ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_has_an_example(module_name, name, obj):
  doc = inspect.getdoc(obj) or ""
  assert "Example" in doc and ">>>" in doc, f"{module_name}.{name} has no runnable Example"
  if name in CITING:
    assert "References" in doc, f"{module_name}.{name} cites no References"


def _doctests():
  finder = doctest.DocTestFinder(exclude_empty=True)
  out, seen = [], set()
  for module_name in MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.ismodule(obj) or not callable(obj):
        continue
      if id(obj) in seen:  # re-exported (optax_half.eden is optax_half.schedules.eden)
        continue
      seen.add(id(obj))
      # Named by module: optax_half.adamw_bf16 and torch_bridge.adamw_bf16 both run.
      for test in finder.find(obj, f"{module_name}.{name}", module=False, globs={}):
        if test.examples:
          out.append(test)
  return out


DOCTESTS = _doctests()


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_example_runs(test):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out = []
  result = runner.run(test, out=out.append)
  assert result.failed == 0, "".join(out)
