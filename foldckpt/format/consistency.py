"""The one consistency check of a converted directory, shared by ``verify`` and the serving loader.

Everything that can be judged without hashing tensor data, in one place so that the two readers of
a manifest cannot disagree on what "consistent" means:

* :func:`manifest_problems`: the manifest hangs together on its own (file names stay inside the
  directory, digests are 64 hex digits, one head digest per head, every MLA layer of its geometry has a
  fold of the right dtype and shape in a listed sidecar);
* :func:`file_problems`: every listed file exists with its recorded size;
* :func:`unlisted_entries`: every other entry of the directory (file, folder, symlink, at any
  depth, hidden ones too) that the manifest does not vouch for, unless an explicit allow-list
  (``verify --allow-extra``, ``FOLDCKPT_ALLOW_EXTRA`` when serving) names it: an added
  ``chat_template.jinja``, ``tokenizer.model`` or ``modeling_*.py`` changes what is served as
  surely as an edited one;
* :func:`sidecar_headers`: every sidecar header parses, tiles its file, has the recorded sha256
  and holds exactly the manifest's folds with their dtypes and shapes;
* :func:`add_head_ranges` / :func:`heads_intact` / :func:`sidecar_intact`: the head blocks whose digests, with the
  header's, cover every byte of a sidecar (verify's content level, convert's resume checks);
* :func:`config_problems`: ``config.json`` gives exactly the manifest's geometry
  (:meth:`Geometry.differences`, the one definition of equality).

Each returns :class:`Problem` records (file relative to the directory, tensor where there is one).
``verify`` reports them by level; :func:`check_served` (the loader) stops at the first one.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from foldckpt.defaults import FOLD_DTYPE_NAMES, FOLD_SCALE_DTYPE, JOURNAL_NAME, SCALED_FOLD_DTYPES, SIDECAR_PREFIX
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import MANIFEST_NAME, FoldTensor, Manifest, SidecarRecord, SourceTensor
from foldckpt.io.files import is_tmp_path, os_error, stays_inside
from foldckpt.io.hashing import HashJob, RangeCheck, hash_job, tensor_digest
from foldckpt.io.safetensors_format import SafetensorsHeader, TensorInfo, read_header, read_tensor_bytes
from foldckpt.model.geometry import CONFIG_NAME, read_geometry

_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True)
class Problem:
    """One failed check: the file (relative to the directory) it is about, the tensor if any, and what differs."""

    file: str
    what: str
    tensor: str | None = None

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tensor": self.tensor, "what": self.what, "message": str(self)}

    def error(self, directory: Path, remedy: str = "") -> FoldckptError:
        """This problem as the error a caller that stops at the first problem raises."""
        detail = f"{self.what}; {remedy}" if remedy else self.what
        return FoldckptError.at(Path(directory) / self.file, detail, self.tensor)

    @classmethod
    def of(cls, directory: Path, exc: FoldckptError, fallback: str) -> Problem:
        """A problem from a library error, named by the file it carries (relative to ``directory``)."""
        if exc.path is not None:
            try:
                return cls(Path(exc.path).relative_to(directory).as_posix(), exc.detail, exc.tensor)
            except ValueError:
                pass
        return cls(fallback, str(exc), exc.tensor)


def is_hex_digest(value: object) -> bool:
    """Whether ``value`` reads as a 32-byte digest (sha256 or BLAKE3): 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and _HEX.issuperset(value)


def _unsafe_name(name: str) -> bool:
    return not name or "\x00" in name or name == "." or not stays_inside(name)


# Linux's limits on a file name's component and on a whole path (with its NUL), in bytes.
_NAME_MAX, _PATH_MAX = 255, 4096


def _too_long(name: str) -> bool:
    """Longer than any file name can be on Linux (NAME_MAX a component, PATH_MAX the whole): such a
    name is the manifest's defect, not a path the user passed (opening it fails with ENAMETOOLONG)."""
    return len(os.fsencode(name)) >= _PATH_MAX or any(len(os.fsencode(part)) > _NAME_MAX for part in name.split("/"))


