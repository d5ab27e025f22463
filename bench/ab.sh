#!/usr/bin/env bash
# One GPU call: the core's kernel tests on the working tree, then bench/decode.py at chosen
# shapes for a saved older tree (default .ab/old, e.g. `git archive REV quantmla bench`) and
# for the working tree, alternately, so both see the same machine and clocks.
#   bash bench/ab.sh OUT SHAPES [OLD]
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1 shapes=$2 old=${3:-.ab/old}
mkdir -p "$out/old" "$out/new"
export PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
timeout "${TEST_TIMEOUT:-200}" python -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_*.py > "$out/tests.log" 2>&1
tail -2 "$out/tests.log"
for side in old new; do
  dir=$PWD; [ $side = old ] && dir=$old
  timeout "${BENCH_TIMEOUT:-200}" python "$dir/bench/decode.py" --shapes "$shapes" --out "$out/$side" > "$out/$side.log" 2>&1
  echo "== $side"; grep -v "^wrote" "$out/$side.log" | tail -3; cat "$out/$side"/*.md | tail -n +5
done
