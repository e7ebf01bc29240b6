"""``foldckpt.json``: the manifest that describes a converted checkpoint.

It is the single source of truth for verify and for the vLLM plugin, and it is written last and
atomically: its presence means the conversion finished. Its content is deterministic (no
timestamps), so an interrupted-then-resumed conversion produces the same bytes as a clean one.

It is the root of trust, so it vouches for itself: ``manifest_sha256`` is the sha256 of the
canonical encoding of everything else in it (:func:`canonical_bytes`), and the file must be
byte-for-byte the encoding foldckpt writes (:func:`encode_manifest`). Any edit of any byte is
therefore caught by :func:`read_manifest` (a :class:`~foldckpt.errors.ManifestError`), before a
file is judged by it. A consistent forgery (manifest and files rewritten together, digest
recomputed) cannot be told from the real thing by the manifest alone: users pin a conversion by
the sha256 of the ``foldckpt.json`` file (``verify`` and ``inspect`` print it, ``sha256sum`` gives
the same), and ``read_manifest(expect_sha256=...)`` refuses any other.

Format 5 (this one) records folds that are each element's exact value rounded once to the fold
dtype, the same bytes from any CPU or GPU, and so no longer the fold device among its parameters:
the same sources and parameters give the same manifest, and the same sha256, on every machine.
Format 4 had folds rounded from fp32 sums, which depended on the machine, and recorded where they
were made. Since format 4 it records one BLAKE3 digest per head block of each fold and of each
source tensor a fold was computed from (tensor bytes; :mod:`foldckpt.io.hashing` says why), and a
sha256 per file: per source file of the whole file, per sidecar of its header. The header and the head blocks tile a
sidecar, so every sidecar byte is covered by exactly one digest and convert hashes each fold byte
once. Format 3 had sha256 where format 4 has BLAKE3; format 2 also kept a whole-file sha256 of each
sidecar (every fold byte hashed twice); format 1 recorded per-rank hashes for the TP sizes chosen
at convert time. All are refused with the command that rewrites them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt import __version__
from foldckpt.defaults import ACCUMULATION_DTYPE, FOLD_DTYPE_NAMES, SCALED_FOLD_DTYPES
from foldckpt.errors import FoldckptError, ManifestError
from foldckpt.io.files import atomic_output, parse_json
from foldckpt.io.hashing import LEAF_RULE, RANK_RULE, TENSOR_DIGEST_RULE
from foldckpt.io.safetensors_format import tensor_nbytes
from foldckpt.model.geometry import SUPPORTED_ARCHITECTURES, Geometry, MLALayer

MANIFEST_NAME = "foldckpt.json"
FORMAT_NAME = "foldckpt"
FORMAT_VERSION = 5
DIGEST_KEY = "manifest_sha256"
DIGEST_RULE = (
    f"sha256 of the manifest without '{DIGEST_KEY}', encoded as JSON with sorted keys, "
    "separators (',', ':'), ASCII escapes"
)
FORMULA = "W_fold[h] = [W_UK[h]^T @ W_qb_nope[h] ; W_qb_pe[h]]"
SCALE_RULE = (
    "<layer prefix>.self_attn.q_fold.weight_scale, F32 [H*(L+R)]: W_fold ~= weight * weight_scale[:, None], "
    "weight_scale = amax(|row|) / 448, weight = row / weight_scale rounded once to e4m3 (OCP e4m3fn)"
)
ROUNDING_RULE = (
    "each element of W_UK^T @ W_qb_nope is its exact value rounded once to the fold dtype (to nearest, ties to "
    "even; an exact zero is +0), from the source values (fp8 ones: e4m3 value times block scale rounded once to "
    "float32); fp8 folds are quantized from the float32 fold so rounded"
)
SIDECAR_RULE = "header_sha256 covers bytes [0, 8 + header length); the folds' head_blake3 cover the rest"
LAYOUT = "head-major [H*(L+R), Lq]; rank r of tp owns rows [r*H/tp*(L+R), (r+1)*H/tp*(L+R))"
TENSOR_NAME_RULE = "<layer prefix>.self_attn.q_fold.weight"
# The row groups of a fold whose relative errors vs fp64 are recorded (foldckpt.fold.FoldError).
ERROR_ROWS = ("ql_nope", "q_pe")
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# Older formats this one replaced, refused with the command that rewrites them (format 1 below).
_OLDER_FORMATS = {
    2: "whole-file sidecar hashes",
    3: "sha256 head and source-tensor digests",
    4: "folds rounded from fp32 sums, which differ from machine to machine",
}


class SchemaError(ValueError):
    """A field of a manifest whose type or range is not what this format holds, ``field`` naming it
    as a path from the manifest's root (``tensors["…"].error_vs_fp64.rel_fro_error``)."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"field {field} {detail}")
        self.field = field


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(value: Any, where: str, minimum: int = 0, maximum: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise SchemaError(where, f"must be an integer {bound}, got {_shown(value)}")
    return value


def _text(value: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise SchemaError(where, f"must be a string, got {_shown(value)}")
    if choices is not None and value not in choices:
        raise SchemaError(where, f"must be one of {', '.join(map(_shown, choices))}, got {_shown(value)}")
    return value


def _figure(value: Any, where: str) -> float | None:
    """An error figure: a finite number >= 0, or null (the figure of a fold of NaN inputs)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise SchemaError(where, f"must be a number >= 0 or null, got {_shown(value)}")
    return value


class _Fields:
    """One JSON object of a manifest, read one field at a time: each read checks the field's type
    and range and names the field when they are wrong (:class:`SchemaError`), and :meth:`close`
    refuses a field that no read took (not one of this format's). Why: every reader of a manifest
    (verify, inspect, convert's rerun, the serving loader) takes its fields as the types they say,
    and a hand-edited manifest with its digest recomputed made them crash (a string error figure)
    or blame a flag nobody passed (a shard size of 0)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise SchemaError(where or "(the root)", f"must be an object, got {_shown(data)}")
        self.data: dict[str, Any] = data
        self._where, self._read = where, set()

    def name(self, key: str) -> str:
        """The field path of ``key`` in this object."""
        return f"{self._where}.{key}" if self._where else key

    def has(self, key: str) -> bool:
        return key in self.data

    def value(self, key: str) -> Any:
        self._read.add(key)
        if key not in self.data:
            raise SchemaError(self.name(key), "is missing")
        return self.data[key]

    def integer(self, key: str, minimum: int = 0, maximum: int | None = None) -> int:
        return _integer(self.value(key), self.name(key), minimum, maximum)

    def text(self, key: str, choices: tuple[str, ...] | None = None) -> str:
        return _text(self.value(key), self.name(key), choices)

    def optional_text(self, key: str) -> str | None:
        value = self.value(key)
        return None if value is None else _text(value, self.name(key))

    def boolean(self, key: str) -> bool:
        value = self.value(key)
        if not isinstance(value, bool):
            raise SchemaError(self.name(key), f"must be true or false, got {_shown(value)}")
        return value

    def figure(self, key: str) -> float | None:
        return _figure(self.value(key), self.name(key))

    def object(self, key: str) -> _Fields:
        return _Fields(self.value(key), self.name(key))

    def table(self, key: str) -> list[tuple[str, Any, str]]:
        """An object of records by name (``tensors``, ``sidecars``, ...): each name, its record and
        the record's field path, ``key["name"]`` (quoted as JSON writes it)."""
        table = self.object(key)
        return [(name, item, f"{self.name(key)}[{json.dumps(name)}]") for name, item in table.data.items()]

    def array(self, key: str, length: int | None = None) -> list[tuple[Any, str]]:
        """A list (of ``length`` items where given): each item with its field path, ``key[i]``."""
        value, where = self.value(key), self.name(key)
        if not isinstance(value, list) or (length is not None and len(value) != length):
            expected = "a list" if length is None else f"a list of {length}"
            raise SchemaError(where, f"must be {expected}, got {_shown(value)}")
        return [(item, f"{where}[{index}]") for index, item in enumerate(value)]

    def close(self) -> None:
        """Refuse a field that no read took: not one of this format's."""
        unread = [key for key in self.data if key not in self._read]
        if unread:
            raise SchemaError(self.name(unread[0]), f"is not a field of manifest format {FORMAT_VERSION}")


def _shape(fields: _Fields, key: str, dims: int) -> tuple[int, ...]:
    return tuple(_integer(item, where, 1) for item, where in fields.array(key, dims))


def _digests(fields: _Fields, key: str) -> tuple[str, ...]:
    """A list of digests (whether each is 64 hex digits, and one per head, is
    :func:`~foldckpt.format.consistency.manifest_problems`' to judge)."""
    return tuple(_text(item, where) for item, where in fields.array(key))


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> FileRecord:
        fields = _Fields(data, where)
        record = cls(fields.integer("size"), fields.text("sha256"))
        fields.close()
        return record


@dataclass(frozen=True)
class SidecarRecord:
    """A sidecar file: its size and the sha256 of its safetensors header (bytes ``[0, 8 + header
    length)``); the tensor data after it is covered by the folds' head digests."""

    size: int
    header_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "header_sha256": self.header_sha256}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "sidecar") -> SidecarRecord:
        fields = _Fields(data, where)
        record = cls(fields.integer("size"), fields.text("header_sha256"))
        fields.close()
        return record


@dataclass(frozen=True)
class SourceTensor:
    """Where a fold's input came from, with the tensor digest (BLAKE3) of exactly the bytes read."""

    name: str
    file: str
    blake3: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "blake3": self.blake3}


@dataclass(frozen=True)
class ScaleTensor:
    """The fp32 scale per row of an fp8 fold (``...q_fold.weight_scale``, ``[H*(L+R)]``), stored
    right after the fold in its sidecar, with its own per-head leaves (head h: rows
    ``[h*(L+R), (h+1)*(L+R))``, the rows its rank owns)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    head_blake3: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "head_blake3": list(self.head_blake3),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> ScaleTensor:
        fields = _Fields(data, where)
        scale = cls(
            fields.text("name"), fields.text("dtype"), _shape(fields, "shape", 1), _digests(fields, "head_blake3")
        )
        fields.close()
        return scale


@dataclass(frozen=True)
class FoldTensor:
    """One stored fold tensor and everything needed to check it: the leaves of its per-head hash
    tree (``head_blake3[h]``: BLAKE3 of head h's rows of the stored bytes), its sources, its error."""

    name: str
    layer_index: int
    layer_prefix: str
    file: str
    dtype: str
    shape: tuple[int, int]
    head_blake3: tuple[str, ...]
    sources: tuple[SourceTensor, ...]
    error: dict[str, Any]
    scale: ScaleTensor | None = None

    @property
    def rel_fro_error(self) -> float:
        """The recorded relative error vs fp64; NaN where it is null (a fold of NaN inputs)."""
        value = self.error.get("rel_fro_error")
        return math.nan if value is None else float(value)

    def parts(self) -> list[FoldTensor | ScaleTensor]:
        """The tensors stored for this fold, in sidecar order: the fold, and an fp8 fold's scale."""
        return [self] if self.scale is None else [self, self.scale]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_index": self.layer_index,
            "layer_prefix": self.layer_prefix,
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "head_blake3": list(self.head_blake3),
            **({"weight_scale": self.scale.to_dict()} if self.scale is not None else {}),
            "sources": [source.to_dict() for source in self.sources],
            "error_vs_fp64": self.error,
        }

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any], num_heads: int, where: str = "fold") -> FoldTensor:
        """The record of fold ``name`` of a model of ``num_heads`` heads, every field checked
        (:class:`SchemaError` names a wrong one by its path from ``where``)."""
        fields = _Fields(data, where)
        shape = _shape(fields, "shape", 2)
        sources = []
        for item, item_where in fields.array("sources"):
            source = _Fields(item, item_where)
            sources.append(SourceTensor(source.text("name"), source.text("file"), source.text("blake3")))
            source.close()
        tensor = cls(
            name=name,
            layer_index=fields.integer("layer_index"),
            layer_prefix=fields.text("layer_prefix"),
            file=fields.text("file"),
            dtype=fields.text("dtype"),
            shape=(shape[0], shape[1]),
            head_blake3=_digests(fields, "head_blake3"),
            sources=tuple(sources),
            error=_read_error(fields.object("error_vs_fp64"), num_heads),
            scale=ScaleTensor.from_dict(fields.value("weight_scale"), fields.name("weight_scale"))
            if fields.has("weight_scale")
            else None,
        )
        fields.close()
        return tensor


def _read_error(fields: _Fields, num_heads: int) -> dict[str, Any]:
    """A fold's recorded error vs fp64 (:meth:`foldckpt.fold.FoldError.to_dict`), checked: the
    heads measured, each a head of the model; figures >= 0 (null: NaN); the worst head one of the
    heads measured (null when none was). Returned as recorded (the manifest is re-encoded from it)."""
    heads = [_integer(item, where, 0, num_heads - 1) for item, where in fields.array("heads")]
    fields.figure("rel_fro_error")
    fields.figure("max_abs_error")
    rows = fields.object("rel_fro_error_rows")
    for part in ERROR_ROWS:
        rows.figure(part)
    rows.close()
    worst = fields.value("worst_head")
    if worst is not None or heads:
        _integer(worst, fields.name("worst_head"), 0, num_heads - 1)
        if worst not in heads:
            raise SchemaError(fields.name("worst_head"), f"must be one of the heads measured, {heads}, got {worst}")
    fields.close()
    return dict(fields.data)


@dataclass(frozen=True)
class Manifest:
    geometry: Geometry
    fold_dtype: str
    accumulation_dtype: str
    tensors: dict[str, FoldTensor]
    sidecars: dict[str, SidecarRecord]
    source_files: dict[str, FileRecord]
    parameters: dict[str, Any] = field(default_factory=dict)
    # For a model converted by Hugging Face id: {"repo_id", "revision" (as asked), "commit"}.
    source: dict[str, Any] | None = None
    # Names among source_files that foldckpt wrote rather than placed: the safetensors index of a
    # source without one, so that weight loaders read the listed weights and never the sidecars.
    generated_files: tuple[str, ...] = ()
    tool_version: str = __version__
    format_version: int = FORMAT_VERSION
    # The sha256 of the foldckpt.json file this was read from (what users pin); None when built.
    file_sha256: str | None = field(default=None, compare=False)

    @property
    def files(self) -> dict[str, FileRecord | SidecarRecord]:
        """Every file of the output directory the manifest vouches for (except itself)."""
        return {**self.source_files, **self.sidecars}

    def fold_bytes(self) -> int:
        """Bytes of fold tensor data, scales included (what GPUs hold), as ``Plan.fold_bytes`` counts them."""
        return sum(tensor_nbytes(part.dtype, part.shape) for t in self.tensors.values() for part in t.parts())

    def sidecar_bytes(self) -> int:
        """Bytes of the sidecar files on disk (tensor data plus safetensors headers)."""
        return sum(record.size for record in self.sidecars.values())

    def to_dict(self) -> dict[str, Any]:
        source = {"source": self.source} if self.source is not None else {}
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "tool_version": self.tool_version,
            **source,
            "geometry": self.geometry.to_dict(),
            "fold": {
                "formula": FORMULA,
                "layout": LAYOUT,
                "dtype": self.fold_dtype,
                "accumulation_dtype": self.accumulation_dtype,
                "rounding": ROUNDING_RULE,
                "tensor_name": TENSOR_NAME_RULE,
                **({"scale": SCALE_RULE} if self.fold_dtype in SCALED_FOLD_DTYPES else {}),
            },
            "integrity": {
                "head_blake3": LEAF_RULE,
                "rank_digest": RANK_RULE,
                "sources": TENSOR_DIGEST_RULE,
                "sidecar": SIDECAR_RULE,
                DIGEST_KEY: DIGEST_RULE,
            },
            "parameters": self.parameters,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "sidecars": {name: r.to_dict() for name, r in self.sidecars.items()},
            "source_files": {name: r.to_dict() for name, r in self.source_files.items()},
            **({"generated_files": list(self.generated_files)} if self.generated_files else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """The manifest of ``data``, every field's type and range checked (:class:`SchemaError`
        names the first that is wrong): the one place a manifest's fields are read."""
        root = _Fields(data, "")
        root.text("format", (FORMAT_NAME,))
        root.value(DIGEST_KEY)  # proven by read_manifest
        geometry = _read_geometry(root.object("geometry"))
        fold = root.object("fold")
        fold_dtype = fold.text("dtype", tuple(FOLD_DTYPE_NAMES))
        for key, rule in (
            ("formula", FORMULA),
            ("layout", LAYOUT),
            ("accumulation_dtype", ACCUMULATION_DTYPE),
            ("rounding", ROUNDING_RULE),
            ("tensor_name", TENSOR_NAME_RULE),
            *((("scale", SCALE_RULE),) if fold_dtype in SCALED_FOLD_DTYPES else ()),
        ):
            fold.text(key, (rule,))
        fold.close()
        integrity = root.object("integrity")
        for key, rule in (
            ("head_blake3", LEAF_RULE),
            ("rank_digest", RANK_RULE),
            ("sources", TENSOR_DIGEST_RULE),
            ("sidecar", SIDECAR_RULE),
            (DIGEST_KEY, DIGEST_RULE),
        ):
            integrity.text(key, (rule,))
        integrity.close()
        parameters = root.object("parameters")
        parameters.text("fold_dtype", (fold_dtype,))
        parameters.text("accumulation_dtype", (ACCUMULATION_DTYPE,))
        parameters.integer("max_shard_size", 1)
        parameters.text("run_key")
        parameters.close()
        source = None
        if root.has("source"):
            origin = root.object("source")
            source = {key: origin.text(key) for key in ("repo_id", "revision", "commit")}
            origin.close()
        generated: tuple[str, ...] = ()
        if root.has("generated_files"):
            generated = tuple(_text(item, where) for item, where in root.array("generated_files"))
        manifest = cls(
            geometry=geometry,
            fold_dtype=fold_dtype,
            accumulation_dtype=ACCUMULATION_DTYPE,
            tensors={
                name: FoldTensor.from_dict(name, item, geometry.num_heads, where)
                for name, item, where in root.table("tensors")
            },
            sidecars={name: SidecarRecord.from_dict(item, where) for name, item, where in root.table("sidecars")},
            source_files={name: FileRecord.from_dict(item, where) for name, item, where in root.table("source_files")},
            parameters=dict(parameters.data),
            source=source,
            generated_files=generated,
            tool_version=root.text("tool_version"),
            format_version=root.integer("format_version", FORMAT_VERSION, FORMAT_VERSION),
        )
        root.close()
        return manifest


def _read_geometry(fields: _Fields) -> Geometry:
    layers = []
    for item, where in fields.array("layers"):
        layer = _Fields(item, where)
        layers.append(MLALayer(layer.integer("index"), layer.text("prefix"), layer.boolean("is_mtp")))
        layer.close()
    block = None
    if fields.value("weight_block_size") is not None:
        rows, columns = _shape(fields, "weight_block_size", 2)
        block = (rows, columns)
    geometry = Geometry(
        family=fields.text("family"),
        architecture=fields.text("architecture", SUPPORTED_ARCHITECTURES),
        num_heads=fields.integer("num_heads", 1),
        q_lora_rank=fields.integer("q_lora_rank", 1),
        kv_lora_rank=fields.integer("kv_lora_rank", 1),
        qk_nope_head_dim=fields.integer("qk_nope_head_dim", 1),
        qk_rope_head_dim=fields.integer("qk_rope_head_dim", 1),
        v_head_dim=fields.integer("v_head_dim", 1),
        layers=tuple(layers),
        uses_rope=fields.boolean("uses_rope"),
        quant_method=fields.optional_text("quant_method"),
        weight_block_size=block,
    )
    fields.close()
    return geometry


def canonical_bytes(data: dict[str, Any]) -> bytes:
    """The canonical encoding of a manifest's content, without its own digest (what it signs)."""
    body = {key: value for key, value in data.items() if key != DIGEST_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def manifest_digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_bytes(data)).hexdigest()


def encode_manifest(data: dict[str, Any]) -> bytes:
    """The exact bytes of ``foldckpt.json`` for ``data`` (which carries its digest last)."""
    return (json.dumps(data, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def manifest_bytes(manifest: Manifest) -> bytes:
    data = manifest.to_dict()
    data[DIGEST_KEY] = manifest_digest(data)
    return encode_manifest(data)


def write_manifest(out_dir: Path, manifest: Manifest) -> str:
    """Write ``foldckpt.json`` atomically; returns the file's sha256 (what users pin)."""
    raw = manifest_bytes(manifest)
    with atomic_output(Path(out_dir) / MANIFEST_NAME) as handle:
        handle.write(raw)
    return hashlib.sha256(raw).hexdigest()


def _read_raw(path: Path, out_dir: Path) -> bytes:
    """The manifest's bytes; a missing or unreadable manifest is unusable input, not a failed check."""
    if path.exists() and not path.is_file():  # a FIFO or device would block or never end
        raise FoldckptError.at(path, "not a regular file; not a foldckpt manifest")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(_MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise FoldckptError.at(path, f"not found; {out_dir} is not a finished foldckpt conversion") from None
    except OSError as exc:
        raise FoldckptError.at(path, f"cannot read: {exc.strerror}") from None
    return raw


def file_sha256(out_dir: Path) -> str:
    """sha256 of the ``foldckpt.json`` file, as ``sha256sum`` prints it."""
    return hashlib.sha256(_read_raw(Path(out_dir) / MANIFEST_NAME, Path(out_dir))).hexdigest()


def listed_files(out_dir: Path) -> list[str]:
    """The file names any foldckpt manifest in ``out_dir`` lists (format 1 included; nothing when it
    cannot be parsed): what ``convert --restart`` removes. Trusts nothing else in it."""
    try:
        data = parse_json(_read_raw(Path(out_dir) / MANIFEST_NAME, Path(out_dir))[:_MAX_MANIFEST_BYTES])
        return [name for name in data.get("source_files", {}) if isinstance(name, str)]
    except (FoldckptError, ValueError, AttributeError, TypeError):
        return []


def read_manifest(out_dir: Path, expect_sha256: str | None = None) -> Manifest:
    """Load ``foldckpt.json`` and prove it is unedited: its own digest, its exact encoding, and (when
    ``expect_sha256`` is given) the pinned file sha256. Raises :class:`ManifestError` for any defect
    of an existing manifest, :class:`FoldckptError` when there is none to read or it is format 1."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST_NAME
    raw = _read_raw(path, out_dir)

    def bad(detail: str) -> ManifestError:
        return ManifestError(f"{path}: {detail}", path=path, detail=detail)

    digest = hashlib.sha256(raw).hexdigest()
    if expect_sha256 is not None and digest != expect_sha256.strip().lower():
        raise bad(f"sha256 {digest} is not the pinned {expect_sha256.strip().lower()}: not the conversion you pinned")
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise bad(f"larger than {_MAX_MANIFEST_BYTES} bytes; not a foldckpt manifest")
    try:
        data = parse_json(raw)
    except ValueError as exc:
        raise bad(f"invalid JSON ({exc}); damaged or edited after conversion") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise bad('not a foldckpt manifest (no "format": "foldckpt")')
    version, recorded = data.get("format_version"), data.get(DIGEST_KEY)
    # The self-digest first (every format since 2 has it, by the same rule), then the format:
    # the format_version of a current manifest edited to an older one is an edit (a failed check,
    # exit 1), not an old output to reconvert (unusable input, exit 2).
    if version == 1 and recorded is None and "tp_sizes" in data:
        raise FoldckptError.at(
            path,
            f"written in manifest format 1 (per-TP rank hashes, no self-digest) by foldckpt "
            f"{data.get('tool_version')}; foldckpt {__version__} reads format {FORMAT_VERSION} only: "
            "reconvert (foldckpt convert MODEL_DIR OUT_DIR --restart)",
        )
    if not isinstance(recorded, str) or recorded != manifest_digest(data):
        raise bad(f"its self-digest ({DIGEST_KEY}) does not match its content: edited or damaged after conversion")
    if isinstance(version, int) and version in _OLDER_FORMATS:
        raise FoldckptError.at(
            path,
            f"written in manifest format {version} ({_OLDER_FORMATS[version]}) by foldckpt "
            f"{data.get('tool_version')}; foldckpt {__version__} reads format {FORMAT_VERSION} only: reconvert "
            "(foldckpt convert MODEL_DIR OUT_DIR --restart)",
        )
    if version != FORMAT_VERSION:
        raise bad(
            f"format_version {version!r} is not one foldckpt {__version__} reads ({FORMAT_VERSION}): edited, or written by another foldckpt"
        )
    try:
        canonical = encode_manifest(data) == raw
    except (TypeError, ValueError):
        canonical = False
    if not canonical:
        raise bad("not byte-for-byte the encoding foldckpt writes (its content is intact): edited after conversion")
    try:
        manifest = Manifest.from_dict(data)
    except SchemaError as exc:
        raise bad(str(exc)) from None
    return dataclasses.replace(manifest, file_sha256=digest)


@dataclass(frozen=True)
class FoldedLayer:
    """One fold recorded in the manifest: config layer index, sidecar and error vs fp64."""

    index: int
    is_mtp: bool
    tensor: str
    sidecar: str
    rel_fro_error: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
