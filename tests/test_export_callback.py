"""The hf_export callback: exports during and at the end of training load and match the model."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import LLAMA_STYLE, MPT_TINY, token_batch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from foundryx import registry
from foundryx.errors import ConfigError, ExportError


def fit(model, callback, batches: int):
    from composer import Trainer
    from torch.utils.data import DataLoader

    batch = token_batch(batch=8, seq=16)
    samples = [{k: v[i] for k, v in batch.items()} for i in range(8)]
    trainer = Trainer(model=model, train_dataloader=DataLoader(samples, batch_size=4),
                      max_duration=f"{batches}ba", callbacks=[callback], device="cpu",
                      optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
                      progress_bar=False, log_to_console=False, seed=1)
    trainer.fit()
    return trainer


def mpt(tokenizer, **overrides):
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    return ComposerMPTCausalLM(tokenizer, **{**MPT_TINY, **overrides})


def test_exports_every_interval_and_at_fit_end(tmp_path, tiny_tokenizer):
    model = mpt(tiny_tokenizer, **LLAMA_STYLE)
    callback = registry.callbacks.get("hf_export")(save_folder=str(tmp_path / "hf"), save_interval="2ba")
    fit(model, callback, batches=3)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["ba2", "ba3"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "ba3").eval()
    assert type(reloaded) is LlamaForCausalLM
    ids = token_batch(2, 16)["input_ids"]
    with torch.no_grad():
        want = model.model.eval()(ids).logits
        torch.testing.assert_close(reloaded(ids).logits, want, atol=1e-5, rtol=0)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf" / "ba3")) == len(tiny_tokenizer)


def test_impossible_format_fails_before_training(tmp_path, tiny_tokenizer):
    model = mpt(tiny_tokenizer, attn_config={"alibi": True})
    callback = registry.callbacks.get("hf_export")(save_folder=str(tmp_path / "hf"), format="llama")
    with pytest.raises(ExportError, match=r"attn_config\.alibi is true"):
        fit(model, callback, batches=2)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "options, needle",
    [({"format": "lama"}, "format: 'lama'"), ({"dtype": "int8"}, "dtype: 'int8'"),
     ({"at_fit_end": False}, "would never export"), ({"save_interval": "often"}, "save_interval")],
)
def test_bad_options(options, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        registry.callbacks.get("hf_export")(save_folder=str(tmp_path), **options)
