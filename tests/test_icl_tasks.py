"""Each ICL task type on hand-made files, scored by a model whose probabilities are set by hand."""

from __future__ import annotations

import math

import pytest
from icl_fakes import FakeLM, run, task, write_jsonl

from foundryx.eval.data import prepare_task
from foundryx.eval.metrics import clean_output, normalize_answer

WORDS = "q a b c d x y z w m n k Question: ans paris london stop because #### 42 so".split()


@pytest.fixture
def fake() -> FakeLM:
    return FakeLM(WORDS)


def test_multiple_choice_picks_lowest_mean_loss_not_sum(fake, tmp_path):
    # choice 0: one token, p=0.1 (mean 2.30, sum 2.30); choice 1: three tokens, p=0.3 each
    # (mean 1.20, sum 3.61). The mean picks choice 1.
    fake.set("q", {"a": 0.1, "b": 0.3})
    fake.set("b", {"c": 0.3})
    fake.set("c", {"d": 0.3})
    rows = [{"query": "q", "choices": ["a", "b c d"], "gold": 1},
            {"query": "q", "choices": ["b c d", "a"], "gold": 1}]
    (res,) = run(fake.model, fake.tokenizer, task(write_jsonl(tmp_path / "mc.jsonl", rows),
                                                   "multiple_choice"), dump=2)
    assert res.outcomes == {0: True, 1: False}
    assert res.score == 0.5
    first = res.dumped[0]["rows"]
    assert [r["tokens"] for r in first] == [1, 3]
    assert first[0]["loss"] == pytest.approx(-math.log(0.1), abs=1e-5)
    assert first[1]["loss"] == pytest.approx(-math.log(0.3), abs=1e-5)
    assert res.dumped[0]["chosen"] == 1 and res.dumped[1]["chosen"] == 0


def test_language_modeling_needs_every_token_to_be_the_argmax(fake, tmp_path):
    fake.set("y", {"z": 0.6})
    fake.set("z", {"w": 0.6})
    fake.set("k", {"z": 0.6})
    fake.set("m", {"w": 0.1, "n": 0.5})
    rows = [{"context": "x y", "continuation": "z w"},   # both argmax: correct
            {"context": "x y", "continuation": "w w"},   # first token wrong
            {"context": "x m", "continuation": "w"},     # w is not m's argmax (n is)
            {"context": "x k", "continuation": "z w"}]   # correct
    (res,) = run(fake.model, fake.tokenizer, task(write_jsonl(tmp_path / "lm.jsonl", rows),
                                                   "language_modeling"), dump=4)
    assert res.outcomes == {0: True, 1: False, 2: False, 3: True}
    assert res.score == 0.5
    assert res.dumped[0]["rows"][0]["predicted_tokens"] == ["z", "w"]


def test_schema_scores_the_continuation_under_each_context(fake, tmp_path):
    fake.set("m", {"z": 0.5})
    fake.set("n", {"z": 0.1})
    rows = [{"context_options": ["x m", "x n"], "continuation": "z w", "gold": 0},
            {"context_options": ["x n", "x m"], "continuation": "z w", "gold": 0}]
    (res,) = run(fake.model, fake.tokenizer, task(write_jsonl(tmp_path / "s.jsonl", rows), "schema"),
                 dump=1)
    assert res.outcomes == {0: True, 1: False}
    rows0 = res.dumped[0]["rows"]
    assert [r["context"] for r in rows0] == ["x m", "x n"]
    assert all(r["scored_tokens"] == ["z", "w"] for r in rows0)


def test_generation_stops_normalises_and_matches_aliases(fake, tmp_path):
    fake.chain("ans", "paris", "stop", "london", "london")
    rows = [{"context": "Question: q ans", "answer": "Paris", "aliases": ["City of Light"]},
            {"context": "Question: q ans", "answer": "London"},
            {"context": "Question: q ans", "answer": "a", "aliases": ["the Paris!"]}]
    path = write_jsonl(tmp_path / "gen.jsonl", rows)
    gen = dict(stop_sequences=["stop"], max_new_tokens=4, continuation_delimiter="")
    (res,) = run(fake.model, fake.tokenizer, task(path, "generation_task_with_answers", **gen), dump=3)
    # "paris stop london london" is cut at "stop"; it does not continue into "london"
    assert res.outcomes == {0: True, 1: False, 2: True}
    assert res.dumped[0]["cleaned"] == "paris"
    (raw,) = run(fake.model, fake.tokenizer, task(path, "generation_task_with_answers",
                                                  do_normalization=False, **gen))
    assert raw.outcomes == {0: False, 1: False, 2: False}  # "paris" does not start with "Paris"
    (nostop,) = run(fake.model, fake.tokenizer, task(path, "generation_task_with_answers",
                                                     max_new_tokens=4, continuation_delimiter=""))
    assert nostop.outcomes == {0: True, 1: False, 2: True}  # still starts with "paris"


def test_generation_chain_of_thought_answer_after_the_delimiter(fake, tmp_path):
    fake.chain("ans", "because", "so", "####", "42", "stop")
    path = write_jsonl(tmp_path / "cot.jsonl", [
        {"context": "q ans", "chain_of_thought": "because so", "answer": "42"},
        {"context": "q ans", "chain_of_thought": "because", "answer": "so"}])
    cfg = task(path, "generation_task_with_answers", cot_delimiter=" #### ", stop_sequences=["stop"],
               do_normalization=False, continuation_delimiter="", num_fewshot=0)
    (res,) = run(fake.model, fake.tokenizer, cfg, dump=2)
    assert res.outcomes == {0: True, 1: False}
    # LLM Foundry's rule: the longest answer text "because so #### 42" (4 tokens) + 10, so the
    # generation runs on to the stop sequence
    assert prepare_task(cfg, fake.tokenizer, 64)[0].max_new_tokens == 14
    assert res.dumped[0]["output"].split() == ["because", "so", "####", "42", "stop"]


def test_categories_give_one_score_each_and_their_mean(fake, tmp_path):
    fake.set("y", {"z": 0.9})
    rows = [{"context": "x y", "continuation": "z", "category": "c1"},
            {"context": "x y", "continuation": "z", "category": "c2"},
            {"context": "x y", "continuation": "w", "category": "c2"},
            {"context": "x y", "continuation": "w", "category": "c2"}]
    (res,) = run(fake.model, fake.tokenizer, task(write_jsonl(tmp_path / "cat.jsonl", rows),
                                                   "language_modeling", has_categories=True))
    assert res.categories == {"c1": 1.0, "c2": pytest.approx(1 / 3)}
    assert res.score == pytest.approx((1 + 1 / 3) / 2)  # the mean of the categories


def test_answer_cleaning():
    opts = {"stop_sequences": ["\n"], "cot_delimiter": "", "do_normalization": True}
    assert clean_output(" The Eiffel-Tower!\nQuestion: x", opts) == "eiffel tower"
    assert normalize_answer("An   apple_pie, the END") == "apple pie end"
    assert clean_output(" A. B", {**opts, "do_normalization": False}) == "A. B"
