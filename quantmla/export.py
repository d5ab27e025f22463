"""Export a method's fused model as a standard Hugging Face checkpoint folder.

``python -m quantmla.export model=... method=quantmla bits=c4r4 [out=DIR]`` (or ``quantmla-export``)
takes the config of :mod:`quantmla.run` — the same ``conf/`` folder and overrides, validated by the
same :func:`~quantmla.run.plan` before anything is loaded, bad input stopping with one line and exit
code 2 — loads the model, runs the method's calibration (reusing the transforms stored under
``<runs_dir>/.transforms`` exactly as a run does, and storing new ones there) and its offline fusion,
puts the native attention modules back and writes ``save_pretrained`` of the native transformers
model: ``config.json``, safetensors weights with the original checkpoint's keys, tokenizer files and
the generation config. ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it without quantmla, so any
engine that serves the original architecture serves the transformed model.

The folder holds the transformed weights, nothing else: the transforms are folded into them, and
with the cache unquantized the model computes what the original computes (to round-off). Quantizing
the KV cache (the CxRy format, its group size, the BF16 sink and recent tokens) is a runtime policy
of the serving engine, which the checkpoint neither applies nor announces: ``config.json`` gets no
``quantization_config``. ``quantmla_export.json`` records what the weights were made for (method,
bits, the whole config, the id a run of this config has, the stored transforms it used) and
``README.md`` says the same in words.

A method whose transform leaves work at inference cannot be a plain checkpoint and is refused:
QuaRot† with a quantized RoPE cache (its post-RoPE Hadamard H_P runs online), before loading; any
other online map found on the model after calibration, before anything is written.

Default output folder: ``<runs_dir>/exports/<model>-<method>-<bits>-<run id>``. An existing folder is
replaced only if it holds an earlier export.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from quantmla.run import ConfigError, Plan, conf_dir, fused, plan

log = logging.getLogger("quantmla")

RECORD = "quantmla_export.json"
FORMAT_VERSION = 1

USAGE = """\
usage: python -m quantmla.export [key=value ...] [out=DIR]

Write the fused model of one run config (model, method, bits, calibration, ... as for
python -m quantmla.run) as a Hugging Face checkpoint folder that
AutoModelForCausalLM.from_pretrained loads without quantmla. The weights hold the method's
transforms; quantizing the KV cache is left to the serving engine.

  out=DIR    the folder to write (default: <runs_dir>/exports/<model>-<method>-<bits>-<run id>)

example: python -m quantmla.export model=smollm2_mla method=quantmla bits=c4r4 out=exports/smollm2-c4r4
"""


def split_argv(argv: list[str]) -> tuple[list[str], str | None]:
    """(Hydra overrides, out) from the command line; ConfigError for flags and sweeps."""
    from quantmla.run import jobs_of

    overrides, out = [], None
    for a in argv:
        if a.startswith("-"):
            raise ConfigError(f"unknown option '{a}': an export takes key=value overrides and out=DIR (see --help)")
        if a.startswith("out="):
            out = a.partition("=")[2]
            if not out:
                raise ConfigError("out= needs a folder")
        else:
            overrides.append(a)
    jobs = len(jobs_of(overrides))
    if jobs > 1:
        raise ConfigError(f"an export writes one model, and these overrides name {jobs} (a sweep); give one value")
    return overrides, out


def compose(overrides: list[str]) -> DictConfig:
    """The run config of ``overrides``, checked as ``quantmla.run`` checks a command line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from quantmla.run import validate_argv

    validate_argv(overrides)  # composed and planned as quantmla.run checks a command line
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return hydra_compose("run", overrides=overrides)


def check_exportable(p: Plan) -> None:
    """Refuse, before loading, a method whose transform at these bits does not fold into the weights."""
    work = p.method.online_work(p.spec)
    if work:
        raise ConfigError(
            f"method {p.method.config.name} at {p.cfg.bits.name} cannot be exported as a plain checkpoint: {work}"
        )


def default_out(cfg: DictConfig) -> Path:
    from quantmla.tracking import run_id

    rid = run_id(OmegaConf.to_container(cfg, resolve=True))
    return Path(cfg.runs_dir) / "exports" / f"{cfg.model.name}-{cfg.method.name}-{cfg.bits.name}-{rid}"


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / RECORD).exists())):
        raise ConfigError(f"out={out} exists and is not an earlier export: choose a new or empty folder")


