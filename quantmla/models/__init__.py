"""Model specs: cheap, validated descriptions of a model that ``load`` turns into (model, tokenizer).

Each spec's ``hf_config()`` reads only the config (no weights), so a sweep is validated
before anything heavy happens. Nothing here reaches a model hub unless the user sets
``allow_download``; a missing checkpoint is an error that says how to get it.

What a run loads: the specs here (:class:`PretrainedModel`, a checkpoint folder or hub name) and
in :mod:`.embedded` (``model=smollm2_mla``, assembled on first use by :mod:`.build` from
:mod:`.smollm2_mla`'s conversion and the stored healed tensors), :mod:`.tiny` (the test model) and
:mod:`.weights` (what a checkpoint's weights are). The embedded model's one-off tooling (healing
text, healing, measuring) is :mod:`.tooling`, which no run imports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quantmla.mla import supported_classes
from quantmla.placement import Placement, dispatch


class ModelUnavailable(ValueError):
    pass


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        out = getattr(torch, dtype)
    except AttributeError:
        out = None
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype '{dtype}' (float32, bfloat16, float16 or auto)")
    return out


def mla_dims(config, name: str) -> tuple[int, int]:
    """(d_c, d_r) of an MLA config; a clear error for a model without MLA attention."""
    d_c, d_r = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if not d_c or not d_r:
        raise ModelUnavailable(
            f"model '{name}' (model_type '{getattr(config, 'model_type', '?')}') has no MLA attention "
            f"(its config has no kv_lora_rank/qk_rope_head_dim); supported attention classes: "
            f"{', '.join(supported_classes())}"
        )
    return int(d_c), int(d_r)


@dataclass
class TinyModel(Placement):
    """The seeded random DeepseekV2 of :mod:`quantmla.models.tiny` (placed like a checkpoint once built)."""

    name: str = "tiny"
    seed: int = 0
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_lora_rank: int = 128
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    dtype: str = "float32"

    def hf_config(self):
        from quantmla.models.tiny import tiny_config

        return tiny_config(
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
        )

    def check(self) -> tuple[int, int]:
        return mla_dims(self.hf_config(), self.name)

    def load(self, device: str = "auto"):
        from quantmla.models.tiny import build

        dev = resolve_device(device)
        model, tok = build(self.hf_config(), seed=self.seed, dtype=resolve_dtype(self.dtype, dev))
        return (dispatch(model, self) if self.device_map else model.to(dev)), tok


@dataclass
class PretrainedModel(Placement):
    """A transformers checkpoint: a hub id found in the local HF cache, or a local folder."""

    name: str
    repo_id: str | None = None
    path: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    allow_download: bool = False

    def local_dir(self) -> Path:
        if self.path:
            p = Path(self.path).expanduser()
            if not (p / "config.json").exists():
                raise ModelUnavailable(f"model '{self.name}': {p} has no config.json")
            return p
        if not self.repo_id:
            raise ModelUnavailable(f"model '{self.name}' needs model.path=<folder> or model.repo_id=<hub id>")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(
                snapshot_download(self.repo_id, revision=self.revision, local_files_only=not self.allow_download)
            )
        except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
            cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
            raise ModelUnavailable(
                f"model '{self.name}' ({self.repo_id}) is not available offline: no copy in the Hugging Face "
                f"cache ({cache}). On a machine with hub access run `hf download {self.repo_id}` and copy the "
                f"cache here, or pass model.path=/folder/with/the/checkpoint ({type(e).__name__})"
            ) from None

    def hf_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.local_dir(), local_files_only=True)

    def check(self) -> tuple[int, int]:
        d = self.local_dir()
        if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
            raise ModelUnavailable(f"model '{self.name}': {d} holds a config but no weights (*.safetensors, *.bin)")
        dims = mla_dims(self.hf_config(), self.name)
        from quantmla.models.weights import check_mla_weights

        check_mla_weights(d, self.name)
        return dims

    def load(self, device: str = "auto"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = resolve_device(device)
        d = self.local_dir()
        if self.device_map is None:
            placed = {"device_map": str(dev)}
        else:
            placed = {"device_map": self.device_map, "max_memory": self.budget(), "offload_folder": self.offload_folder}
        model = AutoModelForCausalLM.from_pretrained(
            d, dtype=resolve_dtype(self.dtype, dev), local_files_only=True, **placed
        )
        if self.device_map is not None:  # transformers reads what is left over from the checkpoint on disk
            self.check_fits(getattr(model, "hf_device_map", None) or {})
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        return model.eval(), tok
