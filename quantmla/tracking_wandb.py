"""A run record in W&B: what :class:`WandbLogger` logs and what ``analysis.wandb_source`` reads back.

One W&B run per record, whose id is made from the sweep and the run id (:func:`wandb_id`), so a
relaunched run (after a failure, an interruption, a SLURM requeue) resumes the same W&B run
(``resume="allow"``) instead of starting a second one of the same name. It holds

- the config: the record's ``config.yaml``, whole;
- the summary: ``metrics.json`` as it is, nested, null averages and their ``why_missing``
  included, plus ``record/run``, ``record/sweep`` and ``record/status``;
- ``record/tasks``: a ``wandb.Table`` with one row per task and metric (:func:`task_rows`);
- an artifact ``record-<wandb id>`` of type ``run-record``: the record folder's files.

Without an API key the run is written offline into ``<record>/wandb/offline-run-<time>-<wandb id>/``;
``wandb sync runs/<sweep>/<run-id>/wandb/offline-run-*`` uploads it (a resumed run's folders in order).

A record made without W&B (``logger=none``, or on a machine whose W&B folders were not kept) gets
the same W&B run afterwards from its folder, since everything above is read from it:
``python -m quantmla.tracking_wandb runs/<folder>`` (:func:`log_records`) logs every finished record
under the folder that has no W&B log yet, with ``record/logged_from: record`` in its summary (its
W&B times are those of the logging, and it has no system metrics).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

RESERVED = "record/"
"""Summary keys of the record itself (not metrics): ``record/run``, ``record/sweep``, ``record/status``, ``record/tasks``."""
ARTIFACT_TYPE = "run-record"
TASK_COLUMNS = ["section", "task", "metric", "value", "note"]


def wandb_id(sweep: str, run_id: str) -> str:
    """The W&B run id of record ``run_id`` of ``sweep``: the same on every launch of the same run."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "_", sweep).strip("_")[:48] or "sweep"
    return f"{safe}-{run_id}"


def task_rows(metrics: dict) -> list[list]:
    """``[section, task, metric, value, note]`` for every per-task number of an evaluation's metrics
    (lm-eval's ``results`` and ``subtasks``, the suites' ``scores`` in %, RULER's ``mean``) and every
    task that could not be evaluated (``unavailable``, ``averages.why_missing``) with its reason."""
    rows = []
    for section in ("results", "subtasks"):
        for task, values in (metrics.get(section) or {}).items():
            for metric, v in (values or {}).items():
                rows.append([section, task, metric, v, ""])
    for section, metric in (("scores", "score_pct"), ("mean", "mean_pct")):
        for task, v in (metrics.get(section) or {}).items():
            rows.append([section, task, metric, v, ""])
    for task, why in (metrics.get("unavailable") or {}).items():
        rows.append(["unavailable", task, "", None, str(why)])
    for task, why in ((metrics.get("averages") or {}).get("why_missing") or {}).items():
        rows.append(["missing", task, "", None, str(why)])
    return [[s, t, m, float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None, n]
            for s, t, m, v, n in rows]  # fmt: skip


