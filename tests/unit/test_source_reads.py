"""The hashing passes that hand the fold its inputs (foldckpt.convert.source_reads), on real files.

Which bugs these catch: a pass that hands over bytes other than the tensor's (wrong offsets, a
buffer reused by the next chunk), a digest not of exactly those bytes, a copy made past the budget
(memory grows with the layout), a consumer left waiting forever when a pass fails or skips a copy,
and an earlier run's fold whose input changed going unnoticed on resume.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from blake3 import blake3

from foldckpt.convert.plan import ConversionPlan, plan_conversion
from foldckpt.convert.source_reads import LOOKAHEAD_LAYERS, IOCounters, SourceReads
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import FileRecord
from foldckpt.io.direct_io import DiskPriority
from foldckpt.io.safetensors_format import TensorInfo, read_tensor_bytes
from foldckpt.model.synthetic import make_checkpoint


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> ConversionPlan:
    model = make_checkpoint(tmp_path_factory.mktemp("reads") / "model", "kimi_k3", shards=3)
    return plan_conversion(model)


def _inputs(plan: ConversionPlan) -> dict[tuple[str, str], TensorInfo]:
    return {(file, info.name): info for layer in plan.layers for file, info in layer.input_tensors()}


def _reads(
    plan: ConversionPlan,
    budget: int,
    recorded: dict[tuple[str, str], str] | None = None,
    files: dict[str, int] | None = None,
    priority: DiskPriority | None = None,
    fold_releases: bool = False,
) -> tuple[SourceReads, dict[str, FileRecord], IOCounters]:
    model = plan.source.model_dir
    files = files or {name: (model / name).stat().st_size for name in plan.files_to_place}
    hashed: dict[str, FileRecord] = {}
    counters = IOCounters()
    inputs = _inputs(plan)
    wanted = {
        (file, info.name): position
        for position, layer in enumerate(plan.layers)
        for file, info in layer.input_tensors()
    }
    reads = SourceReads(
        model,
        files,
        inputs,
        wanted,
        recorded or {},
        hashed.__setitem__,
        lambda n: None,
        counters,
        budget,
        priority,
        fold_releases,
    )
    return reads, hashed, counters


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["copied", "over-budget"])
def test_every_input_is_handed_over_with_its_digest_and_every_file_hashed_once(
    plan: ConversionPlan, budget: int
) -> None:
    reads, hashed, counters = _reads(plan, budget)
    model = plan.source.model_dir
    with ThreadPoolExecutor(4) as pool:
        reads.start(pool, pool)
        for (file, _), info in _inputs(plan).items():
            data, digest = reads.take(file, info)
            assert bytes(data) == bytes(read_tensor_bytes(model / file, info))
            assert digest == blake3(data).hexdigest()
        reads.wait()
    assert hashed == {
        name: FileRecord(size, hashlib.sha256((model / name).read_bytes()).hexdigest())
        for name, size in reads.files.items()
    }
    input_bytes = sum(info.nbytes for info in _inputs(plan).values())
    assert counters.reread == (input_bytes if budget == 0 else 0)
    assert counters.read == sum(reads.files.values()) + counters.reread
    assert reads._held == 0  # every copy handed over and released


def test_a_layer_s_buffers_go_back_to_the_pool_once_the_fold_takes_the_next_layer(plan: ConversionPlan) -> None:
    """The fold is done with a layer's inputs when it takes the next layer's: only then may their
    buffers be filled again (earlier, a pass would overwrite inputs the fold still reads)."""
    reads, _, _ = _reads(plan, 1 << 30)
    model = plan.source.model_dir
    first, second = (list(layer.input_tensors()) for layer in plan.layers[:2])
    with ThreadPoolExecutor(4) as pool:
        reads.start(pool, pool)
        reads.wait()  # every pass may start at once here: every input is copied, none taken
        taken = [reads.take(file, info)[0] for file, info in first]
        assert all(isinstance(data, memoryview) for data in taken)
        lent = {id(data) for data in taken}
        assert not {id(reads.pool.get(data.nbytes)) for data in taken} & lent  # still the fold's
        assert [bytes(data) for data in taken] == [bytes(read_tensor_bytes(model / f, i)) for f, i in first]
        file, info = second[0]
        data, _ = reads.take(file, info)
        assert bytes(data) == bytes(read_tensor_bytes(model / file, info))
        assert {id(reads.pool.get(data.nbytes)) for data in taken} == lent  # back in the pool
        assert id(data) not in lent


def test_a_budget_smaller_than_a_tensor_copies_nothing_and_never_blocks_a_started_pass(plan: ConversionPlan) -> None:
    """Nobody takes anything: every pass allowed to start must still run to its end."""
    smallest = min(info.nbytes for info in _inputs(plan).values())
    reads, hashed, _ = _reads(plan, smallest - 1)
    assert max(reads.first_use.values()) <= LOOKAHEAD_LAYERS  # all may start at once
    with ThreadPoolExecutor(2) as pool:
        reads.start(pool, pool)
        done = threading.Event()
        threading.Thread(target=lambda: (reads.wait(), done.set()), daemon=True).start()
        assert done.wait(30), "a pass waited for the fold"
    assert len(hashed) == len(reads.files) and reads._held == 0


@pytest.fixture(scope="module")
def long_plan(tmp_path_factory: pytest.TempPathFactory) -> ConversionPlan:
    """8 MLA layers, one shard each: files that feed layers far ahead of the fold."""
    model = make_checkpoint(tmp_path_factory.mktemp("reads") / "long", "kimi_k3", layers=28, mtp_layers=1, shards=8)
    return plan_conversion(model)


def test_a_pass_starts_only_within_the_lookahead_of_the_fold_and_stop_releases_the_rest(
    long_plan: ConversionPlan,
) -> None:
    reads, hashed, _ = _reads(long_plan, 1 << 30)
    far = {name for name, due in reads.first_use.items() if due > LOOKAHEAD_LAYERS}
    assert far, "the layout must hold files that feed layers beyond the lookahead"
    with ThreadPoolExecutor(len(reads.files)) as pool:
        reads.start(pool, pool)
        deadline = time.monotonic() + 30
        while len(hashed) < len(reads.files) - len(far) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert set(hashed) == set(reads.files) - far  # the fold is at layer 0: the far files wait
        for (file, _), info in sorted(_inputs(long_plan).items(), key=lambda item: reads.wanted[item[0]]):
            reads.take(file, info)  # the fold moves on: each file is hashed in time, none copied past budget
        reads.wait()
    assert set(hashed) == set(reads.files) and reads.counters.reread == 0

    reads, hashed, _ = _reads(long_plan, 1 << 30)
    with ThreadPoolExecutor(len(reads.files)) as pool:
        reads.start(pool, pool)
        time.sleep(0.2)
        reads.stop()
        reads.wait()  # returns: the waiting passes give up without hashing
    assert not set(hashed) & far


def _settled(reads: SourceReads, hashed: dict[str, FileRecord], layer: int) -> None:
    """Wait until every pass that may run with the fold at ``layer`` has ended."""
    due = {name for name, first in reads.first_use.items() if first <= layer + LOOKAHEAD_LAYERS}
    deadline = time.monotonic() + 30
    while not due <= set(hashed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert due <= set(hashed)


@pytest.mark.parametrize("fold_releases", [False, True], ids=["cpu-fold", "gpu-fold"])
def test_a_fold_that_releases_its_inputs_itself_lets_the_next_passes_reuse_their_buffers(
    long_plan: ConversionPlan, fold_releases: bool
) -> None:
    """A GPU fold is done with a layer's inputs once they are on the GPU (``release``): only then
    may the passes for the layers after start, into those buffers, so that the fold holds none of
    the buffers out at the peak. Until it releases them, its buffers stay its own and those passes
    wait, also when it takes the next layer's inputs."""
    reads, hashed, _ = _reads(long_plan, 1 << 30, fold_releases=fold_releases)
    model = long_plan.source.model_dir
    sizes = {info.nbytes for info in _inputs(long_plan).values()}
    with ThreadPoolExecutor(len(reads.files)) as pool:
        reads.start(pool, pool)
        try:
            for position, layer in enumerate(long_plan.layers):
                # where the fold is, as the passes see it, until it takes the layer (a releasing fold
                # has released none before its first: only that layer's files are read ahead)
                before = position - 1 if fold_releases else max(position - 1, 0)
                _settled(reads, hashed, before)
                taken = [reads.take(file, info)[0] for file, info in layer.input_tensors()]
                assert [bytes(d) for d in taken] == [
                    bytes(read_tensor_bytes(model / f, i)) for f, i in layer.input_tensors()
                ]
                if fold_releases:
                    time.sleep(0.05)
                    waiting = {name for name, first in reads.first_use.items() if first > before + LOOKAHEAD_LAYERS}
                    assert not waiting & set(hashed)
                    reads.release()
            reads.release()
            reads.wait()
        finally:
            reads.stop()
    assert set(hashed) == set(reads.files) and reads.counters.reread == 0
    made = sum(len(buffers) for nbytes, buffers in reads.pool._free.items() if nbytes in sizes)
    # The most ever out: the last file holds two layers (27 and the MTP layer 28), read while the
    # fold is at the layer before them, whose inputs a CPU fold holds and a GPU fold has released.
    assert made == (4 if fold_releases else 6)


