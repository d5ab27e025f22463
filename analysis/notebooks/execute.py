"""Execute the notebooks of this folder with nbclient and store them with their outputs.

    python analysis/notebooks/execute.py                 # every notebook here, in place
    python analysis/notebooks/execute.py methods_on_caches.ipynb

Each notebook runs top to bottom in a fresh Python kernel (the interpreter running this script),
from the repository root, on the CPU. Figures are stored as PNG at a modest resolution so that a
code host shows them and each notebook stays well under a megabyte. Execution counts and
outputs are kept; the kernel's timing metadata and stderr (progress lines, warnings) are dropped, so
that a re-execution changes only what the code computes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 3600  # one cell; the longest (calibrating every method) takes a few minutes on a laptop CPU

# Run before the first cell (never stored): PNG figures of a modest size, no GPU.
SETUP = """\
import os
os.environ["CUDA_VISIBLE_DEVICES"] = ""
%matplotlib inline
%config InlineBackend.figure_formats = ["png"]
%config InlineBackend.rc = {"figure.dpi": 72, "savefig.dpi": 72}
"""


def notebooks() -> list[Path]:
    return sorted(HERE.glob("*.ipynb"))


def execute(path: Path, timeout: int = TIMEOUT_S, extra_code: str | None = None, log=None):
    """The notebook at ``path`` executed (nbformat node, not written). ``extra_code`` runs after the last
    cell in the same kernel and is appended as one more code cell (a test reads what it prints)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    if extra_code is not None:
        nb.cells.append(nbformat.v4.new_code_cell(extra_code))
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
        record_timing=False,
    )
    with client.setup_kernel():
        info = client.wait_for_reply(client.kc.kernel_info())
        nb.metadata["language_info"] = info["content"]["language_info"]
        _run(client, SETUP)
        for index, cell in enumerate(nb.cells):
            if log is not None and cell.cell_type == "code":
                log(f"{path.name}: cell {index}")
            client.execute_cell(cell, index)
    return nb


def _run(client, code: str) -> None:
    """``code`` in the kernel, outside the notebook and its execution count."""
    reply = client.wait_for_reply(client.kc.execute(code, store_history=False))
    if reply is None or reply["content"]["status"] != "ok":
        raise RuntimeError(f"the kernel could not run the setup code: {reply and reply['content']}")


def store(nb, path: Path) -> None:
    """Write ``nb`` without what changes from one execution to the next and says nothing of the
    results: the kernel's timings and stderr (progress lines, warnings)."""
    import nbformat

    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
    nbformat.validate(nb)
    nbformat.write(nb, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook file names in analysis/notebooks (default: all)")
    args = ap.parse_args(argv)
    paths = [HERE / n for n in args.names] or notebooks()
    for p in paths:
        print(f"executing {p.name} ...", file=sys.stderr, flush=True)
        store(execute(p, log=lambda m: print(m, file=sys.stderr, flush=True)), p)
        print(f"stored {p.relative_to(ROOT)} ({p.stat().st_size / 1e3:.0f} kB)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
