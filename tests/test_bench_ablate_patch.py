"""The stage-ablation switches (bench/ablate.patch) still apply to the decode kernel on main."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_ablation_patch_applies():
    r = subprocess.run(
        ["git", "apply", "--check", "bench/ablate.patch"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, f"bench/ablate.patch no longer applies; regenerate it:\n{r.stderr}"
