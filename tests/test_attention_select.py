"""Choosing an attention implementation: `auto`, and clear errors for `flash` and `triton`."""

from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch

from foundryx import registry
from foundryx.errors import FoundryxError
from foundryx.models.layers import attention_select as sel
from foundryx.models.layers.attention import torch_attention
from foundryx.models.layers.attention_flash import flash_attention, varlen_layout
from foundryx.models.layers.attention_triton import triton_attention
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM

LOGGER = "foundryx.models.layers.attention_select"


def qkv(batch=2, seq=12, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(batch, seq, heads, head_dim)] + [(batch, seq, kv_heads, head_dim)] * 2
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


@pytest.fixture(autouse=True)
def fresh_state():
    sel._logged.clear()
    sel.flash_attn_module.cache_clear()
    yield
    sel._logged.clear()
    sel.flash_attn_module.cache_clear()


def test_builtins_are_registered():
    names = registry.attention_implementations.names()
    assert {"torch", "triton", "flash", "auto"} <= set(names)
    assert MPTConfig(attn_config={"attn_impl": "auto"}).attn.attn_impl == "auto"


def test_auto_on_cpu_runs_torch_and_logs_one_line(caplog):
    q, k, v = qkv()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            out = sel.auto_attention(q, k, v, causal=True, sliding_window=3)
    torch.testing.assert_close(out, torch_attention(q, k, v, causal=True, sliding_window=3))
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == [
        "attention: auto chose 'torch': the tensors are on cpu; flash-attn and the Triton "
        "kernel need a CUDA or ROCm GPU"
    ]


def test_mpt_with_auto_on_cpu_matches_torch(caplog):
    cfg = {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 16, "vocab_size": 40}
    torch.manual_seed(0)
    ref = MPTForCausalLM(MPTConfig(**cfg)).eval()
    auto = MPTForCausalLM(MPTConfig(**cfg, attn_config={"attn_impl": "auto"})).eval()
    auto.load_state_dict(ref.state_dict())
    x = torch.randint(0, 40, (2, 16))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        torch.testing.assert_close(auto(x).logits, ref(x).logits)
    assert sum(r.name == LOGGER for r in caplog.records) == 1


class _Cuda:
    """Stands in for a CUDA tensor where only the device is read."""

    device = torch.device("cuda")


@pytest.mark.parametrize(
    "flash, triton, want",
    [
        (None, None, ("flash", "flash-attn 9.9 is installed and supports this call")),
        (
            "flash-attn is not installed",
            None,
            ("triton", "flash: flash-attn is not installed; the Triton kernel supports this call"),
        ),
        (
            "flash-attn takes fp16 or bf16",
            "no GPU",
            ("torch", "flash: flash-attn takes fp16 or bf16; triton: no GPU"),
        ),
    ],
)
def test_auto_prefers_flash_then_triton_then_torch(monkeypatch, flash, triton, want):
    monkeypatch.setattr(sel, "flash_problem", lambda q, k: flash)
    monkeypatch.setattr(sel, "triton_problem", lambda q, k, v, p: triton)
    monkeypatch.setattr(
        sel, "flash_attn_module", lambda: (types.SimpleNamespace(__version__="9.9"), None)
    )
    assert sel.choose(_Cuda(), _Cuda(), _Cuda()) == want


def test_flash_without_flash_attn_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn fails
    q, k, v = qkv()
    with pytest.raises(FoundryxError) as err:
        flash_attention(q, k, v)
    msg = str(err.value)
    assert "attn_impl 'flash' cannot run here: flash-attn is not installed" in msg
    assert "pip install 'foundryx[gpu]'" in msg and "attn_impl to torch or auto" in msg


def test_flash_missing_on_a_gpu_offers_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(sel.AttentionError, match="attn_impl to triton, torch or auto"):
        sel.require("flash", _Cuda(), _Cuda(), _Cuda(), 0.0)


