"""Text that ships with every Python: a byte-level corpus from the standard library.

The demo and the examples train a character (byte) level language model on
the source code of a fixed list of standard-library modules. Nothing is
downloaded; the same Python version gives the same bytes everywhere. The last
10% of the corpus is held out for validation. The corpus is whatever the
running Python ships (1.07 MB on CPython 3.11), so numbers differ slightly
between Python versions; within one version they are the same everywhere.
"""

from __future__ import annotations

import argparse
import os
import sysconfig

import numpy as np

# Pure-Python modules present in every CPython >= 3.11 (as ``name.py`` or, like
# ``string`` from 3.14 on, as a package).
MODULES = (
    "argparse", "textwrap", "difflib", "calendar", "functools", "fractions",
    "heapq", "shlex", "string", "dataclasses", "inspect", "typing", "ast",
    "tokenize", "pprint", "statistics", "csv", "configparser", "gettext",
    "random", "bisect", "contextlib", "enum", "copy", "abc", "glob", "fnmatch",
)
VOCAB = 256  # bytes


def corpus() -> np.ndarray:
  """The concatenated UTF-8 bytes of ``MODULES``' sources, as uint8."""
  parts = []
  for name in MODULES:
    stdlib = sysconfig.get_paths()["stdlib"]
    candidates = [os.path.join(stdlib, name + ".py"), os.path.join(stdlib, name, "__init__.py")]
    path = next((c for c in candidates if os.path.exists(c)), None)
    if path is None:
      raise RuntimeError(f"the standard library in {stdlib} has no source for {name!r}: this "
                         "Python ships without its sources (e.g. a stripped container image)")
    with open(path, "rb") as f:
      parts.append(f.read())
  return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


def split(data: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  n = int(len(data) * (1 - val_fraction))
  return data[:n], data[n:]


def batch_starts(n_tokens: int, steps: int, batch: int, context: int, seed: int) -> np.ndarray:
  """``(steps, batch)`` window offsets: the data order of a run, fixed by ``seed``."""
  return np.random.default_rng(seed).integers(0, n_tokens - context - 1, size=(steps, batch))


def windows(data: np.ndarray, starts: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-byte targets, both ``(len(starts), context)`` int32."""
  idx = starts[:, None] + np.arange(context + 1)
  chunk = data[idx].astype(np.int32)
  return chunk[:, :-1], chunk[:, 1:]


def eval_batches(data: np.ndarray, n: int, batch: int, context: int) -> list:
  """``n`` fixed, evenly spaced batches of ``data`` (the same in every run)."""
  starts = np.linspace(0, len(data) - context - 2, n * batch).astype(np.int64)
  return [windows(data, s, context) for s in starts.reshape(n, batch)]


def example_setup(argv=None, quick_steps: int = 80, steps: int = 600, context: int = 64):
  """The examples' shared setup: ``(steps, train bytes, 4 val batches of 16 x context)``.

  ``--steps N`` sets the step count; ``--quick`` makes it ``quick_steps``.
  """
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, help=f"default {steps}; {quick_steps} with --quick")
  parser.add_argument("--quick", action="store_true", help="a few seconds, for the tests")
  args = parser.parse_args(argv)
  train, val = split(corpus())
  return (args.steps or (quick_steps if args.quick else steps), train,
          eval_batches(val, 4, 16, context))
