"""Packing: first-fit-decreasing, every token kept, no attention across packed examples."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from test_finetuning import CHATS, PAIRS, write_jsonl

from foundryx.data.finetuning.loader import (
    FinetuningDatasetOptions,
    build_finetuning_dataloader,
    load_examples,
)
from foundryx.data.packing import auto_packing_ratio, first_fit_decreasing, pack

SEQ = 256


def test_first_fit_decreasing_known_case():
    assert first_fit_decreasing([2, 5, 4, 7, 1, 3, 8], 10) == [[0, 6], [3, 5], [1, 2, 4]]
    with pytest.raises(ValueError, match="length 11 > capacity 10"):
        first_fit_decreasing([3, 11], 10)


def test_first_fit_decreasing_properties():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 60))]
        bins = first_fit_decreasing(lengths, 100)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
        # FFD never leaves two bins that could be merged
        loads = sorted(sum(lengths[i] for i in b) for b in bins)
        assert len(loads) < 2 or loads[0] + loads[1] > 100


def test_pack_in_windows_and_auto_ratio():
    assert pack([3, 3, 3, 3, 3], 6, window=2) == [[0, 1], [2, 3], [4]]
    ratio, why = auto_packing_ratio([10, 30, 20], 100)
    assert ratio == 5.0 and "average 20.0 tokens (longest 30)" in why
    assert auto_packing_ratio([90, 100], 100)[0] == 1.0


def packed_cfg(src, ratio) -> dict:
    return {"drop_last": False,
            "dataset": {"path": str(src), "max_seq_len": SEQ, "packing_ratio": ratio,
                        "shuffle": True, "shuffle_seed": 5}}


def split_rows(spec) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The examples inside packed rows, cut at sequence_id changes (padding dropped)."""
    out = []
    for batch in spec.dataloader:
        assert batch["input_ids"].shape[1] <= SEQ
        for ids, labels, mask, seq in zip(batch["input_ids"], batch["labels"],
                                          batch["attention_mask"], batch["sequence_id"]):
            n = int(mask.sum())
            for k in seq[:n].unique().tolist():
                keep = (seq == k) & (mask == 1)
                out.append((tuple(ids[keep].tolist()), tuple(labels[keep].tolist())))
    return out


@pytest.mark.parametrize("ratio", ["auto", 2])
def test_packing_keeps_every_token(tmp_path, tiny_tokenizer, caplog, ratio):
    src = write_jsonl(tmp_path / "data.jsonl", (PAIRS + CHATS) * 3)
    examples = load_examples(FinetuningDatasetOptions(path=str(src), max_seq_len=SEQ),
                             tiny_tokenizer)
    with caplog.at_level(logging.INFO, logger="foundryx.data.finetuning.loader"):
        spec = build_finetuning_dataloader(packed_cfg(src, ratio), tiny_tokenizer, 4)
    got = split_rows(spec)
    assert sorted(got) == sorted((tuple(i), tuple(lb)) for i, lb in examples)
    rows = len(spec.dataloader.dataset)
    assert rows <= len(examples) / 2  # they really share rows
    assert f"packed {len(examples)} examples into {rows} rows of {SEQ} tokens" in caplog.text
    if ratio == "auto":
        assert "packing_ratio auto -> " in caplog.text


def test_packed_examples_never_attend_to_each_other(tmp_path, tiny_tokenizer):
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    src = write_jsonl(tmp_path / "data.jsonl", PAIRS + CHATS)
    spec = build_finetuning_dataloader(packed_cfg(src, "auto"), tiny_tokenizer, 4)
    batch = {k: v[:2] for k, v in next(iter(spec.dataloader)).items()}
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tiny_tokenizer, d_model=32, n_heads=2, n_layers=2,
                                max_seq_len=SEQ, vocab_size=448,
                                attn_config={"attn_impl": "torch", "rope": True,
                                             "attn_uses_sequence_id": True}).eval()
    with torch.no_grad():
        packed = model(batch).logits
        no_ids = model.model(batch["input_ids"], batch["attention_mask"]).logits
        checked = leaked = 0
        for row in range(len(batch["input_ids"])):
            mask, seq = batch["attention_mask"][row], batch["sequence_id"][row]
            for k in seq[mask == 1].unique().tolist():
                keep = (seq == k) & (mask == 1)
                alone = model.model(batch["input_ids"][row][keep][None]).logits[0]
                torch.testing.assert_close(packed[row][keep], alone, atol=1e-4, rtol=1e-4)
                leaked += k > 0 and not torch.allclose(no_ids[row][keep], alone, atol=1e-4)
                checked += 1
    assert checked > len(batch["input_ids"])  # rows hold several examples
    assert leaked  # without sequence_id, later examples would see earlier ones
