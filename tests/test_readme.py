"""The README's examples run and print what the README says they print."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"


BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_a_jax_and_a_torch_example():
  assert any("optax_half" in b for b in BLOCKS) and any("torch_bridge" in b for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_usage_snippet_runs_and_matches_its_comment(block):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(block, str(README), "exec"), {})
  printed = out.getvalue().strip()
  promised = re.search(r"print\(.*\)\s+# (.*)", block).group(1).strip()
  assert printed == promised, (printed, promised)


def test_readme_claim_plain_bf16_adamw_stays_at_one():
  import jax
  import jax.numpy as jnp
  import optax
  params = {"w": jnp.full((4,), 1.0, jnp.bfloat16)}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=1e-2))
  state = tx.init(params)
  grads = {"w": jnp.full((4,), 0.5, jnp.bfloat16)}
  for _ in range(100):
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert float(params["w"][0]) == 1.0
