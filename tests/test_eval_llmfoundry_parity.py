"""foundryx's eval YAMLs are LLM Foundry's gauntlet v0.3, field by field, and generation tasks
generate as many tokens as LLM Foundry's rule gives.

LLM Foundry's own files are stored under tests/data/llmfoundry (Apache 2.0, see their headers)
and loaded through foundryx's task loader, which reads LLM Foundry's option names; so a
default that differs, or an option one side sets and the other does not, is a difference.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from icl_fakes import FakeLM, write_jsonl

from foundryx.errors import ConfigError
from foundryx.eval.data import generation_length, prepare_task, read_task
from foundryx.eval.task_config import load_icl_tasks

ROOT = Path(__file__).parents[1]
LLMF = ROOT / "tests" / "data" / "llmfoundry"
LLMF_PREFIX = "eval/local_data/"  # LLM Foundry's dataset_uri paths start with it


def _tasks(path: Path) -> dict[str, dict]:
    """label -> every field of the loaded task, dataset_uri relative to the data folder."""
    out = {}
    root = yaml.safe_load(path.read_text()).get("data_root")
    for t in load_icl_tasks(str(path)):
        fields = dataclasses.asdict(t)
        fields["dataset_uri"] = fields["dataset_uri"].removeprefix(f"{root}/" if root else LLMF_PREFIX)
        out[t.label] = fields
    return out


def _differences(ours: dict, theirs: dict) -> list[str]:
    return [f"{k}: ours {ours[k]!r}, LLM Foundry {theirs[k]!r}" for k in ours if ours[k] != theirs[k]]


def _gauntlet(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["eval_gauntlet"]


def test_tasks_v0_3_is_llmfoundrys_task_for_task():
    ours, theirs = _tasks(ROOT / "eval/yamls/tasks_v0.3.yaml"), _tasks(LLMF / "tasks_v0.3.yaml")
    assert list(ours) == list(theirs)  # the same tasks, in the same order
    problems = {label: d for label in ours if (d := _differences(ours[label], theirs[label]))}
    assert not problems, problems
    gsm8k = ours["gsm8k"]  # LLM Foundry's names were read: early_stopping_criteria, question_prelimiter
    assert gsm8k["stop_sequences"] == ["\n\n", "Question:"] and ours["svamp"]["prelimiter"] == "Question: "


def test_gauntlet_v0_3_is_llmfoundrys():
    assert _gauntlet(ROOT / "eval/yamls/gauntlet_v0.3.yaml") == _gauntlet(LLMF / "eval_gauntlet_v0.3.yaml")


# tasks.yaml: v0.3's tasks on the files of ../shared/eval_data, with these documented exceptions
RENAMED = {"triviaqa": "triviaqa_sm_sub"}  # our label -> v0.3's
OTHER_FILES = {"jeopardy": "world_knowledge/jeopardy_small.jsonl",
               "triviaqa": "world_knowledge/triviaqa_small.jsonl"}


def test_quick_suite_is_v0_3_on_the_shared_files():
    ours = _tasks(ROOT / "eval/yamls/tasks.yaml")
    v3, v2 = _tasks(LLMF / "tasks_v0.3.yaml"), _tasks(LLMF / "tasks_v0.2.yaml")
    for label, fields in ours.items():
        ref = dict(v2["gsm8k"] if label == "gsm8k" else v3[RENAMED.get(label, label)], label=label)
        if label in OTHER_FILES:
            ref["dataset_uri"] = OTHER_FILES[label]
        assert not _differences(fields, ref), (label, _differences(fields, ref))
    shared = {label for label, t in v3.items()
              if (ROOT.parent / "shared/eval_data" / t["dataset_uri"]).is_file()}
    if shared:  # every v0.3 task whose file is there is in the suite
        assert shared <= set(ours)
    # its gauntlet: v0.3's, restricted to these tasks (gsm8k at v0.2's 8 shots)
    g, g3 = _gauntlet(ROOT / "eval/yamls/gauntlet.yaml"), _gauntlet(LLMF / "eval_gauntlet_v0.3.yaml")
    assert {k: v for k, v in g.items() if k != "categories"} == {
        k: v for k, v in g3.items() if k != "categories"}
    keep = {RENAMED.get(t, t) for t in ours}
    expected = [{"name": c["name"], "benchmarks": [
        dict(b, name={v: k for k, v in RENAMED.items()}.get(b["name"], b["name"]),
             num_fewshot=8 if b["name"] == "gsm8k" else b["num_fewshot"])
        for b in c["benchmarks"] if b["name"] in keep]} for c in g3["categories"]]
    assert g["categories"] == expected


def test_llmfoundry_and_foundryx_names_of_one_option_together_are_an_error(tmp_path):
    entry = {"label": "t", "dataset_uri": "t.jsonl", "icl_task_type": "generation_task_with_answers",
             "early_stopping_criteria": ["\n"], "stop_sequences": ["\n"]}
    with pytest.raises(ConfigError, match=r"icl_tasks\[0\]\.early_stopping_criteria: LLM Foundry's "
                                          r"name for stop_sequences, which is set too"):
        load_icl_tasks([entry])


# ---- the generation length: LLM Foundry's _get_max_answer_length, transcribed -----------------

def llmfoundry_max_answer_length(rows: list[dict], tokenizer, cot_delimiter: str) -> int:
    """LLM Foundry 0.22's rule, written out from its InContextLearningGenerationTaskWithAnswers-
    Dataset: has_cot when the file has chain_of_thought; each answer and alias, after the
    chain of thought and delimiter, tokenized alone (the tokenizer's special tokens, no leading
    space); the longest, + 10 when cot_delimiter is set; max_new_tokens is at least 1."""
    has_cot = any("chain_of_thought" in r for r in rows)
    longest = 0
    for r in rows:
        r = {k: v.strip() if isinstance(v, str) else v for k, v in r.items()}  # strip_dataset
        for answer in {r["answer"], *r.get("aliases", [])}:
            response = f"{r['chain_of_thought']}{cot_delimiter}{answer}" if has_cot else answer
            longest = max(longest, len(tokenizer(response)["input_ids"]))
    return max(longest + (10 if cot_delimiter else 0), 1)


def _bos_tokenizer(tiny_tokenizer):
    """The tiny BPE with a BOS token added to every text (as Llama's tokenizers do)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("a b")["input_ids"][0] == tok.bos_token_id
    return tok


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_generation_length_is_llmfoundrys_rule(tmp_path, tiny_tokenizer, bos):
    tokenizer = _bos_tokenizer(tiny_tokenizer) if bos else tiny_tokenizer
    rows = [{"context": "Q: two and two?", "chain_of_thought": " two and two make four ",
             "answer": "4", "aliases": ["four", "the number four"]},
            {"context": "Q: one and one?", "chain_of_thought": "one more", "answer": "2"}]
    path = write_jsonl(tmp_path / "cot.jsonl", rows)
    for delimiter in (" #### ", ""):
        cfg = load_icl_tasks([{"label": "cot", "dataset_uri": str(path), "num_fewshot": [0, 1],
                               "icl_task_type": "generation_task_with_answers",
                               "cot_delimiter": delimiter}])[0]
        expected = llmfoundry_max_answer_length(rows, tokenizer, delimiter)
        assert generation_length(cfg, tokenizer, read_task(cfg)) == expected
        assert {p.max_new_tokens for p in prepare_task(cfg, tokenizer, 512)} == {expected}
        if delimiter:  # the leading space is not counted, the special tokens are
            answer = "two and two make four #### the number four"
            assert expected == len(tokenizer(answer)["input_ids"]) + 10


@pytest.mark.needs_shared
def test_generation_length_of_the_shared_tasks(shared_dir, tiny_tokenizer):
    import json

    for cfg in load_icl_tasks(str(ROOT / "eval/yamls/tasks.yaml"), str(shared_dir / "eval_data")):
        if cfg.icl_task_type != "generation_task_with_answers":
            continue
        rows = [json.loads(line) for line in Path(cfg.dataset_uri).read_text().splitlines() if line]
        assert generation_length(cfg, tiny_tokenizer, read_task(cfg)) == \
            llmfoundry_max_answer_length(rows, tiny_tokenizer, cfg.cot_delimiter), cfg.label


def test_a_fewshot_answer_carries_the_chain_of_thought_without_a_delimiter(tmp_path):
    """LLM Foundry's has_cot: a file with chain_of_thought shows it in few-shot answers."""
    fake = FakeLM("q ans because so 42 2".split())
    path = write_jsonl(tmp_path / "cot.jsonl", [
        {"context": "q", "chain_of_thought": "because", "answer": "42"},
        {"context": "q", "chain_of_thought": "so", "answer": "2"}])
    cfg = load_icl_tasks([{"label": "cot", "dataset_uri": str(path), "num_fewshot": 1,
                           "icl_task_type": "generation_task_with_answers"}])[0]
    (task,) = prepare_task(cfg, fake.tokenizer, 64)
    assert task.examples[0].rendered.queries[0][0] == "q so2\nq "
    assert task.max_new_tokens == 1  # "because42" and "so2": one word each, no buffer
