"""Every input error of the checkpoint, config and safetensors readers carries its file (``path``),
its tensor (``tensor``) and its message without the ``<path>: `` prefix (``detail``), so that no
program parses message text (issue #12, item 3).

Each case breaks a real synthetic checkpoint on disk and checks the three fields and the exact
message: a raise that builds ``f"{path}: ..."`` by hand (dropping ``path``), forgets ``tensor=``,
or rewords the message fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from foldckpt.convert.plan import plan_conversion
from foldckpt.errors import FoldckptError
from foldckpt.format.consistency import Problem
from foldckpt.io.safetensors_format import read_header
from foldckpt.model.checkpoint import INDEX_NAME, list_files_to_place, open_source_checkpoint
from foldckpt.model.geometry import CONFIG_NAME, geometry_from_config, read_geometry
from foldckpt.model.synthetic import make_checkpoint

SHARD = "model-00001-of-00002.safetensors"


def _fails(call: Callable[[], object]) -> FoldckptError:
    with pytest.raises(FoldckptError) as caught:
        call()
    return caught.value


def _assert_fields(exc: FoldckptError, path: Path | str, detail: str, tensor: str | None = None) -> None:
    """The message is exactly ``<path>: <detail>``, and the fields say the same."""
    assert str(exc) == f"{path}: {detail}"
    assert (exc.path, exc.tensor, exc.detail) == (str(path), tensor, detail)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "model", "deepseek_v3", layers=1, mtp_layers=0, shards=2)


@pytest.fixture
def kimi(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "kimi", "kimi_k3", layers=2, mtp_layers=0, shards=2)


def _edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    """Rewrite a JSON file: ``edit`` changes the document in place, or returns a new one."""
    data = json.loads(path.read_text())
    result = edit(data)
    path.write_text(json.dumps(data if result is None else result))


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _rewrite_shard(
    path: Path, edit: Callable[[dict[str, Any]], object], data: Callable[[bytes], bytes] = bytes
) -> None:
    """Re-encode the shard's header after ``edit`` (offsets are relative to the data, so they stay valid)."""
    header, payload = _split(path)
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data(payload))


