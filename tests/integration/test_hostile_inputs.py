"""Broken and hostile inputs, and a full disk, through the real ``foldckpt convert`` (issue 4).

Each case corrupts a copy of a real synthetic checkpoint (or the environment) the way downloads,
strangers and shared storage do, runs the CLI in a subprocess and asserts what a user must see:
exit code 2, exactly one line on stderr that names the offending file, no traceback, bounded memory,
and nothing in OUT_DIR that ``verify`` would accept. Where the failure is environmental (NaN weights
allowed on request, a file-size limit, a full disk) the same command afterwards resumes to a
verified output.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.defaults import JOURNAL_NAME
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import MANIFEST_NAME
from foldckpt.io.safetensors_format import read_header
from foldckpt.model.checkpoint import INDEX_NAME
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.verify import VerifyOptions, verify

SHARD = "model-00002-of-00003.safetensors"  # holds layer 0's kv_b_proj and layer 1's q_b_proj
SIDECAR = "foldckpt-00001-of-00001.safetensors"
MAX_RSS_BYTES = 1024**3
# A claimed header length no reader may allocate. Up-front cases run under an address-space cap far
# below it (and far above what importing a CUDA build of torch maps), so an allocation attempt
# fails loudly with a traceback instead of quietly succeeding through overcommit.
HUGE_HEADER_LENGTH = 2**40
CHILD_ADDRESS_SPACE = 32 * 1024**3
_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str
    max_rss_bytes: int


# foldckpt runs as a grandchild, spawned by this small launcher, which reports its wait status and
# peak RSS. A direct child would not do: at exec Linux folds the high-water mark of the address space
# that spawned it into the child's ru_maxrss, so a child of a large pytest process would report its
# parent's peak (a 13 MB child of a process that once held 1.5 GB reports 1.5 GB). Python ignores
# SIGPIPE and SIGXFSZ at start-up, so the launcher restores their defaults for the command, as Popen does.
_MEASURED_LAUNCH = """
import os, signal, sys
pid = os.posix_spawn(sys.executable, [sys.executable, "-m", "foldckpt", *sys.argv[2:]], os.environ,
                     setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
_, status, usage = os.wait4(pid, 0)
os.write(int(sys.argv[1]), f"{status} {usage.ru_maxrss}".encode())
"""


def run_cli(*args: str | Path, preexec_fn: Callable[[], None] | None = None, timeout: float = 120) -> Run:
    """The real command line in a subprocess, with its own peak resident memory; a run that outlives
    ``timeout`` (a hang) is killed and fails the test. ``preexec_fn`` runs in the launcher, whose
    limits and capabilities the command inherits."""
    report_read, report_write = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        launcher = subprocess.Popen(
            [sys.executable, "-c", _MEASURED_LAUNCH, str(report_write), *map(str, args)],
            stdout=out,
            stderr=err,
            preexec_fn=preexec_fn,
            pass_fds=(report_write,),
            start_new_session=True,
        )
        os.close(report_write)
        watchdog = threading.Timer(timeout, os.killpg, (launcher.pid, signal.SIGKILL))
        watchdog.start()
        try:
            with os.fdopen(report_read, "rb") as report:
                fields = report.read().split()
            launcher.wait()
        finally:
            watchdog.cancel()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if not fields:
        hung = launcher.returncode == -signal.SIGKILL
        pytest.fail(f"foldckpt {args} ran past {timeout} s" if hung else f"the launcher failed: {stderr}")
    status, max_rss_kib = map(int, fields)
    return Run(os.waitstatus_to_exitcode(status), stdout, stderr, max_rss_kib * 1024)


def test_peak_memory_is_the_command_s_own() -> None:
    """The bound error_line checks must not inherit this process's peak: after holding more than the
    bound here, a run that needs a few hundred MB must still measure below it."""
    held = bytearray(MAX_RSS_BYTES + 256 * 1024**2)
    held[:: resource.getpagesize()] = b"x" * len(range(0, len(held), resource.getpagesize()))
    del held
    run = run_cli("--help")
    assert run.returncode == 0 and "convert" in run.stdout, run
    assert 10 * 1024**2 < run.max_rss_bytes < MAX_RSS_BYTES // 2, f"{run.max_rss_bytes / 1e6:.0f} MB"


def error_line(run: Run) -> str:
    """The one stderr line of a refused run (exit 2, no traceback, bounded memory)."""
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("foldckpt: error: ")
    assert run.max_rss_bytes < MAX_RSS_BYTES, f"peak memory {run.max_rss_bytes / 1e6:.0f} MB"
    return lines[0]


def assert_not_accepted(out: Path) -> None:
    """Nothing verify would accept: no OUT_DIR, or one that verify refuses or fails."""
    if not out.exists():
        return
    try:
        report = verify(out, VerifyOptions(progress=False))
    except FoldckptError:
        return
    assert not report.ok, f"verify accepted {out} after a failed conversion"


def assert_verified(out: Path) -> None:
    assert verify(out, VerifyOptions(level="deep", progress=False)).ok


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "model", "deepseek_v3")


@pytest.fixture
def model(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the checkpoint for a test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


# ----------------------------------------------------------------------------- damage helpers


def split_file(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_file(path: Path, header: bytes | dict[str, Any], data: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def replace_header_bytes(path: Path, new: bytes) -> None:
    """Overwrite the JSON header with ``new`` padded to the same length (the length prefix stays)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    write_file(path, new.ljust(length, b" ")[:length], raw[8 + length :])


def edit_index(model: Path, change: Callable[[dict[str, str]], None]) -> None:
    index = json.loads((model / INDEX_NAME).read_text())
    change(index["weight_map"])
    (model / INDEX_NAME).write_text(json.dumps(index))


def point_shard_at(model: Path, target: str) -> None:
    """Make the index say that every tensor of SHARD lives in ``target``."""
    edit_index(model, lambda wm: wm.update({k: target for k, v in wm.items() if v == SHARD}))


def outside_copy(model: Path) -> Path:
    """A valid shard outside the model directory (so only confinement can refuse it)."""
    return Path(shutil.copy(model / SHARD, model.parent / "outside.safetensors"))


class _Boom:
    """Unpickling this creates a marker file: proof that something unpickled the shard."""

    marker = ""

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (self.marker, "w")


def write_pickle_bomb(path: Path, marker: Path) -> None:
    bomb = _Boom()
    bomb.marker = str(marker)
    path.write_bytes(pickle.dumps({"model.layers.0.self_attn.q_b_proj.weight": bomb}))


def set_element(model: Path, tensor: str, value: float) -> str:
    """Write ``value`` into element 7 of ``tensor`` in place; returns the file that holds it."""
    file = json.loads((model / INDEX_NAME).read_text())["weight_map"][tensor]
    info = read_header(model / file).tensors[tensor]
    element = torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with open(model / file, "r+b") as handle:
        handle.seek(info.start + 7 * len(element))
        handle.write(element)
    return file


# ----------------------------------------------------------------------------- refused up front


def truncated_shard(model: Path) -> tuple[str, ...]:
    os.truncate(model / SHARD, (model / SHARD).stat().st_size * 2 // 3)
    return SHARD, "truncated"


def header_length_over_the_limit(model: Path) -> tuple[str, ...]:
    _, data = split_file(model / SHARD)
    (model / SHARD).write_bytes(struct.pack("<Q", HUGE_HEADER_LENGTH) + data)
    return SHARD, f"header length {HUGE_HEADER_LENGTH} exceeds"


def header_length_past_the_end(model: Path) -> tuple[str, ...]:
    _, data = split_file(model / SHARD)
    (model / SHARD).write_bytes(struct.pack("<Q", 90 * 1024**2) + data)
    return SHARD, "runs past the end"


def header_invalid_json(model: Path) -> tuple[str, ...]:
    replace_header_bytes(model / SHARD, b'{"model.layers.0": {"dtype": "BF16", "shape": [1')
    return SHARD, "not valid JSON"


def header_not_utf8(model: Path) -> tuple[str, ...]:
    replace_header_bytes(model / SHARD, b"\xff\xfe{}")
    return SHARD, "not valid JSON"


def header_not_an_object(model: Path) -> tuple[str, ...]:
    replace_header_bytes(model / SHARD, b"[1, 2, 3]")
    return SHARD, "not a JSON object"


def offsets_overlapping(model: Path) -> tuple[str, ...]:
    header, data = split_file(model / SHARD)
    # Two tensors of one dtype and shape, the later one moved onto the earlier one's bytes: every
    # entry keeps its exact size, only the tiling check can see the overlap.
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    kind = lambda k: (header[k]["dtype"], header[k]["shape"])  # noqa: E731
    first, later = next((a, b) for i, a in enumerate(names) for b in names[i + 1 :] if kind(a) == kind(b))
    header[later]["data_offsets"] = list(header[first]["data_offsets"])
    write_file(model / SHARD, header, data)
    return SHARD, f"'{later}' overlaps another tensor"


def offsets_beyond_the_file(model: Path) -> tuple[str, ...]:
    header, data = split_file(model / SHARD)
    header["model.layers.9.extra"] = {"dtype": "U8", "shape": [4096], "data_offsets": [len(data), len(data) + 4096]}
    write_file(model / SHARD, header, data)
    return SHARD, f"the file has {(model / SHARD).stat().st_size}"


def offsets_wrong_size(model: Path) -> tuple[str, ...]:
    header, data = split_file(model / SHARD)
    name = next(k for k in header if k.endswith("kv_b_proj.weight"))
    header[name]["data_offsets"][1] += 2**62
    write_file(model / SHARD, header, data)
    return SHARD, f"tensor '{name}' spans"


def index_missing_file(model: Path) -> tuple[str, ...]:
    point_shard_at(model, "model-00004-of-00003.safetensors")
    return INDEX_NAME, "model-00004-of-00003.safetensors", "does not exist"


def index_dot_dot(model: Path) -> tuple[str, ...]:
    outside_copy(model)
    point_shard_at(model, "../outside.safetensors")
    return INDEX_NAME, "../outside.safetensors", "escapes the model directory"


def index_absolute_path(model: Path) -> tuple[str, ...]:
    target = str(outside_copy(model))
    point_shard_at(model, target)
    return INDEX_NAME, target, "escapes the model directory"


def shard_symlink_outside(model: Path) -> tuple[str, ...]:
    target = outside_copy(model)
    (model / SHARD).unlink()
    (model / SHARD).symlink_to(target)
    return SHARD, "outside the model directory"


def other_file_symlink_outside(model: Path) -> tuple[str, ...]:
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to("/etc/passwd")
    return "tokenizer.json", "outside the model directory"


def fifo_in_model_dir(model: Path) -> tuple[str, ...]:
    """Reading a FIFO would block forever: it must be refused, never opened."""
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    return "tokenizer.json", "not a regular file"


def config_is_a_fifo(model: Path) -> tuple[str, ...]:
    """config.json is read first of all: a FIFO there must not block the run either."""
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    return "config.json", "not a regular file"


def pickle_shards_only(model: Path) -> tuple[str, ...]:
    for path in model.glob("model*"):
        path.unlink()
    write_pickle_bomb(model / "pytorch_model.bin", model.parent / "UNPICKLED")
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model.bin"}}))
    return "pytorch_model.bin", "never unpickles"


def index_points_at_a_pickle(model: Path) -> tuple[str, ...]:
    write_pickle_bomb(model / "pytorch_model.bin", model.parent / "UNPICKLED")
    point_shard_at(model, "pytorch_model.bin")
    return "pytorch_model.bin", "not a valid safetensors file"


def config_dims_disagree(model: Path) -> tuple[str, ...]:
    config = json.loads((model / "config.json").read_text())
    config["q_lora_rank"] = 96
    (model / "config.json").write_text(json.dumps(config))
    return "model-00001-of-00003.safetensors", "q_b_proj", "config.json", "disagree"


def config_heads_disagree(model: Path) -> tuple[str, ...]:
    config = json.loads((model / "config.json").read_text())
    config["num_attention_heads"] = 16
    (model / "config.json").write_text(json.dumps(config))
    return ".safetensors: tensor 'model.layers.0.self_attn.", "heads=16", "disagree"


def config_invalid_json(model: Path) -> tuple[str, ...]:
    (model / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], ')
    return "config.json", "JSON"


def index_invalid_json(model: Path) -> tuple[str, ...]:
    (model / INDEX_NAME).write_text('{"weight_map": {')
    return INDEX_NAME, "invalid JSON"


# JSON that Python's parser refuses with other exceptions than JSONDecodeError (they ended in exit 3)
DEEPLY_NESTED = b"[" * 100_000 + b"]" * 100_000
HUGE_INTEGER = b"1" * 5000  # over Python's 4,300-digit limit for int()


def config_nested_too_deeply(model: Path) -> tuple[str, ...]:
    (model / "config.json").write_bytes(b'{"architectures": ' + DEEPLY_NESTED + b"}")
    return "config.json", "invalid JSON"


def index_with_a_huge_integer(model: Path) -> tuple[str, ...]:
    (model / INDEX_NAME).write_bytes(b'{"metadata": {"total_size": ' + HUGE_INTEGER + b'}, "weight_map": {}}')
    return INDEX_NAME, "invalid JSON"


def header_nested_too_deeply(model: Path) -> tuple[str, ...]:
    _, data = split_file(model / SHARD)
    write_file(model / SHARD, b'{"x": ' + DEEPLY_NESTED + b"}", data)
    return SHARD, "not valid JSON"


def header_with_a_huge_integer(model: Path) -> tuple[str, ...]:
    _, data = split_file(model / SHARD)
    write_file(
        model / SHARD, b'{"x": {"dtype": "BF16", "shape": [' + HUGE_INTEGER + b'], "data_offsets": [0, 2]}}', data
    )
    return SHARD, "not valid JSON"


def index_points_into_a_hidden_directory(model: Path) -> tuple[str, ...]:
    """Hidden entries (.git, .cache) are never placed in OUT_DIR: convert said the shard
    'disappeared while converting'."""
    (model / ".hidden").mkdir()
    (model / SHARD).rename(model / ".hidden" / SHARD)
    edit_index(model, lambda weights: weights.update({k: f".hidden/{SHARD}" for k, v in weights.items() if v == SHARD}))
    return INDEX_NAME, f"to '.hidden/{SHARD}', inside a hidden entry"


def index_omits_a_tensor(model: Path) -> tuple[str, ...]:
    """A tensor a shard holds but the index does not map: loaders serve it all the same, and verify
    refused the output that convert made of it (it must be refused here, before any output)."""
    index = json.loads((model / INDEX_NAME).read_text())
    name = next(n for n, file in index["weight_map"].items() if file == SHARD and "q_b_proj" not in n)
    del index["weight_map"][name]
    (model / INDEX_NAME).write_text(json.dumps(index))
    return INDEX_NAME, f"does not map tensor '{name}', which {SHARD}'s header holds"


UP_FRONT = [
    truncated_shard,
    header_length_over_the_limit,
    header_length_past_the_end,
    header_invalid_json,
    header_not_utf8,
    header_not_an_object,
    offsets_overlapping,
    offsets_beyond_the_file,
    offsets_wrong_size,
    index_missing_file,
    index_dot_dot,
    index_absolute_path,
    shard_symlink_outside,
    other_file_symlink_outside,
    fifo_in_model_dir,
    config_is_a_fifo,
    pickle_shards_only,
    index_points_at_a_pickle,
    config_dims_disagree,
    config_heads_disagree,
    config_invalid_json,
    index_invalid_json,
    index_omits_a_tensor,
    config_nested_too_deeply,
    index_with_a_huge_integer,
    header_nested_too_deeply,
    header_with_a_huge_integer,
    index_points_into_a_hidden_directory,
]


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


@pytest.mark.parametrize("damage", UP_FRONT, ids=lambda f: f.__name__)
def test_hostile_input_is_refused_in_one_line_before_any_output(
    damage: Callable[[Path], tuple[str, ...]], model: Path, tmp_path: Path
) -> None:
    expected = damage(model)
    out = tmp_path / "out"
    line = error_line(run_cli("convert", model, out, "-q", preexec_fn=_limit_address_space))
    for fragment in expected:
        assert fragment in line, line
    assert not out.exists(), "input problems must be found on headers, before OUT_DIR is created"
    assert not (model.parent / "UNPICKLED").exists(), "a pickle was unpickled"
    # The library refuses the same way (what the CLI prints is its message).
    with pytest.raises(FoldckptError):
        convert(model, out, ConvertOptions(progress=False))
    assert not out.exists()


def test_the_pickle_probe_is_live(tmp_path: Path) -> None:
    """The marker check above means something: unpickling the bomb does create the marker."""
    write_pickle_bomb(tmp_path / "pytorch_model.bin", tmp_path / "UNPICKLED")
    pickle.loads((tmp_path / "pytorch_model.bin").read_bytes())["model.layers.0.self_attn.q_b_proj.weight"].close()
    assert (tmp_path / "UNPICKLED").exists()


# ----------------------------------------------------------------------------- NaN / Inf weights


@pytest.mark.parametrize(
    ("tensor", "value"),
    [
        ("model.layers.1.self_attn.q_b_proj.weight", float("nan")),
        ("model.layers.0.self_attn.kv_b_proj.weight", float("inf")),
    ],
    ids=["nan-in-q_b_proj", "inf-in-kv_b_proj"],
)
def test_nonfinite_weights_are_refused_unless_allowed(tensor: str, value: float, model: Path, tmp_path: Path) -> None:
    file = set_element(model, tensor, value)
    out = tmp_path / "out"
    line = error_line(run_cli("convert", model, out, "-q"))
    assert file in line and f"'{tensor}'" in line and "NaN or Inf" in line and "--allow-nonfinite" in line
    assert not (out / MANIFEST_NAME).exists()
    assert_not_accepted(out)
    result = convert(model, out, ConvertOptions(allow_nonfinite=True, progress=False))
    assert result.layers_folded + result.layers_resumed == 2
    assert verify(out, VerifyOptions(progress=False)).ok
    # What a layer of NaN inputs records is strict JSON (no bare NaN, which JavaScript's parser
    # and others refuse): the manifest, and convert's and inspect's --json.
    strict = {"parse_constant": lambda constant: pytest.fail(f"{constant} is not JSON")}
    recorded = json.loads((out / MANIFEST_NAME).read_text(), **strict)
    errors = [record["error_vs_fp64"]["rel_fro_error"] for record in recorded["tensors"].values()]
    assert None in errors and all(error is None or error >= 0 for error in errors)
    rerun = run_cli("convert", model, out, "--allow-nonfinite", "--json")
    json.loads(rerun.stdout, **strict)
    json.loads(run_cli("inspect", out, "--json").stdout, **strict)
    # and verify --deep, which cannot bound NaN against fp64, compares those layers bitwise
    deep = run_cli("verify", out, "--deep")
    assert deep.returncode == 0, deep.stdout
    assert "1 layer(s) with NaN/Inf inputs compared bitwise only" in deep.stdout


@pytest.mark.parametrize(
    ("tensor", "dtype", "value"),
    [
        ("model.layers.0.self_attn.q_b_proj.weight_scale_inv", torch.float32, float("nan")),
        ("model.layers.0.self_attn.q_b_proj.weight", torch.float8_e4m3fn, float("nan")),
    ],
    ids=["nan-in-the-scales", "nan-in-the-fp8-weight"],
)
def test_a_nonfinite_fp8_input_is_named_by_the_file_and_tensor_that_hold_it(
    tensor: str, dtype: torch.dtype, value: float, tmp_path: Path
) -> None:
    """q_b_proj's fp8 values lie in model-00001, its block scales in model-00003: a NaN written
    into the scales' bytes was reported as model-00001's 'q_b_proj.weight' (the dequantized
    product was checked, under the weight's name)."""
    model = make_checkpoint(tmp_path / "fp8", "deepseek_v3_fp8")
    file = json.loads((model / INDEX_NAME).read_text())["weight_map"][tensor]
    info = read_header(model / file).tensors[tensor]
    with open(model / file, "r+b") as handle:
        handle.seek(info.start)
        handle.write(torch.tensor([value]).to(dtype).view(torch.uint8).numpy().tobytes())
    line = error_line(run_cli("convert", model, tmp_path / "out", "-q"))
    assert f"{model / file}: tensor '{tensor}'" in line and "contains NaN or Inf" in line, line
    if tensor.endswith("_scale_inv"):
        assert file == "model-00003-of-00003.safetensors" and "model-00001" not in line, line


# ----------------------------------------------------------------------------- full disk, too large


def test_file_size_limit_efbig_fails_cleanly_then_resumes(model: Path, pristine: Path, tmp_path: Path) -> None:
    """RLIMIT_FSIZE below a sidecar's size: the write fails with EFBIG (the CLI ignores SIGXFSZ)."""
    reference = tmp_path / "reference"
    convert(model, reference, ConvertOptions(progress=False))
    sidecar_size = (reference / SIDECAR).stat().st_size
    limit = sidecar_size * 2 // 3  # room for the first layer's fold, not the second's
    out = tmp_path / "out"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    line = error_line(run_cli("convert", model, out, "-q", preexec_fn=limit_file_size))
    assert SIDECAR in line and "too large" in line and "rerun to resume" in line
    assert not (out / MANIFEST_NAME).exists() and not (out / SIDECAR).exists()
    assert_not_accepted(out)
    result = convert(model, out, ConvertOptions(progress=False))
    assert (result.layers_folded, result.layers_resumed) == (1, 1)
    assert (out / SIDECAR).read_bytes() == (reference / SIDECAR).read_bytes()
    assert (out / MANIFEST_NAME).read_bytes() == (reference / MANIFEST_NAME).read_bytes()
    assert_verified(out)


def test_a_resumed_run_places_the_sources_as_its_link_asks(model: Path, tmp_path: Path) -> None:
    """A run stopped after it hard-linked the sources (EFBIG in the sidecar write), resumed with
    --link copy: the files the stopped run linked become copies too, not only the ones it had not
    placed yet."""
    out = tmp_path / "out"
    limit = 64 * 1024  # below the first layer's fold

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    error_line(run_cli("convert", model, out, "-q", preexec_fn=limit_file_size))
    assert (out / SHARD).stat().st_ino == (model / SHARD).stat().st_ino
    result = convert(model, out, ConvertOptions(progress=False, link="copy"))
    assert result.placed == {"copy": len(list(model.iterdir()))}
    assert all((out / p.name).stat().st_ino != p.stat().st_ino for p in model.iterdir())
    assert_verified(out)


_SMALL_APPEND = """
import resource, sys
from pathlib import Path
from foldckpt.errors import FoldckptError
from foldckpt.io.safetensors_format import TensorSpec
from foldckpt.format.sidecar import ShardWriter
writer = ShardWriter(Path(sys.argv[1]), [TensorSpec("t", "U8", (4096,))], {})
resource.setrlimit(resource.RLIMIT_FSIZE, (writer.offset + 100, writer.offset + 100))
try:
    writer.append(b"x" * 1000)
except FoldckptError as exc:
    writer.close()
    print(exc)
"""


def test_file_size_limit_on_a_small_buffered_append_is_one_error(tmp_path: Path) -> None:
    """A fold smaller than the write buffer fails in flush, and closing retries the flush: that
    second failure must not replace the one-line error with a traceback."""
    path = tmp_path / SIDECAR
    result = subprocess.run(
        [sys.executable, "-c", _SMALL_APPEND, str(path)],
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.strip() == (
        f"{path}: file too large for this filesystem or limit while writing; free space and rerun to resume"
    )


def test_disk_full_enospc_fails_cleanly_then_resumes(model: Path, small_filesystem: Path) -> None:
    """Too little space is refused up front; then, with room for exactly the bytes needed, the disk
    fills up for real during the sidecar write (copies take whole pages) and the run stops with
    ENOSPC. Either way one line, no accepted output, and the rerun after freeing space resumes."""
    out = small_filesystem / "out"
    plan = json.loads(run_cli("convert", model, out, "--dry-run", "--json").stdout)
    needed = sum(plan["sidecars"].values()) + sum(p.stat().st_size for p in model.iterdir())
    filler = small_filesystem / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_filesystem).free - needed // 2))
    line = error_line(run_cli("convert", model, out, "--link", "copy", "-q"))
    assert str(out) in line and "GB free but has" in line and "free space first" in line, line
    assert not out.exists()  # refused before OUT_DIR was made
    assert_not_accepted(out)

    page = os.statvfs(small_filesystem).f_frsize
    os.truncate(filler, filler.stat().st_size + shutil.disk_usage(small_filesystem).free - -(-needed // page) * page)
    line = error_line(run_cli("convert", model, out, "--link", "copy", "-q"))
    assert f"{out / SIDECAR}: disk full while writing" in line, line
    assert not (out / MANIFEST_NAME).exists() and not (out / SIDECAR).exists()
    assert_not_accepted(out)

    filler.unlink()
    result = convert(model, out, ConvertOptions(link="copy", progress=False))
    assert result.layers_folded + result.layers_resumed == 2
    assert not (out / JOURNAL_NAME).exists()
    assert_verified(out)


def test_read_only_out_dir_is_refused_in_one_line(model: Path, read_only_dir: Path) -> None:
    """A read-only OUT_DIR is the user's problem, said in one line: it was an "internal error" (exit
    3, a traceback file), because removing the temporary file of the failed first write failed with
    EROFS too and replaced the write's own error."""
    line = error_line(run_cli("convert", model, read_only_dir, "-q"))
    assert str(read_only_dir) in line and "read-only file system while writing" in line.lower(), line
    assert not any(read_only_dir.iterdir())


# ----------------------------------------------------------------------------- unreadable files


def _drop_file_permission_override() -> None:
    """Make root obey file modes: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding
    set, so the exec'd child (still uid 0, so it can run the root-owned interpreter) lacks them."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture(scope="module")
def obey_file_modes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None] | None:
    """A preexec_fn under which a child cannot read a mode-000 file, or skip if none exists."""
    preexec = _drop_file_permission_override if os.geteuid() == 0 else None
    probe = tmp_path_factory.mktemp("probe") / "secret"
    probe.write_text("secret")
    probe.chmod(0)
    try:
        check = subprocess.run(
            [sys.executable, "-c", f"open({str(probe)!r}).read()"], preexec_fn=preexec, capture_output=True, text=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot make this root process obey file modes ({exc})")
    if check.returncode == 0:
        pytest.skip("a mode-000 file stays readable here (privileges cannot be dropped)")
    assert "PermissionError" in check.stderr, check.stderr
    return preexec


@pytest.mark.parametrize(
    ("file", "before_output"),
    [(SHARD, True), ("config.json", True), ("tokenizer.json", False)],
    ids=["shard", "config", "other-file"],
)
def test_unreadable_file_is_refused_in_one_line(
    file: str, before_output: bool, model: Path, tmp_path: Path, obey_file_modes: Callable[[], None] | None
) -> None:
    (model / file).chmod(0)
    out = tmp_path / "out"
    line = error_line(run_cli("convert", model, out, "-q", preexec_fn=obey_file_modes))
    assert file in line and "permission denied" in line.lower(), line
    assert out.exists() != before_output
    assert_not_accepted(out)


# ----------------------------------------------------------------------------- OUT_DIR aliases, rereads


def test_rerunning_convert_on_a_finished_read_only_output_says_nothing_to_do(model: Path, read_only_dir: Path) -> None:
    """Removing a journal that is not there failed with EROFS: exit 3, an internal error."""
    subprocess.run(["mount", "-o", "remount,bind,rw", read_only_dir], check=True)
    out = read_only_dir / "out"
    convert(model, out, ConvertOptions(link="copy", progress=False))
    subprocess.run(["mount", "-o", "remount,bind,ro", read_only_dir], check=True)
    run = run_cli("convert", model, out, "--link", "copy", "-q")
    assert run.returncode == 0, run.stderr
    assert "already converted with these inputs and parameters; nothing to do" in run.stdout


@pytest.fixture()
def bind_alias(model: Path, tmp_path: Path) -> Iterator[Path]:
    """MODEL_DIR under a second path (a bind mount; root with CAP_SYS_ADMIN only, as above)."""
    alias = tmp_path / "alias"
    alias.mkdir()
    mounted = subprocess.run(["mount", "--bind", model, alias], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount ({mounted.stderr.strip()})")
    try:
        yield alias
    finally:
        subprocess.run(["umount", "-l", str(alias)], check=False)


@pytest.mark.parametrize("where", ["itself", "inside"])
def test_an_out_dir_that_is_the_model_directory_under_another_path_is_refused(
    model: Path, bind_alias: Path, where: str
) -> None:
    """By path the two differ, so convert wrote its sidecars and manifest into MODEL_DIR (with
    --overwrite), or an output inside it, which later conversions of MODEL_DIR carried along."""
    before = sorted(p.name for p in model.iterdir())
    out = bind_alias if where == "itself" else bind_alias / "sub"
    line = error_line(run_cli("convert", model, out, "-q", "--overwrite"))
    assert "the output must not be, contain, or lie inside the model directory" in line, line
    assert sorted(p.name for p in model.iterdir()) == before


def test_a_symlink_planted_at_the_journal_s_temporary_name_is_not_written_through(model: Path, tmp_path: Path) -> None:
    """The journal is written to a temporary file first; opened plainly, a symlink at its name had
    convert write the journal onto the file it points to, anywhere."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / f".{JOURNAL_NAME}.foldckpt-tmp").symlink_to(victim)
    assert run_cli("convert", model, out, "-q").returncode == 0
    assert victim.read_text() == "precious\n"
    assert_verified(out)


def test_a_journal_of_the_wrong_shape_is_one_line_not_an_internal_error(model: Path, tmp_path: Path) -> None:
    """A resume journal that parses as JSON but has another shape ("shards": [1, 2]) was an
    AttributeError, exit 3."""
    out = tmp_path / "out"
    out.mkdir()
    (out / JOURNAL_NAME).write_text(json.dumps({"run_key": "x", "placed": {}, "source_hashes": {}, "shards": [1, 2]}))
    line = error_line(run_cli("convert", model, out, "-q"))
    assert f"{out / JOURNAL_NAME}: unreadable resume journal" in line and "--restart" in line, line
