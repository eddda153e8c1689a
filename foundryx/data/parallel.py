"""Tokenize batches of documents in worker processes, results in input order.

Each worker (and the main process when ``workers == 1``) tokenizes with one thread
(``TOKENIZERS_PARALLELISM=false``), so ``workers`` is the number of cores used and the output
does not depend on it: batches come back in the order they went in.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import types
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import accumulate, chain, repeat
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from foundryx.data.forked_workers import ForkedWorkers, worker_died

log = logging.getLogger(__name__)

_PARALLELISM = "TOKENIZERS_PARALLELISM"
_state: dict[str, Any] = {}  # this process's tokenizer, prefix and suffix


def _init(tokenizer: Any, prefix: list[int], suffix: list[int]) -> None:
    _state.update(tokenizer=tokenizer, prefix=prefix, suffix=suffix)


def _init_worker(tokenizer: Any, prefix: list[int], suffix: list[int]) -> None:
    """A worker's start: ``tokenizer`` is the tokenizer, or the path of a Rust tokenizer's JSON
    (see :func:`_shipped`)."""
    os.environ[_PARALLELISM] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the pool
    if sys.platform == "linux":  # exit with the parent, even when it is killed (kill -9)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    _init(_loaded(tokenizer), prefix, suffix)


def _loaded(tokenizer: Any) -> Any:
    """The tokenizer a worker was sent: loaded from its JSON's path, else as it is."""
    if not isinstance(tokenizer, Path):
        return tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer))


