"""A layer's fold made head chunk by head chunk through the ring (foldckpt.convert.layer.fold_from_source).

Which bugs these catch: chunks emitted out of sidecar order or with other bytes than the whole
fold's, head digests or error statistics that differ from those of the whole fold, the fp8 row
scales emitted before their values, a ring that hands out more buffers than it has slots,
buffers never given back when a check refuses the layer (the next layer would wait forever), and
a fold that releases the fetched bytes while it still reads them (a pass would refill them).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from foldckpt.convert.layer import FoldRing, fold_from_source, load_layer_inputs, reader
from foldckpt.convert.plan import ConversionPlan, plan_conversion
from foldckpt.errors import FoldckptError
from foldckpt.fold import fold_error, fold_layer, fold_layer_fp8, sample_heads
from foldckpt.io.hashing import head_digests
from foldckpt.io.safetensors_format import TensorInfo
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.tensors import tensor_to_bytes


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> ConversionPlan:
    model = make_checkpoint(tmp_path_factory.mktemp("stream") / "model", "deepseek_v3", layers=2)  # 8 heads
    return plan_conversion(model)


def _streamed(plan: ConversionPlan, ring: FoldRing, **options: object) -> tuple[list[bytes], object]:
    emitted: list[bytes] = []

    def emit(buffer: memoryview) -> None:
        emitted.append(bytes(buffer))
        ring.give_back(buffer)

    with ThreadPoolExecutor(4) as pool:
        record = fold_from_source(plan, plan.layers[1], "sidecar", pool, ring, emit, **options)  # type: ignore[arg-type]
    return emitted, record


@pytest.mark.parametrize("fold_dtype", ["bfloat16", "float32"])
def test_a_streamed_fold_emits_the_whole_folds_bytes_in_order_with_its_digests_and_error(
    plan: ConversionPlan, fold_dtype: str
) -> None:
    plan = plan_conversion(plan.source.model_dir, fold_dtype=fold_dtype)
    g = plan.geometry
    emitted, record = _streamed(plan, FoldRing(slots=2))
    inputs = load_layer_inputs(plan, plan.layers[1])
    whole = fold_layer(inputs.q_b_proj, inputs.kv_b_proj, g, getattr(torch, fold_dtype))
    assert len(emitted) == g.num_heads // 4
    assert b"".join(emitted) == bytes(tensor_to_bytes(whole))
    assert record.head_blake3 == head_digests(tensor_to_bytes(whole), g.num_heads)  # type: ignore[attr-defined]
    error = fold_error(whole, inputs.q_b_proj, inputs.kv_b_proj, g, sample_heads(g.num_heads))
    assert record.error == error.to_dict()  # type: ignore[attr-defined]


def test_a_streamed_fp8_fold_emits_its_values_then_its_row_scales(plan: ConversionPlan) -> None:
    plan = plan_conversion(plan.source.model_dir, fold_dtype="fp8")
    g = plan.geometry
    emitted, record = _streamed(plan, FoldRing(slots=2))
    inputs = load_layer_inputs(plan, plan.layers[1])
    values, scale = fold_layer_fp8(inputs.q_b_proj, inputs.kv_b_proj, g)
    assert b"".join(emitted[:-1]) == bytes(tensor_to_bytes(values))
    assert emitted[-1] == bytes(tensor_to_bytes(scale))
    assert record.scale.head_blake3 == head_digests(tensor_to_bytes(scale), g.num_heads)  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fold_releases_the_fetched_bytes_only_once_it_reads_them_no_more(plan: ConversionPlan, device: str) -> None:
    """``release`` lets the passes refill the buffers the fold's inputs came in (here: with NaN
    bytes). A GPU fold calls it once, when the inputs are on the GPU, before its first chunk; a CPU
    fold reads them until its last chunk and never does. Either way the fold is that of the
    original bytes."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fetched: list[bytearray] = []
    emitted: list[bytes] = []
    released_after: list[int] = []  # chunks emitted when release came
    ring = FoldRing(slots=2)

    def fetch(file: str, info: TensorInfo) -> tuple[bytearray, str]:
        data, digest = reader(plan.source.model_dir)(file, info)
        fetched.append(data)
        return data, digest

    def release() -> None:
        released_after.append(len(emitted))
        for data in fetched:
            data[:] = b"\xff" * len(data)

    def emit(buffer: memoryview) -> None:
        emitted.append(bytes(buffer))
        ring.give_back(buffer)

    with ThreadPoolExecutor(4) as pool:
        record = fold_from_source(plan, plan.layers[1], "sidecar", pool, ring, emit, False, fetch, device, release)
    inputs = load_layer_inputs(plan, plan.layers[1])
    whole = fold_layer(inputs.q_b_proj, inputs.kv_b_proj, plan.geometry, torch.bfloat16, device)
    assert released_after == ([0] if device == "cuda" else [])
    assert b"".join(emitted) == bytes(tensor_to_bytes(whole))
    assert record.sources == inputs.sources


def test_the_ring_hands_out_no_more_buffers_than_its_slots_until_one_comes_back() -> None:
    ring = FoldRing(slots=2)
    first, _ = ring.take((4, 1024), torch.bfloat16)
    ring.take((4, 1024), torch.bfloat16)
    third: list[memoryview] = []
    waiting = threading.Thread(target=lambda: third.append(ring.take((4, 1024), torch.bfloat16)[0]))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and not third
    ring.give_back(first)
    waiting.join(5)
    assert third and third[0] is first  # the buffer given back, reused


@pytest.mark.parametrize("failure", ["refused by its check", "error with a chunk out"])
def test_a_failed_fold_leaves_every_buffer_back_in_the_ring(
    plan: ConversionPlan, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A layer refused by its accuracy check after its last chunk (the consumer gave back what was
    emitted), or an error while a chunk was out (hashing it, here): the ring must have all its
    slots again, or the next fold would wait forever."""
    import foldckpt.convert.layer
    from foldckpt.fold import fold_layer_chunks

    if failure == "refused by its check":

        def spoiled(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            for heads, values in fold_layer_chunks(*args, **kwargs):  # type: ignore[arg-type]
                values.mul_(1.5)
                yield heads, values

        monkeypatch.setattr(foldckpt.convert.layer, "fold_layer_chunks", spoiled)
        expected: type[BaseException] = FoldckptError
    else:
        calls: list[None] = []

        def failing(*args: object, **kwargs: object) -> tuple[str, ...]:
            calls.append(None)
            if len(calls) == 2:
                raise OSError("hashing failed")
            return head_digests(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(foldckpt.convert.layer, "head_digests", failing)
        expected = OSError
    ring = FoldRing(slots=2)
    with pytest.raises(expected):
        _streamed(plan, ring)
    taker = threading.Thread(target=lambda: [ring.take((1,), torch.float32) for _ in range(2)], daemon=True)
    taker.start()
    taker.join(5)
    assert not taker.is_alive(), "a buffer of the failed fold never came back to the ring"
