"""The contract helper itself, on a tiny synthetic source tree and fake wheels (no network, no vLLM).

A query that always answers "yes" would make every contract pass vacuously, so each query is
checked on a case where the answer must be "no" as well as one where it must be "yes".
"""

from __future__ import annotations

import os
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.contract import vllm_source as vs
from tests.contract.vllm_source import (
    Param,
    SourceTree,
    VllmSourceUnavailable,
    release_tree,
    vllm_source,
)

FILES = {
    "vllm/__init__.py": """
        from typing import TYPE_CHECKING
        from .version import __version__

        MODULE_ATTRS = {"LazyThing": ".pkg.impl:Thing"}
        if TYPE_CHECKING:
            from .pkg.impl import TypingOnly

        def __getattr__(name):
            if name in MODULE_ATTRS:
                return 1
            if name == "other_lazy":
                return 2
            raise AttributeError(name)
    """,
    "vllm/version.py": "__version__ = '9.9.9'\n",
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    "vllm/pkg/__init__.py": """
        from .impl import Child as ReExported
        from .stars import *
        from .stars_all import *
        try:
            from .impl import Base
        except ImportError:
            Base = None
    """,
    "vllm/pkg/stars.py": "def public(): ...\ndef _private(): ...\n",
    "vllm/pkg/stars_all.py": "__all__ = ['listed']\nlisted = 1\nunlisted = 2\n",
    "vllm/pkg/impl.py": """
        import torch
        import vllm.pkg.stars as stars_module
        from typing import Generic, TypeVar
        from torch import nn
        from vllm.pkg.stars import public

        T = TypeVar("T")
        REGISTRY = {}
        OTHER = {"B": ("mod_b", "ClassB")}
        MODELS = {"A": ("mod_a", "ClassA"), **OTHER}
        counter: int = 0
        annotated_only: int

        def decorate(fn):
            return fn

        def helper(layer, flag=False):
            layer.register_buffer("_k_scale", None)
            layer._q_scale = 1.0
            other.not_layer = 2
            return (1, layer, "text")

        class Base(nn.Module, Generic[T]):
            class_attr = 1
            field_only: int
            field_with_default: int = 3

            def __init__(self, size, /, scale, *args, prefix="", quant=None, **kwargs):
                super().__init__()
                self.size = size
                self.a, (self.b, other.c) = 1, (2, 3)
                self.ann: int = 4
                self.aug += 1
                self.register_buffer("buf", torch.zeros(1))
                setattr(self, "via_setattr", 5)
                replace_parameter(self, "W_UK_T", torch.zeros(1))
                torch.nn.Module.register_buffer(other, "not_self", 1)
                self.read_only_elsewhere

            def inherited(self, x):
                return x

            @property
            def prop(self):
                return 1

        class Child(Base[int]):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.child_only = 1

            @decorate
            @staticmethod
            def static(a, b=1):
                return a

            def work(self, positions, q, *, scale=None):
                out = self.proj(q)[0]
                torch.bmm(out, self.W)
                fused_call(q, is_neox=True, is_nope_first=True)
                fn = lambda: self.inner_call(positions)
                flag = getattr(self, "via_getattr", None)
                if type(self.method) is ExactClass:
                    pass
                if isinstance(q, (TupleA, TupleB)) or type(q) == EqClass:
                    pass

                def nested(y, z=2):
                    return y

                return out, positions

            def forward(self, x):
                return self.work(x, x)
    """,
}


@pytest.fixture
def tree(tmp_path: Path) -> SourceTree:
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "other" / "__init__.py").parent.mkdir()
    (tmp_path / "other" / "__init__.py").write_text("x = 1\n")
    return SourceTree(tmp_path)


IMPL = "vllm.pkg.impl"


