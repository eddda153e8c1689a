"""Tensor parallelism in the plan: the communication of a step (TP collectives within the node,
FSDP2's all-gathers and reduce-scatters), the TP degrees worth trying, and a run re-planned at
another degree for the same global batch.

Communication per step and per rank, counted as the bytes each collective moves (its payload)
and timed as a ring collective does (a rank sends 2 (n-1)/n of an all-reduce's payload and
(n-1)/n of an all-gather's or reduce-scatter's):

- TP: per layer 2 collectives in forward (after the attention's and the MLP's row-wise layer)
  and 2 in backward (the gradients of their column-wise inputs), each of tokens x d_model in
  the compute dtype: all-reduces, or with sequence parallel an all-gather before and a
  reduce-scatter after (the same bytes). Activation checkpointing recomputes the forward's
  (4 + 2 per checkpointed layer). Outside the layers, 3 more of the same size: the first
  block's sequence split (its gradient all-gathered in backward) and the final norm's output
  all-gathered (reduce-scattered in backward); and a vocabulary-parallel embedding's output
  all-reduced. The vocabulary-parallel loss's collectives (a few numbers per token) are left
  out.
- FSDP2 over the shard degree s: each microbatch all-gathers every rank's weights (its 1/tp
  of them under TP) in forward and again in backward (reshard_after_forward), the rank
  receiving (s-1)/s of them, and reduce-scatters the gradients (fp32 under DEFAULT mixed
  precision). TP divides this volume by tp: the same devices hold the weights in s x tp parts.

FSDP's collectives overlap compute (prefetch); a step is all-gather bound when they take
longer than its compute. TP's are on the critical path and add to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from foundryx.plan.census import Census
from foundryx.plan.gpus import CONTENTION
from foundryx.plan.memory import (
    Setup,
    block_gather_bytes,
    terms,
    tp_lora_params,
    vocab_mode,
)
from foundryx.plan.tp_shares import tp_params


@dataclass(frozen=True)
class Links:
    """Per-device link rates (bytes/s, per direction) within a node and across nodes."""

    within: float
    across: float


@dataclass
class Comm:
    """A step's communication per rank, and its time against the step's compute."""

    tp_payload: float  # bytes of the TP collectives' tensors, all layers and microbatches
    tp_sent: float  # bytes a rank sends for them (ring)
    fsdp_gather: float  # bytes of weights a rank receives from FSDP2's all-gathers
    fsdp_reduce: float  # bytes of gradients a rank sends in FSDP2's reduce-scatters
    compute_s: float | None  # the step's compute at the MFU (None: no peak FLOP/s known)
    tp_s: float | None
    fsdp_s: float | None
    fsdp_link: str  # "within the node" | "across nodes" | "none"

    @property
    def all_gather_bound(self) -> bool:
        return bool(self.compute_s and self.fsdp_s and self.fsdp_s > self.compute_s)

    @property
    def step_s(self) -> float | None:
        """Compute plus the exposed TP collectives, or FSDP's when those take longer."""
        if self.compute_s is None:
            return None
        return max(self.compute_s, self.fsdp_s or 0.0) + (self.tp_s or 0.0)

    def to_json(self) -> dict:
        return {**vars(self), "all_gather_bound": self.all_gather_bound, "step_s": self.step_s}


def tp_collectives(s: Setup, n_layers: int, vocab_size: int = 0) -> int:
    """TP collectives per microbatch (see the module's docstring)."""
    if s.tp <= 1:
        return 0
    recomputed = n_layers // max(s.ac_every, 1) if s.activation_checkpointing else 0
    # a vocabulary-parallel embedding's output summed over the TP ranks
    embedding = 1 if vocab_mode(s, vocab_size) == "parallel" else 0
    return 4 * n_layers + 2 * recomputed + 3 + embedding


