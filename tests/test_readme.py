"""The README's JAX example runs and prints what the README says it prints."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_usage_snippet_runs_and_matches_its_comment():
  text = README.read_text()
  block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
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
