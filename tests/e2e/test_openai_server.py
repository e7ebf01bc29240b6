"""The OpenAI-compatible server, as deployed, serves a converted checkpoint with the plugin active.

The server runs with vLLM's default process layout (API server, engine core/worker in another
process), bound to loopback, and every request is bounded in size and time. The stats file is
written by the worker while it serves, which is the only way to see it: the worker is killed, not
asked to exit, when the server stops.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import DEFAULT_ATTENTION_BACKEND, LOG_LINE, MAX_MODEL_LEN, engine_env, requires_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, requires_vllm]

STARTUP_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    stats_path: Path
    log_path: Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def server(engine_dir: Path, converted_bf16: Path) -> Iterator[Server]:
    port = _free_port()
    stats_path, log_path = engine_dir / "server.stats.json", engine_dir / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(converted_bf16),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--max-num-seqs",
        "4",
        "--attention-backend",
        DEFAULT_ATTENTION_BACKEND,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env=engine_env(FOLDCKPT_STATS_FILE=str(stats_path)), stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log_path)
        yield Server(url, str(converted_bf16), stats_path, log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


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
    reply = _post(
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
    reply = _post(f"{server.url}/v1/chat/completions", body)
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8
    stats = _stats_after(server, lambda s: s["folded_decode_tokens"] >= before["folded_decode_tokens"] + 7)
    assert stats["folded_decode_tokens"] >= before["folded_decode_tokens"] + 7, stats
    assert stats["prefill_tokens"] > before["prefill_tokens"]


def test_server_log_names_the_fold(server: Server) -> None:
    assert LOG_LINE in server.log_path.read_text()
