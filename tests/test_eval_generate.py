"""The eval's greedy generation loop gives Hugging Face ``generate``'s text, row for row: with a
KV cache (Llama) and without one (foundryx MPT), left padding, rows that stop early on the
end-of-sequence token or a stop sequence while others run on; and a generation task scores the
same through either path."""

from __future__ import annotations

import pytest
import torch
from icl_fakes import run, task, write_jsonl
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteriaList

import foundryx.eval.kv_cache as kv_cache
import foundryx.eval.runner as runner
from foundryx.eval.data import _pad
from foundryx.eval.generate import decode_generations, fast_path_problem, greedy_generate
from foundryx.eval.hf_stopping import StopOnSequences
from foundryx.eval.kv_cache import GrowingLayer, new_cache
from foundryx.eval.models import wrap_hf_model
from foundryx.models.mpt.composer import ComposerMPTCausalLM


def tiny_model(kind: str, vocab: int, attn: str = "sdpa", **extra) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config, model = classes[kind]
    cfg = config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 initializer_range=0.5,  # sharp preferences: varied, repeatable tokens
                 attn_implementation=attn, **extra)
    return model(cfg).eval()


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    return tiny_model("llama", vocab)


def tiny_mpt(tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    return ComposerMPTCausalLM(tokenizer, d_model=32, n_heads=2, n_layers=2, max_seq_len=128,
                               vocab_size=448, attn_config={"attn_impl": "torch", "rope": True}
                               ).model.eval()


def hf_texts(hf, tokenizer, ids, mask, new, eos, stops):
    crit = StoppingCriteriaList([StopOnSequences(tokenizer, stops, ids.shape[1])] if stops else [])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                          eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or 0,
                          stopping_criteria=crit)
    return tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


PROMPTS = ["the king of the north is", "a", "what is the capital of the land of",
           "one two three four five six seven eight nine ten", "the"]


@pytest.mark.parametrize("family", ["llama", "mpt"])
def test_greedy_generate_is_hf_generate(tiny_tokenizer, family):
    tok = tiny_tokenizer
    hf = tiny_llama(len(tok)) if family == "llama" else tiny_mpt(tok)
    assert fast_path_problem(hf) is None
    rows = [tuple(tok(p)["input_ids"]) for p in PROMPTS]
    ids, mask = _pad(rows, tok.pad_token_id or 0, left=True)
    plain = greedy_generate(hf, tok, ids, mask, 12)
    assert all(len(t) == 12 for t in plain)
    texts = decode_generations(tok, plain)
    assert texts == hf_texts(hf, tok, ids, mask, 12, None, [])
    # an end-of-sequence token that one row emits early and a stop sequence another row's text
    # holds: those rows leave the batch while the others run on, text still as generate's
    eos = plain[0][3]
    stop = tok.decode(plain[2][4:6]).strip() or tok.decode(plain[2][4:6])
    cut = greedy_generate(hf, tok, ids, mask, 12, eos_token_id=eos, stop_sequences=[stop])
    assert len(cut[0]) == plain[0].index(eos) + 1 and min(map(len, cut)) < max(map(len, cut))
    assert decode_generations(tok, cut) == hf_texts(hf, tok, ids, mask, 12, eos, [stop])


@pytest.mark.parametrize("kind,attn,window", [("llama", "sdpa", None), ("llama", "eager", None),
                                              ("qwen2", "sdpa", None), ("mistral", "sdpa", None),
                                              ("mistral", "sdpa", 4)])
def test_decoding_steps_fed_directly_give_generates_tokens(tiny_tokenizer, kind, attn, window,
                                                           monkeypatch):
    """After the prompt's step, greedy_generate feeds the model its new token, position and
    padding mask itself (no prepare_inputs_for_generation, no mask building): the same tokens
    as through prepare_inputs_for_generation every step, and as generate, with left padding
    and rows leaving the batch. A sliding-window model keeps generate's steps."""
    import foundryx.eval.generate as generate

    tok = tiny_tokenizer
    extra = {"sliding_window": window} if kind == "mistral" else {}
    hf = tiny_model(kind, len(tok), attn, **extra)
    calls = []
    prepare = hf.prepare_inputs_for_generation
    monkeypatch.setattr(hf, "prepare_inputs_for_generation",
                        lambda *a, **k: calls.append(1) or prepare(*a, **k))
    ids, mask = _pad([tuple(tok(p)["input_ids"]) for p in PROMPTS], tok.pad_token_id or 0, left=True)
    plain = greedy_generate(hf, tok, ids, mask, 12)
    eos = plain[1][4]  # a row finishes early, the others run on
    direct = greedy_generate(hf, tok, ids, mask, 12, eos_token_id=eos)
    assert min(map(len, direct)) < 12
    assert len(calls) == (2 if window is None else 2 * 12)  # direct: the prompts' steps only
    monkeypatch.setattr(generate, "plain_causal", lambda hf: False)
    assert greedy_generate(hf, tok, ids, mask, 12, eos_token_id=eos) == direct
    monkeypatch.undo()  # generate checks its arguments against prepare_inputs_for_generation's
    assert decode_generations(tok, direct) == hf_texts(hf, tok, ids, mask, 12, eos, [])


