"""The SDPA attention implementation against a naive float64 reference."""

import math

import pytest
import torch

from foundryx import registry
from foundryx.models.layers import attention as attn_mod
from foundryx.models.layers.attention import torch_attention

B, S, H, D = 2, 12, 4, 8


def reference_attention(
    q,
    k,
    v,
    causal=True,
    sequence_id=None,
    alibi_slopes=None,
    key_padding_mask=None,
    softmax_scale=None,
    sliding_window=None,
):
    """Softmax attention with every score and mask written out, one (b, h, i, j) at a time."""
    batch, seq, n_heads, d = q.shape
    group = n_heads // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(n_heads):
            for i in range(seq):
                scores, values = [], []
                for j in range(seq):
                    if causal and j > i:
                        continue
                    if sliding_window is not None and abs(i - j) > sliding_window:
                        continue
                    if sequence_id is not None and sequence_id[b, i] != sequence_id[b, j]:
                        continue
                    if key_padding_mask is not None and not key_padding_mask[b, j]:
                        continue
                    s = (q[b, i, h] * k[b, j, h]).sum() * scale
                    if alibi_slopes is not None:
                        s = s - alibi_slopes[h] * abs(i - j)
                    scores.append(s)
                    values.append(v[b, j, h])
                if scores:
                    w = torch.softmax(torch.stack(scores), dim=0)
                    out[b, i, h] = (w[:, None] * torch.stack(values)).sum(0)
    return out


def _qkv(kv_heads=H, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, S, kv_heads, D, generator=g, dtype=dtype)
    v = torch.randn(B, S, kv_heads, D, generator=g, dtype=dtype)
    return q, k, v


SEQUENCE_ID = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
RIGHT_PADDED = torch.tensor([[True] * 9 + [False] * 3, [True] * 12])
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])

VARIANTS = {
    "causal": {},
    "full": {"causal": False},
    "scale": {"softmax_scale": 0.3},
    "sequence_id": {"sequence_id": SEQUENCE_ID},
    "alibi": {"alibi_slopes": SLOPES},
    "alibi_full": {"alibi_slopes": SLOPES, "causal": False},
    "padding": {"key_padding_mask": RIGHT_PADDED},
    "window": {"sliding_window": 3},
    "all": {
        "sequence_id": SEQUENCE_ID,
        "alibi_slopes": SLOPES,
        "key_padding_mask": RIGHT_PADDED,
        "sliding_window": 3,
    },
}


@pytest.mark.parametrize("kv_heads", [H, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant, kv_heads):
    kw = VARIANTS[variant]
    q, k, v = _qkv(kv_heads)
    got = torch_attention(q, k, v, **kw)
    want = reference_attention(q, k, v, **kw)
    assert got.shape == (B, S, H, D)
    if "key_padding_mask" in kw:  # outputs at padding positions are unspecified
        keep = kw["key_padding_mask"]
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got, want)


def test_gqa_without_enable_gqa(monkeypatch):
    q, k, v = _qkv(kv_heads=2)
    want = torch_attention(q, k, v)
    monkeypatch.setattr(attn_mod, "_sdpa_has_enable_gqa", lambda: False)
    torch.testing.assert_close(torch_attention(q, k, v), want)


def test_gqa_hands_sdpa_the_kv_heads_unrepeated(monkeypatch):
    """torch >= 2.5 (so both tested torch versions): without a mask, grouped-query attention
    passes ``enable_gqa`` and K/V with their own heads; with a mask they are repeated."""
    assert attn_mod._sdpa_has_enable_gqa()  # the probe runs (and is cached) before the spy
    calls = []
    sdpa = attn_mod.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((k.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attn_mod.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(kv_heads=2)
    torch.testing.assert_close(torch_attention(q, k, v), reference_attention(q, k, v))
    torch_attention(q, k, v, sliding_window=3)
    assert calls == [(2, True), (H, False)]


def test_fully_padded_row_is_finite():
    q, k, v = _qkv()
    left_padded = torch.tensor([[False] * 4 + [True] * 8] * B)
    out = torch_attention(q, k, v, key_padding_mask=left_padded)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out[left_padded], reference_attention(q, k, v, key_padding_mask=left_padded)[left_padded]
    )


def test_rejects_bad_head_ratio():
    q, _, _ = _qkv()
    _, k, v = _qkv(kv_heads=3)
    with pytest.raises(ValueError, match="kv_n_heads 3"):
        torch_attention(q, k, v)


def test_low_precision_close_to_reference():
    q, k, v = _qkv(kv_heads=2, dtype=torch.bfloat16)
    got = torch_attention(q, k, v, alibi_slopes=SLOPES, sequence_id=SEQUENCE_ID)
    want = reference_attention(
        q.double(), k.double(), v.double(), alibi_slopes=SLOPES, sequence_id=SEQUENCE_ID
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_a_registered_implementation_is_what_the_model_calls():
    """A plugin's attention implementation, named in attn_config.attn_impl, runs in the model
    and gives the same logits as SDPA when it computes the same thing."""
    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    calls = []

    def spy(q, k, v, **kw):
        calls.append(sorted(kw))
        return torch_attention(q, k, v, **kw)

    registry.attention_implementations.register("test_spy", spy)
    try:
        shape = {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 16, "vocab_size": 64}
        torch.manual_seed(0)
        ref = MPTForCausalLM(MPTConfig(**shape)).eval()
        torch.manual_seed(0)
        spied = MPTForCausalLM(MPTConfig(**shape, attn_config={"attn_impl": "test_spy"})).eval()
        ids = torch.randint(0, 64, (2, 16))
        torch.testing.assert_close(spied(ids).logits, ref(ids).logits)
        assert len(calls) == 2 and all("causal" in kw for kw in calls)
        assert registry.attention_implementations.get("torch") is torch_attention
    finally:
        registry.attention_implementations.unregister("test_spy")
