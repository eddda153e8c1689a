"""Few-shot prompt construction, left truncation, and batches padded to their own longest row."""

from __future__ import annotations

import random
import re

import pytest
from icl_fakes import task, word_tokenizer, write_jsonl

from foundryx.errors import DataError
from foundryx.eval.data import ICLCollator, prepare_task
from foundryx.eval.examples import read_examples
from foundryx.eval.prompts import fewshot_indices, render
from foundryx.eval.task_types import GenerationWithAnswers, LanguageModeling, MultipleChoice


def lm_rows(n: int) -> list[dict]:
    return [{"context": f"c{i}", "continuation": f"a{i}"} for i in range(n)]


def rendered(tmp_path, rows, cls=LanguageModeling, shots=0, **options):
    cfg = task(write_jsonl(tmp_path / "t.jsonl", rows), "x", **options)
    t = cls(cfg)
    return render(t, read_examples(cfg.dataset_uri, t), shots)


def test_prompt_string_delimiters_and_prelimiter(tmp_path):
    rows = [{"query": "q0", "choices": ["x", "y"], "gold": 1}, {"query": "q1", "choices": ["u", "v"], "gold": 0}]
    (r0, _) = rendered(tmp_path, rows, MultipleChoice, shots=1, prompt_string="Answer these.",
                       example_delimiter="\n\n", continuation_delimiter="\nA: ", prelimiter="Q: ")
    # the only other example is the few-shot one, with its gold answer
    assert r0.queries == (("Answer these.\n\nQ: q1\nA: u\n\nQ: q0\nA: ", "x"),
                          ("Answer these.\n\nQ: q1\nA: u\n\nQ: q0\nA: ", "y"))
    (z0, _) = rendered(tmp_path, rows, MultipleChoice, shots=0, prelimiter="Q: ")
    assert z0.queries[0] == ("Q: q0 ", "x")  # no delimiter before the first example


def test_fewshot_never_the_example_itself_and_fixed_by_seed(tmp_path):
    rows = lm_rows(12)
    for r in rendered(tmp_path, rows, shots=11):  # all the others, exactly
        shown = re.findall(r"c(\d+) a", r.queries[0][0])
        assert sorted(map(int, shown)) == sorted(set(range(12)) - {r.index})
    a = rendered(tmp_path, rows, shots=3)
    assert a == rendered(tmp_path, rows, shots=3)
    assert a != rendered(tmp_path, rows, shots=3, fewshot_random_seed=7)
    for r in a:
        shown = [int(i) for i in re.findall(r"c(\d+) a", r.queries[0][0])]
        assert len(set(shown)) == 3 and r.index not in shown


def test_fewshot_draw_is_llm_foundrys():
    # LLM Foundry's _get_fewshot_sample_idxs with random.Random(1234), called in file order
    rng = random.Random(1234)
    draws = [sorted(fewshot_indices(10, 3, i, rng)) for i in range(3)]
    ref = random.Random(1234)
    expected = []
    for i in range(3):
        picked = set(ref.sample(range(10), 3))
        if i in picked:
            picked.remove(i)
            extra = ref.choice(range(10))
            while extra in picked or extra == i:
                extra = ref.choice(range(10))
            picked.add(extra)
        expected.append(sorted(picked))
    assert draws == expected
    assert fewshot_indices(1, 5, 0, random.Random(0)) == []  # a one-example task: 0-shot


def test_fewshot_examples_come_from_the_same_category(tmp_path):
    rows = [{**r, "category": "even" if i % 2 == 0 else "odd"} for i, r in enumerate(lm_rows(10))]
    for r in rendered(tmp_path, rows, shots=3, has_categories=True):
        shown = [int(i) for i in re.findall(r"c(\d+) a", r.queries[0][0])]
        assert len(shown) == 3 and all(i % 2 == r.index % 2 for i in shown)


def test_generation_fewshot_shows_chain_of_thought(tmp_path):
    rows = [{"context": "q0", "chain_of_thought": "t0", "answer": "0"},
            {"context": "q1", "chain_of_thought": "t1", "answer": "1"}]
    (r0, _) = rendered(tmp_path, rows, GenerationWithAnswers, shots=1, cot_delimiter=" #### ",
                       continuation_delimiter="\nA: ", prelimiter="Q: ")
    assert r0.queries == (("Q: q1\nA: t1 #### 1\nQ: q0\nA: ", ""),)
    assert r0.answers == ("0",)


def test_left_truncation_keeps_the_continuation(tmp_path):
    words = [f"w{i}" for i in range(40)]
    tok = word_tokenizer(words)
    path = write_jsonl(tmp_path / "long.jsonl", [{"context": " ".join(words[:30]), "continuation": "w30 w31"}])
    (t,) = prepare_task(task(path, "language_modeling"), tok, max_seq_len=8)
    enc = t.examples[0].rows[0]
    assert len(enc.ids) == 8 and enc.truncated == 24
    assert tok.convert_ids_to_tokens(list(enc.ids)) == words[24:32]
    assert (enc.cont_start, enc.cont_end) == (6, 8)
    with pytest.raises(DataError, match=r"long\.jsonl:1: the continuation \(2 tokens\).*max_seq_len 2"):
        prepare_task(task(path, "language_modeling"), tok, max_seq_len=2)


def test_batches_are_padded_to_their_own_longest_row(tmp_path):
    tok = word_tokenizer([f"w{i}" for i in range(20)])
    rows = [{"query": "w1", "choices": ["w2", "w3 w4 w5"], "gold": 0},
            {"query": "w1 w2 w3 w4 w5 w6", "choices": ["w7", "w8"], "gold": 1}]
    (t,) = prepare_task(task(write_jsonl(tmp_path / "mc.jsonl", rows), "multiple_choice"), tok, 512)
    collate = ICLCollator(t, tok)
    short = collate([(t.examples[0], True)])
    assert short["input_ids"].shape == (2, 4)  # "w1 w3 w4 w5", not 512
    assert short["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    both = collate([(t.examples[0], True), (t.examples[1], False)])
    assert both["input_ids"].shape == (4, 7)
    assert both["primary"].tolist() == [True, True, False, False]
    assert both["cont_start"].tolist() == [1, 1, 6, 6] and both["cont_end"].tolist() == [2, 4, 7, 7]
