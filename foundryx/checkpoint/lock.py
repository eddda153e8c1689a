"""One run per ``save_folder``: a lock file that names its holder and that a killed run does not
leave stuck.

``save_folder/.lock`` holds the owner's host, pid, process start time, pid namespace, run name
and start time. Its modification time is a heartbeat, refreshed every ``HEARTBEAT_S`` seconds
by a thread of the owning process (rank 0), so a long eval or save does not make it look dead.

A lock is *stale*, and taken over with one log line, when its owner is gone:

- same host and pid namespace, and that pid is not running (or is running but started at
  another time: a reused pid); or
- its heartbeat is older than ``STALE_AFTER_S`` (the owner's machine died or it runs
  elsewhere). Ages are measured with the file system's own clock (the mtime of a file written
  just now), so clock skew between nodes does not matter.

The lock file is always complete: it is written under a temp name and hard-linked into place,
which fails when a lock is already there. Taking over renames the stale lock aside first and
checks that what it moved is the lock it judged stale, so two runs taking over at once do not
both win.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from foundryx.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK = ".lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0
SAME_PROCESS = "an earlier run in this process that did not release it"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    pid_start: str | None  # /proc/<pid>/stat start time (Linux), to tell a reused pid apart
    pid_ns: str | None  # /proc/self/ns/pid, so a pid is only checked inside its own namespace
    run_name: str | None
    started: str  # ISO time, UTC

    @classmethod
    def me(cls, run_name: str | None) -> Owner:
        return cls(host=socket.gethostname(), pid=os.getpid(), pid_start=_pid_start(os.getpid()),
                   pid_ns=_pid_ns(), run_name=run_name,
                   started=datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def describe(self) -> str:
        run = f", run {self.run_name}" if self.run_name else ""
        return f"host {self.host}, pid {self.pid}, started {self.started}{run}"


def _pid_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _running(owner: Owner) -> bool:
    """Whether ``owner``'s process is alive (only meaningful on its host and pid namespace)."""
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    start = _pid_start(owner.pid)
    return owner.pid_start is None or start is None or start == owner.pid_start


class SaveFolderLock:
    """``acquire()`` or raise CheckpointError naming the live owner; ``release()`` at the end."""

    def __init__(self, save_folder: str | Path, run_name: str | None = None):
        self.folder = Path(save_folder)
        self.path = self.folder / LOCK
        self.owner = Owner.me(run_name)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._made_folder = False

    # -- taking it ----------------------------------------------------------------------
    def acquire(self) -> None:
        self._made_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._try_create():
                self._start_heartbeat()
                return
            held = self._read()
            if held is None:
                continue  # released (or moved aside by someone taking it over) meanwhile
            text, other, age = held
            why = self._stale_because(other, age)
            if why is None:
                raise CheckpointError(
                    f"save_folder {self.folder} is in use by another run ({other.describe()}; "
                    f"last heartbeat {age:.0f} s ago). Wait for it to finish or stop it, or use "
                    f"another save_folder. If that run is gone, foundryx takes the lock over "
                    f"{STALE_AFTER_S:.0f} s after its last heartbeat; delete {self.path} to take "
                    f"it now"
                )
            if self._move_aside(text):
                level = logging.INFO if why == SAME_PROCESS else logging.WARNING
                log.log(level, "save_folder lock: taking over %s from a run that is gone (%s; %s)",
                        self.path, other.describe(), why)
        raise CheckpointError(f"{self.path}: could not take the lock (other runs keep taking it); "
                              "make sure one run at a time uses this save_folder")

    def _try_create(self) -> bool:
        tmp = self.folder / f"{LOCK}.{self.owner.host}.{self.owner.pid}.tmp"
        tmp.write_text(json.dumps(asdict(self.owner), indent=2) + "\n")
        try:
            os.link(tmp, self.path)  # atomic; fails when a lock is already there
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def _read(self) -> tuple[str, Owner, float] | None:
        try:
            text = self.path.read_text()
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            owner = Owner(**json.loads(text))
        except (ValueError, TypeError):
            raise CheckpointError(
                f"{self.path}: not a foundryx lock file (unreadable JSON); if no run is using "
                f"{self.folder}, delete it") from None
        return text, owner, self._fs_now() - mtime

    def _fs_now(self) -> float:
        """Now, by the clock of the file system that holds the lock."""
        probe = self.folder / f"{LOCK}.{self.owner.host}.{self.owner.pid}.now"
        probe.touch()
        try:
            return probe.stat().st_mtime
        finally:
            probe.unlink()

    def _stale_because(self, other: Owner, age: float) -> str | None:
        here = other.host == self.owner.host and other.pid_ns == self.owner.pid_ns
        if here and other.pid == self.owner.pid:
            return SAME_PROCESS
        if here and not _running(other):
            return f"pid {other.pid} is not running on {other.host}"
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s (over {STALE_AFTER_S:.0f} s)"
        return None

    def _move_aside(self, judged: str) -> bool:
        """Rename the stale lock away; False (and put back) if it was replaced meanwhile."""
        aside = self.folder / f"{LOCK}.stale.{self.owner.pid}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if aside.read_text() != judged:  # another run took over first: that lock is live
            os.rename(aside, self.path)
            return False
        aside.unlink()
        return True

    # -- holding it ---------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="foundryx-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError as e:  # the folder went away: nothing left to protect
                log.warning("save_folder lock: cannot refresh %s (%s)", self.path, e)

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if this process still holds it."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread = None
        held = self._read_quietly()
        if held is not None and held.pid == self.owner.pid and held.host == self.owner.host:
            self.path.unlink(missing_ok=True)
        if self._made_folder and not any(self.folder.iterdir()):
            self.folder.rmdir()  # made for the lock alone: a run that saved nothing leaves nothing

    def _read_quietly(self) -> Owner | None:
        try:
            return Owner(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

