"""``task_threads``: tasks evaluated at once in one process give the results of one at a time,
auto says what it took, a number the run cannot take is refused, and the helper keeps the
config's order, starts the longest first and gives torch's threads back."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from test_eval_native import _config, _llama_folder

from foundryx.errors import ConfigError
from foundryx.eval.config import load_eval_config
from foundryx.eval.run import run_eval
from foundryx.eval.task_threads import choose_task_threads, run_tasks, task_cost


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama_folder(tmp_path_factory.mktemp("threads_llama"))


def test_auto_takes_two_on_a_cpu_of_two_threads_in_one_process_and_says_so():
    n, why = choose_task_threads("auto", "cpu", 1, 2)
    assert n == 2 and why.startswith("tasks: 2 at a time, 1 thread each (task_threads: auto")
    assert choose_task_threads("auto", "cpu", 1, 16)[1].startswith("tasks: 2 at a time, 8 threads each")
    assert choose_task_threads("auto", "cpu", 1, 1) == (1, "tasks: one at a time (task_threads: "
                                                           "auto, one CPU thread)")
    assert choose_task_threads("auto", "cpu", 2, 2)[0] == 1  # processes gather metrics in order
    assert choose_task_threads("auto", "gpu", 1, 8)[0] == 1
    assert choose_task_threads(3, "cpu", 1, 2)[0] == 3
    assert choose_task_threads("auto", "cpu", 1, 2, native=False) == (
        1, "tasks: one at a time (task_threads: auto, a transformers model: its modules are not "
           "known to run safely in two threads)")
    assert choose_task_threads(2, "cpu", 1, 2, native=False)[0] == 2  # the user's choice


@pytest.mark.parametrize("device, world, where", [("gpu", 1, "device gpu"), ("cpu", 2, "2 processes")])
def test_a_number_the_run_cannot_take_is_refused(device, world, where):
    with pytest.raises(ConfigError, match=f"task_threads: 2 runs on a CPU in one process, not on "
                                          f"{where}; set task_threads: 1"):
        choose_task_threads(2, device, world, 8)


def test_task_threads_must_be_positive(llama, tmp_path):
    path = _config(tmp_path, tmp_path, [{"label": "m", "hf": str(llama)}])
    with pytest.raises(ConfigError, match="task_threads: must be positive, got 0"):
        load_eval_config(path, ["task_threads=0"])


class _Task:
    def __init__(self, tokens: int, rows: int = 1, new: int = 0):
        row = type("Row", (), {"ids": [0] * tokens})()
        self.examples = [type("Ex", (), {"rows": [row] * rows})()]
        self.max_new_tokens = new


def test_the_longest_first_results_in_order_threads_given_back():
    tasks = [_Task(10), _Task(5, rows=2, new=3), _Task(400), _Task(1)]
    assert [task_cost(t) for t in tasks] == [10, 10 + 2 * 3 * 40, 400, 1]
    started, seen = [], set()
    before = torch.get_num_threads()

    def evaluate(i):
        started.append(i)
        seen.add((threading.current_thread().name.startswith("foundryx-task"),
                  torch.get_num_threads()))
        time.sleep(0.05)
        return f"result {i}"

    assert run_tasks(tasks, evaluate, 2) == [f"result {i}" for i in range(4)]
    assert started[:2] == [2, 1] and sorted(started) == [0, 1, 2, 3]
    assert seen == {(True, max(1, before // 2))} and torch.get_num_threads() == before
    started.clear()
    assert run_tasks(tasks, evaluate, 1) == [f"result {i}" for i in range(4)]
    assert started == [0, 1, 2, 3]  # one at a time: the config's order, in this thread


def test_a_failing_task_raises_and_gives_the_threads_back():
    before = torch.get_num_threads()

    def evaluate(i):
        if i == 1:
            raise ValueError("task 1")
        return i

    with pytest.raises(ValueError, match="task 1"):
        run_tasks([_Task(3), _Task(2), _Task(1)], evaluate, 2)
    assert torch.get_num_threads() == before


@pytest.mark.needs_shared
def test_two_at_a_time_give_the_results_of_one_at_a_time(llama, tmp_path, shared_dir, capfd):
    path = _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    one = run_eval(load_eval_config(path, ["task_threads=1"]), write=False).results
    err = capfd.readouterr().err
    two = run_eval(load_eval_config(path, ["task_threads=2"]), write=False).results
    err_two = capfd.readouterr().err
    assert two.scores == one.scores and len(one.scores["m"]) >= 4
    assert "tasks: 2 at a time (task_threads)" in err_two
    # each task says when it is done (no progress bars while several run)
    for key in one.scores["m"]:
        if key.count("/") == 1:
            assert re.search(rf"{re.escape(key)}: \d+ examples, score ", err_two), key
    assert "tasks: 1 at a time (task_threads)" in err
