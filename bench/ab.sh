#!/usr/bin/env bash
# One GPU call: the core's kernel tests on the working tree, then a benchmark at chosen shapes for
# saved older trees (default .ab/old, e.g. `git archive REV quantmla bench | tar -x -C .ab/old`) and
# for the working tree, in turn and ROUNDS times over, so all see the same machine and clocks.
#   bash bench/ab.sh OUT SHAPES [TREE ...]
# BENCH=decode (default): bench/decode.py --shapes SHAPES.
# BENCH=exact16: bench/exact16_check.py --shapes SHAPES --only $ONLY (default c4r4_exact,c2r4_exact),
#   which checks the exact kernel against float64 before it times it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1 shapes=$2
shift 2
trees=("$@")
[ ${#trees[@]} -eq 0 ] && trees=(.ab/old)
trees+=(.)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-200}" python -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels_*.py > "$out/tests.log" 2>&1
  tail -2 "$out/tests.log"
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  for i in "${!trees[@]}"; do
    dir=${trees[$i]} side=$i-$(basename "$(cd "${trees[$i]}" && pwd)")-r$round
    mkdir -p "$out/$side"
    if [ "${BENCH:-decode}" = exact16 ]; then
      cmd=(python "$dir/bench/exact16_check.py" --shapes "$shapes" --only "${ONLY:-c4r4_exact,c2r4_exact}" --out "$out/$side")
    else
      cmd=(python "$dir/bench/decode.py" --shapes "$shapes" --out "$out/$side")
    fi
    timeout "${BENCH_TIMEOUT:-200}" "${cmd[@]}" > "$out/$side.log" 2>&1
    echo "== $side ($dir)"; grep -v "^wrote" "$out/$side.log" | grep -v "^{'H'" | tail -2
    grep "^{'H'" "$out/$side.log"
    cat "$out/$side"/*.md 2>/dev/null | tail -n +5
  done
done
