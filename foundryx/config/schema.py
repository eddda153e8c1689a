"""The run config schema: typed dataclasses with defaults and one-line docs.

Sections that name a registry entry (``model``, ``tokenizer``, ``train_loader``,
``optimizer``, ...) are ``{name: <registry key>, <kwargs>...}`` dicts; their kwargs are
checked against the registered object (see :mod:`foundryx.config.components`).
``algorithms``, ``callbacks`` and ``loggers`` map registry keys to kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from foundryx.config.types import option

Precision = Literal["fp32", "amp_fp16", "amp_bf16", "amp_fp8"]


doc = option  # a field with a doc string and constraints (shown by ``--help-config``)

# LLM Foundry users write device_train_microbatch_size: auto. Composer's auto-microbatching
# finds a size by catching out-of-memory errors, which leaves the other ranks of a distributed
# job waiting in a collective; on torch >= 2.7.1 it also fails in Composer 0.32.1 itself
# (a NameError in patch_unshard_for_automicrobatching).
AUTO_MICROBATCH = (
    "Composer's auto-microbatching finds a size by running out of memory, which hangs "
    "distributed jobs, and fails on torch >= 2.7.1; set an integer that divides the per-device "
    "batch, or leave the key out for the whole per-device batch"
)


MixedPrecision = Literal["DEFAULT", "PURE", "FULL"]


@dataclass
class ParallelismConfig:
    """``parallelism``: FSDP2 sharding, tensor parallelism (``tp``) and context parallelism
    (``cp``) over several processes (see docs/distributed.md); null: none (several processes
    then train with Composer's DDP)."""

    sharding_strategy: Literal["FULL_SHARD", "HYBRID_SHARD"] = doc(
        "FULL_SHARD: shard over all ranks; HYBRID_SHARD: shard within a node, replicate across",
        default="FULL_SHARD",
    )
    data_parallel_shard_degree: int = doc(
        "ranks that share one copy of the weights; -1: all (FULL_SHARD) or one node (HYBRID)",
        default=-1,
    )
    reshard_after_forward: bool | int = doc(
        "free gathered weights after forward (true), keep them (false), or reshard to N ranks",
        default=True,
    )
    mixed_precision: MixedPrecision | dict[str, str] = doc(
        "DEFAULT: compute in the precision's dtype, reduce in fp32; PURE: both in it; FULL: "
        "fp32; or {param_dtype, reduce_dtype, output_dtype}",
        default="DEFAULT",
    )
    cpu_offload: bool = doc("keep sharded weights, grads and optimizer state in CPU memory", default=False)
    tp: int = doc(
        "tensor-parallel degree: ranks that split each layer (heads, MLP columns) and the "
        "sequence between layers; the data-parallel ranks are world size / tp",
        ge=1, default=1,
    )
    verbose: bool = doc("log the sharded model", default=False)
    cp: int = doc(
        "context-parallel degree: ranks that split each sequence (each holds 1/cp of every "
        "sequence; attention swaps the split to heads by all-to-all: Ulysses); divides the "
        "model's key-value heads and max_seq_len; FSDP2 shards over dp x cp",
        ge=1, default=1,
    )


def tp_degree(parallelism: Any) -> int:
    """``parallelism.tp`` of a ParallelismConfig, its raw mapping or None (1)."""
    if isinstance(parallelism, dict):
        return int(parallelism.get("tp", 1) or 1)
    return int(getattr(parallelism, "tp", 1) or 1)


def cp_degree(parallelism: Any) -> int:
    """``parallelism.cp`` of a ParallelismConfig, its raw mapping or None (1)."""
    if isinstance(parallelism, dict):
        return int(parallelism.get("cp", 1) or 1)
    return int(getattr(parallelism, "cp", 1) or 1)


def batch_sharers(parallelism: Any) -> int:
    """Ranks that read the same batch: a tensor-parallel group times a context-parallel one."""
    return tp_degree(parallelism) * cp_degree(parallelism)


@dataclass
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: recompute activations in backward instead of storing them;
    applies with or without ``parallelism``."""

    enabled: bool = doc("recompute the chosen modules' activations in backward", default=False)
    every: int = doc("checkpoint every N-th of the chosen modules (the N-th, 2N-th, ...)",
                     ge=1, default=1)
    modules: list[str] | None = doc(
        "module class names to checkpoint; none: the model's transformer blocks", default=None
    )
    cpu_offload: bool = doc(
        "keep every block's saved activations in CPU memory (also without enabled)", default=False
    )
    mode: Literal["full", "selective", "auto"] = doc(
        "full: recompute the whole module; selective: keep the outputs of its matmuls (every "
        "other one) and attention, recompute the rest (torchtitan's selective op AC; less "
        "recompute, more memory); auto: selective where the planner's peak with it fits the "
        "GPU's memory, else full (on a CPU: full), said in one log line (docs/planning.md)",
        default="full")


@dataclass
class TilingConfig:
    """``tiling``: long sequences computed in tiles along the sequence (docs/long_context.md).
    The loss is always taken in chunks where the model fuses it with the output projection
    (``model.fused_loss``); this section tiles the MLP and the RMS norms."""

    mlp: bool | Literal["auto"] = doc(
        "run each block's MLP a tile of tokens at a time, keeping only its input for backward "
        "(one more MLP forward a step); auto: on when a microbatch holds at least "
        "auto_tokens tokens, logged in one line", default="auto")
    mlp_tokens: int | None = doc(
        "tokens per MLP tile; none: the model's d_model (a Llama-3.1-8B tile: 4,096 tokens, "
        "its 14,336-wide hidden tensors 112 MiB each in bf16)", default=None, gt=0)
    norm: bool | Literal["auto"] = doc(
        "run the RMS norms (Llama, Mistral, Qwen2/3, Phi-3) a tile at a time, keeping their "
        "input and a float32 statistic per token instead of float32 copies; auto: as mlp",
        default="auto")
    auto_tokens: int = doc("tokens per microbatch from which mlp and norm: auto tile",
                           default=32768, gt=0)
    mlp_modules: list[str] | None = doc(
        "MLP class names to tile; none: each block's modules whose class name ends in MLP",
        default=None)


@dataclass
class FusedOpsConfig:
    """``fused_ops``: a Hugging Face Llama-family block's elementwise work as one Triton kernel
    each way (docs/hf.md), applied from outside the model: the RMS norms (Llama,
    Mistral, Qwen2/3, Phi-3), the MLP's ``silu(gate) * up`` (Llama, Mistral, Qwen2/3) and the
    attention's RoPE (Llama); and an NF4 frozen base's decoding (any model). A
    family whose modules differ keeps the unfused path, said in one line."""

    rms_norm: bool | Literal["auto"] = doc(
        "each RMS norm as one operator each way (forward: y and a float32 statistic per "
        "token; backward: dx, and dweight only where the weight trains); auto: on a GPU, off "
        "on a CPU (true there runs the operator's torch reference)", default="auto")
    swiglu: bool | Literal["auto"] = doc(
        "the MLP's silu(gate) * up as one operator each way, keeping gate and up for backward "
        "(silu recomputed); auto: as rms_norm", default="auto")
    rope: bool | Literal["auto"] = doc(
        "the attention's rotary embedding of q and k (Llama) as one operator each way, "
        "keeping only cos and sin for backward; auto: as rms_norm", default="auto")
    nf4_dequantize: bool | Literal["auto"] = doc(
        "an NF4 frozen base's weights (model.frozen_base.dtype: nf4) decoded to the compute "
        "dtype by one operator a call (forward, recompute and backward), reading the packed "
        "codes and scalers once, not by ten torch ops a chunk; auto: as rms_norm",
        default="auto")


@dataclass
class CompileConfig:
    """``compile``: ``torch.compile`` each transformer block (regional compilation: the block
    is compiled once and reused, so compile time does not grow with depth); applies with or
    without ``parallelism``. ``compile: false`` is short for ``compile: {enabled: false}``."""

    enabled: bool | Literal["auto"] = doc(
        "torch.compile each transformer block; auto: on where this torch and device support "
        "it (a C++ compiler on CPU, Triton on GPU), logged in one line", default="auto"
    )
    options: dict[str, Any] = doc(
        "keyword arguments of torch.compile, e.g. {mode: max-autotune}", default_factory=dict
    )


@dataclass
class Float8Config:
    """``float8``: torchao's float8 training for pretraining (docs/algorithms.md): the linear
    layers' matmuls in float8 on GPUs with FP8 tensor cores (NVIDIA compute capability 8.9+,
    AMD MI300 / gfx942+), applied from outside the model before compile and FSDP2."""

    enabled: bool = doc("train the linear layers' matmuls in float8 (torchao)", default=False)
    recipe: Literal["rowwise", "tensorwise"] = doc(
        "scaling: rowwise (a scale per row: closer to bf16) or tensorwise (one per tensor: "
        "faster where the GEMMs are large)", default="rowwise")
    skip: list[str] = doc(
        "linear layers left in their precision, by name or glob (fnmatch) on the full or last "
        "name", default_factory=lambda: ["lm_head", "output"])


@dataclass
class NodeConfig:
    """``node``: the machine a recipe is written for. ``foundryx plan`` and ``--dry-run`` plan
    for it unless their flags say otherwise (a login node without a GPU plans the cluster's)."""

    gpu: str | None = doc("the device kind, a `foundryx plan --gpu` name (h100, mi300x, ...)",
                          default=None)
    gpus: int | None = doc("devices (processes) per node", default=None, gt=0)
    nodes: int = doc("nodes", default=1, gt=0)
    host_memory: str | None = doc("host (CPU) memory per node, e.g. 2TB", default=None)


@dataclass
class TrainConfig:
    # -- what to train ------------------------------------------------------------------
    model: dict[str, Any] = doc("model: {name: <models key>, ...model options}")
    tokenizer: dict[str, Any] = doc("tokenizer: {name: <tokenizers key>, ...kwargs}")
    train_loader: dict[str, Any] = doc("training data: {name: <dataloaders key>, ...}")
    max_duration: str = doc("training length, e.g. 4800ba, 1ep, 2000000tok")
    global_train_batch_size: int = doc("samples per optimizer step, summed over all ranks", gt=0)
    optimizer: dict[str, Any] = doc("optimizer: {name: <optimizers key>, lr: ..., ...}")
    scheduler: dict[str, Any] = doc(
        "LR schedule: {name: <schedulers key>, ...}",
        default_factory=lambda: {"name": "constant_with_warmup", "t_warmup": "0ba"},
    )
    max_seq_len: int | None = doc("sequence length (used by model and data)", default=None)
    eval_loader: dict[str, Any] | None = doc("held-out data, same shape as train_loader", default=None)

    # -- batch --------------------------------------------------------------------------
    device_train_microbatch_size: int | None = doc(
        "samples per forward/backward on one device; default: the whole device batch "
        "(not auto: set a number)", default=None, gt=0, unsupported={"auto": AUTO_MICROBATCH},
    )
    device_eval_batch_size: int | None = doc("eval samples per device; default: microbatch",
                                             default=None, gt=0)

    # -- schedule of evaluation and logging ---------------------------------------------
    eval_interval: str = doc("how often to evaluate, e.g. 500ba or 1ep", default="1ep")
    eval_first: bool = doc("evaluate before the first step", default=False)
    eval_subset_num_batches: int = doc("eval batches per evaluation (-1: all)", default=-1)
    console_log_interval: str = doc("how often the console prints a line (loss, lr, tokens/s, "
                                    "MFU, memory, ETA)", default="10ba")
    log_to_console: bool = doc("print a line per console_log_interval, eval tables and the "
                               "run summary (docs/operations.md)", default=True)
    progress_bar: bool | None = doc("a progress bar under the console lines; null: when stderr "
                                    "is a terminal", default=None)
    python_log_level: str | None = doc("log level of foundryx (composer: warnings only unless "
                                       "debug); debug also prints every metric", default="info")

    # -- in-context-learning evaluation at eval_interval (docs/eval.md) -----------------
    icl_tasks: str | list[dict[str, Any]] | None = doc(
        "ICL tasks: a task file (eval/yamls/tasks.yaml) or a list of tasks", default=None
    )
    icl_data_root: str | None = doc(
        "folder of relative ICL dataset_uri paths; default: the task file's data_root", default=None
    )
    icl_max_examples: int | None = doc("evaluate the first N examples of each ICL task", default=None)
    eval_gauntlet: str | dict[str, Any] | None = doc(
        "gauntlet over the ICL results: a file (eval/yamls/gauntlet.yaml) or a mapping", default=None
    )

    # -- extensions ---------------------------------------------------------------------
    algorithms: dict[str, dict[str, Any]] = doc("{<algorithms key>: kwargs}", default_factory=dict)
    callbacks: dict[str, dict[str, Any] | None] = doc(
        "{<callbacks key>: kwargs}; null turns a callback off (preemption, on by default "
        "with a save_folder: callbacks.preemption: null)", default_factory=dict)
    loggers: dict[str, dict[str, Any]] = doc("{<loggers key>: kwargs}", default_factory=dict)

    # -- hardware -----------------------------------------------------------------------
    precision: Precision = doc("numeric precision of training", default="fp32")
    device: Literal["cpu", "gpu"] | None = doc("cpu or gpu; default: gpu when available", default=None)
    parallelism: ParallelismConfig | None = doc(
        "FSDP2 sharding and tensor parallelism (tp) over several processes; none: DDP "
        "(several processes) or plain", default=None
    )
    node: NodeConfig | None = doc(
        "the machine the run is written for (GPU kind and count, host memory): what `foundryx "
        "plan` and --dry-run plan for unless told otherwise", default=None)
    activation_checkpointing: ActivationCheckpointingConfig = doc(
        "recompute activations in backward, per block (with or without parallelism)",
        default_factory=ActivationCheckpointingConfig,
    )
    compile: CompileConfig = doc(
        "torch.compile each transformer block (with or without parallelism)",
        default_factory=CompileConfig,
    )
    tiling: TilingConfig = doc(
        "the MLP computed a tile of tokens at a time (long sequences)",
        default_factory=TilingConfig,
    )
    fused_ops: FusedOpsConfig = doc(
        "RMS norms, SwiGLU and RoPE as fused kernels (Hugging Face Llama-family models on GPUs)",
        default_factory=FusedOpsConfig,
    )
    float8: Float8Config = doc(
        "float8 training of the linear layers (torchao; GPUs with FP8 tensor cores)",
        default_factory=Float8Config,
    )
    cpu_matmul: Literal["auto", "onednn", "blas"] = doc(
        "fp32 matmuls when training on a CPU: onednn (oneDNN's GEMM), blas (torch's: MKL or "
        "OpenBLAS); auto: onednn on x86-64 where this torch has it, logged in one line",
        default="auto")
    host_heap: Literal["auto", "bounded", "glibc"] = doc(
        "host memory a run frees: bounded (glibc's mmap threshold fixed: it goes back to the OS, "
        "host memory as planned; on a CPU device slower), glibc (glibc as it starts: faster, "
        "may keep a step's freed temporaries); auto: bounded on a GPU, glibc on a CPU device, "
        "logged in one line (docs/planning.md)", default="auto")
    dist_timeout: float = doc("seconds to wait for all ranks to start", default=600.0)
    seed: int = doc("random seed of weights, data order and dropout", default=17)
    plan_check: bool = doc(
        "on a GPU, estimate per-device memory first (foundryx plan) and stop with its "
        "suggestions when the run cannot fit", default=True)

    # -- checkpoints --------------------------------------------------------------------
    run_name: str | None = doc("name of the run (checkpoint and logger names)", default=None)
    save_folder: str | None = doc("where checkpoints go; none: no checkpoints", default=None)
    save_interval: str = doc("checkpoint every ..., e.g. 1000ba", default="1000ba")
    save_num_checkpoints_to_keep: int = doc("keep the last K (-1: all)", default=-1)
    save_overwrite: bool = doc("overwrite checkpoints already in save_folder", default=False)
    load_path: str | None = doc("checkpoint to start from", default=None)
    load_weights_only: bool = doc("load only the weights from load_path", default=False)
    autoresume: bool | None = doc(
        "resume from the latest complete checkpoint in save_folder; default: on when "
        "save_folder is set and save_overwrite is false", default=None
    )

    variables: dict[str, Any] = doc("values for ${variables.x} interpolation", default_factory=dict)

    def __post_init__(self) -> None:
        # parallelism sections: validated by the loader; typed here
        if isinstance(self.parallelism, dict):
            self.parallelism = ParallelismConfig(**self.parallelism)
        if isinstance(self.activation_checkpointing, dict):
            self.activation_checkpointing = ActivationCheckpointingConfig(**self.activation_checkpointing)
        if isinstance(self.compile, dict):
            self.compile = CompileConfig(**self.compile)
        if isinstance(self.tiling, dict):
            self.tiling = TilingConfig(**self.tiling)
        if isinstance(self.fused_ops, dict):
            self.fused_ops = FusedOpsConfig(**self.fused_ops)
        if isinstance(self.node, dict):
            self.node = NodeConfig(**self.node)
        if isinstance(self.float8, dict):
            self.float8 = Float8Config(**self.float8)


# Sections whose value names a registry entry, and the registry.
COMPONENT_SECTIONS: dict[str, str] = {
    "model": "models",
    "tokenizer": "tokenizers",
    "train_loader": "dataloaders",
    "eval_loader": "dataloaders",
    "optimizer": "optimizers",
    "scheduler": "schedulers",
}
# Sections mapping registry keys to kwargs.
NAMED_SECTIONS: dict[str, str] = {
    "algorithms": "algorithms",
    "callbacks": "callbacks",
    "loggers": "loggers",
}
# Constructor arguments the builders supply, so a YAML need not (and must not) give them.
SUPPLIED_ARGS: dict[str, set[str]] = {
    "models": {"tokenizer"},
    "tokenizers": set(),
    "dataloaders": {"cfg", "tokenizer", "device_batch_size"},
    "optimizers": {"params"},
    "schedulers": set(),
    "algorithms": set(),
    "callbacks": set(),
    "loggers": set(),
}
