"""A run config (and the planner's command line) read as the Setup that decides memory."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundryx.config.load import LoadedConfig
from foundryx.kernels.cpu_matmul import resolve as resolve_backend
from foundryx.models.peft.lora import apply_lora, inner_model
from foundryx.parallel.fsdp import frozen_compute_dtype
from foundryx.plan.census import Census, NotPlannable, build_meta, take_census
from foundryx.plan.host import HostSetup
from foundryx.plan.memory import Setup

# Optimizer state per trainable parameter, in stored-weight elements, by optimizers key.
OPTIMIZER_STATES = {"adamw": 2, "decoupled_adamw": 2, "adam": 2, "lion": 1, "decoupled_lionw": 1}
MOMENTUM_OPTIMIZERS = ("sgd", "decoupled_sgdw")  # 1 state with momentum, else 0


@dataclass
class Planned:
    """What the planner knows of one run: its census, settings and a note per assumption."""

    census: Census
    setup: Setup
    notes: list[str]
    host: HostSetup = field(default_factory=lambda: HostSetup(ranks_per_node=1))


# How foundryx's TP plans (the ones the models declare, applied by foundryx/parallel) treat
# the vocabulary: MPT, and Hugging Face Llama / Mistral / Qwen2 with an untied lm_head, split
# the embedding, the head and the loss by vocabulary ("parallel", as torchtitan does, also the
# planner's default for a Setup built by hand; MPT's fused loss is vocabulary-parallel, tied
# head or not); a Hugging Face model with a tied head keeps both whole ("replicated").


def tp_vocab(model_name: str, census: Census) -> str:
    if model_name == "hf_causal_lm" and not census.head_params:
        return "replicated"
    return "parallel"


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def stored_bytes(opts: Any, total: int, notes: list[str]) -> int:
    """The pretrained checkpoint's bytes: its safetensors files' sizes (the index's total_size)
    when the folder holds them, else the config's torch_dtype x the parameters."""
    folder = Path(str(opts.pretrained_model_name_or_path)).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        size = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if isinstance(size, int):
            return size
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if files:
        return sum(f.stat().st_size for f in files)
    dtype = "float32"
    config = folder / "config.json"
    if config.is_file():
        saved = json.loads(config.read_text())  # transformers >= 4.56 writes "dtype"
        dtype = str(saved.get("torch_dtype") or saved.get("dtype") or "float32")
    per = DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)
    notes.append(f"no safetensors in {folder}: the checkpoint is taken as {total / 1e9:,.2f}B "
                 f"parameters x {per} bytes ({dtype}, the config's torch_dtype)")
    return total * per


def host_setup(loaded: LoadedConfig, opts: Any, census: Census, per_node: int,
               notes: list[str]) -> HostSetup:
    """Loading mode, checkpoint bytes and dataloader workers of the run ``loaded``."""
    cfg, derived = loaded.cfg, loaded.derived
    load, stored = "none", 0
    if getattr(opts, "pretrained", False) and getattr(opts, "pretrained_model_name_or_path", None):
        init = getattr(opts, "init_device", "cpu")
        load = {"meta": "shard", "mixed": "rank0"}.get(init, "every_rank")
        stored = stored_bytes(opts, census.total, notes)
    workers = 0
    for section in (cfg.train_loader, cfg.eval_loader):
        if isinstance(section, dict):
            workers += int(section.get("num_workers", 0) or 0)
    batch = derived.device_train_batch_size * (cfg.max_seq_len or 0) * 8 * 2  # ids, labels
    return HostSetup(ranks_per_node=per_node, load=load, stored_bytes=stored, workers=workers,
                     batch_bytes=batch)


def optimizer_states(section: dict[str, Any], notes: list[str]) -> int:
    name = str(section.get("name", "")).lower()
    if name in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[name]
    if name in MOMENTUM_OPTIMIZERS:
        return 1 if float(section.get("momentum", 0) or 0) > 0 else 0
    notes.append(f"optimizer {name!r}: state size unknown to the planner; assumed AdamW's "
                 "(2 states per trainable parameter)")
    return 2


