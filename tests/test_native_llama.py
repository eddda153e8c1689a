"""The native Llama (foundryx.models.llama) gives transformers' logits bit for bit (float32 and
bfloat16; grouped-query and multi-head attention; tied and untied heads; llama3 rotary scaling;
Mistral without a sliding window), the eval's native scoring and greedy generation give the
transformers paths' logits and tokens, configs it does not reproduce are refused, loader errors
name the file, and neither module imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eval_generate import PROMPTS, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from foundryx.errors import CheckpointError
from foundryx.eval.data import _pad
from foundryx.eval.generate import greedy_generate
from foundryx.eval.native_lm import native_greedy_generate, native_scoring_forward
from foundryx.eval.score import scoring_forward
from foundryx.models.llama import load_hf_llama, native_problem, spec_from_hf_config, unsupported
from foundryx.models.llama.model import causal_padding_mask

V5 = hasattr(LlamaConfig(), "rope_parameters")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # wavelengths on all three sides of the band


def hf_llama(folder, kv_heads=2, tie=False, llama3=False, family="llama", vocab=300):
    """A seeded random transformers Llama (or Mistral) saved to ``folder``, and the model."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    extra = {}
    if llama3:
        extra = {"rope_parameters": {**LLAMA3, "rope_theta": 10000.0}} if V5 else {"rope_scaling": LLAMA3}
    if family == "mistral":
        extra["sliding_window"] = None
    config, model = {"llama": (LlamaConfig, LlamaForCausalLM),
                     "mistral": (MistralConfig, MistralForCausalLM)}[family]
    cfg = config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                 initializer_range=0.5, tie_word_embeddings=tie, attn_implementation="sdpa", **extra)
    hf = model(cfg).eval()
    hf.save_pretrained(folder)
    return hf


CASES = {"gqa-untied": {}, "mha-tied": {"kv_heads": 4, "tie": True}, "gqa-llama3": {"llama3": True},
         "mistral": {"family": "mistral"}}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_are_transformers_logits(tmp_path, case):
    hf = hf_llama(tmp_path, **CASES[case])
    model = load_hf_llama(tmp_path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == CASES[case].get("tie", False)
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (3, 150))  # past original_max_position_embeddings (llama3)
    ones = torch.ones_like(ids)
    keep = torch.tensor([0, 7, 8, 100, 148])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=ones).logits
        want_kept = hf(input_ids=ids, attention_mask=ones, logits_to_keep=keep).logits
        got = model(ids, torch.arange(150)[None])
        got_kept = model(ids, torch.arange(150)[None], keep=keep)
    assert torch.equal(got, want)
    assert torch.equal(got_kept, want_kept)
    kv, head_dim = CASES[case].get("kv_heads", 2), 32 // 4
    assert model.kv_row_bytes(100) == 2 * 2 * kv * head_dim * 100 * 4  # layers, k+v, float32
    # left padding, positions from the mask (as generate gives them): the real tokens' logits
    mask = ones.clone()
    mask[0, :40], mask[2, :1] = 0, 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = model(ids, pos, attn_mask=causal_padding_mask(mask))
    assert torch.equal(got[mask.bool()], want[mask.bool()])


def test_bfloat16_logits_are_transformers_logits(tmp_path):
    hf_llama(tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)  # a bfloat16 checkpoint
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model = load_hf_llama(tmp_path, dtype="auto")  # config.json's dtype, as from_pretrained's "auto"
    assert model.spec.dtype == model.lm_head.weight.dtype == torch.bfloat16
    assert load_hf_llama(tmp_path).lm_head.weight.dtype == torch.float32  # 4.57's default
    ids = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = model(ids, torch.arange(64)[None])
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def _scoring_batch(rows: int, width: int, right_padded: bool = True) -> dict:
    torch.manual_seed(2)
    ids = torch.randint(0, 300, (rows, width))
    lengths = torch.tensor([width, width - 5, width - 11])[:rows]
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    if not right_padded:
        mask = mask.flip(1)
    start = lengths - 4 if right_padded else torch.full_like(lengths, width - 4)
    return {"input_ids": ids, "attention_mask": mask, "cont_start": start, "cont_end": start + 3}


@pytest.mark.parametrize("right", [True, False], ids=["right-padded", "left-padded"])
def test_native_scoring_is_scoring_forward(tmp_path, right):
    hf = hf_llama(tmp_path)
    batch = _scoring_batch(3, 40, right)
    with torch.no_grad():
        want, want_batch = scoring_forward(hf)(batch)
    got, got_batch = native_scoring_forward(load_hf_llama(tmp_path))(batch)
    assert torch.equal(got, want)
    assert all(torch.equal(got_batch[k], want_batch[k]) for k in want_batch)


