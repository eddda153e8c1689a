"""The fused loss of a Hugging Face model under FSDP2 (issue 51): two ranks, each with half of
the batch and half of every weight, take the same loss and the same gradients as one process
with the whole batch, and still never hold a rank's whole logits. FSDP2 gathers the model's
top-level weights (the output head among them) for the fused loss as for ``forward``
(``foundryx_forward_methods``, parallel/fsdp.py); before, every sharded head turned the fused
loss off."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

# a vocabulary large enough that a rank's whole fp32 logits (2 x 256 tokens: 64 MiB) are four
# of the fused loss's CPU chunks (16 MiB)
LLAMA = {"model_type": "llama", "vocab_size": 32768, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
GLOBAL_BATCH, SEQ = 4, 256
LOGITS_PER_RANK = GLOBAL_BATCH // 2 * SEQ * LLAMA["vocab_size"] * 4  # fp32 bytes
CHECKED = ("model.model.embed_tokens.weight", "model.lm_head.weight",
           "model.model.layers.1.mlp.down_proj.weight")


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _step(fused: bool, tied: bool) -> dict:
    """One training step's loss, whether the output was fused, the largest tensor made, and
    the whole gradients of CHECKED; the batch is this rank's share of the global batch."""
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.hf import ComposerHFCausalLM
    from foundryx.parallel.parallelize import parallelize

    world = tdist.get_world_size() if tdist.is_initialized() else 1
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    torch.manual_seed(0)
    model = ComposerHFCausalLM(config={**LLAMA, "tie_word_embeddings": tied}, pretrained=False,
                               fused_loss=fused)
    ids = torch.randint(0, LLAMA["vocab_size"], (GLOBAL_BATCH, SEQ),
                        generator=torch.Generator().manual_seed(1))
    share = GLOBAL_BATCH // world
    batch = {"input_ids": ids[rank * share:(rank + 1) * share]}
    parallelize(model, ParallelismConfig(mixed_precision="FULL"), precision="fp32",
                device=torch.device("cpu"))
    model.train()
    with LargestTensor() as largest:
        out = model(batch)
        loss = model.loss(out, batch)
        loss.backward()
    params = dict(model.named_parameters())
    grads = {}
    for name in CHECKED:
        if name in params:  # the tied head is the embedding
            g = params[name].grad
            grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    if world > 1:
        tdist.all_reduce(loss.detach(), op=tdist.ReduceOp.SUM)
    return {"loss": loss.item() / world if world > 1 else loss.item(), "fused": out.logits is None,
            "largest": largest.bytes, "grads": grads, "fuses_loss": model.fuses_loss}


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_two_fsdp2_ranks_fuse_the_loss_with_one_process_s_numbers(tied):
    one = _step(True, tied)
    two = run_distributed(_step, 2, args=(True, tied))
    assert one["fused"] and all(r["fused"] and r["fuses_loss"] for r in two)
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, want in one["grads"].items():
        for r in two:
            torch.testing.assert_close(r["grads"][name], want, rtol=1e-4, atol=1e-6, msg=name)
    # no rank holds its whole logits: the largest tensor is one chunk's (or a gathered weight)
    assert all(r["largest"] <= LOGITS_PER_RANK / 3 for r in two), [r["largest"] for r in two]
    if not tied:  # the model's own loss on the same two ranks does hold them
        plain = run_distributed(_step, 2, args=(False, tied))
        assert not plain[0]["fused"] and plain[0]["largest"] >= LOGITS_PER_RANK
        assert plain[0]["loss"] == pytest.approx(two[0]["loss"], rel=1e-5)
