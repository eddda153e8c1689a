"""Text → MDS shards of fixed-length token sequences, in parallel and resumable.

Input: anything :mod:`foundryx.data.sources` reads (.txt, folder of .txt, .jsonl, .parquet,
a Hugging Face ``save_to_disk`` folder or ``hf://owner/name``).

Each document becomes ``[bos] + tokens + [eos]``: the tokens are encoded without the
tokenizer's own special tokens; ``eos`` is appended when the tokenizer has one, and ``bos``
is prepended only when the tokenizer has one distinct from ``eos`` (so a GPT-2 style
tokenizer gives documents separated by one ``<|endoftext|>``). A tokenizer with neither is
refused. The documents' tokens are concatenated in input order and cut into sequences of
exactly ``max_seq_len`` tokens; the remainder at the very end is dropped.

Documents go to ``workers`` processes (default: one per CPU core) in batches of about ``batch_chars`` characters; the
results are written in input order, so the output is identical for any number of workers.
Batches are grouped into chunks of about ``chunk_chars`` characters; each chunk is written
as its own MDS dataset in the hidden work folder (:mod:`foundryx.data.partial`) and recorded
in a ledger when complete. Running the same conversion again after an interruption resumes
after the last complete chunk, so no data is duplicated or lost (``resume=False`` starts
over). At the end the chunk indexes are merged into one ``index.json``,
``foundryx_manifest.json`` is written last, and the folder is renamed to ``out_dir`` in one
step: ``out_dir`` is either absent, the previous dataset, or the complete new one.

Object storage: ``out_dir`` may be a URL (``s3://bucket/path``, any scheme mosaicml-streaming
writes). The work folder is then local (under the data cache root,
:func:`foundryx.data.remote.staging_folder`); each shard is uploaded by streaming's
``MDSWriter`` as soon as it is full, and deleted locally once uploaded; the manifest and,
last, ``index.json`` are uploaded when every shard is. Until then the remote is no dataset
(readers look for ``index.json``), and the same command resumes an interrupted conversion.
``overwrite`` deletes the old ``index.json`` first (S3 only), so a reader never sees old and
new shards mixed.

Partitions (:mod:`foundryx.data.partitions`): ``partition=(i, n)`` converts only the i-th of n
contiguous shares of the input's documents into ``out_dir/part-0000i-of-0000n``.

Output: an MDS dataset with one column ``tokens`` (``ndarray:int32``, length ``max_seq_len``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

from foundryx.data import partitions
from foundryx.data import remote as remotes
from foundryx.data.chunk_writer import COLUMN, INDEX, ChunkWriter, write_rows  # noqa: F401
from foundryx.data.parallel import tokenize_in_order
from foundryx.data.partial import Partial
from foundryx.data.sources import Source, open_source, read_documents  # noqa: F401 (re-export)
from foundryx.errors import DataError
from foundryx.runtime.atomic_writes import replace_all

log = logging.getLogger(__name__)

MANIFEST = "foundryx_manifest.json"
FORMAT = "foundryx-mds-tokens/1"
BATCH_CHARS = 1 << 20  # characters per batch sent to a worker
CHUNK_CHARS = 64 << 20  # characters per chunk (the unit of resuming)


def vocab_hash(tokenizer: Any) -> str:
    """A sha256 of the tokenizer's vocabulary (token → id, added tokens included)."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def is_dataset(folder: Path) -> bool:
    """Whether ``folder`` holds an MDS dataset (an ``index.json`` or a foundryx manifest)."""
    return (folder / INDEX).is_file() or (folder / MANIFEST).is_file()


def _special_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prefix, suffix) token ids around each document; see the module docstring."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None and eos is None:
        raise DataError(
            f"tokenizer {tokenizer.name_or_path!r} has neither a bos nor an eos token, so "
            f"documents could not be separated; use a tokenizer with an eos token"
        )
    prefix = [bos] if bos is not None and bos != eos else []
    return prefix, [eos] if eos is not None else []


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"output {out} exists and is not a folder; choose another --out")
    if is_dataset(out):
        if not overwrite:
            raise DataError(
                f"output {out} already holds a dataset; pass overwrite=True (--overwrite) to "
                f"replace it, or choose another --out"
            )
    elif any(out.iterdir()):
        raise DataError(
            f"output {out} exists and holds files that are not a dataset; "
            f"choose another --out or empty it"
        )


def _reason(e: OSError) -> str:
    """``No space left on device: /path/file`` (what failed, and where when known)."""
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