def communication(c: Census, s: Setup, flops_per_token: float, peak: float | None, mfu: float,
                  links: Links | None) -> Comm:
    """The step's communication per rank (see the module's docstring)."""
    sh = c.shape
    ce, tp, deg = s.compute_bytes, max(s.tp, 1), max(s.shard_degree, 1)
    micro = s.microbatch * s.seq_len * sh.d_model * ce
    payload = tp_collectives(s, sh.n_layers, sh.vocab_size) * micro * s.grad_accum
    sent = payload * 2 * (tp - 1) / tp
    gather = reduce = 0.0
    if s.zero_stage >= 3 and deg > 1:
        outside = c.total - sh.n_layers * c.per_block  # embedding, head, final norm
        mode = vocab_mode(s, sh.vocab_size)
        split = {"parallel": c.vocab_params, "head": c.head_params}.get(mode, 0)
        outside -= split - split / tp  # as the model's TP plan splits them
        weights = sh.n_layers * block_gather_bytes(c, s) + outside * ce
        gathers = 2 if s.reshard_after_forward else 1
        gather = gathers * weights * (deg - 1) / deg * s.grad_accum
        trainable = tp_lora_params(s) if s.lora else tp_params(c, s.tp, mode)
        grad_bytes = 4 if s.mixed_precision == "DEFAULT" or s.precision == "fp32" else ce
        reduce = trainable * grad_bytes * (deg - 1) / deg * s.grad_accum
    node = s.node_size or s.world_size
    link = "none" if not gather else "within the node" if deg * tp <= node else "across nodes"
    compute_s = tp_s = fsdp_s = None
    if peak:
        tokens = s.microbatch * s.grad_accum * s.seq_len  # a TP group's, each rank 1/tp of it
        compute_s = flops_per_token * tokens / tp / (peak * mfu)
    if links:
        tp_s = sent / (links.within * CONTENTION) if sent else 0.0
        rate = links.within if link == "within the node" else links.across
        fsdp_s = (gather + reduce) / (rate * CONTENTION) if gather else 0.0
    return Comm(payload, sent, gather, reduce, compute_s, tp_s, fsdp_s, link)


def tp_degrees(c: Census, node_size: int) -> list[int]:
    """The TP degrees worth trying: divisors of the devices per node (TP stays within a node)
    that divide the attention heads and the kv heads, or are a multiple of the kv heads (the
    plans replicate them)."""
    sh = c.shape
    return [t for t in range(1, node_size + 1) if node_size % t == 0 and sh.n_heads % t == 0
            and (sh.kv_heads % t == 0 or t % sh.kv_heads == 0)]


def at_tp(s: Setup, tp: int) -> Setup | None:
    """``s`` at TP degree ``tp`` on the same devices, for the same global batch: the FSDP
    shard degree gives way (replicas kept), the microbatch of a TP group kept, more
    microbatches per step as each data-parallel rank's share of the batch grows. None when
    the degrees do not divide."""
    replicas = s.world_size // max(s.shard_degree * s.tp, 1) if s.zero_stage >= 3 else 1
    if s.zero_stage >= 3:
        if s.world_size % (replicas * tp):
            return None
        shard = s.world_size // (replicas * tp)
    else:
        shard = s.shard_degree
    if s.world_size % tp:
        return None
    batch = s.microbatch * s.grad_accum * (s.world_size // s.tp)  # the global batch
    per_dp = batch // (s.world_size // tp)
    if batch % (s.world_size // tp) or per_dp < 1:
        return None
    micro = min(s.microbatch, per_dp)
    if per_dp % micro:
        return None
    return replace(s, tp=tp, shard_degree=shard, microbatch=micro, grad_accum=per_dp // micro)


STATE_TERMS = ("frozen_weights", "trainable_weights", "gradients", "optimizer_state")
ACTIVATION_TERMS = ("activations", "backward_working_set", "logits_and_loss", "not_held_together")


@dataclass
class TpOption:
    """The run at one TP degree: its setup, memory per device by group, and communication."""

    tp: int
    setup: Setup
    terms: dict[str, int]
    comm: Comm

    @property
    def per_device_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def state_bytes(self) -> int:
        return sum(self.terms[k] for k in STATE_TERMS)

    @property
    def activation_bytes(self) -> int:
        return sum(self.terms[k] for k in ACTIVATION_TERMS)

    def to_json(self) -> dict:
        return {"tp": self.tp, "shard_degree": self.setup.shard_degree,
                "microbatch": self.setup.microbatch, "grad_accum": self.setup.grad_accum,
                "per_device_bytes": self.per_device_bytes, "state_bytes": self.state_bytes,
                "activation_bytes": self.activation_bytes,
                "fsdp_buffers_bytes": self.terms["fsdp_buffers"], "comm": self.comm.to_json()}


def tp_options(c: Census, s: Setup, flops_per_token: float, peak: float | None, mfu: float,
               links: Links | None) -> list[TpOption]:
    """The run at each TP degree worth trying (the config's own included), same global batch."""
    out = []
    for tp in sorted(set(tp_degrees(c, s.node_size or s.world_size)) | {s.tp}):
        s2 = s if tp == s.tp else at_tp(s, tp)
        if s2 is not None:
            out.append(TpOption(tp, s2, terms(c, s2),
                                communication(c, s2, flops_per_token, peak, mfu, links)))
    return out


def propose_tp(options: list[TpOption], current: int, capacity: int,
               all_gather_bound: bool) -> TpOption | None:
    """The smallest TP degree above ``current`` that fits (and, when the run is all-gather
    bound, is not), or None."""
    for o in options:
        if o.tp > current and o.per_device_bytes <= capacity and not (
                all_gather_bound and o.comm.all_gather_bound):
            return o
    return None
