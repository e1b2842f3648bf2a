"""The package's shape: layers that import only downwards, no import circle, and strategy
and objective names written only where they are registered."""

import ast
import pathlib

import pytest

from bdlm_jax.objectives import OBJECTIVES
from bdlm_jax.parallel.registry import SINGLE_DEVICE, STRATEGIES

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "bdlm_jax"
# Bottom to top: a module may import its own layer and those below it, never one above.
LAYERS = [
    ["bdlm_jax.errors", "bdlm_jax.checksums"],
    ["bdlm_jax.config"],
    ["bdlm_jax.kernels"],
    ["bdlm_jax.models"],
    ["bdlm_jax.objectives"],
    ["bdlm_jax.parallel"],
    ["bdlm_jax.configure", "bdlm_jax.spec", "bdlm_jax.batch", "bdlm_jax.params",
     "bdlm_jax.optimizer", "bdlm_jax.loss", "bdlm_jax.drafting", "bdlm_jax.train", "bdlm_jax.metrics",
     "bdlm_jax.data", "bdlm_jax.checkpoint", "bdlm_jax.sample", "bdlm_jax.evaluate",
     "bdlm_jax.feed", "bdlm_jax.loop"],
    ["bdlm_jax.analysis"],
    ["bdlm_jax"],  # the public API (__init__)
]


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules it imports (`from a import b` names a.b when b is a
  module), read from the source with `ast`, late imports inside functions included."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                 else node.module for a in node.names}
    graph[name] = {d for d in deps if d in modules and d != name}
  return graph


def _layer(module: str) -> int:
  best = None
  for i, prefixes in enumerate(LAYERS):
    for p in prefixes:
      if module == p or module.startswith(p + "."):
        if best is None or len(p) > best[1]:
          best = (i, len(p))
  assert best is not None, f"{module} is in no layer of LAYERS"
  return best[0]


def test_no_module_imports_a_layer_above_its_own():
  upward = [f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
            if _layer(d) > _layer(m)]
  assert not upward, upward


def test_the_package_has_no_import_cycle():
  graph, state, cycles = import_graph(), {}, []

  def visit(node, path):
    state[node] = "open"
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        cycles.append(path[path.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, path + [dep])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert not cycles, cycles


def _string_literals(path: pathlib.Path):
  """(line, value) of every string constant outside docstrings."""
  tree = ast.parse(path.read_text())
  docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
      yield node.lineno, node.value


def _code_files():
  yield from PACKAGE.rglob("*.py")
  yield from (ROOT / "experiments").glob("*.py")
  yield ROOT / "run.py"


def test_strategy_names_are_written_only_in_the_registry():
  # "none" is also a value of other settings (model.remat, a plan's travel): the registry's
  # SINGLE_DEVICE names it wherever it means the strategy.
  names = set(STRATEGIES) - {SINGLE_DEVICE}
  found = [f"{path.relative_to(ROOT)}:{line}: {value!r}" for path in _code_files()
           if path.name != "registry.py" for line, value in _string_literals(path)
           if value in names]
  assert not found, found


def _objective_name_branches(path: pathlib.Path):
  """Comparisons, match cases and dict keys (`{"ar": ...}`, `dict(ar=...)`) whose other side
  or key is an objective's name: written out, as a module constant bound to one, or as an
  objective module's `NAME`."""
  names = set(OBJECTIVES)
  tree = ast.parse(path.read_text())
  constants = {t.id for node in tree.body if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Constant) and node.value.value in names
               for t in node.targets if isinstance(t, ast.Name)}
  is_name = lambda n: (isinstance(n, ast.Constant) and n.value in names) or (
      isinstance(n, ast.Name) and n.id in constants) or (
      isinstance(n, ast.Attribute) and n.attr == "NAME") or (
      isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in n.elts))
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare) and any(map(is_name, [node.left, *node.comparators])):
      yield node.lineno
    elif isinstance(node, ast.match_case) and any(
        isinstance(p, ast.MatchValue) and is_name(p.value) for p in ast.walk(node.pattern)):
      yield node.pattern.lineno
    elif isinstance(node, ast.Dict) and any(k is not None and is_name(k) for k in node.keys):
      yield node.lineno
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "dict" and any(k.arg in names for k in node.keywords)):
      yield node.lineno


def test_no_code_outside_the_objectives_branches_on_an_objective_name():
  files = [*PACKAGE.rglob("*.py"), ROOT / "run.py"]
  found = [f"{path.relative_to(ROOT)}:{line}" for path in files
           if "objectives" not in path.parts for line in _objective_name_branches(path)]
  assert not found, found


@pytest.mark.parametrize("source, caught", [
    ("if cfg.objective.name == 'dflash':\n  pass\n", True),
    ("if o.name in ('ar', 'bd3lm'):\n  pass\n", True),
    ("match name:\n  case 'fast_dllm_v2':\n    pass\n", True),
    ("likelihood = {'bd3lm': 'NELBO', 'ar': 'NLL'}.get(objective)\n", True),
    ("likelihood = dict(ar='NLL').get(objective)\n", True),
    ("AR = 'ar'\nif objective == AR:\n  pass\n", True),
    ("if cfg.objective.name != ar.NAME:\n  pass\n", True),
    ("if name == 'layers':\n  pass\n", False),
    ("counts = {'layers': 2}\nAR = 'ar'\nx = AR\n", False),
])
def test_the_name_branch_check_sees_every_spelling(tmp_path, source, caught):
  path = tmp_path / "m.py"
  path.write_text(source)
  assert bool(list(_objective_name_branches(path))) == caught
