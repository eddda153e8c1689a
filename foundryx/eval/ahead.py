"""A one-process eval's tasks prepared in a child process while the parent imports torch.

``foundryx eval`` spends its first seconds importing torch on one core; reading the task files,
drawing the few-shot examples and tokenizing every row (:mod:`foundryx.eval.prepare`) need
neither torch nor the model, only the tokenizer. So, before torch is imported, :func:`start`
forks a child that does that work with the first model's ``tokenizer.json``
(:class:`~foundryx.data.json_tokenizer.JsonTokenizer`, the tokenizer the native Llama's eval
uses) and sends the prepared tasks back through a pipe. The parent takes them
(:meth:`Ahead.result`) where it would read the tasks itself, and uses them for every model
whose tokenizer is that folder's ``JsonTokenizer`` with the same token limit
(:meth:`Prepared.tasks_for`); any other model prepares its tasks as before. While the
prepared tasks wait for the parent to take them, the child imports matplotlib (still during
the parent's torch import, on the core the parent does not use) and then waits: when the
results are written, it draws their chart (:meth:`Ahead.draw`), which saves the command
matplotlib's import (~0.5 s) at its end.

The child prepares tasks in the config's order until their rows hold :data:`MAX_TOKENS` tokens;
the parent prepares the rest as it reaches them. What the parent sees does not change: the child's work is the same code on the same inputs
(the few-shot draws have their own seeds), a bad task file stops the eval with the same
message before any model loads, and the lines the preparation logs are said as each task is
evaluated. Not taken (everything is prepared in the parent): several processes, ``setup``
steps (they write the task files), a model with an adapter or ``implementation: hf``, a
tokenizer that is not a generic ``tokenizer.json``, a machine without ``os.fork``, and a
process that imported torch before (nothing to overlap).
Standard library and torch-free modules only.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from foundryx.data.json_tokenizer import JsonTokenizer, open_json_tokenizer
from foundryx.errors import FoundryxError
from foundryx.eval.config import EvalModelSpec, LoadedEvalConfig
from foundryx.eval.examples import Example
from foundryx.eval.prepare import PreparedTask, prepare_task, read_tasks
from foundryx.eval.report import EvalResults, bar_chart

log = logging.getLogger(__name__)

__all__ = ["Ahead", "Prepared", "start"]

# Rows the child prepares at most (token ids, ~36 bytes each as Python ints: ~0.6 GB), so that a
# large eval (whole task files at 2048 tokens) does not hold every task's rows at once: the
# parent prepares the tasks past it one at a time, as it does without a child.
MAX_TOKENS = 16_000_000


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
    parent, child = Pipe(duplex=True)  # a socket pair: the tasks back, a chart job out
    pid = os.fork()
    if pid == 0:  # the child: prepare, send, draw if asked, leave without the parent's exit handlers
        parent.close()
        _child(loaded, str(folder), limit, child)
    child.close()
    return Ahead(pid, parent)


def _child(loaded: LoadedEvalConfig, folder: str, limit: int | None, conn: Connection) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):  # a signal ends it; the parent says why
        signal.signal(signum, signal.SIG_DFL)
    try:
        payload: tuple[Any, ...] = ("ok", _prepare(loaded, folder, limit))
    except FoundryxError as e:
        payload = ("error", type(e), str(e))
    except BaseException as e:  # noqa: BLE001  (any other failure: the parent prepares itself)
        payload = ("failed", f"{type(e).__name__}: {e}")
    ok = payload[0] == "ok"
    try:
        data = ForkingPickler.dumps(payload)
    except BaseException:  # noqa: BLE001  (the payload does not pickle)
        os._exit(1)
    del payload
    # The parent reads the tasks once its torch import is done; meanwhile a thread waits to
    # hand them over and this one imports matplotlib, on a core the parent does not use.
    # (Imported after the handover, it ran beside the parent's tasks: their CPU.)
    sent: list[bool] = []
    sender = threading.Thread(target=_send, args=(conn, data, sent), daemon=True)
    sender.start()
    if ok:
        _import_matplotlib()
    sender.join()
    if not sent:  # the parent left
        os._exit(1)
    del data  # the parent has the rows now: not held while this process waits
    gc.collect()
    if ok:
        _draw_when_asked(conn)
    os._exit(0)


def _send(conn: Connection, data: Any, sent: list[bool]) -> None:
    try:
        conn.send_bytes(data)
        sent.append(True)
    except OSError:
        pass


def _import_matplotlib() -> None:
    try:
        from matplotlib.backends import backend_agg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        pass


def _draw_when_asked(conn: Connection) -> None:
    """Wait for the parent's results and draw their chart
    (:func:`~foundryx.eval.report.bar_chart`) to the path it names; reply how that went. The
    parent closing its end (no results to write) ends it."""
    try:
        results, path = conn.recv()
    except (EOFError, OSError):
        return
    try:
        bar_chart(results, Path(path))
        reply: tuple[Any, ...] = ("ok",)
    except OSError as e:
        reply = ("oserror", e.errno, e.strerror, e.filename)
    except BaseException as e:  # noqa: BLE001  (the parent draws it itself)
        reply = ("failed", f"{type(e).__name__}: {e}")
    try:
        conn.send(reply)
    except OSError:
        pass


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
    tokens = 0
    for task_cfg in loaded.tasks:
        if task_cfg.label not in examples:
            continue
        if tokens > MAX_TOKENS:  # the parent prepares the rest, one task at a time
            break
        collect = _Collect()
        root.addHandler(collect)
        try:
            prepared.tasks[task_cfg.label] = prepare_task(
                task_cfg, tokenizer, loaded.cfg.max_seq_len, loaded.cfg.icl_max_examples, limit,
                examples[task_cfg.label])
        finally:
            root.removeHandler(collect)
        prepared.records[task_cfg.label] = collect.records
        tokens += sum(len(row.ids) for task in prepared.tasks[task_cfg.label]
                      for ex in task.examples for row in ex.rows)
    return prepared


class Ahead:
    """The child process of :func:`start` and the connection to it."""

    def __init__(self, pid: int, conn: Connection):
        self.pid: int | None = pid
        self.conn = conn
        self.drawing = False  # the child waits to draw the chart

    def result(self) -> Prepared | None:
        """The child's :class:`Prepared` (waiting for it), or None where it failed (said at
        debug level: the parent prepares the tasks). A bad task file raises its error here, as
        :func:`read_tasks` would."""
        try:
            payload = self.conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            log.debug("tasks prepared here: the preparing process sent nothing readable (%r)", e)
            self.close()
            return None
        if payload[0] == "error":
            self.close()
            error = FoundryxError.__new__(payload[1])
            Exception.__init__(error, payload[2])
            raise error
        if payload[0] == "failed":
            log.debug("tasks prepared here: the preparing process failed (%s)", payload[1])
            self.close()
            return None
        log.debug("tasks prepared for %s by a child process while torch was imported",
                  payload[1].folder)
        self.drawing = True
        return payload[1]

    def draw(self, results: EvalResults, path: Path) -> None:
        """:func:`~foundryx.eval.report.bar_chart` of ``results`` to ``path``: by the child,
        which imported matplotlib meanwhile, where it waits for it; here otherwise. An
        OSError writing the file is raised here, as drawing here would."""
        reply: tuple[Any, ...] = ("failed", "no child waits to draw")
        if self.drawing:
            self.drawing = False
            try:
                self.conn.send((results, str(path)))
                reply = self.conn.recv()
            except (EOFError, OSError) as e:
                reply = ("failed", repr(e))
            self.close()
        if reply[0] == "ok":
            return
        if reply[0] == "oserror":
            raise OSError(reply[1], reply[2], reply[3])
        log.debug("chart drawn here: %s", reply[1])
        bar_chart(results, path)

    def close(self) -> None:
        """End the child and reap it (a no-op once done)."""
        if self.pid is None:
            return
        self.conn.close()
        try:
            os.kill(self.pid, signal.SIGKILL)  # no-op once it has exited
        except OSError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except OSError:
            pass
        self.pid, self.drawing = None, False
