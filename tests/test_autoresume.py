"""Autoresume on 2 CPU processes (gloo, FSDP2): kill -9 at three points, resume, and end
bit-identical to an uninterrupted run; resume on a different world size (2 -> 1, 1 -> 2,
4 -> 2).

Runs go through the composer launcher (and torchrun for 1 -> 2) with this file as the
training script: its ``__main__`` installs the fault (``FOUNDRYX_TEST_KILL``) and runs
``foundryx train``. Every run is the same command; only the fault differs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
BIN = Path(sys.executable).parent
TINY = [
    "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
    "model.init_device=meta", "global_train_batch_size=4", "eval_loader=null", "parallelism={}",
    "scheduler.t_warmup=2ba", "optimizer.lr=0.01", "max_duration=12ba", "save_interval=4ba",
    "save_overwrite=false", "console_log_interval=100ba", "callbacks.speed_monitor.window_size=1",
]
pytestmark = pytest.mark.slow


def train(data: Path, out: Path, *extra: str, nproc: int = 2, kill: str = "", launcher: str = "composer"):
    """One training run writing checkpoints to out/ckpt and metrics to out/metrics.jsonl."""
    args = [f"variables.data_root={data}", f"save_folder={out}/ckpt",
            f"loggers.jsonl.path={out}/metrics.jsonl", *TINY, *extra]
    script = [str(Path(__file__).resolve()), *args]
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--standalone", *script]
    elif nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [str(BIN / "composer"), "-n", str(nproc), "--stderr", str(out / "rank{rank}.err"),
               "--stdout", str(out / "rank{rank}.out"), *script]
    env = {**os.environ, "FOUNDRYX_TEST_KILL": kill, "PYTHONUNBUFFERED": "1"}
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def losses(out: Path) -> dict[int, float]:
    """Loss of each batch (1-based); a batch trained twice keeps its last value."""
    return {row["batch"] + 1: row[LOSS] for row in read_metrics(out / "metrics.jsonl") if LOSS in row}


def names(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name != "latest")


def logs(out: Path, r: subprocess.CompletedProcess) -> str:
    """Everything the run printed (the launcher's streams and the per-rank files)."""
    return r.stdout + r.stderr + "".join(p.read_text() for p in sorted(out.glob("rank*.*")))


def ok(r: subprocess.CompletedProcess) -> str:
    return f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def reference(quickstart_data, tmp_path_factory) -> Path:
    """12 uninterrupted batches on 2 processes, every checkpoint kept."""
    out = tmp_path_factory.mktemp("reference")
    r = train(quickstart_data, out, "save_num_checkpoints_to_keep=-1")
    assert r.returncode == 0, ok(r)
    return out


def test_kill_at_three_points_then_resume_bit_exact(reference, quickstart_data, tmp_path):
    from foundryx.checkpoint import load_model_weights

    ref = losses(reference)
    assert sorted(ref) == list(range(1, 13))
    assert sum(ref[b] for b in (10, 11, 12)) < sum(ref[b] for b in (1, 2, 3)) - 0.3
    ckpt, keep = tmp_path / "ckpt", "save_num_checkpoints_to_keep=1"

    # 1. mid-interval, between checkpoints: batch 6 (ep0-ba4 committed)
    r = train(quickstart_data, tmp_path, keep, kill="batch:6")
    assert r.returncode != 0 and names(ckpt) == ["ep0-ba4"], ok(r)
    # 2. inside a save: ep0-ba8's files and manifest written, the folder not yet renamed
    r = train(quickstart_data, tmp_path, keep, kill="commit:ep0-ba8")
    assert r.returncode != 0 and names(ckpt) == [".tmp-ep0-ba8", "ep0-ba4"], ok(r)
    assert "resumed from" in logs(tmp_path, r)
    # 3. right after the commit: renamed, but `latest` not moved and ep0-ba4 not pruned
    r = train(quickstart_data, tmp_path, keep, kill="latest:ep0-ba8")
    assert r.returncode != 0 and names(ckpt) == ["ep0-ba4", "ep0-ba8"], ok(r)
    assert os.readlink(ckpt / "latest") == "ep0-ba4"
    # the last restart resumes from ep0-ba8 (newest complete, whatever `latest` says)
    r = train(quickstart_data, tmp_path, keep)
    assert r.returncode == 0, ok(r)
    assert names(ckpt) == ["ep0-ba12"] and os.readlink(ckpt / "latest") == "ep0-ba12"

    # every batch any segment trained has the reference's loss, to the last bit
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 13))
    assert got == ref
    a, b = load_model_weights(reference / "ckpt"), load_model_weights(ckpt)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_resume_on_one_process_from_two(reference, quickstart_data, tmp_path):
    """Saved on 2 ranks at batch 8, resumed on 1: the loss curve goes on within noise."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(parents=True)
    shutil.copytree(reference / "ckpt" / "ep0-ba8", ckpt / "ep0-ba8")
    r = train(quickstart_data, tmp_path, nproc=1)
    assert r.returncode == 0, ok(r)
    assert "saved with world size 2, now 1" in r.stderr
    ref, got = losses(reference), losses(tmp_path)
    assert sorted(got) == [9, 10, 11, 12]
    assert all(abs(got[b] - ref[b]) < 1e-4 for b in got), (got, ref)


def test_resume_on_two_processes_from_one_with_torchrun(reference, quickstart_data, tmp_path):
    """Saved on 1 process at batch 4 (the run killed at batch 5), resumed on 2 under torchrun.

    Both segments run the same command (max_duration 12ba), so the LR schedule is the
    reference's; a shorter first run would change the learning rate of the resumed steps.
    """
    r = train(quickstart_data, tmp_path, nproc=1, kill="batch:5")
    assert r.returncode != 0 and names(tmp_path / "ckpt") == ["ep0-ba4"], ok(r)
    r = train(quickstart_data, tmp_path, launcher="torchrun")
    assert r.returncode == 0, ok(r)
    assert "saved with world size 1, now 2" in r.stderr
    ref, got = losses(reference), losses(tmp_path)
    assert sorted(got) == list(range(1, 13))
    assert all(abs(got[b] - ref[b]) < 1e-4 for b in got), (got, ref)
    manifest = json.loads((tmp_path / "ckpt" / "ep0-ba12" / "manifest.json").read_text())
    assert manifest["world_size"] == 2


def test_four_processes_then_resume_on_two(reference, quickstart_data, tmp_path):
    """4 ranks train batches 1-4 (same losses as the 2-rank reference: the loader's order does
    not depend on the world size), are killed at batch 5, and 2 ranks go on from ep0-ba4."""
    r = train(quickstart_data, tmp_path, nproc=4, kill="batch:5")
    assert r.returncode != 0 and names(tmp_path / "ckpt") == ["ep0-ba4"], ok(r)
    manifest = json.loads((tmp_path / "ckpt" / "ep0-ba4" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    r = train(quickstart_data, tmp_path)
    assert r.returncode == 0, ok(r)
    assert "saved with world size 4, now 2" in logs(tmp_path, r)
    ref, got = losses(reference), losses(tmp_path)
    assert sorted(got) == list(range(1, 13))
    assert all(abs(got[b] - ref[b]) < 1e-4 for b in got), (got, ref)


def install_fault(spec: str) -> None:
    """``batch:N`` kills rank 0 at batch N; ``commit:NAME`` just before NAME is renamed into
    place; ``latest:NAME`` just after, before ``latest`` moves and old ones are pruned."""
    from composer.utils import dist

    from foundryx.checkpoint import callback, save

    kind, _, arg = spec.partition(":")

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "batch":
        orig_batch = callback.Checkpointer.batch_checkpoint

        def batch_checkpoint(self, state, logger):
            if int(state.timestamp.batch) == int(arg) and dist.get_global_rank() == 0:
                die()
            orig_batch(self, state, logger)

        callback.Checkpointer.batch_checkpoint = batch_checkpoint
    elif kind == "commit":
        orig_commit = save._commit
        save._commit = lambda root, tmp, final: die() if final.name == arg else orig_commit(root, tmp, final)
    elif kind == "latest":
        orig_latest = save.point_latest
        save.point_latest = lambda root, name: die() if name == arg else orig_latest(root, name)


if __name__ == "__main__":
    if os.environ.get("FOUNDRYX_TEST_KILL"):
        install_fault(os.environ["FOUNDRYX_TEST_KILL"])
    from foundryx.cli import main

    sys.exit(main(["train", "yamls/quickstart.yaml", *sys.argv[1:]]))
