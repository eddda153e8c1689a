"""One run per remote save_folder: ``s3://bucket/run/.lock``, the bucket's version of lock.py.

The lock object holds its owner (host, pid, process start time, pid namespace, run name, start
time; lock.Owner). It is created with a conditional write (``If-None-Match: *``), which the store
refuses when a lock is there, and rewritten every ``HEARTBEAT_S`` seconds with ``If-Match`` on
its own ETag, so its ``LastModified`` is a heartbeat and a run that lost the lock notices. A
lock is stale, and taken over with one log line, when its pid is not running on this host (same
pid namespace) or its heartbeat is older than ``STALE_AFTER_S`` by the store's own clock (the
``Date`` of the store's answer). Taking over is a write with ``If-Match`` on the stale lock's
ETag, so of two runs taking over at once only one wins.

Conditional writes are part of the S3 API (AWS since 2024, MinIO, moto); a store without them
answers 501 NotImplemented, and the run then goes on without a bucket lock (one warning line).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict
from email.utils import parsedate_to_datetime
from typing import Any

from foundryx.checkpoint.lock import HEARTBEAT_S, LOCK, STALE_AFTER_S, Owner, _running
from foundryx.checkpoint.remote import RemoteFolder, describe_error
from foundryx.errors import CheckpointError

log = logging.getLogger(__name__)

_TAKEN = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def _code(e: BaseException) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


class BucketLock:
    """``acquire()`` or raise CheckpointError naming the live owner; ``release()`` at the end."""

    def __init__(self, s3: Any, remote: RemoteFolder, run_name: str | None = None):
        self.s3, self.remote = s3, remote
        self.key = remote.key(LOCK)
        self.url = f"s3://{remote.bucket}/{self.key}"
        self.owner = Owner.me(run_name)
        self.etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, **condition: str) -> str:
        body = json.dumps(asdict(self.owner), indent=2).encode()
        return self.s3.put_object(Bucket=self.remote.bucket, Key=self.key, Body=body, **condition)["ETag"]

    def acquire(self) -> None:
        from botocore.exceptions import ClientError

        condition = {"IfNoneMatch": "*"}
        for _ in range(5):
            try:
                self.etag = self._put(**condition)
                self._thread = threading.Thread(target=self._beat, name="foundryx-bucket-lock", daemon=True)
                self._thread.start()
                return
            except ClientError as e:
                if _code(e) in ("NotImplemented", "501"):
                    log.warning("%s: the store does not support conditional writes; no lock in the "
                                "bucket (two jobs must not share this save_folder)", self.url)
                    return
                if _code(e) not in _TAKEN and _code(e) not in ("NoSuchKey", "404"):
                    raise CheckpointError(f"{self.url}: cannot write the lock ({describe_error(e)})") from None
            held = self._read()
            if held is None:
                condition = {"IfNoneMatch": "*"}  # released meanwhile
                continue
            other, etag, age = held
            why = self._stale_because(other, age)
            if why is None:
                raise CheckpointError(
                    f"save_folder {self.remote.url} is in use by another run ({other.describe()}; "
                    f"last heartbeat {age:.0f} s ago). Wait for it to finish or stop it, or use "
                    f"another save_folder. If that run is gone, foundryx takes the lock over "
                    f"{STALE_AFTER_S:.0f} s after its last heartbeat; delete {self.url} to take it now")
            log.warning("save_folder lock: taking over %s from a run that is gone (%s; %s)",
                        self.url, other.describe(), why)
            condition = {"IfMatch": etag}  # replace exactly the stale lock: one taker wins
        raise CheckpointError(f"{self.url}: could not take the lock (other runs keep taking it); "
                              "make sure one run at a time uses this save_folder")

    def _read(self) -> tuple[Owner, str, float] | None:
        from botocore.exceptions import ClientError

        try:
            got = self.s3.get_object(Bucket=self.remote.bucket, Key=self.key)
        except ClientError as e:
            if _code(e) in ("NoSuchKey", "404"):
                return None
            raise CheckpointError(f"{self.url}: cannot read the lock ({describe_error(e)})") from None
        try:
            owner = Owner(**json.loads(got["Body"].read()))
        except (ValueError, TypeError):
            raise CheckpointError(f"{self.url}: not a foundryx lock (unreadable JSON); if no run is "
                                  "using the save_folder, delete it") from None
        now = parsedate_to_datetime(got["ResponseMetadata"]["HTTPHeaders"]["date"])
        return owner, got["ETag"], (now - got["LastModified"]).total_seconds()

    def _stale_because(self, other: Owner, age: float) -> str | None:
        here = other.host == self.owner.host and other.pid_ns == self.owner.pid_ns
        if here and (other.pid == self.owner.pid or not _running(other)):
            return f"pid {other.pid} is not running on {other.host}" if other.pid != self.owner.pid \
                else "an earlier run in this process that did not release it"
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s (over {STALE_AFTER_S:.0f} s)"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.etag = self._put(IfMatch=self.etag)
            except Exception as e:
                log.warning("save_folder lock: %s is no longer this run's (%s); another run may be "
                            "using %s", self.url, describe_error(e), self.remote.url)
                return

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if this run still holds it."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join(timeout=10)  # not in the middle of a heartbeat
        self._thread = None
        try:
            held = self._read()
            if held is not None and held[1] == self.etag:
                self.s3.delete_object(Bucket=self.remote.bucket, Key=self.key)
        except Exception as e:  # the run is ending: a lock left behind goes stale
            log.warning("save_folder lock: could not delete %s (%s)", self.url, describe_error(e))
