"""Model arguments as vLLM and the ``hf`` CLI take them: a local directory or a Hub model id.

``foldckpt convert ORG/NAME OUT_DIR [--revision R]`` finds ``ORG/NAME`` in the local Hugging Face
cache (``HF_HUB_CACHE``, ``HF_HOME``; the ``models--ORG--NAME/{refs,snapshots,blobs}`` layout that
``hf download`` and vLLM fill) and converts that snapshot. foldckpt never downloads: a model that is
not cached is a one-line error naming the id and the command that fetches it. A path that exists
always wins over an id, so ``./ORG/NAME`` names a directory. huggingface_hub is imported only
when an id is looked up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foldckpt.errors import FoldckptError

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHORT_COMMIT = re.compile(r"[0-9a-f]{4,39}")
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class ModelSource:
    """Where the model is read from: its directory, and for a Hub id the id, the revision asked
    for and the commit it resolved to in the cache."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def label(self) -> str:
        """How summaries name the model: the directory, or ``ORG/NAME@<commit>``."""
        if self.repo_id is None:
            return str(self.path)
        return f"{self.repo_id}@{(self.commit or '')[:12]}"

    def to_dict(self) -> dict[str, Any] | None:
        """The manifest's ``source`` record (None for a plain directory)."""
        if self.repo_id is None:
            return None
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text


def _from_cache(repo_id: str, revision: str | None) -> ModelSource:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub_errors
    from huggingface_hub.file_download import repo_folder_name

    wanted = revision or DEFAULT_REVISION
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    what = f"revision '{wanted}' of '{repo_id}'" if revision else f"'{repo_id}'"
    incomplete = getattr(hub_errors, "IncompleteSnapshotError", None)
    try:
        folder = Path(snapshot_download(repo_id, revision=wanted, local_files_only=True))
    except hub_errors.LocalEntryNotFoundError:
        full = _full_commits(
            Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model"), wanted
        )
        if full:
            raise FoldckptError(
                f"{repo_id}: --revision {wanted}: a commit is named by its full 40-character hash "
                f"(as the Hub takes it); cached commits starting with it: {', '.join(full)}"
            ) from None
        raise FoldckptError(
            f"{repo_id}: no such directory, and {what} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); foldckpt never downloads: fetch it first with `{fetch}`"
        ) from None
    except Exception as exc:  # an incomplete snapshot, or an id the Hub would refuse
        if incomplete is not None and isinstance(exc, incomplete):
            raise FoldckptError(
                f"{repo_id}: the cached snapshot of {what} is incomplete; finish it with `{fetch}`"
            ) from None
        if isinstance(exc, (hub_errors.HFValidationError, ValueError)):
            raise FoldckptError(
                f"{repo_id}: no such directory, and not a valid Hugging Face model id ({exc})"
            ) from None
        raise
    return ModelSource(folder, repo_id, wanted, folder.name)


def _full_commits(repo_folder: Path, revision: str) -> list[str]:
    """The cached snapshots in ``repo_folder`` (a model's folder of the cache) whose commit starts
    with ``revision``, when it reads as a shortened hash: git users type those, the Hub and its
    cache take only full hashes."""
    if not _SHORT_COMMIT.fullmatch(revision):
        return []
    snapshots = repo_folder / "snapshots"
    try:
        return sorted(entry.name for entry in snapshots.iterdir() if entry.name.startswith(revision))
    except OSError:
        return []


def resolve_model(model: str | Path, revision: str | None = None) -> ModelSource:
    """The directory a model argument names: an existing path, else a Hub id in the local cache."""
    text = str(model)
    path = Path(model)
    if path.exists():
        if revision is not None:
            raise FoldckptError(
                f"--revision {revision}: applies to a Hugging Face model id, and {text} is a local directory"
            )
        if not path.is_dir():
            raise FoldckptError(f"{text}: not a directory")
        return ModelSource(path)
    if looks_like_repo_id(text):
        return _from_cache(text, revision)
    if revision is not None:
        raise FoldckptError(f"--revision {revision}: applies to a Hugging Face model id (ORG/NAME), not to {text}")
    raise FoldckptError(f"{text}: no such directory")
