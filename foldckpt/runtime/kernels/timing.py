"""GPU timing helpers shared by the tuner and ``scripts/bench_decode.py``.

Decode GEMMs take microseconds, less than one Python launch, so timing each call with events
measures the host. Instead a CUDA graph records many back-to-back calls (each over a different
layer's weight, so nothing is served from the 60 MB L2) and its replays are timed: what remains
per call is the kernel plus the GPU's own launch gap, which is what a vLLM decode step pays.
The bandwidth ceiling is measured in the same process, never assumed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

__all__ = [
    "CALLS_PER_GRAPH",
    "LAYER_COPIES",
    "layer_order",
    "measure_copy_bandwidth",
    "measure_kernel_overhead_us",
    "relative_error",
    "settle_clocks",
    "time_graph_us",
    "time_graphs_us",
    "time_rounds_us",
]

# A timed graph holds CALLS_PER_GRAPH calls over LAYER_COPIES copies of a layer's weights, so that
# no copy is still in L2 (50-60 MB on Hopper) when its turn comes again, as in a decode step.
LAYER_COPIES = 16
CALLS_PER_GRAPH = 32


def layer_order() -> Iterator[int]:
    """The weight copy each call of a timed graph reads, in order."""
    return (i % LAYER_COPIES for i in range(CALLS_PER_GRAPH))


def _capture(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def time_graphs_us(
    variants: Mapping[str, Sequence[Callable[[], object]]], replays: int = 15, warmup: int = 3
) -> dict[str, float]:
    """Median time of one call per variant, in µs, each from a CUDA graph of its calls back to back.

    Each callable must be capture-safe (no host sync); they run once eagerly first so that
    compilation and library handles stay out of the graph. The variants' replays are
    interleaved, so clock and thermal drift (heavy GEMMs heat the card) hits all of them alike.
    """
    graphs = {name: (_capture(calls), len(calls)) for name, calls in variants.items()}
    for _ in range(warmup):
        for graph, _count in graphs.values():
            graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(replays):
        for name, (graph, count) in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1000.0 / count)
    del graphs
    return {name: statistics.median(times) for name, times in samples.items()}


def time_rounds_us(
    device: torch.device, variants: Mapping[str, Sequence[Callable[[], object]]], rounds: int = 3
) -> dict[str, float]:
    """``time_graphs_us`` after :func:`settle_clocks`, ``rounds`` times over graphs captured afresh,
    the median per variant: where a few tenths of a µs decide a finding, one capture's luck
    (memory placement, a clock step) must not."""
    settle_clocks(device)
    samples = [time_graphs_us(variants) for _ in range(rounds)]
    return {name: statistics.median(sample[name] for sample in samples) for name in variants}


def time_graph_us(calls: Sequence[Callable[[], object]], replays: int = 15, warmup: int = 3) -> float:
    """``time_graphs_us`` for a single variant."""
    return time_graphs_us({"calls": calls}, replays, warmup)["calls"]


def settle_clocks(device: torch.device, seconds: float = 0.2) -> None:
    """Keep the GPU busy for ``seconds`` so that what is timed next does not meet idle clocks.

    An H200 idles at a few hundred MHz; after host-side set-up (weights, fp64 references) the
    first graph replays of a point run slow while the clocks ramp up, enough to fake a routing
    loss.
    """
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(2 * src.numel() * src.element_size() / (start.elapsed_time(end) / 1000.0))
    del src, dst
    return statistics.median(samples)


def measure_kernel_overhead_us(device: torch.device) -> float:
    """Time per near-empty kernel (zeroing 54 KB) in the same graph setup as the GEMMs.

    The copy floor assumes a long stream; every µs-scale kernel also pays the gap between graph
    nodes, its launch and a first-load latency. This number is the part of that a kernel pays
    even when it moves nothing.
    """
    buffers = [torch.empty(108 * 128, dtype=torch.float32, device=device) for _ in range(16)]
    return time_graph_us([buf.zero_ for buf in buffers] * 2)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN or Inf anywhere in ``out`` gives inf."""
    diff = out.double() - ref.double()
    if not torch.isfinite(diff).all():
        return float("inf")
    return (diff.norm() / ref.double().norm()).item()
