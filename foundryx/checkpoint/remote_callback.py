"""``RemoteCheckpointer``: the Checkpointer for a ``save_folder`` or ``load_path`` in object
storage (``s3://bucket/run``); see docs/storage.md.

- Before training: every node checks it can list and write the bucket (a missing bucket, a
  wrong endpoint or missing credentials stop the run here: CheckpointError, exit code 2);
  uploads a killed run left without a manifest are deleted; with autoresume the newest
  complete remote checkpoint is downloaded once per node (local rank 0, every sha256 checked)
  into the local staging folder and loaded from there like a local checkpoint.
- Saving: the checkpoint is written and committed in the local staging folder
  (``$FOUNDRYX_CHECKPOINT_CACHE/staging/<bucket>/<path>``), then each rank uploads its files from
  its upload process (upload_process.py: no share of the training process's interpreter lock)
  while training continues; rank 0 uploads the manifest last (upload.py). At most one
  checkpoint is in flight: the next save first waits for the previous upload.
- At the end of training the run waits for the pending upload, with a progress line.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger
from composer.utils import dist

from foundryx.checkpoint.callback import Checkpointer
from foundryx.checkpoint.layout import LATEST, MANIFEST, TMP_PREFIX, Manifest
from foundryx.checkpoint.lock import LOCK
from foundryx.checkpoint.remote import (
    RemoteFolder,
    cache_folder,
    check_access,
    checkpoints,
    client,
    download,
    fetch,
    is_remote,
    tidy,
)
from foundryx.checkpoint.remote_lock import BucketLock
from foundryx.checkpoint.save import my_files
from foundryx.checkpoint.upload import UploadHandle
from foundryx.checkpoint.upload_process import UploadWorker
from foundryx.errors import CheckpointError

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0


def _node_result(value: Any) -> Any:
    """Every rank gets the value its node's local rank 0 passed (ranks are numbered node by
    node, as the composer launcher and torchrun do)."""
    values = dist.all_gather_object(value)
    return values[dist.get_global_rank() - dist.get_local_rank()]


def _first_problem(problem: str | None) -> None:
    """Every rank raises the first rank's problem, if any rank has one."""
    problems = [p for p in dist.all_gather_object(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])


