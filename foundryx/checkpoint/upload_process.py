"""Each rank's checkpoint uploads in a process of its own.

Why a process and not a thread of the training process: the upload's Python work (boto3
reading, checksumming and sending the files in 16 KB blocks) holds the interpreter lock, and a
thread of the training process takes that time from the training loop (measured on the benchmark
VM: about 0.04 s per 64 MB, with the upload on a core of its own; benchmarks/RESULTS.md).
Composer's RemoteUploaderDownloader uploads from processes for the same reason.

One :class:`UploadWorker` per rank starts ``python -m foundryx.checkpoint.upload_process`` at
the rank's first remote save and keeps it for the run. The worker imports only the upload
code and boto3 (no torch), runs each job with :class:`~foundryx.checkpoint.upload.Upload` and
talks JSON lines: jobs and ``stop`` on its stdin; ``done_bytes`` every second and one ``end``
(error text or none, committed or not) on its stdout; its log goes to the training process's
stderr. It ignores the signals a scheduler sends the whole job (SIGTERM, SIGUSR1, ...: the
training process handles them and then waits for the upload). When its stdin closes (the run
ended, or the training process died, even by kill -9) it exits at once: an upload it had not
finished never gets its manifest, so autoresume does not take the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from foundryx.checkpoint.remote import RemoteFolder, client, describe_error
from foundryx.checkpoint.upload import Upload, UploadHandle, staged_bytes
from foundryx.errors import CheckpointError, RunError
from foundryx.runtime.log_setup import setup_logging

log = logging.getLogger(__name__)

REPORT_EVERY_S = 1.0


class ProcessUpload(UploadHandle):
    """One checkpoint's upload, run by this rank's upload process; the same handle as
    :class:`~foundryx.checkpoint.upload.Upload` (``running``, ``join``, ``stop``, ``error``,
    ``committed``, ``progress``)."""

    def __init__(self, worker: UploadWorker, remote: RemoteFolder, name: str, total_bytes: int,
                 newest_complete: str | None):
        super().__init__(remote, name, total_bytes, newest_complete)
        self._worker = worker
        self._ended = threading.Event()

    def running(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> bool:
        return self._ended.wait(timeout)

    def stop(self) -> None:
        """Abandon the upload (the run is ending on an error): the manifest is not uploaded."""
        self._worker.send({"stop": self.name})

    def _end(self, error: str | None, committed: bool) -> None:
        self.error = RunError(error) if error else None
        self.committed = committed
        self._ended.set()


class UploadWorker:
    """This rank's upload process: started by the first :meth:`submit`, ended by :meth:`close`."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._current: ProcessUpload | None = None
        self._lock = threading.Lock()

    def submit(self, remote: RemoteFolder, name: str, folder: Path, files: list[str], *,
               manifest: dict[str, dict[str, Any]] | None, keep: int, replace: set[str],
               newest_complete: str | None, attempts: int = 5,
               backoff_s: float = 1.0) -> ProcessUpload:
        folder = Path(folder)
        handle = ProcessUpload(self, remote, name, staged_bytes(folder, files), newest_complete)
        self._current = handle
        self._start()
        self.send({"upload": {"bucket": remote.bucket, "prefix": remote.prefix, "name": name,
                              "folder": str(folder), "files": files, "manifest": manifest,
                              "keep": keep, "replace": sorted(replace),
                              "newest_complete": newest_complete, "attempts": attempts,
                              "backoff_s": backoff_s}})
        return handle

    @property
    def pid(self) -> int | None:
        """The upload process's pid, None before the first upload."""
        return self._proc.pid if self._proc is not None else None

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return
            try:
                self._proc.stdin.write(json.dumps(message) + "\n")
                self._proc.stdin.flush()
            except OSError:  # the worker is gone; the reader thread reports it
                pass

    def close(self) -> None:
        """End the process (it abandons an upload still running: no manifest for it)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        level = logging.getLevelName(logging.getLogger("foundryx").getEffectiveLevel())
        # foundryx importable in the child as it is here (a checkout on sys.path, not installed)
        here = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(level).lower()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                env={**os.environ, "PYTHONPATH": path})
        except OSError as e:
            raise CheckpointError(f"cannot start the checkpoint upload process ({e}); the "
                                  f"upload to a remote save_folder needs {sys.executable} "
                                  "runnable") from None
        threading.Thread(target=self._read, args=(self._proc,), name="foundryx-upload-reader",
                         daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # not a report: something in the process printed to stdout
                continue
            handle = self._current
            if handle is None or msg.get("name") != handle.name:
                continue
            handle.done_bytes = msg.get("done_bytes", handle.done_bytes)
            if "end" in msg:
                handle._end(msg["end"]["error"], msg["end"]["committed"])
        handle = self._current
        if handle is not None and handle.running():  # the process died during an upload
            code = proc.wait()
            handle._end(f"checkpoint {handle.name}: the upload process ended (exit code {code}) "
                        f"before the upload to {handle.url} finished; {handle._still()}", False)


# -- the upload process ----------------------------------------------------------------------
def serve(level: str) -> None:
    """The upload process: jobs from stdin, reports to stdout, until stdin closes."""
    setup_logging(level)
    # The signals a scheduler or a terminal sends the whole job (Slurm's SIGTERM or SIGUSR1
    # before preemption, Ctrl-C) are the training process's to handle: it saves, waits for this
    # upload and closes our stdin. Dying on them would fail the upload in flight.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    out = sys.stdout
    out_lock = threading.Lock()
    s3 = None
    current: Upload | None = None  # the newest upload; the training process waits for one

    def report(message: dict[str, Any]) -> None:
        with out_lock:
            out.write(json.dumps(message) + "\n")
            out.flush()

    def watch(up: Upload) -> None:
        up.start()
        while not up.join(REPORT_EVERY_S):
            report({"name": up.name, "done_bytes": up.done_bytes})
        report({"name": up.name, "done_bytes": up.done_bytes,
                "end": {"error": str(up.error) if up.error else None, "committed": up.committed}})

    for line in sys.stdin:
        msg = json.loads(line)
        if "stop" in msg and current is not None and current.name == msg["stop"]:
            current.stop()
        elif "upload" in msg:
            job = msg["upload"]
            try:
                s3 = s3 or client()
                up = Upload(s3, RemoteFolder(job["bucket"], job["prefix"]), job["name"],
                            Path(job["folder"]), job["files"], manifest=job["manifest"],
                            keep=job["keep"], replace=set(job["replace"]),
                            newest_complete=job["newest_complete"], attempts=job["attempts"],
                            backoff_s=job["backoff_s"])
            except Exception as e:  # boto3 missing, a staged file gone: one message, as ever
                report({"name": job["name"], "end": {"committed": False, "error": (
                    f"checkpoint {job['name']}: the upload could not start ({describe_error(e)})")}})
                continue
            current = up
            threading.Thread(target=watch, args=(up,), daemon=True).start()
    os._exit(0)  # stdin closed: the run is over or its process is gone; nothing more is committed


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "info")
