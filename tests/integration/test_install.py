"""Set-up and installation as a user meets them (issue 11).

* ``pip install foldckpt`` without the test extra, into a fresh virtualenv, runs convert, verify
  and inspect (no numpy, no safetensors, no pytest in that environment);
* ``scripts/setup_venv.sh`` says what each step installs and why, takes torch 2.13.0+cpu from the
  configured pip indexes when they have it, else from PyTorch's CPU wheel index, and fails within
  seconds, naming that index, where it cannot be reached (it never hangs).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from foldckpt.model.synthetic import make_checkpoint
from tests.conftest import REPO

SETUP = "scripts/setup_venv.sh"


def checkout_copy(dest: Path) -> Path:
    """The project's files (tracked and new, as git sees them) copied to ``dest``: building a wheel
    writes build/ into the source tree, which must not be the shared checkout."""
    listed = (
        subprocess.run(
            [
                "git",
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
                "--",
                "pyproject.toml",
                "README.md",
                "foldckpt",
                "scripts",
            ],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def setup_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("setup: ")]


@pytest.mark.slow
def test_a_clean_install_without_the_test_extra_converts_verifies_and_inspects(tmp_path: Path) -> None:
    source = checkout_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    started = time.monotonic()
    setup = subprocess.run(
        ["bash", SETUP, "--plain"],
        cwd=source,
        env={**os.environ, "FOLDCKPT_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.monotonic() - started
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    steps = setup_lines(setup.stdout)
    assert steps[0] == f"setup: creating the virtualenv {venv} with python3.11"
    assert steps[1].startswith("setup: installing torch 2.13.0+cpu (the CPU build")
    assert steps[2] == "setup: installing foldckpt from this checkout as a user installs it (a wheel, no extras)"
    assert steps[-1] == f"setup: done: {venv}"
    print(f"clean install: {took:.0f} s")

    python = venv / "bin" / "python"
    probe = "import importlib.util as u, foldckpt; print(foldckpt.__file__); print([m for m in ('numpy', 'safetensors', 'pytest') if u.find_spec(m)])"
    where, missing = subprocess.run(
        [python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(where).is_relative_to(venv) and missing == "[]"

    model = make_checkpoint(tmp_path / "model", "kimi_k3")
    foldckpt = venv / "bin" / "foldckpt"
    for args in (
        ["convert", model, tmp_path / "out", "-q"],
        ["verify", tmp_path / "out", "--deep", "-q"],
        ["inspect", tmp_path / "out"],
    ):
        run = subprocess.run([foldckpt, *map(str, args)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stderr == "", (args, run.stdout, run.stderr)
    assert "verified in" in run.stdout or "fold       3/3 layers" in run.stdout

    again = subprocess.run(
        ["bash", SETUP, "--plain"],
        cwd=source,
        env={**os.environ, "FOLDCKPT_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"setup: virtualenv {venv} exists (Python 3.11.{again.stdout.split('Python 3.11.')[1].split(')')[0]})",
        "setup: torch 2.13.0+cpu already installed",
        "setup: foldckpt from this checkout as a user installs it (a wheel, no extras): already installed",
        f"setup: done: {venv}",
    ]


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An HTTP address that accepts connections and never answers (an index behind a black hole)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/whl/cpu"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


@pytest.mark.slow
def test_setup_fails_fast_naming_the_index_when_no_index_can_give_the_cpu_torch(
    tmp_path: Path, silent_server: str
) -> None:
    """A machine whose pip sees no index with torch 2.13.0+cpu, and where PyTorch's index does not
    answer: the set-up says so in seconds instead of hanging."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.update(
        {
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INDEX": "1",
            "FOLDCKPT_VENV": str(tmp_path / "venv"),
            "FOLDCKPT_TORCH_INDEX": silent_server,
        }
    )
    started = time.monotonic()
    run = subprocess.run(["bash", SETUP], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert setup_lines(run.stdout)[1] == (
        "setup: installing torch 2.13.0+cpu (the CPU build; PyPI's torch is the CUDA one) from PyTorch's CPU "
        f"wheel index {silent_server}, which the configured pip indexes do not include"
    )
    errors = run.stderr.splitlines()
    assert errors[0].startswith(f"setup: cannot reach {silent_server}/torch/ (")
    assert errors[1].startswith(
        f"setup: torch 2.13.0+cpu is neither on the configured pip indexes nor reachable at {silent_server}"
    )
    assert took < 60, f"set-up took {took:.0f} s to give up"
    assert not (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch").exists()


def configured_indexes_have_cpu_torch() -> bool:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "torch", "--timeout", "5", "--retries", "0"],
        capture_output=True,
        text=True,
    ).stdout
    return bool(re.search(r"^Available versions:.*\b2\.13\.0\+cpu\b", listed, re.MULTILINE))


def local_simple_index(root: Path) -> str:
    """A PEP 503 index on disk holding torch 2.13.0+cpu and its dependencies (fetched through this
    machine's pip configuration): a stand-in for https://download.pytorch.org/whl/cpu."""
    files = root / "files"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--dest",
            str(files),
            "torch==2.13.0+cpu",
        ],
        check=True,
        capture_output=True,
    )
    for wheel in files.glob("*.whl"):
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        page = root / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        (page / wheel.name).symlink_to(wheel)
        with open(page / "index.html", "a") as handle:
            handle.write(f'<a href="{wheel.name.replace("+", "%2B")}">{wheel.name}</a>\n')
    return (root / "simple").as_uri()


@pytest.mark.slow
def test_on_a_machine_whose_pip_sees_only_pypi_torch_comes_from_the_pytorch_cpu_index(tmp_path: Path) -> None:
    """PyPI's torch 2.13.0 is the CUDA build: with only PyPI configured, the set-up must notice that
    torch 2.13.0+cpu is missing there and take it (and only it) from PyTorch's CPU index, here a
    local copy of it."""
    if not configured_indexes_have_cpu_torch():
        pytest.skip("this machine's pip has no torch 2.13.0+cpu to mirror: the clean-install test took the real index")
    index = local_simple_index(tmp_path / "pytorch-index")
    source = checkout_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.update({"PIP_CONFIG_FILE": os.devnull, "FOLDCKPT_TORCH_INDEX": index, "FOLDCKPT_VENV": str(venv)})
    setup = subprocess.run(["bash", SETUP, "--plain"], cwd=source, env=env, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert setup_lines(setup.stdout)[1] == (
        "setup: installing torch 2.13.0+cpu (the CPU build; PyPI's torch is the CUDA one) from PyTorch's CPU "
        f"wheel index {index}, which the configured pip indexes do not include"
    )
    version = subprocess.run(
        [venv / "bin" / "python", "-c", "import torch; print(torch.__version__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == "2.13.0+cpu"
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    run = subprocess.run(
        [venv / "bin" / "foldckpt", "convert", model, tmp_path / "out", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr
