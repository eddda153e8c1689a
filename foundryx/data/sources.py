"""Input readers: text documents for conversion, example records for fine-tuning.

An input is named by a string:

* a ``.txt`` file: documents are separated by blank lines (each block of non-blank lines is
  one document, its lines joined by ``\\n``);
* a ``.jsonl`` file: one JSON object per line, the document in a text field;
* a ``.parquet`` file, or a folder of ``*.parquet`` files (sorted by path): a text column;
* a Hugging Face dataset saved with ``save_to_disk`` (a folder with ``state.json``, or with
  ``dataset_dict.json`` and then a ``split``): a text column;
* a Hugging Face hub dataset ``hf://owner/name`` (with ``split`` and optionally ``subset``);
  offline (``HF_HUB_OFFLINE=1``) only what is in the local cache loads;
* any other folder: every ``*.txt`` file below it (sorted by path) is one document;
* an MDS folder (``index.json``): records for fine-tuning only.

Errors name the file and line (or row index) and what is wrong.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any

from foundryx.errors import DataError

HUB_PREFIX = "hf://"
_KINDS = "a .txt, .jsonl or .parquet file, a folder, a save_to_disk folder or hf://owner/name"


@dataclass
class Source:
    """Where documents come from, and how far along a read is (for progress bars)."""

    label: str
    kind: str  # txt, folder, jsonl, parquet, hf
    documents: Callable[[], Iterator[str]]
    total: int | None = None  # progress total, in ``unit``
    unit: str = "B"  # "B": bytes of text; "docs": rows
    fingerprint: dict[str, Any] = field(default_factory=dict)  # identity, for resuming
    # the same documents in lists (a .txt file: those of each read), for readers of many
    # documents at a time; None: ``documents`` in lists of GROUP. A copy of a Source given
    # other ``documents`` (dataclasses.replace) must give these too, or None.
    blocks: Callable[[], Iterator[list[str]]] | None = None

    def document_lists(self) -> Iterator[list[str]]:
        """The documents in order, in lists (the concatenation of the lists is
        ``documents()``)."""
        if self.blocks is not None:
            return self.blocks()
        docs = self.documents()
        return iter(lambda: list(islice(docs, GROUP)), [])


GROUP = 4096  # documents a list, for a Source without blocks


def slice_lists(lists: Iterator[list[str]], start: int, stop: int) -> Iterator[list[str]]:
    """The documents ``[start, stop)`` of the concatenation of ``lists``, in lists."""
    seen = 0  # documents before the current list
    for docs in lists:
        n = len(docs)
        if seen + n > start:
            part = docs[max(start - seen, 0):stop - seen]
            if part:
                yield part
        seen += n
        if seen >= stop:
            return


def _files_fingerprint(files: list[Path]) -> dict[str, Any]:
    return {"files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


NOT_UTF8_FIX = "convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8 IN > OUT)"


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, newlines (``\n`` or ``\r\n``) removed;
    a DataError naming the file, line and byte offset where it is not UTF-8."""
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 at byte {offset + e.start} (line {lineno}: "
                                f"{e.reason}); {NOT_UTF8_FIX}") from None
            offset += len(raw)
            yield lineno, line


