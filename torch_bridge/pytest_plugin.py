"""pytest fixture ``parity``: JAX/torch parity checks on your own param trees.

Opt in from your ``conftest.py`` (an opt-in, not an auto-loaded entry point,
so that pytest runs that do not ask for it never import torch or JAX)::

    pytest_plugins = ["torch_bridge.pytest_plugin"]

then any test can ask for it::

    def test_my_model_agrees(parity):
      params = nnx.state(model, nnx.Param)           # or a torch state_dict()
      report = parity("adamw_bf16", params, steps=200, dtype="bf16",
                      learning_rate=1e-3, weight_decay=0.1)
      assert report.summary()["param_equal"] == 1.0  # optional, stricter

``parity(...)`` takes the arguments of ``torch_bridge.parity.compare``, runs
it and fails the test with the report's table when a tolerance
(``torch_bridge.parity.TOLERANCES``, or ``tolerances=``) is broken; it returns
the ``ParityReport``. (``python -m pytest -p torch_bridge.pytest_plugin``
loads it for one run.)
"""

from __future__ import annotations

import pytest


@pytest.fixture
def parity():
  """``compare(...)`` that fails the test when a tolerance is broken."""
  from torch_bridge.parity import compare

  def check(name, params, grads=None, steps=100, **kwargs):
    report = compare(name, params, grads, steps, **kwargs)
    if not report.ok:
      pytest.fail("JAX/torch parity broken:\n" + report.table(), pytrace=False)
    return report

  return check