def record_files(folder: Path) -> list[Path]:
    """The files of a record folder that its artifact holds (not the W&B log, locks or temporaries)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


class WandbLogger:
    """W&B for a run record (see the module's doc).

    ``mode``: ``auto`` logs online when an API key is configured (``WANDB_API_KEY`` or a
    ``wandb login``) and offline otherwise; ``online``, ``offline`` and ``disabled`` force it.
    """

    def __init__(self, project: str = "quantmla", entity: str | None = None, mode: str = "auto", tags=()):
        if mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"wandb mode '{mode}' is not one of auto, online, offline, disabled")
        self.project, self.entity, self.mode, self.tags = project, entity, mode, list(tags or ())
        self.run = None
        self.record = None
        self.sweep = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        if os.environ.get("WANDB_API_KEY"):
            return "online"
        netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        return "online" if netrc.exists() and "api.wandb.ai" in netrc.read_text() else "offline"

    def start(self, record, sweep: str, logged_from: str | None = None) -> None:
        """``logged_from``: where the run was logged from when not by the run itself (``record/logged_from``)."""
        import wandb

        self.record, self.sweep = record, sweep
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.resolved_mode(),
            dir=str(record.dir),
            name=record.id,
            id=wandb_id(sweep, record.id),
            resume="allow",
            group=sweep,
            job_type=str(record.cfg.get("eval", {}).get("name", "run")),
            tags=self.tags,
            config=record.cfg,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.summary.update(
            {f"{RESERVED}run": record.id, f"{RESERVED}sweep": sweep, f"{RESERVED}status": "running"}
        )
        if logged_from:
            self.run.summary[f"{RESERVED}logged_from"] = logged_from

    def log(self, metrics: dict) -> None:
        """The finished record: metrics as the summary, the per-task table, the record folder as an artifact."""
        if self.run is None:
            return
        import wandb

        self.run.summary.update(dict(metrics))
        rows = task_rows(metrics)
        if rows:
            self.run.log({f"{RESERVED}tasks": wandb.Table(columns=TASK_COLUMNS, data=rows)})
        art = wandb.Artifact(f"record-{self.run.id}", type=ARTIFACT_TYPE, metadata={"run": self.record.id})
        for f in record_files(self.record.dir):
            art.add_file(str(f), name=f.name, policy="immutable")  # the record's files are not written again
        self.run.log_artifact(art)
        self.run.summary[f"{RESERVED}status"] = "done"

    def finish(self, ok: bool) -> None:
        if self.run is not None:
            if not ok:
                self.run.summary[f"{RESERVED}status"] = "failed"
            self.run.finish(exit_code=0 if ok else 1)
            self.run = None


def has_wandb_log(folder: Path, wid: str) -> bool:
    """Whether the record folder holds a W&B run folder (offline or online) of W&B run ``wid``."""
    return any((folder / "wandb").glob(f"*run-*-{wid}"))


def log_records(root: str | Path, project=None, entity=None, mode: str = "auto", tags=(), say=print) -> dict:
    """Log every finished record under ``root`` that has no W&B log yet, as :class:`WandbLogger` logs
    a run (same W&B id, config, summary, task table and artifact), plus ``record/logged_from``.

    ``project``, ``entity`` and ``tags`` default to the record's own ``logger`` settings (the project
    to ``quantmla`` if it has none). Returns ``{record folder: outcome}``: ``logged``, ``has a W&B log``, or why it was left alone."""
    from quantmla.tracking import RunRecord, scan_runs

    scan = scan_runs(root)
    for path, why in scan.damaged:
        say(f"{path}: damaged ({why}), left alone")
    out = {}
    for i, run in enumerate(scan.runs, 1):
        folder, cfg, metrics = Path(run["dir"]), run["config"], run["metrics"]
        sweep = str(cfg.get("sweep") or folder.parent.name)
        record = RunRecord(folder.parent.parent, sweep, cfg)
        own = cfg.get("logger") if isinstance(cfg.get("logger"), dict) else {}
        if record.dir != folder:
            outcome = f"not in <sweep>/<run id> ({sweep}/{record.id}), left alone"
        elif has_wandb_log(folder, wandb_id(sweep, record.id)):
            outcome = "has a W&B log"
        else:
            logger = WandbLogger(
                project or own.get("project") or "quantmla",
                entity or own.get("entity"),
                mode,
                tags or own.get("tags") or (),
            )
            ok = False
            try:
                logger.start(record, sweep, logged_from="record")
                logger.log(metrics)
                ok = True
            finally:
                logger.finish(ok)
            outcome = "logged"
        out[folder] = outcome
        say(f"[{i}/{len(scan.runs)}] {folder}: {outcome}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m quantmla.tracking_wandb",
        description="Log the finished run records under the folders to W&B, each that has no W&B log yet "
        "(offline without an API key: `wandb sync <record>/wandb/offline-run-*` uploads them).",
    )
    ap.add_argument("folders", nargs="+", type=Path, help="folders of run records (searched recursively)")
    ap.add_argument("--project", help="W&B project (default: each record's logger.project, else quantmla)")
    ap.add_argument("--entity", help="W&B entity (default: each record's logger.entity)")
    ap.add_argument("--mode", default="auto", choices=("auto", "online", "offline"), help="as logger.mode")
    ap.add_argument("--tags", nargs="*", default=(), help="W&B tags of the logged runs")
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        ap.error(f"no such folder: {', '.join(missing)}")
    counts = dict.fromkeys(("logged", "has a W&B log", "left alone"), 0)
    for folder in args.folders:
        for outcome in log_records(folder, args.project, args.entity, args.mode, args.tags).values():
            kind = outcome if outcome in ("logged", "has a W&B log") else "left alone"
            counts[kind] += 1
    print(", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no finished records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
