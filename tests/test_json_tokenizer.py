"""JsonTokenizer gives what AutoTokenizer gives on the folders it accepts (every call the ICL
eval makes: ids, offsets, special-token masks, decoding, special tokens), on this leg's
transformers; and it refuses the folders where transformers would apply rules of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from foundryx.data.json_tokenizer import JsonTokenizer, json_tokenizer_problem
from foundryx.runtime.hf_compat import portable_tokenizer_config

TEXTS = [
    "The king of the north is here.", " leading space", "two  spaces", "Q: what is 2+2?\nA: 4",
    "unicode: café ‘quote’ — ñ 東京", "trailing space ", "<|endoftext|> inside text", "",
    "isn't it? they're here , aren't they !", "tabs\tand\nnewlines\n\n", "<s> and </s>",
]


def _save(tok: Tokenizer, out: Path, **special) -> Path:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.save_pretrained(str(out))
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps(portable_tokenizer_config(json.loads(config.read_text()))))
    return out


def byte_level(out: Path) -> Path:
    """A GPT-2 style byte-level BPE (one <|endoftext|> special token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return _save(tok, out, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def llama_style(out: Path) -> Path:
    """A SentencePiece-style BPE (Metaspace) whose post-processor adds <s> before each text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return _save(tok, out, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["byte_level", "llama_style"])
def folder(request, tmp_path) -> Path:
    return llama_style(tmp_path) if request.param == "llama_style" else byte_level(tmp_path)


def test_every_call_matches_auto_tokenizer(folder):
    assert json_tokenizer_problem(folder) is None
    ours, theirs = JsonTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    if theirs.pad_token is None:  # what foundryx's hf tokenizer does (build_hf_tokenizer)
        theirs.pad_token = theirs.eos_token
    kw = {"return_offsets_mapping": True, "return_special_tokens_mask": True,
          "return_attention_mask": False, "verbose": False}
    for special in (True, False):
        a = ours(TEXTS, add_special_tokens=special, **kw)
        b = theirs(TEXTS, add_special_tokens=special, **kw)
        assert a["input_ids"] == b["input_ids"]
        assert [list(map(tuple, o)) for o in a["offset_mapping"]] == \
            [list(map(tuple, o)) for o in b["offset_mapping"]]
        assert a["special_tokens_mask"] == b["special_tokens_mask"]
    assert ours(" a", add_special_tokens=False)["input_ids"] == \
        theirs(" a", add_special_tokens=False)["input_ids"]
    ids = theirs(TEXTS)["input_ids"]
    for skip in (True, False):
        assert ours.batch_decode(ids, skip_special_tokens=skip) == \
            theirs.batch_decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids[0][1:5]) == theirs.decode(ids[0][1:5])
    assert ours.convert_ids_to_tokens(ids[3]) == theirs.convert_ids_to_tokens(ids[3])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


def test_refuses_what_transformers_would_change(tmp_path):
    folder = byte_level(tmp_path)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    cases = {
        "tokenizer_class LlamaTokenizerFast": {"tokenizer_class": "LlamaTokenizerFast"},
        "sets add_bos_token": {"add_bos_token": True},
        "split_special_tokens": {"split_special_tokens": True},
        "'<mask>' is not an added token": {"mask_token": "<mask>"},
        # transformers 4 and 5 treat these two differently: left to transformers
        "clean_up_tokenization_spaces is set": {"clean_up_tokenization_spaces": True},
        "add_prefix_space differs": {"add_prefix_space": True},
    }
    for why, change in cases.items():
        config_file.write_text(json.dumps({**config, **change}))
        assert why in json_tokenizer_problem(folder), why
    config_file.write_text(json.dumps(config))
    assert json_tokenizer_problem(folder) is None
    (folder / "tokenizer.json").unlink()
    assert "no tokenizer.json" in json_tokenizer_problem(folder)


def test_loading_it_imports_no_transformers(tmp_path):
    folder = byte_level(tmp_path)
    code = ("import sys; from foundryx.data.json_tokenizer import JsonTokenizer; "
            f"t = JsonTokenizer({str(folder)!r}); t(['a b']); t.decode([1]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
