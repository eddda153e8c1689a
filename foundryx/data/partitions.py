"""Conversion on many machines: one share of the input per job, then one merged index.

``foundryx data convert ... --num-partitions N --partition I`` converts share ``I`` of ``N``
into ``OUT/part-0000I-of-0000N`` (a complete MDS dataset of its own, with its manifest);
``foundryx data merge OUT`` joins the N partitions' indexes into ``OUT/index.json`` with
mosaicml-streaming's ``merge_index``, partitions in order, without copying a shard.

The shares: the input's D documents, counted in one pass before tokenizing, in input order;
share I is documents ``floor(I*D/N)`` to ``floor((I+1)*D/N) - 1``: contiguous, in order, the
same on every machine, and every document whole in exactly one share.

What equals a single-machine conversion: each share is packed like a whole input (its
documents concatenated, cut into ``max_seq_len`` sequences, its last ``< max_seq_len`` tokens
dropped). So the merged dataset is exactly the concatenation, share by share, of converting
each share alone, and its token stream is the single-machine conversion's token stream with,
at each of the N-1 share boundaries, the tail of that share (``tokens_dropped`` in its
manifest, under one sequence) left out; every sequence after a boundary starts at a document
start. With N = 1 the result is the single-machine conversion, token for token. The merged
manifest lists each partition's documents, tokens and dropped tokens.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

from foundryx.data import remote as remotes
from foundryx.data.sources import Source, slice_lists
from foundryx.errors import DataError

log = logging.getLogger(__name__)

INDEX, MANIFEST = remotes.INDEX, remotes.MANIFEST
SAME = ("format", "source", "column", "dtype", "compression", "max_seq_len", "tokenizer")


def name(i: int, n: int) -> str:
    return f"part-{i:05d}-of-{n:05d}"


def check(i: int, n: int) -> None:
    if n < 1 or not 0 <= i < n:
        raise DataError(f"--partition {i} --num-partitions {n}: the partition must be one of "
                        f"0 .. {max(n, 1) - 1} and num-partitions at least 1 (a Slurm array: "
                        "--partition $SLURM_ARRAY_TASK_ID)")


def folder_of(out: Path | str, i: int, n: int) -> str | Path:
    """The partition's own sub-folder of ``out`` (a folder or a URL)."""
    check(i, n)
    if remotes.is_remote(str(out)):
        return remotes.join(str(out), name(i, n))
    return Path(out) / name(i, n)


def bounds(n_docs: int, i: int, n: int) -> tuple[int, int]:
    """Documents ``[start, stop)`` of share ``i`` of ``n``."""
    return n_docs * i // n, n_docs * (i + 1) // n


def share(source: Source, i: int, n: int) -> Source:
    """The documents of share ``i`` of ``n`` of ``source`` (counted in one pass first)."""
    n_docs = sum(map(len, source.document_lists()))
    start, stop = bounds(n_docs, i, n)
    if start == stop:
        raise DataError(f"input {source.label} has {n_docs} documents, too few for "
                        f"{n} partitions (partition {i} would be empty); use fewer partitions")
    log.info("partition %d of %d: documents %d to %d of %d in %s", i, n, start, stop - 1,
             n_docs, source.label)
    return replace(  # the progress total is an estimate: the share's part of the input's
        source, documents=lambda: islice(source.documents(), start, stop),
        blocks=lambda: slice_lists(source.document_lists(), start, stop),
        total=source.total and source.total * (stop - start) // n_docs,
        fingerprint={**source.fingerprint, "partition": [i, n]})


def record(i: int, n: int) -> dict[str, Any]:
    """What a partition's manifest says about its share."""
    return {"index": i, "count": n}


