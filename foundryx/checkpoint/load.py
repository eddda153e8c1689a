"""Loading a checkpoint into a running job (every rank calls ``load``), and picking which one."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from composer.utils import dist

from foundryx.checkpoint import trainer_state
from foundryx.checkpoint.layout import (
    CORRUPT_SUFFIX,
    DCP_DIR,
    RNG_DIR,
    TRAINER_STATE,
    Manifest,
    complete_checkpoints,
    read_json,
)
from foundryx.checkpoint.lora import adapter_state, check_base
from foundryx.checkpoint.safe_dcp import (
    DCP_ERRORS,
    SafeFileSystemReader,
    SafeLoadPlanner,
    dcp_error_text,
    read_metadata,
)
from foundryx.checkpoint.save import live_state, tensor_shapes
from foundryx.checkpoint.tp_rows import to_model_rows
from foundryx.checkpoint.verify import raise_problems, shape_mismatches, verify_files
from foundryx.checkpoint.weights import model_tensor_shapes
from foundryx.errors import CheckpointError
from foundryx.models.peft.adapters import base_key, is_adapter_key

log = logging.getLogger(__name__)


def problems_of(folder: Path) -> list[str]:
    """Integrity problems of a checkpoint, each rank checking a share of its files."""
    try:
        manifest = Manifest.read(folder)
        mine = verify_files(folder, manifest, dist.get_global_rank(), dist.get_world_size())
    except CheckpointError as e:
        mine = [str(e)]
    return sorted({p for part in dist.all_gather_object(mine) for p in part})


def newest_intact(save_folder: Path) -> Path | None:
    """The newest complete checkpoint that passes verification, or None if there is none.

    Newer ones that fail are reported and renamed ``<name>.corrupt`` (kept for inspection,
    never loaded, pruned or overwritten). If every one fails, CheckpointError lists the
    problems and nothing is renamed.
    """
    found = dist.all_gather_object([str(p) for p, _ in complete_checkpoints(save_folder)])[0]
    failures: list[tuple[Path, list[str]]] = []
    for path in map(Path, found):
        problems = problems_of(path)
        if not problems:
            set_aside([p for p, _ in failures])
            return path
        failures.append((path, problems))
        log.warning("checkpoint %s is corrupt or incomplete; trying the previous one:\n  %s",
                    path, "\n  ".join(problems))
    if failures:
        raise CheckpointError("\n".join(
            [f"autoresume: no usable checkpoint in {save_folder}:"]
            + [f"  - {p}" for _, problems in failures for p in problems]
            + ["  fix or remove them, or set save_overwrite: true to start over"]
        ))
    return None


def set_aside(paths: list[Path]) -> None:
    """Rename corrupt checkpoints to ``<name>.corrupt`` (rank 0) so they are never loaded again."""
    if dist.get_global_rank() == 0:
        for p in paths:
            target = p.with_name(p.name + CORRUPT_SUFFIX)
            n = 1
            while target.exists():
                target, n = p.with_name(f"{p.name}{CORRUPT_SUFFIX}{n}"), n + 1
            os.replace(p, target)
            log.warning("checkpoint %s set aside as %s", p, target.name)
    dist.barrier()


def check_model_matches(folder: Path, model_sd: dict[str, Any]) -> None:
    """CheckpointError naming the checkpoint when its model tensors differ from the model's."""
    diffs = shape_mismatches(tensor_shapes(model_sd), model_tensor_shapes(read_metadata(folder / DCP_DIR)))
    if diffs:
        raise CheckpointError("\n".join(
            [f"{folder / DCP_DIR / '.metadata'}: the checkpoint holds a different model:"]
            + [f"  - {d}" for d in diffs]
            + ["  load it into the model it was saved from, or use another save_folder"]
        ))


def load(state: Any, folder: Path, weights_only: bool = False,
         base: dict[str, Any] | None = None, via: str = "save_folder") -> dict[str, Any] | None:
    """Load ``folder`` into Composer ``state``: model weights, and unless ``weights_only`` the
    optimizer, schedulers, timestamp and data position. Returns this rank's saved RNG state
    when the world size is unchanged (apply it before the next batch), else None.

    ``base``: this run's LoRA base record (:func:`~foundryx.checkpoint.lora.base_record`),
    None without LoRA. A LoRA checkpoint must record the same base (else CheckpointError
    naming both); an adapter-only one loads into the LoRA weights only (the base is already
    in place). A checkpoint without LoRA loads, weights only, into a LoRA model's base.
    ``via``: how the run names ``folder`` (``save_folder`` or ``load_path``), for the fix."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    manifest = Manifest.read(folder)
    saved = check_base(folder, base, via)
    partial = saved is not None and bool(saved.get("adapter_only"))
    if weights_only:
        model_sd, optim_sd = get_model_state_dict(state.model), {}
    else:
        model_sd, optim_sd = live_state(state.model, state.optimizers)
    names: dict[str, str] | None = None  # checkpoint name -> model name, for a base into LoRA
    if partial:
        model_sd = adapter_state(model_sd)
    elif base is not None and saved is None:
        if not weights_only:
            raise CheckpointError(
                f"{folder} is a checkpoint of a run without LoRA, and this run has peft_config; "
                "give it as load_path (the base's weights) with a save_folder of its own")
        names = {base_key(k): k for k in model_sd if not is_adapter_key(k)}
        model_sd, partial = {b: model_sd[k] for b, k in names.items()}, True
    check_model_matches(folder, model_sd)
    target: dict[str, Any] = {"model": model_sd} if weights_only else {"model": model_sd, "optim": optim_sd}
    reader = SafeFileSystemReader(str(folder / DCP_DIR))
    try:
        dcp_load(target, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except DCP_ERRORS as e:
        raise CheckpointError(f"{reader.where()}: cannot load ({dcp_error_text(e)}); the "
                              "checkpoint is damaged: use an earlier one") from None
    loaded = target["model"] if names is None else {names[k]: v for k, v in target["model"].items()}
    to_model_rows(state.model, loaded, target.get("optim", {}))
    options = StateDictOptions(strict=not partial)
    if weights_only:
        set_model_state_dict(state.model, loaded, options=options)
        log.info("loaded model weights from %s%s", folder,
                 " into the LoRA model's base" if names is not None else "")
        return None
    set_state_dict(state.model, list(state.optimizers or []), model_state_dict=loaded,
                   optim_state_dict=target["optim"], options=options)
    trainer_state.restore(state, read_json(folder / TRAINER_STATE), str(folder))
    world = dist.get_world_size()
    log.info("resumed from %s at batch %d (saved with world size %d, now %d)", folder,
             manifest.batch, manifest.world_size, world)
    if manifest.world_size != world:
        log.info("world size changed (%d -> %d): RNG states start from the seed, not the "
                 "checkpoint", manifest.world_size, world)
        return None
    return read_json(folder / RNG_DIR / f"rank{dist.get_global_rank()}.json")


def verified(folder: Path) -> Path:
    """``folder`` if it passes verification, else CheckpointError naming the bad files."""
    raise_problems(folder, problems_of(folder))
    return folder