def read_utf8(path: Path) -> str:
    """The whole text of ``path``; a DataError naming the byte offset where it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 at byte {e.start} ({e.reason}); {NOT_UTF8_FIX}") from None


# one or more blank lines (nothing but whitespace: \s is str.isspace, as str.strip uses) at a
# line start: what separates the documents of a .txt file
_BLANK_LINES = re.compile(r"^(?:[^\S\n]*\n)+", re.MULTILINE)
# the same separator with the line end before it: a search for it looks at the line ends only
# (its literal first character), not at every character as a search for ``^`` does (4x faster)
_END_AND_BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")
_LEADING_BLANK_LINES = re.compile(r"(?:[^\S\n]*\n)+")
# the \r's at a line's end, which reading line by line removes (``rstrip("\r\n")``)
_CR_LINE_ENDS = re.compile(r"\r+\n")
_READ_BYTES = 1 << 22


def _txt_documents(path: Path) -> Iterator[str]:
    """The blocks of non-blank lines of ``path``, each line's ``\r\n`` (or ``\n``) end
    removed, joined by ``\n``: the rule of reading line by line (:func:`utf8_lines`)."""
    return chain.from_iterable(_txt_blocks(path))


def _txt_blocks(path: Path) -> Iterator[list[str]]:
    """The documents of :func:`_txt_documents`, a list per read of a few MB (decoded at once,
    split at blank lines by one regular expression)."""
    for text in _complete_lines(path):  # whole lines, each ending in \n
        if "\r" in text:  # each line's \r\n (or \r\r\n ...) end: \n (blank lines stay blank)
            text = text.replace("\r\n", "\n")  # 5x faster than the expression, which is
            if "\r\n" in text:  # needed only where a line ends in more than one \r
                text = _CR_LINE_ENDS.sub("\n", text)
        docs = _split_documents(text)
        if docs:
            yield docs


def _split_documents(text: str) -> list[str]:
    """The runs of non-blank lines of ``text`` (whole lines, each ending in ``\n``), each
    without its last ``\n``. Between two separators there is always a non-blank line (the
    separator takes every blank line after a line end), so only the ends can be empty."""
    lead = _LEADING_BLANK_LINES.match(text)
    docs = _END_AND_BLANK_LINES.split(text[lead.end():] if lead else text)
    last = docs.pop()  # ends in \n, or empty when the text ends in blank lines
    if last:
        docs.append(last[:-1])
    return docs


def _complete_lines(path: Path) -> Iterator[str]:
    """The text of ``path`` in pieces that each hold whole documents: the text up to the last
    blank line of what has been read so far (a document spanning reads waits for its end), the
    rest at the end of the file, with a final newline added; a DataError naming the file, line
    and byte where it is not UTF-8 (the same as :func:`utf8_lines`)."""
    offset = 0  # bytes before ``data``
    rest = b""  # an incomplete last line, read again with the next block
    # whole lines after the last blank line: an unfinished document, kept as the list of its
    # reads (joined once it ends), so a document of any length costs linear time. It holds no
    # blank line, so only each new read is searched for one.
    carry: list[str] = []
    with path.open("rb") as f:
        while True:
            block = f.read(_READ_BYTES)
            data = rest + block
            end = data.rfind(b"\n") + 1 if block else len(data)
            if not end and block:
                rest = data
                continue
            data, rest = data[:end], data[end:]
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                at = offset + e.start
                raise DataError(f"{path}: not UTF-8 at byte {at} (line {_line_at(path, at)}: "
                                f"{e.reason}); {NOT_UTF8_FIX}") from None
            offset += len(data)
            if not block:
                yield "".join(carry) + text + ("\n" if text and not text.endswith("\n") else "")
                return
            last = _last_blank_end(text)
            if last:
                yield "".join(carry) + text[:last]
                carry = [text[last:]]
            else:
                carry.append(text)


def _line_at(path: Path, byte: int) -> int:
    """The number of the line of ``path`` that holds byte ``byte`` (counted only for an error
    message, so reading does not count lines)."""
    lines = 0
    with path.open("rb") as f:
        while byte > 0:
            block = f.read(min(byte, _READ_BYTES))
            if not block:
                break
            lines += block.count(b"\n")
            byte -= len(block)
    return lines + 1


def _last_blank_end(text: str) -> int:
    """Where the last run of blank lines of ``text`` (whole lines) ends; 0 if it has none."""
    end = 0  # an empty line ("\n\n") is the usual separator: start near the last one
    for m in _BLANK_LINES.finditer(text, max(0, text.rfind("\n\n") - 4096)):
        end = m.end()
    return end


def _folder_documents(files: list[Path]) -> Iterator[str]:
    for file in files:
        text = read_utf8(file).strip()
        if text:
            yield text


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(location, parsed row)`` of each non-blank line."""
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def text_of(row: Any, text_field: str, where: str) -> str:
    """``row[text_field]`` as a string, or a DataError naming ``where``."""
    if not isinstance(row, dict) or text_field not in row:
        keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
        raise DataError(
            f"{where}: no field {text_field!r} (found: {keys}); "
            f"set the text field (--text-field) to the field holding the text"
        )
    value = row[text_field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is a {type(value).__name__}, expected a string")
    return value


def _texts(rows: Iterator[tuple[str, Any]], text_field: str) -> Iterator[str]:
    """The non-blank ``text_field`` of each ``(location, row)``."""
    for where, row in rows:
        text = text_of(row, text_field, where)
        if text.strip():
            yield text


def _parquet_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.rglob("*.parquet"))


def _parquet_rows(files: list[Path], columns: list[str] | None) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file in files:
        try:
            pf = pq.ParquetFile(file)
            names = pf.schema_arrow.names
            missing = [c for c in columns or [] if c not in names]
            if missing:
                raise DataError(
                    f"{file}: no column {missing[0]!r} (columns: {', '.join(names)}); set the text "
                    f"field (--text-field) to the column holding the text"
                )
            row = 0
            for batch in pf.iter_batches(columns=columns, batch_size=4096):
                for record in batch.to_pylist():
                    yield f"{file}[row {row}]", record
                    row += 1
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: unreadable parquet ({e}); re-export the file") from None


