"""The ``text`` dataloader: batches of token sequences from MDS shards, one or mixed.

Config section (``train_loader`` / ``eval_loader``)::

    name: text
    dataset:
      local: data/quickstart/mds   # folder written by `foundryx data convert` ...
      # remote: s3://bucket/mds    # ... or a dataset in object storage, local: its cache
      split: train                 # subfolder of local (and remote), or null
      # ... or several datasets mixed (see foundryx.data.streams), instead of local:
      # streams:
      #   web:  {remote: s3://bucket/web-mds, split: train, proportion: 0.7}
      #   code: {local: /data/code-mds, split: train, proportion: 0.3}
      # epoch_size: 100000         # samples per epoch (with proportions; default: all)
      max_seq_len: 128             # <= the stored sequence length; longer ones are truncated
      shuffle: true                # default false
      shuffle_seed: 17             # default 0
      shuffle_algo: py1e           # streaming's shuffle algorithm
      num_canonical_nodes: 1       # default 1: the same order on any number of nodes and ranks
      emit_sequence_id: false      # add sequence_id (per-document ids) to each batch
    drop_last: true                # default true
    num_workers: 0                 # default 0

Batches are ``{"input_ids", "labels", "attention_mask"}``, each a ``LongTensor (B, S)``;
``labels`` equals ``input_ids`` (the model shifts). With ``emit_sequence_id`` they also hold
``sequence_id``: within each row, the documents are numbered 0, 1, 2, ... from the left; a
document ends with (and includes) the tokenizer's eos token, so the id goes up by one right
after each eos (without an eos token: a bos starts a new document). A row that starts in the
middle of a document starts with id 0. The MPT model uses it (with
``attn_config.attn_uses_sequence_id: true``) so packed documents do not attend to each other.

Order: the global order of samples depends only on the data, ``shuffle_seed``,
``shuffle_algo`` and ``num_canonical_nodes``, not on the number of ranks: rank r of n gets
its share of every global batch. Resuming: Composer saves the dataset's position
(``StreamingDataset.state_dict``) in each checkpoint, and a resumed run continues at the next
unseen sample. A ``remote`` (any URL mosaicml-streaming reads: ``s3://``, ``gs://``, ...) is
streamed shard by shard into ``local`` (default: a folder per remote under
``$FOUNDRYX_DATA_CACHE`` or ``~/.cache/foundryx/mds``, logged); its ``index.json`` is read
when the loader is built, so a bad remote stops the run before training
(:mod:`foundryx.data.remote`). Shared memory left by killed runs is freed at start, and runs on one host that
start together take turns to name theirs (:mod:`foundryx.data.shm`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from composer.utils import dist

from foundryx.config.components import ModelFacts
from foundryx.config.types import coerce, option
from foundryx.data import remote as remotes
from foundryx.data import shm, streams
from foundryx.data.convert import read_manifest, vocab_hash
from foundryx.data.options import LoaderOptions, mds_folder_problems, shard_problems
from foundryx.data.streams import StreamOptions
from foundryx.errors import DataError

log = logging.getLogger(__name__)

ShuffleAlgo = Literal["py1e", "py1br", "py1b", "py1s", "py2s", "naive"]


@dataclass
class TextDatasetOptions:
    """The ``dataset`` of a ``text`` loader: one MDS folder (``local``) or ``streams``."""

    max_seq_len: int = option("tokens per sample (<= the stored sequence length)", gt=0)
    local: str | None = option("folder written by `foundryx data convert`; with remote: the "
                               "cache folder (default: under the cache root)", default=None)
    remote: str | None = option("the MDS dataset in object storage, e.g. s3://bucket/path "
                                "(credentials and S3_ENDPOINT_URL from the environment)",
                                default=None)
    streams: dict[str, StreamOptions] | None = option(
        "several datasets mixed, instead of local: {name: {local, split, proportion | repeat | "
        "choose}}", default=None)
    split: str | None = option("subfolder of local, or null", default=None)
    shuffle: bool = option("shuffle the samples", default=False)
    shuffle_seed: int = option("seed of the shuffle", default=0)
    shuffle_algo: ShuffleAlgo = option("streaming's shuffle algorithm", default="py1e")
    num_canonical_nodes: int = option(
        "streaming's canonical nodes; 1: the same order on any number of nodes and ranks",
        default=1, gt=0)
    epoch_size: int | None = option("samples per epoch (with proportions; default: all)",
                                    default=None, gt=0)
    emit_sequence_id: bool = option("add sequence_id (per-document ids) to each batch",
                                    default=False)
    replication: int | None = option(
        "consecutive ranks that read the same samples (streaming's replication); set from "
        "parallelism.tp, whose ranks share a batch", default=None, gt=0)

    def problems(self) -> list[str]:
        if self.streams is None:
            return mds_folder_problems(self.local, self.split, "", self.max_seq_len,
                                       remote=self.remote)
        both = [f"{k}: give either {k} (one dataset) or streams, not both"
                for k in ("local", "remote") if getattr(self, k) is not None]
        return both + streams.streams_problems(self)


@dataclass(kw_only=True)
class TextLoaderOptions(LoaderOptions):
    """The ``text`` loader section (see the module docstring)."""

    dataset: TextDatasetOptions = option("the MDS data: {local, split, max_seq_len, ...}")

    def problems_with(self, model: ModelFacts) -> list[str]:
        problems = super().problems_with(model)
        if model.uses_sequence_id and not self.dataset.emit_sequence_id:
            problems.append("dataset.emit_sequence_id: model.attn_config.attn_uses_sequence_id "
                            "is true, so the batches need sequence_id; set emit_sequence_id: true")
        return problems


def document_ids(ids: Any, eos_id: int | None, bos_id: int | None) -> Any:
    """Per-token document ids of a (batch, seq) tensor; see the module docstring."""
    import torch

    if eos_id is not None:
        ends = (ids == eos_id).long()
        return torch.cumsum(ends, dim=1) - ends
    if bos_id is None:
        return torch.zeros_like(ids)
    starts = (ids == bos_id).long()
    starts[:, 0] = 0
    return torch.cumsum(starts, dim=1)


def _collate(samples: list[dict[str, Any]], max_seq_len: int,
             separators: tuple[int | None, int | None] | None) -> dict[str, Any]:
    import numpy as np
    import torch

    ids = torch.from_numpy(np.stack([s["tokens"][:max_seq_len] for s in samples]).astype(np.int64))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    if separators is not None:
        batch["sequence_id"] = document_ids(ids, *separators)
    return batch


def _num_tokens(batch: dict[str, Any]) -> int:
    return int(batch["attention_mask"].sum())


def _shared_samples(batch: dict[str, Any], share: int) -> float:
    return len(batch["input_ids"]) / share


def _shared_tokens(batch: dict[str, Any], share: int, part: int) -> int:
    """This rank's whole share of the batch's tokens (Composer wants an int): the remainder of
    the division goes one token each to the first ranks of the group, so the group sums to the
    batch's tokens exactly."""
    whole, rest = divmod(_num_tokens(batch), share)
    return whole + (part < rest)


