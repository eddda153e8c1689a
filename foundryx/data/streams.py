"""Mixing several MDS datasets ("streams") in one ``text`` loader.

``dataset.streams`` maps a name to ``{local, remote, split, proportion | repeat | choose}``
(``remote``: the stream's MDS dataset in object storage, ``local`` its cache; see
:mod:`foundryx.data.remote`):

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
from foundryx.data import remote as remotes
from foundryx.data.options import mds_folder_problems

WEIGHTS = ("proportion", "repeat", "choose")


@dataclass
class StreamOptions:
    """One entry of ``dataset.streams``."""

    local: str | None = option("folder of MDS shards (written by `foundryx data convert`); "
                               "with remote: the cache folder (default: under the cache root)",
                               default=None)
    remote: str | None = option("the MDS dataset in object storage, e.g. s3://bucket/path",
                                default=None)
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
                                        f"streams.{name}.", ds.max_seq_len, "max_seq_len",
                                        remote=stream.remote)
    if len({s.proportion is not None for s in ds.streams.values()}) > 1:
        problems.append("streams: give proportion to every stream or to none "
                        "(proportions are relative and do not mix with repeat or choose)")
    absolute = any(s.repeat or s.choose for s in ds.streams.values())
    if ds.epoch_size is not None and absolute:
        problems.append("epoch_size: only with proportion weights (repeat and choose "
                        "already fix the epoch); remove it")
    return problems


@dataclass
class Place:
    """Where one stream's MDS data is: a local folder, or a remote and its local cache."""

    name: str  # the stream's name; "dataset" for a single dataset
    key: str  # YAML path of its section relative to the loader's dataset: "" or "streams.web."
    local: str  # the folder (or the remote's cache), without the split
    remote: str | None
    split: str | None

    @property
    def folder(self) -> Path:
        return Path(self.local).expanduser() / (self.split or "")

    @property
    def label(self) -> str:
        return remotes.join(self.remote, self.split) if self.remote else str(self.folder)


def places(ds: Any) -> list[Place]:
    """Each stream's place, in the config's order (a single dataset is the stream "dataset");
    a remote without local gets its default cache folder (logged)."""
    entries = ds.streams.items() if ds.streams else [("dataset", ds)]
    out = []
    for name, s in entries:
        key = f"streams.{name}." if ds.streams else ""
        split = (s.split or ds.split) if ds.streams else ds.split
        local = s.local or remotes.default_local(s.remote, f"dataset.{key}remote")
        out.append(Place(name, key, str(Path(local).expanduser()), s.remote, split))
    return out


def build_streams(ds: Any, where: list[Place]) -> list[Any]:
    """streaming ``Stream`` objects for ``dataset.streams``, in the config's order."""
    from streaming import Stream

    return [Stream(local=p.local, remote=p.remote, split=p.split, **s.weights())
            for p, s in zip(where, ds.streams.values())]


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
