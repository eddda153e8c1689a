"""A dataloader worker killed mid-epoch (the OOM killer, ``kill -9``) ends the run with one
message naming the loader, the worker's pid, the signal and the batch/sample the run had
reached; no hang, no traceback, exit code 1.

The run goes through this file as the training script (as in tests/test_autoresume.py): its
``__main__`` makes the dataset's ``__getitem__`` SIGKILL its own process at the
``FOUNDRYX_TEST_WORKER_DIES_AT``-th sample it reads, but only inside a dataloader worker.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from foundryx.data.workers import WorkerDeath, parse_worker_death, worker_death_error
from foundryx.errors import FoundryxError, RunError
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
BIN = Path(sys.executable).parent
BATCH = 4  # global batch size
DIES_AT = 4 * BATCH  # the worker dies reading the first sample of batch 5 (1-based)
TINY = [
    "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
    f"global_train_batch_size={BATCH}", "eval_loader=null", "max_duration=20ba",
    "save_interval=100ba", "save_overwrite=false", "console_log_interval=100ba",
    "callbacks.speed_monitor.window_size=1", "train_loader.num_workers=1",
]


def train(data: Path, out: Path, *extra: str, nproc: int = 1, dies_at: int | None = DIES_AT):
    args = [f"variables.data_root={data}", f"save_folder={out}/ckpt",
            f"loggers.jsonl.path={out}/metrics.jsonl", *TINY, *extra]
    script = [str(Path(__file__).resolve()), *args]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [str(BIN / "composer"), "-n", str(nproc), "--stderr", str(out / "rank{rank}.err"),
               "--stdout", str(out / "rank{rank}.out"), *script]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FOUNDRYX_TEST_PID_FILE": str(out / "pid")}
    env.pop("FOUNDRYX_TEST_WORKER_DIES_AT", None)
    if dies_at is not None:
        env["FOUNDRYX_TEST_WORKER_DIES_AT"] = str(dies_at)
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


def trained_batches(out: Path) -> int:
    return len([row for row in read_metrics(out / "metrics.jsonl") if LOSS in row])


def logs(out: Path, r: subprocess.CompletedProcess) -> str:
    return r.stdout + r.stderr + "".join(p.read_text() for p in sorted(out.glob("rank*.*")))


def check_message(text: str, out: Path) -> None:
    """One message naming the loader, the dead worker's pid, the signal and the position."""
    pid = int((out / "pid").read_text())
    assert "Traceback" not in text, text[-4000:]
    assert text.count("foundryx: error:") == 1 and text.count(f"(pid {pid})") == 1, text[-4000:]
    assert "DataLoader worker" not in text, text[-4000:]  # torch's own wording
    msg = text[text.index("foundryx: error: "):]
    assert msg.startswith(f"foundryx: error: a dataloader worker of train_loader (pid {pid}) "
                          "was killed by signal SIGKILL after batch "), msg
    # the position the run had reached: b batches trained (b * BATCH samples). The worker
    # reads up to 2 batches ahead of training (prefetch_factor 2), so b is 2, 3 or 4; it is
    # the number of losses logged (one more when the worker died between logging batch b+1's
    # loss and counting that batch)
    m = re.search(r"after batch (\d+) \(sample (\d+), epoch 0\)", msg)
    assert m, msg
    batch, sample = int(m[1]), int(m[2])
    assert sample == batch * BATCH and DIES_AT // BATCH - 2 <= batch <= DIES_AT // BATCH, msg
    assert trained_batches(out) in (batch, batch + 1), (msg, trained_batches(out))
    assert "dmesg" in msg and "lower train_loader.num_workers (now 1)" in msg, msg
    assert f"autoresume continues from the newest checkpoint in {out}/ckpt" in msg, msg


@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
def test_killed_worker_is_one_message(quickstart_data, tmp_path):
    start = time.monotonic()
    r = train(quickstart_data, tmp_path)
    took = time.monotonic() - start
    assert r.returncode == 1, (r.returncode, r.stderr[-4000:])
    check_message(r.stdout + r.stderr, tmp_path)
    print(f"run with a killed worker ended in {took:.1f}s")


