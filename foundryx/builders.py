"""Config → objects, only through the registries."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from foundryx import registry
from foundryx.checkpoint.callback import Checkpointer
from foundryx.checkpoint.remote import is_remote
from foundryx.checkpoint.remote_callback import RemoteCheckpointer
from foundryx.checkpoint.run_shape import run_shape
from foundryx.config import TrainConfig
from foundryx.config.components import (  # noqa: F401  (split_name re-exported)
    build_component,
    options_parameter,
    split_name,
)
from foundryx.config.schema import batch_sharers, cp_degree, tp_degree
from foundryx.config.types import coerce
from foundryx.errors import ConfigError
from foundryx.loading import keep_stored_dtype, wants_pretrained
from foundryx.loading import load as load_pretrained
from foundryx.loading import prepare as prepare_pretrained
from foundryx.loading.adapter import ADAPTER_ATTR, load_adapter_shards
from foundryx.models.peft.adapters import load_adapter, section_options
from foundryx.models.peft.frozen_base import LowPrecisionLinear, apply_frozen_base, stored_bytes
from foundryx.models.peft.frozen_options import FrozenBaseOptions
from foundryx.models.peft.lora import apply_lora, inner_model
from foundryx.models.peft.parts import STORAGE_ROWS
from foundryx.parallel import parallelize
from foundryx.parallel.cp import length_problem
from foundryx.parallel.dist import world_size
from foundryx.parallel.offload import offload_layers
from foundryx.parallel.offload_pack import pack_offloaded
from foundryx.runtime.device_choice import pick_device

log = logging.getLogger(__name__)


def build_named(reg_name: str, mapping: dict[str, dict[str, Any] | None]) -> list[Any]:
    """``{key: kwargs}`` → one object per registry key (algorithms, callbacks, loggers); an
    entry with an options dataclass gets an instance of it, as in :func:`build_component`."""
    return [build_component(reg_name, {**(kwargs or {}), "name": name})
            for name, kwargs in mapping.items()]


def build_tokenizer(cfg: TrainConfig) -> Any:
    return build_component("tokenizers", cfg.tokenizer)


def build_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    """The model section's model, with LoRA applied from outside when it has ``peft_config``
    (before parallelism and the optimizer, as torchtitan orders them)."""
    model = build_component("models", cfg.model, tokenizer=tokenizer)
    adapter = cfg.model.get("pretrained_lora_id_or_path")
    options = section_options(cfg.model.get("peft_config"), adapter)
    if options is not None:
        if cfg.model.get("peft_config") is None:  # taken from the adapter: recorded in checkpoints
            cfg.model["peft_config"] = dataclasses.asdict(options)
        model = apply_lora(model, options)
        if adapter is not None and not load_adapter(inner_model(model), adapter):
            setattr(model, ADAPTER_ATTR, adapter)  # built on meta: read in after parallelism
    frozen = cfg.model.get("frozen_base")
    if frozen is not None:  # after LoRA, before parallelism
        model = apply_frozen_storage(model, coerce(FrozenBaseOptions, frozen, owner="model.frozen_base"),
                                     tp=tp_degree(getattr(cfg, "parallelism", None)),
                                     device=pick_device(getattr(cfg, "device", None)))
    return model


def apply_frozen_storage(model: Any, options: FrozenBaseOptions, tp: int = 1,
                         device: torch.device | str | None = None) -> Any:
    """``model.frozen_base`` from outside the model: the frozen linear weights stored in
    ``options.dtype`` (models.peft.frozen_base), then ``options.offload_fraction`` of those
    layers offloaded to host memory by the offload runtime (parallel.offload), handed the
    storages' row cuts and ``device``, the run's (None: ``pick_device``'s), which
    decides whether their host buffer is pinned and whether an fp8 base multiplies in FP8."""
    world = world_size()
    device = device if device is not None else pick_device()
    model = apply_frozen_base(model, options, tp=tp, world=world, device=device)
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    chosen = offload_layers(layers, options.offload_fraction, STORAGE_ROWS, device)
    if chosen:
        size = sum(stored_bytes(layer.offload.host) for layer in chosen)
        if chosen[0].offload.host.is_meta:
            size //= world  # placeholders: each rank will hold its rows
        log.info("frozen_base: %d of %d frozen linear layers offloaded to host memory (%.1f MB on "
                 "each of %d ranks)", len(chosen), len(layers), size / 2**20, world)
    return model


def build_dataloader(section: dict[str, Any], tokenizer: Any, device_batch_size: int) -> Any:
    """A loader with an options dataclass gets it (see foundryx.config.components); one
    without gets the whole section: ``factory(cfg, tokenizer, device_batch_size)``."""
    factory = registry.dataloaders.get(section["name"])
    if options_parameter(factory) is not None:
        return build_component("dataloaders", section, tokenizer=tokenizer,
                               device_batch_size=device_batch_size)
    return factory(section, tokenizer, device_batch_size)


def tp_run_problems(data: dict[str, Any]) -> list[str]:
    """With ``parallelism.tp`` > 1 the ranks of a tensor-parallel group must read the same
    batches: only the ``text`` loader (streaming's ``replication``) can (the ICL evaluators
    read by data-parallel rank: foundryx.eval.data). So must a context-parallel group's
    (``parallelism.cp``), which also needs a ``max_seq_len`` it divides (see
    :func:`cp_run_problems`)."""
    tp = batch_sharers(data.get("parallelism"))
    problems = cp_run_problems(data)
    if tp == 1:
        return problems
    what = "tp" if cp_degree(data.get("parallelism")) == 1 else \
        "cp" if tp_degree(data.get("parallelism")) == 1 else "tp x cp"
    for key in ("train_loader", "eval_loader"):
        section = data.get(key)
        if not isinstance(section, dict):
            continue
        if section.get("name") != "text":
            problems.append(f"{key}.name: {section.get('name')!r} with parallelism.{what}: {tp}; "
                            f"the ranks of a {GROUP[what]} group must read the same batches, "
                            "which only the 'text' loader does (dataset.replication); use it or "
                            f"{what}: 1")
        else:
            rep = (section.get("dataset") or {}).get("replication")
            if rep not in (None, tp):
                problems.append(f"{key}.dataset.replication: {rep}, but parallelism.{what} is {tp}; "
                                f"drop it (foundryx sets it to {tp})")
    return problems


GROUP = {"tp": "tensor-parallel", "cp": "context-parallel", "tp x cp": "tensor- and context-parallel"}


def cp_run_problems(data: dict[str, Any]) -> list[str]:
    """``parallelism.cp`` > 1: a ``max_seq_len`` it divides, no tensor parallelism beside it,
    no ICL evaluators (they read by data-parallel rank, in lengths of their own)."""
    parallelism = data.get("parallelism")
    cp = cp_degree(parallelism)
    if cp == 1:
        return []
    problems = []
    seq = data.get("max_seq_len")
    problem = length_problem(seq if isinstance(seq, int) else None, cp)
    if problem:
        problems.append(problem)
    tp = tp_degree(parallelism)
    if tp > 1:
        problems.append(f"parallelism.cp: {cp} with parallelism.tp: {tp}: context parallelism "
                        "does not combine with tensor parallelism yet; use one of them")
    if data.get("icl_tasks"):
        problems.append(f"icl_tasks: ICL evaluation with parallelism.cp: {cp} is not supported "
                        "(its batches are read by data-parallel rank); drop icl_tasks from the "
                        "training run and evaluate the checkpoint with `foundryx eval`")
    return problems


def frozen_base_checkpoint_problems(data: dict[str, Any]) -> list[str]:
    """A LoRA run on a low-precision ``frozen_base`` whose base comes from no pretrained folder
    and no ``load_path`` saves full checkpoints, the quantized base in them; DCP stores that
    storage (a tensor subclass) pickled, which no checkpoint load reads back (no pickled code
    runs: docs/checkpoints.md). Refused when it would save one."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if not (model.get("peft_config") and model.get("frozen_base") and data.get("save_folder")):
        return []
    pretrained = model.get("pretrained_model_name_or_path") and model.get("pretrained", True)
    if pretrained or data.get("load_path"):
        return []  # adapter-only checkpoints: the base is read again from its source
    return ["model.frozen_base: LoRA on a base with no pretrained weights "
            "(model.pretrained_model_name_or_path) and no load_path saves its quantized base in "
            "every checkpoint, which cannot be read back; give the base's weights as one of "
            "those, drop frozen_base, or drop save_folder"]


def replicate_data_for_tp(cfg: TrainConfig) -> None:
    """Set ``dataset.replication`` of the text loaders to ``parallelism.tp`` times
    ``parallelism.cp`` (said in one line)."""
    tp = batch_sharers(cfg.parallelism)
    if tp == 1:
        return
    for section in (cfg.train_loader, cfg.eval_loader):
        if section is not None:
            section["dataset"] = {**section.get("dataset", {}), "replication": tp}
    what = "tp" if cp_degree(cfg.parallelism) == 1 else \
        "cp" if tp_degree(cfg.parallelism) == 1 else "tp x cp"
    log.info("parallelism.%s: %d: the %d ranks of each %s group read the same "
             "batches (dataset.replication: %d)", what, tp, tp, GROUP[what], tp)


def build_optimizer(cfg: TrainConfig, model: Any) -> Any:
    section = dict(cfg.optimizer)
    if isinstance(section.get("betas"), list):
        section["betas"] = tuple(section["betas"])
    # Only trainable parameters: with LoRA the frozen base gets no optimizer state.
    params = [p for p in model.parameters() if p.requires_grad]
    return build_component("optimizers", section, params=params)


def build_scheduler(cfg: TrainConfig) -> Any:
    return build_component("schedulers", cfg.scheduler)


def build_parallelism(cfg: TrainConfig, model: Any) -> Any:
    """Apply ``parallelism`` (FSDP2), ``activation_checkpointing``, ``compile`` and
    ``cpu_matmul`` to ``model`` and materialise meta-device weights: a model built on meta
    that wants pretrained weights gets them read shard by shard (foundryx.loading; the folder
    is checked first, on every rank). Call before building the optimizer. See
    docs/distributed.md."""
    return parallelize_and_load(model, cfg.parallelism,
                                activation_checkpointing=cfg.activation_checkpointing,
                                compile=cfg.compile, precision=cfg.precision,
                                cpu_matmul=cfg.cpu_matmul, device=pick_device(cfg.device),
                                float8=cfg.float8, tiling=cfg.tiling,
                                microbatch_tokens=microbatch_tokens(cfg),
                                fused_ops=getattr(cfg, "fused_ops", None))


def microbatch_tokens(cfg: TrainConfig) -> int | None:
    """Tokens of one training microbatch a device holds (``tiling: auto`` decides on it; under
    context parallelism its 1/cp of each sequence, as the planner counts it), or None."""
    mb = cfg.device_train_microbatch_size
    if not isinstance(mb, int) or not cfg.max_seq_len:
        return None
    cp = int(getattr(cfg.parallelism, "cp", 1) or 1) if cfg.parallelism is not None else 1
    return mb * int(cfg.max_seq_len) // max(cp, 1)


def parallelize_and_load(model: Any, parallelism: Any = None, **kwargs: Any) -> Any:
    """:func:`foundryx.parallel.parallelize` with ``kwargs``, and the pretrained weights (and
    ``pretrained_lora_id_or_path``'s adapter) of a meta-built model read into its shards
    afterwards."""
    folder = wants_pretrained(model)
    plan = prepare_pretrained(model, folder) if folder else None
    if plan is not None:  # frozen-only FSDP2 units keep the checkpoint's dtype
        keep_stored_dtype(model, plan, parallelism, kwargs.get("precision") or "fp32")
    model = parallelize(model, parallelism, **kwargs)
    device = kwargs.get("device") or pick_device()
    if plan is not None:
        load_pretrained(model, plan, device)
    elif tp_degree(parallelism) > 1:  # TP cut the offloaded shards again: one buffer once more
        offloaded = [m for m in model.modules()
                     if isinstance(m, LowPrecisionLinear) and m.offload is not None]
        if offloaded and not offloaded[0].offload.host.is_meta:
            pack_offloaded(offloaded, device)
    if getattr(model, ADAPTER_ATTR, None):  # a meta-built model's pretrained_lora_id_or_path
        load_adapter_shards(model, getattr(model, ADAPTER_ATTR))
    return model


def resolve_autoresume(cfg: TrainConfig) -> bool:
    """``autoresume``, defaulting to on when ``save_folder`` is set and ``save_overwrite`` is not."""
    if cfg.autoresume is not None:
        problems = []
        if cfg.autoresume and not cfg.save_folder:
            problems.append("autoresume: true needs a save_folder to resume from; set save_folder")
        if cfg.autoresume and cfg.save_overwrite:
            problems.append("autoresume: true and save_overwrite: true contradict each other "
                            "(continue from the checkpoints, or replace them); drop one")
        if problems:
            raise ConfigError(problems)
        return cfg.autoresume
    if not cfg.save_folder:
        return False
    log.info("autoresume: %s (not set; save_folder is set and save_overwrite is %s)",
             "on" if not cfg.save_overwrite else "off", str(cfg.save_overwrite).lower())
    return not cfg.save_overwrite


def stable_run_name(cfg: TrainConfig, source: str) -> str | None:
    """``run_name``, or when unset and checkpoints are saved, one derived from the config file
    and save_folder, so a restarted job gets the same name."""
    if cfg.run_name or not cfg.save_folder:
        return cfg.run_name
    where = cfg.save_folder if is_remote(cfg.save_folder) else str(Path(cfg.save_folder).resolve())
    digest = hashlib.sha1(where.encode()).hexdigest()[:8]
    name = f"{Path(source).stem}-{digest}"
    log.info("run_name: %s (not set; derived from the config name and save_folder)", name)
    return name


def build_checkpointer(cfg: TrainConfig, run_name: str | None) -> Any:
    """The Checkpointer callback (saves, keeps the last K, autoresume, load_path), or None.
    Each checkpoint records the run's model and tokenizer sections (``components.json``); an
    ``s3://`` save_folder or load_path gets the RemoteCheckpointer (docs/storage.md)."""
    if not cfg.save_folder and not cfg.load_path:
        return None
    remote = is_remote(cfg.save_folder) or is_remote(cfg.load_path)
    return (RemoteCheckpointer if remote else Checkpointer)(
        save_folder=cfg.save_folder, save_interval=cfg.save_interval,
        keep=cfg.save_num_checkpoints_to_keep, overwrite=cfg.save_overwrite,
        autoresume=resolve_autoresume(cfg), load_path=cfg.load_path,
        load_weights_only=cfg.load_weights_only, run_name=run_name,
        model_section=cfg.model, tokenizer_section=cfg.tokenizer, run=_run_shape(cfg),
    )


def _run_shape(cfg: TrainConfig) -> dict[str, Any]:
    """What a resume of this run must keep (foundryx/checkpoint/run_shape.py)."""
    frozen = cfg.model.get("frozen_base") if isinstance(cfg.model, dict) else None
    dataset = cfg.train_loader.get("dataset") if isinstance(cfg.train_loader, dict) else None
    return run_shape(cfg.global_train_batch_size, cfg.max_seq_len,
                     frozen.get("dtype") if isinstance(frozen, dict) else None, dataset)
