"""Several tasks evaluated at once in one process (``task_threads``), the CPU's threads shared
between them.

On a CPU a small model's step is mostly per-operation overhead (dispatch, Python, tiny
kernels): a decoding step of the benchmark's model takes 2.45-2.90 ms on two intra-op threads
and 3.27 ms on one, so a task's second thread adds little. Two tasks at once, each on one
thread, keep both cores busy instead: the 20 results of ``benchmarks/eval_vs_llmfoundry.py``
took 0.81-0.87x the time (2 runs, alternating). Each task runs exactly as alone (its own
metric, batches and generation; greedy decoding, no randomness), on the same model, whose
forward keeps no state between calls; tasks are started longest first (:func:`task_cost`) so
the last one does not run alone for long, and the results come back in the config's order.

``auto`` takes 2 for the native Llama on a CPU with at least 2 threads in one process, else 1,
and says which in one line. Several processes keep 1 (their tasks' metrics gather across
processes in order), and so does a transformers model under auto (its modules are not known
to be safe from two threads: some rotary embeddings update their state in the forward); a
number sets it on a CPU in one process. Where ``task_processes`` takes 2 (its ``auto`` on a
Linux CPU, :mod:`foundryx.eval.task_processes`: two processes do not share Python's lock, two
threads do), ``auto`` here takes 1 in each process.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from foundryx.errors import ConfigError
from foundryx.eval.prepare import PreparedTask

__all__ = ["choose_task_threads", "longest_first", "run_tasks", "task_cost"]

T = TypeVar("T")
GENERATED_TOKEN = 40  # a generated token's work in prompt tokens (a decoding step is one forward)


def choose_task_threads(setting: int | str, device: str, world: int, threads: int,
                        native: bool = True) -> tuple[int, str]:
    """``(tasks at once, why)`` for ``task_threads`` = ``setting`` on ``device`` with
    ``world`` processes and ``threads`` intra-op threads, for a ``native`` model (foundryx's
    own Llama) or not; a ConfigError for a number the run cannot take."""
    if isinstance(setting, int):
        if setting > 1 and (world > 1 or device != "cpu"):
            where = f"{world} processes" if world > 1 else f"device {device}"
            raise ConfigError([f"task_threads: {setting} runs on a CPU in one process, not on "
                               f"{where}; set task_threads: 1 (or auto)"])
        return setting, f"tasks: {setting} at a time (task_threads)"
    if device == "cpu" and world == 1 and threads >= 2 and native:
        return 2, (f"tasks: 2 at a time, {threads // 2} thread{'s' if threads // 2 > 1 else ''} "
                   f"each (task_threads: auto on a CPU of {threads} threads; 1 for one at a time)")
    why = (f"{world} processes" if world > 1 else f"device {device}" if device != "cpu"
           else "one CPU thread" if threads < 2
           else "a transformers model: its modules are not known to run safely in two threads")
    return 1, f"tasks: one at a time (task_threads: auto, {why})"


def task_cost(task: PreparedTask) -> int:
    """An estimate of ``task``'s work: its rows' tokens, a generated token counting as
    :data:`GENERATED_TOKEN` of them. Only the order tasks start in depends on it."""
    tokens = sum(len(row.ids) for ex in task.examples for row in ex.rows)
    generated = sum(len(ex.rows) for ex in task.examples) * task.max_new_tokens
    return tokens + GENERATED_TOKEN * generated


def longest_first(tasks: list[PreparedTask]) -> list[int]:
    """The tasks' indices in the order they start: the most work (:func:`task_cost`) first."""
    return sorted(range(len(tasks)), key=lambda i: -task_cost(tasks[i]))


def run_tasks(tasks: list[PreparedTask], evaluate: Callable[[int], T], at_once: int) -> list[T]:
    """``[evaluate(i) for i in range(len(tasks))]``, ``at_once`` of them running together
    (longest first), torch's intra-op threads divided between them meanwhile."""
    if at_once <= 1 or len(tasks) <= 1:
        return [evaluate(i) for i in range(len(tasks))]
    order = longest_first(tasks)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before // at_once))
    try:
        with ThreadPoolExecutor(at_once, thread_name_prefix="foundryx-task") as pool:
            done: dict[int, Any] = dict(zip(order, pool.map(evaluate, order)))
    finally:
        torch.set_num_threads(before)
    return [done[i] for i in range(len(tasks))]
