"""The hidden, resumable work folder of a conversion: ``.<out>.partial`` beside ``out``.

Layout::

    .<out>.partial/
      ledger.jsonl          line 1: the header (what is converted, how); then one line per
                            finished chunk: {"chunk", "docs", "tokens", "sequences", "carry"}
      chunks/000000/ ...    one MDS dataset per chunk (written before its ledger line)
    .<out>.lock             locked while a conversion writes, so two never share a folder

A chunk's ledger line is appended (and fsynced) only after its shards are complete, so after
an interruption the ledger lists exactly the chunks that can be kept; a resumed run deletes
any later chunk folder and starts after the last listed one, with its ``carry`` (the tokens
not yet cut into a sequence). The folder is never a dataset (no top-level ``index.json``)
until :meth:`Partial.finish` merges the chunk indexes, and only then is it renamed to ``out``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from foundryx.errors import DataError

log = logging.getLogger(__name__)

LEDGER = "ledger.jsonl"
CHUNKS = "chunks"


class Partial:
    """The work folder of a conversion to ``out``; use as a context manager (holds the lock)."""

    def __init__(self, out: Path):
        self.out = out
        self.folder = out.with_name(f".{out.name}.partial")
        self.lock_path = out.with_name(f".{out.name}.lock")
        self._lock_fd: int | None = None

    def __enter__(self) -> Partial:
        import fcntl

        self.out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:  # a POSIX lock: held by this process only (not its forked workers), freed at exit
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DataError(
                f"another conversion is writing to {self.out} (it holds {self.lock_path}); wait "
                f"for it to finish, or choose another --out"
            ) from None
        self._lock_fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lock_fd is not None:
            self.lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- the ledger --------------------------------------------------------------------------
    def start(self, header: dict[str, Any], resume: bool) -> list[dict[str, Any]]:
        """The finished chunks to keep (empty for a fresh start); prepares the folder."""
        done = self._resumable(header) if resume else []
        if not done:
            if self.folder.exists():
                shutil.rmtree(self.folder)
            (self.folder / CHUNKS).mkdir(parents=True)
            self._append(header)
            return []
        keep = {self.chunk_dir(c["chunk"]).name for c in done}
        for sub in (self.folder / CHUNKS).iterdir():
            if sub.name not in keep:
                shutil.rmtree(sub)
        (self.folder / LEDGER).unlink()
        for record in [header, *done]:  # drops any line after the last kept chunk
            self._append(record)
        log.info("resuming the conversion to %s: %d chunks (%d sequences) already done in %s",
                 self.out, len(done), sum(c["sequences"] for c in done), self.folder)
        return done

    def _resumable(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        path = self.folder / LEDGER
        if not path.is_file():
            return []
        lines = []
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by the interruption: what follows is not trusted
        if not lines or lines[0] != header:
            log.info("%s is from a conversion of other input or settings; starting over",
                     self.folder)
            return []
        done = []
        for i, chunk in enumerate(lines[1:]):
            if chunk.get("chunk") != i or not (self.chunk_dir(i) / "index.json").is_file():
                break
            done.append(chunk)
        return done

    def _append(self, record: dict[str, Any]) -> None:
        with (self.folder / LEDGER).open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def chunks(self) -> list[dict[str, Any]]:
        """The ledger records of the finished chunks."""
        lines = (self.folder / LEDGER).read_text().splitlines()[1:]
        return [json.loads(line) for line in lines]

    def chunk_dir(self, chunk: int) -> Path:
        return self.folder / CHUNKS / f"{chunk:06d}"

    def chunk_done(self, record: dict[str, Any]) -> None:
        """Record a chunk whose shards are complete."""
        self._append(record)

    # -- the end -----------------------------------------------------------------------------
    def finish(self, n_chunks: int, files: dict[str, str]) -> None:
        """Merge the chunk indexes into one ``index.json``, add ``files``, drop the ledger
        (last: until then a failure, e.g. a full disk, leaves the work resumable)."""
        self.merge_index(n_chunks)
        for name, text in files.items():  # after index.json: the manifest marks it complete
            (self.folder / name).write_text(text)
        (self.folder / LEDGER).unlink()

    def merge_index(self, n_chunks: int) -> None:
        """Write ``index.json``: every chunk's shards, in chunk order, named from the folder."""
        shards = []
        for chunk in range(n_chunks):
            rel = self.chunk_dir(chunk).relative_to(self.folder).as_posix()
            index = json.loads((self.chunk_dir(chunk) / "index.json").read_text())
            for shard in index["shards"]:
                for key in ("raw_data", "zip_data"):
                    if shard.get(key):
                        shard[key]["basename"] = f"{rel}/{shard[key]['basename']}"
                shards.append(shard)
        (self.folder / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))

    def discard(self) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder)
