"""`scoring: lm_eval`: lm-eval-harness's prompts, few-shot draw, acc and acc_norm, checked on
examples computed by hand (benchmarks/eval_vs_lmeval.py compares with the real lm_eval)."""

from __future__ import annotations

import math
import random

import pytest
from icl_fakes import FakeLM, run, write_jsonl

from foundryx.errors import ConfigError
from foundryx.eval.data import prepare_task
from foundryx.eval.task_config import load_icl_tasks

WORDS = "q a b c x m n s t Answer:".split()


def _task(path, **options):
    entry = {"label": "mc", "dataset_uri": str(path), "icl_task_type": "multiple_choice",
             "scoring": "lm_eval", **options}
    return load_icl_tasks([entry])[0]


@pytest.fixture
def two_questions(tmp_path):
    """q: "a" has p 0.2, "b c" has p 0.3 * 0.4, so sums -1.609 vs -2.120 (a wins acc) but per
    character -1.609 / 1 vs -2.120 / 3 = -0.707 ("b c" wins acc_norm, and is gold).
    x: "m" has p 0.6, "n" 0.1: "m" (gold) wins both."""
    fake = FakeLM(WORDS)
    fake.set("q", {"a": 0.2, "b": 0.3})
    fake.set("b", {"c": 0.4})
    fake.set("x", {"m": 0.6, "n": 0.1})
    path = write_jsonl(tmp_path / "mc.jsonl", [{"query": "q", "choices": ["a", "b c"], "gold": 1},
                                               {"query": "x", "choices": ["m", "n"], "gold": 0}])
    return fake, path


def test_acc_and_acc_norm_of_two_questions_by_hand(two_questions):
    fake, path = two_questions
    (res,) = run(fake.model, fake.tokenizer, _task(path), dump=2)
    assert res.score == 0.5  # acc: q wrong ("a" has the higher sum), x right
    assert res.metrics == {"acc_norm": 1.0}  # per character "b c" wins q; x right
    assert res.outcomes == {0: False, 1: True}
    q, x = res.dumped
    assert [r["loglik"] for r in q["rows"]] == pytest.approx(
        [math.log(0.2), math.log(0.3) + math.log(0.4)], abs=1e-5)
    assert [r["loglik"] for r in x["rows"]] == pytest.approx([math.log(0.6), math.log(0.1)], abs=1e-5)
    assert q["chosen"] == 0 and x["chosen"] == 0
    assert [r["continuation"] for r in q["rows"]] == [" a", " b c"]
    # LLM Foundry's scoring (lowest mean loss per token) picks "b c" for q: both right
    (foundry,) = run(fake.model, fake.tokenizer, _task(path, scoring="llmfoundry"))
    assert foundry.score == 1.0 and foundry.metrics == {}


def test_prompts_and_fewshot_draw_are_lm_evals(tmp_path):
    """Text: prelimiter + query + continuation_delimiter, right-stripped, read unstripped from
    the file; a few-shot example is its text, " ", its answer, "\\n\\n"; the draw samples
    num_fewshot + 1 documents with one Random(seed) per task and drops the example itself."""
    rows = [{"query": f"q{i} ", "choices": [f"a{i}", f"b{i}"], "gold": i % 2} for i in range(6)]
    path = write_jsonl(tmp_path / "mc.jsonl", rows)
    fake = FakeLM(WORDS)
    cfg = _task(path, num_fewshot=2, continuation_delimiter="\nAnswer: ", fewshot_random_seed=7)
    (task,) = prepare_task(cfg, fake.tokenizer, 64)
    rng = random.Random(7)
    for i, ex in enumerate(task.examples):
        shots = [j for j in rng.sample(range(6), 3) if j != i][:2]
        before = "".join(f"q{j} \nAnswer: {rows[j]['choices'][j % 2]}\n\n" for j in shots)
        assert ex.rendered.queries == ((before + f"q{i} \nAnswer:", f" a{i}"),
                                       (before + f"q{i} \nAnswer:", f" b{i}"))
        assert ex.rendered.norm_lengths == (2, 2)


def test_schema_in_lm_eval_form(tmp_path):
    """One context per option, the continuation after each; acc_norm divides by the options'
    lengths, as lm-eval-harness's multiple-input tasks do."""
    fake = FakeLM(WORDS)
    fake.set("m", {"s": 0.5})
    fake.set("n", {"s": 0.1})
    path = write_jsonl(tmp_path / "s.jsonl", [
        {"context_options": ["x m", "x n"], "continuation": "s t", "gold": 0},
        {"context_options": ["x n", "x m"], "continuation": "s t", "gold": 0}])
    cfg = load_icl_tasks([{"label": "s", "dataset_uri": str(path), "icl_task_type": "schema",
                           "scoring": "lm_eval", "num_fewshot": 1}])[0]
    (task,) = prepare_task(cfg, fake.tokenizer, 64)
    assert task.examples[0].rendered.queries == (("x n s t\n\nx m", " s t"), ("x n s t\n\nx n", " s t"))
    (res,) = run(fake.model, fake.tokenizer, cfg)
    assert res.outcomes == {0: True, 1: False} and res.score == 0.5


@pytest.mark.parametrize(("options", "message"), [
    ({"icl_task_type": "generation_task_with_answers"},
     r"icl_tasks\[0\]\.scoring: lm_eval is for multiple-choice tasks \(multiple_choice, schema\); "
     r"'t' is a generation_task_with_answers task"),
    ({"icl_task_type": "language_modeling"}, r"lm_eval is for multiple-choice tasks"),
    ({"icl_task_type": "multiple_choice", "has_categories": True},
     r"lm_eval scores a task as one .* set has_categories: false"),
    ({"icl_task_type": "multiple_choice", "scoring": "lm-eval"},
     r"scoring: expected one of 'llmfoundry', 'lm_eval', got 'lm-eval'"),
])
def test_lm_eval_scoring_where_it_does_not_apply(options, message):
    with pytest.raises(ConfigError, match=message):
        load_icl_tasks([{"label": "t", "dataset_uri": "t.jsonl", "scoring": "lm_eval", **options}])