# -- the translation itself, without a run -------------------------------------------------

@pytest.mark.parametrize("text, death", [
    ("DataLoader worker (pid 1234) is killed by signal: Killed. ",
     WorkerDeath((1234,), signal="SIGKILL")),
    ("DataLoader worker (pid 77) is killed by signal: Bus error. It is possible that "
     "dataloader's workers are out of shared memory. Please try to raise your shared memory "
     "limit.", WorkerDeath((77,), signal="SIGBUS")),
    ("DataLoader worker (pid 5) exited unexpectedly with exit code 3. Details are lost due to "
     "multiprocessing. Rerunning with num_workers=0 may give better error trace.",
     WorkerDeath((5,), exit_code=3)),
    ("DataLoader worker (pid(s) 11, 12) exited unexpectedly", WorkerDeath((11, 12))),
])
def test_reads_each_of_torchs_wordings(text, death):
    assert parse_worker_death(RuntimeError(text)) == death


def fake_state(train_workers: int, eval_workers: int, label: str = "train") -> SimpleNamespace:
    def loader(n):
        return SimpleNamespace(num_workers=n, dataset=None)

    evaluator = SimpleNamespace(label="eval", dataloader=SimpleNamespace(dataloader=loader(eval_workers)))
    return SimpleNamespace(train_dataloader=loader(train_workers), evaluators=[evaluator],
                           dataloader_label=label, timestamp=SimpleNamespace(batch=3, sample=12, epoch=0))


KILLED = RuntimeError("DataLoader worker (pid 1234) is killed by signal: Killed. ")


def _suicide() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_while_handing_over_a_batch():
    """torch 2.14: the main process gets ConnectionResetError (no pid in it) when the worker
    dies while passing a tensor's file descriptor; the iterator in the traceback names it."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=_suicide)
    worker.start()
    worker.join()

    class Iterator:  # stands in for torch's _MultiProcessingDataLoaderIter
        _workers = [worker]

        def _try_get_data(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(ConnectionResetError) as e:
        Iterator()._try_get_data()
    assert parse_worker_death(e.value) == WorkerDeath((worker.pid,), signal="SIGKILL")
    assert parse_worker_death(ConnectionResetError(104, "elsewhere")) is None


def test_other_errors_pass_through():
    state = fake_state(1, 0)
    assert worker_death_error(RuntimeError("CUDA out of memory"), state, save_folder=None,
                              autoresume=False) is None
    assert worker_death_error(ValueError(str(KILLED)), state, save_folder=None,
                              autoresume=False) is None


def test_names_the_loader_that_has_workers_not_the_one_being_read():
    """The train loader prefetches during an eval, so the label being read says nothing."""
    err = worker_death_error(KILLED, fake_state(0, 2, label="train"), save_folder=None,
                             autoresume=False)
    assert isinstance(err, RunError) and err.exit_code == 1 and not err.rank_zero_only
    assert str(err).startswith("a dataloader worker of eval_loader (pid 1234) was killed by "
                               "signal SIGKILL after batch 3 (sample 12, epoch 0)")
    assert "lower eval_loader.num_workers (now 2)" in str(err)
    assert "save_folder is not set" in str(err)
    both = str(worker_death_error(KILLED, fake_state(4, 2, label="eval"), save_folder="ck",
                                  autoresume=False))
    assert both.startswith("a dataloader worker of train_loader or eval_loader (pid 1234)")
    assert "train_loader.num_workers (now 4) or eval_loader.num_workers (now 2)" in both
    assert "Checkpoints are in ck, but autoresume is off" in both


def test_torchs_handler_firing_late_is_still_one_message(monkeypatch):
    """torch 2.14: the main process hears of the death as a broken connection, and torch's
    SIGCHLD handler raises its own RuntimeError a moment later, in whatever frame runs then:
    as the translation begins, or after it (while the message is printed)."""
    import multiprocessing

    from foundryx import train as train_module

    def torchs_handler(signum, frame):
        raise RuntimeError("DataLoader worker (pid 1234) is killed by signal: Killed. ")

    calls = []
    real = train_module.worker_death_error

    def fires_at_entry(err, *args, **kwargs):
        calls.append(type(err).__name__)
        if len(calls) == 1:
            torchs_handler(signal.SIGCHLD, None)
        return real(err, *args, **kwargs)

    class Trainer:
        state = fake_state(1, 0)

        def fit(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(train_module, "worker_death_error", fires_at_entry)
    cfg = SimpleNamespace(save_folder=None)
    previous = signal.signal(signal.SIGCHLD, torchs_handler)
    try:
        with pytest.raises(RunError, match=r"\(pid 1234\) was killed by signal SIGKILL"):
            train_module.fit(Trainer(), cfg, eval_first=False, checkpointer=None)
        assert calls == ["ConnectionResetError", "RuntimeError"]
        # the handler is quiet now: another child's exit raises nothing
        child = multiprocessing.get_context("fork").Process(target=_suicide)
        child.start()
        child.join()
        time.sleep(0.2)
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_cli_prints_a_run_error_on_every_rank(monkeypatch, capsys):
    """A RunError is known only to the rank that saw it; a FoundryxError is rank 0's to say."""
    from foundryx import cli
    from foundryx.cli import train_command

    monkeypatch.setenv("RANK", "1")
    for error, code, printed in ((RunError("worker gone"), 1, True), (FoundryxError("bad"), 2, False)):
        def cmd_train(args, error=error):
            raise error

        monkeypatch.setattr(train_command, "cmd_train", cmd_train)
        assert cli.main(["train", "x.yaml"]) == code
        err = capsys.readouterr().err
        assert (f"foundryx: error: {error}" in err) is printed, err