def test_the_generation_cache_holds_what_dynamic_cache_holds(tiny_tokenizer):
    """The cache greedy_generate uses keeps keys and values in place: step by step the same
    tensors as transformers' DynamicLayer (a prompt, then a token at a time), after rows leave
    the batch, and after it outgrows its first capacity (doubled, filled part copied)."""
    from transformers.cache_utils import DynamicLayer

    assert all(type(layer) is GrowingLayer
               for layer in new_cache(tiny_llama(len(tiny_tokenizer)), capacity=20).layers)
    torch.manual_seed(0)
    mine, ref = GrowingLayer(capacity=7), DynamicLayer()
    for step, (rows, length) in enumerate([(4, 5), (4, 1), (4, 1), (3, 1), (3, 1), (3, 1), (2, 1)]):
        if step and rows < ref.keys.shape[0]:
            keep = torch.tensor([0, 2, 3][:rows]) if rows == 3 else torch.tensor([1, 2])
            mine.batch_select_indices(keep)
            ref.batch_select_indices(keep)
        k, v = torch.randn(rows, 2, length, 8), torch.randn(rows, 2, length, 8)
        got, want = mine.update(k, v), ref.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        assert mine.get_seq_length() == ref.get_seq_length()
    assert mine._k.shape[2] == 2 * 8  # outgrown at 8 positions
    # keep 6 positions: crop takes the length to keep in transformers 4, the (negative) count
    # of tokens to remove in 5
    cut = -(ref.get_seq_length() - 6) if kv_cache._CROP_REMOVES else 6
    mine.crop(cut)
    ref.crop(cut)
    assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


def test_generation_task_scores_the_same_through_generate(tiny_tokenizer, tmp_path, monkeypatch):
    model = wrap_hf_model(tiny_llama(len(tiny_tokenizer)), tiny_tokenizer)
    path = write_jsonl(tmp_path / "gen.jsonl", [
        {"context": p, "answer": a} for p, a in zip(PROMPTS * 2, ["king", "the", "of", "x", "a"] * 2)])
    cfg = task(path, "generation_task_with_answers", num_fewshot=2, max_new_tokens=6,
               stop_sequences=["."], continuation_delimiter=" ")
    fast = run(model, tiny_tokenizer, cfg, batch_size=3, dump=10)
    monkeypatch.setattr(runner, "fast_path_problem", lambda hf: "forced for the test")
    slow = run(model, tiny_tokenizer, cfg, batch_size=3, dump=10)
    assert [d["output"] for d in fast[0].dumped] == [d["output"] for d in slow[0].dumped]
    assert fast[0].outcomes == slow[0].outcomes


def test_a_generation_config_beyond_greedy_keeps_generate(tiny_tokenizer):
    hf = tiny_llama(len(tiny_tokenizer))
    hf.generation_config.repetition_penalty = 1.3
    assert "repetition_penalty" in fast_path_problem(hf)


def test_generation_batch_size_sizes_generation_batches_only(tmp_path, monkeypatch):
    import yaml
    from icl_fakes import FakeLM

    from foundryx.errors import ConfigError
    from foundryx.eval.config import load_eval_config

    fake = FakeLM(["q", "a", "b"])
    gen = write_jsonl(tmp_path / "gen.jsonl", [{"context": "q", "answer": "a"}] * 3)
    lm = write_jsonl(tmp_path / "lm.jsonl", [{"context": "q", "continuation": "a"}] * 3)
    cfg = {"models": [{"label": "m", "hf": str(tmp_path)}], "device_eval_batch_size": 2,
           "generation_batch_size": 16, "icl_tasks": [
               {"label": "g", "dataset_uri": str(gen), "icl_task_type": "generation_task_with_answers",
                "num_fewshot": 0, "max_new_tokens": 1},
               {"label": "l", "dataset_uri": str(lm), "icl_task_type": "language_modeling",
                "num_fewshot": 0}]}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sizes = {}
    monkeypatch.setattr(runner, "evaluate_task", lambda model, t, tok, batch_size, **kw:
                        sizes.setdefault(t.key, batch_size))
    runner.evaluate_model(fake.model, fake.tokenizer, load_eval_config(str(path)), None)
    assert sizes == {"g/0-shot": 16, "l/0-shot": 2}
    with pytest.raises(ConfigError, match="generation_batch_size: must be positive"):
        load_eval_config(str(path), ["generation_batch_size=0"])