# ---- modules and names ---------------------------------------------------------------------
def test_modules_and_version(tree: SourceTree) -> None:
    assert tree.version == "9.9.9" and tree.minor == (9, 9) and tree.label == "vLLM 9.9.9"
    assert tree.has_module("vllm.pkg.impl") and tree.is_package("vllm.pkg") and not tree.is_package(IMPL)
    assert not tree.has_module("vllm.pkg.missing")
    assert not tree.has_module("other"), "packages outside `packages` are not read"
    with pytest.raises(AssertionError, match=r"vLLM 9\.9\.9: module vllm\.nope is gone"):
        tree.path("vllm.nope")
    assert tree.modules_under("vllm.pkg") == ["vllm.pkg", "vllm.pkg.impl", "vllm.pkg.stars", "vllm.pkg.stars_all"]
    assert tree.modules_containing("Child(Base", ("vllm",)) == [IMPL]
    assert tree.modules_containing("no such text anywhere") == []


def test_module_global_names(tree: SourceTree) -> None:
    names = tree.module_global_names(IMPL)
    assert {"torch", "Generic", "nn", "public", "T", "REGISTRY", "counter", "helper", "Base", "Child"} <= names
    assert "annotated_only" not in names, "a bare annotation binds nothing"
    assert "stars_module" in names
    package = tree.module_global_names("vllm.pkg")
    assert {"ReExported", "public", "listed", "Base"} <= package
    assert not {"_private", "unlisted", "Child", "impl"} & package
    top = tree.module_global_names("vllm")
    assert {"__version__", "LazyThing", "other_lazy", "MODULE_ATTRS"} <= top
    assert "TypingOnly" not in top, "TYPE_CHECKING-only imports are not there at run time"


def test_defines_and_resolve(tree: SourceTree) -> None:
    assert tree.defines("vllm.pkg", "impl"), "a submodule is importable from its package"
    assert tree.defines("vllm.pkg", "ReExported") and not tree.defines("vllm.pkg", "Child")
    assert not tree.defines(IMPL, "missing")
    where, node = tree.resolve("vllm.pkg", "ReExported")
    assert where == IMPL and getattr(node, "name", None) == "Child"
    assert tree.resolve("vllm.pkg", "public")[0] == "vllm.pkg.stars"
    assert tree.resolve(IMPL, "stars_module")[0] == "vllm.pkg.stars"
    assert tree.resolve(IMPL, "torch") is None, "outside names do not resolve"
    assert tree.resolve("vllm.pkg", "missing") is None
    assert tree.imported_from("vllm.pkg", "Base") == {IMPL}
    assert tree.imported_from("vllm.pkg", "public") == set()


def test_dict_entry(tree: SourceTree) -> None:
    assert tree.dict_entry(IMPL, "MODELS", "A") == ("mod_a", "ClassA")
    assert tree.dict_entry(IMPL, "MODELS", "B") == ("mod_b", "ClassB"), "followed the **OTHER spread"
    with pytest.raises(AssertionError, match="has no entry 'C'"):
        tree.dict_entry(IMPL, "MODELS", "C")
    with pytest.raises(AssertionError, match="no module-level NOPE"):
        tree.dict_entry(IMPL, "NOPE", "A")
    tree.require_dict_entry(IMPL, "MODELS", "A", ("mod_a", "ClassA"))
    with pytest.raises(AssertionError, match=r"MODELS\['A'\] is \('mod_a', 'ClassA'\), the contract expects"):
        tree.require_dict_entry(IMPL, "MODELS", "A", ("mod_a", "Other"))


