"""Text → MDS shards of fixed-length token sequences.

Input (``input_path``):

* a ``.txt`` file: documents are separated by blank lines (each block of non-blank lines is
  one document, its lines joined by ``\\n``);
* a folder: every ``*.txt`` file below it (sorted by path) is one document;
* a ``.jsonl`` file: one JSON object per line, the document in field ``text_field``.

Each document becomes ``[bos] + tokens + [eos]``: the tokens are encoded without the
tokenizer's own special tokens; ``eos`` is appended when the tokenizer has one, and ``bos``
is prepended only when the tokenizer has one distinct from ``eos`` (so a GPT-2 style
tokenizer gives documents separated by one ``<|endoftext|>``). A tokenizer with neither is
refused. The stream is cut into sequences of exactly ``max_seq_len`` tokens; the remainder
is dropped.

Output: an MDS dataset with one column ``tokens`` (``ndarray:int32``, length ``max_seq_len``)
and ``foundryx_manifest.json``, written last. Everything is written to a hidden sibling folder
that is renamed into place at the end, so an interrupted conversion leaves no ``out_dir``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from foundryx.errors import DataError

MANIFEST = "foundryx_manifest.json"
INDEX = "index.json"
COLUMN = "tokens"
BATCH_DOCS = 256  # documents per batch call of the tokenizer


def vocab_hash(tokenizer: Any) -> str:
    """A sha256 of the tokenizer's vocabulary (token → id, added tokens included)."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def is_dataset(folder: Path) -> bool:
    """Whether ``folder`` holds an MDS dataset (an ``index.json`` or a foundryx manifest)."""
    return (folder / INDEX).is_file() or (folder / MANIFEST).is_file()


def _txt_documents(path: Path) -> Iterator[str]:
    block: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def _folder_documents(path: Path) -> Iterator[str]:
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"input folder {path} has no .txt files; give one .txt file per document")
    for file in files:
        text = file.read_text(encoding="utf-8").strip()
        if text:
            yield text


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or field not in row:
                keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
                raise DataError(
                    f"{path}:{lineno}: no field {field!r} (found: {keys}); "
                    f"set the text field (--text-field) to the field holding the text"
                )
            if not isinstance(row[field], str):
                raise DataError(
                    f"{path}:{lineno}: field {field!r} is a {type(row[field]).__name__}, "
                    f"expected a string"
                )
            if row[field].strip():
                yield row[field]


def read_documents(input_path: Path | str, text_field: str = "text") -> Iterator[str]:
    """The non-empty documents of a .txt file, a folder of .txt files or a .jsonl file."""
    path = Path(input_path)
    if not path.exists():
        raise DataError(f"input {path} does not exist; give a .txt file, a folder or a .jsonl file")
    if path.is_dir():
        return _folder_documents(path)
    if path.suffix == ".txt":
        return _txt_documents(path)
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, text_field)
    raise DataError(f"input {path}: unsupported file type {path.suffix!r}; use .txt or .jsonl")


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


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


def _commit(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out``, replacing what is there."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def convert_to_mds(
    input_path: Path | str,
    out_dir: Path | str,
    tokenizer: Any,
    max_seq_len: int,
    *,
    text_field: str = "text",
    compression: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``input_path`` into MDS sequences of ``max_seq_len`` tokens at ``out_dir``.

    Returns the manifest that was written (see the module docstring for the rules).
    """
    from streaming import MDSWriter
    from tqdm.auto import tqdm

    if max_seq_len < 1:
        raise DataError(f"max_seq_len must be a positive number of tokens, got {max_seq_len}")
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    docs = read_documents(input_path, text_field)
    prefix, suffix = _special_ids(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    n_docs = n_tokens = n_seqs = 0
    try:
        bar = tqdm(desc=f"tokenizing {Path(input_path).name}", unit=" docs", disable=not progress)
        start = time.perf_counter()
        buffer: list[int] = []
        with bar, MDSWriter(out=str(tmp), columns={COLUMN: "ndarray:int32"},
                            compression=compression) as writer:
            for batch in _batches(docs, BATCH_DOCS):
                encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
                for ids in encoded:
                    buffer += prefix + ids + suffix
                    n_tokens += len(prefix) + len(ids) + len(suffix)
                n_full = len(buffer) // max_seq_len * max_seq_len
                if n_full:
                    seqs = np.asarray(buffer[:n_full], dtype=np.int32).reshape(-1, max_seq_len)
                    for seq in seqs:
                        writer.write({COLUMN: seq})
                    n_seqs += len(seqs)
                    buffer = buffer[n_full:]
                n_docs += len(batch)
                bar.update(len(batch))
                bar.set_postfix(tokens_per_s=f"{n_tokens / (time.perf_counter() - start):,.0f}",
                                refresh=False)
        if n_docs == 0:
            raise DataError(f"input {input_path} holds no documents (all empty?)")
        if n_seqs == 0:
            raise DataError(
                f"input {input_path} gives only {n_tokens} tokens, fewer than one sequence of "
                f"max_seq_len={max_seq_len}; add text or lower max_seq_len"
            )
        manifest = {
            "format": "foundryx-mds-tokens/1",
            "source": str(input_path),
            "tokenizer": {
                "name_or_path": tokenizer.name_or_path,
                "vocab_size": len(tokenizer),
                "vocab_sha256": vocab_hash(tokenizer),
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
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _check_out_dir(out, overwrite)  # another process may have written it meanwhile
        _commit(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return manifest


def read_manifest(folder: Path | str) -> dict[str, Any] | None:
    """The foundryx manifest of a dataset folder, or None when it has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable manifest ({e}); re-run the conversion") from None

