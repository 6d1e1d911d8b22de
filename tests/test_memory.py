"""Memory: the state's bytes and the compiled temporaries of init and step, per
optimizer, against the table in docs/algorithms.md#memory; and the eager init's
process high-water mark (a subprocess)."""

import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_half as oh
from optax_half import _native

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The table's first column -> (param dtype, optimizer).
OPTIMIZERS = {
    "`optax.adamw` (fp32 params)": (jnp.float32, lambda: optax.adamw(1e-3)),
    "`adamw_bf16` kahan": (jnp.bfloat16, lambda: oh.adamw_bf16(1e-3)),
    "`adamw_bf16` split": (jnp.bfloat16, lambda: oh.adamw_bf16(1e-3, compensation="split")),
    "`adamw_bf16` stochastic": (
        jnp.bfloat16, lambda: oh.adamw_bf16(1e-3, compensation="stochastic")),
    "`adamw_bf16` none": (jnp.bfloat16, lambda: oh.adamw_bf16(1e-3, compensation="none")),
    "`adam_fp32_master`": (jnp.bfloat16, lambda: oh.adam_fp32_master(1e-3)),
    "`adamw_bf16` kahan, fp16 params": (jnp.float16, lambda: oh.adamw_bf16(1e-3)),
    "`adamw_bf16` kahan, `flat_state=True`": (
        jnp.bfloat16, lambda: oh.adamw_bf16(1e-3, flat_state=True)),
    "`adam_fp32_master`, `flat_state=True`": (
        jnp.bfloat16, lambda: oh.adam_fp32_master(1e-3, flat_state=True)),
    "`kahan_summation(optax.adam)`": (jnp.bfloat16, lambda: oh.kahan_summation(optax.adam(1e-3))),
    "`scaled_adam`": (jnp.bfloat16, lambda: oh.scaled_adam(1e-3)),
}


def memory_table() -> dict:
  """label -> (state, init, update, update_and_apply, update with gradients made in the
  step) bytes per param, from the doc."""
  text = (ROOT / "docs" / "algorithms.md").read_text()
  section = text[text.index("### Memory"):]
  section = section[:section.index("\n#", 1)]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and re.fullmatch(r"[\d.]+", cells[1]):
      rows[cells[0]] = tuple(float(c) for c in cells[1:])
  return rows


def test_the_table_names_every_optimizer():
  assert set(memory_table()) == set(OPTIMIZERS)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("label", list(OPTIMIZERS))
def test_state_and_compiled_temporaries(label):
  state_b, init_b, update_b, in_place_b, in_step_b = memory_table()[label]
  dtype, make = OPTIMIZERS[label]
  tx = make()
  shapes = [(256, 256)] * 3 + [(128, 512)]
  params = {f"p{i}": jax.ShapeDtypeStruct(s, dtype) for i, s in enumerate(shapes)}
  n = sum(a * b for a, b in shapes)
  state = jax.eval_shape(tx.init, params)
  assert _nbytes(state) / n == pytest.approx(state_b, abs=0.01)
  init = jax.jit(tx.init).lower(params).compile()
  assert init.memory_analysis().temp_size_in_bytes / n == pytest.approx(init_b, abs=0.01)
  kernel = jax.default_backend() == "cpu" and _native.available() and (
      dtype != jnp.float16 or _native.has_f16())
  if not kernel:
    pytest.skip("the step's temporaries are the kernel's (CPU, built)")

  def update(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def in_place(p, s, g):
    return oh.update_and_apply(tx, g, s, p)

  for step, expected in ((update, update_b), (in_place, in_place_b)):
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / n
    assert temp == pytest.approx(expected, abs=0.01), step.__name__

  # A training step: the gradients are made in the step (XLA's own buffers, which the
  # kernel writes), so nothing is allocated beyond them.
  def loss(p):
    return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(p))

  def train_step(p, s):
    u, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, u), s

  compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state).compile()
  beyond = compiled.memory_analysis().temp_size_in_bytes / n - jnp.dtype(dtype).itemsize
  assert max(beyond, 0.0) == pytest.approx(in_step_b, abs=0.01)


# The eager init's high-water mark: params, then the state, and at most one leaf
# more, plus SLACK for what the first call compiles and the interpreter allocates.
LEAVES, SIDE = 8, 2048
SLACK = 48 * 2**20

_PROBE = r"""
import json, sys
import jax, jax.numpy as jnp
import optax_half as oh

def status(field):
  for line in open("/proc/self/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024

txs = {"kahan": oh.adamw_bf16(1e-3), "stochastic": oh.adamw_bf16(1e-3, compensation="stochastic"),
       "split": oh.adamw_bf16(1e-3, compensation="split"), "master": oh.adam_fp32_master(1e-3),
       "kahan flat_state": oh.adamw_bf16(1e-3, flat_state=True),
       "master flat_state": oh.adam_fp32_master(1e-3, flat_state=True)}
leaves, side = int(sys.argv[1]), int(sys.argv[2])
params = {f"p{i}": jnp.full((side, side), 0.01 * (i + 1), jnp.bfloat16) for i in range(leaves)}
jax.block_until_ready(params)
jax.block_until_ready(oh.adamw_bf16(1e-3).init({"w": jnp.ones(3, jnp.bfloat16)}))  # JAX warm
out = {}
for name, tx in txs.items():
  base = status("VmRSS")
  open("/proc/self/clear_refs", "w").write("5")
  state = jax.block_until_ready(tx.init(params))
  peak, kept = status("VmHWM") - base, status("VmRSS") - base
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  out[name] = dict(above=peak - nbytes, kept=kept - nbytes)
  del state
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux /proc only")
def test_eager_init_high_water_mark():
  # Each array its own mapping, returned when freed: the resident set follows the arrays.
  env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
  proc = subprocess.run([sys.executable, "-c", _PROBE, str(LEAVES), str(SIDE)],
                        capture_output=True, text=True, env=env, cwd=ROOT, check=True)
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  leaf = SIDE * SIDE * 2
  for name, r in out.items():
    assert r["above"] <= leaf + SLACK, (name, r)
    assert r["kept"] <= SLACK, (name, r)  # nothing of the tree's size left behind
