"""A one-process eval's tasks prepared in a child process while the parent imports torch.

``foundryx eval`` spends its first seconds importing torch on one core; reading the task files,
drawing the few-shot examples and tokenizing every row (:mod:`foundryx.eval.prepare`) need
neither torch nor the model, only the tokenizer. So, before torch is imported, :func:`start`
forks a child that does that work with the first model's ``tokenizer.json``
(:class:`~foundryx.data.json_tokenizer.JsonTokenizer`, the tokenizer the native Llama's eval
uses) and sends the prepared tasks back through a pipe. The parent takes them
(:meth:`Ahead.result`) where it would read the tasks itself, and uses them for every model
whose tokenizer is that folder's ``JsonTokenizer`` with the same token limit
(:meth:`Prepared.tasks_for`); any other model prepares its tasks as before.

What the parent sees does not change: the child's work is the same code on the same inputs
(the few-shot draws have their own seeds), a bad task file stops the eval with the same
message before any model loads, and the lines the preparation logs are said as each task is
evaluated. Not taken (everything is prepared in the parent): several processes, ``setup``
steps (they write the task files), a model with an adapter or ``implementation: hf``, a
tokenizer that is not a generic ``tokenizer.json``, a machine without ``os.fork``, and a
process that imported torch before (nothing to overlap).
Standard library and torch-free modules only.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundryx.data.json_tokenizer import JsonTokenizer, open_json_tokenizer
from foundryx.errors import FoundryxError
from foundryx.eval.config import EvalModelSpec, LoadedEvalConfig
from foundryx.eval.examples import Example
from foundryx.eval.prepare import PreparedTask, prepare_task, read_tasks

log = logging.getLogger(__name__)

__all__ = ["Ahead", "Prepared", "start"]


@dataclass
class Prepared:
    """What the child sends back: every task's examples (as :func:`read_tasks` gives them),
    and each task at its few-shot counts for the tokenizer of ``folder`` at ``limit`` tokens,
    with the log records its preparation made."""

    folder: str
    limit: int | None
    examples: dict[str, list[Example]]
    tasks: dict[str, list[PreparedTask]] = field(default_factory=dict)
    records: dict[str, list[logging.LogRecord]] = field(default_factory=dict)

    def tasks_for(self, label: str, tokenizer: Any, limit: int | None) -> list[PreparedTask] | None:
        """Task ``label`` prepared for a model with ``tokenizer`` and token ``limit``, its log
        lines said now; None where the model's differ (the caller prepares the task)."""
        same = (isinstance(tokenizer, JsonTokenizer) and tokenizer.name_or_path == self.folder
                and limit == self.limit)
        if not same or label not in self.tasks:
            return None
        for record in self.records.get(label, []):
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                record.created = time.time()  # said now, as the task is evaluated
                record.msecs = (record.created - int(record.created)) * 1000
                logger.handle(record)
        return self.tasks[label]


def _tokenizer_folder(spec: EvalModelSpec) -> Path | None:
    if not spec.hf or spec.adapter or spec.implementation == "hf":
        return None
    folder = Path(spec.tokenizer or spec.hf).expanduser()
    return folder if (folder / "tokenizer.json").is_file() else None


def _limit(spec: EvalModelSpec) -> int | None:
    """The model's longest sequence as the eval reads it from the loaded model
    (:func:`foundryx.eval.models.model_max_len`): ``max_position_embeddings`` of config.json."""
    try:
        value = json.loads((Path(spec.hf).expanduser() / "config.json").read_text(encoding="utf-8")
                           ).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def start(loaded: LoadedEvalConfig, world: int, *, after_torch: bool = False) -> Ahead | None:
    """A child preparing ``loaded``'s tasks for its first model's tokenizer, or None where the
    parent prepares them (see the module doc). In a process that has imported torch already
    (a notebook, a test) there is no import to overlap, and torch's threads make a fork
    riskier: None, unless ``after_torch``."""
    if world != 1 or loaded.cfg.setup or not loaded.models or not hasattr(os, "fork"):
        return None
    if "torch" in sys.modules and not after_torch:
        return None
    spec = loaded.models[0]
    folder = _tokenizer_folder(spec)
    if folder is None:
        return None
    limit = _limit(spec)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: prepare, send, leave without the parent's exit handlers
        os.close(read)
        _child(loaded, str(folder), limit, write)
    os.close(write)
    return Ahead(pid, read)


def _child(loaded: LoadedEvalConfig, folder: str, limit: int | None, fd: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the parent says it, not the child
        payload: tuple[Any, ...] = ("ok", _prepare(loaded, folder, limit))
    except FoundryxError as e:
        payload = ("error", type(e), str(e))
    except BaseException as e:  # noqa: BLE001  (any other failure: the parent prepares itself)
        payload = ("failed", f"{type(e).__name__}: {e}")
    try:
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    except BaseException:  # noqa: BLE001  (the parent left, or the payload does not pickle)
        code = 1
    os._exit(code)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None  # formatted here: it pickles
        self.records.append(record)


def _prepare(loaded: LoadedEvalConfig, folder: str, limit: int | None) -> Prepared:
    examples = read_tasks(loaded)
    prepared = Prepared(folder, limit, examples)
    tokenizer = open_json_tokenizer(folder)
    if isinstance(tokenizer, str):  # the parent will not use it either: tasks prepared there
        return prepared
    root = logging.getLogger("foundryx")  # this process's records go to the parent alone
    root.handlers, root.propagate = [], False
    root.setLevel(logging.DEBUG)
    for task_cfg in loaded.tasks:
        if task_cfg.label not in examples:
            continue
        collect = _Collect()
        root.addHandler(collect)
        try:
            prepared.tasks[task_cfg.label] = prepare_task(
                task_cfg, tokenizer, loaded.cfg.max_seq_len, loaded.cfg.icl_max_examples, limit,
                examples[task_cfg.label])
        finally:
            root.removeHandler(collect)
        prepared.records[task_cfg.label] = collect.records
    return prepared


class Ahead:
    """The child process of :func:`start` and the pipe its result comes through."""

    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd

    def result(self) -> Prepared | None:
        """The child's :class:`Prepared` (waiting for it), or None where it failed (said at
        debug level: the parent prepares the tasks). A bad task file raises its error here, as
        :func:`read_tasks` would."""
        with os.fdopen(self.fd, "rb") as pipe:
            data = pipe.read()
        os.waitpid(self.pid, 0)
        self.pid = None
        try:
            payload = pickle.loads(data)
        except Exception as e:  # noqa: BLE001  (a child that died before writing)
            log.debug("tasks prepared here: the preparing process sent nothing readable (%s)", e)
            return None
        if payload[0] == "error":
            error = FoundryxError.__new__(payload[1])
            Exception.__init__(error, payload[2])
            raise error
        if payload[0] == "failed":
            log.debug("tasks prepared here: the preparing process failed (%s)", payload[1])
            return None
        log.debug("tasks prepared for %s by a child process while torch was imported",
                  payload[1].folder)
        return payload[1]

    def close(self) -> None:
        """End the child if its result was not taken (the parent stopped first)."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.pid = None
