"""``foldckpt convert ORG/NAME OUT_DIR [--revision R]``: Hub model ids resolved from a real Hugging
Face cache on disk (``models--ORG--NAME/{blobs,snapshots,refs}``, snapshot files symlinked into
``blobs/``, as ``hf download`` leaves them). Nothing is ever downloaded: the endpoint points at a
closed port, so any network attempt would fail the test."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from foldckpt.format.manifest import read_manifest
from foldckpt.model.synthetic import make_checkpoint
from tests.conftest import run_foldckpt

REPO_ID = "acme/kimi-k3-tiny"
MAIN_COMMIT = "1" * 40
V2_COMMIT = "2" * 40


def add_snapshot(cache: Path, repo_id: str, commit: str, model_dir: Path, refs: tuple[str, ...]) -> Path:
    """Store ``model_dir`` in the cache as ``commit`` of ``repo_id``: each file a blob named by its
    sha256, linked from ``snapshots/<commit>/`` by a relative symlink, and ``refs/<name>`` -> commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for source in sorted(model_dir.rglob("*")):
        if source.is_dir():
            continue
        relative = source.relative_to(model_dir)
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(source, blob)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hf-cache"
    main = add_snapshot(cache, REPO_ID, MAIN_COMMIT, make_checkpoint(root / "main", "kimi_k3", seed=0), ("main",))
    v2 = add_snapshot(cache, REPO_ID, V2_COMMIT, make_checkpoint(root / "v2", "kimi_k3", seed=1), ("v2",))
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # closed: a download attempt would fail, not pass
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)  # resolution must be offline by itself, not by this switch
    return {"cache": cache, "main": main, "v2": v2, "env": env}


def test_a_hub_id_converts_from_the_cache_and_the_manifest_records_repo_and_commit(
    hub: dict[str, object], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run = run_foldckpt("convert", REPO_ID, out, "-q", "--json", env=hub["env"])
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["source"] == {"repo_id": REPO_ID, "revision": "main", "commit": MAIN_COMMIT}
    assert summary["folded_layers"] == [3, 5, 6]
    manifest = read_manifest(out)
    assert manifest.source == {"repo_id": REPO_ID, "revision": "main", "commit": MAIN_COMMIT}
    assert json.loads((out / "foldckpt.json").read_text())["source"]["commit"] == MAIN_COMMIT
    main = Path(hub["main"])  # type: ignore[arg-type]
    for name in manifest.source_files:  # the blobs themselves, hard-linked (not the snapshot's symlinks)
        placed = out / name
        assert not placed.is_symlink() and placed.stat().st_ino == (main / name).resolve().stat().st_ino
    verify = run_foldckpt("verify", out, "--deep", "-q", env=hub["env"])
    assert verify.returncode == 0, verify.stdout + verify.stderr
    inspect = run_foldckpt("inspect", out, env=hub["env"])
    assert f"source     {REPO_ID} (revision main, commit {MAIN_COMMIT})" in inspect.stdout.splitlines()
    again = run_foldckpt("convert", REPO_ID, out, "-q", "--json", env=hub["env"])
    assert json.loads(again.stdout)["up_to_date"] is True


@pytest.mark.parametrize(
    ("revision", "commit"), [("v2", V2_COMMIT), (MAIN_COMMIT, MAIN_COMMIT), (V2_COMMIT, V2_COMMIT)]
)
def test_revision_picks_a_branch_or_a_commit(
    hub: dict[str, object], tmp_path: Path, revision: str, commit: str
) -> None:
    out = tmp_path / "out"
    run = run_foldckpt("convert", REPO_ID, out, "--revision", revision, "-q", env=hub["env"])
    assert run.returncode == 0, run.stderr
    assert read_manifest(out).source == {"repo_id": REPO_ID, "revision": revision, "commit": commit}
    snapshot = Path(hub["main" if commit == MAIN_COMMIT else "v2"])  # type: ignore[arg-type]
    sidecar_source = read_manifest(out).tensors
    first = next(iter(sidecar_source.values())).sources[0]
    assert (out / first.file).read_bytes() == (snapshot / first.file).read_bytes()


def test_dry_run_and_inspect_take_a_hub_id(hub: dict[str, object], tmp_path: Path) -> None:
    plan = run_foldckpt("convert", REPO_ID, tmp_path / "never", "--dry-run", env=hub["env"])
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.splitlines()[0] == (
        f"model      {REPO_ID} (revision main, commit {MAIN_COMMIT}, {hub['main']}) "
        "(KimiK3ForConditionalGeneration, family kimi_k3)"
    )
    assert not (tmp_path / "never").exists()
    info = json.loads(run_foldckpt("inspect", REPO_ID, "--revision", "v2", "--json", env=hub["env"]).stdout)
    assert info["source"] == {"repo_id": REPO_ID, "revision": "v2", "commit": V2_COMMIT}
    assert info["folded_layers"] is None


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["acme/not-cached"],
            "foldckpt: error: acme/not-cached: no such directory, and 'acme/not-cached' is not in "
            "the Hugging Face cache ({cache}); foldckpt never downloads: fetch it first with "
            "`hf download acme/not-cached`",
        ),
        (
            [REPO_ID, "--revision", "v3"],
            f"foldckpt: error: {REPO_ID}: no such directory, and revision 'v3' of "
            f"'{REPO_ID}' is not in the Hugging Face cache ({{cache}}); foldckpt never "
            f"downloads: fetch it first with `hf download {REPO_ID} --revision v3`",
        ),
        (
            [REPO_ID, "--revision", "3" * 40],
            f"foldckpt: error: {REPO_ID}: no such directory, and revision '{'3' * 40}'",
        ),
        ([REPO_ID, "--revision", "3333abc"], f"foldckpt: error: {REPO_ID}: no such directory, and revision '3333abc'"),
        # A shortened hash of a cached commit: named in full, not "fetch it first" (it is cached).
        (
            [REPO_ID, "--revision", "2222222"],
            f"foldckpt: error: {REPO_ID}: --revision 2222222: a commit is named by its "
            f"full 40-character hash (as the Hub takes it); cached commits starting "
            f"with it: {V2_COMMIT}",
        ),
    ],
)
def test_an_id_that_is_not_cached_is_one_line_naming_it(
    hub: dict[str, object], tmp_path: Path, args: list[str], expected: str
) -> None:
    run = run_foldckpt("convert", args[0], tmp_path / "out", *args[1:], env=hub["env"])
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(cache=hub["cache"])), lines
    assert not (tmp_path / "out").exists()


def test_revision_with_a_local_directory_is_refused(hub: dict[str, object], tmp_path: Path) -> None:
    run = run_foldckpt("convert", hub["main"], tmp_path / "out", "--revision", "v2", env=hub["env"])
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"foldckpt: error: --revision v2: applies to a Hugging Face model id, and {hub['main']} is a local directory"
    ]


def test_an_existing_directory_wins_over_an_id_of_the_same_name(hub: dict[str, object], tmp_path: Path) -> None:
    local = tmp_path / "acme" / "kimi-k3-tiny"
    make_checkpoint(local, "kimi_k3", seed=2)
    run = run_foldckpt("convert", "acme/kimi-k3-tiny", tmp_path / "out", "-q", "--json", env=hub["env"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["source"] is None
    assert read_manifest(tmp_path / "out").source is None
