"""The GPU-side scorer of ``quantmla.models.tooling.measure`` against lm-eval's own HFLM on the same requests."""

import pytest
import torch
from lm_eval.models.huggingface import HFLM

from quantmla.models.tiny import build
from quantmla.models.tooling.measure import score_ll

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)


def test_score_ll_matches_hflm():
    model, tok = build()
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(12):
        ctx = torch.randint(3, 259, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(1, 6, (1,), generator=g))
        if i % 2:  # the model's own greedy continuation: is_greedy must come out True
            with torch.no_grad():
                cont = model.generate(torch.tensor([ctx]), max_new_tokens=n, do_sample=False)[0, len(ctx) :].tolist()
        else:
            cont = torch.randint(3, 259, (n,), generator=g).tolist()
        reqs.append((ctx, cont))
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=4)._loglikelihood_tokens(
        [(("", ""), c, d) for c, d in reqs], disable_tqdm=True
    )
    ours = score_ll(model, reqs, torch.device("cpu"), batch_tokens=64)
    assert [r[1] for r in ours] == [r[1] for r in ref] and any(r[1] for r in ref)
    assert max(abs(a[0] - b[0]) for a, b in zip(ref, ours)) < 1e-4