# ---- classes and defs ----------------------------------------------------------------------
def test_classes_bases_mro(tree: SourceTree) -> None:
    assert tree.class_def("vllm.pkg", "ReExported").name == "Child"
    assert tree.base_names(IMPL, "Base") == ["nn.Module", "Generic"]
    assert tree.base_names(IMPL, "Child") == ["Base"]
    assert [node.name for _, node in tree.mro(IMPL, "Child")] == ["Child", "Base"]
    with pytest.raises(AssertionError, match="has no class Nope"):
        tree.class_def(IMPL, "Nope")
    with pytest.raises(AssertionError, match="helper is a FunctionDef now"):
        tree.class_def(IMPL, "helper")
    tree.require_class(IMPL, "Child", bases=["Base"])
    with pytest.raises(AssertionError, match=r"Child \(vllm/pkg/impl\.py:\d+\) derives from \(Base\), not nn\.Module"):
        tree.require_class(IMPL, "Child", bases=["nn.Module"])


def test_methods_and_signatures(tree: SourceTree) -> None:
    assert tree.method(IMPL, "Child", "inherited").name == "inherited"
    with pytest.raises(AssertionError, match="has no method inherited"):
        tree.method(IMPL, "Child", "inherited", inherited=False)
    with pytest.raises(AssertionError, match="has no method nope"):
        tree.method(IMPL, "Child", "nope")
    with pytest.raises(AssertionError, match="is no def"):
        tree.method(IMPL, "Base", "class_attr")
    assert tree.method(IMPL, "Child", "work.nested").name == "nested"
    assert tree.param_names(IMPL, "Child", "work.nested") == ["y", "z"]
    with pytest.raises(AssertionError, match="has no inner def gone"):
        tree.method(IMPL, "Child", "work.gone")
    assert tree.function_def(IMPL, "helper").name == "helper"
    with pytest.raises(AssertionError, match="has no function Base"):
        tree.function_def(IMPL, "Base")
    assert tree.signature(IMPL, "Base", "__init__") == [
        Param("self", "positional_only"),
        Param("size", "positional_only"),
        Param("scale", "positional"),
        Param("args", "var_positional"),
        Param("prefix", "keyword_only", "''"),
        Param("quant", "keyword_only", "None"),
        Param("kwargs", "var_keyword"),
    ]
    assert [p.render() for p in tree.signature(IMPL, None, "helper")] == ["layer", "flag=False"]
    assert tree.decorators(IMPL, "Child", "static") == ["decorate", "staticmethod"]
    assert tree.decorators(IMPL, "Child", "work") == []


def test_require_method_checks_each_part(tree: SourceTree) -> None:
    tree.require_method(
        IMPL,
        "Child",
        "work",
        params=["self", "positions", "q", "scale=None"],
        positional=2,
        keywords=["scale"],
        calls=["self.proj", "torch.bmm"],
    )
    tree.require_method(IMPL, "Child", "work", params=["self", "positions", "q", "scale"])
    with pytest.raises(
        AssertionError,
        match=r"vLLM 9\.9\.9: Child\.work \(vllm/pkg/impl\.py:\d+\) now has parameters "
        r"\(self, positions, q, scale=None\), the contract expects \(self, q\) \[foldckpt: me\]",
    ):
        tree.require_method(IMPL, "Child", "work", params=["self", "q"], why="me")
    with pytest.raises(AssertionError, match="the contract expects"):
        tree.require_method(IMPL, "Child", "work", params=["self", "positions", "q", "scale=1"])
    with pytest.raises(AssertionError, match=r"takes at most 2 positional argument\(s\) now"):
        tree.require_method(IMPL, "Child", "work", positional=3)
    with pytest.raises(AssertionError, match="no longer takes `output`"):
        tree.require_method(IMPL, "Child", "work", positional=2, keywords=["output"])
    with pytest.raises(AssertionError, match="would get `q` twice"):
        tree.require_method(IMPL, "Child", "work", positional=2, keywords=["q"])
    with pytest.raises(AssertionError, match="now requires `q`"):
        tree.require_method(IMPL, "Child", "work", positional=1)
    # keyword-only and var-arguments: Base.__init__(self, size, /, scale, *args, prefix="", ...)
    tree.require_method(IMPL, "Base", "__init__", positional=5, keywords=["prefix", "anything"])
    with pytest.raises(AssertionError, match="now requires `scale`"):
        tree.require_method(IMPL, "Base", "__init__", positional=1, keywords=["prefix"])
    tree.require_method(IMPL, "Child", "static", positional=2)  # a staticmethod has no self to drop
    with pytest.raises(AssertionError, match="at most 2 positional"):
        tree.require_method(IMPL, "Child", "static", positional=3)
    tree.require_function(IMPL, "helper", positional=1, keywords=["flag"])
    with pytest.raises(AssertionError, match="no longer decorated @staticmethod"):
        tree.require_method(IMPL, "Child", "work", decorators=["staticmethod"])
    with pytest.raises(AssertionError, match="no longer calls self.gone"):
        tree.require_method(IMPL, "Child", "work", calls=["self.proj", "self.gone"])
    tree.require_method(IMPL, "Base", "__init__", assigns=["size", "buf"])
    with pytest.raises(AssertionError, match="no longer sets self.c"):
        tree.require_method(IMPL, "Base", "__init__", assigns=["size", "c"])


