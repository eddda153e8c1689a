"""Multiple-choice scoring with each context computed once (foundryx.eval.shared_context): the
logits a metric reads are whole rows' up to float32 rounding, batches without a shared context
are whole rows exactly, and ``share_context: false`` scores whole rows."""

from __future__ import annotations

import pytest
import torch

from foundryx.eval.native_lm import native_scoring_forward
from foundryx.eval.native_models import NativeCausalLM
from foundryx.eval.shared_context import context_groups, shared_context_forward
from foundryx.models.llama.model import LlamaLM
from foundryx.models.llama.spec import LlamaSpec


def _model(kv_heads: int) -> LlamaLM:
    spec = LlamaSpec(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
                     rms_norm_eps=1e-6)
    model = LlamaLM(spec)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def _batch(examples: list[tuple[int, list[int]]]) -> dict:
    """Rows of (context length, continuation lengths): one row per continuation, each
    example's context the same random tokens, right padded to the longest row."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for context, conts in examples:
        ctx = torch.randint(1, 97, (context,), generator=g).tolist()
        rows += [(ctx, torch.randint(1, 97, (n,), generator=g).tolist()) for n in conts]
    width = max(len(c) + len(k) for c, k in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (c, k) in enumerate(rows):
        ids[r, :len(c) + len(k)] = torch.tensor(c + k)
        mask[r, :len(c) + len(k)] = 1
    start = torch.tensor([len(c) for c, _ in rows])
    return {"input_ids": ids, "attention_mask": mask, "cont_start": start,
            "cont_end": start + torch.tensor([len(k) for _, k in rows])}


def _spans(logits: torch.Tensor, compact: dict) -> list[torch.Tensor]:
    """Each row's logits that a metric reads: positions cont_start - 1 .. cont_end - 2."""
    return [logits[r, s - 1:e - 1] for r, (s, e) in
            enumerate(zip(compact["cont_start"].tolist(), compact["cont_end"].tolist()))]


def test_context_groups_of_a_hand_built_batch():
    ids = [[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 8, 1], [5, 6, 7, 3, 4]]
    assert context_groups(ids, [3, 3, 3, 3]) == ([0, 0, 1, 0], [0, 2])
    # the same tokens with another start are another context
    assert context_groups(ids, [3, 2, 3, 3]) == ([0, 1, 2, 0], [0, 1, 2])


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("examples", [
    [(20, [1, 3, 5]), (27, [2, 4]), (9, [6])],   # several lengths, a lone row, a 1-token choice
    [(15, [1, 1, 1, 1]), (11, [1, 1])],          # one-token choices: the context's run only
    [(12, [2, 2]), (30, [1, 2])],                # one token after the first: a single query
], ids=["mixed", "one-token", "two-token"])
def test_the_read_logits_are_whole_rows_up_to_rounding(kv_heads, examples):
    model = _model(kv_heads)
    batch = _batch(examples)
    whole = native_scoring_forward(model)
    want, want_compact = whole(batch)
    got, got_compact = shared_context_forward(model, whole)(batch)
    assert got.shape == want.shape
    assert all(torch.equal(got_compact[k], want_compact[k]) for k in want_compact)
    for r, (a, b) in enumerate(zip(_spans(got, got_compact), _spans(want, want_compact))):
        assert a.shape[0] == int(batch["cont_end"][r] - batch["cont_start"][r])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"row {r}")
    # the scores a metric computes from them: each row's mean loss of its continuation
    targets = [want_compact["input_ids"][r, s:e] for r, (s, e) in enumerate(
        zip(want_compact["cont_start"].tolist(), want_compact["cont_end"].tolist()))]
    losses = [[float(torch.nn.functional.cross_entropy(x, t)) for x, t in zip(spans, targets)]
              for spans in (_spans(got, got_compact), _spans(want, want_compact))]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_batch_without_a_shared_context_is_whole_rows_exactly():
    model = _model(2)
    batch = _batch([(10, [2]), (14, [3]), (7, [1])])
    whole = native_scoring_forward(model)
    want, _ = whole(batch)
    got, _ = shared_context_forward(model, whole)(batch)
    assert torch.equal(got, want)


def test_share_context_false_scores_whole_rows():
    model = _model(2)
    batch = _batch([(20, [1, 3, 5])])
    want, _ = native_scoring_forward(model)(batch)
    whole, _ = NativeCausalLM(model, None, share_context=False).scoring_forward()(batch)
    assert torch.equal(whole, want)
    shared, _ = NativeCausalLM(model, None).scoring_forward()(batch)  # the default shares it
    assert torch.equal(shared, shared_context_forward(model, native_scoring_forward(model))(batch)[0])