def export(cfg: DictConfig, out: str | Path | None = None):
    """Export the fused model of ``cfg`` to ``out``; returns (folder, native fused model, tokenizer)."""
    from quantmla import attention

    p = plan(cfg)
    check_exportable(p)
    out = (Path(out) if out else default_out(cfg)).resolve()
    check_out(out)
    model, tokenizer, layers = fused(p, cfg)
    online = [str(layer.layer_idx) for layer in layers if layer.rope_transform is not None]
    if online:
        raise ConfigError(
            f"method {p.method.config.name} at {cfg.bits.name} cannot be exported as a plain checkpoint: "
            f"it left an online post-RoPE map on the attention of layers {', '.join(online)}"
        )
    attention.uninstall(model)
    check_native(model)
    write(model, tokenizer, out, record(p, cfg))
    log.info("exported %s %s %s → %s", p.model.name, p.method.config.name, cfg.bits.name, out)
    return out, model, tokenizer


def check_native(model) -> None:
    """The module tree is the one transformers builds from the model's config: no harness module left,
    the same state_dict keys (so the weights load into the native class as they are)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantmla import attention

    if attention.latent_layers(model):
        raise RuntimeError("the harness attention is still installed; cannot write a native checkpoint")
    with torch.device("meta"):
        native = AutoModelForCausalLM.from_config(model.config)
    want, have = set(native.state_dict()), set(model.state_dict())
    if want != have:
        diff = sorted(want ^ have)
        raise RuntimeError(f"the model's state_dict keys differ from the native ones ({len(diff)}, e.g. {diff[0]})")


def record(p: Plan, cfg: DictConfig) -> dict:
    from quantmla.tracking import environment, run_id

    container = OmegaConf.to_container(cfg, resolve=True)
    spec = p.spec
    return {
        "format": FORMAT_VERSION,
        "model": p.model.name,
        "method": p.method.config.to_dict(),
        "bits": {"name": cfg.bits.name, "content": spec.content_bits, "rope": spec.rope_bits, "group": spec.group},
        "protect": {"enabled": spec.protect, "sink": spec.sink, "recent": spec.recent},
        "run_id": run_id(container),
        "transforms": {path: {"key": folder.name, "dir": str(folder)} for path, folder in p.method.stored.items()},
        "method_info": p.method.info,
        "weights": "transforms fused offline into the native weights; nothing runs online",
        "kv_cache": "not quantized by this checkpoint: the CxRy format is a runtime policy of the serving engine",
        "config": container,
        "environment": environment(),
    }


def write(model, tokenizer, out: Path, rec: dict) -> None:
    """``save_pretrained`` of model and tokenizer, the record and a README, into a fresh folder that
    then replaces ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / RECORD).write_text(json.dumps(rec, indent=2, default=str) + "\n")
    (tmp / "README.md").write_text(readme(rec))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def readme(rec: dict) -> str:
    m, b, prot = rec["method"]["name"], rec["bits"], rec["protect"]
    fmt = b["name"].upper()
    protection = (
        f"the first {prot['sink']} and the {prot['recent']} most recent tokens kept in BF16"
        if prot["enabled"]
        else "none"
    )
    return f"""# {rec["model"]}, transformed by {m} for a {fmt} KV cache

A standard Hugging Face checkpoint: `AutoModelForCausalLM.from_pretrained` loads it, no quantmla
needed. It is the {rec["model"]} model with the `{m}` transforms for {fmt} fused into its weights.
Nothing runs online: with an unquantized cache it computes what the original model computes, to
round-off.

The checkpoint does not quantize the KV cache. That is a runtime policy of the serving engine: here
the content latent at {b["content"]} bits and the post-RoPE key at {b["rope"]} bits, per token in
groups of {b["group"]} channels, asymmetric min/max; protection as evaluated: {protection}.

`{RECORD}` holds the method, the bits, the whole config, the id a `quantmla.run` of this config
records under (`{rec["run_id"]}`) and the stored transforms used.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE, end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        overrides, out = split_argv(argv)
        cfg = compose(overrides)
        export(cfg, out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from quantmla.export import main as _main  # the importable module, not __main__

    sys.exit(_main())
