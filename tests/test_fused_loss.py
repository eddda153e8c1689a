"""The training loss fused with the output projection: the same numbers as logits + cross
entropy (float64 reference), and the vocabulary logits are never held whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from foundryx.models.layers import loss as loss_module
from foundryx.models.layers.loss import linear_cross_entropy
from foundryx.models.mpt.composer import ComposerMPTCausalLM


def reference(h, w, y, scale):
    logits = F.linear(h, w) * (scale if scale is not None else 1.0)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("chunk", [7, 64, 1000])  # a last chunk shorter than the others; one
def test_matches_float64_reference_loss_and_gradients(scale, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 41, 24, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(257, 24, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 257, (3, 41), generator=g)
    y[0, :9] = -100  # ignored positions count in neither the sum nor the mean
    want = reference(h, w, y, scale)
    want_grads = torch.autograd.grad(want * 2.5, (h, w))  # the upstream gradient is honoured
    got = linear_cross_entropy(h, w, y, scale, chunk=chunk)
    got_grads = torch.autograd.grad(got * 2.5, (h, w))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("grads", ["none", "h only"])  # evaluation; a frozen (LoRA) projection
def test_partial_gradients_match_float64_reference(grads):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 33, 16, dtype=torch.float64, generator=g, requires_grad=grads != "none")
    w = torch.randn(101, 16, dtype=torch.float64, generator=g)
    y = torch.randint(0, 101, (2, 33), generator=g)
    y[1, -5:] = -100
    got = linear_cross_entropy(h, w, y, 0.5, chunk=10)
    torch.testing.assert_close(got, reference(h, w, y, 0.5), rtol=0, atol=1e-12)
    if grads == "h only":
        (want,) = torch.autograd.grad(reference(h, w, y, 0.5), h)
        torch.testing.assert_close(torch.autograd.grad(got, h)[0], want, rtol=0, atol=1e-12)


def test_bf16_autocast_matches_unfused_autocast():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 64, 32, generator=g, requires_grad=True)
    w = torch.randn(300, 32, generator=g, requires_grad=True)
    y = torch.randint(0, 300, (2, 64), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(h, w, y, None)
        got = linear_cross_entropy(h, w, y, chunk=50)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)
    gh, gw = torch.autograd.grad(got, (h, w))
    rh, rw = torch.autograd.grad(want, (h, w))
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    torch.testing.assert_close(gh, rh, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(gw, rw, rtol=5e-2, atol=5e-3)


def tiny_mpt(tie: bool) -> ComposerMPTCausalLM:
    torch.manual_seed(0)
    return ComposerMPTCausalLM(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=4096,
                               tie_word_embeddings=tie, logit_scale=None if tie else 0.5)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0  # padding: its labels are ignored
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("tie", [True, False])
def test_training_step_loss_and_gradients_equal_the_logits_path(tie):
    model, b = tiny_mpt(tie), batch()
    model.train()
    fused_out = model(b)
    assert fused_out.logits is None  # a training step never builds the logits
    fused = model.loss(fused_out, b)
    fused.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        model.eval()
        logits_out = model(b)
    assert logits_out.logits.shape == (4, 64, 4096)
    model.train()
    plain = model.loss(model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]), b)
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.loss(logits_out, b), plain.detach(), rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_training_step_never_holds_the_whole_vocabulary_logits():
    model, b = tiny_mpt(True), batch()
    model.model.loss_chunks = loss_module.LossChunks(cpu=64 * 4096 * 4)  # 64-token chunks
    model.train()
    whole = b["input_ids"].numel() * 4096  # tokens x vocab
    with LargestTensor() as seen:
        model.loss(model(b), b).backward()
    # the largest tensor is a chunk of logits (or the vocab x d_model weight), far below whole
    assert seen.largest <= whole // 2, (seen.largest, whole)
    with LargestTensor() as unfused:
        model.loss(model.model(input_ids=b["input_ids"]), b).backward()
    assert unfused.largest >= whole  # the check would see the logits if they were built


LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("labels", ["given", "padded"])
def test_a_hugging_face_llama_fuses_its_training_loss_with_the_same_numbers(labels, caplog):
    """A Llama's training step returns its loss fused with the output projection and no
    logits (issue 46: the whole logits were the 8B step's peak), equal to the model's own loss
    and gradients; eval keeps the logits; foundryx's choice is said in one line."""
    import logging

    from foundryx.models.hf import ComposerHFCausalLM

    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        model = ComposerHFCausalLM(config=LLAMA, pretrained=False)
    assert [r.getMessage() for r in caplog.records if "fused loss" in r.getMessage()] == [
        "hf_causal_lm: fused loss on (model_type llama: the training loss is taken chunk by "
        "chunk, never holding the whole logits; model.fused_loss sets it)"]
    ids = torch.randint(0, 512, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # padding: -100 labels when labels come from input_ids
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels == "given":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    model.train()
    out = model(batch)
    assert out.logits is None
    fused = model.loss(out, batch)
    fused.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.fuses_loss = False
    out = model(batch)
    assert out.logits is not None
    plain = model.loss(out, batch)
    plain.backward()
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    model.eval()
    with torch.no_grad():
        assert model.eval_forward(batch).shape == (2, 24, 512)


def test_fused_loss_off_or_refused_where_the_head_is_not_a_plain_linear_layer():
    from foundryx.errors import ConfigError
    from foundryx.models.hf import ComposerHFCausalLM

    gpt2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 1, "n_head": 2}
    assert not ComposerHFCausalLM(config=gpt2, pretrained=False).fuses_loss  # not in FUSABLE
    assert not ComposerHFCausalLM(config=LLAMA, pretrained=False, fused_loss=False).fuses_loss
    neox = {"model_type": "gpt_neox", "vocab_size": 256, "hidden_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    assert ComposerHFCausalLM(config=neox, pretrained=False, fused_loss=True).fuses_loss
    with pytest.raises(ConfigError, match="fused_loss: true, but"):
        from torch import nn

        from foundryx.models import hf

        model = ComposerHFCausalLM(config=LLAMA, pretrained=False).model
        model.lm_head = nn.Linear(64, 512, bias=True)
        hf.fuses_loss(model, True)
