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
FOLDCKPT="$VENV/bin/foldckpt"
MODEL="$WORK/kimi-k3-tiny"
OUT="$WORK/kimi-k3-tiny-folded"
step() { printf '\n\033[1m== %s\033[0m\n$ %s\n' "$1" "${*:2}"; "${@:2}"; }

step "1. a synthetic Kimi-K3 checkpoint" "$VENV/bin/python" scripts/make_tiny_checkpoint.py --family kimi_k3 "$MODEL"
step "2. plan from headers only (nothing written)" "$FOLDCKPT" convert "$MODEL" "$OUT" --dry-run
step "3. convert" "$FOLDCKPT" convert "$MODEL" "$OUT" --quiet
step "4. convert again: idempotent" "$FOLDCKPT" convert "$MODEL" "$OUT" --quiet
step "5. verify every level, recomputing the folds" "$FOLDCKPT" verify "$OUT" --deep --quiet
step "6. what a TP8 rank-3 node checks before serving" "$FOLDCKPT" verify "$OUT" --rank 3 --tp 8 --quiet
step "7. inspect" "$FOLDCKPT" inspect "$OUT"
echo
echo "== 8. flip one byte in the sidecar: verify must fail (exit 1) and name the file"
cp "$OUT/foldckpt-00001-of-00001.safetensors" "$WORK/sidecar.bak"
printf '\xff' | dd of="$OUT/foldckpt-00001-of-00001.safetensors" bs=1 seek=4096 conv=notrunc status=none
set +e
"$FOLDCKPT" verify "$OUT" --quiet
status=$?
set -e
mv "$WORK/sidecar.bak" "$OUT/foldckpt-00001-of-00001.safetensors"
[ "$status" -eq 1 ] || { echo "expected exit 1 from verify, got $status"; exit 1; }
echo "(exit $status, as expected; sidecar restored)"
echo
echo "demo OK: $OUT holds the original files (hard links), the fold sidecar and foldckpt.json"