def _tensors_by_offset(path: Path) -> list[str]:
    header, _ = _split(path)
    return sorted((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"])


# --- config.json (geometry.py) ------------------------------------------------------------------

NO_Q_LORA = (
    "q_lora_rank is not set: this model projects queries with q_proj directly (no q_b_proj), so there is "
    "nothing to fold"
)
MTP = "'num_nextn_predict_layers' must be a non-negative integer"


@pytest.mark.parametrize(
    ("edit", "detail"),
    [
        pytest.param(lambda c: [c], "expected a JSON object", id="not-an-object"),
        pytest.param(
            lambda c: c.update(architectures=["LlamaForCausalLM"]),
            "unsupported architecture ['LlamaForCausalLM']; foldckpt folds DeepseekV2ForCausalLM, "
            "DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration, KimiK3ForConditionalGeneration",
            id="architecture",
        ),
        pytest.param(lambda c: c.update(q_lora_rank=None), NO_Q_LORA, id="no-q_lora_rank"),
        pytest.param(
            lambda c: c.update(num_attention_heads=0),
            "'num_attention_heads' must be a positive integer, got 0",
            id="heads",
        ),
        pytest.param(lambda c: c.update(num_nextn_predict_layers=-1), MTP, id="mtp"),
    ],
)
def test_config_errors_carry_the_config_path(model: Path, edit: Callable[[Any], Any], detail: str) -> None:
    config = model / CONFIG_NAME
    _edit_json(config, edit)
    _assert_fields(_fails(lambda: read_geometry(model)), config, detail)


def test_kimi_config_without_text_config_names_the_file(kimi: Path) -> None:
    config = kimi / CONFIG_NAME
    _edit_json(config, lambda c: c.__delitem__("text_config"))
    detail = "KimiK3ForConditionalGeneration needs a 'text_config' object"
    _assert_fields(_fails(lambda: read_geometry(kimi)), config, detail)


def _kda(layers: list[Any]) -> Callable[[Any], None]:
    return lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=layers)


def _text(**changes: Any) -> Callable[[Any], None]:
    return lambda c: c["text_config"].update(changes)


@pytest.mark.parametrize(
    ("edit", "detail"),
    [
        pytest.param(_text(v_head_dim="32"), "'v_head_dim' must be a positive integer, got '32'", id="v_head_dim"),
        pytest.param(_text(q_lora_rank=0), NO_Q_LORA, id="no-q_lora_rank"),
        pytest.param(_text(num_nextn_predict_layers=True), MTP, id="mtp"),
        pytest.param(
            lambda c: c["text_config"].__delitem__("linear_attn_config"),
            "Kimi-K3 text_config needs linear_attn_config.kda_layers",
            id="no-kda_layers",
        ),
        pytest.param(
            _kda([0]), "linear_attn_config.kda_layers must hold 1-based layer numbers in 1..2", id="kda-range"
        ),
        pytest.param(_kda([1, 2]), "the model has no MLA layer (every layer is linear attention)", id="no-mla"),
    ],
)
def test_text_config_errors_carry_the_config_path_and_name_the_section(
    kimi: Path, edit: Callable[[Any], Any], detail: str
) -> None:
    """The message reads ``<config> (text_config): ...`` as before; ``path`` is the file itself
    (not ``"<config> (text_config)"``) and ``detail`` keeps the section."""
    config = kimi / CONFIG_NAME
    _edit_json(config, edit)
    exc = _fails(lambda: read_geometry(kimi))
    assert str(exc) == f"{config} (text_config): {detail}"
    assert (exc.path, exc.tensor, exc.detail) == (str(config), None, f"text_config: {detail}")


def test_a_parsed_config_names_the_where_it_was_given(model: Path) -> None:
    config = json.loads((model / CONFIG_NAME).read_text())
    config["kv_lora_rank"] = -4
    detail = "'kv_lora_rank' must be a positive integer, got -4"
    _assert_fields(_fails(lambda: geometry_from_config(config)), CONFIG_NAME, detail)
    _assert_fields(_fails(lambda: geometry_from_config(config, "elsewhere.json")), "elsewhere.json", detail)


def test_problem_of_a_config_error_is_named_by_its_file(model: Path) -> None:
    """What the fields are for: verify's problem list names ``config.json`` and the bare detail."""
    _edit_json(model / CONFIG_NAME, lambda c: c.update(num_attention_heads=0))
    problem = Problem.of(model, _fails(lambda: read_geometry(model)), "fallback")
    assert problem == Problem(CONFIG_NAME, "'num_attention_heads' must be a positive integer, got 0")


# --- the index and the model directory (checkpoint.py) ------------------------------------------


def test_a_tensor_not_in_the_checkpoint(model: Path) -> None:
    source = open_source_checkpoint(model)
    _assert_fields(_fails(lambda: source.read("nope")), model, "tensor 'nope' is not in the checkpoint", "nope")


@pytest.mark.parametrize(
    ("file", "detail"),
    [
        ("", "invalid file name ''"),
        ("a\x00b.safetensors", "invalid file name 'a\\x00b.safetensors'"),
        ("../elsewhere.safetensors", "file name '../elsewhere.safetensors' escapes the model directory; refused"),
        ("/abs.safetensors", "file name '/abs.safetensors' escapes the model directory; refused"),
        ("missing.safetensors", "refers to 'missing.safetensors', which does not exist in {model}"),
        ("dir.safetensors", "'dir.safetensors' is not a regular file"),
        ("link.safetensors", "'link.safetensors' is a symlink to {outside}, outside the model directory; refused"),
    ],
    ids=["empty", "nul", "dotdot", "absolute", "missing", "directory", "symlink-out"],
)
def test_bad_index_entries_carry_the_index_path(tmp_path: Path, model: Path, file: str, detail: str) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.copy(model / SHARD, outside)
    (model / "link.safetensors").symlink_to(outside)
    (model / "dir.safetensors").mkdir()
    index = model / INDEX_NAME
    _edit_json(index, lambda i: i["weight_map"].update({"model.embed_tokens.weight": file}))
    exc = _fails(lambda: open_source_checkpoint(model))
    _assert_fields(exc, index, detail.format(model=model, outside=outside.resolve()))


def test_a_weight_map_that_is_not_a_mapping(model: Path) -> None:
    index = model / INDEX_NAME
    _edit_json(index, lambda i: i.update(weight_map=["model.embed_tokens.weight"]))
    detail = "'weight_map' must map tensor names to file names"
    _assert_fields(_fails(lambda: open_source_checkpoint(model)), index, detail)


def test_an_index_entry_the_shard_does_not_hold_names_index_and_tensor(model: Path) -> None:
    index = model / INDEX_NAME
    _edit_json(index, lambda i: i["weight_map"].update(ghost=SHARD))
    detail = f"says 'ghost' is in {SHARD}, but that file's header has no such tensor"
    _assert_fields(_fails(lambda: open_source_checkpoint(model)), index, detail, "ghost")


def test_a_tensor_in_two_shards_without_an_index_names_the_second_shard(model: Path) -> None:
    (model / INDEX_NAME).unlink()
    duplicate = model / "zz-copy.safetensors"
    shutil.copy(model / SHARD, duplicate)
    name = next(iter(read_header(duplicate).tensors))
    detail = f"tensor '{name}' also appears in {SHARD}"
    _assert_fields(_fails(lambda: open_source_checkpoint(model)), duplicate, detail, name)


def test_directories_without_weights_carry_their_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    detail = f"no {INDEX_NAME} or *.safetensors weights found"
    _assert_fields(_fails(lambda: open_source_checkpoint(empty)), empty, detail)
    (empty / "pytorch_model.bin").write_bytes(b"\x80\x04")
    detail = (
        "only pickle weights found (pytorch_model.bin); foldckpt never unpickles files: "
        "convert the checkpoint to safetensors first"
    )
    _assert_fields(_fails(lambda: open_source_checkpoint(empty)), empty, detail)
    pickle = empty / "pytorch_model.bin"
    _assert_fields(_fails(lambda: open_source_checkpoint(pickle)), pickle, "not a directory")


def test_files_to_place_outside_the_model_carry_the_model_dir(tmp_path: Path, model: Path) -> None:
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    (model / "notes.txt").symlink_to(outside)
    detail = f"'notes.txt' is a symlink to {outside.resolve()}, outside the model directory; refused"
    _assert_fields(_fails(lambda: list_files_to_place(model)), model, detail)


# --- shard headers and tensor data (safetensors_format.py), through the checkpoint --------------


def _first(header: dict[str, Any]) -> str:
    return next(name for name in header if name != "__metadata__")


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h[_first(h)].update({field: value})


def _double_rows(header: dict[str, Any]) -> None:
    entry = header[_first(header)]
    entry["shape"] = [2 * entry["shape"][0], *entry["shape"][1:]]


ENTRY_CASES = [
    ("not-an-object", lambda h: h.update({_first(h): []}), "header entry for tensor '{t}' is not an object"),
    ("dtype", _set("dtype", "Q7"), "tensor '{t}' has unknown dtype 'Q7'"),
    ("shape", _set("shape", [-1]), "tensor '{t}' has an invalid shape [-1]"),
    ("offsets", _set("data_offsets", [5]), "tensor '{t}' has invalid data_offsets [5]"),
    ("shape-mismatch", _double_rows, "tensor '{t}' spans {n} bytes but BF16{shape} needs {twice}"),
]


@pytest.mark.parametrize(("edit", "what"), [c[1:] for c in ENTRY_CASES], ids=[c[0] for c in ENTRY_CASES])
def test_bad_header_entries_carry_the_shard_and_the_tensor(
    model: Path, edit: Callable[[dict[str, Any]], None], what: str
) -> None:
    shard = model / SHARD
    header, _ = _split(shard)
    name = _first(header)
    entry = header[name]
    assert entry["dtype"] == "BF16"
    begin, end = entry["data_offsets"]
    shape = [2 * entry["shape"][0], *entry["shape"][1:]]
    _rewrite_shard(shard, edit)
    detail = "not a valid safetensors file: " + what.format(t=name, n=end - begin, shape=shape, twice=2 * (end - begin))
    _assert_fields(_fails(lambda: open_source_checkpoint(model)), shard, detail, name)


@pytest.mark.parametrize("shift", [8, -2], ids=["gap", "overlap"])
def test_a_tensor_out_of_place_carries_the_shard_and_the_tensor(model: Path, shift: int) -> None:
    shard = model / SHARD
    last = _tensors_by_offset(shard)[-1]
    start = _split(shard)[0][last]["data_offsets"][0]

    def move(header: dict[str, Any]) -> None:
        header[last]["data_offsets"] = [o + shift for o in header[last]["data_offsets"]]

    _rewrite_shard(shard, move, lambda data: data + bytes(max(shift, 0)))
    what = "leaves a gap before it" if shift > 0 else "overlaps another tensor"
    detail = f"not a valid safetensors file: tensor '{last}' {what} (offset {start + shift})"
    _assert_fields(_fails(lambda: open_source_checkpoint(model)), shard, detail, last)


def test_whole_file_header_errors_carry_the_shard_and_no_tensor(model: Path) -> None:
    shard = model / SHARD
    original = shard.read_bytes()
    size = len(original)

    shard.write_bytes(original[:4])  # a truncated header
    _assert_fields(
        _fails(lambda: open_source_checkpoint(model)),
        shard,
        "not a valid safetensors file: file is 4 bytes, too short for a header (truncated?)",
    )
    shard.write_bytes(original[:-2])  # truncated tensor data
    _assert_fields(
        _fails(lambda: open_source_checkpoint(model)),
        shard,
        f"not a valid safetensors file: tensor data needs {size} bytes but the file has {size - 2} (truncated?)",
    )
    shard.write_bytes(original + b"\0" * 3)
    _assert_fields(
        _fails(lambda: open_source_checkpoint(model)),
        shard,
        "not a valid safetensors file: 3 trailing bytes after the last tensor",
    )


def test_an_unreadable_dtype_carries_the_shard_and_the_tensor(model: Path) -> None:
    shard = model / SHARD
    name = _first(_split(shard)[0])
    _rewrite_shard(shard, _set("dtype", "U16"))  # same width as BF16: a valid header torch cannot read
    source = open_source_checkpoint(model)
    detail = f"tensor '{name}' has dtype U16, which foldckpt cannot read"
    _assert_fields(_fails(lambda: source.read(name)), shard, detail, name)


def test_a_shard_that_shrinks_after_its_header_was_checked(model: Path) -> None:
    shard = model / SHARD
    last = _tensors_by_offset(shard)[-1]
    source = open_source_checkpoint(model)
    os.truncate(shard, source.headers[SHARD].tensors[last].start)
    detail = f"truncated while reading tensor '{last}' (file shrank after its header was checked)"
    _assert_fields(_fails(lambda: source.read(last)), shard, detail, last)


def test_a_shard_that_disappears_after_its_header_was_checked(model: Path) -> None:
    shard = model / SHARD
    name = _first(_split(shard)[0])
    source = open_source_checkpoint(model)
    shard.unlink()
    _assert_fields(_fails(lambda: source.read(name)), shard, "file disappeared while converting")


def test_plan_errors_carry_the_shard_and_the_tensor(tmp_path: Path) -> None:
    """A q_b_proj whose shape disagrees with config.json: the shard that holds it, and its name."""
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    config = json.loads((model / "config.json").read_text())
    config["q_lora_rank"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(FoldckptError) as caught:
        plan_conversion(model)
    error = caught.value
    assert error.tensor is not None and error.tensor.endswith("self_attn.q_b_proj.weight")
    assert error.path is not None and Path(error.path).parent == model and Path(error.path).suffix == ".safetensors"
    assert (
        error.detail.startswith(f"tensor '{error.tensor}' has shape") and str(error) == f"{error.path}: {error.detail}"
    )
