"""Hugging Face export: Llama-style MPT → LlamaForCausalLM, other MPTs → foundryx_mpt, HF models
as themselves; same logits after reload; atomic output; clear errors."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from hf_tiny import HF_CONFIGS, LLAMA_STYLE, VOCAB, composer_state, random_mpt, token_batch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from foundryx.checkpoint.metadata import write_model_metadata
from foundryx.cli import main
from foundryx.errors import CheckpointError, ExportError
from foundryx.export import ExportSpec, export_checkpoint, export_weights, writer


def export(model, out, tokenizer=None, **kw):
    spec = ExportSpec(model.config, tokenizer, "the test")
    return export_weights(composer_state(model), spec, out, progress=False, **kw)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "overrides",
    [
        {"attn_config": {"rope": True, "kv_n_heads": 2, "rope_theta": 500000.0}},  # GQA, tied
        {"tie_word_embeddings": False, "norm_eps": 1e-6},
        {"attn_config": {"rope": True, "kv_n_heads": 1}, "ffn_config": {"ffn_type": "swiglu",
                                                                          "ffn_hidden_size": 48}},
    ],
    ids=["gqa-tied", "untied", "mqa-ffn48"],
)
def test_llama_style_mpt_exports_as_llama(overrides, tmp_path):
    mpt = random_mpt(**{**LLAMA_STYLE, **overrides})
    out = export(mpt, tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not list(out.glob("*.py"))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # no trust_remote_code
    assert type(reloaded) is LlamaForCausalLM
    ids = token_batch(2, 32)["input_ids"]
    torch.testing.assert_close(logits(reloaded, ids), logits(mpt, ids), atol=1e-5, rtol=0)
    greedy = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(reloaded.generate(ids[:, :8], **greedy), mpt.generate(ids[:, :8], **greedy))


@pytest.mark.parametrize(
    "overrides",
    [
        {"attn_config": {"alibi": True}},
        {"learned_pos_emb": True},  # LayerNorm, GELU MLP, biases: the MPT defaults
        {**LLAMA_STYLE, "attn_config": {"rope": True, "qk_ln": True}},
        {**LLAMA_STYLE, "attn_config": {"rope": True, "sliding_window_size": 4}},
        {**LLAMA_STYLE, "logit_scale": "inv_sqrt_d_model"},
    ],
    ids=["alibi", "layernorm-gelu", "qk_ln", "sliding-window", "logit-scale"],
)
def test_other_mpts_export_as_foundryx_mpt(overrides, tmp_path):
    mpt = random_mpt(**overrides)
    out = export(mpt, tmp_path / "mpt")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "foundryx_mpt" and config["init_device"] == "cpu"
    assert sorted(p.name for p in out.glob("*.py")) == [
        "configuration_foundryx_mpt.py", "modeling_foundryx_mpt.py"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = token_batch(2, 32)["input_ids"]
    torch.testing.assert_close(logits(reloaded, ids), logits(mpt, ids), atol=0, rtol=0)


def test_format_llama_names_what_prevents_it(tmp_path):
    mpt = random_mpt(attn_config={"alibi": True})
    with pytest.raises(ExportError, match=r"not Llama-style: .*attn_config\.alibi is true"):
        export(mpt, tmp_path / "out", fmt="llama")
    assert not (tmp_path / "out").exists()


def test_tokenizer_and_generation_config_are_written(tmp_path, tiny_tokenizer):
    out = export(random_mpt(**LLAMA_STYLE), tmp_path / "out", tiny_tokenizer)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("the cat")["input_ids"] == tiny_tokenizer("the cat")["input_ids"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tiny_tokenizer.eos_token_id
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tiny_tokenizer.eos_token_id


def test_export_tokenizer_returns_what_the_model_takes(tmp_path, tiny_tokenizer):
    """The saved tokenizer returns no token_type_ids (which generate refuses); the caller's
    tokenizer is left as it was."""
    before = list(tiny_tokenizer.model_input_names)
    out = export(random_mpt(**LLAMA_STYLE), tmp_path / "out", tiny_tokenizer)
    assert sorted(AutoTokenizer.from_pretrained(out)("the cat")) == ["attention_mask", "input_ids"]
    assert tiny_tokenizer.model_input_names == before


def test_export_modes_follow_the_umask(tmp_path, tiny_tokenizer):
    """Not mkdtemp's 0o700 nor safetensors' 0o600: what the umask gives any file and folder."""
    old = os.umask(0o027)
    try:
        out = export(random_mpt(**LLAMA_STYLE), tmp_path / "out", tiny_tokenizer)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def test_hf_model_exports_as_its_own_architecture(tmp_path):
    from foundryx.models.hf import ComposerHFCausalLM

    wrapped = ComposerHFCausalLM(config={"model_type": "gpt2", **HF_CONFIGS["gpt2"]}, pretrained=False)
    state = wrapped.state_dict()  # ComposerModel keys, lm_head tied to wte
    spec = ExportSpec(wrapped.model.config, None, "the test")
    out = export_weights(state, spec, tmp_path / "gpt2", progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "GPT2LMHeadModel"
    ids = token_batch(2, 16)["input_ids"]
    torch.testing.assert_close(logits(reloaded, ids), logits(wrapped.model.eval(), ids), atol=0, rtol=0)
    for fmt, needle in (("llama", "'gpt2' model"), ("mpt", "for MPT models")):
        with pytest.raises(ExportError, match=needle):
            export_weights(state, spec, tmp_path / fmt, fmt=fmt, progress=False)


def test_bf16_export(tmp_path):
    from safetensors import safe_open

    out = export(random_mpt(**LLAMA_STYLE), tmp_path / "bf16", dtype="bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_checkpoint_with_metadata_exports_without_config(tmp_path, tiny_tokenizer, caplog,
                                                          monkeypatch):
    """Weights with only an hf/ folder beside them (as older checkpoints have): the model is
    rebuilt from hf/config.json, and one log line says so."""
    import logging

    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.mpt.configuration import FIELDS

    model = ComposerMPTCausalLM(tiny_tokenizer, **{k: v for k, v in random_mpt().config.to_dict().items()
                                                    if k in FIELDS})
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    with pytest.raises(ExportError, match="holds no model config.*--config"):
        export_checkpoint(tmp_path / "weights.pt", tmp_path / "out", progress=False)
    write_model_metadata(tmp_path, model)
    monkeypatch.setattr(logging.getLogger("foundryx"), "propagate", True)  # after setup_logging
    with caplog.at_level(logging.INFO, logger="foundryx"):
        out = export_checkpoint(tmp_path / "weights.pt", tmp_path / "out", progress=False)
    assert "holds no components.json (saved by an older foundryx); rebuilding the model from" \
        in caplog.text
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = token_batch(2, 16)["input_ids"]
    torch.testing.assert_close(logits(reloaded, ids), logits(model.model.eval(), ids), atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(out).eos_token == tiny_tokenizer.eos_token


def test_config_that_does_not_match_names_both_files(tmp_path):
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    small = ComposerMPTCausalLM(None, **{**LLAMA_STYLE, "d_model": 32, "n_heads": 4, "n_layers": 2,
                                         "vocab_size": VOCAB})
    big = ComposerMPTCausalLM(None, **{**LLAMA_STYLE, "d_model": 64, "n_heads": 4, "n_layers": 2,
                                       "vocab_size": VOCAB})
    torch.save(small.state_dict(), tmp_path / "weights.pt")
    write_model_metadata(tmp_path, big)
    with pytest.raises(CheckpointError) as e:
        export_checkpoint(tmp_path / "weights.pt", tmp_path / "out", progress=False)
    msg = str(e.value)
    assert str(tmp_path / "weights.pt") in msg and str(tmp_path / "hf" / "config.json") in msg
    assert "attn.Wqkv.weight: model has shape (192, 64), checkpoint has (96, 32)" in msg
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten(tmp_path):
    mpt = random_mpt(**LLAMA_STYLE)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists.*--overwrite"):
        export(mpt, tmp_path / "out")
    with pytest.raises(ExportError, match="not a model folder"):
        export(mpt, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    first = export(mpt, tmp_path / "model")
    export(random_mpt(seed=1, **LLAMA_STYLE), first, overwrite=True)  # an older export: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(folder, model, tokenizer, **_):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr("foundryx.export.core.save_model_folder", broken)
    with pytest.raises(ExportError, match=r"could not write the export to .*out \(disk full\); "
                                          "nothing was written"):
        export(random_mpt(**LLAMA_STYLE), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    assert writer.replaceable(tmp_path)  # an empty folder may be written into


def test_cli_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "nope: no such checkpoint" in capsys.readouterr().err
    (tmp_path / "save" / "ep0-ba2" / "dcp").mkdir(parents=True)  # a save killed before its manifest
    assert main(["export", str(tmp_path / "save"), str(tmp_path / "out")]) == 2
    assert "no complete checkpoint here" in capsys.readouterr().err
    (tmp_path / "trunc.pt").write_bytes(b"PK\x03\x04 truncated")
    assert main(["export", str(tmp_path / "trunc.pt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "trunc.pt" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_hf_causal_lm_trains_an_mpt_export(tmp_path):
    from foundryx.models.hf import ComposerHFCausalLM

    mpt = random_mpt(attn_config={"alibi": True})
    out = export(mpt, tmp_path / "mpt")
    wrapped = ComposerHFCausalLM(pretrained_model_name_or_path=str(out))  # no trust_remote_code
    ids = token_batch(2, 16)["input_ids"]
    torch.testing.assert_close(logits(wrapped.model.eval(), ids), logits(mpt, ids), atol=0, rtol=0)


def test_run_config_needs_only_its_model_and_tokenizer(tmp_path, tiny_tokenizer):
    import yaml

    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    model_section = {"name": "mpt_causal_lm", **LLAMA_STYLE, "d_model": 32, "n_heads": 4,
                     "n_layers": 2, "max_seq_len": 32, "vocab_size": VOCAB}
    run = {"model": model_section, "tokenizer": {"name": "hf", "path": tiny_tokenizer.name_or_path},
           "train_loader": {"name": "text", "dataset": {"local": "/data/elsewhere"}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    kw = {k: v for k, v in model_section.items() if k != "name"}
    torch.save(ComposerMPTCausalLM(tiny_tokenizer, **kw).state_dict(), tmp_path / "w.pt")
    out = export_checkpoint(tmp_path / "w.pt", tmp_path / "out", config=tmp_path / "run.yaml",
                            progress=False)
    assert type(AutoModelForCausalLM.from_pretrained(out)) is LlamaForCausalLM
    assert len(AutoTokenizer.from_pretrained(out)) == len(tiny_tokenizer)
    with pytest.raises(CheckpointError, match=f"model section of {tmp_path / 'run.yaml'}"):
        export_checkpoint(tmp_path / "w.pt", tmp_path / "o2", config=tmp_path / "run.yaml",
                          overrides=["model.d_model=64"], progress=False)


def test_checkpoint_metadata_of_models_without_hf_parts(tmp_path):
    """A plugin's ComposerModel without a Hugging Face config gets no hf/ folder; one whose
    tokenizer cannot save_pretrained gets the config alone (the checkpoint save goes on)."""
    from types import SimpleNamespace

    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    assert write_model_metadata(tmp_path / "a", SimpleNamespace(model=torch.nn.Linear(2, 2))) is None
    assert not (tmp_path / "a").exists()
    model = ComposerMPTCausalLM(None, **{**LLAMA_STYLE, "d_model": 32, "n_heads": 4, "n_layers": 2,
                                         "vocab_size": VOCAB})
    model.tokenizer = object()
    assert write_model_metadata(tmp_path / "b", model) == tmp_path / "b" / "hf"
    names = {p.name for p in (tmp_path / "b" / "hf").iterdir()}
    assert "config.json" in names and not any(n.startswith(("tokenizer", "special")) for n in names)
