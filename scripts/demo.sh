#!/usr/bin/env bash
# foldckpt demo on a fresh CPU machine: set up, build a tiny Kimi-K3-geometry checkpoint (KDA +
# MLA layers, MXFP4 experts, an MTP layer, shards that split a layer), convert it, verify it down
# to a numerical recompute, inspect it, and show verify catching a one-byte corruption.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${DEMO_DIR:-.work/demo}"
# The demo deletes only a directory it made itself (it holds MARK): DEMO_DIR=~ or DEMO_DIR=/data
# must never be wiped. Anything else non-empty, or a symlink, is refused before any work.
MARK=.foldckpt-demo
if [ -L "$WORK" ]; then
  echo "demo.sh: DEMO_DIR $WORK is a symlink; give the directory itself (or an empty or new one)" >&2
  exit 2
elif [ -f "$WORK/$MARK" ]; then
  rm -rf -- "$WORK"
elif [ -e "$WORK" ] && [ -n "$(ls -A -- "$WORK" 2>/dev/null || echo unreadable)" ]; then
  echo "demo.sh: DEMO_DIR $WORK is not empty and was not made by this demo; choose an empty or new directory" >&2
  exit 2
fi
mkdir -p -- "$WORK"
: > "$WORK/$MARK"
bash scripts/setup_venv.sh
VENV="${FOLDCKPT_VENV:-.venv}"
# The venv's bin/ first on PATH, as `source $VENV/bin/activate` puts it: each command is printed as
# a user types it once the venv is active (the README's examples), and runs exactly that way.
VENV_BIN="$(cd -- "$VENV/bin" && pwd)"
export PATH="$VENV_BIN:$PATH"
MODEL="$WORK/kimi-k3-tiny"
OUT="$WORK/kimi-k3-tiny-folded"
# Bold titles on a terminal only: `scripts/demo.sh > demo.log` must not write escape codes.
if [ -t 1 ]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD="" PLAIN=""; fi
title() { printf '\n%s== %s%s\n' "$BOLD" "$1" "$PLAIN"; }
step() { title "$1"; printf '$ %s\n' "${*:2}"; "${@:2}"; }

step "1. a synthetic Kimi-K3 checkpoint" python scripts/make_tiny_checkpoint.py --family kimi_k3 "$MODEL"
step "2. plan from headers only (nothing written)" foldckpt convert "$MODEL" "$OUT" --dry-run
step "3. convert" foldckpt convert "$MODEL" "$OUT" --quiet
step "4. convert again: idempotent" foldckpt convert "$MODEL" "$OUT" --quiet
step "5. verify every level, recomputing the folds" foldckpt verify "$OUT" --deep --quiet
step "6. what a TP8 rank-3 node checks before serving" foldckpt verify "$OUT" --rank 3 --tp 8 --quiet
step "7. inspect" foldckpt inspect "$OUT"
title "8. flip one byte in the sidecar: verify must fail (exit 1) and name the file"
cp "$OUT/foldckpt-00001-of-00001.safetensors" "$WORK/sidecar.bak"
printf '\xff' | dd of="$OUT/foldckpt-00001-of-00001.safetensors" bs=1 seek=4096 conv=notrunc status=none
set +e
foldckpt verify "$OUT" --quiet
status=$?
set -e
mv "$WORK/sidecar.bak" "$OUT/foldckpt-00001-of-00001.safetensors"
[ "$status" -eq 1 ] || { echo "expected exit 1 from verify, got $status"; exit 1; }
echo "(exit $status, as expected; sidecar restored)"
echo
echo "demo OK: $OUT holds the original files (hard links), the fold sidecar and foldckpt.json"
echo "to type the commands above yourself: source $VENV_BIN/activate (foldckpt is installed in $VENV only)"