def manifest_problems(manifest: Manifest) -> list[Problem]:
    """What the manifest says about itself must hang together before any file is judged by it."""
    problems: list[Problem] = []

    def bad(what: str, tensor: str | None = None) -> None:
        problems.append(Problem(MANIFEST_NAME, what, tensor))

    for name in sorted(set(manifest.sidecars) & set(manifest.source_files)):
        bad(f"'{name}' is listed both as a sidecar and as a source file")
    for section, records in (("sidecars", manifest.sidecars), ("source_files", manifest.source_files)):
        for name, record in records.items():
            if _unsafe_name(name):
                bad(f"{section}: file name {name!r} escapes the output directory")
            elif _too_long(name):
                bad(f"{section}: file name {name[:40]!r}... is longer than a file name can be")
            digest = record.header_sha256 if isinstance(record, SidecarRecord) else record.sha256
            if not is_hex_digest(digest):
                bad(f"{section}: '{name}' has sha256 {digest!r}, not 64 lowercase hex digits")
    for name in manifest.sidecars:
        if not PurePosixPath(name).name.startswith(SIDECAR_PREFIX) or "/" in name:
            bad(f"sidecar '{name}' is not named {SIDECAR_PREFIX}*.safetensors at the top of the output")
    geometry = manifest.geometry
    stored = FOLD_DTYPE_NAMES[manifest.fold_dtype]  # one of them: read_manifest checked it
    for layer in geometry.layers:
        if layer.q_fold not in manifest.tensors:
            bad(f"MLA layer {layer.index} has no fold '{layer.q_fold}'", layer.q_fold)
    layer_folds = {layer.q_fold for layer in geometry.layers}
    for name, tensor in manifest.tensors.items():
        if name not in layer_folds:
            bad(f"fold '{name}' belongs to no MLA layer of the manifest's geometry", name)
        if tensor.file not in manifest.sidecars:
            bad(f"tensor '{name}' is said to be in '{tensor.file}', which is not a listed sidecar", name)
        if tensor.shape != geometry.fold_shape or tensor.dtype != stored:
            bad(
                f"fold '{name}' is {tensor.dtype}{list(tensor.shape)}, the geometry and fold dtype imply "
                f"{stored}{list(geometry.fold_shape)}",
                name,
            )
        if len(tensor.head_blake3) != geometry.num_heads or not all(map(is_hex_digest, tensor.head_blake3)):
            bad(f"tensor '{name}': head_blake3 must be {geometry.num_heads} BLAKE3 hex digests, one per head", name)
        scale, expected = tensor.scale, (geometry.fold_shape[0],)
        if (scale is not None) != (manifest.fold_dtype in SCALED_FOLD_DTYPES):
            bad(
                f"fold '{name}' {'has' if scale is not None else 'lacks'} a weight_scale, its fold dtype "
                f"{manifest.fold_dtype} {'has none' if scale is not None else 'needs one'}",
                name,
            )
        elif scale is not None:
            layer = next((layer for layer in geometry.layers if layer.q_fold == name), None)
            if layer is not None and scale.name != layer.q_fold_scale:
                bad(f"fold '{name}': its weight_scale is named '{scale.name}', not '{layer.q_fold_scale}'", name)
            if (scale.dtype, scale.shape) != (FOLD_SCALE_DTYPE, expected):
                bad(
                    f"fold '{name}': weight_scale is {scale.dtype}{list(scale.shape)}, expected {FOLD_SCALE_DTYPE}{list(expected)}",
                    name,
                )
            if len(scale.head_blake3) != geometry.num_heads or not all(map(is_hex_digest, scale.head_blake3)):
                bad(
                    f"tensor '{scale.name}': head_blake3 must be {geometry.num_heads} BLAKE3 hex digests, one per head",
                    scale.name,
                )
        for source in tensor.sources:
            if source.file not in manifest.source_files:
                bad(
                    f"tensor '{name}': its source '{source.name}' is in '{source.file}', not a listed source file", name
                )
            if not is_hex_digest(source.blake3):
                bad(f"tensor '{name}': source '{source.name}' has an invalid BLAKE3 digest {source.blake3!r}", name)
    return problems


def file_problems(out_dir: Path, manifest: Manifest) -> list[Problem]:
    """Every listed file exists with its recorded size. Only call once :func:`manifest_problems`
    found nothing (file names may be unsafe)."""
    problems: list[Problem] = []
    for name, record in manifest.files.items():
        path = out_dir / name
        if not path.is_file():
            what = "listed in foldckpt.json but missing" if not path.exists() else "not a regular file"
            problems.append(Problem(name, what))
        elif name in manifest.sidecars and path.is_symlink():
            problems.append(
                Problem(name, "a symlink; convert writes sidecars in place (copy the directory with cp -rL)")
            )
        elif (size := path.stat().st_size) != record.size:
            problems.append(
                Problem(name, f"size {size} bytes, {MANIFEST_NAME} records {record.size} (truncated or replaced?)")
            )
    return problems


@dataclass(frozen=True)
class Unlisted:
    """What :func:`unlisted_entries` found: the entries it refuses, and those the allow-list let through."""

    problems: tuple[Problem, ...]
    allowed: tuple[str, ...]


_ALLOW_HINT = "remove it, or allow it (verify --allow-extra PATTERN; FOLDCKPT_ALLOW_EXTRA when serving)"


def unlisted_entries(out_dir: Path, manifest: Manifest, allow: Iterable[str] = ()) -> Unlisted:
    """Every entry of ``out_dir``, at any depth, that the manifest does not vouch for: a file or
    symlink it does not list, a folder that holds none of its files (reported once, as a whole), a
    symlink where its files need a folder. Symlinks are never followed. ``allow`` holds
    shell-style patterns (``fnmatch``: ``*`` matches ``/`` too) on the path relative to
    ``out_dir``; one that matches an entry lets it and all it holds through. Convert's resume
    journal cannot be allowed: it means a conversion has not finished there (the temporary files
    of an interrupted write can, they are inert). Only call once :func:`manifest_problems` found
    nothing."""
    patterns = tuple(allow)
    listed = {*manifest.files, MANIFEST_NAME}
    folders = {parent.as_posix() for name in listed for parent in PurePosixPath(name).parents} - {"."}
    problems: list[Problem] = []
    allowed: list[str] = []

    def visit(relative: str) -> bool:
        """Report what ``relative`` (a folder) holds; whether it holds anything listed or allowed."""
        try:
            entries = sorted(os.scandir(out_dir / relative if relative else out_dir), key=lambda e: e.name)
        except OSError as exc:
            problems.append(Problem(relative or ".", f"cannot be listed ({exc.strerror}), so it cannot be checked"))
            return True
        found: list[Problem] = []
        vouched = False
        for entry in entries:
            name = f"{relative}/{entry.name}" if relative else entry.name
            if name in listed:
                vouched = True  # file_problems checks it
            elif name == JOURNAL_NAME:
                found.append(
                    Problem(
                        name,
                        "the resume journal of a convert that has not finished in this directory: "
                        "rerun that convert command to finish it",
                    )
                )
            elif any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
                allowed.append(name)
                vouched = True
            elif entry.is_symlink():
                target = os.readlink(entry.path)
                what = "where convert makes a folder" if name in folders else f"not listed in {MANIFEST_NAME}"
                found.append(Problem(name, f"a symlink (to {target}) {what}; {_ALLOW_HINT}"))
            elif entry.is_dir(follow_symlinks=False):
                before = len(problems)
                if visit(name) or name in folders:
                    vouched = True
                    continue
                del problems[before:]  # nothing in it is vouched for: the folder is reported once
                found.append(Problem(name, f"a folder holding nothing {MANIFEST_NAME} lists; {_ALLOW_HINT}"))
            else:
                found.append(Problem(name, f"{_stray_kind(entry)} not listed in {MANIFEST_NAME}; {_ALLOW_HINT}"))
        problems.extend(found)
        return vouched

    visit("")
    return Unlisted(tuple(problems), tuple(allowed))


