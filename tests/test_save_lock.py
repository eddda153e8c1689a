"""One run per save_folder: a live run's lock refuses a second run with one message naming it;
a lock left by a killed run (dead pid here, or no heartbeat from another host) is taken over
with a log line; an end-to-end second `foundryx train` on a live run's folder exits 2."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundryx.checkpoint import lock as lockmod
from foundryx.checkpoint.lock import LOCK, SaveFolderLock
from foundryx.errors import CheckpointError

ROOT = Path(__file__).parents[1]
HOLD = """
import sys, time
from foundryx.checkpoint.lock import SaveFolderLock
SaveFolderLock(sys.argv[1], "holder-run").acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process (another pid) that holds tmp_path/ckpt's lock."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "held"
    yield p
    p.kill()
    p.wait()


def test_a_live_run_is_named_and_a_killed_one_is_taken_over(holder, tmp_path, caplog):
    folder = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as e:
        SaveFolderLock(folder, "second").acquire()
    msg = str(e.value)
    assert f"save_folder {folder} is in use by another run" in msg
    assert f"host {socket.gethostname()}, pid {holder.pid}, started 20" in msg and "holder-run" in msg
    assert "another save_folder" in msg and str(folder / LOCK) in msg

    holder.send_signal(signal.SIGKILL)
    holder.wait()
    mine = SaveFolderLock(folder, "second")
    with caplog.at_level(logging.WARNING, logger="foundryx.checkpoint.lock"):
        mine.acquire()
    assert f"pid {holder.pid} is not running" in caplog.text and "taking over" in caplog.text
    assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    mine.release()
    assert not (folder / LOCK).exists()
    assert sorted(p.name for p in folder.iterdir()) == []  # no temp or probe files left


def write_lock(folder: Path, age_s: float, **fields) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    owner = {"host": "node-17", "pid": 4242, "pid_start": None, "pid_ns": None,
             "run_name": "other", "started": "2026-11-23T10:00:00+00:00", **fields}
    (folder / LOCK).write_text(json.dumps(owner))
    t = time.time() - age_s
    os.utime(folder / LOCK, (t, t))


def test_another_hosts_lock_holds_while_it_beats_and_goes_stale_without(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    write_lock(folder, age_s=5)
    with pytest.raises(CheckpointError, match="host node-17, pid 4242.*last heartbeat [0-9]+ s ago"):
        SaveFolderLock(folder).acquire()
    write_lock(folder, age_s=lockmod.STALE_AFTER_S + 30)
    mine = SaveFolderLock(folder)
    with caplog.at_level(logging.WARNING, logger="foundryx.checkpoint.lock"):
        mine.acquire()
    assert "no heartbeat for" in caplog.text and "node-17" in caplog.text
    mine.release()


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    """The recorded pid runs (our parent), but it started at another time: a different process."""
    folder = tmp_path / "ckpt"
    write_lock(folder, age_s=1, host=socket.gethostname(), pid=os.getppid(), pid_start="1",
               pid_ns=lockmod._pid_ns())
    mine = SaveFolderLock(folder)
    mine.acquire()
    mine.release()


def test_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lockmod, "HEARTBEAT_S", 0.05)
    mine = SaveFolderLock(tmp_path)
    mine.acquire()
    t = time.time() - 1000
    os.utime(tmp_path / LOCK, (t, t))
    time.sleep(0.5)
    assert time.time() - (tmp_path / LOCK).stat().st_mtime < 10
    mine.release()


def test_a_damaged_lock_file_is_named(tmp_path):
    (tmp_path / LOCK).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"\.lock: not a foundryx lock file.*delete it"):
        SaveFolderLock(tmp_path).acquire()


def test_release_leaves_another_runs_lock_alone(tmp_path):
    mine = SaveFolderLock(tmp_path)
    mine.acquire()
    write_lock(tmp_path, age_s=0)  # someone took it over meanwhile
    mine.release()
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "node-17"


@pytest.mark.slow
def test_second_train_on_a_live_runs_save_folder_exits_2(quickstart_data, tmp_path):
    """A real `foundryx train` holds the folder; a second one is refused, names it, exit 2."""
    args = [str(Path(sys.executable).parent / "foundryx"), "train", "yamls/quickstart.yaml",
            f"variables.data_root={quickstart_data}", f"save_folder={tmp_path / 'ckpt'}",
            "save_overwrite=false", "max_duration=100000ba", "save_interval=1000000ba",
            "eval_loader=null", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
            "variables.max_seq_len=32"]
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (tmp_path / "ckpt" / LOCK).exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.5)
        second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert f"is in use by another run (host {socket.gethostname()}, pid {first.pid}" in second.stderr
