"""``attn_impl: flex``: FlexAttention with a block mask built from the documents.

On CPU FlexAttention runs eagerly, which evaluates the mask function on every pair and never
reads the block structure; what a GPU's compiled kernel reads (which key blocks each query block
visits, and where it may skip the mask) is checked separately against the blocks of the dense
reference mask. Both run at lengths that are not multiples of the block.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundryx import registry
from foundryx.errors import FoundryxError
from foundryx.models.layers import attention_select as sel
from foundryx.models.layers.attention import torch_attention
from foundryx.models.layers.attention_flex import document_block_mask, flex_attention
from tests.test_attention_select import _Cuda, h100_choice
from tests.test_attention_torch import reference_attention

B, S, H, D = 2, 37, 4, 8  # 37: not a multiple of any block
SEQUENCE_ID = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [3] * 5 + [4] * 32])
PADDED = torch.tensor([[True] * 30 + [False] * 7, [True] * 37])  # padding: the last document
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])

CASES = {
    "causal": {},
    "full": {"causal": False},
    "packed": {"sequence_id": SEQUENCE_ID},
    "packed_full": {"sequence_id": SEQUENCE_ID, "causal": False},
    "alibi": {"alibi_slopes": SLOPES, "softmax_scale": 0.3},
    "window": {"sliding_window": 5},
    "window_full": {"sliding_window": 4, "causal": False},
    "padding": {"key_padding_mask": PADDED},
    "all": {"sequence_id": SEQUENCE_ID, "alibi_slopes": SLOPES, "sliding_window": 6,
            "key_padding_mask": PADDED},
}


def qkv(kv_heads=H, seq=S, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = [(B, seq, H, D)] + [(B, seq, kv_heads, D)] * 2
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize(
    "case, kv_heads",
    [(case, H) for case in CASES] + [("packed", 1), ("all", 1), ("all", 2)],
    ids=[*CASES, "packed-mqa", "all-mqa", "all-gqa"])
def test_matches_the_float64_reference(case, kv_heads):
    kw = CASES[case]
    q, k, v = qkv(kv_heads)
    got, want = flex_attention(q, k, v, **kw), reference_attention(q, k, v, **kw)
    assert got.shape == (B, S, H, D)
    real = kw.get("key_padding_mask", torch.ones(B, S, dtype=torch.bool))
    torch.testing.assert_close(got[real], want[real], rtol=1e-12, atol=1e-12)


def test_gradients_match_the_reference_with_gqa():
    kw = {"sequence_id": SEQUENCE_ID[:, :20], "alibi_slopes": SLOPES, "sliding_window": 6}
    grads = []
    for fn in (flex_attention, reference_attention):
        q, k, v = qkv(kv_heads=2, seq=20, grad=True)
        out = fn(q, k, v, **kw)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        grads.append([t.grad for t in (q, k, v)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_low_precision_is_close_to_the_reference():
    q, k, v = qkv(kv_heads=2, dtype=torch.bfloat16)
    kw = {"sequence_id": SEQUENCE_ID, "alibi_slopes": SLOPES}
    got = flex_attention(q, k, v, **kw)
    want = reference_attention(q.double(), k.double(), v.double(), **kw)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def dense_keep(seq, causal=True, sequence_id=None, key_padding_mask=None, sliding_window=None):
    """(batch, seq, seq) bool from the definitions, pair by pair (independent of the code)."""
    keep = torch.zeros(B, seq, seq, dtype=torch.bool)
    for b in range(B):
        for i in range(seq):
            for j in range(seq):
                keep[b, i, j] = not (
                    (causal and j > i)
                    or (sliding_window is not None and abs(i - j) > sliding_window)
                    or (sequence_id is not None and sequence_id[b, i] != sequence_id[b, j])
                    or (key_padding_mask is not None and not key_padding_mask[b, j]))
    return keep


def blocks_seen(mask, n):
    """(partial, full) bool (batch, n, n) from a BlockMask's index lists: what the compiled
    kernel visits, with and without evaluating the mask function."""
    out = []
    for num, idx in ((mask.kv_num_blocks, mask.kv_indices),
                     (mask.full_kv_num_blocks, mask.full_kv_indices)):
        seen = torch.zeros(B, n, n, dtype=torch.bool)
        for b in range(B):
            for r in range(n):
                seen[b, r, idx[b, 0, r, : num[b, 0, r]].long()] = True
        out.append(seen)
    return out


def random_case(rng, seq):
    ids = []
    for _ in range(B):
        row, doc = [], 0
        while len(row) < seq:
            row += [doc] * rng.randint(1, 2 * seq // 3)
            doc += 1
        ids.append(row[:seq])
    pad = torch.ones(B, seq, dtype=torch.bool)
    pad[0, seq - rng.randint(1, 9):] = False  # right padding
    pad[1, : rng.randint(1, 12)] = False  # left padding
    return {"causal": rng.random() < 0.5,
            "sequence_id": torch.tensor(ids) if rng.random() < 0.8 else None,
            "key_padding_mask": pad if rng.random() < 0.4 else None,
            "sliding_window": rng.randint(1, 12) if rng.random() < 0.4 else None}


@pytest.mark.parametrize("seed", range(6))
def test_the_blocks_a_gpu_visits_are_those_of_the_reference_mask(seed):
    """Every block with a kept pair is visited; a block is visited without the mask only when
    it is whole and every pair in it is kept; evaluating the mask in the visited blocks gives
    the reference mask exactly."""
    rng = random.Random(seed)
    seq, block = rng.choice([37, 45, 61]), 8
    n = -(-seq // block)
    kw = random_case(rng, seq)
    keep = dense_keep(seq, **kw)
    mask = document_block_mask(B, seq, block=block, **kw)
    partial, full = blocks_seen(mask, n)
    padded = torch.nn.functional.pad(keep, (0, n * block - seq, 0, n * block - seq))
    tiles = padded.view(B, n, block, n, block).transpose(2, 3)
    any_kept, all_kept = tiles.any((-1, -2)), tiles.all((-1, -2))
    whole = torch.ones(n, n, dtype=torch.bool)
    if seq % block:
        whole[-1, :] = whole[:, -1] = False
    assert torch.equal(full, all_kept & whole)
    assert torch.equal(partial, any_kept & ~(all_kept & whole))
    # the mask as a compiled kernel applies it: mask_mod in partial blocks, all in full ones
    idx = torch.arange(seq)
    qb, kb = idx[:, None] // block, idx[None, :] // block
    applied = torch.zeros(B, seq, seq, dtype=torch.bool)
    for b in range(B):
        mod = mask.mask_mod(torch.tensor(b), torch.tensor(0), idx[:, None], idx[None, :])
        applied[b] = (partial[b][qb, kb] & mod) | full[b][qb, kb]
    assert torch.equal(applied, keep)
    # the lists by key block (for the backward) are the transposes, as torch makes them
    torch_made = type(mask).from_kv_blocks(
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        BLOCK_SIZE=block, seq_lengths=(seq, seq))
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        mine, theirs = getattr(mask, name), getattr(torch_made, name)
        if name.endswith("indices"):  # past each count the order is free
            counts = getattr(mask, name.replace("indices", "num_blocks"))
            used = torch.arange(mine.shape[-1]) < counts[..., None]
            mine, theirs = mine[used], theirs[used]
        assert torch.equal(mine, theirs), name


class LargestTensor(TorchDispatchMode):
    """The most bytes any one tensor made under it held."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_a_128k_token_packed_mask_is_blocks_not_a_dense_mask():
    """At 128K tokens a dense boolean mask is 16 GiB; the block mask is O((seq / 128)²)."""
    seq, block = 1 << 17, 128
    n = seq // block
    lengths = [3000, 50_000, 777, 60_000]
    ids = torch.cat([torch.full((m,), d) for d, m in enumerate(lengths + [seq - sum(lengths)])])
    pad = torch.ones(1, seq, dtype=torch.bool)
    pad[0, -100:] = False
    with LargestTensor() as seen:
        mask = document_block_mask(1, seq, sequence_id=ids[None], key_padding_mask=pad,
                                   sliding_window=8192)
    assert mask.kv_indices.shape == (1, 1, n, n)
    assert seen.largest <= 8 * n * n < seq * seq // 1000  # 8 MiB: int64 block pairs
    # the blocks visited: about what the documents and window hold, not seq² / 2
    visited = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    assert visited < n * (8192 // block + 2)


def test_dropout_is_one_clear_message():
    with pytest.raises(FoundryxError) as err:
        flex_attention(*qkv(), dropout_p=0.1)
    assert str(err.value) == (
        "attn_impl 'flex' cannot run here: attention dropout (attn_pdrop 0.1) is not "
        "implemented by FlexAttention. Fix: set model.attn_config.attn_pdrop: 0, or set "
        "model.attn_config.attn_impl to torch or flash or auto (which picks one that runs "
        "here).")


def test_says_how_it_runs_once(caplog):
    from foundryx.models.layers import attention_flex

    attention_flex.runner.cache_clear()
    with caplog.at_level(logging.INFO, logger=attention_flex.__name__):
        for _ in range(2):
            flex_attention(*qkv(seq=9))
    assert [r.getMessage() for r in caplog.records] == [
        "attention: flex runs FlexAttention eagerly on cpu (dense scores per head: for tests "
        "and short sequences; a GPU runs it compiled, block-sparse)"]


@pytest.fixture
def flex_registered():
    """``flex`` in the registry (its entry point, once the package metadata is reinstalled)."""
    added = "flex" not in registry.attention_implementations
    if added:
        registry.attention_implementations.register("flex", flex_attention)
    yield
    if added:
        registry.attention_implementations.unregister("flex")


def test_an_mpt_with_alibi_on_packed_documents_trains_the_same_with_flex(flex_registered):
    """MPT-1B's shape of attention (ALiBi, packed documents, GQA here): loss and gradients of
    ``flex`` equal those of ``torch`` (SDPA with a dense bias)."""
    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    shape = {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 40, "vocab_size": 50}
    attn = {"alibi": True, "attn_uses_sequence_id": True, "kv_n_heads": 2}
    results = []
    for impl in ("torch", "flex"):
        torch.manual_seed(0)
        model = MPTForCausalLM(MPTConfig(**shape, attn_config={**attn, "attn_impl": impl}))
        model.double()
        ids = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(1))
        out = model(ids, sequence_id=SEQUENCE_ID, labels=ids)
        out.loss.backward()
        results.append((out.loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=0)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_torch_and_flex_agree_on_what_torch_compares():
    """Where ids are contiguous runs (as every packing loader writes them), ``flex`` (runs) and
    ``torch`` (id equality) mean the same mask."""
    q, k, v = qkv(kv_heads=2)
    kw = {"sequence_id": SEQUENCE_ID, "causal": False, "key_padding_mask": PADDED}
    torch.testing.assert_close(flex_attention(q, k, v, **kw)[PADDED],
                               torch_attention(q, k, v, **kw)[PADDED])


# -- attn_impl: auto on a GPU for packed long sequences (stand-in tensors: see test_attention_select)
def long_call(seq=1 << 19, batch=1, **features):
    q = _Cuda()
    q.shape = (batch, seq, 16, 128)
    return q, {"sequence_id": "ids", **features}


def test_auto_on_a_gpu_leaves_sdpa_where_its_dense_mask_is_too_big(monkeypatch):
    q, features = long_call()
    # measured rows where SDPA was the fastest: the next measured one that runs
    rows = [{"device": "GPU X", "arch": "sm90", "head_dim": 128, "mask": "docs", "causal": True,
             "gqa": False, "seq": 4096, "train": {"torch": 500, "triton": 100}, "source": "t"}]
    name, reason = h100_choice(monkeypatch, device="GPU X", rows=rows, q=q, k=q, **features)
    assert name == "triton" and reason.endswith(
        "; torch (500) cannot run: SDPA's dense mask would take 2,304 GiB at 524288 tokens "
        "(auto leaves SDPA past 4 GiB) [t]")
    # a GPU without rows: flash-attn's varlen kernel where installed, else flex
    name, reason = h100_choice(monkeypatch, device="NVIDIA H200", q=q, k=q, **features)
    assert (name, reason) == ("flash", (
        "SDPA's dense mask would take 2,304 GiB at 524288 tokens (auto leaves SDPA past 4 GiB); "
        "flash, the first of flash-attn's varlen kernel, flex and triton that runs this call "
        "(not measured on this device)"))
    name, reason = h100_choice(monkeypatch, device="NVIDIA H200", q=q, k=q,
                               flash="flash-attn is not installed", **features)
    assert name == "flex" and reason.endswith("; flash cannot run: flash-attn is not installed")
    # the H100 with the Triton kernel unable to run: no measured one runs, so the same order
    name, reason = h100_choice(monkeypatch, q=q, k=q, triton="no", **features)
    assert name == "flash" and reason.startswith(
        "no measured implementation can run: triton (88) cannot run: no; torch (22) cannot run: "
        "SDPA's dense mask would take")


def test_auto_keeps_sdpa_for_short_or_unmasked_calls(monkeypatch):
    q, features = long_call(seq=16384)  # 16K: a 2.3 GiB mask
    assert h100_choice(monkeypatch, device="NVIDIA H200", q=q, k=q, **features)[0] == "torch"
    q, _ = long_call()
    assert h100_choice(monkeypatch, device="NVIDIA H200", q=q, k=q)[0] == "torch"  # no mask


def test_auto_with_nothing_else_runnable_says_sdpa_and_why(monkeypatch):
    q, features = long_call(alibi_slopes="s")
    name, reason = h100_choice(monkeypatch, device="NVIDIA H200", q=q, k=q, flash="no flash",
                               triton="no triton", **features)
    assert name == "flex"  # dropout 0: flex runs
    monkeypatch.setattr(sel, "flex_problem", lambda p: "no flex")
    name, reason = h100_choice(monkeypatch, device="NVIDIA H200", q=q, k=q, flash="no flash",
                               triton="no triton", **features)
    assert name == "torch" and reason.endswith(
        "but nothing else runs: flash cannot run: no flash; flex cannot run: no flex; triton "
        "cannot run: no triton; SDPA")


def test_dropout_with_flex_is_caught_before_the_run(flex_registered):
    from config_checks import section_problems

    problems = section_problems("models", "mpt_causal_lm", {
        "d_model": 32, "n_heads": 4, "n_layers": 1, "vocab_size": 50,
        "attn_config": {"attn_impl": "flex", "attn_pdrop": 0.1}})
    assert problems == ["attn_config.attn_pdrop: attn_impl flex has no attention dropout; set "
                        "attn_pdrop: 0, or attn_impl torch or flash"]


GPU = "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path runs on a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_on_a_gpu_matches_the_float64_reference(dtype):
    """The GPU path, torch.compile(flex_attention) over the block mask, at 1,000 tokens (no
    multiple of 128) with packed documents, ALiBi, a window, padding and GQA: forward and
    gradients against float64."""
    g = torch.Generator().manual_seed(0)
    seq, heads = 1000, 8
    lengths = [300, 77, 400, 223]
    ids = torch.cat([torch.full((m,), d) for d, m in enumerate(lengths)])
    kw = {"sequence_id": torch.stack([ids, ids.flip(0)]), "sliding_window": 200,
          "alibi_slopes": torch.logspace(-1, -8, heads, base=2),
          "key_padding_mask": torch.arange(seq).expand(2, seq) < torch.tensor([[990], [1000]])}
    shapes = [(2, seq, heads, 64), (2, seq, 2, 64), (2, seq, 2, 64)]
    base = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    real = kw["key_padding_mask"]
    # no gradient from padding queries' outputs (unspecified, so not the same in both)
    dout = torch.randn(shapes[0], generator=g, dtype=torch.float64) * real[:, :, None, None]
    runs = []
    for device, dt in ((GPU, dtype), ("cpu", torch.float64)):
        q, k, v = (t.to(device, dt).requires_grad_() for t in base)
        fn = flex_attention if device == GPU else torch_attention
        out = fn(q, k, v, **{n: t.to(device) if isinstance(t, torch.Tensor) else t
                             for n, t in kw.items()})
        out.backward(dout.to(device, dt))
        runs.append([t.detach().double().cpu() for t in (out, q.grad, k.grad, v.grad)])
    # of each tensor's largest element; on a CPU (eager) this measured 5.4e-3 (bf16) and 3.1e-7
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, got, want in zip(("out", "dq", "dk", "dv"), *runs):
        if got.shape[2] == heads:  # out and dq: padding queries are unspecified
            got, want = got[real], want[real]
        ratio = float((got - want).abs().max() / want.abs().max())
        assert ratio <= tol, (name, ratio)
