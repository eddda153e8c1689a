"""hf_causal_lm: tiny random Hugging Face models from folders and configs train; bad sections
are reported before anything is built; an offline hub name fails at once."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hf_tiny import HF_CONFIGS, hf_folder, token_batch, train_steps

from foundryx import registry
from foundryx.config.components import component_problems
from foundryx.errors import ConfigError
from foundryx.models.hf import ComposerHFCausalLM


@pytest.mark.parametrize("model_type", sorted(HF_CONFIGS))
def test_pretrained_folder_loads_and_trains(model_type, tmp_path, tiny_tokenizer):
    folder = hf_folder(model_type, tmp_path / model_type, tiny_tokenizer)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    model = registry.models.get("hf_causal_lm")(
        tokenizer=tiny_tokenizer, pretrained_model_name_or_path=str(folder)
    )
    loaded = model.model.state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    losses = train_steps(model)
    assert losses[-1] < 0.5 * losses[0], losses


def test_pretrained_false_is_random_init_of_the_folder_config(tmp_path):
    folder = hf_folder("llama", tmp_path / "m")
    model = ComposerHFCausalLM(pretrained_model_name_or_path=str(folder), pretrained=False,
                               config_overrides={"num_hidden_layers": 1})
    assert model.model.config.num_hidden_layers == 1 and len(model.model.model.layers) == 1
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    key = "model.embed_tokens.weight"
    assert not torch.equal(saved[key], model.model.state_dict()[key])


def test_config_dict_with_overrides_trains():
    model = ComposerHFCausalLM(config={"model_type": "qwen2", **HF_CONFIGS["qwen2"]},
                               pretrained=False, config_overrides={"intermediate_size": 48})
    assert type(model.model).__name__ == "Qwen2ForCausalLM"
    assert model.model.model.layers[0].mlp.up_proj.out_features == 48
    losses = train_steps(model)
    assert losses[-1] < 0.5 * losses[0]


def test_fsdp_and_init_hooks_mark_decoder_blocks():
    model = ComposerHFCausalLM(config={"model_type": "llama", **HF_CONFIGS["llama"]}, pretrained=False)
    hf = model.model
    assert hf.fsdp_wrap_fn(hf.model.layers[0]) and hf.activation_checkpointing_fn(hf.model.layers[1])
    assert not hf.fsdp_wrap_fn(hf.model.embed_tokens) and not hf.fsdp_wrap_fn(hf.lm_head)
    assert hf.param_init_fn == hf._init_weights


def test_meta_init_and_mixed_now_meaning_meta(tmp_path, caplog):
    cfg = {"model_type": "llama", **HF_CONFIGS["llama"]}
    meta = ComposerHFCausalLM(config=cfg, pretrained=False, init_device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert not any(b.is_meta for b in meta.buffers())  # rotary frequencies: computed for real
    assert getattr(meta.model, "pretrained_weights_folder", None) is None
    folder = hf_folder("llama", tmp_path / "m")
    with caplog.at_level("WARNING"):
        mixed = ComposerHFCausalLM(pretrained_model_name_or_path=str(folder), init_device="mixed")
    assert "init_device: mixed is deprecated and now means meta" in caplog.text
    # every rank on meta; the weights are read shard by shard after sharding (foundryx.loading)
    assert all(p.is_meta for p in mixed.parameters())
    assert mixed.model.pretrained_weights_folder == str(folder)


def test_flops_per_batch_counts_matmul_params():
    model = ComposerHFCausalLM(config={"model_type": "gpt2", **HF_CONFIGS["gpt2"]}, pretrained=False)
    hf = model.model
    n = sum(p.numel() for p in hf.parameters()) - hf.transformer.wpe.weight.numel()  # tied: wte counts
    b, s = 4, 16
    assert model.flops_per_batch(token_batch(b, s)) == 3 * b * (2 * n * s + 4 * 2 * 32 * s * s)


def test_small_vocab_needs_resizing(tiny_tokenizer):
    cfg = {"model_type": "llama", **HF_CONFIGS["llama"], "vocab_size": 300}
    with pytest.raises(ConfigError, match="allow_embedding_resizing"):
        ComposerHFCausalLM(tokenizer=tiny_tokenizer, config=cfg, pretrained=False)
    model = ComposerHFCausalLM(tokenizer=tiny_tokenizer, config=cfg, pretrained=False,
                               allow_embedding_resizing=True)
    assert model.model.get_input_embeddings().weight.shape[0] == len(tiny_tokenizer)


@pytest.mark.parametrize(
    "section, needle",
    [
        ({}, "give exactly one of pretrained_model_name_or_path"),
        ({"config": {"model_type": "llama"}}, "pretrained: a config dict has no weights"),
        ({"config": {"model_type": "lama"}, "pretrained": False}, "did you mean 'llama'"),
        ({"config": {"model_type": "llama"}, "pretrained": False,
          "config_overrides": {"num_layers": 1}}, "did you mean 'num_hidden_layers'"),
        ({"pretrained_model_name_or_path": "./no/such/folder"}, "does not exist"),
        ({"pretrained_model_name": "x"}, "did you mean 'pretrained_model_name_or_path'"),
        ({"config": "llama", "pretrained": False}, "config: expected a mapping or null"),
        ({"config": {"model_type": "llama"}, "pretrained": False, "init_device": "gpu"},
         "init_device: expected one of 'cpu', 'meta', 'mixed', got 'gpu'"),
    ],
)
def test_bad_sections_are_reported_by_the_validator(section, needle):
    problems = component_problems({"model": {"name": "hf_causal_lm", **section}})
    assert any(p.startswith("model.") and needle in p for p in problems), problems


def test_every_init_device_builds_float32_from_a_bfloat16_folder(tmp_path):
    """One dtype rule for every rank: rank 0's from_pretrained and the meta ranks'
    from_config once disagreed for a bf16 config (fp32 vs bf16: the first all-gather failed)."""
    from transformers import AutoModelForCausalLM

    from foundryx.loading import load, prepare

    folder = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(hf_folder("llama", tmp_path / "m")).to(
        torch.bfloat16).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    built = {d: ComposerHFCausalLM(pretrained_model_name_or_path=str(folder), init_device=d)
             for d in ("cpu", "meta")}
    assert {p.dtype for m in built.values() for p in m.parameters()} == {torch.float32}
    load(built["meta"], prepare(built["meta"], str(folder)), torch.device("cpu"))
    cpu, meta = built["cpu"].state_dict(), built["meta"].state_dict()
    assert all(torch.equal(cpu[k], meta[k]) for k in cpu)


def test_hub_name_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set.*huggingface-cli download"):
        ComposerHFCausalLM(pretrained_model_name_or_path="someone/not-cached-model")
    assert time.monotonic() - start < 5


def test_unreachable_hub_fails_at_once(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ConfigError, match="hub is unreachable"):
        ComposerHFCausalLM(pretrained_model_name_or_path="someone/not-cached-model")
    assert time.monotonic() - start < 5



def test_packed_batches_keep_documents_apart_and_say_so_once(monkeypatch):
    import foundryx.models.hf as hf

    lines = []
    monkeypatch.setattr(hf.log, "info", lambda msg, *a: lines.append(msg % a))
    model = ComposerHFCausalLM(config={"model_type": "llama", **HF_CONFIGS["llama"]}, pretrained=False)
    batch = {**token_batch(), "sequence_id": torch.zeros(4, 16, dtype=torch.long)}
    model(batch)
    model(batch)
    packed = [line for line in lines if "packed batches" in line]
    assert packed == ["hf_causal_lm: packed batches: position ids restart at each document and "
                      "attention sdpa keeps documents apart (transformers reads the documents "
                      "from the position ids; a dense mask of seq² per row: "
                      "model.attn_implementation: foundryx_flex builds none)"]
