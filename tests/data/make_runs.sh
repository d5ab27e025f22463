#!/usr/bin/env bash
# Regenerates tests/data/runs/: real runs of the tiny model (CPU, ~30 min on two idle cores) whose records the analysis
# tests render and compare with tests/data/rendered/. Run from the repository root; then
#   python -m analysis paper tests/data/runs --out tests/data/rendered/paper && rm tests/data/rendered/paper/*.p[nd][gf]
#   python -m analysis table tests/data/runs/ppl --out tests/data/rendered/table
# keep their .md, .csv and .tex files (figures are not compared) and review the diff.
set -euo pipefail
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRITON_INTERPRET=1
run() { python -m quantmla.run -m model=tiny logger=none runs_dir=tests/data/runs calibration=quick "$@"; }
QM=(method.steps=30 method.val_every=10)

# Perplexity at C4R4 (16 windows of 256 tokens), every method, and the noise floor of RTN
PPL=(eval.seq_len=256 eval.max_tokens=4096)
run sweep=ppl "${PPL[@]}" +row=rtn,smoothquant,quarot
run sweep=ppl "${PPL[@]}" +row=quantmla "${QM[@]}"
run sweep=ppl "${PPL[@]}" experiment=noise_floor +row=rtn

# Table 3 (MMLU 5-shot, one item per subject, prompts cut to 512 tokens): the cumulative ablation
T3=(experiment=table3_ablation sweep=table3 eval.limit=1 eval.max_length=512)
run "${T3[@]}" +row=bf16,rtn,smoothquant,quarot
for row in quantmla_content quantmla_unprotected quantmla; do  # one at a time: a +row sweep refuses method.steps
    run "${T3[@]}" +row=$row "${QM[@]}"
done

# Tables 1 and 8 (Suite A, quick profile): BF16 and two baselines unprotected
run sweep=table1 eval=suite_a_quick +row=bf16,rtn,quarot

# keep the records only (no Hydra folders, cached transforms or host details)
rm -rf tests/data/runs/.transforms tests/data/runs/*/.hydra
find tests/data/runs -name env.json -delete
find tests/data/runs \( -name 'table.*' -o -name comparisons.csv -o -name details.csv -o -name '*.tmp' \) -delete
