"""Preemption at any moment: SIGTERM to the process group of ``composer -n 2 train.py
yamls/quickstart.yaml ...``, as Slurm and ``kill -TERM -PGID`` send it, during the launcher's
start-up, a rank's start-up, torch.compile, a step, a save or an eval. Each time either a
checkpoint of the batch the run stopped after is saved, or one line says why none could be
(training had not begun); the launcher ends with one line, no traceback, exit 75
(foundryx.runtime.preempt.PREEMPTED). The one other ending allowed: the launcher killed by the signal
before torch is imported in it (before any foundryx code runs there; no rank has started, so
nothing exists to save), exit -15. See foundryx.composer_launcher and foundryx.runtime.preempt.

Also here: the launcher's stderr lacks torchao's "Skipping import of cpp extensions" (pinned
leg: torch 2.7 with torchao 0.16), filtered in the launcher process by the same hook.

The unit tests (fast) check the launcher's exit decision and the phases of a process's signal
handling without torch.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from foundryx.checkpoint.layout import complete_checkpoints
from foundryx.composer_launcher import foundryx_script, outcome
from foundryx.runtime import preempt

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
TINY = ["variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        "global_train_batch_size=4", "console_log_interval=1ba", "max_duration=10000ba",
        "save_interval=3ba", "eval_interval=4ba", "eval_subset_num_batches=2",
        "device_eval_batch_size=4", "callbacks.speed_monitor.window_size=1"]
TRY_LIMIT_S = 420  # start-up on a loaded 2-core machine is most of it


# ---------------------------------------------------------------------------------- fast


def test_the_launchers_exit_code_and_line():
    term = int(signal.SIGTERM)
    assert outcome({0: 0, 1: 0}, 0) == (0, None)
    code, line = outcome({0: 75, 1: 75}, term)
    assert code == preempt.PREEMPTED and line.startswith("foundryx: preempted by SIGTERM")
    code, line = outcome({0: 75, 1: 0}, 0)  # ranks signalled alone, one had finished
    assert code == 75 and "preempted by a preemption signal" in line
    code, line = outcome({0: 143, 1: -15}, term)  # preemption off: Composer's exit 143
    assert code == 143 and "without a checkpoint" in line
    assert outcome({0: 75, 1: 1}, term) == (1, None)  # a real failure is Composer's case
    assert outcome({0: -9, 1: 0}, 0) == (137, None)
    code, line = outcome({0: 0, 1: 0}, term)  # the signal came as the run ended
    assert code == 0 and "finished" in line


def test_the_launcher_takes_over_for_foundryx_scripts_only(tmp_path):
    mine, theirs = tmp_path / "mine.py", tmp_path / "theirs.py"
    mine.write_text("import sys\nfrom foundryx.cli import run\n")
    theirs.write_text("import composer\n# foundryx is not imported here\n")
    assert foundryx_script(str(ROOT / "train.py")) and foundryx_script(str(mine))
    assert not foundryx_script(str(theirs)) and not foundryx_script(str(tmp_path / "absent.py"))
    assert foundryx_script("foundryx.cli", module_mode=True)
    assert not foundryx_script("mypkg.train", module_mode=True)


def test_a_launcher_hook_that_cannot_load_says_so_and_torch_still_imports(tmp_path):
    """torch makes any error of a backend hook its own (``import torch`` then fails in every
    process): a foundryx whose launcher module cannot load costs the composer command its
    signal handling, in one line, and nothing else."""
    broken = tmp_path / "shadow" / "foundryx"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "composer_launcher.py").write_text("raise ImportError('a half-installed foundryx')\n")
    script = tmp_path / "bin" / "composer"  # the hook acts in the composer command only
    script.parent.mkdir()
    script.write_text("import torch\nprint('torch', torch.__version__)\n")
    got = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(broken.parent)})
    assert got.returncode == 0 and got.stdout.startswith("torch "), got.stderr[-2000:]
    said = [line for line in got.stderr.splitlines() if line.startswith("foundryx:")]
    assert said == ["foundryx: the composer command runs without foundryx's signal handling "
                    "(ImportError: a half-installed foundryx); FOUNDRYX_LAUNCHER=0 turns it off"], got.stderr


PHASES = r"""
import os, signal, sys
os.environ["FOUNDRYX_HELD_SIGNALS"] = "15,10"
signal.pthread_sigmask(signal.SIG_BLOCK, [15, 10])
os.kill(os.getpid(), signal.SIGTERM)          # held: it waits
import foundryx                               # released into a handler that notes it
from foundryx.runtime import preempt
assert preempt.received() == 15 and "FOUNDRYX_HELD_SIGNALS" not in os.environ
with preempt.kept():                          # an import setting its own handler leaves ours
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
assert signal.getsignal(signal.SIGTERM) is preempt._handle
try:
    preempt.take_over()                       # foundryx train: the noted signal is acted on