def _batches(source: Source, batch_chars: int, chunk_chars: int
             ) -> Iterator[tuple[tuple[int, int, int], list[str]]]:
    """``((chunk, docs, progress units), docs)`` per batch; chunks depend on the input only.

    A batch ends with the first document that brings its characters to ``batch_chars``; a
    chunk with the first batch that brings its characters to ``chunk_chars``. The documents
    come in lists (:meth:`Source.document_lists`), and each list's batch ends are found by
    bisecting its running character count, so no Python code runs per document."""
    chunk = in_chunk = 0
    by_doc = source.unit != "B"  # else bytes of UTF-8 text
    docs: list[str] = []  # the batch so far, from earlier lists
    size = 0  # its characters
    for block in source.document_lists():
        ends = list(accumulate(map(len, block), initial=size))  # ends[j]: with block[:j]
        begin, base, n = 0, 0, len(block)  # the batch takes block[begin:], base: ends[begin]
        while True:
            stop = bisect_left(ends, base + batch_chars, begin + 1)
            if stop > n:
                break
            batch = docs + block[begin:stop] if docs else block[begin:stop]
            batch_size = ends[stop] - base
            yield (chunk, len(batch), _units(batch, batch_size, by_doc)), batch
            in_chunk += batch_size
            if in_chunk >= chunk_chars:
                chunk, in_chunk = chunk + 1, 0
            docs, begin, base = [], stop, ends[stop]
        docs = docs + block[begin:] if docs else block[begin:]
        size = ends[n] - base
    if docs:
        yield (chunk, len(docs), _units(docs, size, by_doc)), docs


def _units(docs: list[str], size: int, by_doc: bool) -> int:
    """The progress units of ``docs`` (``size`` characters): documents, or bytes of UTF-8."""
    if by_doc:
        return len(docs)
    if all(map(str.isascii, docs)):  # str.isascii is a flag look-up: no scan of the text
        return size
    return sum(map(len, map(str.encode, docs)))