def test_native_greedy_tokens_are_greedy_generates(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    hf = tiny_model("llama", len(tok))  # grouped-query attention
    hf.save_pretrained(tmp_path)
    model = load_hf_llama(tmp_path)
    rows = [tuple(tok(p)["input_ids"]) for p in PROMPTS]
    ids, mask = _pad(rows, tok.pad_token_id or 0, left=True)
    plain = native_greedy_generate(model, tok, ids, mask, 12)
    assert plain == greedy_generate(hf, tok, ids, mask, 12)
    assert all(len(t) == 12 for t in plain)
    # one row ends at an end-of-sequence token, another at a stop sequence: they leave the
    # batch (and the cache) while the others run on, with greedy_generate's tokens
    eos = plain[0][3]
    stop = tok.decode(plain[2][4:6]).strip() or tok.decode(plain[2][4:6])
    cut = native_greedy_generate(model, tok, ids, mask, 12, eos_token_id=eos, stop_sequences=[stop])
    assert cut == greedy_generate(hf, tok, ids, mask, 12, eos_token_id=eos, stop_sequences=[stop])
    assert len(cut[0]) == plain[0].index(eos) + 1 and min(map(len, cut)) < max(map(len, cut))
    # prompts of one length: no padding anywhere
    same = ids[:, -1:].repeat(1, 6)
    ones = torch.ones_like(same)
    assert native_greedy_generate(model, tok, same, ones, 5) == greedy_generate(hf, tok, same, ones, 5)
    assert native_greedy_generate(model, tok, ids, mask, 0) == [[] for _ in PROMPTS]


def test_padding_only_queries_leave_real_tokens_exact(tmp_path):
    """A padding query sees no real token; it attends to itself (no empty SDPA row, no NaN that
    the next layer's keys and values could carry into real tokens)."""
    hf_llama(tmp_path)
    model = load_hf_llama(tmp_path)
    mask = torch.tensor([[0] * 30 + [1] * 10, [1] * 40])
    full = causal_padding_mask(mask)
    assert full.any(-1).all()  # no query without a key
    assert causal_padding_mask(torch.ones_like(mask)) is None
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (2, 40))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(ids, pos, attn_mask=full)
        alone = model(ids[:1, 30:], torch.arange(10)[None])
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[0, 30:], alone[0], rtol=1e-4, atol=1e-4)  # other shapes: other sums


def _config(tmp_path) -> dict:
    hf_llama(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


REFUSED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act"),
    "linear-rope": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": None},
                    "linear"),
    "yarn-v5": ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
                 "rope_scaling": None}, "yarn"),
    "gpt2": ({"model_type": "gpt2"}, "model_type"),
    "classifier": ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    "mistral-window": ({"model_type": "mistral", "architectures": None, "sliding_window": 4096},
                       "sliding_window"),
    "mistral-default-window": ({"model_type": "mistral", "architectures": None}, "sliding_window"),
    "partial-rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "quantized": ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized"),
    "heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "dtype": ({"torch_dtype": "float8_e4m3fn", "dtype": "float8_e4m3fn"}, "dtype"),
    "eager": ({"attn_implementation": "eager"}, "attn_implementation"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_names_what_it_does_not_reproduce(tmp_path, case):
    config = _config(tmp_path)
    assert unsupported(config) is None
    change, word = REFUSED[case]
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None or k == "sliding_window"}
    if case == "mistral-default-window":
        config.pop("sliding_window", None)
    reason = unsupported(config)
    assert reason is not None and word in reason
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json.*" + word):
        load_hf_llama(tmp_path)


