"""The continuation span is found by offsets for byte-level BPE (``Ġword``, or a lone ``Ġ``) and
SentencePiece-style (``▁word``) tokenizers, with or without BOS/EOS tokens."""

from __future__ import annotations

import pytest
import torch
from icl_fakes import LookupConfig, LookupLM, run, task, write_jsonl

from foundryx.data.synthetic import generate_corpus, world_facts
from foundryx.errors import DataError
from foundryx.eval.encode import encode_rows
from foundryx.eval.models import wrap_hf_model


def metaspace_tokenizer(bos_eos: bool):
    """A SentencePiece-style BPE: spaces become ``▁`` glued to the next word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(generate_corpus(300, seed=1), trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    if bos_eos:  # Llama-like BOS, plus an EOS that must not be scored
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")


@pytest.fixture(params=["byte_bpe", "metaspace", "metaspace_bos_eos"])
def tokenizer(request, tiny_tokenizer):
    return {"byte_bpe": lambda: tiny_tokenizer, "metaspace": lambda: metaspace_tokenizer(False),
            "metaspace_bos_eos": lambda: metaspace_tokenizer(True)}[request.param]()


def test_span_is_exactly_the_continuation(tokenizer):
    facts = world_facts(1)[:40] + [("12 plus 3 is", " 15"), ("In the end it is", "Velqua")]
    rows = [(c + " ", a.strip()) for c, a in facts]
    for (context, cont), enc in zip(rows, encode_rows(tokenizer, rows, 64)):
        ids = list(enc.ids)
        assert tokenizer.decode(ids[enc.cont_start:enc.cont_end]).strip() == cont
        assert tokenizer.decode(ids[:enc.cont_start], skip_special_tokens=True) == context.rstrip()
        assert enc.cont_end == len(ids) - (tokenizer.eos_token_id == ids[-1])
        if tokenizer.convert_ids_to_tokens(ids[enc.cont_start]) == "Ġ":
            assert tokenizer.decode(ids[enc.cont_start:enc.cont_end]) == " " + cont  # a lone space token


def test_a_lone_space_token_is_part_of_the_continuation(tiny_tokenizer):
    # this BPE has no merged "ĠV...": the space is its own token and belongs to the continuation
    (enc,) = encode_rows(tiny_tokenizer, [("The capital of", "Velqua")], 64)
    tokens = tiny_tokenizer.convert_ids_to_tokens(list(enc.ids))
    assert tokens[enc.cont_start] == "Ġ"
    assert "".join(tokens[:enc.cont_start]) == "TheĠcapitalĠof"


def test_multiple_choice_end_to_end_on_each_family(tokenizer, tmp_path):
    """A model that knows the gold continuations' token bigrams picks them on every family."""
    facts = world_facts(3)[:16]
    rows = [{"query": c, "choices": ["zzzz", a.strip()][::1 - 2 * (i % 2)], "gold": 1 - i % 2}
            for i, (c, a) in enumerate(facts)]
    cfg = task(write_jsonl(tmp_path / "mc.jsonl", rows), "multiple_choice")
    lm = LookupLM(LookupConfig(vocab_size=len(tokenizer)))
    for context, answer in facts:
        (enc,) = encode_rows(tokenizer, [(context, answer.strip())], 64)
        for t in range(enc.cont_start, enc.cont_end):
            with torch.no_grad():
                lm.table[enc.ids[t - 1], enc.ids[t]] = 8.0
    (res,) = run(wrap_hf_model(lm, tokenizer), tokenizer, cfg)
    assert res.score == 1.0


def test_a_slow_tokenizer_is_refused(tiny_tokenizer):
    class Slow:
        is_fast = False

    with pytest.raises(DataError, match="needs a fast"):
        encode_rows(Slow(), [("a", "b")], 8)