def is_hf_folder(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def load_hf_dataset(name: str, split: str | None = None, subset: str | None = None):
    """A ``datasets.Dataset`` from a save_to_disk folder or ``hf://owner/name``."""
    import datasets

    if name.startswith(HUB_PREFIX):
        hub = name[len(HUB_PREFIX):]
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        try:
            ds = datasets.load_dataset(hub, subset, split=split or "train")
        except Exception as e:  # noqa: BLE001 - network, cache and name errors all mean "unreachable"
            why = "offline (HF_HUB_OFFLINE=1) and not in the local cache" if offline else \
                "no such dataset, no network, or not in the local cache"
            raise DataError(
                f"could not load Hugging Face dataset {hub!r} ({why}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); download it where there is network "
                f"and save it with dataset.save_to_disk(folder), then give that folder"
            ) from None
        return ds
    path = Path(name)
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as e:
        raise DataError(f"{path}: unreadable Hugging Face dataset folder ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(
                f"{path} holds the splits {', '.join(ds)}; choose one with split (--split)"
                + (f" ({split!r} is not one of them)" if split else "")
            )
        ds = ds[split]
    return ds


def _hf_rows(ds: Any, label: str, columns: list[str] | None) -> Iterator[tuple[str, dict]]:
    missing = [c for c in columns or [] if c not in ds.column_names]
    if missing:
        raise DataError(
            f"{label}: no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); set the "
            f"text field (--text-field) to the column holding the text"
        )
    view = ds.select_columns(columns) if columns else ds
    for i, row in enumerate(view):
        yield f"{label}[{i}]", row


def open_source(input_path: Path | str, text_field: str = "text", *, split: str | None = None,
                subset: str | None = None) -> Source:
    """The :class:`Source` of documents named by ``input_path`` (see the module docstring)."""
    name = str(input_path)
    if name.startswith(HUB_PREFIX):
        ds = load_hf_dataset(name, split, subset)
        return Source(name, "hf", lambda: _texts(_hf_rows(ds, name, [text_field]), text_field),
                      len(ds), "docs", {"hub": name, "split": split, "subset": subset})
    path = Path(input_path)
    if not path.exists():
        raise DataError(f"input {path} does not exist; give {_KINDS}")
    if path.is_dir() and is_hf_folder(path):
        ds = load_hf_dataset(name, split)
        arrow = _files_fingerprint(sorted(path.rglob("*.arrow")))
        return Source(name, "hf", lambda: _texts(_hf_rows(ds, name, [text_field]), text_field),
                      len(ds), "docs", {**arrow, "split": split})
    if path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet"))):
        files = _parquet_files(path)
        return Source(name, "parquet", lambda: _texts(_parquet_rows(files, [text_field]), text_field),
                      sum(f.stat().st_size for f in files), "B", _files_fingerprint(files))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"input folder {path} has no .txt files; give one .txt file per document")
        return Source(name, "folder", lambda: _folder_documents(files),
                      sum(f.stat().st_size for f in files), "B", _files_fingerprint(files))
    if path.suffix == ".txt":
        return Source(name, "txt", lambda: _txt_documents(path), path.stat().st_size, "B",
                      _files_fingerprint([path]), blocks=lambda: _txt_blocks(path))
    if path.suffix == ".jsonl":
        return Source(name, "jsonl", lambda: _texts(_jsonl_rows(path), text_field),
                      path.stat().st_size, "B", _files_fingerprint([path]))
    raise DataError(f"input {path}: unsupported file type {path.suffix!r}; give {_KINDS}")


def read_documents(input_path: Path | str, text_field: str = "text", **kw: Any) -> Iterator[str]:
    """The non-empty documents of an input (see the module docstring)."""
    return open_source(input_path, text_field, **kw).documents()


def _mds_rows(path: Path) -> Iterator[tuple[str, dict]]:
    from streaming import LocalDataset

    try:
        ds = LocalDataset(str(path))
        for i in range(len(ds)):
            yield f"{path}[{i}]", ds[i]
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable MDS dataset ({type(e).__name__}: {e}); "
                        f"re-write it") from None


def read_records(input_path: Path | str, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """``(location, record)`` of every example of a .jsonl or .parquet file, a save_to_disk
    folder, ``hf://owner/name`` or an MDS folder; locations name file and line or index."""
    name = str(input_path)
    if name.startswith(HUB_PREFIX):
        return _hf_rows(load_hf_dataset(name, split), name, None)
    path = Path(input_path)
    if not path.exists():
        raise DataError(f"input {path} does not exist; give a .jsonl or .parquet file, a "
                        f"save_to_disk folder, an MDS folder or hf://owner/name")
    if path.is_dir() and is_hf_folder(path):
        return _hf_rows(load_hf_dataset(str(path), split), str(path), None)
    if path.is_dir() and (path / "index.json").is_file():
        return _mds_rows(path)
    if path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet"))):
        return _parquet_rows(_parquet_files(path), None)
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    raise DataError(f"input {path}: unsupported for fine-tuning examples; give a .jsonl or "
                    f".parquet file, a save_to_disk folder, an MDS folder or hf://owner/name")
