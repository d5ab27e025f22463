"""Console scripts: pyproject's [project.scripts] names the functions behind ``python -m``, and each
resolves and answers --help and bad input as its ``python -m`` form does."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "quantmla-run": "quantmla.run:cli",
    "quantmla-analysis": "analysis.__main__:main",
    "quantmla-export": "quantmla.export:main",
    "quantmla-lm-eval": "quantmla.evals.cli:main",
}
# What a console script's wrapper does: load the entry point, call it with the script's argv, exit with it.
WRAPPER = """
import sys
from importlib.metadata import EntryPoint
name, value, *args = sys.argv[1:]
sys.argv = [name, *args]
sys.exit(EntryPoint(name, value, "console_scripts").load()())
"""


def test_pyproject_names_the_scripts():
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert table == SCRIPTS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_resolves_to_a_function(name):
    fn = metadata.EntryPoint(name, SCRIPTS[name], "console_scripts").load()
    assert callable(fn)


def test_installed_scripts_match_where_this_checkout_is_installed():
    """Where quantmla is installed from a checkout with the table, its console scripts are these."""
    dist = metadata.distribution("quantmla")
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    if not installed:
        pytest.skip("the installed quantmla predates its console scripts")
    assert installed == SCRIPTS


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,args,rc,expect",
    [
        ("quantmla-run", ["--help"], 0, "== Configuration groups =="),
        ("quantmla-run", ["bits.name=c5r4"], 2, "error: content bits 5 is not supported"),
        ("quantmla-run", ["model=nope"], 1, "In 'run': Could not find 'model/nope'"),
        ("quantmla-analysis", ["--help"], 0, "usage: python -m analysis"),
        ("quantmla-analysis", ["table", "no-such-folder"], 2, "error: no-such-folder is not a folder of runs"),
        ("quantmla-export", ["--help"], 0, "usage: python -m quantmla.export"),
        ("quantmla-export", ["method=nope"], 2, "error: In 'run': Could not find 'method/nope'"),
        ("quantmla-lm-eval", ["run", "--help"], 0, "--model_args"),
    ],
)
def test_script_answers_help_and_bad_input(name, args, rc, expect, tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this checkout's code
    r = subprocess.run(
        [sys.executable, "-c", WRAPPER, name, SCRIPTS[name], *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": path, "WANDB_MODE": "offline"},
        timeout=300,
    )
    assert r.returncode == rc, r.stderr
    if rc == 0:
        assert expect in r.stdout
    elif "Could not find" in expect:  # Hydra's refusal, whole: the options it lists follow
        err = r.stderr.strip().splitlines()
        group = expect.split("'")[3].split("/")[0]
        assert err[0].startswith(expect) and f"Available options in '{group}':" in err, r.stderr
    else:
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(expect), r.stderr
    assert not (tmp_path / "runs").exists()  # neither help nor bad input starts anything
