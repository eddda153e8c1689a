"""Shared-memory hygiene: runs on the same data do not collide; only dead runs are cleaned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_text_loader import SEQ, loader_cfg, mds_root, stored_rows  # noqa: F401 (fixture)

from foundryx.data import shm
from foundryx.data.text import build_text_dataloader

HOLDER = """
import json, sys
from foundryx.data.text import build_text_dataloader
spec = build_text_dataloader(json.loads(sys.argv[1]), None, 4)
print(f"{spec.dataloader.dataset._shm_prefix_int:06d}", flush=True)
sys.stdin.readline()  # wait; then read everything, to show the dataset still works
rows = sum(len(b["input_ids"]) for b in spec.dataloader)
print(rows, flush=True)
"""


SHM_DIR = Path("/dev/shm")


def segments(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{prefix}_*"))


def holder(cfg) -> tuple[subprocess.Popen, str]:
    """A process holding a live dataset (in its own process group) and its shm prefix."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps(cfg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, proc.stdout.readline().strip()


@pytest.mark.slow
@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")
def test_only_dead_runs_are_cleaned(mds_root):  # noqa: F811
    cfg = loader_cfg(mds_root)
    dead, dead_prefix = holder(cfg)
    live, live_prefix = holder(cfg)
    try:
        assert dead_prefix != live_prefix  # same data, separate shared memory
        # kill the run and its helpers (Python's resource tracker would otherwise free the
        # memory), as a job scheduler or the OOM killer does
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait()
        assert segments(dead_prefix) and segments(live_prefix)  # the killed run leaked
        freed = shm.clean_stale_shared_memory()
        assert dead_prefix in freed and live_prefix not in freed
        assert not segments(dead_prefix) and not shm.lock_path(int(dead_prefix)).exists()
        assert segments(live_prefix)
        out, err = live.communicate("go\n", timeout=120)
        assert live.returncode == 0 and int(out) == len(stored_rows(mds_root)), err[-3000:]
        # a normal exit leaves nothing of its prefix behind (no segment, no lock file), and
        # frees its memory once: no "leaked shared_memory" / "No such file" warnings
        assert "resource_tracker" not in err, err[-3000:]
        assert not segments(live_prefix)
        assert not sorted(Path(tempfile.gettempdir()).glob(f"{live_prefix}_*"))
        assert not shm.lock_path(int(live_prefix)).exists()
    finally:
        for p in (dead, live):
            if p.poll() is None:
                p.kill()


def test_two_loaders_on_the_same_folder(mds_root, tiny_tokenizer):  # noqa: F811
    a = build_text_dataloader(loader_cfg(mds_root, shuffle=True, shuffle_seed=1), tiny_tokenizer, 4)
    b = build_text_dataloader(loader_cfg(mds_root, shuffle=True, shuffle_seed=2), tiny_tokenizer, 4)
    assert a.dataloader.dataset._shm_prefix_int != b.dataloader.dataset._shm_prefix_int
    rows_a, rows_b = [], []
    for batch_a, batch_b in zip(a.dataloader, b.dataloader):  # interleaved reads
        rows_a += map(tuple, batch_a["input_ids"].tolist())
        rows_b += map(tuple, batch_b["input_ids"].tolist())
    assert sorted(rows_a) == sorted(rows_b) == sorted(stored_rows(mds_root))
    assert rows_a != rows_b
    assert len(rows_a) == len(stored_rows(mds_root)) and len(rows_a[0]) == SEQ