def _manifest(source: Source, tokenizer: Any, max_seq_len: int, compression: str | None,
              chunks: list[dict[str, Any]], vocab_sha256: str) -> dict[str, Any]:
    n_docs = sum(c["docs"] for c in chunks)
    n_tokens = sum(c["tokens"] for c in chunks)
    n_seqs = sum(c["sequences"] for c in chunks)
    if n_docs == 0:
        raise DataError(f"input {source.label} holds no documents (all empty?)")
    if n_seqs == 0:
        raise DataError(
            f"input {source.label} gives only {n_tokens} tokens, fewer than one sequence of "
            f"max_seq_len={max_seq_len}; add text or lower max_seq_len"
        )
    return {
        "format": FORMAT,
        "source": source.label,
        "tokenizer": {
            "name_or_path": tokenizer.name_or_path,
            "vocab_size": len(tokenizer),
            "vocab_sha256": vocab_sha256,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        "column": COLUMN,
        "dtype": "int32",
        "compression": compression,
        "max_seq_len": max_seq_len,
        "documents": n_docs,
        "tokens": n_seqs * max_seq_len,
        "tokens_dropped": n_tokens - n_seqs * max_seq_len,
        "sequences": n_seqs,
    }


def convert_to_mds(
    input_path: Path | str,
    out_dir: Path | str,
    tokenizer: Any,
    max_seq_len: int,
    *,
    text_field: str = "text",
    split: str | None = None,
    subset: str | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    resume: bool = True,
    progress: bool = True,
    batch_chars: int = BATCH_CHARS,
    chunk_chars: int = CHUNK_CHARS,
    partition: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Tokenize ``input_path`` into MDS sequences of ``max_seq_len`` tokens at ``out_dir``
    (a folder or a URL such as ``s3://bucket/path``); ``partition=(i, n)``: only the i-th of
    n shares of the documents, into ``out_dir/part-0000i-of-0000n``.

    Returns the manifest that was written (see the module docstring for the rules).
    """
    if max_seq_len < 1:
        raise DataError(f"max_seq_len must be a positive number of tokens, got {max_seq_len}")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1
        log.info("tokenizing with %d worker process(es), one per CPU core (set workers to "
                 "choose)", workers)
    if workers < 1:
        raise DataError(f"workers must be at least 1, got {workers}")
    if partition is not None:
        out_dir = partitions.folder_of(out_dir, *partition)
    remote = str(out_dir).rstrip("/") if remotes.is_remote(str(out_dir)) else None
    out = remotes.staging_folder(remote) if remote else Path(out_dir)
    up = None
    if remote:
        up = remotes.uploader(out.with_name(f".{out.name}.upload"), remote)
        _check_remote_out(up, remote, overwrite)
        log.info("converting into %s; work folder (ledger, indexes) %s", remote, out)
    else:
        _check_out_dir(out, overwrite)
    source = open_source(input_path, text_field, split=split, subset=subset)
    if partition is not None:
        source = partitions.share(source, *partition)
    prefix, suffix = _special_ids(tokenizer)
    vocab_sha256 = vocab_hash(tokenizer)  # a dump of the vocabulary: once
    header = {"format": FORMAT, "source": source.fingerprint, "text_field": text_field,
              "vocab_sha256": vocab_sha256, "prefix": prefix, "suffix": suffix,
              "max_seq_len": max_seq_len, "compression": compression,
              "batch_chars": batch_chars, "chunk_chars": chunk_chars}
    with Partial(out) as partial:
        done = partial.start(header, resume)
        try:
            writer = ChunkWriter(partial, max_seq_len, compression, done, remote)
            bar = _progress_bar()(desc=f"tokenizing {Path(source.label).name}",
                                    total=source.total, unit=source.unit, unit_scale=True,
                                    disable=not progress)
            start, n_tokens = time.perf_counter(), 0

            def todo() -> Iterator[tuple[tuple[int, int, int], list[str]]]:
                for tag, docs in _batches(source, batch_chars, chunk_chars):
                    if tag[0] < len(done):
                        bar.update(tag[2])  # finished before the interruption: skip
                    else:
                        yield tag, docs

            with bar:
                for (chunk, n_docs, units), tokens in tokenize_in_order(
                    todo(), tokenizer, prefix, suffix, workers
                ):
                    n_tokens += writer.add(chunk, n_docs, tokens)
                    bar.update(units)
                    bar.set_postfix(tokens_per_s=f"{n_tokens / (time.perf_counter() - start):,.0f}",
                                    refresh=False)
                writer.close_chunk()
                bar.total = bar.n  # the input's size counted blank lines and markup too
                bar.refresh()
            chunks = partial.chunks()
            manifest = _manifest(source, tokenizer, max_seq_len, compression, chunks,
                                 vocab_sha256)
            if partition is not None:
                manifest["partition"] = partitions.record(*partition)
        except DataError:
            partial.discard()  # bad input: it must change, so nothing is worth resuming
            raise
        except OSError as e:  # out of disk, no permission: resumable once that is fixed
            raise DataError(
                f"the conversion to {remote or out} stopped: {_reason(e)}; {out} is unchanged, the "
                f"finished chunks stay in {partial.folder} and the same command resumes from "
                f"them once that is fixed (--no-resume starts over)"
            ) from e
        except BaseException as e:  # interrupted, a worker died: resumable
            log.warning("conversion stopped (%s); its finished chunks stay in %s and the same "
                        "command resumes from them (--no-resume starts over)",
                        type(e).__name__, partial.folder)
            raise
        if remote:
            _finish_remote(partial, len(chunks), manifest, remote, up)
            return manifest
        try:
            partial.finish(len(chunks), {MANIFEST: json.dumps(manifest, indent=2) + "\n"})
            _check_out_dir(out, overwrite)  # another process may have written it meanwhile
            replace_all([(partial.folder, out)])  # out: the previous dataset or the new one
        except OSError as e:  # finish drops the ledger last, so a failed finish resumes
            raise DataError(f"could not finish the dataset at {out}: {_reason(e)}; {out} is "
                            f"unchanged; run the same command again once that is fixed") from e
    return manifest


def _progress_bar() -> type:
    """tqdm's bar: ``tqdm.auto``'s (a widget in a notebook) where IPython runs, else the
    terminal's ``tqdm.std`` (the same bar outside a notebook; ``tqdm.auto`` also imports
    asyncio: 40 ms more); without tqdm's monitor thread (which it starts with the first bar,
    even a disabled one, to watch for stalled bars), so that the conversion runs no thread of
    its own and can fork its workers (:func:`foundryx.data.parallel.start_method`)."""
    if "IPython" in sys.modules:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return type(tqdm.__name__, (tqdm,), {"monitor_interval": 0})


def _check_remote_out(up: Any, remote: str, overwrite: bool) -> None:
    """The bucket exists (checked by the uploader) and holds no dataset at ``remote``, or
    ``overwrite``: its old index is deleted first, so no reader sees old and new mixed."""
    if INDEX not in remotes.list_keys(up, remote, INDEX):
        return
    if not overwrite:
        raise DataError(f"output {remote} already holds a dataset ({INDEX}); pass --overwrite "
                        f"to replace it, or choose another --out")
    log.info("--overwrite: deleting %s first (the new one is uploaded last)",
             remotes.join(remote, INDEX))
    remotes.delete(remote, INDEX)


def _finish_remote(partial: Partial, n_chunks: int, manifest: dict[str, Any], remote: str,
                   up: Any) -> None:
    """Upload the manifest, then ``index.json`` (last: it makes the remote a dataset), then
    drop the local work folder (its ledger stays until the upload is done, so a failed upload
    resumes)."""
    import shutil

    partial.merge_index(n_chunks)
    (partial.folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for name in (MANIFEST, INDEX):
        shutil.copyfile(partial.folder / name, Path(up.local) / name)
    remotes.upload(up, [MANIFEST, INDEX], remote)
    partial.discard()
    shutil.rmtree(up.local, ignore_errors=True)


def read_manifest(folder: Path | str) -> dict[str, Any] | None:
    """The foundryx manifest of a dataset folder, or None when it has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({e}); re-run the conversion") from None