def _check_tokenizer(manifest: dict[str, Any] | None, tokenizer: Any, folder: Path | str) -> None:
    if manifest is None or tokenizer is None:
        return
    stored = manifest["tokenizer"]
    if stored["vocab_sha256"] != vocab_hash(tokenizer):
        raise DataError(
            f"{folder} was tokenized with {stored['name_or_path']!r} "
            f"(vocab {stored['vocab_size']}), whose vocabulary differs from the run's tokenizer "
            f"{tokenizer.name_or_path!r} (vocab {len(tokenizer)}); use that tokenizer, or "
            f"re-convert the data with this one"
        )


def _stored_len(dataset: Any, ds: TextDatasetOptions, where: list[streams.Place]) -> None:
    """Refuse a max_seq_len longer than what a stream stores (datasets without a manifest)."""
    for place, offset in zip(where, dataset.sample_offset_per_stream):
        stored = len(dataset.get_item(int(offset))["tokens"])
        if ds.max_seq_len > stored:
            raise DataError(
                f"dataset.max_seq_len: {ds.max_seq_len} is longer than the sequences stored "
                f"in {place.label} ({stored} tokens); lower it, or re-convert with "
                f"--max-seq-len {ds.max_seq_len}" +
                (f" (stream {place.name!r})" if ds.streams else "")
            )


