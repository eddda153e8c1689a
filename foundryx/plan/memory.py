"""Per-device memory of a training run, term by term.

Everything is arithmetic on the parameter census (census.py) and the run's settings (Setup);
each term's docstring line below is what ``foundryx plan`` prints beside it. The static terms
follow the ZeRO paper's accounting (Rajbhandari et al., 2020): a trainable parameter under
bf16 mixed precision costs 2 + 2 bytes of bf16 weight and gradient plus 12 bytes of fp32 master
weight and Adam moments, i.e. 16 bytes. Stage 1 shards the 12 bytes (2 + 2 + 12 / N), stage 2
the gradients too (2 + 14 / N), stage 3 everything (16 / N). Unsharded (DDP under autocast)
and FSDP2 keep the fp32 weight and gradient as the stored copies (4 + 4 + 8, the same 16
bytes), which is how the terms are named for stages 0 and 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from foundryx.models.layers.loss import chunk_tokens
from foundryx.plan.census import Census, Shape
from foundryx.plan.tp_shares import (
    kv_divisor,
    tp_block_params,
    tp_linear_fraction,
    tp_other,
    tp_params,
)

GiB = 2**30

# Bytes per element of frozen linear weights, by frozen_base dtype, scales included:
# fp8 / int8: one fp32 scale per output row (amortised over the row here via `row_scale`);
# nf4 (QLoRA, torchao's NF4Tensor): 4 bits + an int8 scale per 64-element block + an fp32
# factor per 256 scales.
QUANT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
ROW_SCALE_BYTES = {"fp8": 4, "int8": 4}

# Per-device overheads on accelerators (stated, not measured here): the CUDA / ROCm context
# with cuBLAS / hipBLASLt and NCCL / RCCL workspaces, and the caching allocator's reserved-above-
# allocated share. A CPU process has neither, but its compute libraries' buffers and thread
# arenas grow its memory when training starts: benchmarks/plan_accuracy.py's `tiny` case (a
# 1-block, d_model 64 MPT) measures 8.6 MiB (1 process) and 9.1 MiB (2) above its tensors.
CONTEXT_BYTES = {"cuda": 1 * GiB, "rocm": 1 * GiB, "cpu": 9 * 2**20}
FRAGMENTATION = {"cuda": 0.10, "rocm": 0.10, "cpu": 0.0}

# How a model's TP plan treats the vocabulary: "parallel" (torchtitan's: embedding, output
# projection and loss split by vocabulary), "head" (the output projection column-wise, its
# logits gathered whole for the loss; the embedding whole), "replicated" (both whole on
# every TP rank; FSDP still shards them).
TP_VOCAB_MODES = ("parallel", "head", "replicated")

TERM_DOCS = {
    "frozen_weights": "frozen base weights (LoRA), in their storage dtype",
    "trainable_weights": "trainable weights as stored (fp32 master copies under mixed precision)",
    "gradients": "gradients of the trainable weights",
    "optimizer_state": "optimizer state (AdamW: 2 moments per trainable parameter)",
    "activations": "activations kept for backward, at their peak (start of backward)",
    "backward_working_set": "backward's working set: a recomputed block's activations and their gradients (checkpointing), else a block's largest gradients",
    "logits_and_loss": "vocabulary logits and their gradient",  # + how: planner.loss_doc
    "fsdp_buffers": "FSDP2 all-gather (this block and the prefetched next) and reduce-scatter",
    "offload_buffers": "frozen weights brought back from CPU (this block and the next)",
    "cast_buffers": "one weight cast to the compute dtype at a time",
    "not_held_together": "gradients and activations not held at once (the peak is the larger "
                         "of the end of forward, the start and the end of backward)",
    "fragmentation": "caching-allocator margin: reserved above allocated (10% on GPUs)",
    "context": "CUDA / ROCm context and library workspaces (1 GiB assumed; CPU: 9 MiB measured)",
}


@dataclass(frozen=True)
class Setup:
    """The run's settings that decide memory (from the run config and the command line)."""

    world_size: int
    shard_degree: int  # ranks one copy of the weights is split over
    zero_stage: int  # 3: FSDP2 (weights, gradients, optimizer sharded); 0: replicated (DDP)
    microbatch: int
    seq_len: int
    grad_accum: int = 1  # microbatches per step: > 1 keeps every gradient through the forward passes
    precision: str = "amp_bf16"  # fp32 | amp_bf16 | amp_fp16 | amp_fp8
    mixed_precision: str = "DEFAULT"  # FSDP2: DEFAULT | PURE | FULL
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    ac_every: int = 1
    # activation_checkpointing.mode: selective: a checkpointed block keeps also its attention's
    # output and log-sum-exp and every other matmul's output (``selective_kept`` elements a
    # token, settings.selective_widths; foundryx.parallel.selective_ac)
    ac_selective: bool = False
    selective_kept: float = 0.0
    optimizer_states: int = 2  # fp32 states per trainable parameter
    fsdp_cpu_offload: bool = False
    device_kind: str = "cuda"  # cuda | rocm | cpu
    cpu_onednn: bool = False  # on a CPU, fp32 products through oneDNN (cpu_matmul)
    lora_params: int = 0  # trainable adapter parameters; 0: full fine-tuning
    lora_params_per_block: int = 0
    lora_dropout_inputs: int = 0  # input features of the adapted layers of one block, when lora_dropout > 0
    frozen_dtype: str | None = None  # frozen_base.dtype; None: the trainable dtype
    offload_fraction: float = 0.0
    tp: int = 1  # tensor-parallel degree: ranks one layer's weights and heads are split over
    sequence_parallel: bool = True  # with tp > 1: norms, dropout, residual split by sequence
    node_size: int = 0  # devices per node (the TP degrees worth trying divide it); 0: world_size
    # how TP splits the embedding, the output projection and the loss (TP_VOCAB_MODES)
    tp_vocab: str = "parallel"
    # bytes per element of the frozen weights outside the blocks' linear layers (embedding,
    # norms, output projection) where the loader keeps the checkpoint's dtype for them
    # (foundryx/loading/dtypes.py); 0: the stored (master) bytes
    frozen_other_bytes: int = 0
    # activation_checkpointing.cpu_offload: what the blocks save (with checkpointing: their
    # inputs) in host memory, two blocks' worth on the device (the one in use, the prefetched)
    act_offload: bool = False
    mlp_tile: int = 0  # tiling.mlp: tokens a tile (0: not tiled)
    mlp_tile_from: int = 0  # tiling.mlp: auto: tiled from this many tokens a microbatch
    norm_tile: int = 0  # tiling.norm: tokens a tile (0: not tiled)
    norm_tile_from: int = 0  # tiling.norm: auto: tiled from this many tokens a microbatch

    @property
    def mlp_tiled(self) -> bool:
        """Whether the MLP runs in tiles at this microbatch (auto decides on its tokens)."""
        tokens = self.microbatch * self.seq_len
        return self.mlp_tile > 0 and tokens >= self.mlp_tile_from and tokens > self.mlp_tile

    @property
    def norm_tiled(self) -> bool:
        """Whether the RMS norms run in tiles at this microbatch."""
        tokens = self.microbatch * self.seq_len
        return self.norm_tile > 0 and tokens >= self.norm_tile_from and tokens > self.norm_tile

    @property
    def lora(self) -> bool:
        return self.lora_params > 0

    @property
    def compute_bytes(self) -> int:
        if self.precision == "fp32" or self.mixed_precision == "FULL":
            return 4
        return 2

    @property
    def master_bytes(self) -> int:
        """Stored weights (and so gradients and optimizer state) per element."""
        return 2 if self.mixed_precision == "PURE" and self.precision != "fp32" else 4


