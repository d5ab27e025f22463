"""Latent channels whose norm weight Γ is zero (a norm-steadying group, as in the embedded
smollm2_mla model) stay out of every content transform: fusion stays exact, they stay cached
as zero, and no rotation spends quantization range on them."""

from __future__ import annotations

import pytest
import torch
from mla_fixtures import installed, set_spec, small_calibration

from baselines.quarot import QuaRotConfig
from baselines.smoothquant import SmoothQuantConfig
from quantmla import methods, mla
from quantmla.cache import CacheSpec
from quantmla.methods import MethodContext
from quantmla.methods.quantmla import QuantMLAConfig
from quantmla.transforms import fuse_content, hadamard

DEAD = slice(64, 128)  # the second 64-channel group of tiny's 128-channel latent


def dead_group_model():
    """tiny with a dead latent group: Γ = 0 and zero consumer columns, and producer rows that give
    that group most of the weightless latent's energy (like a constant norm channel)."""
    model, tok, layers = installed("tiny")
    with torch.no_grad():
        for layer in layers:
            layer.kv_a_layernorm.weight[DEAD] = 0.0
            layer.kv_b_proj.weight[:, DEAD] = 0.0
            layer.kv_a_proj_with_mqa.weight[DEAD] *= 20.0
    return model, tok, layers


def _apply(model, tok, cfg, tmp_path):
    m = methods.get(cfg)
    ctx = MethodContext(
        spec=CacheSpec.parse("c4r4"),
        tokenizer=tok,
        calibration=small_calibration(seq_len=64, train=4, heldout=4),
        cache_dir=tmp_path,
        progress=False,
    )
    return m.apply(model, mla.adapters(model), ctx)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    [SmoothQuantConfig(), QuaRotConfig(), QuantMLAConfig(steps=4, val_every=2, lr_rotation=0.3, select="last")],
    ids=lambda c: c.name,
)
def test_dead_channels_stay_dead_and_fusion_stays_exact(cfg, tmp_path):
    model, tok, layers = dead_group_model()
    ids = torch.randint(3, 259, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        c_pre, _ = layers[0].mla.latent_pre(x)
    # the dead group dominates the weightless latent, as in smollm2_mla
    assert c_pre[..., DEAD].pow(2).sum() > 0.9 * c_pre.pow(2).sum()
    _apply(model, tok, cfg, tmp_path)
    set_spec(layers, CacheSpec())
    captured = {}
    with torch.no_grad():
        out = model(ids, use_cache=False).logits
        for layer in layers:
            assert (layer.kv_a_layernorm.weight[DEAD] == 0).all()
            c_pre, _ = layer.mla.latent_pre(torch.randn(1, 5, layer.mla.dims.d_model))
            captured[layer.layer_idx] = layer.mla.content(c_pre)
    assert (out - ref).abs().max() <= 1e-4
    assert all((C[..., DEAD] == 0).all() for C in captured.values())  # cached as zero


def test_a_rotation_mixing_dead_and_live_channels_is_refused():
    _, _, layers = dead_group_model()
    with pytest.raises(ValueError, match="may not mix latent channels whose norm weight is zero"):
        fuse_content(layers[0].mla, hadamard(128))