# ---- what defs do --------------------------------------------------------------------------
def test_calls_and_call_sites(tree: SourceTree) -> None:
    calls = tree.calls(IMPL, "Child", "work")
    assert {"self.proj", "torch.bmm", "fused_call", "self.inner_call", "type", "isinstance"} <= calls
    assert "self.work" not in calls and "self.W" not in calls
    assert tree.calls(IMPL, "Child", "forward") == {"self.work"}
    (site,) = tree.call_sites(IMPL, "Child", "work", "fused_call")
    assert site.args == ("q",) and site.keywords == {"is_neox": "True", "is_nope_first": "True"}
    assert tree.call_sites(IMPL, "Child", "work", "not_called") == []
    tree.require_call(IMPL, "Child", "work", "fused_call", positional=1, keywords=["is_neox", "is_nope_first"])
    with pytest.raises(
        AssertionError,
        match=r"calls fused_call as \(line \d+: 1 positional, keywords \['is_neox', "
        r"'is_nope_first'\]\), the contract expects keywords \['is_neox', 'is_neox_style'\]",
    ):
        tree.require_call(IMPL, "Child", "work", "fused_call", keywords=["is_neox", "is_neox_style"])
    with pytest.raises(AssertionError, match="expects 2 positional"):
        tree.require_call(IMPL, "Child", "work", "fused_call", positional=2)
    with pytest.raises(AssertionError, match="no longer calls missing_fn"):
        tree.require_call(IMPL, "Child", "work", "missing_fn")


def test_assignments(tree: SourceTree) -> None:
    assigned = tree.assigned_attributes(IMPL, "Base", "__init__")
    assert assigned == {"size", "a", "b", "ann", "aug", "buf", "via_setattr", "W_UK_T"}
    assert tree.assignments(IMPL, "Base", "__init__")["size"] == ["size"]
    assert tree.assigns_attribute(IMPL, "Base", "__init__", "b")
    for not_set in ("c", "not_self", "read_only_elsewhere", "child_only"):
        assert not tree.assigns_attribute(IMPL, "Base", "__init__", not_set), not_set
    assert tree.assigned_attributes(IMPL, None, "helper", receiver="layer") == {"_k_scale", "_q_scale"}
    assert tree.assigned_attributes(IMPL, None, "helper") == set()