def loss_is_fused(sh: Shape, s: Setup) -> bool:
    """Whether the run's loss is fused with the output projection at its TP degree."""
    return sh.fused_loss and (s.tp == 1 or sh.fused_under_tp)


def terms(c: Census, s: Setup) -> dict[str, int]:
    """Bytes per device, by term; zero terms are kept (the table shows every line)."""
    sh = c.shape
    ce, pb = s.compute_bytes, s.master_bytes
    deg = max(s.shard_degree, 1)
    w_div = deg if s.zero_stage >= 3 else 1
    g_div = deg if s.zero_stage >= 2 else 1
    o_div = deg if s.zero_stage >= 1 else 1
    on_device = 0.0 if s.fsdp_cpu_offload else 1.0

    lf = tp_linear_fraction(c, s.tp)
    mode = vocab_mode(s, c.shape.vocab_size)
    trainable = tp_lora_params(s) if s.lora else tp_params(c, s.tp, mode)
    t: dict[str, float] = dict.fromkeys(TERM_DOCS, 0.0)
    if s.lora:
        lin = frozen_linear_bytes(c, s) * lf
        other = tp_other(c, s.tp, mode) * (s.frozen_other_bytes or pb)
        t["frozen_weights"] = (lin * (1 - s.offload_fraction) + other) / w_div * on_device
    if s.zero_stage in (1, 2):
        # ZeRO-1/2 (DeepSpeed's layout): a replicated working copy in the compute dtype; the
        # fp32 master weights are sharded with the optimizer state, the gradients (compute
        # dtype) too at stage 2: 2 + 2 + 12 / N bytes per parameter, then 2 + 14 / N
        master = trainable * pb / deg if pb > ce else 0
        t["trainable_weights"] = (trainable * min(ce, pb) + master) * on_device
        t["gradients"] = trainable * min(ce, pb) / g_div * on_device
    else:  # replicated (DDP) or FSDP2: the stored (master) weights and their gradients
        t["trainable_weights"] = trainable * pb / w_div * on_device
        t["gradients"] = trainable * pb / g_div * on_device
    t["optimizer_state"] = trainable * pb * s.optimizer_states / o_div * on_device

    b, q, d = s.microbatch, s.seq_len, sh.d_model
    acts, block = _activations(sh, s)
    t["activations"] = acts
    # With checkpointing, backward recomputes a block and holds its activations and their
    # gradients together (a block's worth on top of ``acts``, which counts the recomputed one;
    # measured). Without it, a block's saved activations are freed as its gradients are made,
    # so backward adds only its largest gradients, the FFN's two hidden-width ones (measured:
    # the peak grows with the microbatch as the end of the forward pass does, not faster).
    if s.activation_checkpointing and _lean(sh, s):
        # tiled: the gradients of the residual stream, of the block's output and of the op
        # running (3 d a token), and one MLP tile's hidden-width tensors and gradients
        work = 3 * b * q * d / max(s.tp if s.sequence_parallel else 1, 1) * ce
        work += min(s.mlp_tile, b * q) * 6 * sh.ffn_hidden / max(s.tp, 1) * ce
    elif s.activation_checkpointing:
        work = block
    else:
        work = 2 * b * q * max(sh.ffn_hidden / s.tp, d) * ce
    t["backward_working_set"] = work
    # the output projection's weight gradient, when it trains (full fine-tuning): the fused
    # loss accumulates it in fp32 during the forward pass and saves it for backward; under
    # TP the projection and the loss are vocabulary-parallel (each rank its 1/tp of the rows)
    vocab = sh.vocab_size / (s.tp if mode == "parallel" else 1)  # loss parallel
    head = sh.vocab_size / (s.tp if mode != "replicated" else 1)
    out_grad = 0.0 if s.lora else head * d * 4
    fused = loss_is_fused(sh, s)
    if fused:
        # one chunk's fp32 logits, reused by every chunk and turned into their gradient in
        # place (under mixed precision also the chunk's logits and gradient in the compute
        # dtype), then the saved weight gradient beside its accumulator; plus the input
        # gradient and its saved copy; on a CPU with oneDNN's products (cpu_matmul), each chunk's
        # weight gradient is a product of its own before it is added
        chunk = min(b * q, chunk_tokens(math.ceil(vocab), s.device_kind)) * vocab * 4
        mixed = chunk * ce / 4 if ce < 4 else 0.0
        weight_grads = 3 if s.cpu_onednn else 2
        t["logits_and_loss"] = chunk + mixed + weight_grads * out_grad + 2 * b * q * d * ce
    else:
        t["logits_and_loss"] = b * q * vocab * (ce + 4 + 4)
        if s.tp > 1 and mode == "head":  # the rank's own slice before the gather
            t["logits_and_loss"] += b * q * head * ce
        elif s.tp > 1 and mode == "parallel":
            # loss parallel runs the loss as a graph of its own (foundryx.parallel.
            # loss_parallel): in backward its detached logits and their gradient beside the
            # log-softmax's, two fp32 copies more than the plain loss (measured:
            # benchmarks/RESULTS.md, the tp section)
            t["logits_and_loss"] += b * q * vocab * 8
    # Gradients and activations are not all held at once: the activations are freed block by
    # block in backward as the gradients are made. The peak is the larger of the end of the
    # forward pass (every activation and the loss's buffers, no gradient yet), the start of
    # backward (the activations, one block's working set and the output projection's
    # gradient) and its end (every gradient and one block's working set); what the sum of the
    # terms above counts twice is taken off here. With gradient accumulation the gradients of
    # the earlier microbatches are held through every forward pass after the first.
    counted = t["gradients"] + acts + work + t["logits_and_loss"]
    held = t["gradients"] if s.grad_accum > 1 else 0
    start = acts + work + (t["logits_and_loss"] if not fused else 2 * out_grad)
    peak = held + max(acts + t["logits_and_loss"], start, t["gradients"] - held + work)
    t["not_held_together"] = -(counted - peak)

    if s.zero_stage >= 3 and deg > 1:
        gathered = block_gather_bytes(c, s)
        blocks = 2 if s.reshard_after_forward else sh.n_layers
        per_block_trainable = (tp_lora_params(s, s.lora_params_per_block) if s.lora
                               else tp_block_params(c, s.tp))
        t["fsdp_buffers"] = blocks * gathered + per_block_trainable * pb
    if s.lora and s.offload_fraction > 0:
        t["offload_buffers"] = 2 * frozen_linear_bytes(c, s) * lf / sh.n_layers / w_div
    if ce != pb or (s.lora and s.frozen_dtype not in (None, "bf16")):
        t["cast_buffers"] = c.largest_linear / s.tp * ce
    allocated = sum(t.values())  # what the caching allocator holds (the context is not in it)
    t["fragmentation"] = allocated * FRAGMENTATION[s.device_kind]
    t["context"] = CONTEXT_BYTES[s.device_kind]
    return {k: int(math.ceil(v)) for k, v in t.items()}


