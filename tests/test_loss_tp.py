"""The fused loss with its output projection split by vocabulary rows (tensor parallelism's
vocabulary-parallel head: the model's single-device loss and logits in the vocabulary-parallel
forms of foundryx.parallel.vocab_rows), on 2 gloo processes against the whole loss in float64: the loss, the
hidden states' gradient and the weight's gradient, and the whole logits read from a split
weight."""

from __future__ import annotations

import torch
from distributed import run_distributed

from foundryx.models.layers.head import output_logits
from foundryx.models.layers.loss import linear_cross_entropy
from foundryx.parallel.vocab_rows import gathered_logits, split_loss

VOCAB, D = 67, 16  # 34 + 33 rows: a vocabulary the ranks do not split evenly


def _split_against_whole(scale: float | None) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 40, D, dtype=torch.float64, generator=g)
    w = torch.randn(VOCAB, D, dtype=torch.float64, generator=g)
    labels = torch.randint(0, VOCAB, (3, 40), generator=g)
    labels[0, :7] = -100  # ignored
    labels[1, :4] = torch.tensor([0, 33, 34, VOCAB - 1])  # each rank's first and last rows
    h_whole, w_whole = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = linear_cross_entropy(h_whole, w_whole, labels, scale, chunk=16)
    want.backward()
    reference = torch.nn.functional.cross_entropy(
        (h @ w.T * (scale or 1.0)).flatten(0, 1), labels.flatten(), ignore_index=-100)
    h_split = h.clone().requires_grad_()
    w_split = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    got = split_loss(linear_cross_entropy)(h_split, w_split, labels, scale, chunk=16)
    got.backward()
    logits = gathered_logits(output_logits)(h, w_split.detach(), scale)
    return {
        "loss": (got - want).abs().item(),
        "reference": (want - reference).abs().item() / reference.item(),
        "grad h": (h_split.grad - h_whole.grad).abs().max().item(),
        "grad w": (w_split.grad.full_tensor() - w_whole.grad).abs().max().item(),
        "grad w rows": w_split.grad.to_local().shape[0],
        "logits": (logits - h @ w.T * (scale or 1.0)).abs().max().item(),
        "logits type": type(logits).__name__,
    }


def test_a_vocabulary_split_loss_equals_the_whole_one_in_float64():
    for scale in (None, 0.25):
        results = run_distributed(_split_against_whole, world_size=2, args=(scale,))
        for rank, r in enumerate(results):
            assert r["reference"] < 1e-14, r  # the fused loss is cross entropy
            assert r["loss"] < 1e-14 and r["grad h"] < 1e-14 and r["grad w"] < 1e-14, (scale, r)
            assert r["grad w rows"] == (34, 33)[rank], r  # each rank's gradient its own rows
            assert r["logits"] < 1e-14 and r["logits type"] == "Tensor", r  # whole, plain