def test_flash_installed_but_on_cpu_says_to_choose_another(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.7.4"))
    with pytest.raises(
        sel.AttentionError, match="needs a CUDA or ROCm GPU; the tensors are on cpu"
    ) as err:
        flash_attention(*qkv())
    assert "pip install" not in str(err.value)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.3.0"))
    sel.flash_attn_module.cache_clear()
    assert sel.flash_problem(*qkv()[:2]) == "flash-attn 2.3.0 is too old; foundryx needs >= 2.6"


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    pytest.importorskip("triton")
    from foundryx.kernels import flash_attention as kernel

    monkeypatch.setattr(kernel, "INTERPRETED", False)
    with pytest.raises(sel.AttentionError) as err:
        triton_attention(*qkv())
    msg = str(err.value)
    assert "attn_impl 'triton' cannot run here: the tensors are on the CPU" in msg
    assert "CUDA or ROCm GPU" in msg and "attn_impl to torch or auto" in msg


def test_triton_refuses_attention_dropout():
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU, in the interpreter
    with pytest.raises(sel.AttentionError, match="attention dropout is not implemented"):
        triton_attention(*(t.to(device) for t in qkv()), dropout_p=0.1)


def test_autocast_gives_one_dtype_as_sdpa_gets():
    q, k, v = qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = {t.dtype for t in sel.autocast_inputs(q, k.half(), v)}
    assert dtypes == {torch.bfloat16}
    assert sel.autocast_inputs(q, k, v)[0] is q


# -- the flash adapter against a stand-in flash_attn that follows flash-attn's documented API --
def _fake_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes):
    """flash-attn semantics for one sequence (seq, heads, dim): window_size=(left, right)."""
    seq, heads, dim = q.shape
    k, v = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
    scale = softmax_scale or 1 / math.sqrt(dim)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    keep = torch.ones(seq, seq, dtype=torch.bool)
    left, right = window_size
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * (i - j).abs()
    return torch.einsum("hij,jhd->ihd", s.masked_fill(~keep, -math.inf).softmax(-1), v)


def _fake_flash_attn():
    def flash_attn_func(q, k, v, **kw):
        return torch.stack([_fake_dense(*t, **kw) for t in zip(q, k, v)])

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert max_q == max_k == int(cu_q.diff().max())
        parts = [slice(a, b) for a, b in zip(cu_q.tolist(), cu_q[1:].tolist())]
        return torch.cat([_fake_dense(q[p], k[p], v[p], **kw) for p in parts])

    return types.SimpleNamespace(
        __version__="2.7.4",
        flash_attn_func=flash_attn_func,
        flash_attn_varlen_func=flash_attn_varlen_func,
    )


SEQUENCE_ID = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [7] * 12])
PADDING = torch.tensor([[1] * 9 + [0] * 3, [0] * 4 + [1] * 8])
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": False, "alibi_slopes": SLOPES, "sliding_window": 2},
        {"sequence_id": SEQUENCE_ID, "alibi_slopes": SLOPES},
        {"key_padding_mask": PADDING, "sliding_window": 3},
        {"sequence_id": SEQUENCE_ID, "key_padding_mask": PADDING, "causal": False},
    ],
    ids=["plain", "full_alibi_window", "packed", "padding", "packed_padding"],
)
def test_flash_adapter_matches_torch(monkeypatch, kw):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    monkeypatch.setattr(sel, "flash_problem", lambda q, k: None)  # the stand-in runs on CPU
    q, k, v = qkv(dtype=torch.float64)
    got, want = flash_attention(q, k, v, **kw), torch_attention(q, k, v, **kw)
    real = PADDING.bool() if "key_padding_mask" in kw else torch.ones(2, 12, dtype=torch.bool)
    torch.testing.assert_close(got[real], want[real])
    assert (got[~real] == 0).all()


def test_varlen_layout():
    cu, max_len, kept = varlen_layout(2, 12, SEQUENCE_ID, PADDING, torch.device("cpu"))
    assert cu.tolist() == [0, 5, 9, 17] and max_len == 8
    assert kept.tolist() == list(range(9)) + list(range(16, 24))
    cu, max_len, kept = varlen_layout(2, 12, SEQUENCE_ID, None, torch.device("cpu"))
    assert cu.tolist() == [0, 5, 9, 12, 24] and max_len == 12 and kept is None
    cu, max_len, kept = varlen_layout(2, 12, None, PADDING, torch.device("cpu"))
    assert cu.tolist() == [0, 9, 17] and max_len == 9
