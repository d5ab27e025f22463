#!/usr/bin/env bash
# On one CUDA GPU: the core's tests with real compilation, then the decode benchmark.
#   bash bench/run_gpu.sh [out-dir]        (default out-dir: bench/results)
# Kernel variants are compiled in parallel first (Triton's disk cache), so the timed sweep
# and the tests do not wait on the compiler one kernel at a time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
date -u | tee "$out/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$out/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python bench/decode.py --warm > "$out/warm.log" 2>&1 &
warm=$!
par=()
python -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-8}")
timeout "${TEST_TIMEOUT:-300}" python -m pytest -q "${par[@]}" -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$out/tests.log"
wait "$warm"
grep -c "^warm ok" "$out/warm.log"; grep "FAILED" "$out/warm.log"
# The defaults are the tuned tile table; BENCH_ARGS=--tune times the candidates first.
timeout "${BENCH_TIMEOUT:-300}" python bench/decode.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
