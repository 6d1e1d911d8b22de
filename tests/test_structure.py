"""The package's internal imports form no cycle (function-level imports
included): each module can be read, and changed, without the ones that use it."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(package: str) -> dict:
  """module -> the modules of ``package`` it imports, anywhere in its source."""
  graph = {}
  for path in sorted((ROOT / package).glob("*.py")):
    name = f"{package}.{path.stem}" if path.stem != "__init__" else package
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == package:
          deps |= {f"{package}.{a.name}" for a in node.names}
        elif node.module.startswith(package + "."):
          deps.add(node.module)
      elif isinstance(node, ast.Import):
        deps |= {a.name for a in node.names if a.name.startswith(package + ".")}
    graph[name] = {d for d in deps if d != name}
  return graph


def _cycle(graph: dict):
  state = {}

  def visit(node, trail):
    state[node] = "open"
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == "open":
        return trail + [node, dep]
      if dep not in state:
        found = visit(dep, trail + [node])
        if found:
          return found
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [])
      if found:
        return found
  return None


@pytest.mark.parametrize("package", ["optax_half", "torch_bridge"])
def test_no_import_cycle_between_modules(package):
  graph = _imports(package)
  graph.pop(package, None)  # __init__ imports everything by design
  for deps in graph.values():
    deps.discard(package)
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_in_place_step_is_carried_by_the_transformations_type():
  import copy  # noqa: PLC0415

  import optax  # noqa: PLC0415

  import optax_half as oh  # noqa: PLC0415
  from optax_half import _in_place  # noqa: PLC0415
  for tx in (oh.adamw_bf16(1e-3), oh.adam_fp32_master(1e-3, skip_nonfinite=True),
             oh.dynamic_loss_scale(oh.adamw_bf16(1e-3)),
             oh.chain(oh.clip_by_global_norm(1.0), oh.adamw_bf16(1e-3))):
    assert isinstance(tx, _in_place.InPlaceTransformation)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert _in_place.step_of(tx) is not None
    assert _in_place.step_of(copy.deepcopy(tx)) is not None
  assert _in_place.scaled_of(oh.adamw_bf16(1e-3)) is not None
  # optax's wrappers build a plain transformation around it: the two calls run
  assert _in_place.step_of(optax.chain(oh.adamw_bf16(1e-3))) is None
  assert _in_place.step_of(optax.adam(1e-3)) is None
  # The wrappers carry theirs (a master's in-place step lands on its rounding).
  assert _in_place.step_of(oh.kahan_summation(optax.sgd(1e-3))) is not None
  assert _in_place.step_of(oh.master_weights(optax.sgd(1e-3))) is not None