def test_auto_generation_batches_fit_in_a_scoring_batchs_logits(tiny_tokenizer, tmp_path, monkeypatch,
                                                                caplog):
    """generation_batch_size: auto (the default) sizes a generation batch by its KV caches
    against the logits of a scoring batch, by hand for a tiny Llama; a model without a KV
    cache (foundryx's MPT) keeps device_eval_batch_size; a number or null is taken as given;
    each says why in one line; anything else is a config error."""
    import logging

    import yaml

    from foundryx.errors import ConfigError
    from foundryx.eval.batching import AUTO_CAP, generation_rows, kv_row_bytes
    from foundryx.eval.config import load_eval_config

    vocab = len(tiny_tokenizer)
    llama = wrap_hf_model(tiny_llama(vocab), tiny_tokenizer)
    # 2 layers x (k, v) x 2 kv heads x head dim 8 x 128 tokens x 4 bytes
    assert kv_row_bytes(llama, 128) == 2 * 2 * 2 * 8 * 128 * 4 == 32768
    # a scoring batch of 4 rows of 128 tokens, vocabulary 256: 4 x 128 x 256 fp32 logits =
    # 524288 bytes; a generation row 32768 + one row of logits (256 x 4)
    assert generation_rows("auto", 4, llama, 128, 256)[0] == 524288 // (32768 + 1024) == 15
    assert generation_rows("auto", 4, llama, 128, 50000)[0] == AUTO_CAP  # big logits: capped
    assert generation_rows("auto", 4, llama, 2048, 8)[0] == 4  # at least device_eval_batch_size
    mpt = tiny_mpt(None)
    rows, why = generation_rows("auto", 4, mpt, 128, 448)
    assert kv_row_bytes(mpt, 128) is None and rows == 4 and "no KV cache" in why
    assert generation_rows(3, 4, llama, 128, 64)[0] == 3
    assert generation_rows(None, 4, llama, 128, 64)[0] == 4

    gen = write_jsonl(tmp_path / "gen.jsonl", [{"context": "q", "answer": "a"}] * 3)
    cfg = {"models": [{"label": "m", "hf": str(tmp_path)}], "device_eval_batch_size": 4,
           "max_seq_len": 128, "icl_tasks": [
               {"label": "g", "dataset_uri": str(gen), "icl_task_type": "generation_task_with_answers",
                "num_fewshot": 0, "max_new_tokens": 1}]}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sizes = {}
    monkeypatch.setattr(runner, "evaluate_task", lambda model, t, tok, batch_size, **kw:
                        sizes.setdefault(t.key, batch_size))
    with caplog.at_level(logging.INFO, logger="foundryx.eval.runner"):
        runner.evaluate_model(llama, tiny_tokenizer, load_eval_config(str(path)), None)
    want = min(AUTO_CAP, max(4, 4 * 128 * vocab * 4 // (32768 + vocab * 4)))
    assert sizes == {"g/0-shot": want}, (sizes, want)
    said = [r.getMessage() for r in caplog.records if "rows a batch" in r.getMessage()]
    assert len(said) == 1 and "generation_batch_size: auto" in said[0] and "0.0 MiB" not in said[0]
    with pytest.raises(ConfigError, match="generation_batch_size"):
        load_eval_config(str(path), ["generation_batch_size=big"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_greedy_token_is_torchs_argmax_ties_and_nans_included(dtype):
    """On a CPU the greedy token comes from numpy's argmax (torch's is not vectorised): the
    same index as torch's float32 argmax, the first of equal maxima, a NaN the largest."""
    from foundryx.eval.decoding import greedy_next

    logits = torch.randn(9, 3, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, -1, [7, 30]] = 1e4  # a tie: the first
    logits[2, -1, 40] = float("nan")  # a NaN after the maximum
    logits[3, -1, [5, 20]] = float("nan")  # two: the first
    logits[4, -1] = float("-inf")  # nothing finite: 0
    logits[5, -1, 49] = float("inf")
    last = logits[:, -1]  # a strided view, as the decoding loops pass it
    got = greedy_next(last)
    assert got.dtype == torch.int64 and got.tolist() == last.float().argmax(-1).tolist()
    assert got.tolist()[1:6] == [7, 40, 5, 0, 49]
