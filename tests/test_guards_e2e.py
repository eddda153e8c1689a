"""Guards and loggers in real 2-process runs (``foundryx launch``, gloo, the quickstart MPT):

- preemption: SIGTERM sent to each training process (as Slurm signals every task; rank 1
  first, rank 0 a moment later), a checkpoint at the next batch, exit 75, and the autoresumed
  run ends with the losses of an uninterrupted run; the same runs log to W&B (offline; the
  resumed run continues the same W&B run id) and TensorBoard (event files read back);
- hang watchdog: rank 1 stalls at the end of batch 3; both ranks print their stacks, the
  message says rank 1 is behind, and the run exits non-zero soon after the timeout.

This file is also the training script: its ``__main__`` installs the test hooks
(``FOUNDRYX_TEST_*``) and runs ``foundryx train``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
LOSS = "loss/train/total"
TINY = [
    "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
    "model.init_device=meta", "global_train_batch_size=4", "eval_loader=null", "parallelism={}",
    "scheduler.t_warmup=2ba", "optimizer.lr=0.01", "max_duration=16ba", "save_interval=1000ba",
    "save_overwrite=false", "console_log_interval=100ba", "callbacks.speed_monitor.window_size=1",
]


def command(data: Path, out: Path, *extra: str) -> list[str]:
    args = [f"variables.data_root={data}", f"save_folder={out}/ckpt",
            f"loggers.jsonl.path={out}/metrics.jsonl", *TINY, *extra]
    return [str(BIN / "foundryx"), "launch", "-n", "2", "--stderr", str(out / "rank{rank}.err"),
            "--stdout", str(out / "rank{rank}.out"), str(Path(__file__).resolve()), *args]


def start(data: Path, out: Path, *extra: str, **env: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.*"), out / "launcher.log"]:
        old.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FOUNDRYX_TEST_PIDS": str(out), **env}
    # the launcher's streams (rank 0 prints there) go to a file, not a pipe: a helper process
    # a rank leaves behind for a moment must not hold the test up
    with (out / "launcher.log").open("w") as log:
        return subprocess.Popen(command(data, out, *extra), cwd=ROOT, env=env, text=True,
                                stdout=log, stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen, out: Path, timeout: float = 900) -> tuple[int, str]:
    p.wait(timeout=timeout)
    said = (out / "launcher.log").read_text() if (out / "launcher.log").exists() else ""
    return p.returncode, said + "".join(f.read_text() for f in sorted(out.glob("rank*.*")))


def losses(out: Path) -> dict[int, float]:
    return {row["batch"]: row[LOSS] for row in read_metrics(out / "metrics.jsonl") if LOSS in row}


def wait_for(test, what: str, p: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        assert p.poll() is None, f"the run ended before {what}: {finish(p, Path('.'))[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_saves_at_the_next_batch_exits_75_and_autoresume_ends_as_uninterrupted(
        quickstart_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ref = tmp_path / "reference"
    rc, said = finish(start(quickstart_data, ref), ref)
    assert rc == 0, said[-3000:]

    out = tmp_path / "preempted"
    extra = ["callbacks.preemption={}", f"loggers.wandb.dir={out}", "loggers.wandb.project=guards",
             f"loggers.tensorboard.log_dir={out}/tb"]
    p = start(quickstart_data, out, *extra, FOUNDRYX_TEST_SLOW="0.5", WANDB_MODE="offline")
    pids = [out / f"pid.rank{r}" for r in (0, 1)]
    wait_for(lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= 4, "batch 4", p)
    wait_for(lambda: all(f.exists() for f in pids), "pid files", p)
    os.kill(int(pids[1].read_text()), signal.SIGTERM)  # one rank first: they must still agree
    time.sleep(0.3)
    os.kill(int(pids[0].read_text()), signal.SIGTERM)
    rc, said = finish(p, out)
    assert rc == 75, said[-3000:]  # preempted and saved (foundryx.runtime.preempt.PREEMPTED)
    assert "foundryx: preempted by a preemption signal" in said and "Traceback" not in said
    lines = [ln for ln in said.splitlines() if "preemption: SIGTERM received" in ln]
    assert len(lines) == 1, said[-3000:]
    stop = int(lines[0].split("stopping after batch ")[1].split()[0])
    assert 4 <= stop < 16, lines
    ckpts = sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("ep"))
    assert ckpts == [f"ep0-ba{stop}"], (ckpts, lines)
    assert max(losses(out)) == stop

    rc, said = finish(start(quickstart_data, out, *extra, WANDB_MODE="offline"), out)
    assert rc == 0, said[-3000:]
    assert (f"resumed from {out / 'ckpt' / f'ep0-ba{stop}'} at batch {stop} (saved with world "
            "size 2, now 2)") in said, said[-3000:]
    got, want = losses(out), losses(ref)
    assert sorted(got) == list(range(1, 17))
    assert got == want, "the preempted and resumed run differs from the uninterrupted one"

    # W&B (offline): two local runs, one run id, the one kept in the run folder
    run_id = (out / "wandb-run-id").read_text().strip()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    assert all((r / f"run-{run_id}.wandb").stat().st_size > 0 for r in runs)
    assert "wandb: continuing W&B run " + run_id in said

    # TensorBoard: every batch's loss once (the resumed run purged nothing it had not logged)
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(LOSS)
    assert sorted({e.step for e in events}) == list(range(1, 17))  # batches 1..16, as printed
    by_step = {e.step: e.value for e in events}
    assert all(abs(by_step[b] - want[b]) < 1e-5 for b in want)


@pytest.mark.slow
def test_hang_watchdog_dumps_both_ranks_and_names_the_one_behind(quickstart_data, tmp_path):
    # well above a batch of this run after the first (first_batch_timeout_s covers the start-up),
    # even on a loaded 2-core machine: a batch takes under a second there
    timeout_s, grace_s = 15, 5
    p = start(quickstart_data, tmp_path, f"callbacks.hang_watchdog.timeout_s={timeout_s}",
              f"callbacks.hang_watchdog.grace_s={grace_s}", "dist_timeout=600",
              FOUNDRYX_TEST_STALL="3:1:900")
    rc, said = finish(p, tmp_path)
    ended = time.time()
    assert rc != 0, said[-3000:]
    stalled = [float(ln.split()[1]) for ln in said.splitlines() if ln.startswith("[stall] ")]
    assert stalled, said[-3000:]
    # the dumps start timeout_s after the last finished batch; generous: the machine is loaded
    assert ended - stalled[0] < timeout_s + grace_s + 60, ended - stalled[0]
    # rank 0 prints to the launcher's streams, rank 1 to rank1.err
    rank1 = (tmp_path / "rank1.err").read_text()
    assert "Python stacks of rank 0 " in said and "Python stacks of rank 1 " in rank1, said[-3000:]
    for text in (said.split("Python stacks of rank 0 ")[1], rank1):
        assert 'File "' in text and "Thread 0x" in text, text[-3000:]  # faulthandler's dump
    assert "in stall" in rank1, rank1[-3000:]  # rank 1's stack shows where it is stuck
    assert "Behind: rank(s) 1;" in said and "rank 0: 3" in said and "rank 1: 2" in said, said[-3000:]


def install_hooks() -> None:
    """``FOUNDRYX_TEST_PIDS``: each rank writes its pid there; ``FOUNDRYX_TEST_SLOW=s``: each
    batch sleeps s seconds; ``FOUNDRYX_TEST_STALL=batch:rank:s``: that rank sleeps s seconds at
    the end of that batch, before the hang watchdog records it as finished."""
    from foundryx.callbacks import hang_watchdog
    from foundryx.checkpoint import callback

    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("FOUNDRYX_TEST_PIDS"):
        Path(os.environ["FOUNDRYX_TEST_PIDS"], f"pid.rank{rank}").write_text(str(os.getpid()))
    if os.environ.get("FOUNDRYX_TEST_SLOW"):
        pause, orig_start = float(os.environ["FOUNDRYX_TEST_SLOW"]), callback.Checkpointer.batch_start

        def batch_start(self, state, logger):
            time.sleep(pause)
            orig_start(self, state, logger)

        callback.Checkpointer.batch_start = batch_start
    if os.environ.get("FOUNDRYX_TEST_STALL"):
        at, who, seconds = os.environ["FOUNDRYX_TEST_STALL"].split(":")
        orig_end = hang_watchdog.HangWatchdog.batch_end

        def stall():
            print(f"[stall] {time.time()}", file=sys.stderr, flush=True)
            time.sleep(float(seconds))

        def batch_end(self, state, logger):
            if int(state.timestamp.batch) == int(at) and rank == int(who):
                stall()
            orig_end(self, state, logger)

        hang_watchdog.HangWatchdog.batch_end = batch_end


if __name__ == "__main__":
    install_hooks()
    from foundryx.cli import run

    run(["train", "yamls/quickstart.yaml", *sys.argv[1:]])