def test_attribute_owner_and_fields(tree: SourceTree) -> None:
    assert tree.attribute_owner(IMPL, "Child", "child_only") == "Child.__init__"
    assert tree.attribute_owner(IMPL, "Child", "size") == "Base.__init__"
    assert tree.attribute_owner(IMPL, "Child", "class_attr") == "Base (class body)"
    assert tree.attribute_owner(IMPL, "Child", "prop") == "Base (class body)"
    assert tree.attribute_owner(IMPL, "Child", "field_with_default") == "Base (class body)"
    for missing in ("field_only", "read_only_elsewhere", "c", "nothing"):
        assert tree.attribute_owner(IMPL, "Child", missing) is None, missing
    assert tree.attribute_owner(IMPL, "Child", "size", methods=("work",)) is None
    tree.require_attributes(IMPL, "Child", ["child_only", "size", "inherited"])
    with pytest.raises(AssertionError, match=r"Child \(vllm/pkg/impl\.py:\d+\) no longer gets c, nothing"):
        tree.require_attributes(IMPL, "Child", ["size", "c", "nothing"])
    assert tree.fields(IMPL, "Child") == {"field_only", "field_with_default"}
    tree.require_fields(IMPL, "Child", ["field_only"])
    with pytest.raises(AssertionError, match="has no field size"):
        tree.require_fields(IMPL, "Child", ["size"])


def test_undefined_self_reads(tree: SourceTree) -> None:
    assert tree.undefined_self_reads(IMPL, "Child") == {
        "proj",
        "W",
        "inner_call",
        "method",
        "via_getattr",
        "read_only_elsewhere",
        "register_buffer",  # nn.Module
    }
    assert "read_only_elsewhere" in tree.undefined_self_reads(IMPL, "Base")
    assert "child_only" not in tree.undefined_self_reads(IMPL, "Base")


def test_returns_constants_type_checks_source(tree: SourceTree) -> None:
    assert tree.returns(IMPL, None, "helper") == ["(1, layer, 'text')"]
    assert tree.returns(IMPL, "Child", "work") == ["(out, positions)"], "the inner def's return is not counted"
    assert {"_k_scale", "text"} <= tree.string_constants(IMPL, None, "helper")
    assert "is_neox" not in tree.string_constants(IMPL, "Child", "work"), "keyword names are no constants"
    assert tree.exact_type_checks(IMPL, "Child", "work") == {("self.method", "ExactClass"), ("q", "EqClass")}
    assert tree.isinstance_checks(IMPL, "Child", "work") == {("q", "TupleA"), ("q", "TupleB")}
    assert tree.exact_type_checks(IMPL, None, "helper") == set()
    assert "return (out, positions)" in tree.source(IMPL, "Child", "work")


