"""Run PyTorch's own GradScaler tests on CPU against ``tb.dynamic_loss_scale``.

Usage (from the repo root)::

    .venv/bin/python tools/torch_grad_scaler_suite.py PATH/TO/test_torch.py [-n 2] [--torch] [PYTEST_ARGS...]

``PATH/TO/test_torch.py`` is PyTorch's ``test/test_torch.py`` (of the torch
release installed; it needs ``expecttest``, and ``pytest-xdist`` for ``-n``).
Only the GradScaler tests of ``TestTorchDeviceTypeCPU`` run (``-k`` below).
Before they run, ``torch.GradScaler``, ``torch.amp.GradScaler`` and the
deprecated ``torch.cpu.amp`` / ``torch.cuda.amp`` ``GradScaler`` are replaced
by ``TbGradScaler``: it takes GradScaler's arguments (``device`` first, which
``dynamic_loss_scale`` does not need: its state follows the first scaled
loss) and returns ``tb.dynamic_loss_scale(init_scale, growth_factor,
backoff_factor, growth_interval, enabled=enabled)`` with every other default
(``min_scale=1.0``) as is; ``isinstance(x, torch.amp.GradScaler)`` is then
true of a ``DynamicLossScaler``. ``--torch`` runs the same tests unpatched
(the baseline: all should pass). Prints passed/failed/skipped counts and
each failing test id with a one-line reason; exits 1 if any test failed.

The file is used as a pytest plugin too (``-p torch_grad_scaler_suite``, so
that ``-n`` workers patch as well); the patch is made only when the
environment variable ``TB_GRAD_SCALER_SUITE=patch`` is set, as ``main`` does.
"""

from __future__ import annotations

import os
import sys

import suite_runner

ENV = "TB_GRAD_SCALER_SUITE"
SELECT = ("TestTorchDeviceTypeCPU and (grad_scal or gradscaler or grad_scaler "
          "or params_invalidated)")


class _ScalerMeta(type):
  def __instancecheck__(cls, obj):
    import torch_bridge as tb
    return isinstance(obj, tb.DynamicLossScaler)


class TbGradScaler(metaclass=_ScalerMeta):
  """``torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor,
  growth_interval, enabled)`` -> ``tb.dynamic_loss_scale`` with those values."""

  def __new__(cls, device="cuda", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
              growth_interval=2000, enabled=True):
    import torch_bridge as tb
    del device  # tb's scaler puts its state where the first scaled loss is
    return tb.dynamic_loss_scale(init_scale, growth_factor, backoff_factor, growth_interval,
                                 enabled=enabled)


def patch_torch() -> None:
  import torch
  import torch.amp
  import torch.cpu.amp
  import torch.cuda.amp
  for module in (torch, torch.amp, torch.cpu.amp, torch.cuda.amp):
    module.GradScaler = TbGradScaler


def pytest_configure(config):  # runs in the controller and in every -n worker
  if os.environ.get(ENV) == "patch":
    patch_torch()


def main(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-"):
    print(__doc__)
    return 2
  path, rest = os.path.abspath(argv[0]), argv[1:]
  baseline = "--torch" in rest
  rest = [a for a in rest if a != "--torch"]
  mode = "torch.amp.GradScaler (baseline)" if baseline else "tb.dynamic_loss_scale"
  return suite_runner.run(path, "torch_grad_scaler_suite", SELECT,
                          {ENV: "" if baseline else "patch"},
                          f"PyTorch GradScaler tests on CPU with {mode}", rest)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
