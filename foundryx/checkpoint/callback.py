"""``Checkpointer``: the Composer callback that resumes, saves and prunes foundryx checkpoints."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist

from foundryx.checkpoint import load as loader
from foundryx.checkpoint.layout import complete_checkpoints, resolve_checkpoint, unfinished_saves
from foundryx.checkpoint.lock import SaveFolderLock
from foundryx.checkpoint.lora import base_record, check_base, read_base
from foundryx.checkpoint.metadata import read_components, record_of
from foundryx.checkpoint.run_shape import check_resume
from foundryx.checkpoint.save import finish_interrupted_commits, save
from foundryx.checkpoint.trainer_state import set_rng_state
from foundryx.checkpoint.weights import load_model_weights, match_prefix
from foundryx.errors import CheckpointError
from foundryx.models.peft.adapters import base_key, is_adapter_key
from foundryx.parallel.tp_fused import permute_full_state
from foundryx.runtime import preempt

log = logging.getLogger(__name__)


class Checkpointer(Callback):
    """Sharded checkpoints in ``save_folder`` every ``save_interval`` and at the end of training.

    Before training (Composer's ``AFTER_LOAD``): with ``autoresume``, continue from the newest
    intact checkpoint in ``save_folder`` (falling back past corrupt ones); otherwise load
    ``load_path`` if given (a foundryx checkpoint, or a weights file, which rank 0 reads and
    broadcasts). A ``save_folder`` that already holds checkpoints needs ``autoresume`` or
    ``overwrite``; with ``overwrite`` they are deleted when this run commits its first one.

    ``model_section`` and ``tokenizer_section`` (the run's resolved sections) are recorded in
    each checkpoint as ``components.json``, from which ``rebuild_model`` (``foundryx export``,
    ``foundryx eval``) rebuilds the model through the registries.
    """

    def __init__(
        self,
        save_folder: str | None,
        save_interval: str = "1000ba",
        keep: int = -1,
        overwrite: bool = False,
        autoresume: bool = False,
        load_path: str | None = None,
        load_weights_only: bool = False,
        run_name: str | None = None,
        model_section: dict[str, Any] | None = None,
        tokenizer_section: dict[str, Any] | None = None,
        run: dict[str, Any] | None = None,
    ):
        self.save_folder = Path(save_folder) if save_folder else None
        self.should_save = create_interval_scheduler(save_interval)
        self.keep, self.overwrite, self.autoresume = keep, overwrite, autoresume
        self.load_path, self.load_weights_only, self.run_name = load_path, load_weights_only, run_name
        self.components = (record_of(model_section, tokenizer_section)
                           if model_section is not None else None)
        self.run = run  # what a resume must keep (run_shape.py), recorded with the components
        if self.components is not None and run is not None:
            self.components["run"] = run
        self.replace: set[str] = set()
        self.loaded: Path | None = None
        self._rng: dict[str, Any] | None = None
        self._last_saved = -1
        self._due = False  # a save due at the last batch of an epoch, made at the epoch's end
        self._lock: SaveFolderLock | None = None
        self._base: dict[str, Any] | None = None  # a LoRA run's base record (lora.py)

    # -- before training ----------------------------------------------------------------
    def after_load(self, state: State, logger: Logger) -> None:
        try:
            self._resume_or_load(state)
        except BaseException:
            self.close(state, logger)  # a run that cannot start leaves the folder as it was
            raise

    def _resume_or_load(self, state: State) -> None:
        section = self.components.get("model") if self.components is not None else None
        self._base = base_record(state.model, section, self.load_path, self._lora_of_load_path())
        if self._base is not None and not self._base["adapter_only"] and self.save_folder:
            log.info("LoRA on a randomly initialised base (no pretrained_model_name_or_path with "
                     "pretrained: true, no load_path): checkpoints hold the whole model, base "
                     "included, as the base cannot be read again from a source")
        if self.save_folder is not None:
            self._take_lock(self.save_folder)
            self._tidy(self.save_folder)
            if self.autoresume:
                found = self._newest_intact()
                if found is not None:
                    self._check_resume(found)
                    self._load_lora_base(state, found)
                    self._rng = loader.load(state, found, base=self._base)
                    self.loaded, self._last_saved = found, int(state.timestamp.batch)
                    preempt.checkpointed(self._last_saved)
                    return
                log.info("autoresume: no checkpoint in %s yet; starting from the beginning",
                         self.save_folder)
            else:
                self._check_reuse(self.save_folder)
        if self.load_path:
            self._load_path(state, self.load_path)

    def _lora_of_load_path(self) -> dict[str, Any] | None:
        """The base record of the LoRA checkpoint ``load_path`` names (local), else None."""
        path = Path(self.load_path) if self.load_path else None
        if path is None or (path.is_file() and path.name != "manifest.json"):
            return None
        try:
            return read_base(resolve_checkpoint(path))
        except CheckpointError:  # not a checkpoint (yet): said when it is loaded
            return None

    def _check_resume(self, folder: Path) -> None:
        """Before a resume loads anything: the run that saved ``folder`` and this one agree on
        what a resume must keep (run_shape.py)."""
        record = read_components(folder)
        check_resume(folder, record[0].get("run") if record else None, self.run)

    def _load_lora_base(self, state: State, found: Path) -> None:
        """Before resuming an adapter-only checkpoint whose base came from ``load_path``: check
        the base is the one it records, then load the base's weights from ``load_path``."""
        saved = check_base(found, self._base)
        if saved is None or not saved.get("adapter_only") or saved.get("source_field") != "load_path":
            return
        path = Path(self.load_path)
        if path.is_file() and path.name != "manifest.json":
            self._load_weights_file(state, path)
        else:
            loader.load(state, loader.verified(resolve_checkpoint(path)), weights_only=True,
                        base=self._base)
        log.info("LoRA base weights read again from load_path %s before resuming %s", path, found)

    def _newest_intact(self) -> Path | None:
        """The checkpoint autoresume continues from (RemoteCheckpointer: from the bucket)."""
        return loader.newest_intact(self.save_folder)

    def _take_lock(self, root: Path) -> None:
        """Rank 0 takes ``root``'s lock (see lock.py); every rank stops if another run holds it."""
        problem = None
        if dist.get_global_rank() == 0:
            lock = SaveFolderLock(root, self.run_name)
            try:
                lock.acquire()
                self._lock = lock
            except CheckpointError as e:
                problem = str(e)
        problem = dist.all_gather_object(problem)[0]
        if problem is not None:
            raise CheckpointError(problem)

    def close(self, state: State, logger: Logger) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _tidy(self, root: Path) -> None:
        """Finish commits a kill interrupted, then remove temp folders of saves that never
        committed (rank 0)."""
        if dist.get_global_rank() == 0:
            for line in finish_interrupted_commits(root):
                log.info("checkpoint commit interrupted by the end of the last run: %s", line)
        stale = dist.all_gather_object([str(p) for p in unfinished_saves(root)])[0]
        if dist.get_global_rank() == 0 and stale:
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
            log.info("removed %d temp folder(s) of unfinished saves or prunes in %s: %s", len(stale), root,
                     ", ".join(Path(p).name for p in stale))
        dist.barrier()

    def _check_reuse(self, root: Path) -> None:
        existing = [p.name for p, _ in complete_checkpoints(root)]
        if not existing:
            return
        if not self.overwrite:
            raise CheckpointError(
                f"save_folder {root} already holds checkpoints ({', '.join(sorted(existing))}); "
                "set autoresume: true to continue from them, save_overwrite: true to replace "
                "them, or choose another save_folder"
            )
        self.replace = set(existing)
        log.info("save_overwrite: the %d checkpoint(s) already in %s are deleted when this run "
                 "saves its first one", len(existing), root)

    def _load_path(self, state: State, path: str) -> None:
        p = Path(path)
        if p.is_file() and p.name != "manifest.json":
            self._load_weights_file(state, p)
            return
        folder = loader.verified(resolve_checkpoint(p))
        saved = read_base(folder)
        if saved is not None and saved.get("adapter_only") and saved.get("source_field") == "load_path":
            raise CheckpointError(
                f"load_path {folder}: holds only LoRA adapters, whose base came from load_path "
                f"{saved['source']}; continue it with autoresume in its own save_folder (and that "
                "load_path), or export its adapter (foundryx export) and start from it with "
                f"model.pretrained_lora_id_or_path and load_path: {saved['source']}")
        if not self.load_weights_only:
            self._check_resume(folder)
        self._rng = loader.load(state, folder, weights_only=self.load_weights_only, base=self._base,
                                via="load_path")
        self.loaded = folder

    def _load_weights_file(self, state: State, path: Path) -> None:
        """Rank 0 reads a weights file once; every rank receives its part of it."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        full = load_model_weights(path) if dist.get_global_rank() == 0 else {}
        lora = self._base is not None
        if full:
            keys = set(get_model_state_dict(state.model))
            names = {base_key(k): k for k in keys if not is_adapter_key(k)} if lora else {}
            full = _match_keys(full, set(names) if lora else keys, path)
            full = {names[k]: v for k, v in full.items()} if lora else full
            permute_full_state(state.model, full)  # a fused layer's rows in this run's TP order
        distributed = dist.get_world_size() > 1
        try:
            set_model_state_dict(state.model, full, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=distributed, strict=not lora))
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: does not fit the model ({str(e).strip()[:300]})") from None
        log.info("loaded model weights from %s%s", path,
                 " (read on rank 0, broadcast)" if distributed else "")
        self.loaded = path

    # -- during training ----------------------------------------------------------------
    def epoch_start(self, state: State, logger: Logger) -> None:
        if self._rng is not None:  # a checkpoint of an epoch's start: before its loader starts
            set_rng_state(self._rng)
            self._rng = None

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._rng is not None:  # mid-epoch: here, after the loader has skipped to the batch
            set_rng_state(self._rng)
            self._rng = None
        if self._due:  # the epoch did not end after all (a loader longer than its len)
            self._save_now(state)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_save(state, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._maybe_save(state, Event.EPOCH_CHECKPOINT)

    def _maybe_save(self, state: State, event: Event) -> None:
        if self.save_folder is None:
            return
        if not self.should_save(state, event) and not (self._due and event == Event.EPOCH_CHECKPOINT):
            return
        if int(state.timestamp.batch) == self._last_saved:
            return
        if event == Event.BATCH_CHECKPOINT and _ends_epoch(state):
            self._due = True  # saved at EPOCH_CHECKPOINT, as the next epoch starts (see _ends_epoch)
            return
        self._save_now(state)

    def _save_now(self, state: State) -> None:
        self._due = False
        self._save(state)
        self.replace = set()
        self._last_saved = int(state.timestamp.batch)

    def _save(self, state: State) -> Path:
        """Write and commit one checkpoint (RemoteCheckpointer: then upload it)."""
        return save(state, self.save_folder, run_name=self.run_name, keep=self.keep,
                    replace=self.replace, components=self.components, lora=self._base)


def _ends_epoch(state: State) -> bool:
    """Whether this batch is the last of its epoch. A checkpoint due there is written at the
    epoch's end (Composer's EPOCH_CHECKPOINT, named for the next epoch): after the epoch's end
    events (train metrics, EPOCH_END evals), at the next epoch's start, which a resume continues
    from exactly (the sampler's next epoch, the loader started afresh, the RNG as it was before
    it started). A checkpoint of the last batch itself would resume into an epoch with nothing
    left, which Composer runs through empty, the RNG restored only after the next epoch's loader
    has started."""
    length = state.dataloader_len
    return length is not None and int(state.timestamp.batch_in_epoch) == int(length)


def _match_keys(weights: dict[str, Any], expected: set[str], path: Path) -> dict[str, Any]:
    """``weights`` keyed like the model (see :func:`~foundryx.checkpoint.weights.match_prefix`);
    CheckpointError naming the file when the keys still differ."""
    weights = match_prefix(weights, expected)
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or extra:
        raise CheckpointError(
            f"{path}: its tensors do not match the model (missing: {missing[:3]}, "
            f"unexpected: {extra[:3]}); load weights saved from this model"
        )
    return weights
