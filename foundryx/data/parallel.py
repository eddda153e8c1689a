"""Tokenize batches of documents in worker processes, results in input order.

Each worker (and the main process when ``workers == 1``) tokenizes with one thread
(``TOKENIZERS_PARALLELISM=false``), so ``workers`` is the number of cores used and the output
does not depend on it: batches come back in the order they went in.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import sys
import types
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_PARALLELISM = "TOKENIZERS_PARALLELISM"
_state: dict[str, Any] = {}  # this process's tokenizer, prefix and suffix
ENCODE_DOCS = 1000  # documents a call to a tokenizers.Tokenizer (tokenize_batch)
PIECES = 4  # jobs a batch, with worker processes (tokenize_in_order)


def _init(tokenizer: Any, prefix: list[int], suffix: list[int]) -> None:
    _state.update(tokenizer=tokenizer, prefix=prefix, suffix=suffix)


def _init_worker(tokenizer: Any, prefix: list[int], suffix: list[int]) -> None:
    os.environ[_PARALLELISM] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the pool
    if sys.platform == "linux":  # exit with the parent, even when it is killed (kill -9)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    _init(tokenizer, prefix, suffix)


def encoder(tokenizer: Any) -> Any:
    """What tokenizes in the workers: a fast tokenizer's Rust backend (quick to send to a
    spawned worker, which then needs no transformers import), without truncation or padding,
    as a Hugging Face call with ``add_special_tokens=False`` uses it; else ``tokenizer``."""
    if not getattr(tokenizer, "is_fast", False):
        return tokenizer
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def tokenize_batch(docs: list[str]) -> np.ndarray:
    """The token stream of ``docs``: ``prefix + ids + suffix`` per document, as int32.

    A ``tokenizers.Tokenizer`` encodes ``ENCODE_DOCS`` documents a call: a batch of 1 MB holds
    ~16,000 short documents, and encoding them in one call cost ~5% more CPU than in calls of
    1,000 (their encodings no longer fit the caches before they are read back)."""
    tok, prefix, suffix = _state["tokenizer"], _state["prefix"], _state["suffix"]
    out: list[int] = []
    if hasattr(tok, "encode_batch"):  # a tokenizers.Tokenizer
        # encode_batch_fast: the same ids without the character offsets (tokenizers >= 0.20)
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        for i in range(0, len(docs), ENCODE_DOCS):
            _extend(out, (e.ids for e in encode(docs[i:i + ENCODE_DOCS],
                                                add_special_tokens=False)), prefix, suffix)
    else:
        _extend(out, tok(docs, add_special_tokens=False, verbose=False)["input_ids"], prefix,
                suffix)
    return np.array(out, dtype=np.int32)


def _extend(out: list[int], encoded: Iterable[list[int]], prefix: list[int],
            suffix: list[int]) -> None:
    for ids in encoded:
        if prefix:
            out += prefix
        out += ids
        if suffix:
            out += suffix


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


def _joined(item: tuple[Any, list[Any]]) -> tuple[Any, np.ndarray]:
    tag, parts = item
    arrays = [part.get() for part in parts]
    return tag, arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def tokenize_in_order(
    batches: Iterable[tuple[Any, list[str]]],
    tokenizer: Any,
    prefix: list[int],
    suffix: list[int],
    workers: int = 1,
) -> Iterator[tuple[Any, np.ndarray]]:
    """``(tag, token stream)`` for each ``(tag, docs)`` of ``batches``, in order.

    With ``workers > 1`` at most ``2 * workers`` batches are in flight, so memory stays
    bounded however large the input; each goes to the workers as ``PIECES`` jobs, so the
    last batch keeps every worker busy (whole, it left all workers but one idle at the end).
    """
    tokenizer = encoder(tokenizer)
    batches = iter(batches)
    first = list(itertools.islice(batches, 2))
    batches = itertools.chain(first, batches)
    if workers <= 1 or len(first) < 2:  # one batch: a pool would be pure overhead
        _init(tokenizer, prefix, suffix)
        with _single_threaded():
            for tag, docs in batches:
                yield tag, tokenize_batch(docs)
        return
    # spawn, not fork: forking a process that runs threads (torch, tokenizers, loggers) can
    # copy a held lock into the child and hang the pool.
    ctx = mp.get_context("spawn")
    with _bare_main():
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer, prefix, suffix))
    try:
        pending: deque = deque()
        for tag, docs in batches:
            step = max(1, -(-len(docs) // PIECES))  # PIECES jobs: even the last batch splits
            pending.append((tag, [pool.apply_async(tokenize_batch, (docs[i:i + step],))
                                  for i in range(0, len(docs), step)]))
            if len(pending) >= 2 * workers:
                yield _joined(pending.popleft())
        while pending:
            yield _joined(pending.popleft())
        pool.close()
    finally:
        pool.terminate()
        pool.join()
