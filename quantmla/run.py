"""One run: config → model → method → quantized cache → evaluation → run record + W&B.

``python -m quantmla.run [hydra overrides]`` (``-m`` for a sweep). Every job of a sweep is
composed and validated first, so bad input stops with one line and exit code 2 before any
model is loaded. From code, call :func:`run` with a composed config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("quantmla")


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


def make(node):
    """Instantiate a config group node, dropping its display ``name`` where the class has no such field."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_class, instantiate

    node = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
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


def plan(cfg: DictConfig) -> Plan:
    """Build and validate everything a run needs, loading no model."""
    from quantmla import methods
    from quantmla.cache import CacheSpec
    from quantmla.data import CalibrationData
    from quantmla.kernels import PageFormat, check_backend
    from quantmla.models import resolve_device

    try:
        model = make(cfg.model)
        method_cfg = make(cfg.method)
        spec = CacheSpec.parse(
            cfg.bits.name,
            group=int(cfg.bits.group),
            sink=int(cfg.protect.sink),
            recent=int(cfg.protect.recent),
            protect=bool(cfg.protect.enabled),
            exact=bool(cfg.get("exact", False)),
        )
        method = methods.get(method_cfg)
        ev = make(cfg.eval)
        logger = make(cfg.logger)
        calibration = CalibrationData(**OmegaConf.to_container(cfg.calibration, resolve=True))
        d_c, d_r = model.check()
        spec.check_dims(d_c, d_r)
        backend, device = str(cfg.get("backend", "auto")), resolve_device(str(cfg.device))
        if getattr(model, "device_map", None) and str(cfg.device) not in ("auto", "cuda"):
            raise ConfigError(
                f"model.device_map={model.device_map} spreads the model over the GPUs: leave device=auto, not {cfg.device}"
            )
        check_backend(backend, device)
        PageFormat(spec.content_bits, spec.rope_bits, d_c, d_r, spec.group)  # the cache layout can hold it
        method.check(spec)
        method.check_dims(d_c, d_r)
        if method.needs_data:
            calibration.check()
        ev.check()
        ev.check_model(model.hf_config())
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every validation failure becomes one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(msg) from e
    return Plan(cfg, model, method, spec, ev, logger, calibration)


def run(cfg: DictConfig) -> dict:
    """Run one job (skipped if its record is already done); returns its metrics."""
    from quantmla.tracking import RunRecord

    p = plan(cfg)
    container = OmegaConf.to_container(cfg, resolve=True)
    record = RunRecord(cfg.runs_dir, cfg.sweep, container)
    if record.done:
        log.info("skip %s (done): %s", record.id, record.dir)
        return record.metrics()
    record.start()
    log.info("run %s → %s", record.id, record.dir)
    try:
        with record.watch_signals():
            return _execute(p, cfg, record)
    except BaseException as e:
        record.fail(e)
        raise


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
    layers = attention.install(model, CacheSpec(group=p.spec.group), backend=str(cfg.get("backend", "auto")))
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
            progress=sys.stderr.isatty(),
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
            progress=sys.stderr.isatty(),
            work_dir=str(record.dir),
        )
        metrics = p.eval.run(model, tokenizer, ctx)
        if p.method.info:
            metrics["method"] = p.method.info
        record.finish(metrics)
        p.logger.log(metrics)
        ok = True
        log.info("done %s: %s", record.id, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        return metrics
    finally:
        p.logger.finish(ok)


def _hydra_main():
    import hydra

    @hydra.main(config_path=str(conf_dir()), config_name="run", version_base="1.3")
    def main(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return main


def _sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax (a,b / range / choice) into the jobs' override lists."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for ov in parsed:
        key = ov.get_key_element()
        if ov.is_sweep_override():
            axes.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            axes.append([ov.input_line])
    return [list(c) for c in itertools.product(*axes)]


def validate_argv(argv: list[str]) -> None:
    """Compose and validate every job of the command line; ConfigError on the first bad one."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    groups = ("model", "method", "bits", "eval", "logger", "calibration", "experiment", "row")
    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        jobs = _sweep_jobs(job_overrides)
    except HydraException as e:
        raise ConfigError(f"cannot parse overrides: {str(e).splitlines()[0]}") from None
    for job in jobs:
        for o in job:
            key, _, value = o.lstrip("+~").partition("=")
            if key in groups and value not in group_options(key) and value != "null":
                hint = f" (any other CxRy: bits.name={value})" if key == "bits" else ""
                raise ConfigError(f"unknown {key} '{value}'; choose one of: {', '.join(group_options(key))}{hint}")
    multirun = any(a in ("-m", "--multirun") for a in argv)
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        for job in jobs:
            for sub in _config_sweep(job) if multirun else [job]:
                try:
                    cfg = compose("run", overrides=sub)
                except HydraException as e:
                    raise ConfigError(str(e).strip().splitlines()[0]) from None
                plan(cfg)


def _config_sweep(job: list[str]) -> list[list[str]]:
    """The jobs a sweep's ``hydra.sweeper.params`` (set by an experiment file) adds to ``job``;
    keys given on the command line win, as in Hydra's basic sweeper."""
    from hydra import compose
    from hydra.errors import HydraException

    try:
        params = compose("run", overrides=job, return_hydra_config=True).hydra.sweeper.get("params") or {}
    except HydraException as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    given = {o.lstrip("+~").partition("=")[0] for o in job}
    extra = [f"{k}={v}" for k, v in params.items() if k.lstrip("+~") not in given]
    return [job + sub for sub in _sweep_jobs(extra)] if extra else [job]


def cli(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not any(a in ("-h", "--help", "--hydra-help", "--info", "-c", "--cfg") for a in argv):
        try:
            validate_argv(argv)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    _hydra_main()()


if __name__ == "__main__":
    from quantmla.run import cli as _cli  # the importable module, not __main__

    _cli()
