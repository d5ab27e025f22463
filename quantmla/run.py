"""One run: config → model → method → quantized cache → evaluation → run record + W&B.

``python -m quantmla.run [hydra overrides]`` (``-m`` for a sweep) is Hydra's own command line. A run's
config is validated before its folder is made, and every job of a sweep before the first one launches
(the :class:`CheckConfig` callback): bad input stops with one line and exit code 2 before any model
is loaded, while what Hydra itself refuses (an override that does not parse or compose) is reported
by Hydra, in full. From code, call :func:`run` with a composed config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("quantmla")


def _launch_name() -> str:
    """The Hydra folder of one launch (``${quantmla.launch:}`` in conf/run.yaml): its start time and
    process id, so that two launches in the same second do not share one."""
    from datetime import datetime

    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{os.getpid()}"


OmegaConf.register_new_resolver("quantmla.launch", _launch_name, use_cache=True, replace=True)


class ConfigError(ValueError):
    """Bad input, reported as one line before anything heavy runs."""


def conf_dir() -> Path:
    """``conf/`` of a source checkout, or the copy packaged inside the wheel."""
    here = Path(__file__).resolve().parent
    for p in (here.parent / "conf", here / "conf"):
        if (p / "run.yaml").exists():
            return p
    raise FileNotFoundError("cannot find the conf/ folder next to the quantmla package")


def group_options(group: str) -> list[str]:
    d = conf_dir() / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def checked(node, where: str) -> dict:
    """A config group node as plain values, checked against the fields of the dataclass it instantiates
    (unknown keys refused, each value of its field's type) and normalised (:mod:`quantmla.schema`)."""
    from hydra.utils import get_class

    from quantmla.schema import typed

    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    if not isinstance(values, dict) or "_target_" not in values:
        raise ConfigError(f"{where} is not a config group node (it has no _target_)")
    cls = get_class(values["_target_"])
    if not dataclasses.is_dataclass(cls):
        return values
    return typed(where, values, cls, ignore=("_target_", "name"))


def make(node, where: str = "config"):
    """Instantiate a config group node, dropping its display ``name`` where the class has no such field."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_class, instantiate

    node = checked(node, where)
    cls = get_class(node["_target_"])
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    name = node.get("name")
    if "name" in node and "name" not in fields:
        node.pop("name")
        if getattr(cls, "name", name) != name:
            raise ConfigError(f"config name '{name}' does not match {cls.__name__}.name '{cls.name}'")
    try:
        return instantiate(node)
    except InstantiationException as e:  # report the target's own error (one line), not Hydra's wrapper
        if isinstance(e.__cause__, Exception):
            raise e.__cause__ from None
        raise


@dataclass
class Plan:
    cfg: DictConfig
    model: object
    method: object
    spec: object
    eval: object
    logger: object
    calibration: object
    record: dict  # the resolved config, checked and normalised: what the run id is made of
    backend: str = "auto"  # the attention core's backend (noise.perturb=backend changes it)
    noise: str = ""  # what the run's noise settings changed (quantmla.noise), empty for an ordinary run

    def run_record(self):
        from quantmla.tracking import RunRecord

        return RunRecord(self.record["runs_dir"], self.record["sweep"], self.record)


REFERENCE = {"method": "rtn", "protect.enabled": True, "exact": False}
"""What every unquantized (C16R16) run is recorded with: RTN (no transform), protection as conf/run.yaml
has it and rounded rows, so that the BF16 runs recorded before these fields were normalised keep their ids."""


def unquantized_reference(container: dict, top: dict) -> tuple[dict, dict]:
    """The BF16 reference is one run whatever the method: at C16R16 nothing is quantized, so the
    method (its transforms are exact with quantization off, the paper's §4.3), the protection of
    sink and recent tokens and ``exact`` change nothing that is computed. They are set to
    :data:`REFERENCE`, in the record and so in the run id: a sweep ``method=a,b bits=c16r16,c4r4``
    computes C16R16 once and every method shares it."""
    from quantmla.cache import CacheSpec

    try:
        quantized = CacheSpec.parse(top["bits"]["name"]).quantized
    except ValueError:
        return container, top  # reported by plan() with the rest of the bits checks
    if quantized:
        return container, top
    method = OmegaConf.to_container(OmegaConf.load(conf_dir() / "method" / f"{REFERENCE['method']}.yaml"))
    given = container.get("method", {}).get("name")
    if given != REFERENCE["method"]:
        make(dict(container["method"]), "method")  # a method config the user got wrong is still an error
        log.info("bits=%s: method %s has no effect on an unquantized cache; recorded as %s", top["bits"]["name"],
                 given, REFERENCE["method"])  # fmt: skip
    top = top | {"exact": REFERENCE["exact"], "protect": top["protect"] | {"enabled": REFERENCE["protect.enabled"]}}
    return container | {"method": method} | {k: top[k] for k in ("exact", "protect")}, top


def model_context(name: str) -> int:
    """The context length (max_position_embeddings) of ``conf/model/<name>.yaml``, from its config
    alone: no weights are read (``scripts/reproduce`` sizes RULER's lengths with it)."""
    path = conf_dir() / "model" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ValueError(f"no model '{name}' in conf/model/ (one of: {known})")
    node = OmegaConf.to_container(OmegaConf.load(path))
    node.pop("defaults", None)
    return int(getattr(make(node, "model").hf_config(), "max_position_embeddings", 0) or 0)


def plan(cfg: DictConfig) -> Plan:
    """Build and validate everything a run needs, loading no model."""
    from quantmla import methods, noise, schema
    from quantmla.cache import CacheSpec
    from quantmla.data import CalibrationData
    from quantmla.kernels import PageFormat, check_backend
    from quantmla.models import resolve_device, resolve_dtype

    try:
        container = OmegaConf.to_container(cfg, resolve=True)
        top = schema.settings(container)
        container, top = unquantized_reference(container, top)
        groups = {g: checked(container[g], g) for g in ("model", "method", "eval", "logger")}
        groups["calibration"] = schema.typed("calibration", container["calibration"], CalibrationData)
        schema.check_device(top["device"])
        schema.check_runs_dir(top["runs_dir"], top["sweep"])
        model = make(groups["model"], "model")
        method_cfg = make(groups["method"], "method")
        spec = CacheSpec.parse(
            top["bits"]["name"],
            group=top["bits"]["group"],
            sink=top["protect"]["sink"],
            recent=top["protect"]["recent"],
            protect=top["protect"]["enabled"],
            exact=top.get("exact", False),
        )
        method = methods.get(method_cfg)
        ev = make(groups["eval"], "eval")
        logger = make(groups["logger"], "logger")
        calibration = CalibrationData(**groups["calibration"])
        d_c, d_r = model.check()
        spec.check_dims(d_c, d_r)
        backend, device = top.get("backend", "auto"), resolve_device(top["device"])
        if getattr(model, "device_map", None) and top["device"] not in ("auto", "cuda"):
            raise ConfigError(
                f"model.device_map={model.device_map} spreads the model over the GPUs: leave device=auto, not {top['device']}"
            )
        check_backend(backend, device)
        resolve_dtype(str(getattr(model, "dtype", "auto")), device)
        PageFormat(spec.content_bits, spec.rope_bits, d_c, d_r, spec.group)  # the cache layout can hold it
        method.check(spec)
        method.check_dims(d_c, d_r)
        backend, ev, calibration, perturbed = noise.perturb(
            top.get("noise", {}), backend, device, ev, calibration, method
        )
        if method.needs_data:
            calibration.check()
        ev.check()
        ev.check_model(model.hf_config())
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every validation failure becomes one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(msg) from e
    return Plan(cfg, model, method, spec, ev, logger, calibration, container | top | groups, backend, perturbed)


def run(cfg: DictConfig) -> dict:
    """Run one job (skipped if its record is already done); returns its metrics."""
    return run_plan(plan(cfg))


def run_plan(p: Plan) -> dict:
    """Run a validated job. One process at a time computes a run: a second one waits for the first
    and then skips the run it finished (or retries the run it left failed)."""
    from quantmla.files import one_writer

    record = p.run_record()
    if record.done:
        log.info("skip %s (done): %s", record.id, record.dir)
        return record.metrics()
    with one_writer(record.dir, f"run {record.id}") as waited:
        if record.done:
            log.info(
                "skip %s (done by another process%s): %s", record.id, " while this one waited" * waited, record.dir
            )
            return record.metrics()
        record.start()
        logfile = _link_log(record.dir)
        log.info("run %s → %s%s", record.id, record.dir, f" (log: {logfile})" if logfile else "")
        try:
            with record.watch_signals():
                return _execute(p, p.cfg, record)
        except BaseException as e:
            record.fail(e)
            raise


def _link_log(run_dir: Path) -> Path | None:
    """``<run>/log``: a link to the log file this process writes (Hydra's ``<job>.log``), so that a run's
    record leads to its log; the latest attempt's where a run was retried. Returns the log file."""
    files = [Path(h.baseFilename) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return None
    link, tmp = run_dir / "log", run_dir / f".log.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.path.relpath(files[0], run_dir))
        os.replace(tmp, link)
    except OSError as e:  # a file system without links: the path, as text
        log.debug("no link to the log (%s)", e)
        tmp.unlink(missing_ok=True)
        from quantmla.files import write_atomic

        write_atomic(link, f"{files[0]}\n")
    return files[0]


def prepare(p: Plan, cfg: DictConfig):
    """(model, tokenizer) as a run evaluates them: :func:`fused`, then the cache format set."""
    model, tokenizer, layers = fused(p, cfg)
    for layer in layers:
        layer.spec = p.spec
    return model, tokenizer


def fused(p: Plan, cfg: DictConfig):
    """(model, tokenizer, latent layers): loaded (spread over devices if the model config asks), every MLA
    attention routed through the latent cache, unquantized, and the method applied (calibration, reusing the
    transforms stored under ``<runs_dir>/.transforms``, then offline fusion). Shared by runs and exports."""
    import torch

    from quantmla import attention, mla, placement
    from quantmla.cache import CacheSpec
    from quantmla.methods import MethodContext

    torch.manual_seed(int(cfg.seed))
    model, tokenizer = p.model.load(cfg.device)
    if placement.describe(model):
        log.info("%s spread over devices (modules per device): %s", p.model.name, placement.describe(model))
    layers = attention.install(model, CacheSpec(group=p.spec.group), backend=p.backend)
    p.method.apply(
        model,
        mla.adapters(model),
        MethodContext(
            spec=p.spec,
            tokenizer=tokenizer,
            model_name=p.model.name,
            device=placement.execution_device(model),
            cache_dir=Path(cfg.runs_dir) / ".transforms",
            calibration=p.calibration,
            progress=True,  # a bar on a terminal, periodic lines in a log (quantmla.progress)
        ),
    )
    return model, tokenizer, layers


def _execute(p: Plan, cfg: DictConfig, record) -> dict:
    from quantmla.evals import EvalContext

    ok = False
    try:
        p.logger.start(record, cfg.sweep)
        model, tokenizer = prepare(p, cfg)
        ctx = EvalContext(
            model_name=p.model.name,
            max_positions=getattr(model.config, "max_position_embeddings", None),
            progress=True,
            work_dir=str(record.dir),
        )
        metrics = p.eval.run(model, tokenizer, ctx)
        if p.method.info:
            metrics["method"] = p.method.info
        if p.method.needs_data:  # the banks it read (analysis marks rows calibrated off the paper's recipe)
            metrics["calibration"] = p.calibration.to_dict()
        if p.noise:
            metrics["noise"] = {"applied": p.noise}
        record.finish(metrics)
        p.logger.log(metrics)
        ok = True
        log.info("done %s: %s", record.id, p.eval.summary(metrics))
        return metrics
    finally:
        p.logger.finish(ok)


def _hydra_main():
    import hydra

    @hydra.main(config_path=str(conf_dir()), config_name="run", version_base="1.3")
    def main(cfg: DictConfig) -> None:
        try:  # checked already by CheckConfig; planned again here, where a launcher runs the job
            p = plan(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if not _multirun():
            run_plan(p)
            return
        try:  # a sweep goes on past a failed job, and lists every failure when it ends
            run_plan(p)
            _job_result(p, None)
        except Exception as e:  # noqa: BLE001 - recorded in the run folder, reported by analysis.callbacks
            _job_result(p, e)

    return main


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_result(p: Plan, error: Exception | None) -> None:
    """``job.json`` in the Hydra job folder: what the sweep's end reports (analysis.callbacks.SweepTable)."""
    import json

    from hydra.core.hydra_config import HydraConfig

    from quantmla.files import reason, write_atomic

    hc = HydraConfig.get()
    record = p.run_record()
    result = {"run": record.id, "dir": str(record.dir), "overrides": list(hc.overrides.task)}
    if error is None:
        result["status"] = "done"
    else:
        result |= {"status": "failed", "error": reason(error)}
        log.error(
            "failed %s (%s): %s; traceback in %s", record.id, " ".join(result["overrides"]), result["error"],
            record.dir / "error.txt",
        )  # fmt: skip
    out = Path(hc.runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "job.json", json.dumps(result, indent=1))


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(master: DictConfig) -> list[list[str]] | None:
    """The task overrides of every job that Hydra's basic sweeper launches from ``master`` (a sweep's
    config, ``hydra`` node included): ``hydra.sweeper.params`` (an experiment file's) and then the
    command line's overrides, expanded as the sweeper expands them (``a,b``, ``range``, ``glob``; a key
    given on the command line wins). None for another sweeper, whose jobs are known only as it runs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if master.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    overrides = parser.parse_overrides([*params, *master.hydra.overrides.task])
    return BasicSweeper.split_arguments(overrides, None)[0]


def check_sweep(master: DictConfig) -> int:
    """Compose every job of the sweep ``master`` as its launcher will, and :func:`plan` it (ConfigError on
    the first bad one; Hydra's own exception, whole, where a job does not compose). Returns the number of
    jobs checked (0 where the sweeper is not Hydra's basic one: each job then checks itself)."""
    from hydra.core.global_hydra import GlobalHydra

    jobs = sweep_jobs(master) or []
    loader = GlobalHydra.instance().config_loader()
    for job in jobs:
        full = loader.load_sweep_config(master, job)
        plan(OmegaConf.masked_copy(full, [k for k in full if k != "hydra"]))
    return len(jobs)


class CheckConfig(Callback):
    """Hydra callback (``hydra.callbacks.check`` in conf/run.yaml): before a run makes its folder, or a sweep
    launches its first job, the config of every job is composed and validated, so bad input stops with
    one line and exit code 2 before any model is loaded or any folder made."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(lambda: plan(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        n = self._check(lambda: check_sweep(config))
        if n:
            log.info("checked the %d job(s) of the sweep", n)

    @staticmethod
    def _check(fn):
        try:
            return fn()
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)


def _master(overrides: list[str], multirun: bool = True) -> DictConfig:
    """The config Hydra composes for a command line's ``overrides`` (``hydra`` node included), inside an
    initialised Hydra; a sweep's config (its jobs in ``hydra.overrides.task``) where ``multirun``."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    return GlobalHydra.instance().config_loader().load_configuration("run", list(overrides), run_mode=mode)


def validate_argv(argv: list[str]) -> None:
    """Compose and validate every job of a command line (Hydra overrides, ``-m`` for a sweep), as
    ``python -m quantmla.run`` does before it loads anything. ConfigError on the first bad job, with
    Hydra's error text, whole, where the overrides do not parse or compose."""
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    multirun = any(a in ("-m", "--multirun") for a in argv)
    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise ConfigError(f"validate_argv takes Hydra overrides and -m, not {flags[0]}")
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        try:
            master = _master(overrides, multirun)
            if multirun:
                check_sweep(master)
            else:
                plan(OmegaConf.masked_copy(master, [k for k in master if k != "hydra"]))
        except HydraException as e:
            raise ConfigError(hydra_text(e)) from None


def hydra_text(e: BaseException) -> str:
    """A Hydra exception's whole text, with the errors that caused it (as Hydra's command line prints them)."""
    parts = []
    while e is not None:
        parts.append(str(e).strip())
        e = e.__cause__
    return "\n".join(p for p in parts if p)


def jobs_of(overrides: list[str]) -> list[list[str]]:
    """The task overrides of every job ``-m <overrides>`` launches (one job without sweep syntax);
    ConfigError with Hydra's text where the overrides do not parse or compose."""
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        try:
            master = _master(overrides)
            return sweep_jobs(master) or [list(master.hydra.overrides.task)]
        except HydraException as e:
            raise ConfigError(hydra_text(e)) from None


def cli(argv: list[str] | None = None) -> None:
    """``python -m quantmla.run`` / ``quantmla-run``: Hydra's own command line (every Hydra flag works:
    ``--help``, ``--cfg job``, ``-sc install=bash``, ``-m`` with any sweep syntax). ``argv`` replaces
    ``sys.argv[1:]``, which is what Hydra reads."""
    from quantmla.tracking import exit_code, terminate_by_exception

    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "quantmla.run", *argv]
    with terminate_by_exception():
        try:
            _hydra_main()()
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the run is recorded interrupted
            print(f"interrupted (exit {exit_code(e)})", file=sys.stderr)
            sys.exit(exit_code(e))


if __name__ == "__main__":
    from quantmla.run import cli as _cli  # the importable module, not __main__

    _cli()
