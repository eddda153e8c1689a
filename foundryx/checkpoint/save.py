"""Saving a sharded checkpoint and committing it atomically (every rank calls ``save``)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from composer.utils import dist
from torch.distributed.checkpoint.api import CheckpointException

from foundryx.checkpoint import trainer_state
from foundryx.checkpoint.layout import (
    DCP_DIR,
    MANIFEST,
    RNG_DIR,
    TMP_PREFIX,
    TRAINER_STATE,
    Manifest,
    checkpoint_name,
    complete_checkpoints,
    fsync_dir,
    point_latest,
    write_json_atomic,
)
from foundryx.checkpoint.lora import adapter_state, write_base
from foundryx.checkpoint.metadata import write_components, write_model_metadata
from foundryx.checkpoint.tp_rows import to_logical_rows
from foundryx.checkpoint.verify import file_digest, signature
from foundryx.checkpoint.write_failure import describe, interrupted, state_bytes
from foundryx.errors import CheckpointError
from foundryx.runtime import preempt

log = logging.getLogger(__name__)

# what a save that cannot write raises (DCP wraps every rank's error in CheckpointException)
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, CheckpointException)


def model_and_optim_state(model: torch.nn.Module, optimizers: Any) -> tuple[dict, dict]:
    """Sharded (DTensor under FSDP) model and optimizer state dicts, keyed by parameter name,
    with fused layers' rows in their logical order (:mod:`foundryx.checkpoint.tp_rows`)."""
    model_sd, optim_sd = live_state(model, optimizers)
    to_logical_rows(model, model_sd, optim_sd)
    return model_sd, optim_sd


