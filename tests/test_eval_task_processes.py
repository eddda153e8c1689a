"""``task_processes``: tasks evaluated in forked processes give the results of one process, auto
says what it took, a number the run cannot take is refused, and the helper hands the tasks out
to both processes, keeps the config's order, raises a child's error, reports a child's death
and ends its children when it fails itself."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import torch
from test_eval_native import _config, _llama_folder
from test_eval_task_threads import _Task

from foundryx.errors import ConfigError, DataError, RunError
from foundryx.eval import task_processes
from foundryx.eval.config import load_eval_config
from foundryx.eval.run import run_eval
from foundryx.eval.task_processes import choose_task_processes, run_in_processes

linux = pytest.mark.skipif(sys.platform != "linux", reason="task_processes forks on Linux only")


class _Keyed(_Task):
    def __init__(self, key: str, tokens: int):
        super().__init__(tokens)
        self.key = key


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama_folder(tmp_path_factory.mktemp("processes_llama"))


@linux
def test_auto_forks_two_for_the_native_llama_on_a_cpu_of_two_threads_and_says_so():
    n, why = choose_task_processes("auto", "auto", "cpu", 1, 2)
    assert (n, why) == (2, "tasks: 2 at a time in 2 processes, 1 thread each (task_processes: "
                           "auto on a CPU of 2 threads; 1 for one at a time)")
    assert choose_task_processes("auto", "auto", "cpu", 1, 16)[1].startswith(
        "tasks: 2 at a time in 2 processes, 8 threads each")
    # else 1, and the thread rule's line is said instead
    for args in (("auto", "cpu", 1, 1), ("auto", "gpu", 1, 8), ("auto", "cpu", 2, 2),
                 (2, "cpu", 1, 2)):  # task_threads given: the user's threads
        assert choose_task_processes("auto", *args) == (1, ""), args
    assert choose_task_processes("auto", "auto", "cpu", 1, 2, native=False) == (1, "")
    assert choose_task_processes(3, "auto", "cpu", 1, 2) == (
        3, "tasks: 3 processes at once (task_processes)")


@pytest.mark.parametrize(("device", "world", "where"), [("gpu", 1, "device gpu"),
                                                        ("cpu", 2, "2 processes")])
def test_a_number_the_run_cannot_take_is_refused(device, world, where):
    with pytest.raises(ConfigError, match=f"task_processes: 2 forks the eval process on a Linux "
                                          f"CPU run as one process, not on {where}; set "
                                          "task_processes: 1"):
        choose_task_processes(2, "auto", device, world, 8)


def test_without_fork_auto_takes_one_and_a_number_is_refused(monkeypatch):
    monkeypatch.setattr(task_processes, "FORKS", False)
    assert choose_task_processes("auto", "auto", "cpu", 1, 2) == (1, "")
    with pytest.raises(ConfigError, match=f"not on {sys.platform}; set task_processes: 1"):
        choose_task_processes(2, "auto", "cpu", 1, 2)


def test_task_processes_must_be_positive(llama, tmp_path):
    path = _config(tmp_path, tmp_path, [{"label": "m", "hf": str(llama)}])
    with pytest.raises(ConfigError, match="task_processes: must be positive, got 0"):
        load_eval_config(path, ["task_processes=0"])


def _where(i):
    time.sleep(0.1)
    return i, os.getpid(), torch.get_num_threads()


@linux
def test_results_come_back_in_order_from_both_processes_and_threads_are_given_back():
    tasks = [_Keyed(f"t{i}", n) for i, n in enumerate([100, 60, 50, 40, 10, 5])]
    before = torch.get_num_threads()
    out = run_in_processes(tasks, _where, 2)
    assert [i for i, _, _ in out] == list(range(6))
    pids = {pid for _, pid, _ in out}
    assert os.getpid() in pids and len(pids) == 2  # the parent and one child took tasks
    assert {n for _, _, n in out} == {max(1, before // 2)}  # each process its share
    assert torch.get_num_threads() == before
    # one task: no child at all
    assert [p for _, p, _ in run_in_processes(tasks[:1], _where, 2)] == [os.getpid()]


def _in_the_child(parent: int, action):
    def evaluate(i):
        if os.getpid() != parent:
            action()
        time.sleep(0.2)
        return i
    return evaluate


@linux
@pytest.mark.parametrize("error", [DataError("row 3 of t1 is broken"), ValueError("a bug")])
def test_a_childs_error_is_raised_here(error):
    tasks = [_Keyed(f"t{i}", 100 - i) for i in range(4)]

    def fail():
        raise error

    before = torch.get_num_threads()
    evaluate = _in_the_child(os.getpid(), fail)
    if isinstance(error, DataError):  # foundryx's errors as they are: their message is all
        with pytest.raises(DataError, match="row 3 of t1 is broken"):
            run_in_processes(tasks, evaluate, 2)
    else:  # anything else with the child's traceback
        with pytest.raises(RuntimeError, match=r"(?s)the eval process evaluating t\d \(pid \d+\) "
                                               r"failed; its traceback:.*ValueError: a bug"):
            run_in_processes(tasks, evaluate, 2)
    assert torch.get_num_threads() == before


@linux
def test_a_child_that_dies_is_reported_naming_its_task():
    tasks = [_Keyed("gsm8k/8-shot", 100), _Keyed("piqa/0-shot", 90), _Keyed("copa/0-shot", 5)]
    evaluate = _in_the_child(os.getpid(), lambda: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(RunError, match=r"the eval process evaluating (gsm8k/8|piqa/0|copa/0)-shot "
                                       r"\(pid \d+\) was killed by signal SIGKILL before it sent its "
                                       r"results .*task_processes: 1 evaluates every task"):
        run_in_processes(tasks, evaluate, 2)


@linux
def test_a_failing_parent_ends_its_child_first(tmp_path):
    tasks = [_Keyed("t0", 100), _Keyed("t1", 90)]
    pid_file, parent = tmp_path / "child", os.getpid()

    def evaluate(i):
        if os.getpid() != parent:  # the child: say who it is (whole: a rename), then run long
            pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
            os.replace(pid_file.with_suffix(".tmp"), pid_file)
            time.sleep(60)
            return i
        while not pid_file.exists():
            time.sleep(0.01)
        raise KeyboardInterrupt  # the parent's own task stops (Ctrl-C)

    with pytest.raises(KeyboardInterrupt):
        run_in_processes(tasks, evaluate, 2)
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # ended and reaped: no such process
        os.kill(child, 0)


@linux
@pytest.mark.needs_shared
def test_two_processes_give_the_results_of_one(llama, tmp_path, shared_dir, capfd):
    path = _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    one = run_eval(load_eval_config(path, ["task_processes=1", "task_threads=1",
                                           f"output_dir={tmp_path / 'one'}"]),
                   dump_examples=2).results
    capfd.readouterr()
    two = run_eval(load_eval_config(path, ["task_processes=2", f"output_dir={tmp_path / 'two'}"]),
                   dump_examples=2).results
    err = capfd.readouterr().err
    assert two.scores == one.scores and len(one.scores["m"]) >= 4
    # the rows --dump-examples writes come back from the child too, the same and in order
    dumped = (tmp_path / "two" / "examples.jsonl").read_text()
    assert dumped == (tmp_path / "one" / "examples.jsonl").read_text() and dumped.count("\n") >= 8
    assert "tasks: 2 processes at once (task_processes)" in err
    assert "Traceback" not in err and "forked" not in err  # no tokenizers warning
    for key in one.scores["m"]:  # each task says when it is done, in whichever process ran it
        if key.count("/") == 1:
            assert re.search(rf"{re.escape(key)}: \d+ examples, score ", err), key