@contextlib.contextmanager
def _shipped(tokenizer: Any) -> Iterator[Any]:
    """What the workers' start sends of ``tokenizer``: a Rust tokenizer as the path of its JSON
    in a temporary file (removed after), anything else as it is. A spawned worker's start
    arguments go down a pipe that the parent writes before the next worker is started; a
    tokenizer's JSON is larger than the pipe (100 KB for a 4,096-token BPE, ~9 MB for Llama 3's),
    so each write waited for that worker's Python to start and read it: the workers started one
    after another (0.17 s each measured here, 2 workers), not together."""
    if not hasattr(tokenizer, "to_str"):
        yield tokenizer
        return
    fd, name = tempfile.mkstemp(prefix="foundryx-tokenizer-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer.to_str())
        yield Path(name)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def encoder(tokenizer: Any) -> Any:
    """What tokenizes in the workers: a fast tokenizer's Rust backend (quick to send to a
    spawned worker, which then needs no transformers import), without truncation or padding,
    as a Hugging Face call with ``add_special_tokens=False`` uses it; else ``tokenizer``. The
    backend itself when it truncates and pads nothing (a copy parses the tokenizer's JSON
    again: the longer the larger the vocabulary), else a copy with both turned off."""
    if not getattr(tokenizer, "is_fast", False):
        return tokenizer
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        return backend
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


SLICE_CHARS = 1 << 15  # characters of text a tokenizer call takes in a worker


def tokenize_batch(docs: list[str]) -> np.ndarray:
    """The token stream of ``docs``: ``prefix + ids + suffix`` per document, as int32.

    The documents go to the tokenizer a slice of about ``SLICE_CHARS`` characters at a time:
    one call over a whole batch (1 MiB of text, ~7,000 paragraphs of tinyshakespeare) holds
    all its Encodings and id lists at once, and tokenized 5-9% slower than slices of a few
    hundred paragraphs (benchmarks/RESULTS.md, issue 55). The stream is the same."""
    parts = [_tokenized(docs[i:j]) for i, j in pieces(docs, round(_chars(docs) / SLICE_CHARS))]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _chars(docs: list[str]) -> int:
    return sum(map(len, docs))


def pieces(docs: list[str], n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of at most ``n`` consecutive runs of ``docs`` (at least one, each at
    least one document), cut where the running character count passes each ``k/n`` of the
    whole."""
    n = max(1, min(n, len(docs)))
    total = _chars(docs) if n > 1 else 0  # a whole batch (n = 1): no count of its characters
    if not total:
        return [(0, len(docs))]
    ends = list(accumulate(map(len, docs)))
    cuts = [0]
    for k in range(1, n):
        cut = bisect_left(ends, total * k / n) + 1  # the document that passes k/n ends a run
        if cuts[-1] < cut < len(docs):
            cuts.append(cut)
    return list(zip(cuts, cuts[1:] + [len(docs)]))


def _tokenized(docs: list[str]) -> np.ndarray:
    tok, prefix, suffix = _state["tokenizer"], _state["prefix"], _state["suffix"]
    if hasattr(tok, "encode_batch"):  # a tokenizers.Tokenizer
        # encode_batch_fast: the same ids without the character offsets (tokenizers >= 0.20)
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        encodings = encode(docs, add_special_tokens=False)
        n_ids = sum(map(len, encodings))  # an Encoding's length: its number of ids
        ids: Iterable[list[int]] = map(attrgetter("ids"), encodings)  # one list at a time
    else:
        ids = tok(docs, add_special_tokens=False, verbose=False)["input_ids"]
        n_ids = sum(map(len, ids))
    # the ids, each document's between prefix and suffix, straight into the int32 array (one
    # pass in C; a list of them all first, then np.array, is a third slower)
    parts = [repeat(prefix)] if prefix else []
    parts += [ids] + ([repeat(suffix)] if suffix else [])
    count = n_ids + len(docs) * (len(prefix) + len(suffix))
    stream = chain.from_iterable(chain.from_iterable(zip(*parts)))
    return np.fromiter(stream, dtype=np.int32, count=count)


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    old = os.environ.get(_PARALLELISM)
    os.environ[_PARALLELISM] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_PARALLELISM, None)
        else:
            os.environ[_PARALLELISM] = old


@contextlib.contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """The objects alive before the loop left out of the cyclic garbage collector while it
    runs (``gc.freeze``; ``gc.unfreeze`` after). A conversion in the command's own process
    (``workers: 1``) tokenizes beside torch, transformers and streaming's modules, and every
    full collection that the ids' lists trigger walked them all: 2.5 of 25 CPU s on 40 copies
    of tinyshakespeare (2 alternating pairs). Objects made during the loop are collected as
    usual. A process that froze objects itself keeps its own arrangement (nothing is done)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _bare_main() -> Iterator[None]:
    """Workers started meanwhile do not import the parent's ``__main__`` (a spawned process
    imports it again by default: for ``foundryx data convert`` the whole command line, a
    second or more of imports per worker). They need only this module and the tokenizer's."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def tokenize_in_order(
    batches: Iterable[tuple[Any, list[str]]],
    tokenizer: Any,
    prefix: list[int],
    suffix: list[int],
    workers: int = 1,
) -> Iterator[tuple[Any, np.ndarray]]:
    """``(tag, token stream)`` for each ``(tag, docs)`` of ``batches``, in order.

    With ``workers > 1`` at most ``2 * workers`` batches are in flight, so memory stays
    bounded however large the input.
    """
    tokenizer = encoder(tokenizer)
    batches = iter(batches)
    first = list(itertools.islice(batches, 2))
    batches = itertools.chain(first, batches)
    if workers <= 1 or len(first) < 2:  # one batch: a pool would be pure overhead
        _init(tokenizer, prefix, suffix)
        with _single_threaded(), _older_objects_frozen():
            for tag, docs in batches:
                yield tag, tokenize_batch(docs)
        return
    method = start_method()
    log.debug("tokenizing in %d %s worker processes", workers, method)
    if method == "fork":  # the workers start with the tokenizer in their memory; batches
        # and streams go through shared memory (foundryx/data/forked_workers.py), not the
        # pool's pipes and threads
        with _single_threaded():  # the tokenizer's thread pool off in the children
            pool = ForkedWorkers(workers, _init_worker, (tokenizer, prefix, suffix))
        yield from _in_order(pool, batches, workers)
        return
    with _shipped(tokenizer) as shipped:
        with _bare_main():
            pool = mp.get_context("spawn").Pool(
                workers, initializer=_init_worker, initargs=(shipped, prefix, suffix))
        yield from _in_order(_Watched(pool), batches, workers)


def start_method() -> str:
    """How the workers start: ``fork`` on Linux in a process that runs no other Python thread
    and has not imported torch, else ``spawn``.

    A forked worker starts at once with the parent's tokenizer; a spawned one starts a Python,
    imports numpy and tokenizers and loads the tokenizer: ~0.3 s before the first batch on 2
    cores, with both cores busy (benchmarks/RESULTS.md, issue 55). Forking copies only the
    calling thread: a lock another thread held at that moment stays held in the child, so a
    process with other Python threads (a notebook's, a trainer's, an upload pool's) or with
    torch (its thread pools, CUDA) spawns. The native threads left are numpy's BLAS pool
    (which stops itself around a fork) and the tokenizer's Rust pool, which the workers never
    use (one thread each, ``TOKENIZERS_PARALLELISM=false``)."""
    if sys.platform == "linux" and threading.active_count() == 1 and "torch" not in sys.modules:
        return "fork"
    return "spawn"


WATCH_S = 1.0  # how often a wait for a pool's result looks for a dead worker


class _Watched:
    """A ``multiprocessing.Pool`` whose results' ``get`` raises a RunError once one of the
    workers it started has ended: the pool replaces such a worker, loses its task and would
    wait for that result for ever (a worker killed by the out-of-memory killer)."""

    def __init__(self, pool: Any):
        self.pool, self.workers = pool, list(pool._pool)  # the processes it started

    def apply_async(self, fn: Any, args: tuple) -> Any:
        return _WatchedResult(self.pool.apply_async(fn, args), self.workers)

    def close(self) -> None:
        self.pool.close()

    def terminate(self) -> None:
        self.pool.terminate()

    def join(self) -> None:
        self.pool.join()


class _WatchedResult:
    def __init__(self, result: Any, workers: list[Any]):
        self.result, self.workers = result, workers

    def get(self) -> Any:
        while True:
            try:
                return self.result.get(timeout=WATCH_S)
            except mp.TimeoutError:
                for proc in self.workers:
                    if proc.exitcode is not None:
                        raise worker_died(proc.pid, proc.exitcode) from None


def _in_order(pool: Any, batches: Iterable[tuple[Any, list[str]]], workers: int
              ) -> Iterator[tuple[Any, np.ndarray]]:
    """The token streams of ``batches`` in order from ``pool`` (a watched
    ``multiprocessing.Pool`` or :class:`ForkedWorkers`), at most ``2 * workers`` batches in
    flight; the pool closed and joined after, or terminated if the loop stops early.

    The last ``workers`` batches go out in ``2 * workers`` pieces each (their streams joined
    again here): whole, the worker that took the last batch ran on alone for up to a batch's
    time (0.1-0.5 s measured, 2 workers) while the other had finished."""
    try:
        pending: deque = deque()  # (tag, the pieces' results)
        held: deque = deque()  # batches read but not sent: the last ones go in pieces
        for batch in batches:
            held.append(batch)
            if len(held) > workers:
                yield from _sent(pool, pending, held.popleft(), 1, 2 * workers)
        for batch in held:
            yield from _sent(pool, pending, batch, 2 * workers, 2 * workers)
        while pending:
            yield _received(pending.popleft())
    except BaseException:  # an error, Ctrl-C, the consumer stopped: the workers are stopped
        pool.terminate()
        pool.join()
        raise
    # done: the workers exit once told (a pool's terminate after its close could wait for ever
    # in _help_stuff_finish for its queue's lock, held by a worker waiting for its last message)
    pool.close()
    pool.join()


def _sent(pool: Any, pending: deque, batch: tuple[Any, list[str]], n: int, in_flight: int
          ) -> Iterator[tuple[Any, np.ndarray]]:
    """Send ``batch`` to the pool in ``n`` pieces; yield the oldest batches' streams while
    ``in_flight`` batches or more are pending."""
    tag, docs = batch
    pending.append((tag, [pool.apply_async(tokenize_batch, (docs[i:j],))
                          for i, j in pieces(docs, n)]))
    while len(pending) >= in_flight:
        yield _received(pending.popleft())


def _received(item: tuple[Any, list[Any]]) -> tuple[Any, np.ndarray]:
    tag, results = item
    streams = [r.get() for r in results]
    return tag, streams[0] if len(streams) == 1 else np.concatenate(streams)
