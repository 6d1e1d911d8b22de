"""What the tools/ suites share: run a PyTorch test file under pytest with a
plugin that patches torch, then print one line of counts and each failure.
"""

from __future__ import annotations

import os
import sys


class _Collector:
  """One outcome and a one-line reason per test id, gathered in the controller."""

  def __init__(self):
    self.outcomes: dict[str, tuple[str, str]] = {}

  def pytest_runtest_logreport(self, report):
    if report.skipped:
      reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
      self.outcomes.setdefault(report.nodeid, ("skipped", reason))
    elif report.failed:  # a failure in setup or teardown counts too
      outcome = "failed" if report.when == "call" else "error"
      self.outcomes[report.nodeid] = (outcome, _reason(report))
    elif report.when == "call":
      self.outcomes.setdefault(report.nodeid, ("passed", ""))


def _reason(report) -> str:
  crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
  text = crash.message if crash is not None else str(report.longrepr)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  first = lines[0] if lines else "?"
  if len(lines) > 1 and first.endswith(("!", ":")):  # assertEqual's headline alone says little
    first += " " + lines[1]
  return first[:300]


def run(path: str, plugin: str, select: str, env: dict, title: str, pytest_args: list) -> int:
  """Runs ``path``'s tests matching ``select`` with ``-p plugin`` (this folder's
  module, also loaded by ``-n`` workers) and ``env`` set; prints the counts
  under ``title`` and each failing id with its reason. Returns the exit code."""
  import pytest
  here = os.path.dirname(os.path.abspath(__file__))
  repo = os.path.dirname(here)
  os.environ.update(env, PYTORCH_TESTING_DEVICE_ONLY_FOR="cpu")
  # -n workers import the plugin and torch_bridge by name.
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [here, repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
  sys.path[:0] = [here, repo]
  collector = _Collector()
  path = os.path.abspath(path)
  pytest.main([path, "-c", os.devnull, "--rootdir", os.path.dirname(path),
               "-p", "no:cacheprovider", "-p", plugin, "-k", select, "-q", "--tb=short",
               "-W", "ignore::DeprecationWarning", *pytest_args], plugins=[collector])
  counts = dict.fromkeys(("passed", "failed", "skipped", "error"), 0)
  for outcome, _ in collector.outcomes.values():
    counts[outcome] += 1
  print(f"\n== {title}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
        + f" (of {len(collector.outcomes)})")
  for nodeid, (outcome, reason) in sorted(collector.outcomes.items()):
    if outcome in ("failed", "error"):
      print(f"{outcome.upper():7} {nodeid.split('::', 1)[-1]}\n        {reason}")
  return 1 if counts["failed"] or counts["error"] or not collector.outcomes else 0
