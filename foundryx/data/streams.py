"""Mixing several MDS datasets ("streams") in one ``text`` loader.

``dataset.streams`` maps a name to ``{local, split, proportion | repeat | choose}``:

* ``proportion``: relative weights (normalised to sum to 1); the epoch has ``epoch_size``
  samples (default: the sum of all streams' samples), each stream contributing its share,
  up- or down-sampled as needed. Give it to every stream or to none.
* ``repeat``: take each sample of the stream this many times per epoch (0.5 = half of them).
* ``choose``: take this many samples of the stream per epoch.
* none of them: every sample once.

This is mosaicml-streaming's ``Stream`` weighting, which picks the samples of each stream
deterministically from the shuffle seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundryx.data.options import is_int, is_number, key_problems, mds_folder_problems

WEIGHTS = ("proportion", "repeat", "choose")
STREAM_KEYS = {"local", "split", *WEIGHTS}


def _weight_problems(stream: dict[str, Any], path: str) -> list[str]:
    given = [w for w in WEIGHTS if stream.get(w) is not None]
    problems = []
    if len(given) > 1:
        problems.append(f"{path}{given[1]}: give only one of proportion, repeat or choose "
                        f"per stream (got {', '.join(given)})")
    for w in given:
        value = stream[w]
        ok = is_int(value) and value > 0 if w == "choose" else is_number(value) and value > 0
        if not ok:
            want = "a positive integer" if w == "choose" else "a positive number"
            problems.append(f"{path}{w}: expected {want}, got {value!r}")
    return problems


def streams_problems(ds: dict[str, Any]) -> list[str]:
    """Problems of ``dataset.streams`` (and of its relation to the other dataset keys)."""
    streams = ds.get("streams")
    if not isinstance(streams, dict) or not streams:
        return [f"dataset.streams: expected {{name: {{local: <folder>, split: ..., proportion: "
                f"...}}, ...}}, got {streams!r}"]
    problems = []
    if ds.get("local") is not None:
        problems.append("dataset.local: give either local (one dataset) or streams, not both")
    relative = set()
    for name, stream in streams.items():
        path = f"dataset.streams.{name}."
        if not isinstance(stream, dict):
            problems.append(f"{path[:-1]}: expected {{local: <folder>, split: ..., proportion | "
                            f"repeat | choose: ...}}, got {stream!r}")
            continue
        problems += key_problems(stream, STREAM_KEYS, path, "text")
        problems += _weight_problems(stream, path)
        relative.add(stream.get("proportion") is not None)
        problems += mds_folder_problems(stream.get("local"), stream.get("split", ds.get("split")),
                                        path, ds.get("max_seq_len"))
    if len(relative) > 1:
        problems.append("dataset.streams: give proportion to every stream or to none "
                        "(proportions are relative and do not mix with repeat or choose)")
    absolute = any(isinstance(s, dict) and (s.get("repeat") or s.get("choose"))
                   for s in streams.values())
    if ds.get("epoch_size") is not None and absolute:
        problems.append("dataset.epoch_size: only with proportion weights (repeat and choose "
                        "already fix the epoch); remove it")
    return problems


def folders(ds: dict[str, Any]) -> dict[str, Path]:
    """``{stream name: MDS folder}``; a single dataset is the stream ``"dataset"``."""
    if ds.get("streams"):
        return {name: Path(s["local"]).expanduser() / (s.get("split", ds.get("split")) or "")
                for name, s in ds["streams"].items()}
    return {"dataset": Path(ds["local"]).expanduser() / (ds.get("split") or "")}


def build_streams(ds: dict[str, Any]) -> list[Any]:
    """streaming ``Stream`` objects for ``dataset.streams``, in the config's order."""
    from streaming import Stream

    return [
        Stream(local=str(Path(s["local"]).expanduser()), split=s.get("split", ds.get("split")),
               **{w: s[w] for w in WEIGHTS if s.get(w) is not None})
        for s in ds["streams"].values()
    ]


def mix_table(dataset: Any, names: list[str]) -> str:
    """The mix a ``StreamingDataset`` derived: samples, share, repeats per stream."""
    rows = [("stream", "samples", "per epoch", "weight", "repeats")]
    for name, stream, n in zip(names, dataset.streams, dataset.samples_per_stream):
        rows.append((name, f"{int(n):,}", f"{int(stream.choose):,}", f"{stream.proportion:.3f}",
                     f"{stream.repeat:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in rows]
    return "\n".join("  " + line for line in lines)
