"""Uploading a staged checkpoint to a remote save_folder in the background.

Every rank uploads the files it wrote (its share, see ``save.my_files``) from the local
staging folder while training goes on: in a thread of the rank's upload process
(``upload_process.py``), or of the calling process when :class:`Upload` is used directly.
Rank 0 then waits until the bucket holds every file the manifest lists, with the listed size,
uploads ``manifest.json`` last (the checkpoint is complete from that moment), and deletes
remote checkpoints beyond ``save_num_checkpoints_to_keep``. A file that cannot be uploaded is
retried with exponential backoff; after the last attempt the run stops at its next batch with
one message naming the object (:class:`~foundryx.errors.RunError`, exit code 1: running again
may succeed).

Test hook: ``FOUNDRYX_TEST_UPLOAD_PAUSE=<checkpoint name>`` stops the upload of that
checkpoint after its first file, until the process is killed (the window a kill test needs).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from foundryx.checkpoint.layout import MANIFEST
from foundryx.checkpoint.remote import (
    RemoteFolder,
    checkpoints,
    delete_checkpoint,
    describe_error,
    list_objects,
)
from foundryx.errors import RunError

log = logging.getLogger(__name__)

PAUSE_ENV = "FOUNDRYX_TEST_UPLOAD_PAUSE"


def staged_bytes(folder: Path, files: list[str]) -> int:
    """The size of a checkpoint's staged files: the total an upload's progress counts up to."""
    return sum((Path(folder) / rel).stat().st_size for rel in files)


class UploadHandle:
    """What the checkpoint callback sees of one checkpoint's upload by this rank, wherever it
    runs (:class:`Upload` here in a thread, ``upload_process.ProcessUpload`` in this rank's
    upload process)."""

    def __init__(self, remote: RemoteFolder, name: str, total_bytes: int,
                 newest_complete: str | None):
        self.remote, self.name, self.total_bytes = remote, name, total_bytes
        self.newest_complete = newest_complete
        self.done_bytes = 0
        self.error: RunError | None = None
        self.committed = False

    @property
    def url(self) -> str:
        return f"{self.remote.url}/{self.name}"

    def progress(self) -> str:
        return (f"{self.done_bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MB of this rank's "
                f"files")

    def _still(self) -> str:
        newest = (f"{self.remote.url}/{self.newest_complete} is still the newest complete checkpoint"
                  if self.newest_complete else "no earlier complete checkpoint is there")
        return (f"the checkpoint was not committed ({newest}); check the bucket, its permissions "
                "and the network, then run the same command: autoresume continues from the "
                "newest complete checkpoint")


class Upload(UploadHandle):
    """One checkpoint's upload by this rank; ``start()`` runs it in a daemon thread."""

    def __init__(self, s3: Any, remote: RemoteFolder, name: str, folder: Path, files: list[str], *,
                 manifest: dict[str, dict[str, Any]] | None = None, keep: int = -1,
                 replace: set[str] | None = None, attempts: int = 5, backoff_s: float = 1.0,
                 newest_complete: str | None = None, wait_timeout_s: float = 3600.0):
        folder = Path(folder)
        super().__init__(remote, name, staged_bytes(folder, files), newest_complete)
        self.s3, self.folder, self.files = s3, folder, list(files)
        self.manifest = manifest  # rank 0: the manifest's file list, uploaded last
        self.keep, self.replace = keep, set(replace or ())
        self.attempts, self.backoff_s, self.wait_timeout_s = attempts, backoff_s, wait_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"foundryx-upload-{name}", daemon=True)
        self._started = 0.0

    def start(self) -> Upload:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Abandon the upload (the run is ending on an error): the manifest is not uploaded."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            pause = os.environ.get(PAUSE_ENV) == self.name
            for i, rel in enumerate(self.files):
                if self._stop.is_set():
                    return
                if pause and i == 1:
                    log.warning("%s=%s: upload paused after its first file", PAUSE_ENV, self.name)
                    self._stop.wait()
                    return
                self._put(rel)
                self.done_bytes += (self.folder / rel).stat().st_size
            if self.manifest is None:
                self._drop_local(self.files)
                return
            if not self._wait_for_every_file():
                return
            if pause:
                log.warning("%s=%s: upload paused before its manifest", PAUSE_ENV, self.name)
                self._stop.wait()
                return
            self._put(MANIFEST)
            self.committed = True
            log.info("checkpoint uploaded: %s (%d files, %.1f MB from rank 0, %.1f s)", self.url,
                     len(self.manifest) + 1, self.total_bytes / 2**20, time.monotonic() - self._started)
            shutil.rmtree(self.folder, ignore_errors=True)  # every rank's files are in the bucket
            self._prune()
        except RunError as e:
            self.error = e
        except Exception as e:  # anything else the thread meets is still one message
            self.error = RunError(f"checkpoint {self.name}: the upload to {self.url} failed "
                                  f"({describe_error(e)}); {self._still()}")

    def _put(self, rel: str) -> None:
        key = self.remote.key(f"{self.name}/{rel}")
        for attempt in range(1, self.attempts + 1):
            try:
                self.s3.upload_file(str(self.folder / rel), self.remote.bucket, key)
                return
            except Exception as e:  # botocore/boto3 errors, OSError, S3UploadFailedError
                why = describe_error(e)
                if attempt == self.attempts:
                    raise RunError(
                        f"checkpoint {self.name}: uploading s3://{self.remote.bucket}/{key} failed "
                        f"{self.attempts} times (last: {why}); {self._still()}") from None
                delay = min(self.backoff_s * 2 ** (attempt - 1), 60.0)
                log.warning("upload of s3://%s/%s failed (%s); retrying in %.0f s (attempt %d of %d)",
                            self.remote.bucket, key, why, delay, attempt + 1, self.attempts)
                if self._stop.wait(delay):
                    raise RunError(f"checkpoint {self.name}: upload stopped") from None

    def _wait_for_every_file(self) -> bool:
        """Rank 0: poll the bucket until every file in the manifest is there with its size
        (the other ranks upload theirs meanwhile); False when stopped."""
        assert self.manifest is not None
        prefix = RemoteFolder(self.remote.bucket, self.remote.key(self.name))
        deadline = time.monotonic() + self.wait_timeout_s
        delay = 0.2
        while True:
            have = list_objects(self.s3, prefix)
            missing = [rel for rel, want in self.manifest.items() if have.get(rel) != want["size"]]
            if not missing:
                return True
            if time.monotonic() > deadline:
                raise RunError(f"checkpoint {self.name}: {len(missing)} file(s) of other ranks never "
                               f"reached {self.url} (e.g. {missing[0]}) within "
                               f"{self.wait_timeout_s:.0f} s; {self._still()}")
            if self._stop.wait(delay):
                return False
            delay = min(delay * 1.5, 5.0)

    def _drop_local(self, files: list[str]) -> None:
        for rel in files:
            (self.folder / rel).unlink(missing_ok=True)

    def _prune(self) -> None:
        """Delete remote checkpoints beyond ``keep`` and those in ``replace`` (a warning on
        failure: the new checkpoint is committed)."""
        try:
            complete, _, _ = checkpoints(self.s3, self.remote)
            names = [n for n, _ in complete if n != self.name]
            doomed = [n for n in names if n in self.replace]
            if self.keep >= 0:
                kept = [n for n in names if n not in doomed]
                doomed += kept[max(self.keep - 1, 0):] if self.keep > 0 else kept
            for n in doomed:
                delete_checkpoint(self.s3, self.remote, n)
                why = "save_overwrite" if n in self.replace else f"save_num_checkpoints_to_keep={self.keep}"
                log.info("checkpoint removed: %s/%s (%s)", self.remote.url, n, why)
        except Exception as e:
            log.warning("checkpoint %s is uploaded, but deleting old ones from %s failed (%s)",
                        self.name, self.remote.url, describe_error(e))
