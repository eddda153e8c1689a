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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.config.types import option
from foundryx.data.options import mds_folder_problems

WEIGHTS = ("proportion", "repeat", "choose")


@dataclass
class StreamOptions:
    """One entry of ``dataset.streams``."""

    local: str = option("folder of MDS shards (written by `foundryx data convert`)")
    split: str | None = option("subfolder of local; null: the dataset's split", default=None)
    proportion: float | None = option("relative weight (give it to every stream or none)",
                                      default=None, gt=0)
    repeat: float | None = option("times each sample is taken per epoch", default=None, gt=0)
    choose: int | None = option("samples taken per epoch", default=None, gt=0)

    def weights(self) -> dict[str, float]:
        return {w: getattr(self, w) for w in WEIGHTS if getattr(self, w) is not None}

    def problems(self) -> list[str]:
        given = list(self.weights())
        if len(given) > 1:
            return [f"{given[1]}: give only one of proportion, repeat or choose per stream "
                    f"(got {', '.join(given)})"]
        return []


def streams_problems(ds: Any) -> list[str]:
    """Problems of ``dataset.streams`` together, and with the other dataset keys; ``ds`` is
    the text loader's dataset options (paths relative to it)."""
    problems = []
    if not ds.streams:
        return ["streams: expected {name: {local: <folder>, split: ..., proportion: ...}, ...}"]
    for name, stream in ds.streams.items():
        problems += mds_folder_problems(stream.local, stream.split or ds.split,
                                        f"streams.{name}.", ds.max_seq_len, "max_seq_len")
    if len({s.proportion is not None for s in ds.streams.values()}) > 1:
        problems.append("streams: give proportion to every stream or to none "
                        "(proportions are relative and do not mix with repeat or choose)")
    absolute = any(s.repeat or s.choose for s in ds.streams.values())
    if ds.epoch_size is not None and absolute:
        problems.append("epoch_size: only with proportion weights (repeat and choose "
                        "already fix the epoch); remove it")
    return problems


def folders(ds: Any) -> dict[str, Path]:
    """``{stream name: MDS folder}``; a single dataset is the stream ``"dataset"``."""
    if ds.streams:
        return {name: Path(s.local).expanduser() / (s.split or ds.split or "")
                for name, s in ds.streams.items()}
    return {"dataset": Path(ds.local).expanduser() / (ds.split or "")}


def build_streams(ds: Any) -> list[Any]:
    """streaming ``Stream`` objects for ``dataset.streams``, in the config's order."""
    from streaming import Stream

    return [Stream(local=str(Path(s.local).expanduser()), split=s.split or ds.split, **s.weights())
            for s in ds.streams.values()]


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
