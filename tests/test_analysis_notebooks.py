"""The notebooks under analysis/notebooks run top to bottom on the embedded model, and what their
text tells the reader holds on the numbers they compute."""

import json
import math
import warnings
from pathlib import Path
from statistics import median

import matplotlib
import pytest

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "analysis" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _load(path: Path) -> dict:
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4 and nb["cells"], f"{path.name} is not an nbformat-4 notebook with cells"
    return nb


def run_notebook(path: Path) -> dict:
    """Execute the code cells in order in one namespace (Agg backend); returns the namespace."""
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ns = {"__name__": "__main__"}
    code = [c for c in _load(path)["cells"] if c["cell_type"] == "code"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-interactive.*", category=UserWarning)  # plt.show() on Agg
        for i, cell in enumerate(code):
            exec(compile("".join(cell["source"]), f"{path.name}, code cell {i}", "exec"), ns)
    ns["_figures"] = len(plt.get_fignums())
    plt.close("all")
    return ns


def test_notebooks_are_there_and_stored_without_outputs():
    assert [p.name for p in NOTEBOOKS] == ["dual_path_sensitivity.ipynb", "methods_on_caches.ipynb"]
    for path in NOTEBOOKS:
        nb = _load(path)
        for cell in nb["cells"]:
            assert cell.get("id"), f"{path.name}: a cell without an id"
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} is stored with outputs"


def test_dual_path_sensitivity_notebook():
    ns = run_notebook(NOTEBOOK_DIR / "dual_path_sensitivity.ipynb")
    assert ns["_figures"] == 4  # channels, responses, predictor, bits
    n = ns["n_layers"]
    assert n == 30 and len(ns["R_C"]) == len(ns["R_P"]) == n

    # Section 2: the matched errors sit on the target, and the text's finding holds on this model.
    assert ns["off_target"] < 0.01
    for r in ns["resp"]:
        for b in "CP":
            assert r[b]["nmse_out"] == pytest.approx(ns["TARGET_NMSE"] * r[b]["R"], rel=1e-9)
    table4 = ns["table4"]
    assert table4["ratio"] == pytest.approx((sum(ns["R_P"]) / n) / (sum(ns["R_C"]) / n))
    assert table4["ratio"] > 1

    # Section 3: at cache NMSE 1e-3 the first-order model predicts the measured output error, and
    # the JVP gain is the finite-perturbation gain.
    for point in ns["loc"].values():
        for d in point.values():
            assert d["nmse_cache"] == pytest.approx(ns["LOCAL_NMSE"], rel=1e-9)
            assert d["G"] == pytest.approx(d["G_finite"], rel=0.15)
            assert d["nmse_pred"] == pytest.approx(d["nmse_out"], rel=0.15)
            assert d["T"] > 0 and d["A"] > 0

    # The predictor with the allocation beats both controls (the notebook's reading of Table 5),
    # and the points its scatter plot draws are the ones Table 5 scores.
    def mae(pred):
        return sum(abs(p - m) for p, m in zip(pred, ns["measured"])) / len(pred)

    table5 = ns["table5"]
    assert table5["points"] == len(ns["local_layers"])
    assert table5["mae_operator_allocation"] == pytest.approx(mae(ns["full"]))
    assert table5["mae_trace_only"] == pytest.approx(mae(ns["operator"]))
    assert table5["mae_operator_allocation"] < min(table5["mae_trace_only"], table5["mae_cache_only"])

    # Section 4: every control gave a positive, finite gain ratio on every layer.
    for point in ns["iv"].values():
        for d in point.values():
            assert all(math.isfinite(d[f"iv_{c}"]) and d[f"iv_{c}"] > 0 for c in ns["CONTROLS"])
    assert ns["table6"]["points"] == len(ns["local_layers"])

    # Section 5: more bits, less error on both paths, and C2R4 beats C4R2 as the text says.
    real = ns["real"]
    for b in "CP":
        for i in range(n):
            assert real[(b, 2)][i] > real[(b, 4)][i] > real[(b, 8)][i]
    assert median(ns["summed"]["C2R4"]) < median(ns["summed"]["C4R2"])