def _stray_kind(entry: os.DirEntry[str]) -> str:
    if entry.name.endswith(".safetensors"):
        return "stray sidecar" if entry.name.startswith(SIDECAR_PREFIX) else "stray safetensors file"
    if is_tmp_path(Path(entry.name)):
        return "a temporary file of an interrupted foldckpt write,"
    return "a stray file" if entry.is_file(follow_symlinks=False) else "a stray special file (FIFO, socket or device)"


def sidecar_headers(out_dir: Path, manifest: Manifest) -> tuple[dict[str, SafetensorsHeader], list[Problem]]:
    """The validated header of every sidecar, and whatever disagrees with the manifest."""
    problems: list[Problem] = []
    headers: dict[str, SafetensorsHeader] = {}
    for name in manifest.sidecars:
        try:
            header = read_header(out_dir / name)
        except FoldckptError as exc:
            problems.append(Problem.of(out_dir, exc, name))
            continue
        headers[name] = header
        if (digest := header_sha256(header)) != manifest.sidecars[name].header_sha256:
            problems.append(
                Problem(
                    name,
                    f"header sha256 {digest[:16]}… differs from {manifest.sidecars[name].header_sha256[:16]}… "
                    f"recorded in {MANIFEST_NAME} (the header was edited or replaced)",
                )
            )
        listed = {part.name: part for t in manifest.tensors.values() if t.file == name for part in t.parts()}
        for tensor_name in sorted(set(header.tensors) - set(listed)):
            problems.append(Problem(name, f"tensor '{tensor_name}' is not in {MANIFEST_NAME}", tensor_name))
        for tensor_name, tensor in listed.items():
            info = header.tensors.get(tensor_name)
            if info is None:
                problems.append(
                    Problem(name, f"tensor '{tensor_name}' listed by {MANIFEST_NAME} is missing", tensor_name)
                )
            elif (info.dtype, info.shape) != (tensor.dtype, tensor.shape):
                problems.append(
                    Problem(
                        name,
                        f"tensor '{tensor_name}' is {info.dtype}{list(info.shape)}, "
                        f"{MANIFEST_NAME} says {tensor.dtype}{list(tensor.shape)}",
                        tensor_name,
                    )
                )
    return headers, problems


def header_sha256(header: SafetensorsHeader) -> str:
    """sha256 of a safetensors file's header bytes, ``[0, 8 + header length)``."""
    try:
        with open(header.path, "rb") as handle:
            return hashlib.sha256(handle.read(8 + header.header_size)).hexdigest()
    except OSError as exc:
        raise os_error(header.path, exc, "hashing the header of") from None


def add_head_ranges(
    job: HashJob,
    infos: dict[str, TensorInfo],
    tensors: Iterable[FoldTensor],
    heads: int,
    first: int = 0,
    stop: int | None = None,
) -> None:
    """Add to ``job`` the head blocks ``[first, stop)`` of every fold in ``tensors`` (and of an fp8
    fold's scale) that ``infos`` (the file's header) places, each with its recorded leaf digest."""
    for part in (part for tensor in tensors for part in tensor.parts()):
        info = infos.get(part.name)
        if info is None:  # the structure check reports it
            continue
        block = info.nbytes // heads
        for head in range(first, heads if stop is None else stop):
            start = info.start + head * block
            job.add(start, start + block, RangeCheck(part.name, head, part.head_blake3[head]))


