"""Spec of a model the project builds from installed packages plus stored weights (``model=smollm2_mla``).

``load`` builds the model folder on first use (:mod:`quantmla.models.build`, under the
quantmla cache: ``$QUANTMLA_CACHE`` or ``~/.cache/quantmla``, keyed by the stored file's
hash) and loads it offline like any local checkpoint. ``check`` reads only the stored
file's header and ``hf_config`` only the GGUF's metadata, so a sweep validates without
building anything.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from quantmla.models import ModelUnavailable, PretrainedModel
from quantmla.placement import Placement


@dataclass
class EmbeddedModel(Placement):
    name: str = "smollm2_mla"
    model: str = "smollm2-mla"
    dtype: str = "auto"

    def _stored(self):
        from quantmla.models.build import stored_file

        try:
            return stored_file(self.model)
        except (ValueError, FileNotFoundError) as e:
            raise ModelUnavailable(f"model '{self.name}': {e}") from None

    def _header(self) -> tuple[int, int, bool]:
        """(d_c, d_R, whether K has a bias) from the stored file's header; checks the package is there."""
        from safetensors import safe_open

        from quantmla.data import DataUnavailable
        from quantmla.models import smollm2_mla as S

        path = self._stored()
        try:
            S.gguf_dir()
        except DataUnavailable as e:
            raise ModelUnavailable(f"model '{self.name}' is built from a package: {e}") from None
        with safe_open(str(path), "pt") as f:
            d_c = f.get_slice("layers.0.kv_a_layernorm.weight").get_shape()[0]
            rows = f.get_slice("layers.0.kv_a_proj_with_mqa.weight").get_shape()[0]
            bias = "layers.0.kv_a_proj_with_mqa.bias" in f.keys()
        return int(d_c), int(rows - d_c), bias

    def check(self) -> tuple[int, int]:
        d_c, d_r, _ = self._header()
        return d_c, d_r

    def folder(self):
        from quantmla.models.build import build

        self.check()
        return build(self.model)

    def hf_config(self):
        """The config the build will write, from the GGUF's metadata and the stored header (no build)."""
        from quantmla.models import smollm2_mla as S

        d_c, _, bias = self._header()
        return S.mla_config(S.source_config(), d_c, attention_bias=bias)

    def load(self, device: str = "auto"):
        placed = {f.name: getattr(self, f.name) for f in fields(Placement)}
        return PretrainedModel(name=self.name, path=str(self.folder()), dtype=self.dtype, **placed).load(device)
