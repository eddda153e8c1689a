"""Choosing an attention implementation: `auto`, and clear errors for `flash` and `triton`."""

from __future__ import annotations

import functools
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
    """Stands in for a CUDA tensor where only the device, shape and grad are read."""

    device = torch.device("cuda")
    requires_grad = True

    def __init__(self, heads=16, head_dim=128):
        self.shape = (2, 4096, heads, head_dim)


H100 = "NVIDIA H100 80GB HBM3"


def h100_choice(monkeypatch, *, flash=None, triton=None, rows=None, device=H100, q=None, k=None,
                **features):
    """choose() for a stand-in call on ``device`` with flash/triton problems as given."""
    monkeypatch.setattr(sel, "device_kind", lambda d: (device, "sm90"))
    monkeypatch.setattr(sel, "flash_problem", lambda q, k: flash)
    monkeypatch.setattr(sel, "triton_problem", lambda q, k, v, p: triton)
    q = q or _Cuda()
    k = k or _Cuda()
    return sel.choose(q, k, k, rows=rows, **features)


def test_the_shipped_table_has_the_h100_run_book_figures():
    rows = [r for r in sel.attention_table.ROWS if r["device"] == H100]
    got = {(r["mask"], r["causal"]): (r["train"]["triton"], r["train"]["torch"]) for r in rows}
    assert got == {("none", True): (146, 479), ("docs", True): (88, 22),
                   ("none", False): (152, 548), ("docs", False): (111, 45)}
    for r in sel.attention_table.ROWS:  # every row names where its figures came from
        assert r["source"] and r["seq"] > 0 and {"train", "fwd"} <= set(r)


@pytest.mark.parametrize(
    "features, want, figures",
    [
        ({}, "torch", "torch 479 TFLOP/s fwd+bwd against triton 146"),
        ({"causal": False}, "torch", "torch 548 TFLOP/s fwd+bwd against triton 152"),
        ({"sequence_id": "ids"}, "triton", "triton 88 TFLOP/s fwd+bwd against torch 22"),
        ({"sequence_id": "ids", "causal": False}, "triton", "triton 111 TFLOP/s fwd+bwd"),
    ],
    ids=["one-causal", "one-full", "packed-causal", "packed-full"],
)
def test_auto_on_an_h100_picks_sdpa_for_one_document_and_triton_for_packed(
        monkeypatch, features, want, figures):
    name, reason = h100_choice(monkeypatch, **features)
    assert name == want
    assert reason.startswith(f"fastest measured on {H100} for head dim 128, ")
    assert figures in reason and "benchmarks/RESULTS.md" in reason


def test_forward_only_calls_rank_by_forward_figures(monkeypatch):
    q = _Cuda()
    q.requires_grad = False
    k = _Cuda()
    k.requires_grad = False
    name, reason = h100_choice(monkeypatch, q=q, k=k, sequence_id="ids")
    assert name == "triton" and "triton 116 TFLOP/s fwd against torch 19" in reason


def test_no_row_for_this_device_chooses_sdpa_and_says_so(monkeypatch):
    name, reason = h100_choice(monkeypatch, device="NVIDIA A100-SXM4-80GB", sequence_id="ids")
    assert name == "torch"
    assert reason == (
        "the attention table (foundryx/models/layers/attention_table.py) has no row for this "
        "device (NVIDIA A100-SXM4-80GB); SDPA, without measuring (python -m benchmarks.attention "
        "--table measures rows for it)")
    # an H100 PCIe is another kind of device: the SXM's rows do not apply
    assert h100_choice(monkeypatch, device="NVIDIA H100 PCIe")[0] == "torch"


def test_no_row_for_this_case_chooses_sdpa(monkeypatch):
    name, reason = h100_choice(monkeypatch, alibi_slopes="slopes")
    assert name == "torch"
    assert reason == (f"the attention table has rows for {H100} but none for head dim 128, one "
                      "document + alibi, causal, MHA; SDPA, without measuring")


def row(mask="none", head_dim=128, gqa=False, **train):
    return {"device": "GPU X", "arch": "sm90", "head_dim": head_dim, "mask": mask,
            "causal": True, "gqa": gqa, "seq": 2048, "train": train, "fwd": train, "source": "t"}


def test_rows_in_choice_out(monkeypatch):
    rows = [row(torch=100, triton=300, flash=200), row("docs+alibi", triton=90, torch=10),
            row(head_dim=64, torch=50, triton=10), row(gqa=True, torch=500, flash=400)]
    pick = functools.partial(h100_choice, monkeypatch, rows=rows, device="gpu x")  # any case
    assert pick()[0] == "triton"
    assert pick(sequence_id="i", alibi_slopes="s")[0] == "triton"
    assert pick(q=_Cuda(head_dim=64), k=_Cuda(head_dim=64))[0] == "torch"
    assert pick(k=_Cuda(heads=4))[0] == "torch"  # the GQA row
    # the nearest row: head dim 96 is nearer 128 than 64 (a tie goes to the larger)
    name, reason = pick(q=_Cuda(head_dim=96), k=_Cuda(head_dim=96))
    assert name == "triton" and "(nearest row: head dim 128, measured at seq 2048)" in reason
    name, reason = pick(rows=rows[:1], k=_Cuda(heads=4))
    assert name == "triton" and "(nearest row: MHA, measured at seq 2048)" in reason
    # the fastest cannot run here: the next that can, and why
    name, reason = pick(triton="the Triton kernel is broken")
    assert name == "flash"
    assert reason.endswith("; triton (300) cannot run: the Triton kernel is broken [t]")
    assert pick(triton="no", flash="flash-attn is not installed")[0] == "torch"
    assert pick(rows=[row(triton=300)], triton="no")[0] == "torch"


def test_auto_logs_one_line_per_choice(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(sel, "choose", lambda q, k, v, p, **kw: ("torch", f"why {sorted(kw)}"))
    monkeypatch.setitem(sel._impls, "torch", lambda q, k, v, **kw: calls.append(kw))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            sel.auto_attention(*qkv(), causal=True, sequence_id=None)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "attention: auto chose 'torch': why ['causal', 'sequence_id']"]
    assert len(calls) == 3


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
