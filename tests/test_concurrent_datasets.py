"""Two runs reading one MDS dataset at the same time, each on 2 processes (gloo), both work:
streaming's shared memory of one run never mixes with the other's, and each run's losses
are those of the same run alone.

streaming picks a dataset's shared-memory prefix racily (every rank scans /dev/shm, and the
leader claims the prefix only after a barrier; mosaicml/streaming#901). Two whole runs
started together seldom hit the window, so the second test forces it: one rank of run "a"
reaches its loader late, after run "b" has claimed the prefix "a"'s leader already chose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from distributed import run_distributed
from test_text_loader import loader_cfg, mds_root, stored_rows  # noqa: F401 (fixture)

from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
BIN = Path(sys.executable).parent
TINY = [
    "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
    "global_train_batch_size=4", "parallelism={}", "max_duration=6ba", "save_interval=6ba",
    "eval_interval=6ba", "eval_subset_num_batches=1", "console_log_interval=100ba",
    "callbacks.speed_monitor.window_size=1", "train_loader.num_workers=1",
]
pytestmark = pytest.mark.slow


def launch(data: Path, out: Path) -> subprocess.Popen:
    """``foundryx train`` on 2 processes (composer launcher), train and eval data from ``data``."""
    args = [f"variables.data_root={data}", f"save_folder={out}/ckpt",
            f"loggers.jsonl.path={out}/metrics.jsonl", *TINY]
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN / "composer"), "-n", "2", "--stderr", str(out / "rank{rank}.err"),
           "--stdout", str(out / "rank{rank}.out"), "train.py", "yamls/quickstart.yaml", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def finish(proc: subprocess.Popen, out: Path) -> tuple[int, str]:
    try:
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, text + "".join(p.read_text() for p in sorted(out.glob("rank*.*")))


def curve(out: Path) -> list[float]:
    return [row[LOSS] for row in read_metrics(out / "metrics.jsonl") if LOSS in row]


def eval_loss(out: Path) -> list[float]:
    key = "metrics/eval/LanguageCrossEntropy"
    return [row[key] for row in read_metrics(out / "metrics.jsonl") if key in row]


def test_two_runs_read_one_dataset_at_once(quickstart_data, tmp_path):
    start = time.monotonic()
    rc, log = finish(launch(quickstart_data, tmp_path / "alone"), tmp_path / "alone")
    assert rc == 0, log[-4000:]
    alone, alone_eval = curve(tmp_path / "alone"), eval_loss(tmp_path / "alone")
    assert len(alone) == 6 and len(alone_eval) == 1
    took_alone = time.monotonic() - start

    start = time.monotonic()
    runs = {name: launch(quickstart_data, tmp_path / name) for name in ("a", "b")}
    results = {name: finish(proc, tmp_path / name) for name, proc in runs.items()}
    for name, (rc, log) in results.items():
        assert rc == 0, (name, log[-6000:])
        assert curve(tmp_path / name) == alone, name
        assert eval_loss(tmp_path / name) == alone_eval, name
    print(f"alone: {took_alone:.1f}s; two at once: {time.monotonic() - start:.1f}s")


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()


def _rank_of_run(mds: str, run: str, flags: str) -> tuple[int, list[tuple[int, ...]]]:
    """One rank of run ``run`` builds a text loader on ``mds`` and reads it; returns its
    shared-memory prefix and rows. Rank 0 of "a" chooses its prefix first; then "b" starts;
    rank 1 of "a" comes once "b" has its loader (or after 4 s, when "b" has to wait for "a").
    Each run keeps its dataset, so its shared memory, until the other has built its own."""
    import streaming.base.shared.prefix as prefix
    import torch.distributed as tdist

    from foundryx.data.text import build_text_dataloader

    here, rank = Path(flags), tdist.get_rank()
    if run == "a" and rank == 0:
        scan = prefix._check_and_find_retrying

        def scan_and_tell(*args, **kwargs):
            found = scan(*args, **kwargs)
            (here / "a0-scanned").touch()
            return found

        prefix._check_and_find_retrying = scan_and_tell
    elif run == "b":
        assert _wait_for(here / "a0-scanned", 60)
    elif rank == 1:
        _wait_for(here / "b-built", 4)
    spec = build_text_dataloader(loader_cfg(mds), None, 2)
    (here / f"{run}{rank}-built").touch()
    if run == "b":
        (here / "b-built").touch()
        _wait_for(here / "a1-built", 30)  # b's memory stays while a claims its own
    rows = [tuple(r) for batch in spec.dataloader for r in batch["input_ids"].tolist()]
    if run == "a":  # a's memory stays until b has claimed its own (else b may rightly reuse it)
        _wait_for(here / "b-built", 60)
    return spec.dataloader.dataset._shm_prefix_int, rows


def test_a_late_rank_does_not_take_another_runs_prefix(mds_root, tmp_path):  # noqa: F811
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_distributed, _rank_of_run, 2, "gloo",
                               (str(mds_root), run, str(tmp_path)), 120) for run in ("a", "b")]
        (a0, a1), (b0, b1) = (f.result() for f in futures)
    assert a0[0] == a1[0] and b0[0] == b1[0] and a0[0] != b0[0]  # one prefix per run
    assert a0[1] == b0[1] and a1[1] == b1[1]  # same data, same order, in both runs
    assert set(a0[1] + a1[1]) == set(stored_rows(mds_root))
