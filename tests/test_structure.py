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