def live_state(model: torch.nn.Module, optimizers: Any) -> tuple[dict, dict]:
    """The model and optimizer state dicts as the model holds them (a load's target)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, list(optimizers or []))


def tensor_shapes(state_dict: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of the tensors of a (possibly sharded) state dict."""
    return {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def save(
    state: Any,
    save_folder: str | Path,
    *,
    run_name: str | None,
    keep: int = -1,
    replace: set[str] | None = None,
    components: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``state`` under ``save_folder`` and commit it; return its folder.

    Files go to ``.tmp-<name>/``; after every rank has written its shards and every file is
    hashed, rank 0 writes ``manifest.json`` and renames the folder into place, repoints
    ``latest`` and keeps the newest ``keep`` checkpoints (-1: all). Names in ``replace`` are
    checkpoints that may be deleted regardless of ``keep`` (an overwritten earlier run).
    ``components`` (see :func:`~foundryx.checkpoint.metadata.record_of`) is written as
    ``components.json``; the model's Hugging Face config and tokenizer go to ``hf/``.
    ``lora`` (a LoRA run's :func:`~foundryx.checkpoint.lora.base_record`) is written as
    ``lora_base.json``; when it says ``adapter_only`` only the LoRA weights of the model are
    saved (the optimizer holds only them anyway).
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    root = Path(save_folder)
    ts = state.timestamp
    name = checkpoint_name(int(ts.epoch), int(ts.batch))
    tmp, final = root / (TMP_PREFIX + name), root / name
    rank, world = dist.get_global_rank(), dist.get_world_size()
    if dist.get_local_rank() == 0 and tmp.exists():  # each node: staging may be node-local
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt at this very save
    dist.barrier()
    (tmp / RNG_DIR).mkdir(parents=True, exist_ok=True)
    dist.barrier()

    model_sd, optim_sd = model_and_optim_state(state.model, state.optimizers)
    if lora is not None and lora.get("adapter_only"):
        model_sd = adapter_state(model_sd)
    failure: BaseException | None = None
    try:
        dcp_save({"model": model_sd, "optim": optim_sd},
                 storage_writer=FileSystemWriter(str(tmp / DCP_DIR)))
        write_json_atomic(tmp / RNG_DIR / f"rank{rank}.json", trainer_state.rng_state())
        if rank == 0:
            write_json_atomic(tmp / TRAINER_STATE, trainer_state.capture(state))
            write_model_metadata(tmp, state.model)  # hf/: config + tokenizer, for export and eval
            if components is not None:
                write_components(tmp, components)  # model + tokenizer sections, for rebuild_model
            if lora is not None:
                write_base(tmp, lora)  # the LoRA base's source and config hash
    except WRITE_ERRORS as e:
        if interrupted(e):  # a second Ctrl-C: stop now (foundryx.runtime.preempt), not a write failure
            raise KeyboardInterrupt from None
        failure = e
    _agree(failure, root, tmp, lambda: state_bytes(model_sd, optim_sd))

    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    mine = {rel: file_digest(tmp / rel) for rel in my_files(files)}
    digests: dict[str, Any] = {}
    for part in dist.all_gather_object(mine):
        digests.update(part)
    failure = None
    if rank == 0:
        shapes = tensor_shapes(model_sd)
        try:
            Manifest(
                batch=int(ts.batch), epoch=int(ts.epoch), world_size=world, run_name=run_name,
                model_class=type(state.model).__name__, model_signature=signature(shapes),
                num_params=sum(_numel(s) for s, _ in shapes.values()), files=digests,
            ).write(tmp)
        except OSError as e:
            failure = e
    _agree(failure, root, tmp, lambda: state_bytes(model_sd, optim_sd))
    if rank == 0:
        _commit(root, tmp, final)
        _after_commit(root, final.name, keep, replace or set())
        log.info("checkpoint saved: %s (%d files, %d ranks)", final, len(files) + 1, world)
    dist.barrier()
    return final


def my_files(seen: list[str]) -> list[str]:
    """This rank's share of the files of a save, given the files it sees (every rank calls it):
    each file goes to one of the ranks that see it, spread evenly. On a shared file system all
    ranks see every file; on node-local staging (a remote save_folder), the ranks of the node
    that wrote it."""
    seers: dict[str, list[int]] = {}
    for r, view in enumerate(dist.all_gather_object(sorted(seen))):
        for rel in view:
            seers.setdefault(rel, []).append(r)
    rank = dist.get_global_rank()
    return [rel for i, rel in enumerate(sorted(seers)) if seers[rel][i % len(seers[rel])] == rank]


def _agree(failure: BaseException | None, root: Path, tmp: Path, needed: Callable[[], int]) -> None:
    """Every rank learns whether any rank failed to write its part; if one did, the temp folder
    is deleted and every rank raises one CheckpointError saying why and what is still there."""
    mine = None if failure is None else describe(failure, root, needed())
    texts = dist.all_gather_object(mine)
    if all(t is None for t in texts):
        return
    if dist.get_global_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    failed = [(r, t) for r, t in enumerate(texts) if t is not None]
    if len({t for _, t in failed}) == 1:
        ranks = "every rank" if len(failed) == len(texts) else ", ".join(f"rank {r}" for r, _ in failed)
        why = f"{failed[0][1]} ({ranks})" if len(texts) > 1 else failed[0][1]
    else:
        why = "; ".join(f"rank {r}: {t}" for r, t in failed)
    done = complete_checkpoints(root)
    still = (f"{done[0][0].name} is still the newest complete checkpoint" if done
             else "no earlier checkpoint is there")
    raise CheckpointError(
        f"checkpoint {tmp.name[len(TMP_PREFIX):]} could not be written to {root}: {why}. Nothing "
        f"of it was kept ({still}); make room or set save_folder to another place, then run the "
        "same command: autoresume continues from the newest complete checkpoint"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _set_aside_name(root: Path, name: str) -> Path:
    """Where a commit keeps the checkpoint it replaces until the new one is in place."""
    return root / (TMP_PREFIX + "old-" + name)


def _commit(root: Path, tmp: Path, final: Path) -> None:
    """Rename ``tmp`` (holding its manifest) to ``final``; an existing ``final`` is replaced:
    set aside, the new one renamed in, the old one deleted. A process killed between the two
    renames leaves no ``final``: :func:`finish_interrupted_commits` completes it. Said to
    foundryx.runtime.preempt at once: a Ctrl-C from here on names this checkpoint as the last."""
    assert (tmp / MANIFEST).is_file()
    old = None
    if final.exists():
        old = _set_aside_name(root, final.name)
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    batch = final.name.rsplit("-ba", 1)[-1]  # checkpoint_name's batch
    if batch.isdigit():
        preempt.checkpointed(int(batch))
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old)


def finish_interrupted_commits(root: Path) -> list[str]:
    """Complete each commit that was killed between its two renames (rank 0, before the temp
    folders of unfinished saves are removed): the checkpoint's name is missing and what it
    held is set aside. The new save, whole when it holds its manifest (written before the
    commit began), is renamed into place; without one the set-aside checkpoint goes back.
    Returns a line for each, for the log."""
    done = []
    for aside in sorted(root.glob(TMP_PREFIX + "old-*")) if root.is_dir() else []:
        name = aside.name[len(TMP_PREFIX + "old-"):]
        final, new = root / name, root / (TMP_PREFIX + name)
        if final.exists() or not (aside / MANIFEST).is_file():
            continue  # the commit got past its renames: the set-aside copy is only left over
        if (new / MANIFEST).is_file():
            os.replace(new, final)
            done.append(f"{name}: its save was complete; now in place of the previous {name}")
        else:
            os.replace(aside, final)
            done.append(f"{name}: the previous {name} is back in place")
        fsync_dir(root)
    return done


def _after_commit(root: Path, name: str, keep: int, replace: set[str]) -> None:
    """Move ``latest`` and prune; the checkpoint is committed, so a failure here is a warning."""
    try:
        point_latest(root, name)
        _prune(root, keep, keep_names={name}, replace=replace)
    except OSError as e:
        log.warning("checkpoint %s is saved, but tidying %s failed (%s); `latest` or old "
                    "checkpoints may be out of date, which autoresume does not depend on",
                    name, root, e)


def _prune(root: Path, keep: int, keep_names: set[str], replace: set[str]) -> None:
    """Delete complete checkpoints beyond the newest ``keep`` and those named in ``replace``."""
    done = [p for p, _ in complete_checkpoints(root)]
    doomed = [p for p in done if p.name in replace and p.name not in keep_names]
    if keep >= 0:
        kept = [p for p in done if p not in doomed]
        doomed += [p for p in kept[keep:] if p.name not in keep_names]
    for p in doomed:
        aside = root / (TMP_PREFIX + "pruned-" + p.name)  # one rename: never half a checkpoint
        os.replace(p, aside)
        shutil.rmtree(aside)
        why = "save_overwrite" if p.name in replace else f"save_num_checkpoints_to_keep={keep}"
        log.info("checkpoint removed: %s (%s)", p, why)
