"""``foundryx eval`` ends after its atexit handlers without the interpreter's teardown
(foundryx.cli._exit_after_handlers): what a user or a wrapper relies on at exit still happens:
threads it would wait for finish, atexit handlers run, stdout (a pipe here) is complete, the
results files are whole and the exit code is the command's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from test_eval_ahead import _config
from test_eval_native import ROOT, _llama_folder

WRAPPER = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    marks = Path(sys.argv[1])
    atexit.register(lambda: (marks / "atexit").write_text("ran"))
    def late():
        time.sleep(0.5)
        (marks / "thread").write_text("finished")
    threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    from foundryx.cli import run
    run(sys.argv[2:])
""")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama_folder(tmp_path_factory.mktemp("exit_llama"))


@pytest.mark.needs_shared
def test_eval_exits_after_its_handlers_with_everything_written(llama, tmp_path, shared_dir):
    _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    wrapper, marks = tmp_path / "wrapper.py", tmp_path / "marks"
    wrapper.write_text(WRAPPER)
    marks.mkdir()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout: buffered

    def eval_(*args):
        return subprocess.run([sys.executable, str(wrapper), str(marks), "eval", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)

    r = eval_(str(tmp_path / "eval.yaml"), "max_seq_len=200", "progress_bar=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (marks / "atexit").read_text() == "ran"
    assert (marks / "thread").read_text() == "finished"
    assert "| arc_easy/3-shot |" in r.stdout and r.stdout.rstrip().splitlines()[-1].startswith(
        "wrote ")  # the pipe's buffer flushed: the last line is there
    assert (tmp_path / "out/results.png").read_bytes()[-8:] == b"IEND\xaeB`\x82"  # whole
    (marks / "atexit").unlink()
    bad = eval_(str(tmp_path / "eval.yaml"), "max_seq_lenn=200")
    assert bad.returncode == 2 and "foundryx: error:" in bad.stderr
    assert "Traceback" not in bad.stderr and (marks / "atexit").read_text() == "ran"
