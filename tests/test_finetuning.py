"""The ``finetuning`` loader: formats, sources, loss masking, bad examples, batches."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from config_checks import section_problems

from foundryx import registry
from foundryx.data.finetuning.examples import IGNORE
from foundryx.data.finetuning.loader import (
    FinetuningDatasetOptions,
    build_finetuning_dataloader,
    load_examples,
)
from foundryx.errors import ConfigError, DataError

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"first answer {2 * i}"},
                  {"role": "user", "content": "And times two?"},
                  {"role": "assistant", "content": f"second answer {4 * i}"}]}
    for i in range(12)
]
PAIRS = [{"prompt": f"Name the number after {i}: ", "response": f"it is {i + 1}"} for i in range(12)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(path, **kw) -> FinetuningDatasetOptions:
    return FinetuningDatasetOptions(**{"path": str(path), "max_seq_len": 256, "shuffle": False,
                                       **kw})


def loader_problems(options: dict) -> list[str]:
    return section_problems("dataloaders", "finetuning", options)


def learned(tokenizer, ids, labels) -> str:
    """The text of the tokens that carry a loss."""
    return tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])


def test_registered_by_entry_point():
    assert registry.dataloaders.get("finetuning") is build_finetuning_dataloader
    assert registry.dataloaders.entry("finetuning").package == "foundryx"


@pytest.mark.parametrize("target_prompts", ["none", "all"])
def test_prompt_response_masking(tmp_path, tiny_tokenizer, target_prompts):
    src = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    [(ids, labels), *_] = load_examples(dataset(src, target_prompts=target_prompts), tiny_tokenizer)
    prompt = tiny_tokenizer(PAIRS[0]["prompt"])["input_ids"]
    response = tiny_tokenizer(PAIRS[0]["response"])["input_ids"]
    eos = tiny_tokenizer.eos_token_id
    assert ids == prompt + response + [eos]  # bos == eos here, so none is prepended
    if target_prompts == "none":
        assert labels == [IGNORE] * len(prompt) + response + [eos]
    else:
        assert labels == ids


@pytest.mark.parametrize(("target_prompts", "target_responses"),
                         [("none", "last"), ("none", "all"), ("all", "last"), ("all", "all")])
def test_chat_masking(tmp_path, tiny_tokenizer, caplog, target_prompts, target_responses):
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    with caplog.at_level(logging.INFO, logger="foundryx.data.finetuning.loader"):
        examples = load_examples(dataset(src, target_prompts=target_prompts,
                                         target_responses=target_responses), tiny_tokenizer)
    assert "no chat template; chat examples use the ChatML-style default" in caplog.text
    ids, labels = examples[3]
    text = tiny_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\nsecond answer 12<|im_end|>\n<|endoftext|>")
    target = learned(tiny_tokenizer, ids, labels)
    if target_prompts == "all":
        want = text if target_responses == "all" else text.replace("first answer 6<|im_end|>\n", "")
    else:
        last = "second answer 12<|im_end|>\n<|endoftext|>"
        want = ("first answer 6<|im_end|>\n" + last) if target_responses == "all" else last
    assert target == want


def test_tokenizer_chat_template_is_used(tmp_path, tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS[:1])
    [(ids, labels)] = load_examples(dataset(src), tok)
    assert tok.decode(ids).startswith("[system] Be brief.\n[user] What is 0 plus 0?\n")
    assert learned(tok, ids, labels) == "second answer 0\n<|endoftext|>"


def test_sources_give_the_same_examples(tmp_path, tiny_tokenizer):
    import datasets
    from streaming import MDSWriter

    rows = PAIRS + CHATS
    want = load_examples(dataset(write_jsonl(tmp_path / "x.jsonl", rows)), tiny_tokenizer)
    datasets.Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "hf_pairs"))
    assert load_examples(dataset(tmp_path / "hf_pairs"), tiny_tokenizer) == want[:12]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS)}).save_to_disk(
        str(tmp_path / "hf_chat"))
    assert load_examples(dataset(tmp_path / "hf_chat", split="train"), tiny_tokenizer) == want[12:]
    with MDSWriter(out=str(tmp_path / "mds" / "train"), columns={"messages": "json"}) as w:
        for row in CHATS:
            w.write(row)
    assert load_examples(dataset(tmp_path / "mds", split="train"), tiny_tokenizer) == want[12:]


BAD = [
    ('{"prompt": "a", "answer": "b"}', r":2: expected 'prompt' and 'response', or 'messages' "
                                       r"\(found: 'prompt', 'answer'\)"),
    ('{"prompt": 3, "response": "b"}', r":2: 'prompt' must be a string, got int"),
    ('{"prompt": "a", "response": " "}', r":2: 'response' is empty"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r":2: messages\[0\].role must be one of"),
    ('{"messages": [{"role": "user", "content": "x"}]}', r":2: the last message must be from "
                                                         r"the assistant"),
    ('{"messages": "hi"}', r":2: 'messages' must be a non-empty list"),
    ('{"prompt": "' + "word " * 200 + '", "response": "b"}', r":2: \d+ tokens, longer than "
                                                             r"max_seq_len 256"),
    ('{"prompt": "a", oops}', r":2: not valid JSON"),
]


@pytest.mark.parametrize(("line", "message"), BAD)
def test_bad_example_names_file_line_and_problem(tmp_path, tiny_tokenizer, line, message):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n" + json.dumps(PAIRS[1]) + "\n")
    with pytest.raises(DataError, match=f"{src}{message}"):
        load_examples(dataset(src), tiny_tokenizer)


def test_skip_bad_examples_counts_them(tmp_path, tiny_tokenizer, caplog):
    src = tmp_path / "mixed.jsonl"
    lines = [json.dumps(p) for p in PAIRS[:5]] + [line for line, _ in BAD[:4]]
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="set skip_bad_examples: true"):
        load_examples(dataset(src), tiny_tokenizer)
    with caplog.at_level(logging.WARNING, logger="foundryx.data.finetuning.loader"):
        examples = load_examples(dataset(src, skip_bad_examples=True), tiny_tokenizer)
    assert len(examples) == 5
    assert f"skipped 4 bad example(s) of 9 in {src}; the first: {src}:6:" in caplog.text


def test_batches_pad_and_mask(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "mixed.jsonl", PAIRS + CHATS)
    cfg = {"dataset": {"path": str(src), "max_seq_len": 256, "shuffle": False},
           "drop_last": False}
    assert loader_problems(cfg) == []
    spec = build_finetuning_dataloader(cfg, tiny_tokenizer, 8)
    examples = load_examples(dataset(src), tiny_tokenizer)
    rows = 0
    for batch in spec.dataloader:
        assert set(batch) == {"input_ids", "labels", "attention_mask"}
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            n = int(mask.sum())
            assert bool((mask[:n] == 1).all()) and bool((labels[n:] == IGNORE).all())
            assert (ids[:n].tolist(), labels[:n].tolist()) == examples[rows]
            rows += 1
        assert spec.get_num_tokens_in_batch(batch) == int(batch["attention_mask"].sum())
    assert rows == len(examples) == 24


def test_config_problems(tmp_path):
    cfg = {"drop_lst": True,
           "dataset": {"path": str(tmp_path / "none.jsonl"), "max_seq_len": 0,
                       "target_prompts": "some", "target_responses": "first",
                       "packing_ratio": 0.5, "shufle": True}}
    problems = loader_problems(cfg)
    assert any(p.startswith("drop_lst: unknown option of the 'finetuning' dataloader")
               for p in problems)
    assert any(p.startswith("dataset.shufle: unknown option") and "shuffle" in p for p in problems)
    assert "dataset.max_seq_len: expected an integer > 0, got 0" in problems
    assert "dataset.target_prompts: expected one of 'none', 'all', got 'some'" in problems
    assert "dataset.target_responses: expected one of 'last', 'all', got 'first'" in problems
    assert "dataset.packing_ratio: expected a number >= 1, got 0.5" in problems
    assert any(p.startswith(f"dataset.path: {tmp_path / 'none.jsonl'} does not exist")
               for p in problems)
    with pytest.raises(ConfigError, match="'finetuning' dataloader"):
        build_finetuning_dataloader(cfg, None, 4)
    assert loader_problems({})[0].startswith("dataset: missing")
    assert torch  # the loader's batches are torch tensors (checked above)
