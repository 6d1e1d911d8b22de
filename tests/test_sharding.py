"""Every optax_half transformation on params sharded over 8 CPU devices.

``tests/sharded_jax.py`` runs in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (JAX reads it once, at
start-up, so this process cannot): each configuration steps the same params
and gradients on one device and sharded FSDP-style (``NamedSharding``,
matrices split over the data axis; a 4 x 2 mesh too), with explicit and with
automatic axis types. Asserted here, per run:

* every per-element state leaf has its param's sharding, after an eager
  ``init``, a jitted ``init`` and the jitted steps;
* elementwise optimizers equal the one-device run bit for bit (params and
  every state leaf), including a skipped step whose +inf sits in one shard only;
* optimizers with a global norm (ScaledAdam's clipping and RMS, optax's
  clip_by_global_norm) reduce across shards: within a few ULPs / a relative
  bound of the one-device run (only the order of the partial sums differs);
* no all-gather in the compiled step, and no native custom call (it has no
  partitioning rule; the composed transformation runs on several devices);
* sharded optimizer states checkpoint and resume bit for bit with
  ``optax_half.checkpoint`` (Orbax), and move between one device and the mesh.

The subprocess compiles some 120 sharded programs (minutes on 2 cores): it is
marked ``slow`` (``make test-slow``, run by CI) and runs once per session.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sharded_jax as sj
from suite_helpers import once

from optax_half import _util

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow

RUNS = [(name, axis, mesh) for name in sj.CONFIGS for axis, mesh in
        [("Explicit", "8"), ("Auto", "8")] + ([("Explicit", "4x2")] if name in sj.MESH_2D else [])]


def _run(_):
  # Eight devices' programs on two cores, beside the other pytest-xdist
  # worker's tests: a device can reach a collective long after the others,
  # and XLA:CPU ends the process when one waits 40 s (its default); 600 s
  # here, inside the run's own 900 s limit.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
             "--xla_cpu_collective_call_terminate_timeout_seconds=600")
  out = subprocess.run([sys.executable, str(HERE / "sharded_jax.py")], env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  rows = once(tmp_path_factory, "sharded_jax", _run)  # one run, whichever worker asks first
  runs = {(r["config"], r["axis_type"].split(".")[-1], r["mesh"]): r
          for r in rows if "config" in r}
  runs.update({r["checkpoint"]: r for r in rows if "checkpoint" in r})
  return runs


@pytest.mark.parametrize("name,axis,mesh", RUNS, ids=["/".join(r) for r in RUNS])
def test_sharded_equals_one_device(results, name, axis, mesh, request):
  if axis == "Auto" and _util.shard_alike is None:
    request.applymarker(pytest.mark.xfail(
        reason="this JAX has no shard_alike: under automatic axes a jitted init's state "
               "is laid out by XLA (docs/algorithms.md#jax-sharding)"))
  r = results[(name, axis, mesh)]
  # State follows the params' sharding (a vacuous check would have checked nothing).
  assert r["checked"] >= 5, r
  assert r["init"] == [] and r["init_jit"] == [] and r["after"] == [], r
  assert r["hlo"] == {"all_gather": 0, "native": 0}, r["hlo"]
  if r["kind"] == "bitwise":
    assert r["params"]["equal"] and r["state"]["equal"], r
  else:
    assert r["params"]["max_ulp"] <= 1 and r["params"]["max_rel"] <= 1e-5, r["params"]
    assert r["state"]["max_ulp"] <= 2 and r["state"]["max_rel"] <= 1e-3, r["state"]
  # The skip is global: a +inf on one device skips the step everywhere.
  assert r["counters"]["sharded"] == r["counters"]["one_device"], r["counters"]
  if name in sj.SKIPPING:
    skipped = r["counters"]["sharded"]
    assert skipped.get("total_notfinite", skipped.get("skipped_steps")) == 1, skipped


@pytest.mark.parametrize("name", sj.CHECKPOINTED)
def test_sharded_checkpoint_resumes_bitwise(results, name):
  """N sharded steps == N/2 + optax_half.checkpoint save/restore + N/2, bit for
  bit; the restored state keeps the shardings of the state it was restored
  into; a sharded checkpoint restores onto one device and back, unchanged."""
  r = results[name]
  assert r["resume"]["params"]["equal"] and r["resume"]["state"]["equal"], r
  assert r["same_layout"] and r["one_device"] and r["round_trip"], r