def test_both_rope_spellings_give_one_spec():
    base = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    v4 = spec_from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": dict(LLAMA3)})
    v5 = spec_from_hf_config({**base, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    old_style = {k: v for k, v in LLAMA3.items() if k != "rope_type"} | {"type": "llama3"}
    legacy = spec_from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": old_style})
    assert v4 == v5 == legacy and v4.rope_scaling["factor"] == 8.0 and v4.rope_theta == 5e5
    plain = spec_from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 8 and plain.dtype is None


def test_a_sharded_folder_loads(tmp_path):
    hf = hf_llama(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        assert torch.equal(load_hf_llama(tmp_path / "sharded")(ids, torch.arange(16)[None]),
                           load_hf_llama(tmp_path / "one")(ids, torch.arange(16)[None]))


def _drop(folder, name):
    tensors = load_file(folder / "model.safetensors")
    tensors.pop(name)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _add(folder, name):
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = torch.zeros(3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _reshape(folder, _):
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))


BROKEN = {
    "no-config": (lambda f, _: (f / "config.json").unlink(), "config.json: not found"),
    "no-weights": (lambda f, _: (f / "model.safetensors").unlink(), "no model.safetensors"),
    "missing-tensor": (lambda f, _: _drop(f, "model.layers.1.mlp.up_proj.weight"),
                       "missing tensors model.layers.1.mlp.up_proj.weight"),
    "extra-tensor": (lambda f, _: _add(f, "model.layers.0.self_attn.q_proj.bias"),
                     "unexpected tensors model.layers.0.self_attn.q_proj.bias"),
    "shape": (_reshape, r"model.safetensors: tensor model.layers.\d.mlp.\w+_proj.weight has shape"),
    "not-json": (lambda f, _: (f / "config.json").write_text("{"), "cannot read it as JSON"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_loader_errors_name_the_file_and_the_fix(tmp_path, case):
    hf_llama(tmp_path)
    breaking, message = BROKEN[case]
    breaking(tmp_path, None)
    with pytest.raises(CheckpointError, match=message):
        load_hf_llama(tmp_path)


def test_native_problem_says_whether_a_folder_loads(tmp_path):
    assert "not a local folder" in native_problem(tmp_path / "meta-llama/Llama-3.2-1B")
    hf_llama(tmp_path / "ok")
    assert native_problem(tmp_path / "ok") is None
    hf_llama(tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    assert "no safetensors weights" in native_problem(tmp_path / "bin")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    assert "mlp_bias" in native_problem(tmp_path / "ok")
    (tmp_path / "ok" / "config.json").unlink()
    assert "config.json: not found" in native_problem(tmp_path / "ok")


def test_a_missing_shard_is_named(tmp_path):
    hf_llama(tmp_path).save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: listed in model.safetensors.index.json"):
        load_hf_llama(tmp_path)


def test_native_modules_do_not_import_transformers():
    code = ("import sys, foundryx.models.llama, foundryx.eval.native_lm, foundryx.eval.decoding; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'composer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_autocast_bfloat16_gives_transformers_numbers(tmp_path, tiny_tokenizer):
    """Under the eval's amp_bf16 precision (autocast) the same operations run in the same
    precisions: scoring logits and generated tokens stay transformers'."""
    hf = hf_llama(tmp_path, vocab=len(tiny_tokenizer))
    model = load_hf_llama(tmp_path)
    batch = _scoring_batch(3, 40)
    batch["input_ids"] = batch["input_ids"] % len(tiny_tokenizer)
    rows = [tuple(tiny_tokenizer(p)["input_ids"]) for p in PROMPTS]
    ids, mask = _pad(rows, tiny_tokenizer.pad_token_id or 0, left=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want, _ = scoring_forward(hf)(batch)
        got, _ = native_scoring_forward(model)(batch)
        want_tokens = greedy_generate(hf, tiny_tokenizer, ids, mask, 8)
        got_tokens = native_greedy_generate(model, tiny_tokenizer, ids, mask, 8)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert got_tokens == want_tokens


def test_tasks_score_the_same_through_the_native_operations(tiny_tokenizer, tmp_path, monkeypatch):
    """The eval's runner with the native scoring forward and generation in place of the
    transformers ones (as the runner will wire them): the same outcomes and generated texts on a
    multiple-choice and a generation task (few-shot prompts, several batches, stop sequences)."""
    from icl_fakes import run, task, write_jsonl

    import foundryx.eval.runner as runner
    from foundryx.eval.decoding import decode_generations
    from foundryx.eval.models import wrap_hf_model

    tok = tiny_tokenizer
    hf = tiny_model("llama", len(tok))
    hf.save_pretrained(tmp_path / "model")
    native = load_hf_llama(tmp_path / "model")
    model = wrap_hf_model(hf, tok)
    mc = write_jsonl(tmp_path / "mc.jsonl", [
        {"query": p, "choices": ["the king", "a", "of the land"], "gold": i % 3}
        for i, p in enumerate(PROMPTS * 2)])
    gen = write_jsonl(tmp_path / "gen.jsonl", [
        {"context": p, "answer": a} for p, a in zip(PROMPTS * 2, ["king", "the", "of", "x", "a"] * 2)])
    configs = [task(mc, "multiple_choice", num_fewshot=1, continuation_delimiter=" "),
               task(gen, "generation_task_with_answers", num_fewshot=2, max_new_tokens=6,
                    stop_sequences=["."], continuation_delimiter=" ")]

    used = []

    def scorer(model, task, metric):
        if task.task_type.mode == "generate":
            return None
        forward = native_scoring_forward(native)
        return lambda batch: used.append("score") or forward(batch)

    def generator(model, task, tokenizer, world):
        if task.task_type.mode != "generate":
            return None

        def generate(batch):
            used.append("generate")
            kw = batch["generation_kwargs"]
            return decode_generations(tokenizer, native_greedy_generate(
                native, tokenizer, batch["input_ids"], batch["attention_mask"],
                kw["max_new_tokens"], kw.get("eos_token_id"), batch["icl_options"]["stop_sequences"]))

        return generate

    for cfg in configs:
        want = run(model, tok, cfg, batch_size=3, dump=10)
        with monkeypatch.context() as m:
            m.setattr(runner, "_scorer", scorer)
            m.setattr(runner, "_generator", generator)
            got = run(model, tok, cfg, batch_size=3, dump=10)
        assert got[0].outcomes == want[0].outcomes
        assert [d.get("output") for d in got[0].dumped] == [d.get("output") for d in want[0].dumped]
    assert used.count("score") >= 3 and used.count("generate") >= 3  # 10 rows, batches of 3
