"""What one rank of a tensor-parallel group holds of the model's weights (and uses of k and v),
arithmetic on the parameter census (census.py): q, k, v, gate and up split column-wise, o and
down row-wise, k and v with their heads when ``tp`` divides them (else whole: foundryx's
parallel/tp_kv), the embedding and the output projection as the vocabulary mode splits them,
norms and biases whole. memory.py's terms and tp.py's options read it."""

from __future__ import annotations

from foundryx.plan.census import Census

__all__ = ["kv_divisor", "kv_weight_divisor", "tp_block_params", "tp_linear_fraction",
           "tp_other", "tp_params"]


def kv_divisor(sh, tp: int) -> int:
    """The share of k and v a rank uses under TP (their activations): the kv heads split over
    ``tp`` when they divide, else one whole kv head per rank (kv_heads, when tp is a multiple
    of them: its q heads' head), else nothing is split."""
    if sh.kv_heads % tp == 0:
        return tp
    return sh.kv_heads if tp % sh.kv_heads == 0 else 1


def kv_weight_divisor(sh, tp: int) -> int:
    """The share of the k and v weights a rank holds under TP: split with the kv heads when
    tp divides them, else whole (replicated over the TP ranks; foundryx.parallel.tp_kv)."""
    return tp if sh.kv_heads % tp == 0 else 1


def _replicated_q(sh, tp: int) -> bool:
    """Whether q is replicated with k and v (a fused projection whose kv heads are)."""
    return sh.qkv_fused and sh.kv_heads % tp != 0


def tp_linear_fraction(c: Census, tp: int) -> float:
    """The share of the blocks' linear weights one rank holds under TP (column-wise q, k, v,
    gate, up and row-wise o, down: 1/tp each, k and v by :func:`kv_weight_divisor`)."""
    if tp <= 1 or not c.block_linear:
        return 1.0
    sh = c.shape
    kv = min(sh.n_layers * 2 * sh.kv_heads * (sh.d_model // sh.n_heads) * sh.d_model,
             c.block_linear)
    if _replicated_q(sh, tp):  # MPT's Wqkv replicated whole: q with k and v
        kv = min(kv + sh.n_layers * sh.d_model * sh.d_model, c.block_linear)
    return ((c.block_linear - kv) / tp + kv / kv_weight_divisor(sh, tp)) / c.block_linear


def tp_other(c: Census, tp: int, vocab: str = "parallel") -> float:
    """Parameters outside the blocks' linear layers one rank holds under TP: the embedding
    and the output projection as ``vocab`` (TP_VOCAB_MODES) splits them, norms and biases
    whole."""
    split = {"parallel": c.vocab_params, "head": c.head_params, "replicated": 0}[vocab]
    return c.other - split + split / max(tp, 1)


def tp_params(c: Census, tp: int, vocab: str = "parallel") -> float:
    """All parameters one rank of a TP group holds (before FSDP shards them further)."""
    return c.block_linear * tp_linear_fraction(c, tp) + tp_other(c, tp, vocab)


def tp_block_params(c: Census, tp: int) -> float:
    """One block's parameters one rank of a TP group holds (its FSDP unit)."""
    linear = c.block_linear / c.shape.n_layers
    return c.per_block - linear + linear * tp_linear_fraction(c, tp)
