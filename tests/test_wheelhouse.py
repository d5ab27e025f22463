"""scripts/wheelhouse fills a folder from which quantmla installs offline (needs PyPI)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)

# A node's `pip list --format=freeze`: its CUDA torch and triton, an older PyYAML than PyPI's
# newest, and a CUDA library that never enters the wheelhouse.
NODE = "torch==2.13.0+cu130\ntriton==3.7.0\nPyYAML==6.0.2\nnvidia-cublas==13.1.0.3\n"


@pytest.mark.slow
def test_wheelhouse_installs_quantmla_offline(tmp_path):
    out, node = tmp_path / "wheelhouse", tmp_path / "node.txt"
    node.write_text(NODE)
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", ROOT / "scripts" / "wheelhouse", out, "--have", node], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]

    names = {wheelhouse.canon(w.name.split("-")[0]): w.name for w in out.glob("*.whl")}
    assert not [n for n in names if wheelhouse.NODE_PROVIDED.fullmatch(n)]
    assert "pyyaml" not in names  # the node has it
    for n in ["quantmla", "antlr4-python3-runtime", "hydra-core", "omegaconf", "lm-eval", "wandb", "pytest", "ruff"]:
        assert n in names
    data = wheelhouse.read_freeze(ROOT / "data-packages.txt")
    assert all(n in names for n in data)
    install = (out / "INSTALL.txt").read_text()
    assert "--no-index --find-links wheelhouse 'quantmla[dev]'" in install
    assert "--no-deps -r wheelhouse/data-packages.txt" in install

    # The closure: resolve quantmla[dev] for the default target (3.12, manylinux x86_64) from the
    # folder alone, the node's packages as metadata-only wheels, pip's configuration off.
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    for n, v in wheelhouse.read_freeze(node).items():
        wheelhouse.placeholder(node_dir, n, v)
    opts, markers = wheelhouse.target("3.12", "x86_64", "2.28")
    offline = dict(os.environ, PIP_CONFIG_FILE=os.devnull, WHEELHOUSE_MARKERS=json.dumps(markers))
    offline.pop("PIP_FIND_LINKS", None)
    report = tmp_path / "report.json"
    run = [sys.executable, "-c", wheelhouse.TARGET_PIP, "install", "--dry-run", "--ignore-installed", "--no-index"]
    pip = [*run, *opts, "--find-links", out, "--find-links", node_dir, "--report", report]
    done = subprocess.run([*pip, "quantmla[dev]"], env=offline, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = {wheelhouse.canon(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"torch", "triton", "pyyaml", "hydra-core", "lm-eval", "transformers"} <= resolved
    done = subprocess.run([*pip, "--no-deps", "-r", out / "data-packages.txt"], env=offline, capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
