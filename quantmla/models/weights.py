"""What a checkpoint folder's weights are, read from their headers (no tensor is loaded).

A config can say MLA while the weights next to it are of another model (a Llama checkpoint with a
DeepseekV2 config copied in): transformers would then build the MLA model, initialise every
attention projection at random and evaluate noise. The tensor names in the safetensors headers
(or their index) tell before anything is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

MLA_TENSOR = "kv_a_proj_with_mqa"  # the latent down-projection every supported MLA family has


def tensor_names(folder: Path) -> set[str] | None:
    """Names of the tensors in ``folder``'s safetensors files; None where the weights are not safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), "pt") as handle:
                names |= set(handle.keys())
        except Exception as e:  # noqa: BLE001 - safetensors' own error type
            raise ValueError(f"{f} is not a readable safetensors file ({str(e).strip() or type(e).__name__})") from None
    return names


def check_mla_weights(folder: Path, name: str) -> None:
    """ValueError if the weights in ``folder`` have no MLA attention (their config may say otherwise)."""
    names = tensor_names(folder)
    if names is None:  # *.bin only: their names are not readable without loading them
        return
    if not any(MLA_TENSOR in n for n in names):
        attn = sorted({n.split("self_attn.")[1].split(".")[0] for n in names if "self_attn." in n})
        seen = f" (attention tensors: {', '.join(attn[:6])})" if attn else ""
        raise ValueError(
            f"model '{name}': the weights in {folder} have no MLA attention ({MLA_TENSOR}){seen}, "
            "although its config describes an MLA model; they are another model's weights"
        )