def test_an_input_changed_since_an_earlier_run_folded_it_is_refused_naming_file_and_tensor(
    plan: ConversionPlan,
) -> None:
    (file, name), info = next(iter(_inputs(plan).items()))
    reads, hashed, _ = _reads(plan, 1 << 30, recorded={(file, name): "0" * 64})
    with ThreadPoolExecutor(2) as pool:
        reads.start(pool, pool)
        with pytest.raises(FoldckptError, match="changed since an earlier run of this conversion folded it") as caught:
            reads.wait()
    assert caught.value.path == str(plan.source.model_dir / file) and caught.value.tensor == name
    assert file not in hashed  # its digest is not journaled: the resumed run does not trust it


def test_a_failed_pass_wakes_the_fold_with_the_error(plan: ConversionPlan, tmp_path: Path) -> None:
    (file, _), info = next(iter(_inputs(plan).items()))
    reads, _, _ = _reads(plan, 1 << 30, files={file: 1})
    reads.out_dir = tmp_path  # the file is not there: the pass fails before the tensor
    with ThreadPoolExecutor(1) as pool:
        reads.start(pool, pool)
        with pytest.raises(FoldckptError, match="hashing"):
            reads.take(file, info)
        with pytest.raises(FoldckptError):
            reads.wait()


def test_files_that_feed_no_layer_wait_while_a_foreground_transfer_runs(plan: ConversionPlan) -> None:
    """The sidecar appends go first: a pass over a file no fold waits for holds its reads while one
    runs, and the passes the fold waits for do not."""
    priority = DiskPriority()
    reads, hashed, _ = _reads(plan, 1 << 30, priority=priority)
    background = set(reads.files) - set(reads.first_use)
    assert background and reads.first_use, "the layout must hold both kinds of file"
    with ThreadPoolExecutor(len(reads.files)) as pool:
        with priority.foreground():
            reads.start(pool, pool)
            for (file, _), info in _inputs(plan).items():
                reads.take(file, info)  # every pass feeding the fold ends while the foreground runs
            deadline = time.monotonic() + 30
            while not set(reads.first_use) <= set(hashed) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            assert set(hashed) == set(reads.first_use)  # the others hold their first read
        reads.wait()
    assert set(hashed) == set(reads.files)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
