"""The notebooks under analysis/notebooks run top to bottom on the embedded model, and what their
text tells the reader holds on the numbers they compute."""

import json
import math
import warnings
from pathlib import Path
from statistics import median

import matplotlib
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "analysis" / "notebooks").glob("*.ipynb"))


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
    assert [p.name for p in NOTEBOOKS] == ["dual_path_sensitivity.ipynb"]
    for path in NOTEBOOKS:
        nb = _load(path)
        for cell in nb["cells"]:
            assert cell.get("id"), f"{path.name}: a cell without an id"
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} is stored with outputs"


def test_dual_path_sensitivity_notebook():
    ns = run_notebook(NOTEBOOKS[0])
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
