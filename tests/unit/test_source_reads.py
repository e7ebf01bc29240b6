"""The hashing passes that hand the fold its inputs (foldckpt.source_reads), on real files.

Which bugs these catch: a pass that hands over bytes other than the tensor's (wrong offsets, a
buffer reused by the next chunk), a digest not of exactly those bytes, a copy made past the budget
(memory grows with the layout), a consumer left waiting forever when a pass fails or skips a copy,
and an earlier run's fold whose input changed going unnoticed on resume.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from foldckpt.errors import FoldckptError
from foldckpt.manifest import FileRecord
from foldckpt.plan import ConversionPlan, plan_conversion
from foldckpt.safetensors_format import TensorInfo, read_tensor_bytes
from foldckpt.source_reads import IOCounters, SourceReads
from foldckpt.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> ConversionPlan:
    model = make_checkpoint(tmp_path_factory.mktemp("reads") / "model", "kimi_k3", shards=3)
    return plan_conversion(model)


def _inputs(plan: ConversionPlan) -> dict[tuple[str, str], TensorInfo]:
    return {(file, info.name): info for layer in plan.layers for file, info in layer.input_tensors()}


def _reads(plan: ConversionPlan, budget: int, recorded: dict[tuple[str, str], str] | None = None,
           files: dict[str, int] | None = None) -> tuple[SourceReads, dict[str, FileRecord], IOCounters]:  # fmt: skip
    model = plan.source.model_dir
    files = files or {name: (model / name).stat().st_size for name in plan.files_to_place}
    hashed: dict[str, FileRecord] = {}
    counters = IOCounters()
    inputs = _inputs(plan)
    reads = SourceReads(model, files, inputs, set(inputs), recorded or {}, hashed.__setitem__, lambda n: None, counters, budget)
    return reads, hashed, counters


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["copied", "over-budget"])
def test_every_input_is_handed_over_with_its_digest_and_every_file_hashed_once(plan: ConversionPlan, budget: int) -> None:
    reads, hashed, counters = _reads(plan, budget)
    model = plan.source.model_dir
    with ThreadPoolExecutor(4) as pool:
        reads.start(pool)
        for (file, _), info in _inputs(plan).items():
            data, digest = reads.take(file, info)
            assert bytes(data) == bytes(read_tensor_bytes(model / file, info))
            assert digest == hashlib.sha256(data).hexdigest()
        reads.wait()
    assert hashed == {name: FileRecord(size, hashlib.sha256((model / name).read_bytes()).hexdigest()) for name, size in reads.files.items()}
    input_bytes = sum(info.nbytes for info in _inputs(plan).values())
    assert counters.reread == (input_bytes if budget == 0 else 0)
    assert counters.read == sum(reads.files.values()) + counters.reread
    assert reads._held == 0  # every copy handed over and released


def test_a_budget_smaller_than_a_tensor_copies_nothing_and_never_blocks_a_pass(plan: ConversionPlan) -> None:
    """Passes run to the end with nobody taking anything: none may wait for the fold."""
    smallest = min(info.nbytes for info in _inputs(plan).values())
    reads, hashed, _ = _reads(plan, smallest - 1)
    with ThreadPoolExecutor(2) as pool:
        reads.start(pool)
        done = threading.Event()
        threading.Thread(target=lambda: (reads.wait(), done.set()), daemon=True).start()
        assert done.wait(30), "a pass waited for the fold"
    assert len(hashed) == len(reads.files) and reads._held == 0


def test_an_input_changed_since_an_earlier_run_folded_it_is_refused_naming_file_and_tensor(plan: ConversionPlan) -> None:
    (file, name), info = next(iter(_inputs(plan).items()))
    reads, hashed, _ = _reads(plan, 1 << 30, recorded={(file, name): "0" * 64})
    with ThreadPoolExecutor(2) as pool:
        reads.start(pool)
        with pytest.raises(FoldckptError, match="changed since an earlier run of this conversion folded it") as caught:
            reads.wait()
    assert caught.value.path == str(plan.source.model_dir / file) and caught.value.tensor == name
    assert file not in hashed  # its digest is not journaled: the resumed run does not trust it


def test_a_failed_pass_wakes_the_fold_with_the_error(plan: ConversionPlan, tmp_path: Path) -> None:
    (file, _), info = next(iter(_inputs(plan).items()))
    reads, _, _ = _reads(plan, 1 << 30, files={file: 1})
    reads.out_dir = tmp_path  # the file is not there: the pass fails before the tensor
    with ThreadPoolExecutor(1) as pool:
        reads.start(pool)
        with pytest.raises(FoldckptError, match="hashing"):
            reads.take(file, info)
        with pytest.raises(FoldckptError):
            reads.wait()
