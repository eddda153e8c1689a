"""Synthetic corpus, tokenizers and the quickstart data preparation."""

from __future__ import annotations

import json
import time

import pytest
from config_checks import section_problems

from foundryx.config.components import build_component
from foundryx.data import quickstart
from foundryx.data.convert import MANIFEST
from foundryx.data.quickstart import prepare_quickstart
from foundryx.data.synthetic import build_world, generate_corpus, world_facts
from foundryx.data.tokenizers import END_OF_TEXT, build_hf_tokenizer, train_bpe_tokenizer
from foundryx.errors import DataError

SMALL = {"n_docs": 300, "vocab_size": 300, "max_seq_len": 32, "progress": False}


def test_corpus_is_deterministic_per_seed():
    docs = generate_corpus(200, seed=7)
    assert docs == generate_corpus(200, seed=7)
    assert docs != generate_corpus(200, seed=8)
    assert generate_corpus(50, seed=7) == docs[:50]
    assert all(doc.strip() and "\n" not in doc and doc.endswith(".") for doc in docs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_world_names_are_distinct(seed):
    world = build_world(seed)
    names = [c.name for c in world.countries] + [c.capital for c in world.countries]
    names += [c.river for c in world.countries] + [p.name for p in world.people]
    assert len(set(names)) == len(names)


def test_world_facts_are_stated_in_the_corpus():
    facts = world_facts(0)
    assert facts == world_facts(0) and facts != world_facts(1)
    assert all(answer.startswith(" ") and not context.endswith(" ") for context, answer in facts)
    text = " ".join(generate_corpus(4000, seed=0))
    missing = [c + a for c, a in facts if c + a + "." not in text]
    assert not missing, missing[:5]


def test_trained_tokenizer_loads_offline(tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path)
    assert len(tok) == len(tiny_tokenizer) == 400
    assert tok.eos_token == tok.bos_token == tok.pad_token == END_OF_TEXT
    text = "The capital of Veloria is Quenport. 7 plus 5 is 12."
    ids = tok(text)["input_ids"]
    assert ids == tiny_tokenizer(text)["input_ids"] and tok.eos_token_id not in ids
    assert tok.decode(ids) == text


def test_vocab_size_too_small(tmp_path):
    with pytest.raises(DataError, match="vocab_size=200 is too small"):
        train_bpe_tokenizer(["some text"], 200, tmp_path)


def test_build_hf_tokenizer(tiny_tokenizer):
    tok = build_hf_tokenizer(tiny_tokenizer.name_or_path, model_max_length=77)
    assert tok.model_max_length == 77
    assert tok.pad_token_id == tok.eos_token_id
    section = {"path": tiny_tokenizer.name_or_path, "model_max_length": 55}
    assert section_problems("tokenizers", "hf", section) == []
    assert build_component("tokenizers", {"name": "hf", **section}).model_max_length == 55


def test_build_hf_tokenizer_sets_missing_pad(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").unlink(missing_ok=True)  # transformers 5 writes none
    assert build_hf_tokenizer(str(tmp_path)).pad_token == END_OF_TEXT


def test_build_hf_tokenizer_errors(tmp_path):
    missing = str(tmp_path / "no" / "tokenizer")
    with pytest.raises(DataError, match="does not exist.*a local folder with tokenizer files"):
        build_hf_tokenizer(missing)
    [problem] = section_problems("tokenizers", "hf", {"path": missing})
    assert problem.startswith(f"path: tokenizer folder {missing} does not exist")
    assert section_problems("tokenizers", "hf", {})[0].startswith("path: missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="could not load tokenizer .* as a local folder"):
        build_hf_tokenizer(str(tmp_path / "empty"))


def test_prepare_quickstart_layout_and_idempotence(tmp_path, monkeypatch):
    out = prepare_quickstart(tmp_path / "qs", **SMALL)
    assert out == tmp_path / "qs"
    for path in ["corpus/train.txt", "corpus/val.txt", "tokenizer/tokenizer.json",
                 f"mds/train/{MANIFEST}", f"mds/val/{MANIFEST}", "mds/train/index.json",
                 quickstart.STAMP]:
        assert (out / path).is_file(), path
    manifest = json.loads((out / "mds" / "train" / MANIFEST).read_text())
    assert manifest["max_seq_len"] == 32 and manifest["documents"] == 285
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a complete quickstart folder")

    monkeypatch.setattr(quickstart, "convert_to_mds", fail)
    monkeypatch.setattr(quickstart, "train_bpe_tokenizer", fail)
    start = time.perf_counter()
    prepare_quickstart(out, **SMALL)
    assert time.perf_counter() - start < 0.5
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes
    with pytest.raises(AssertionError, match="rebuilt"):
        prepare_quickstart(out, **SMALL, force=True)
    with pytest.raises(AssertionError, match="rebuilt"):
        prepare_quickstart(out, **{**SMALL, "seed": 1})
    monkeypatch.undo()
    prepare_quickstart(out, **{**SMALL, "max_seq_len": 16})
    assert json.loads((out / "mds" / "val" / MANIFEST).read_text())["max_seq_len"] == 16


def test_incomplete_quickstart_is_rebuilt(tmp_path):
    out = prepare_quickstart(tmp_path / "qs", **SMALL)
    (out / "mds" / "val" / MANIFEST).unlink()
    prepare_quickstart(out, **SMALL)
    assert (out / "mds" / "val" / MANIFEST).is_file()


def test_default_quickstart_has_data_for_300_steps(quickstart_data):
    """The shared session fixture: batch 16 x 128 tokens for 300 steps within one epoch."""
    train = json.loads((quickstart_data / "mds" / "train" / MANIFEST).read_text())
    val = json.loads((quickstart_data / "mds" / "val" / MANIFEST).read_text())
    assert train["max_seq_len"] == 128 and train["sequences"] >= 300 * 16
    assert val["sequences"] >= 4 * 16 * 2  # eval_subset_num_batches=4 on each of 2 ranks
    assert train["tokenizer"]["vocab_size"] <= 2048  # fits the quickstart model's vocab_size