class RemoteCheckpointer(Checkpointer):
    """A Checkpointer whose ``save_folder`` (and/or ``load_path``) may be an ``s3://`` URL."""

    def __init__(self, save_folder: str | None, *args: Any, **kwargs: Any):
        self.url = save_folder
        self.remote = RemoteFolder.parse(save_folder) if is_remote(save_folder) else None
        staging = str(cache_folder(save_folder)) if self.remote is not None else save_folder
        super().__init__(staging, *args, **kwargs)
        self._s3: Any = None
        self._complete: list[tuple[str, Manifest]] = []
        self._upload: UploadHandle | None = None
        self._uploads = UploadWorker()  # this rank's upload process, from its first save
        self._newest: str | None = None  # the newest complete remote checkpoint, for messages
        self._bucket_lock: BucketLock | None = None

    def _client(self) -> Any:
        if self._s3 is None:
            self._s3 = client()
        return self._s3

    # -- before training ----------------------------------------------------------------
    def _take_lock(self, root: Path) -> None:
        if self.remote is not None:
            _first_problem(check_access(self.url) if dist.get_local_rank() == 0 else None)
            problem = None
            if dist.get_global_rank() == 0:
                lock = BucketLock(self._client(), self.remote, self.run_name)
                try:
                    lock.acquire()
                    self._bucket_lock = lock
                except CheckpointError as e:
                    problem = str(e)
            _first_problem(problem)
            if dist.get_global_rank() == 0:
                log.info("save_folder %s: checkpoints are written to %s (this node's disk) first "
                         "and uploaded in the background", self.url, root)
        super()._take_lock(root)

    def _tidy(self, root: Path) -> None:
        super()._tidy(root)
        if self.remote is None:
            return
        if dist.get_local_rank() == 0 and root.is_dir():  # staging holds only in-flight saves
            for p in root.iterdir():
                if not p.name.startswith(LOCK) and p.name != LATEST:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        found = None
        if dist.get_global_rank() == 0:
            try:
                complete, incomplete, unfinished = checkpoints(self._client(), self.remote)
                tidy(self._client(), self.remote, unfinished)
                for why in incomplete:
                    log.warning("skipping %s", why)
                found = complete
            except Exception as e:  # one message, on every rank
                found = f"{self.url}: cannot list its checkpoints ({e})"
        found = dist.all_gather_object(found)[0]
        if isinstance(found, str):
            raise CheckpointError(found)
        self._complete = found
        self._newest = found[0][0] if found else None
        dist.barrier()

    def _check_reuse(self, root: Path) -> None:
        if self.remote is None:
            return super()._check_reuse(root)
        existing = [name for name, _ in self._complete]
        if not existing:
            return
        if not self.overwrite:
            raise CheckpointError(
                f"save_folder {self.url} already holds checkpoints ({', '.join(sorted(existing))}); "
                "set autoresume: true to continue from them, save_overwrite: true to replace "
                "them, or choose another save_folder")
        self.replace = set(existing)
        log.info("save_overwrite: the %d checkpoint(s) already in %s are deleted when this run "
                 "uploads its first one", len(existing), self.url)

    def _newest_intact(self) -> Path | None:
        if self.remote is None:
            return super()._newest_intact()
        failures = []
        for name, manifest in self._complete:
            problem = None
            if dist.get_local_rank() == 0:
                try:
                    download(self._client(), self.remote, name, manifest, self.save_folder)
                except CheckpointError as e:
                    problem = str(e)
                except Exception as e:
                    problem = f"{self.url}/{name}: download failed ({e})"
            problems = [p for p in dist.all_gather_object(problem) if p is not None]
            if not problems:
                return self.save_folder / name
            failures.append(problems[0])
            log.warning("checkpoint %s/%s cannot be used; trying the previous one:\n  %s",
                        self.url, name, problems[0])
        if failures:
            raise CheckpointError("\n".join([f"autoresume: no usable checkpoint in {self.url}:"]
                                            + [f"  - {p}" for p in failures]))
        return None

    def after_load(self, state: State, logger: Logger) -> None:
        super().after_load(state, logger)
        loaded = self.loaded
        if self.remote is not None and loaded is not None and loaded.parent == self.save_folder:
            dist.barrier()  # every rank has read it: the downloaded copy goes
            if dist.get_local_rank() == 0:
                shutil.rmtree(loaded, ignore_errors=True)

    def _load_path(self, state: State, path: str) -> None:
        if not is_remote(path):
            return super()._load_path(state, path)
        local, problem = None, None
        if dist.get_local_rank() == 0:
            try:
                local = str(fetch(path))
            except CheckpointError as e:
                problem = str(e)
        _first_problem(problem)
        super()._load_path(state, _node_result(local))

    # -- saving ---------------------------------------------------------------------------
    def _save(self, state: State) -> Path:
        if self.remote is None:
            return super()._save(state)
        if self._upload is not None:
            if self._upload.running():
                log.info("waiting for the upload of %s before saving the next checkpoint "
                         "(uploads take longer than save_interval)", self._upload.name)
            self._wait()
        replace = set(self.replace)
        folder = super()._save(state)
        view = folder if folder.is_dir() else folder.parent / (TMP_PREFIX + folder.name)
        seen = [str(p.relative_to(view)) for p in view.rglob("*") if p.is_file() and p.name != MANIFEST]
        mine = my_files(seen)
        manifest = Manifest.read(view).files if dist.get_global_rank() == 0 else None
        self._upload = self._uploads.submit(self.remote, folder.name, view, mine, manifest=manifest,
                                            keep=self.keep, replace=replace,
                                            newest_complete=self._newest)
        if dist.get_global_rank() == 0:
            log.info("checkpoint %s staged in %s; uploading to %s/%s in the background",
                     folder.name, folder.parent, self.url, folder.name)
        return folder

    def _wait(self) -> None:
        """Wait for this rank's pending upload, a progress line every few seconds; raise its
        error, if it failed."""
        up = self._upload
        if up is None:
            return
        while not up.join(PROGRESS_EVERY_S):
            log.info("waiting for the upload of checkpoint %s to %s: %s", up.name, self.url,
                     up.progress())
        self._raise_if_failed()
        if up.committed:
            self._newest = up.name
        self._upload = None

    def _raise_if_failed(self) -> None:
        if self._upload is not None and self._upload.error is not None:
            error, self._upload = self._upload.error, None
            raise error

    def batch_end(self, state: State, logger: Logger) -> None:
        self._raise_if_failed()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._upload is not None:
            if self._upload.running() and dist.get_global_rank() == 0:
                log.info("training done; waiting for the upload of checkpoint %s to %s",
                         self._upload.name, self.url)
            self._wait()

    def close(self, state: State, logger: Logger) -> None:
        up, self._upload = self._upload, None
        if up is not None and up.running():
            up.stop()
            log.warning("checkpoint %s was not uploaded completely (the run is stopping); %s "
                        "holds no manifest for it, so autoresume does not take it", up.name,
                        self.url)
        self._uploads.close()
        if self._bucket_lock is not None:
            self._bucket_lock.release()
            self._bucket_lock = None
        super().close(state, logger)
