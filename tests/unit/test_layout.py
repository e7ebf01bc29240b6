"""The package layout keeps its layers (issue 33): bytes below the output format, the model below
both, and no module-level import cycle anywhere.

Read from the source with ``ast``: every ``from foldckpt... import`` at module level (imports inside
functions and under ``TYPE_CHECKING`` are deferred on purpose and do not count). Importing
``foldckpt.a.b`` runs ``foldckpt/a/__init__.py`` first, so a package's ``__init__`` counts as a
dependency of every module imported from it: that is how ``inspect`` -> ``convert.journal`` ->
``convert/__init__`` -> ``inspect`` once made a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "foldckpt"
# What each layer may import from foldckpt outside itself.
ALLOWED = {
    "foldckpt.console": {"foldckpt.errors"},
    "foldckpt.io": {"foldckpt.errors"},
    "foldckpt.model": {"foldckpt.errors", "foldckpt.defaults", "foldckpt.io"},
    "foldckpt.format": {"foldckpt.errors", "foldckpt.defaults", "foldckpt.io", "foldckpt.model"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str], types: bool = False) -> set[str]:
    """The foldckpt modules ``path`` imports when it is imported, parent packages included (with
    ``types``, also those it imports for type checking only)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not types:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for item in ast.walk(node):
            names: list[str] = []
            if isinstance(item, ast.ImportFrom) and item.module and item.module.startswith("foldckpt"):
                names = [f"{item.module}.{alias.name}" for alias in item.names] + [item.module]
            elif isinstance(item, ast.Import):
                names = [alias.name for alias in item.names if alias.name.startswith("foldckpt")]
            for name in names:
                parts = name.split(".")  # the root package (its version only) is below every layer
                found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in modules)
    return found


def import_graph(types: bool = False) -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {name: _top_level_imports(path, modules, types) for name, path in paths.items()}
    # a module's own packages run before it, not because of it
    return {
        name: {dep for dep in deps if dep != name and not name.startswith(dep + ".")} for name, deps in graph.items()
    }


@pytest.mark.parametrize("types", [False, True], ids=["at-import", "with-type-only-imports"])
def test_no_module_level_import_cycle(types: bool) -> None:
    """With ``types``: no cycle either through the imports made for type checking only.
    options.py named VerifyReport from verify.py, which imports options.py (issue 46): the
    report now lives in foldckpt.format.report, below both."""
    graph = import_graph(types)
    state: dict[str, str] = {}  # "open" while on the current import chain, then "done"
    chain: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        chain.append(node)
        for dep in sorted(graph[node]):
            assert state.get(dep) != "open", "import cycle: " + " -> ".join([*chain[chain.index(dep) :], dep])
            if dep not in state:
                visit(dep)
        chain.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    graph = import_graph()
    for layer, allowed in ALLOWED.items():
        for module, deps in graph.items():
            if module == layer or module.startswith(layer + "."):
                outside = {dep for dep in deps if not (dep == layer or dep.startswith(layer + "."))}
                reach = {dep for dep in outside if not any(dep == a or dep.startswith(a + ".") for a in allowed)}
                assert not reach, f"{module} imports {sorted(reach)}: {layer} may import only {sorted(allowed)}"


def test_the_package_root_holds_at_most_ten_modules() -> None:
    """The layout asks for at most ten modules directly in foldckpt/ (issue 46 found eleven): a
    module that belongs with others goes into their package."""
    modules = sorted(path.name for path in PACKAGE.glob("*.py") if path.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 10, modules
