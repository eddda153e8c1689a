"""Norms, feed-forward blocks and position helpers against float64 references."""

import math

import pytest
import torch
import torch.nn.functional as F

from foundryx import registry
from foundryx.models.layers.ffn import MLP, SwiGLU
from foundryx.models.layers.norm import LayerNorm, RMSNorm
from foundryx.models.layers.positions import (
    alibi_slopes,
    apply_rope,
    rope_cos_sin,
    token_positions,
)


def _randomise(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_reference(bias):
    torch.manual_seed(0)
    norm = LayerNorm(8, eps=1e-3, bias=bias).double()
    _randomise(norm)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    want = (x - mean) / torch.sqrt(var + 1e-3) * norm.weight
    if bias:
        want = want + norm.bias
    else:
        assert norm.bias is None
    torch.testing.assert_close(norm(x), want)


@pytest.mark.parametrize("bias", [True, False])
def test_rmsnorm_matches_reference(bias):
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-3, bias=bias).double()
    _randomise(norm)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    want = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-3) * norm.weight
    if bias:
        want = want + norm.bias
    torch.testing.assert_close(norm(x), want)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.float64))


def test_rmsnorm_keeps_input_dtype():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert RMSNorm(8)(x).dtype == torch.bfloat16


def test_mlp_matches_reference():
    torch.manual_seed(0)
    mlp = MLP(6, 10).double()
    _randomise(mlp)
    x = torch.randn(4, 6, dtype=torch.float64)
    h = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    torch.testing.assert_close(mlp(x), h @ mlp.down_proj.weight.T + mlp.down_proj.bias)
    assert mlp.down_proj._is_residual


def test_swiglu_matches_reference():
    torch.manual_seed(0)
    ffn = SwiGLU(6, 10, bias=False).double()
    _randomise(ffn)
    x = torch.randn(4, 6, dtype=torch.float64)
    g = x @ ffn.gate_proj.weight.T
    h = g * torch.sigmoid(g) * (x @ ffn.up_proj.weight.T)
    torch.testing.assert_close(ffn(x), h @ ffn.down_proj.weight.T)
    assert all(m.bias is None for m in (ffn.gate_proj, ffn.up_proj, ffn.down_proj))
    assert ffn.down_proj._is_residual


def test_builtins_are_registered():
    assert registry.norms.get("layernorm") is LayerNorm
    assert registry.norms.get("rmsnorm") is RMSNorm
    assert registry.ffns.get("mlp") is MLP
    assert registry.ffns.get("swiglu") is SwiGLU


def test_alibi_slopes_power_of_two():
    want = torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    torch.testing.assert_close(alibi_slopes(8), want)
    torch.testing.assert_close(alibi_slopes(4, alibi_bias_max=4), want[:4])


def test_alibi_slopes_non_power_of_two():
    # ALiBi paper: slopes of the power of 2 below, then every other slope of twice that.
    def geometric(n):
        return [2.0 ** (-8 * (i + 1) / n) for i in range(n)]

    want = geometric(8) + geometric(16)[0::2][:4]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want))


def _naive_rope(x, positions, theta):
    """Rotate each pair (i, i + d/2) of every head vector by angle pos * theta^(-2i/d)."""
    out = x.clone()
    batch, seq, heads, d = x.shape
    for b in range(batch):
        for t in range(seq):
            for i in range(d // 2):
                angle = positions[b, t].item() * theta ** (-2 * i / d)
                c, s = math.cos(angle), math.sin(angle)
                a, bb = x[b, t, :, i], x[b, t, :, i + d // 2]
                out[b, t, :, i] = a * c - bb * s
                out[b, t, :, i + d // 2] = a * s + bb * c
    return out


def test_rope_matches_naive_rotation():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])
    cos, sin = rope_cos_sin(positions, 8, theta=100.0, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), _naive_rope(x, positions, 100.0))


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, dtype=torch.float64).unbind(0)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), 16, dtype=torch.float64)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), 16, dtype=torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100))
    assert not torch.allclose(score(7, 3), score(7, 5))


def test_token_positions():
    ids = torch.zeros(2, 6, dtype=torch.long)
    assert token_positions(ids).tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    seq_id = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert token_positions(ids, sequence_id=seq_id).tolist() == [
        [0, 1, 0, 1, 2, 0],
        [0, 1, 2, 3, 4, 5],
    ]
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    assert token_positions(ids, attention_mask=left_padded).tolist() == [
        [0, 0, 0, 1, 2, 3],
        [0, 1, 2, 3, 3, 3],
    ]


def test_gelu_tanh_option():
    mlp = MLP(4, 8, approximate="tanh")
    x = torch.randn(3, 4)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.gelu(mlp.up_proj(x), approximate="tanh")))
