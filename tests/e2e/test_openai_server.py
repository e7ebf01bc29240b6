"""The OpenAI-compatible server, as deployed, serves a converted checkpoint with the plugin active.

The server runs with vLLM's default process layout (API server, engine core/worker in another
process), bound to loopback, and every request is bounded in size and time. The stats file is
written by the worker while it serves, which is the only way to see it: the worker is killed, not
asked to exit, when the server stops.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    DEFAULT_ATTENTION_BACKEND,
    LOG_LINE,
    engine_env,
    openai_server,
    post_json,
    requires_vllm,
    wait_healthy,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, requires_vllm]

STARTUP_TIMEOUT_S = 240


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    stats_path: Path
    log_path: Path


@pytest.fixture(scope="module")
def server(engine_dir: Path, converted_bf16: Path) -> Iterator[Server]:
    stats_path, log_path = engine_dir / "server.stats.json", engine_dir / "server.log"
    env = engine_env(FOLDCKPT_STATS_FILE=str(stats_path))
    args = ("--enforce-eager", "--max-num-seqs", "4", "--attention-backend", DEFAULT_ATTENTION_BACKEND)
    with openai_server(converted_bf16, log_path, env, *args) as (url, process):
        if not wait_healthy(url, process, STARTUP_TIMEOUT_S):
            pytest.fail(f"server not healthy (exit {process.poll()}):\n{log_path.read_text()[-6000:]}")
        yield Server(url, str(converted_bf16), stats_path, log_path)


def _stats_after(server: Server, predicate: Any) -> dict[str, int]:
    """The worker's stats once ``predicate`` holds (it writes at most every 50 ms)."""
    deadline = time.monotonic() + 10
    stats: dict[str, int] = {}
    while time.monotonic() < deadline:
        if server.stats_path.exists():
            stats = json.loads(server.stats_path.read_text())
            if predicate(stats):
                break
        time.sleep(0.1)
    return stats


def test_completions(server: Server) -> None:
    reply = post_json(
        f"{server.url}/v1/completions",
        {"model": server.model, "prompt": "The fold", "max_tokens": 12, "temperature": 0},
    )
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["choices"][0]["finish_reason"] == "length"
    stats = _stats_after(server, lambda s: s["folded_decode_tokens"] >= 11)
    assert stats["folded_decode_tokens"] >= 11, stats
    assert stats["layers_with_fold"] == 2


def test_chat_completions(server: Server) -> None:
    before = _stats_after(server, lambda s: True)
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Fold it."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    reply = post_json(f"{server.url}/v1/chat/completions", body)
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8
    stats = _stats_after(server, lambda s: s["folded_decode_tokens"] >= before["folded_decode_tokens"] + 7)
    assert stats["folded_decode_tokens"] >= before["folded_decode_tokens"] + 7, stats
    assert stats["prefill_tokens"] > before["prefill_tokens"]


def test_server_log_names_the_fold(server: Server) -> None:
    assert LOG_LINE in server.log_path.read_text()
