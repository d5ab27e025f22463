"""bench/ncu_summary.py --phases on a real Nsight Compute report of the exact decode kernel (H200,
bench/results/ncu-20261202-exact-v28): the page loop it finds must hold the tensor-core work the
compiler put in the loop (39 wgmma and 72 mma.sync per tile and warp, bench/gluon_sass.py --exact)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ncu_summary  # noqa: E402

REPORTS = ROOT / "bench" / "results" / "ncu-20261202-exact-v28"


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4"])
def test_phases_of_the_exact_page_loop(fmt):
    rows = ncu_summary.load(REPORTS / f"h16-b32-l32768-{fmt}-exact_True.sass.csv.gz")
    got = {name: (fi, fs, n, ops) for name, fi, fs, n, ops in ncu_summary.phases(rows)}
    assert list(got) == ["tile start", "scores", "softmax", "P·V"]
    assert sum(v[0] for v in got.values()) == pytest.approx(1.0)
    assert sum(v[1] for v in got.values()) == pytest.approx(1.0)
    # 36 group products + 3 zero-point products, all in the score phase; the 72 mma.sync in P·V
    assert round(got["scores"][3]["HGMMA"]) == 39
    assert round(sum(v[3]["HGMMA"] for v in got.values())) == 39
    assert round(got["P·V"][3]["HMMA"]) == 72
    # per tile and warp the loop runs ~1,100 of the 1,277-1,336 static instructions (the rare
    # rescaling branch is skipped)
    assert 1000 < sum(v[2] for v in got.values()) < 1336
