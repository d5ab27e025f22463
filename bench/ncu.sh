#!/usr/bin/env bash
# Nsight Compute on the decode kernel (the exact one with cfg exact=True) at the bar shapes
# (needs a GPU machine where ncu reads the counters). Writes <out>/<tag>.ncu-rep, the details page and the per-instruction SASS
# page (stall samples) as text/CSV.
#   bash bench/ncu.sh [out-dir] [H:B:L:fmt[:cfg] ...]     e.g. 16:32:32768:c2r4:exact=True
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/ncu}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(16:32:32768:c16r16 16:32:32768:c4r4 16:32:32768:c2r4 128:32:32768:c16r16 128:32:32768:c4r4)
for job in "${jobs[@]}"; do
  IFS=: read -r H B L fmt cfg <<<"$job"
  tag="h$H-b$B-l$L-$fmt${cfg:+-${cfg//[=,]/_}}"
  ncu --clock-control none --profile-from-start off -k "regex:_decode_kernel|_exact16_kernel" --set full \
      --import-source no -f -o "$out/$tag" \
      python bench/ncu_decode.py --shape "$H:$B:$L" --fmt "$fmt" --config "${cfg:-}" > "$out/$tag.log" 2>&1
  tail -1 "$out/$tag.log"
  ncu --import "$out/$tag.ncu-rep" --page details > "$out/$tag.details.txt" 2>&1
  ncu --import "$out/$tag.ncu-rep" --page source --print-source sass --csv > "$out/$tag.sass.csv" 2>&1
done