def sidecar_intact(path: Path, record: SidecarRecord, tensors: Iterable[FoldTensor], heads: int) -> bool:
    """Whether the sidecar at ``path`` holds exactly the recorded bytes: size, header sha256 and
    every head block of every fold in it (one read; each byte hashed once)."""
    try:
        header = read_header(path)
    except FoldckptError:
        return False
    if header.file_size != record.size or header_sha256(header) != record.header_sha256:
        return False
    return heads_intact(path, header.tensors, tensors, heads)


def heads_intact(path: Path, infos: dict[str, TensorInfo], tensors: Iterable[FoldTensor], heads: int) -> bool:
    """Whether every head block of every fold in ``tensors`` (placed in ``path`` as ``infos`` says)
    matches its recorded leaf digest: one read of those ranges."""
    job = HashJob(path.name, 0, False)
    add_head_ranges(job, infos, tensors, heads)
    _, digests = hash_job(path, job)
    return all(digests[bound] == check.expected for bound, checks in job.ranges.items() for check in checks)


def config_problems(out_dir: Path, manifest: Manifest) -> list[Problem]:
    """``config.json`` must describe exactly the model the manifest was made for."""
    try:
        geometry = read_geometry(out_dir)
    except FoldckptError as exc:
        return [Problem.of(out_dir, exc, CONFIG_NAME)]
    diffs = manifest.geometry.differences(geometry)
    if not diffs:
        return []
    return [Problem(CONFIG_NAME, f"describes another model than {MANIFEST_NAME} was made for ({'; '.join(diffs)})")]


def check_served(
    out_dir: Path, manifest: Manifest, remedy: str = "", allow: Iterable[str] = ()
) -> dict[str, SafetensorsHeader]:
    """What the serving loader checks before any weight is read: all of the above; raises the first
    problem as a :class:`FoldckptError` naming its file (and tensor). Returns the sidecar headers.
    An unlisted entry (:func:`unlisted_entries`, ``allow`` its allow-list) is refused like a
    changed file: it can change what is served (a chat template, a tokenizer, remote code), and
    the pinned manifest (``FOLDCKPT_EXPECT_MANIFEST_SHA256``) would otherwise not name everything
    that serves."""
    out_dir = Path(out_dir)
    stages: tuple[Callable[[], Sequence[Problem]], ...] = (
        lambda: manifest_problems(manifest),  # first: the others take its file names as safe
        lambda: file_problems(out_dir, manifest),
        lambda: unlisted_entries(out_dir, manifest, allow).problems,
        lambda: config_problems(out_dir, manifest),
    )
    for stage in stages:
        if problems := stage():
            raise problems[0].error(out_dir, remedy)
    headers, problems = sidecar_headers(out_dir, manifest)
    if problems:
        raise problems[0].error(out_dir, remedy)
    return headers


def changed_fold_inputs(directory: Path, sources: Iterable[SourceTensor]) -> list[SourceTensor]:
    """The fold inputs (as a manifest records them) whose bytes in ``directory`` are not the bytes
    that were folded, or can no longer be read: each tensor hashed, each file's header read once.
    ``verify`` names them once a source file is found changed; the serving loader checks the inputs
    of every fold it loads, so that a fold never serves beside weights it was not made from (the
    manifest and sidecar of another model, a source rewritten in place at the same size: files
    whose sizes, all the loader checks of the sources otherwise, are right)."""
    headers: dict[str, dict[str, TensorInfo] | None] = {}
    changed = []
    for source in sources:
        if source.file not in headers:
            headers[source.file] = header_tensors(directory / source.file)
        info = (headers[source.file] or {}).get(source.name)
        try:
            same = info is not None and tensor_digest(read_tensor_bytes(directory / source.file, info)) == source.blake3
        except FoldckptError:
            same = False
        if not same:
            changed.append(source)
    return changed


def header_tensors(path: Path) -> dict[str, TensorInfo] | None:
    """The tensors a safetensors file's header lists, or None when the header cannot be read (a
    problem the caller reports elsewhere, by the file)."""
    try:
        return read_header(path).tensors
    except FoldckptError:
        return None