# -- the fault the training script installs ------------------------------------------------

def install_fault(dies_at: int, pid_file: str) -> None:
    """The ``dies_at``-th sample a dataloader worker of rank 0 reads (0-based) kills that
    worker; it writes its pid to ``pid_file`` first."""
    import torch.utils.data
    from streaming import StreamingDataset

    orig = StreamingDataset.__getitem__
    seen = [0]

    def getitem(self, idx):
        if torch.utils.data.get_worker_info() is not None and os.environ.get("RANK", "0") == "0":
            if seen[0] == dies_at:
                Path(pid_file).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            seen[0] += 1
        return orig(self, idx)

    StreamingDataset.__getitem__ = getitem


if __name__ == "__main__":
    if os.environ.get("FOUNDRYX_TEST_WORKER_DIES_AT"):
        install_fault(int(os.environ["FOUNDRYX_TEST_WORKER_DIES_AT"]),
                      os.environ["FOUNDRYX_TEST_PID_FILE"])
    from foundryx.cli import run

    run(["train", "yamls/quickstart.yaml", *sys.argv[1:]])


def test_a_death_raised_inside_a_finalizer_prints_no_traceback(monkeypatch):
    """torch's SIGCHLD handler can fire while the garbage collector runs a ``__del__`` (CI saw
    it in tempfile's): Python prints "Exception ignored in" with the handler's traceback. During
    a run that traceback is kept back; any other finalizer error still reaches the hook that
    prints it (Python's own; here a recording stand-in, since pytest replaces Python's)."""
    import gc

    from foundryx.data.workers import unraisable_deaths_kept_quiet

    class Finalizer:
        def __init__(self, text):
            self.text = text

        def __del__(self):
            raise RuntimeError(self.text)

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(str(u.exc_value)))
    death = "DataLoader worker (pid 4321) is killed by signal: Killed. "
    with unraisable_deaths_kept_quiet() as kept:
        Finalizer(death)
        Finalizer("an unrelated bug")
        gc.collect()
    assert printed == ["an unrelated bug"]
    assert [str(e) for e in kept] == [death]
    assert parse_worker_death(kept[0]).pids == (4321,)
    Finalizer(death)  # after the run: the hook that was there before
    gc.collect()
    assert printed == ["an unrelated bug", death]
