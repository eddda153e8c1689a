"""Next-token cross entropy fused with the output projection, chunk by chunk.

``linear_cross_entropy(h, weight, labels)`` equals
``F.cross_entropy((h @ weight.T) * scale, labels, ignore_index=-100)`` (token mean), but never
holds the ``tokens x vocab`` logits whole: it projects ``chunk`` tokens at a time, takes their
loss and, when a gradient is wanted, their gradients with respect to ``h`` and ``weight`` in
the same pass (the softmax minus the one-hot target, times the projection), then drops the
chunk's logits. Peak memory for the loss is one chunk's logits instead of the whole batch's
logits, their log-softmax and their gradient (three ``tokens x vocab`` fp32 tensors: 2.5 GB for
4 x 2048 tokens of a 50k vocabulary), and no matmul is repeated: backward only scales the saved
gradients by the incoming one. The same idea as Liger-Kernel's fused linear cross entropy,
written in plain PyTorch so it runs on every device.

The same function serves a vocabulary split by rows over ranks (tensor parallelism's
vocabulary-parallel head) without knowing of ranks: ``weight`` is then this rank's rows, and
``vocab`` (a :class:`VocabShard`, supplied from outside by
``foundryx.parallel.vocab_rows``) says which rows they are and combines each chunk's row maxima
and sums of exponentials (with the target's logit, from the rank that holds it) over the ranks,
and the input's gradient once at the end. Each rank holds one chunk of its 1/N of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from foundryx.kernels import cpu_matmul

IGNORE_INDEX = -100
# One chunk's fp32 logits: on a GPU large enough for full-speed matmuls (each chunk reads the
# whole output projection, forward and for the input's gradient: with 64 MB of logits a chunk
# was 130 tokens at Llama 3's 128k vocabulary, 130 FLOPs a byte of weight, under an H100's
# ridge of 295, and the 8B step's loss read the 1 GB head 126 times; 256 MB gives 523 tokens
# there, 32 reads, and 1,330 tokens at MPT's 50k: the op census, benchmarks/RESULTS.md); on a
# CPU small enough to stay in its caches through the
# in-place passes over them (16 MB measured 1.5% faster per training step than 64 MB for
# vocabulary 8192 on the 2-core benchmark VM, benchmarks/RESULTS.md)
@dataclass(frozen=True)
class LossChunks:
    """Bytes of one chunk's fp32 logits, on a GPU and on a CPU (the reasons above): an option
    of the model that calls the fused loss (``MPTForCausalLM.loss_chunks``, a Hugging Face
    model's ``foundryx_loss_chunks``), default :data:`DEFAULT_CHUNKS`. The CPU instruments
    give a CPU model the GPU's (benchmarks/instruments/fake_step.py)."""

    gpu: int = 256 * 2**20
    cpu: int = 16 * 2**20


DEFAULT_CHUNKS = LossChunks()


class VocabShard(Protocol):
    """This rank's rows of a vocabulary split over ranks, and the reductions that combine the
    ranks' partial results in place (a max and a sum over the ranks)."""

    first: int  # the vocabulary row of this rank's first weight row

    def max_(self, t: torch.Tensor) -> None: ...

    def sum_(self, t: torch.Tensor) -> None: ...


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross entropy of position t predicting ``labels[:, t + 1]``; labels equal to
    -100 are ignored (the unfused loss, from whole logits)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )


def chunk_tokens(vocab_size: int, device: str = "cuda",
                 chunks: LossChunks = DEFAULT_CHUNKS) -> int:
    """Tokens per chunk so that a chunk's fp32 logits take about ``chunks.gpu`` bytes
    (``chunks.cpu`` on ``device`` "cpu")."""
    budget = chunks.cpu if device == "cpu" else chunks.gpu
    return max(64, budget // (4 * vocab_size))


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    scale: float | None = None,
    chunk: int | None = None,
    vocab: VocabShard | None = None,
    chunks: LossChunks = DEFAULT_CHUNKS,
) -> torch.Tensor:
    """Token-mean cross entropy of ``(h @ weight.T) * scale`` against ``labels`` (-100:
    ignored), ``h`` (..., d) and ``labels`` (...) already aligned (shift before calling).
    Under autocast the projection runs in the autocast dtype and the softmax in fp32, as the
    unfused ``F.linear`` + ``F.cross_entropy`` would. With ``vocab``, ``weight`` is this
    rank's rows of a vocabulary split (see the module's docstring); ``h`` and ``labels`` are
    then whole on every rank, and so is the loss. ``chunk``: tokens per chunk; default from
    ``chunks`` (:func:`chunk_tokens`)."""
    chunk = chunk or chunk_tokens(weight.shape[0], h.device.type, chunks)
    return _LinearCrossEntropy.apply(h, weight, labels, scale, chunk, vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, scale, chunk, vocab):  # noqa: D102
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        # the gradient of each input only if it needs one: under LoRA the (tied) output
        # projection is frozen, and a vocab x d_model gradient of it would be pure waste
        want_grad_h, want_grad_w = ctx.needs_input_grad[:2]
        want_grad = want_grad_h or want_grad_w
        acc = torch.promote_types(dtype, torch.float32)  # softmax and sums: fp32 or better
        with torch.autocast(device, enabled=False):
            x_all = h.reshape(-1, h.shape[-1]).to(dtype)
            w = weight.to(dtype)
            y_all = labels.reshape(-1)
            n_valid = (y_all != IGNORE_INDEX).sum()
            total = torch.zeros((), dtype=acc, device=h.device)
            grad_x = torch.empty_like(x_all) if want_grad_h else None
            grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if want_grad_w else None
            # one logits buffer for every chunk, each step below in place: a fresh chunk-sized
            # tensor per operation costs more than the arithmetic (on CPU, mostly the page
            # faults of each new allocation), and exp is taken once, for the loss and softmax
            buf = torch.empty((min(chunk, x_all.shape[0]), w.shape[0]), dtype=acc, device=h.device)
            mult = 1.0 if scale is None else scale
            first = 0 if vocab is None else vocab.first
            rows = w.shape[0]
            for start in range(0, x_all.shape[0], chunk):
                x, y = x_all[start:start + chunk], y_all[start:start + chunk]
                logits = buf[:x.shape[0]]
                if cpu_matmul.uses_onednn(x, w):  # its own output: a copy would cost more
                    logits = cpu_matmul.mm(x, w.T)
                elif dtype == acc:
                    torch.mm(x, w.T, out=logits)
                else:
                    logits.copy_(x @ w.T)
                if scale is not None:
                    logits.mul_(scale)
                valid = y != IGNORE_INDEX
                local = y.clamp(min=0) - first  # the target's row among this rank's
                here = valid & (local >= 0) & (local < rows)
                target = local.clamp(0, rows - 1).unsqueeze(1)
                target_logit = logits.gather(1, target).squeeze(1) * here
                row_max = logits.amax(dim=1, keepdim=True)
                if vocab is not None:
                    vocab.max_(row_max)
                exp = logits.sub_(row_max).exp_()
                norm = exp.sum(dim=1, keepdim=True)
                if vocab is not None:  # every rank's sum of exponentials, and the target's logit
                    both = torch.cat([norm, target_logit.unsqueeze(1)], dim=1)
                    vocab.sum_(both)
                    norm, target_logit = both[:, :1], both[:, 1]
                lse = (row_max + norm.log()).squeeze(1)
                total += ((lse - target_logit) * valid).sum()
                if want_grad:  # d(sum of losses)/d(logits) = softmax - one_hot, on valid rows
                    # softmax times the scale's chain factor, zero on ignored rows: one pass
                    g = exp.mul_(torch.where(valid.unsqueeze(1), mult / norm, 0.0))
                    g.scatter_add_(1, target, (-mult * here.to(acc)).unsqueeze(1))
                    g = g.to(dtype)
                    if want_grad_h and dtype == acc:
                        cpu_matmul.mm(g, w, out=grad_x[start:start + chunk])
                    elif want_grad_h:
                        grad_x[start:start + chunk] = g @ w
                    if want_grad_w and cpu_matmul.uses_onednn(g, x):
                        grad_w += cpu_matmul.mm(g.T, x)
                    elif want_grad_w and g.dtype == acc:
                        grad_w.addmm_(g.T, x)
                    elif want_grad_w:
                        grad_w += (g.T @ x).to(acc)
            if vocab is not None and want_grad_h:  # each rank's rows' share of it, summed
                summed = grad_x.to(acc)
                vocab.sum_(summed)
                grad_x.copy_(summed)
        loss = total / n_valid  # nan when every label is ignored, as F.cross_entropy gives
        if want_grad:
            denom = n_valid.clamp(min=1).to(acc)
            ctx.save_for_backward(
                (grad_x.view(h.shape) / denom.to(grad_x.dtype)).to(h.dtype) if want_grad_h else None,
                (grad_w / denom).to(weight.dtype) if want_grad_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: D102
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype),
                None, None, None, None)