def _activations(sh, s: Setup) -> tuple[float, float]:
    """(activations held at the end of the forward pass, one block's activations).

    Per token, one block keeps (counted from the tensors autograd saves, tested): each of its
    two norms its input, the normalized input and the output (3 d each); q, k and v (d + 2 kv;
    slices of one output keep it whole); with RoPE the rotated q and k (d + kv); the
    attention's output (d) and its fp32 log-sum-exp per head; the FFN's up and gate outputs,
    the activation and the product (4 f gated, 2 f otherwise); LoRA dropout's inputs. With
    activation checkpointing a checkpointed block keeps only its input, and one block is
    recomputed in backward. Outside the blocks: the embedding output and the final norm's
    three tensors.

    Tensor parallelism over ``tp`` ranks splits the heads and the FFN's hidden width: q, k, v,
    the rotated q and k, the attention output, the log-sum-exp and the FFN's tensors are 1/tp
    per rank (k and v by the kv heads a rank holds), with or without sequence parallel. The
    residual stream (the norms' tensors, a checkpointed block's input, the embedding output)
    is whole on every rank without sequence parallel and 1/tp with it; sequence parallel then
    all-gathers the normed input of the attention and of the MLP, and the column-wise layers
    keep that whole tensor for their weight gradients (2 d per token, as PyTorch's DTensor TP
    does; Megatron-LM gathers it again in backward instead). An attention that keeps its
    probabilities (``Shape.scores_kept``) adds heads / tp x s x s per sequence."""
    b, q, d, ce = s.microbatch, s.seq_len, sh.d_model, s.compute_bytes
    tp = max(s.tp, 1)
    sp = tp if s.sequence_parallel else 1  # the residual stream's divisor
    kv = sh.kv_heads * (d // sh.n_heads) / (kv_divisor(sh, tp) if tp > 1 else 1)
    ffn = (4 if sh.gated_ffn else 2) * sh.ffn_hidden
    rope = d / tp + kv if sh.rotary else 0
    tiled = s.mlp_tiled
    inner = (d / tp + 2 * kv) + rope + d / tp + (0 if tiled else ffn / tp)
    gathered = 2 * d if tp > 1 and s.sequence_parallel else 0
    per_token = 6 * d / sp + gathered + inner + s.lora_dropout_inputs
    if _lean(sh, s):
        # norms and MLP tiled (counted from the traced 8B step, benchmarks/RESULTS.md "Long
        # context"): the two norms' outputs (2 d; a tiled norm keeps its input, the block's
        # input or the residual already held, and a float32 statistic per token), the rotated
        # q and k, v (d + 2 kv: the unrotated q and k are freed), the attention's output (d)
        per_token = 2 * d / sp + gathered + (d / tp + 2 * kv) + d / tp + s.lora_dropout_inputs
    block = b * q * per_token * ce + b * sh.n_heads / tp * q * 4
    if sh.scores_kept == "always" or (sh.scores_kept == "cpu" and s.device_kind == "cpu"):
        block += b * sh.n_heads / tp * q * q * ce  # the attention's probabilities
    if s.activation_checkpointing:
        kept = sh.n_layers // max(s.ac_every, 1)
        # offloaded: the inputs live in host memory; the one being recomputed and the
        # prefetched one are on the device
        inputs = min(kept, 2) if s.act_offload else kept
        acts = inputs * b * q * d / sp * ce + (sh.n_layers - kept) * block + block
        if s.ac_selective:  # what each checkpointed block keeps besides its input
            acts += kept * selective_bytes(sh, s)
    elif s.act_offload:  # everything the blocks save in host memory, two blocks' worth here
        acts = min(sh.n_layers, 2) * block
    else:
        acts = sh.n_layers * block
    # outside the blocks: the embedding output and the final norm's three tensors; tiled,
    # the final norm keeps its input and output only, and the embedding output (the first
    # block's input) is not kept when the checkpoints are offloaded
    outside = 4 if not _lean(sh, s) else 2 if s.act_offload else 3
    return acts + outside * b * q * d / sp * ce, block


def full_checkpointing(s: Setup) -> Setup:
    """``s`` at full activation checkpointing (nothing kept selectively)."""
    return replace(s, ac_selective=False, selective_kept=0.0)


def selective_bytes(sh, s: Setup) -> float:
    """What selective checkpointing keeps of one block besides its input, per rank: every other
    matmul's output (``s.selective_kept`` elements a token, in the compute dtype), and the
    attention's output (d / tp a token) with its float32 log-sum-exp per head."""
    b, q, tp = s.microbatch, s.seq_len, max(s.tp, 1)
    return b * q * (s.selective_kept + sh.d_model / tp) * s.compute_bytes \
        + b * sh.n_heads / tp * q * 4


def _lean(sh, s: Setup) -> bool:
    """Whether a block's recompute is the tiled one (norms and MLP tiled, RoPE): its own
    per-token count in :func:`_activations`."""
    return s.mlp_tiled and s.norm_tiled and sh.rotary


def offloaded_activation_bytes(sh, s: Setup) -> float:
    """Host bytes of ``activation_checkpointing.cpu_offload``: every checkpointed block's
    input (or, without checkpointing, every block's saved activations), pinned on a GPU."""
    if not s.act_offload:
        return 0.0
    sp = max(s.tp, 1) if s.sequence_parallel else 1
    if s.activation_checkpointing:
        kept = sh.n_layers // max(s.ac_every, 1)
        return kept * s.microbatch * s.seq_len * sh.d_model / sp * s.compute_bytes
    return sh.n_layers * _activations(sh, s)[1]


def block_activations(sh, s: Setup) -> float:
    """One block's saved activations per rank (what a block's forward keeps for backward)."""
    return _activations(sh, s)[1]


def vocab_mode(s: Setup, vocab_size: int) -> str:
    """How ``s``'s TP splits the vocabulary (TP_VOCAB_MODES): its ``tp_vocab``, or whole
    ("replicated") when ``tp`` does not divide the vocabulary (the plans keep it whole then:
    FSDP2 refuses an uneven TP split)."""
    return "replicated" if s.tp > 1 and vocab_size % s.tp else s.tp_vocab


def tp_lora_params(s: Setup, n: int | None = None) -> float:
    """Adapter parameters per rank under TP (torchtitan's rule: a column-wise base splits
    lora_b, a row-wise one lora_a, the other stays whole): taken as half of the adapters split."""
    n = s.lora_params if n is None else n
    return n if s.tp <= 1 else n * (1 + 1 / s.tp) / 2


def frozen_linear_bytes(c: Census, s: Setup) -> float:
    """The blocks' frozen linear weights in their storage dtype, scales included."""
    if s.frozen_dtype is None:
        return c.block_linear * s.master_bytes
    rows = sum(out for out, _ in c.linears.values())
    return c.block_linear * QUANT_BYTES[s.frozen_dtype] + rows * ROW_SCALE_BYTES.get(s.frozen_dtype, 0)


def block_gather_bytes(c: Census, s: Setup) -> float:
    """One block's weights as all-gathered: the compute dtype, or a frozen base's own bytes."""
    if not s.lora or s.frozen_dtype is None:
        return tp_block_params(c, s.tp) * s.compute_bytes
    linear = frozen_linear_bytes(c, s) * tp_linear_fraction(c, s.tp) / c.shape.n_layers
    rest = c.per_block - c.block_linear / c.shape.n_layers
    return linear + rest * s.compute_bytes


def by_stage(c: Census, s: Setup, degree: int) -> dict[str, int]:
    """Total bytes per device under ZeRO stages 0-3 at ``degree`` (what each step buys)."""
    names = {0: "none", 1: "optimizer", 2: "+gradients", 3: "+weights"}
    return {names[z]: sum(terms(c, replace(s, zero_stage=z, shard_degree=degree)).values())
            for z in range(4)}