# -- merge -----------------------------------------------------------------------------------
def _partition_manifests(out: str, up: Any) -> dict[str, dict[str, Any]]:
    """``{partition folder name: its manifest}`` of every complete partition under ``out``."""
    found: dict[str, dict[str, Any]] = {}
    if up is None:
        root = Path(out)
        if not root.is_dir():
            raise DataError(f"{out} does not exist; give the --out of the partitioned "
                            "conversions")
        for sub in sorted(root.glob("part-*-of-*")):
            if (sub / INDEX).is_file() and (sub / MANIFEST).is_file():
                found[sub.name] = json.loads((sub / MANIFEST).read_text())
        return found
    keys = remotes.list_keys(up, out, "part-")
    names = sorted({k.split("/")[0] for k in keys if k.endswith(f"/{INDEX}")
                    and k.count("/") == 1})
    with tempfile.TemporaryDirectory(prefix="foundryx-merge-") as tmp:
        for sub in names:
            if f"{sub}/{MANIFEST}" not in keys:
                continue
            remotes._download(remotes.join(out, sub, MANIFEST), Path(tmp) / sub)
            found[sub] = json.loads((Path(tmp) / sub).read_text())
    return found


def _merged_manifest(parts: list[dict[str, Any]]) -> dict[str, Any]:
    first = parts[0]
    merged = {k: first[k] for k in SAME if k in first}
    for key in ("documents", "tokens", "tokens_dropped", "sequences"):
        merged[key] = sum(p[key] for p in parts)
    merged["partitions"] = [{k: p[k] for k in ("documents", "tokens", "tokens_dropped",
                                               "sequences")} for p in parts]
    return merged


def merge(out: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Join the partitions under ``out`` (a folder or a URL) into one dataset at ``out``;
    returns its manifest. The manifest is written first, ``index.json`` last."""
    from streaming.base.util import merge_index

    out = str(out).rstrip("/")
    remote = remotes.is_remote(out)
    work = Path(tempfile.mkdtemp(prefix="foundryx-merge-out-"))
    try:
        up = remotes.uploader(work, out) if remote else None
        found = _partition_manifests(out, up)
        if not found:
            raise DataError(f"{out} holds no complete partition (part-*-of-*/ with {INDEX} and "
                            f"{MANIFEST}); run `foundryx data convert ... --out {out} "
                            "--num-partitions N --partition I` for each I first")
        n = next(iter(found.values()))["partition"]["count"]
        missing = [name(i, n) for i in range(n) if name(i, n) not in found]
        if missing:
            raise DataError(f"{out}: {len(missing)} of {n} partitions are missing or unfinished "
                            f"({', '.join(missing[:5])}); run (or finish) their conversions, "
                            "then merge again")
        extra = sorted(set(found) - {name(i, n) for i in range(n)})
        if extra:
            raise DataError(f"{out} holds partitions of another split into parts "
                            f"({', '.join(extra[:3])}) beside the {n} of {name(0, n)}; "
                            "remove the ones that are not wanted")
        parts = [found[name(i, n)] for i in range(n)]
        for i, p in enumerate(parts[1:], start=1):
            differ = [k for k in SAME if p.get(k) != parts[0].get(k)]
            if differ:
                raise DataError(f"{out}: {name(i, n)} was converted with other "
                                f"{', '.join(differ)} than {name(0, n)}; re-convert it with "
                                "the same input and settings")
        exists = (INDEX in remotes.list_keys(up, out, INDEX)) if remote else \
            (Path(out) / INDEX).is_file()
        if exists and not overwrite:
            raise DataError(f"{out} already holds a merged dataset ({INDEX}); pass --overwrite "
                            "to merge again")
        manifest = _merged_manifest(parts)
        text = json.dumps(manifest, indent=2) + "\n"
        if remote:
            (work / MANIFEST).write_text(text)
            remotes.upload(up, [MANIFEST], out)
            urls = [remotes.join(out, name(i, n), INDEX) for i in range(n)]
        else:
            (Path(out) / INDEX).unlink(missing_ok=True)
            (Path(out) / MANIFEST).write_text(text)
            urls = [str(Path(out) / name(i, n) / INDEX) for i in range(n)]
        target = (str(work / "merged"), out) if remote else out
        try:
            merge_index(urls, target, keep_local=not remote)  # uploads index.json last
        except Exception as e:  # streaming wraps any SDK error
            raise DataError(f"merging the partition indexes into {out} failed ({e}); run the "
                            "same command again once that is fixed") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("merged %d partitions into %s: %d sequences of %d tokens", n, out,
             manifest["sequences"], manifest["max_seq_len"])
    return manifest