def test_only_passes_over_files_that_feed_no_layer_yield_the_cores(plan: ConversionPlan) -> None:
    """The fold waits for the passes that read its inputs, not for the others: only those are
    niced (when every pass was, the fold waited for inputs its own GEMM had kept from being read)."""
    niceness: dict[str, set[int]] = {"feeding": set(), "other": set()}

    def progress(count: int) -> None:  # runs in the pass's thread
        kind = threading.current_thread().name.split("_")[0]
        niceness[kind].add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    reads, _, _ = _reads(plan, 1 << 30)
    reads.progress = progress
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadPoolExecutor(2, "feeding") as feeding, ThreadPoolExecutor(2, "other") as other:
        reads.start(feeding, other)
        for (file, _), info in _inputs(plan).items():
            reads.take(file, info)
        reads.wait()
    assert niceness["feeding"] == {own}
    assert niceness["other"] == {max(own, 10)}


def test_background_turn_returns_only_once_no_foreground_transfer_runs() -> None:
    priority = DiskPriority()
    turns: list[float] = []
    with priority.foreground():
        with priority.foreground():  # nested: both must end
            waiter = threading.Thread(target=lambda: (priority.background_turn(), turns.append(time.monotonic())))
            waiter.start()
            time.sleep(0.1)
        time.sleep(0.1)
        assert not turns
        released = time.monotonic()
    waiter.join(5)
    assert turns and turns[0] >= released
    priority.background_turn()  # nothing in the foreground: no wait
