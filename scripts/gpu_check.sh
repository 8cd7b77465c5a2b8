#!/usr/bin/env bash
# GPU readiness in one command: the CUDA tests, then the engine bench at an 8B target / 1B draft
# shape (scripts/gpu_bench.py; random weights unless --target/--draft name checkpoints).
# Usage: scripts/gpu_check.sh [gpu_bench.py options]
# Without CUDA it prints one line and exits 0. Logs and results go to $OUT if set, else results/.
# Both parts run even when the first fails (GPU time is scarce); the exit status is non-zero if
# either failed. The bench is cut off after BENCH_TIMEOUT seconds (default 360).
set -euo pipefail
cd "$(dirname "$0")/.."

# The first interpreter whose torch sees a GPU: $PYTHON, the project's venv, or the machine's own
# python3 (a bare GPU machine has no venv, but its python3 has torch and transformers).
PY=""
for candidate in ${PYTHON:-} .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null
    then
        PY="$candidate"
        break
    fi
done
if [[ -z "$PY" ]]; then
    echo "no CUDA: skipped"
    exit 0
fi

RESULTS="${OUT:-results}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0

echo "[gpu_check] $("$PY" -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)")"

# test_gpu.py in full, then the tests marked `gpu` elsewhere. Only the files that use the marker
# are collected: other test modules import application packages a bare GPU machine lacks.
echo "[gpu_check] tests"
mapfile -t marked < <(grep -rlE --include='test_*.py' 'mark\.gpu\b' tests |
    grep -v '^tests/llm_engine/test_gpu.py$' || true)
(
    rc=0
    "$PY" -m pytest -q -p no:cacheprovider tests/llm_engine/test_gpu.py || rc=1
    if ((${#marked[@]})); then
        "$PY" -m pytest -q -p no:cacheprovider -m gpu "${marked[@]}" || rc=1
    fi
    exit "$rc"
) 2>&1 | tee "$RESULTS/gpu_tests.log" || status=1

echo "[gpu_check] bench"
timeout "${BENCH_TIMEOUT:-360}" "$PY" scripts/gpu_bench.py --out "$RESULTS" "$@" 2>&1 |
    tee "$RESULTS/gpu_bench.log" || status=1

echo "[gpu_check] $([[ $status == 0 ]] && echo ok || echo FAILED); results in $RESULTS/"
exit "$status"