except preempt.Preempted as e:
    print("preempted", e.signum)
"""


def test_a_held_signal_is_noted_then_acted_on_and_an_import_does_not_replace_the_handler():
    got = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "preempted 15", got.stderr[-2000:]


SWALLOWED = r"""
import os, signal, time
from foundryx.runtime import preempt
preempt._Deadline.GRACE_S = 1.0
preempt.take_over()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except preempt.Preempted:
    pass  # swallowed, as a library's finalizer or import machinery may; then stuck
while True:
    time.sleep(0.1)
"""


def test_a_signal_before_training_ends_the_process_even_when_its_raise_is_swallowed():
    """The rank that hung in the stress test: its Preempted lost on the way, then waiting on a
    rank that had left. The deadline thread ends it: one line, exit 75, within its grace."""
    started = time.monotonic()
    got = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert got.returncode == preempt.PREEMPTED, got.stderr[-2000:]
    assert got.stderr.strip().splitlines() == [preempt.before_training_line(signal.SIGTERM)]
    assert time.monotonic() - started < 60


# ---------------------------------------------------------------------------------- slow


@dataclass
class Try:
    moment: str
    rc: int
    said: str      # the launcher's stdout and stderr: rank 0's output and its own
    out: Path
    seconds: float


def _losses(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count('"loss/train/total"') if path.exists() else 0


def _when(moment: str, out: Path, start: float) -> bool:
    """Whether ``moment`` has come: ``launcher:S`` S s after start, ``ranks:S`` S s after the
    ranks started, ``batch:K`` after K batches, ``save:K`` as batch K's checkpoint is written,
    ``compile`` as the blocks are being compiled, ``eval`` just after an eval began."""
    kind, _, arg = moment.partition(":")
    said = "".join(f.read_text(errors="replace") for f in (out / "launcher.err", out / "launcher.out")
                   if f.exists())
    if kind == "launcher":
        return time.monotonic() - start >= float(arg)
    if kind == "ranks":
        born = out / "rank1.err"
        return born.exists() and time.time() - born.stat().st_mtime >= float(arg)
    if kind == "batch":
        return _losses(out) >= int(arg)
    if kind == "save":
        return (out / "ckpt" / f"ep0-ba{arg}").exists()
    if kind == "compile":  # the first batch compiles: signalled 2 s into it
        began = out / "began"
        if "MFU: not reported" in said and not began.exists():
            began.write_text("")
        return began.exists() and time.time() - began.stat().st_mtime >= 2
    if kind == "eval":  # eval_interval=4ba: the eval runs after batch 4 (console: "batch     4/")
        return re.search(r"^batch\s+4/", said, re.MULTILINE) is not None
    raise ValueError(moment)


def one_try(data: Path, out: Path, moment: str, *extra: str) -> Try:
    """One launch of the quickstart's 2-process run, SIGTERM to its process group at
    ``moment``, waited for (bounded)."""
    out.mkdir(parents=True)
    cmd = [str(BIN / "composer"), "-n", "2", "--stderr", str(out / "rank{rank}.err"),
           "--stdout", str(out / "rank{rank}.out"), "train.py", "yamls/quickstart.yaml",
           f"variables.data_root={data}", f"save_folder={out}/ckpt",
           f"loggers.jsonl.path={out}/metrics.jsonl", *TINY, *extra]
    start = time.monotonic()
    with (out / "launcher.out").open("w") as o, (out / "launcher.err").open("w") as e:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while not _when(moment, out, start):
            assert p.poll() is None, f"{moment}: the run ended before its moment"
            assert time.monotonic() - start < TRY_LIMIT_S, f"{moment}: not reached"
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGTERM)
        rc = p.wait(timeout=max(30.0, TRY_LIMIT_S - (time.monotonic() - start)))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    said = (out / "launcher.out").read_text(errors="replace") + (out / "launcher.err").read_text(errors="replace")
    return Try(moment, rc, said, out, time.monotonic() - start)


def check(t: Try) -> str:
    """The try ended as preemption promises; returns how (for the summary)."""
    head = f"{t.moment} (exit {t.rc}):\n{t.said[-3000:]}"
    assert "Traceback" not in t.said and "SystemExit" not in t.said, head
    assert "Skipping import of cpp extensions" not in t.said, head
    if t.rc == -signal.SIGTERM:  # before the launcher imported torch: no foundryx code yet
        assert not (t.out / "rank1.err").exists() and not t.said.strip(), head
        return "launcher killed before foundryx's hook (no rank started)"
    assert t.rc == preempt.PREEMPTED, head
    last = t.said.strip().splitlines()[-1]
    assert last.startswith(("foundryx: preempted by SIGTERM", "foundryx: SIGTERM before the ranks")), head
    stops = [ln for ln in t.said.splitlines() if "preemption: SIGTERM received" in ln]
    if stops:  # training had begun: the batch it stopped after is saved, complete
        assert len(stops) == 1, head
        batch = int(stops[0].split("stopping after batch ")[1].split()[0])
        saved = {c.name for c, manifest in complete_checkpoints(t.out / "ckpt") if manifest}
        assert f"ep0-ba{batch}" in saved, (saved, head)
        return f"saved at batch {batch}"
    if last.startswith("foundryx: SIGTERM before the ranks"):  # the launcher's own line
        return "before the ranks started"
    why = [ln for ln in t.said.splitlines() if ln.startswith("foundryx: preemption: SIGTERM")
           and "training began" in ln]  # rank 0's line
    assert len(why) == 1, head
    return why[0].removeprefix("foundryx: preemption: ")[:60]


def moments(n: int, seed: int = 48) -> list[str]:
    """``n`` moments across the run's life: the launcher's start-up, the ranks', compile,
    steps, saves and evals, drawn at random (a fixed seed: reruns hit the same moments)."""
    rng = random.Random(seed)
    kinds = [lambda: f"launcher:{rng.uniform(0.5, 25):.1f}", lambda: f"ranks:{rng.uniform(0, 20):.1f}",
             lambda: "compile", lambda: f"batch:{rng.randint(1, 8)}",
             lambda: f"save:{rng.choice((3, 6))}", lambda: "eval"]
    return [rng.choice(kinds)() for _ in range(n)]


def _run(data: Path, tmp: Path, chosen: list[str]) -> list[str]:
    ended = []
    for i, moment in enumerate(chosen):
        extra = () if moment == "compile" else ("compile=false",)
        t = one_try(data, tmp / f"try{i}", moment, *extra)
        ended.append(f"{moment}: {check(t)} in {t.seconds:.0f} s")
    print("\n".join(ended))
    return ended


@pytest.mark.slow
def test_sigterm_at_a_few_moments_saves_or_says_why(quickstart_data, tmp_path):
    """The fast variant: one moment in each phase that matters (a rank starting, a step, a
    save), ~3 launches."""
    ended = _run(quickstart_data, tmp_path, ["ranks:3", "batch:2", "save:3"])
    assert "before training began" in ended[0], ended
    assert "saved at batch" in ended[1] and "saved at batch" in ended[2], ended


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_at_20_random_moments_saves_or_says_why(quickstart_data, tmp_path):
    _run(quickstart_data, tmp_path, moments(int(os.environ.get("FOUNDRYX_STRESS_TRIES", "20"))))


@pytest.mark.slow
def test_a_2_process_launch_prints_no_torchao_line(quickstart_data, tmp_path):
    """``composer -n 2 train.py yamls/quickstart.yaml``: the launcher's stderr (its own and rank
    0's) lacks torchao's import-time line, and a finished run ends without Composer's
    "Waiting up to 30 seconds" line."""
    out = tmp_path / "run"
    cmd = [str(BIN / "composer"), "-n", "2", "train.py", "yamls/quickstart.yaml",
           f"variables.data_root={quickstart_data}", f"save_folder={out}/ckpt",
           f"loggers.jsonl.path={out}/metrics.jsonl", "eval_loader=null", "compile=false",
           *TINY[:5], "max_duration=2ba"]
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TRY_LIMIT_S)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "Skipping import of cpp extensions" not in got.stderr, got.stderr[-3000:]
    assert "Waiting up to 30 seconds" not in got.stdout + got.stderr
