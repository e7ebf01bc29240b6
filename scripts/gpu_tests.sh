#!/usr/bin/env bash
# The GPU suite on the GPU machine, in one device call (at most 10 minutes) or in named parts:
#   source .vl/unpack.sh && bash scripts/gpu_tests.sh \
#     [all | kernels | engine | overlap | bench-k3 | bench-ds | profile-k3 | profile-ds]...
# kernels: tests/gpu (fold kernels, fp8, convert --device cuda) and tests/unit's cuda parameters (the
# exact fold and rounding on a GPU); engine: tests/gpu/engine (real vLLM engines, stock vs plugin,
# side by side); bench-k3 / bench-ds: scripts/bench_engine.py for one full-depth model (about 9
# minutes each: one device call per model; "all" runs neither); profile-k3 / profile-ds: stock's and
# the fp8 engines' decode steps broken down by kernel (bench_engine.py --profile, about 8 minutes);
# overlap: the query timed as engines run it, after an x-writing kernel (bench_launch_overlap.py)
# and beside Kimi-K3's output gate on vLLM's second stream (bench_gate_overlap.py), about a minute
# (not in "all"). "all" runs the kernel tests beside the engine tests (they share the GPU; neither
# times anything). What docs/bench keeps lands in $OUT (the device returns it): gpu_tests_<gpu>.txt,
# gpu_engine_tests_<gpu>.txt, engine_<gpu>.json and engine_profile_<gpu>.json (a run merges into
# the file of that name it finds in $OUT or docs/bench), launch_overlap_<gpu>.json,
# gate_overlap_<gpu>.json, engine logs (tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tests_out}
ENGINE_S=${GPU_ENGINE_TESTS_S:-320}
mkdir -p "$OUT"
GPU=$(python3 -c "import torch; n = torch.cuda.get_device_name(0).lower(); print(next((f'nvidia_{k}' for k in ('h200', 'h100') if k in n), n.replace(' ', '_')))")
COMMIT=$(cat GPU_COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
HEADER="$(python3 -c "import torch; print(torch.cuda.get_device_name(0), '| torch', torch.__version__)") | vLLM $(python3 -c "from importlib.metadata import version; print(version('vllm'))" 2>/dev/null) | commit $COMMIT | $(date -u +%FT%TZ)"
parts=${*:-all}
has() { [[ " $parts " == *" $1 "* || " $parts " == *" all "* ]]; }
status=0

if has kernels; then
  { echo "# $HEADER"; timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu tests/unit --ignore=tests/gpu/engine 2>&1; } \
    > "$OUT/gpu_tests_$GPU.txt" &
  kernels_pid=$!
fi
if has engine; then
  rm -rf /tmp/gpu-engine-tests
  { echo "# $HEADER"; timeout "$ENGINE_S" python3 -m pytest -m gpu -rA -p no:cacheprovider --basetemp=/tmp/gpu-engine-tests \
      tests/gpu/engine 2>&1; } | tee "$OUT/gpu_engine_tests_$GPU.txt" | grep -E "^(PASSED|FAILED|XFAIL|ERROR|SKIPPED)|passed|failed"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  (cd /tmp/gpu-engine-tests && find . -name "*.log" -o -name matrix.json | tar czf "$OUT/engine_logs.tgz" -T -) 2>/dev/null
fi
if [ -n "${kernels_pid:-}" ]; then
  wait "$kernels_pid" || status=1
  tail -3 "$OUT/gpu_tests_$GPU.txt"
fi
if [[ " $parts " == *" overlap "* ]]; then
  for bench in launch gate; do
    timeout 240 python3 "scripts/bench_${bench}_overlap.py" --out "$OUT/${bench}_overlap_$GPU.json" || status=1
  done
fi
for model in k3 ds; do
  for kind in bench profile; do
    [[ " $parts " == *" $kind-$model "* ]] || continue
    name=$([ "$kind" = bench ] && echo engine || echo engine_profile)
    [ -f "$OUT/${name}_$GPU.json" ] || cp "docs/bench/${name}_$GPU.json" "$OUT/" 2>/dev/null
    timeout 560 python3 scripts/bench_engine.py --model "$model" --out "$OUT/${name}_$GPU.json" \
      --workdir /tmp/bench_engine $([ "$kind" = profile ] && echo --profile) || status=1
    (cd /tmp/bench_engine && tar czf "$OUT/${kind}_logs_$model.tgz" "$model"/*.log) 2>/dev/null
  done
done
echo "gpu_tests: $GPU, commit $COMMIT, parts: $parts, ${SECONDS} s, status $status"
exit $status
