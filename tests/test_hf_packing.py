"""Packed fine-tuning batches in Hugging Face models keep their documents apart: a packed
training step equals the same documents run one by one."""

from __future__ import annotations

import logging

import pytest
import torch

from foundryx.data.finetuning.loader import FinetuningDatasetOptions, build_rows, collate
from foundryx.errors import ConfigError
from foundryx.models.hf import ComposerHFCausalLM
from foundryx.models.hf_attention import documents_of, packed_positions
from foundryx.models.layers.loss import IGNORE_INDEX
from tests.hf_tiny import HF_CONFIGS, VOCAB

LENGTHS = [5, 11, 3, 8, 6, 9, 2]  # 44 tokens: rows of at most 19 (not a multiple of a block)
PAD = 0


def examples():
    g = torch.Generator().manual_seed(3)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (n // 3) + ids[n // 3:]  # a prompt, then the response
        out.append((ids, labels))
    return out


def packed_batch():
    ds = FinetuningDatasetOptions(path="unused", max_seq_len=19, packing_ratio=4, shuffle=False)
    rows = build_rows(examples(), ds, device_batch_size=2)
    return collate(rows, PAD)


def model(attn, seed=0, fused=False):
    torch.manual_seed(seed)
    return ComposerHFCausalLM(config={"model_type": "llama", **HF_CONFIGS["llama"]},
                              pretrained=False, attn_implementation=attn, fused_loss=fused)


def token_losses(m, batch):
    """Cross entropy of each labelled token, in the order the examples were given."""
    logits = m.eval_forward(batch) if not m.training else m(batch).logits
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    losses = torch.nn.functional.cross_entropy(logits[:, :-1][keep], labels[keep],
                                               reduction="none")
    return losses, keep


def test_the_loader_packs_and_takes_no_loss_across_documents():
    batch = packed_batch()
    assert batch["input_ids"].shape[1] == 19 and "sequence_id" in batch
    ids = batch["sequence_id"]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    assert (batch["labels"][starts] == IGNORE_INDEX).all()  # first token of every example
    positions = packed_positions(ids, batch["attention_mask"])
    assert (positions[starts] == 0).all() and torch.equal(positions[~starts],
                                                          torch.roll(positions, 1, 1)[~starts] + 1)
    assert torch.equal(documents_of(positions, len(positions)).diff(dim=1) != 0, starts[:, 1:])


@pytest.mark.parametrize("attn", ["foundryx_flex", "sdpa"])
def test_a_packed_training_step_equals_the_documents_one_by_one(attn, caplog):
    packed = packed_batch()
    pm, um = model(attn), model("sdpa")  # the reference: each document alone, plain SDPA
    pm.train(), um.train()
    with caplog.at_level(logging.INFO, logger="foundryx.models.hf"):
        got, keep = token_losses(pm, packed)
    assert f"attention {attn} keeps documents apart" in caplog.text
    # the same documents, each alone in a batch of one, no padding
    want = []
    for r in range(packed["input_ids"].shape[0]):
        ids = packed["sequence_id"][r]
        for d in ids.unique_consecutive():
            cols = (ids == d) & (packed["attention_mask"][r] == 1)
            if cols.any():
                one = {k: packed[k][r, cols][None] for k in ("input_ids", "labels")}
                one["attention_mask"] = torch.ones_like(one["input_ids"])
                want.append(token_losses(um, one)[0])
    want = torch.cat(want)
    assert got.numel() == want.numel() == sum(n - max(1, n // 3) for n in LENGTHS)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)  # float32 roundings
    fused = model(attn, fused=True).train()  # the training step's own loss, fused
    torch.testing.assert_close(fused.loss(fused(packed), packed), want.mean())
    got.mean().backward()
    want.mean().backward()
    for (name, p), q in zip(pm.named_parameters(), um.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=2e-6, msg=name)


def test_without_keeping_documents_apart_the_losses_differ():
    """The test above can fail: the same packed batch with positions and mask as before
    (documents attending to each other) gives other losses."""
    packed = packed_batch()
    m = model("foundryx_flex")
    got = token_losses(m, packed)[0]
    leaky = {k: v for k, v in packed.items() if k != "sequence_id"}
    assert not torch.allclose(token_losses(m, leaky)[0], got, atol=1e-3)


def test_an_attention_that_cannot_keep_documents_apart_is_one_message():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("my_attention", sdpa_attention_forward)
    m = model("my_attention")
    with pytest.raises(ConfigError) as err:
        m(packed_batch())
    assert str(err.value).splitlines()[-1].strip().endswith(
        "model.attn_implementation: the batches are packed (sequence_id) and LlamaForCausalLM "
        "cannot keep their documents apart: its attention 'my_attention' does not read documents "
        "from position ids; set model.attn_implementation: foundryx_flex (no dense mask), or "
        "packing_ratio: null in the loader's dataset")


def test_foundryx_flex_unpacked_with_left_padding_matches_sdpa():
    """Unpacked batches with padding: the 2-D mask reaches foundryx_flex as key padding."""
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    flex, sdpa = model("foundryx_flex").eval(), model("sdpa").eval()
    with torch.no_grad():
        a, b = flex(batch).logits, sdpa(batch).logits
    torch.testing.assert_close(a[mask == 1], b[mask == 1], rtol=1e-5, atol=1e-5)


def test_foundryx_flex_gets_documents_and_no_mask_from_transformers(monkeypatch):
    """transformers builds no mask for foundryx_flex (its mask function is flash-attn's: None
    or the 2-D padding mask); the documents come from the position ids."""
    import foundryx.models.hf_attention as hfa

    calls, real = [], hfa.flex_attention

    def spy(q, k, v, **kw):
        calls.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(hfa, "flex_attention", spy)
    packed = packed_batch()
    with torch.no_grad():
        model("foundryx_flex").eval()(packed)
    assert len(calls) == HF_CONFIGS["llama"]["num_hidden_layers"]
    for kw in calls:
        assert kw["key_padding_mask"] is None and kw["causal"] is True
        starts = torch.ones_like(packed["sequence_id"], dtype=torch.bool)
        starts[:, 1:] = (packed["sequence_id"].diff(dim=1) != 0) | (
            packed["attention_mask"].diff(dim=1) != 0)
        assert torch.equal(kw["sequence_id"], starts.long().cumsum(1))