def _lora_counts(model: nn.Module, opts: Any, n_layers: int) -> tuple[int, int, int]:
    """(trainable adapter parameters, per block, adapted input features of one block when
    lora_dropout > 0): LoRA applied to the meta model, counted."""
    if getattr(opts, "peft_config", None) is None:
        return 0, 0, 0
    # the adapters on the meta device too: peft builds them on the default device and runs
    # their random init (minutes of CPU for 405B's 882 adapters, all of it thrown away here)
    with torch.device("meta"):
        apply_lora(model, opts.peft_config)
    inner = inner_model(model)
    trainable = sum(p.numel() for p in inner.parameters() if p.requires_grad)
    per_block = trainable // n_layers
    dropout_inputs = 0
    if opts.peft_config.lora_dropout > 0:
        dropout_inputs = sum(m.in_features for n, m in inner.named_modules()
                             if n.endswith("lora_A.default") and hasattr(m, "in_features"))
        dropout_inputs //= n_layers
    return trainable, per_block, dropout_inputs


def selective_widths(model: nn.Module) -> list[int]:
    """The output widths of the matmuls selective checkpointing counts in one transformer block,
    in its forward's order (foundryx.parallel.selective_ac): a plain linear layer one; a LoRA
    layer in one pass (``OnePassLoraLinear``) its base product and ``h Aᵀ`` (rank r; its
    ``addmm_`` into the base output is not counted); PEFT's own layer also ``t Bᵀ``. Module
    order is taken as forward order (Llama, Mistral, Qwen, MPT: q, k, v, o, gate, up, down)."""
    from foundryx.parallel.policy import blocks

    found = blocks(model)
    if not found:
        return []
    widths: list[int] = []
    skip: set[int] = set()
    for m in found[0][1].modules():
        if id(m) in skip:
            continue
        lora_a = getattr(m, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and len(lora_a):
            skip.update(id(x) for x in m.modules())
            out = int(m.out_features)
            rank = int(next(iter(lora_a.values())).out_features)
            one_pass = bool(getattr(m, "one_pass", False))
            widths += [out, rank] if one_pass else [out, rank, out]
        elif isinstance(getattr(m, "out_features", None), int) and hasattr(m, "in_features"):
            widths.append(int(m.out_features))
    return widths


def tp_settings(resolved: dict[str, Any]) -> tuple[int, bool]:
    """(tensor-parallel degree, sequence parallel) from the run config's ``parallelism.tp``
    and ``parallelism.sequence_parallel`` (default true), read from the resolved data so that
    the planner reads them whichever release of the schema declares them."""
    par = resolved.get("parallelism")
    if not isinstance(par, dict):
        return 1, True
    tp = par.get("tp", 1)
    if tp is None:
        tp = 1
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise NotPlannable([f"parallelism.tp: expected a positive integer, got {tp!r}"])
    sp = par.get("sequence_parallel", True)
    return tp, bool(True if sp is None else sp)


def mlp_tiling(resolved: dict[str, Any], shape: Any) -> dict[str, int]:
    """``Setup.mlp_tile``, ``norm_tile`` and their ``*_from`` from the run config's ``tiling``
    section (read from the resolved data, defaults as the schema's): tokens a tile (the
    model's d_model when not given), and the microbatch tokens from which ``auto`` tiles. A
    norm is tiled only where foundryx tiles it (foundryx.parallel.tiling.RMS_NORMS)."""
    section = resolved.get("tiling") if isinstance(resolved.get("tiling"), dict) else {}
    tile = int(section.get("mlp_tokens") or shape.d_model)
    auto = int(section.get("auto_tokens") or 32768)
    out = {}
    for part, can in (("mlp", True), ("norm", shape.rms_norm_tiles)):
        mode = section.get(part, "auto")
        on = mode is not False and can
        out[f"{part}_tile"] = tile if on else 0
        out[f"{part}_tile_from"] = 0 if mode is True or not on else auto
    return out


def plan_setup(loaded: LoadedConfig, world_size: int, gpus_per_node: int,
               device_kind: str, tp_degree: int | None = None) -> Planned:
    """Census and Setup of the run ``loaded`` on ``world_size`` devices (``tp_degree``: plan
    at this tensor-parallel degree instead of the config's ``parallelism.tp``)."""
    cfg, derived = loaded.cfg, loaded.derived
    notes: list[str] = []
    model, shape, opts = build_meta(dict(cfg.model))
    census = take_census(model, shape)
    lora, lora_block, dropout_inputs = _lora_counts(model, opts, shape.n_layers)
    par = cfg.parallelism
    tp, sp = tp_settings(loaded.resolved)
    tp = tp if tp_degree is None else tp_degree
    if par is None:
        degree, stage = 1, 0
        if world_size > 1 and tp == 1:
            notes.append("no parallelism section: every rank holds a full replica (DDP)")
    else:
        default = world_size if par.sharding_strategy == "FULL_SHARD" else gpus_per_node
        default = max(default // tp, 1)
        degree = par.data_parallel_shard_degree if par.data_parallel_shard_degree > 0 else default
        stage = 3
    if world_size % tp:
        raise NotPlannable([f"parallelism.tp: {tp} does not divide the world size {world_size}"])
    frozen = getattr(opts, "frozen_base", None)
    seq = cfg.max_seq_len or getattr(opts, "max_seq_len", None)
    if not seq:
        raise NotPlannable(["max_seq_len: the planner needs the sequence length; set max_seq_len"])
    cp = getattr(par, "cp", 1) if par is not None else 1
    if cp > 1:  # context parallel: a device holds seq / cp tokens of every sequence
        notes.append(f"context parallel over {cp} devices (Ulysses): each holds {seq // cp:,} of "
                     f"every sequence's {seq:,} tokens; planned as that sequence length (its "
                     "attention FLOPs, over the whole sequence of 1/cp of the heads, cp times more)")
        seq //= cp
    ac = cfg.activation_checkpointing
    selective = ac.enabled and ac.mode == "selective"
    widths = selective_widths(model) if selective else []
    # a TP group shares its microbatches: each of the world / tp data-parallel ranks takes
    # global / (world / tp) samples per step, in microbatches of device_train_microbatch_size
    micro, accum = derived.device_train_microbatch_size, derived.grad_accum
    if tp > 1:
        per_dp = cfg.global_train_batch_size // max(world_size // tp, 1)
        micro = min(micro, per_dp)
        accum = max(1, -(-per_dp // micro))
    mp = par.mixed_precision if par is not None and isinstance(par.mixed_precision, str) else "DEFAULT"
    setup = Setup(
        world_size=world_size,
        shard_degree=degree,
        zero_stage=stage,
        microbatch=micro,
        grad_accum=accum,
        seq_len=seq,
        precision=cfg.precision,
        mixed_precision=mp,
        reshard_after_forward=bool(par.reshard_after_forward) if par is not None else True,
        activation_checkpointing=ac.enabled,
        ac_every=getattr(ac, "every", 1) or 1,
        ac_selective=selective,
        selective_kept=sum(widths[0::2]) / max(tp, 1),
        optimizer_states=optimizer_states(dict(cfg.optimizer), notes),
        fsdp_cpu_offload=bool(par.cpu_offload) if par is not None else False,
        device_kind=device_kind,
        cpu_onednn=device_kind == "cpu" and resolve_backend(cfg.cpu_matmul)[0] == "onednn",
        lora_params=lora,
        lora_params_per_block=lora_block,
        lora_dropout_inputs=dropout_inputs,
        frozen_dtype=getattr(frozen, "dtype", None) if frozen is not None else None,
        offload_fraction=float(getattr(frozen, "offload_fraction", 0.0) or 0.0) if frozen else 0.0,
        tp=tp,
        sequence_parallel=sp,
        tp_vocab=tp_vocab(str(cfg.model.get("name")), census),
        node_size=gpus_per_node,
        act_offload=bool(getattr(ac, "cpu_offload", False)),
        **mlp_tiling(loaded.resolved, shape),
    )
    if setup.frozen_dtype is not None and not setup.lora:
        notes.append("frozen_base without peft_config: nothing is frozen, so it changes nothing")
    host = host_setup(loaded, opts, census, gpus_per_node, notes)
    kept = kept_stored_bytes(setup, host, census, par, cfg.precision)
    if kept:
        setup = replace(setup, frozen_other_bytes=kept)
    return Planned(census, setup, notes, host)


def kept_stored_bytes(s: Setup, h: HostSetup, c: Census, par: Any, precision: str) -> int:
    """Bytes per element of the frozen weights outside the blocks when the loader keeps the
    checkpoint's dtype for them (foundryx/loading/dtypes.py: LoRA, read shard by shard, a
    compute dtype other than theirs: FSDP2's mixed precision on 2+ ranks, amp_bf16 on one; a
    checkpoint narrower than the stored weights); 0 otherwise."""
    if not (s.lora and h.load == "shard" and h.stored_bytes):
        return 0
    if frozen_compute_dtype(par, precision, s.world_size) is None:
        return 0
    per_elem = round(h.stored_bytes / max(c.total, 1))
    return per_elem if 0 < per_elem < s.master_bytes else 0
