"""Preemption at any moment: SIGTERM to the process group of ``foundryx launch -n 2 train.py
yamls/quickstart.yaml ...``, as Slurm and ``kill -TERM -PGID`` send it, during the launcher's
start-up, a rank's start-up, torch.compile, a step, a save or an eval. Each time either a
checkpoint of the batch the run stopped after is saved, or one line says why none could be
(training had not begun); the launcher ends with one line, no traceback, exit 75
(foundryx.runtime.preempt.PREEMPTED). The one other ending allowed: the launcher killed by the signal
before its handler is set (Python's start-up and ``import foundryx.cli``, about a second; no rank
has started, so nothing exists to save), exit -15. See foundryx.cli.launch and
foundryx.runtime.preempt.

Under plain ``composer -n 2`` (Composer's launcher as Composer made it, no foundryx code in it)
a SIGTERM while training still saves: the ranks imported foundryx, save the batch they stop
after and exit 75; what Composer's launcher prints around that is its own.

Also here: no ``torch.backends`` entry point (foundryx runs in no process that did not import
it), ``foundryx launch``'s stderr lacks torchao's "Skipping import of cpp extensions" (pinned
leg: torch 2.7 with torchao 0.16), and its mistakes are one line, exit 2.

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
from foundryx.cli.launch import foundryx_script, outcome
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


def test_no_torch_backends_entry_point_and_no_module_beside_the_package():
    """torch calls every ``torch.backends`` entry point at the end of every ``import torch``:
    foundryx registers none, and ships no top-level module for one."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "torch.backends" not in project["project"].get("entry-points", {})
    assert "py-modules" not in project.get("tool", {}).get("setuptools", {})
    assert not list(ROOT.glob("_foundryx*.py"))


NOTHING_OF_FOUNDRYX = r"""
import sys, torch
print(sorted(m for m in sys.modules if m.split(".")[0] in ("foundryx", "_foundryx_torch_hook")))
"""


def test_import_torch_runs_nothing_of_foundryx():
    """In this environment (its installed entry points, as pip left them): ``import torch``
    imports no module of foundryx's distribution. Fails in an environment installed from a
    foundryx that had the ``torch.backends`` hook until it is installed again."""
    got = subprocess.run([sys.executable, "-c", NOTHING_OF_FOUNDRYX], capture_output=True,
                         text=True, cwd="/", timeout=300)
    assert got.returncode == 0 and got.stdout.strip() == "[]", (got.stdout, got.stderr[-2000:])


def test_the_docs_name_composers_launcher_flags_and_the_readmes_command():
    """docs/operations.md, "Which launcher": the flags it lists are Composer's launcher's (what
    ``foundryx launch`` parses, with Composer's own parser), and its ``foundryx launch``
    command is the README's (run by tests/test_quickstart_e2e.py)."""
    from composer.cli.launcher import _get_parser

    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("### Which launcher", 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"`(-[-\w/]+)", section.split("and the same ranks", 1)[0]))
    listed = {f for flag in listed for f in flag.split("/")}
    flags = {o for a in _get_parser()._actions for o in a.option_strings} - {"-h", "--help", "--version"}
    assert listed == flags, (listed ^ flags)
    command = re.search(r"^foundryx launch -n 2 .*$", section, re.M).group(0)
    assert command in (ROOT / "README.md").read_text()
    assert "foundryx launch" in (ROOT / "launch" / "slurm_node.sh").read_text()


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


LEAVING = r"""
import atexit, sys, time
import composer.core.engine  # sets its SIGTERM handler, sys.exit(143) wherever it lands
def linger():
    print("leaving", flush=True)
    time.sleep(5)
atexit.register(linger)  # a callback on the way out, as torch._dynamo's dump_compile_times is
from foundryx.cli import run
run(["train", sys.argv[1]])
"""