def test_methods_on_caches_notebook():
    ns = run_notebook(NOTEBOOK_DIR / "methods_on_caches.ipynb")
    assert ns["_figures"] == 3  # objectives, cached channels, cache error against output error
    scores, info, formats = ns["scores"], ns["info"], ns["FORMATS"]
    base = ["SmoothQuant†", "QuaRot†", "QuantMLA"]

    # Section 1: every method's transforms beat RTN on both paths; QuantMLA is far ahead on the
    # content path; QuaRot† leads on the RoPE path and QuantMLA closes most of RTN's gap to it.
    for bits in formats:
        s = {n: scores[bits, n] for n in ["RTN", *base]}
        for n in base:
            assert s[n]["L_C"] < s["RTN"]["L_C"] and s[n]["L_P"] < s["RTN"]["L_P"], (bits, n)
        assert s["QuantMLA"]["L_C"] < 0.75 * min(s["SmoothQuant†"]["L_C"], s["QuaRot†"]["L_C"])
        assert min(s, key=lambda n: s[n]["L_P"]) == "QuaRot†"
        closed = (s["RTN"]["L_P"] - s["QuantMLA"]["L_P"]) / (s["RTN"]["L_P"] - s["QuaRot†"]["L_P"])
        assert closed > 0.5
        # QuantMLA's content scale starts from the α that SmoothQuant† picks, on the same objective
        assert info[bits, "QuantMLA"]["alpha_C"] == info[bits, "SmoothQuant†"]["alpha_C"]
        assert info[bits, "QuantMLA"]["heldout_init_C"] == pytest.approx(info[bits, "SmoothQuant†"]["heldout_nmse_C"])
    # both formats store K_P at 4 bits: the C2R4 run reused the RoPE path learned for C4R4
    assert info["c2r4", "QuantMLA"]["cached_P"] == 1
    assert scores["c2r4", "QuantMLA"]["L_P"] == scores["c4r4", "QuantMLA"]["L_P"]
    # the cache's own error ranks the methods differently from the output error
    rows = [n for n in ns["CONFIGS"]]
    by = {k: sorted(rows, key=lambda n: scores["c2r4", n][k]) for k in ("L_C", "cache NMSE of C")}
    assert by["L_C"] != by["cache NMSE of C"]

    # Section 2: quantization off, every fused model is the original; QuantMLA's cache is the
    # flattest inside its quantization groups.
    assert all(e < 1e-5 for e in ns["fusion_error"].values())
    assert min(ns["spread"], key=ns["spread"].get) == "QuantMLA"
    assert max(ns["spread"], key=ns["spread"].get) == "RTN"

    # Section 3: trained on the cache, the cache error is lower and the output error higher.
    aligned, cache_trained = ns["aligned"], ns["cache_trained"]
    assert cache_trained["cache NMSE of C"] < aligned["cache NMSE of C"]
    assert cache_trained["L_C"] > 1.5 * aligned["L_C"]

    # Section 4: end to end, C2R4 costs more than C4R4 for every method; QuantMLA leads at C2R4,
    # is close to QuaRot† at C4R4, and both stay ahead of SmoothQuant† and RTN.
    e2e = ns["end_to_end"]
    for n in ["RTN", *base]:
        assert e2e["c2r4", n] > e2e["c4r4", n]
    others = [e2e["c2r4", n] for n in ns["names"] if n != "QuantMLA"]
    assert e2e["c2r4", "QuantMLA"] < 0.8 * min(others)  # "about two thirds of the next best"
    for bits in formats:
        assert max(e2e[bits, "QuantMLA"], e2e[bits, "QuaRot†"]) < min(e2e[bits, "SmoothQuant†"], e2e[bits, "RTN"])
    a, b = e2e["c4r4", "QuantMLA"], e2e["c4r4", "QuaRot†"]
    assert abs(a - b) < 0.25 * min(a, b)