# ---- fetching ------------------------------------------------------------------------------
def _wheel(path: Path, members: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return path


WHEEL_MEMBERS = {
    "vllm/__init__.py": "from .sub.mod import thing\n",
    "vllm/_version.py": "__version__ = version = '7.7.7'\n",
    "vllm/sub/mod.py": "def thing(a, b=1): ...\n",
    "vllm/sub/kernels.so": "binary",
    "vllm/configs/tuned.json": "{}",
    "vllm-7.7.7.dist-info/METADATA": "Name: vllm\nVersion: 7.7.7\n",
    "vllm-7.7.7.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    "vllm-7.7.7.dist-info/RECORD": "",
    "README.py": "not under vllm/",
}


def test_vllm_source_extracts_only_the_py_files_atomically_and_caches(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "given" / "vllm-7.7.7-py3-none-any.whl", WHEEL_MEMBERS)
    cache = tmp_path / "cache"
    root = vllm_source("7.7.7", wheel=wheel, cache=cache)
    assert root == cache / "7.7.7"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == [".foldckpt-complete", "vllm/__init__.py", "vllm/_version.py", "vllm/sub/mod.py"]
    assert sorted(p.name for p in cache.iterdir()) == ["7.7.7"], "no partial directory is left behind"
    assert wheel.is_file(), "a wheel given by the caller is not deleted"
    tree = SourceTree(root)
    assert tree.version == "7.7.7" and tree.param_names("vllm", None, "thing") == ["a", "b"]
    wheel.unlink()
    assert vllm_source("7.7.7", wheel=wheel, cache=cache) == root, "a complete cache is used as is"


def test_vllm_source_replaces_an_incomplete_cache(tmp_path: Path) -> None:
    stale = tmp_path / "cache" / "7.7.7" / "vllm"
    stale.mkdir(parents=True)
    (stale / "half.py").write_text("")
    wheel = _wheel(tmp_path / "vllm-7.7.7-py3-none-any.whl", WHEEL_MEMBERS)
    root = vllm_source("7.7.7", wheel=wheel, cache=tmp_path / "cache")
    assert not (root / "vllm" / "half.py").exists() and (root / "vllm" / "sub" / "mod.py").is_file()


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ({"vllm/../evil.py": ""}, "refusing the member path 'vllm/../evil.py'"),
        ({"other/mod.py": ""}, r"holds no vllm/\*\*/\*\.py"),
        (None, "cannot be read as a wheel"),
    ],
    ids=["path-escape", "not-vllm", "not-a-zip"],
)
def test_vllm_source_refuses_bad_wheels(tmp_path: Path, members: dict[str, str] | None, match: str) -> None:
    wheel = tmp_path / "vllm-7.7.7-py3-none-any.whl"
    if members is None:
        wheel.write_bytes(b"not a zip file")
    else:
        _wheel(wheel, members)
    with pytest.raises(VllmSourceUnavailable, match=match):
        vllm_source("7.7.7", wheel=wheel, cache=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == [], "nothing is left in the cache"
    assert not (tmp_path / "evil.py").exists()


@pytest.fixture
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip without the network: only wheels in the returned directory can be "downloaded"."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv(vs.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(vs.SKIP_ENV, raising=False)
    return links


def test_vllm_source_downloads_with_pip_and_deletes_the_wheel(
    offline_pip: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _wheel(offline_pip / "vllm-7.7.7-py3-none-any.whl", WHEEL_MEMBERS)
    root = vllm_source("7.7.7")
    assert root == tmp_path / "cache" / "7.7.7", f"{vs.CACHE_ENV} names the cache root"
    assert (root / "vllm" / "sub" / "mod.py").is_file()
    assert list((tmp_path / "cache").rglob("*.whl")) == [], "the downloaded wheel is deleted"
    assert (offline_pip / "vllm-7.7.7-py3-none-any.whl").is_file()
    err = capfd.readouterr().err
    assert "downloading the vllm==7.7.7 wheel" in err and err.count("\n") == 1, err


def test_a_failed_download_fails_with_one_line(offline_pip: Path, tmp_path: Path) -> None:
    with pytest.raises(VllmSourceUnavailable) as failure:
        vllm_source("7.7.6")
    message = str(failure.value)
    assert "\n" not in message
    assert "`pip download vllm==7.7.6` failed" in message and "No matching distribution" in message
    assert vs.SKIP_ENV in message
    assert not (tmp_path / "cache" / "7.7.6").exists()


def test_release_tree_fails_without_source_unless_skipping_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vs.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(vs.SKIP_ENV, raising=False)
    attempts: list[str] = []

    def no_network(version: str, dest: Path, target: Path) -> Path:
        attempts.append(version)
        raise VllmSourceUnavailable(f"`pip download vllm=={version}` failed (exit 1: no network)")

    monkeypatch.setattr(vs, "_download", no_network)
    with pytest.raises(pytest.fail.Exception, match=r"vLLM 7\.7\.6 contract tests cannot run: `pip download"):
        release_tree("7.7.6")
    monkeypatch.setenv(vs.SKIP_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match="not downloading vLLM 7.7.6"):
        release_tree("7.7.6")
    assert attempts == ["7.7.6"], "skipping downloads nothing"
    vllm_source("7.7.7", wheel=_wheel(tmp_path / "vllm-7.7.7-py3-none-any.whl", WHEEL_MEMBERS))
    assert release_tree("7.7.7").version == "7.7.7", "a cached release is still checked when skipping is asked"
    monkeypatch.delenv(vs.SKIP_ENV)
    assert release_tree("7.7.7").version == "7.7.7"
    assert attempts == ["7.7.6"]