def test_a_sigterm_while_a_failed_rank_exits_keeps_its_exit_2_and_one_line(tmp_path):
    """Every rank stops on the same bad config (exit 2); the launcher, seeing the first leave,
    sends SIGTERM to the others while they run their atexit callbacks (CI: one said Composer's
    SystemExit 143 in a traceback). The signal is ignored on the way out."""
    p = subprocess.Popen([sys.executable, "-c", LEAVING, str(tmp_path / "missing.yaml")], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "leaving", p.communicate(timeout=120)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err[-2000:]
    assert "Traceback" not in err and "SystemExit" not in err, err[-2000:]
    assert "foundryx: error:" in err and "missing.yaml" in err, err[-2000:]


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


LAUNCHERS = {"foundryx": [str(BIN / "foundryx"), "launch"], "composer": [str(BIN / "composer")]}


def one_try(data: Path, out: Path, moment: str, *extra: str, launcher: str = "foundryx") -> Try:
    """One launch of the quickstart's 2-process run by ``launcher`` (``foundryx launch`` or
    plain ``composer``), SIGTERM to its process group at ``moment``, waited for (bounded)."""
    out.mkdir(parents=True)
    cmd = [*LAUNCHERS[launcher], "-n", "2", "--stderr", str(out / "rank{rank}.err"),
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
        rc = p.wait(timeout=max(60.0, TRY_LIMIT_S - (time.monotonic() - start)))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    said = (out / "launcher.out").read_text(errors="replace") + (out / "launcher.err").read_text(errors="replace")
    return Try(moment, rc, said, out, time.monotonic() - start)


def _saved_batch(t: Try, head: str) -> int | None:
    """The batch rank 0 said it stops after (None: it said no such line), its checkpoint
    checked complete."""
    stops = [ln for ln in t.said.splitlines() if "preemption: SIGTERM received" in ln]
    if not stops:
        return None
    assert len(stops) == 1, head
    batch = int(stops[0].split("stopping after batch ")[1].split()[0])
    saved = {c.name for c, manifest in complete_checkpoints(t.out / "ckpt") if manifest}
    assert f"ep0-ba{batch}" in saved, (saved, head)
    return batch


def check(t: Try) -> str:
    """A ``foundryx launch`` try ended as preemption promises; returns how (for the summary)."""
    head = f"{t.moment} (exit {t.rc}):\n{t.said[-3000:]}"
    assert "Traceback" not in t.said and "SystemExit" not in t.said, head
    assert "Skipping import of cpp extensions" not in t.said, head
    if t.rc == -signal.SIGTERM:  # before the launcher set its handler: Python's start-up
        assert not (t.out / "rank1.err").exists() and not t.said.strip(), head
        return "launcher killed before its handler was set (no rank started)"
    assert t.rc == preempt.PREEMPTED, head
    last = t.said.strip().splitlines()[-1]
    assert last.startswith(("foundryx: preempted by SIGTERM", "foundryx: SIGTERM before the ranks")), head
    batch = _saved_batch(t, head)
    if batch is not None:  # training had begun: the batch it stopped after is saved, complete
        return f"saved at batch {batch}"
    if last.startswith("foundryx: SIGTERM before the ranks"):  # the launcher's own line
        return "before the ranks started"
    why = [ln for ln in t.said.splitlines() if ln.startswith("foundryx: preemption: SIGTERM")
           and "training began" in ln]  # rank 0's line
    assert len(why) == 1, head
    return why[0].removeprefix("foundryx: preemption: ")[:60]


def check_composer(t: Try) -> str:
    """A plain ``composer`` try signalled while training: both ranks saved the batch they
    stopped after and exited 75. Their exit codes are read from Composer 0.32's own lines
    ("Global rank R (PID P) exited with code C", its launcher's report of each rank that
    exited neither 0 nor killed); the rest of what its launcher prints, and its exit code, are
    Composer's."""
    head = f"{t.moment} (composer, exit {t.rc}):\n{t.said[-3000:]}"
    batch = _saved_batch(t, head)
    assert batch is not None, head
    codes = dict(re.findall(r"Global rank (\d+) \(PID \d+\) exited with code (-?\d+)", t.said))
    assert codes == {"0": str(preempt.PREEMPTED), "1": str(preempt.PREEMPTED)}, (codes, head)
    rank1 = (t.out / "rank1.err").read_text(errors="replace")
    assert "Traceback" not in rank1, rank1[-3000:]
    return f"saved at batch {batch}, ranks exit 75, composer exit {t.rc}"


def moments(n: int, seed: int = 48, kinds: tuple[str, ...] = ("launcher", "ranks", "compile",
            "batch", "save", "eval")) -> list[str]:
    """``n`` moments across the run's life: the launcher's start-up, the ranks', compile,
    steps, saves and evals (those of ``kinds``), drawn at random (a fixed seed: reruns hit the
    same moments)."""
    rng = random.Random(seed)
    draw = {"launcher": lambda: f"launcher:{rng.uniform(0.5, 25):.1f}",
            "ranks": lambda: f"ranks:{rng.uniform(0, 20):.1f}", "compile": lambda: "compile",
            "batch": lambda: f"batch:{rng.randint(1, 8)}", "save": lambda: f"save:{rng.choice((3, 6))}",
            "eval": lambda: "eval"}
    return [draw[rng.choice(kinds)]() for _ in range(n)]


def _run(data: Path, tmp: Path, chosen: list[str], launcher: str = "foundryx") -> list[str]:
    ended = []
    for i, moment in enumerate(chosen):
        extra = () if moment == "compile" else ("compile=false",)
        t = one_try(data, tmp / f"try{i}", moment, *extra, launcher=launcher)
        how = check(t) if launcher == "foundryx" else check_composer(t)
        ended.append(f"{moment}: {how} in {t.seconds:.0f} s")
        print(ended[-1], flush=True)  # as it goes: a run cut short by the timeout shows its tries
    return ended


@pytest.mark.slow
def test_sigterm_at_a_few_moments_saves_or_says_why(quickstart_data, tmp_path):
    """``foundryx launch``, the fast variant: one moment in each phase that matters (a rank
    starting, a step, a save), ~3 launches."""
    ended = _run(quickstart_data, tmp_path, ["ranks:3", "batch:2", "save:3"])
    assert "before training began" in ended[0], ended
    assert "saved at batch" in ended[1] and "saved at batch" in ended[2], ended


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_at_20_random_moments_saves_or_says_why(quickstart_data, tmp_path):
    """``foundryx launch``: 20 moments (``FOUNDRYX_STRESS_TRIES``) of every phase."""
    _run(quickstart_data, tmp_path, moments(int(os.environ.get("FOUNDRYX_STRESS_TRIES", "20"))))


@pytest.mark.slow
@pytest.mark.modern_leg  # make test: on torch 2.15 (the foundryx launch checks run on 2.7)
def test_plain_composer_sigterm_while_training_saves(quickstart_data, tmp_path):
    """``composer -n 2 train.py ...``, Composer's launcher with nothing of foundryx in it: a
    SIGTERM to the process group after batch 2 still ends with batch 2 or 3 saved and both
    ranks exiting 75 (the ranks' handler is foundryx's: train.py imported it)."""
    _run(quickstart_data, tmp_path, ["batch:2"], launcher="composer")


@pytest.mark.slow
@pytest.mark.long
def test_plain_composer_sigterm_at_random_training_moments_saves(quickstart_data, tmp_path):
    """The same at 6 moments of training (``FOUNDRYX_STRESS_TRIES``): steps, saves, evals."""
    n = int(os.environ.get("FOUNDRYX_STRESS_TRIES", "6"))
    _run(quickstart_data, tmp_path, moments(n, seed=53, kinds=("batch", "save", "eval")),
         launcher="composer")


@pytest.mark.slow
def test_a_2_process_launch_prints_no_torchao_line(quickstart_data, tmp_path):
    """``foundryx launch -n 2 train.py yamls/quickstart.yaml``: the launcher's stderr (its own
    and rank 0's) lacks torchao's import-time line (the launcher filters it before it imports
    Composer), and a finished run ends without Composer's "Waiting up to 30 seconds" line.
    (Plain ``composer``'s launcher process prints the line when its import of Composer reaches
    torchao, on the pinned leg: nothing of foundryx runs there; tests/test_tp_docs.py.)"""
    out = tmp_path / "run"
    cmd = [*LAUNCHERS["foundryx"], "-n", "2", "train.py", "yamls/quickstart.yaml",
           f"variables.data_root={quickstart_data}", f"save_folder={out}/ckpt",
           f"loggers.jsonl.path={out}/metrics.jsonl", "eval_loader=null", "compile=false",
           *TINY[:5], "max_duration=2ba"]
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TRY_LIMIT_S)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "Skipping import of cpp extensions" not in got.stderr, got.stderr[-3000:]
    assert "Waiting up to 30 seconds" not in got.stdout + got.stderr
    assert not [ln for ln in got.stderr.splitlines() if ln.startswith("foundryx: launch")], got.stderr


@pytest.mark.slow
def test_launch_mistakes_are_one_line_and_exit_2(tmp_path):
    """A flag Composer's launcher refuses: one line naming it, exit 2, no traceback."""
    got = subprocess.run([*LAUNCHERS["foundryx"], "-n", "0", "train.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=TRY_LIMIT_S)
    assert got.returncode == 2, got.stderr[-3000:]
    assert got.stderr.strip().splitlines() == ["foundryx launch: error: The nproc must be 1 or greater"]


@pytest.mark.slow
@pytest.mark.modern_leg
def test_launch_of_a_script_without_foundryx_is_composers_said_in_one_line(tmp_path):
    """A script that does not import foundryx would never release the signals foundryx's
    launcher holds for its ranks: Composer's launcher runs it as ``composer`` does, and one
    line says so."""
    script = tmp_path / "theirs.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    got = subprocess.run([*LAUNCHERS["foundryx"], "-n", "1", str(script)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=TRY_LIMIT_S)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.splitlines()[0] == "rank 0 of 1", got.stdout  # then Composer's own lines
    said = [ln for ln in got.stderr.splitlines() if ln.startswith("foundryx")]
    assert said == [f"foundryx: launch: {script} does not import foundryx (its ranks would never "
                    f"release the signals foundryx holds for them): Composer's launcher runs it as "
                    f"`composer` would, without foundryx's signal handling"], got.stderr