def _check_place(place: streams.Place, ds: TextDatasetOptions, tokenizer: Any) -> None:
    """A local dataset's shards, or a remote one's index (reachable, cache not stale); then
    the tokenizer and sequence length its manifest records."""
    if place.remote is None:
        bad = shard_problems(place.folder)
        if bad:
            raise DataError(f"{len(bad)} bad shard(s) in {place.folder}: " + "; ".join(bad[:3]))
        manifest = read_manifest(place.folder)
    else:
        key = f"dataset.{place.key}remote"
        index, manifest = remotes.fetch_index(place.remote, place.split, key)
        remotes.check_cache(place.local, place.split, index, place.remote, key)
        stored = (manifest or {}).get("max_seq_len")
        if isinstance(stored, int) and ds.max_seq_len > stored:
            raise DataError(f"dataset.max_seq_len: {ds.max_seq_len} is longer than the sequences "
                            f"stored in {place.label} ({stored} tokens); lower it, or re-convert "
                            f"with --max-seq-len {ds.max_seq_len}")
    _check_tokenizer(manifest, tokenizer, place.label)


def build_text_dataloader(options: TextLoaderOptions | Mapping[str, Any], tokenizer: Any,
                          device_batch_size: int):
    """A ``composer.core.DataSpec`` over the MDS shards the options name (see module doc)."""
    from composer.core import DataSpec
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    options = coerce(TextLoaderOptions, options, owner="the 'text' dataloader")
    ds = options.dataset
    where = streams.places(ds)
    for place in where:
        _check_place(place, ds, tokenizer)

    source = ({"streams": streams.build_streams(ds, where)} if ds.streams else
              {"local": where[0].local, "remote": where[0].remote, "split": ds.split})
    with shm.registering():  # streaming's choice of shared-memory names is racy across runs
        shm.clean_once()
        dataset = StreamingDataset(
            **source,
            shuffle=ds.shuffle,
            shuffle_seed=ds.shuffle_seed,
            shuffle_algo=ds.shuffle_algo,
            num_canonical_nodes=ds.num_canonical_nodes,
            epoch_size=ds.epoch_size,
            batch_size=device_batch_size,
            replication=ds.replication,
        )
        shm.hold(dataset)
    _stored_len(dataset, ds, where)
    if ds.streams:
        log.info("data mix (%d samples per epoch, shuffle_seed %d):\n%s", dataset.epoch_size,
                 ds.shuffle_seed, streams.mix_table(dataset, [p.name for p in where]))
    separators = (tokenizer.eos_token_id, tokenizer.bos_token_id) if ds.emit_sequence_id else None
    loader = DataLoader(
        dataset,
        batch_size=device_batch_size,
        collate_fn=functools.partial(_collate, max_seq_len=ds.max_seq_len, separators=separators),
        drop_last=options.drop_last,
        num_workers=options.num_workers,
    )
    share = ds.replication or 1
    if share > 1:
        # the `share` ranks that read one batch (a tensor-parallel group) count 1/share of it
        # each: Composer sums the counts over ranks (float counts are its way for sequence
        # parallelism), so samples, tokens, a max_duration in them and the data position a
        # checkpoint resumes from (streaming's state_dict wants unique samples) are the data read
        part = dist.get_global_rank() % share  # the group's ranks are consecutive (streaming's)
        return DataSpec(loader, get_num_samples_in_batch=functools.partial(_shared_samples, share=share),
                        get_num_tokens_in_batch=functools.partial(_shared_tokens, share=share,
                                                                  part=part))
    return DataSpec(loader, get_num_tokens_in_batch=_num_tokens)
