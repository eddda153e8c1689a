"""Checks across config sections: data longer than the model, sequence_id the model needs."""

from __future__ import annotations

import pytest

from foundryx.cli import main
from foundryx.config import load_config
from foundryx.errors import ConfigError

QUICKSTART = "yamls/quickstart.yaml"


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["variables.data_root=/nowhere", *overrides])
    return info.value.problems


def test_max_seq_len_longer_than_the_model(capsys):
    found = problems("train_loader.dataset.max_seq_len=256")
    assert ("train_loader.dataset.max_seq_len: 256 is longer than model.max_seq_len 128; lower "
            "it to 128 or less, or raise model.max_seq_len") in found
    assert not any(p.startswith("eval_loader.dataset.max_seq_len") for p in found)
    assert main(["train", "--dry-run", QUICKSTART, "eval_loader.dataset.max_seq_len=129"]) == 2
    err = capsys.readouterr().err
    assert "eval_loader.dataset.max_seq_len: 129 is longer than model.max_seq_len 128" in err
    assert "Traceback" not in err


def test_sequence_id_the_model_needs():
    found = problems("model.attn_config.attn_uses_sequence_id=true")
    assert any(p.startswith("train_loader.dataset.emit_sequence_id: model.attn_config."
                            "attn_uses_sequence_id is true") for p in found)
    found = problems("model.attn_config.attn_uses_sequence_id=true",
                     "train_loader.dataset.emit_sequence_id=true",
                     "eval_loader.dataset.emit_sequence_id=true")
    assert not any("emit_sequence_id" in p for p in found)
    found = problems("model.attn_config.attn_uses_sequence_id=true", "train_loader.name=finetuning",
                     "train_loader.dataset={path: x.jsonl, max_seq_len: 128}",
                     "eval_loader.dataset.emit_sequence_id=true")
    assert any(p.startswith("train_loader.dataset.packing_ratio: model.attn_config") for p in found)
