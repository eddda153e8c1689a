"""Scoring batches of a plain causal model go without padding in their attention mask (it is on
the right, after every real token), so SDPA runs causal with no mask: the logits at every real position are the masked
forward's, bit for bit, across attention's blocks; other padding keeps the mask."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from foundryx.eval.plain_causal import plain_causal, right_padded
from foundryx.eval.score import scoring_forward


def test_right_padded_reads_the_mask():
    assert right_padded(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert not right_padded(torch.tensor([[1, 1, 1], [0, 1, 1]]))  # left padding
    assert not right_padded(torch.tensor([[1, 0, 1]]))  # a hole


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scoring_without_a_mask_gives_the_masked_logits(family, monkeypatch):
    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    torch.manual_seed(0)
    hf = model(config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation="sdpa")).eval()
    assert plain_causal(hf)
    lengths, width = [700, 650, 333, 701], 701  # past one block of the CPU kernel's keys (512)
    ids = torch.randint(1, 300, (len(lengths), width))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ends = torch.tensor(lengths)
    batch = {"input_ids": ids, "attention_mask": mask, "cont_start": ends - 5, "cont_end": ends}
    score, seen = scoring_forward(hf), []
    forward = hf.forward
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(hf, "forward", lambda **kw: seen.append(kw["attention_mask"]) or forward(**kw))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: masks.append(kw.get("attn_mask")) or sdpa(*a, **kw))
    fast, _ = score(batch)
    assert bool(seen[0].all()) and masks == [None, None]  # SDPA runs causal, with no mask at all
    with torch.no_grad():
        full = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
    keep = [p for p in range(width - 1) if any(e - 6 <= p < e - 1 for e in lengths)]  # kept: every row's last 5
    for row, n in enumerate(lengths):
        got = fast[row, :len(keep)]
        want = full[row, keep]
        real = [j for j, p in enumerate(keep) if p < n]
        assert torch.equal(got[real], want[real])
    seen.clear()
    score({**batch, "attention_mask": mask.flip(1)})  # left padding keeps its mask
    assert torch.equal(seen[0], mask.flip(1))
