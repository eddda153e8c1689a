"""``foundryx data``: the quickstart data, conversion to MDS and merging partitions."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from foundryx.errors import FoundryxError

# The data modules (numpy, omegaconf, the writers) are imported by the command that uses them:
# every other command (`foundryx eval`, whose first seconds are its start-up) would import them
# with the parser.

log = logging.getLogger(__name__)


def cmd_data_quickstart(args: argparse.Namespace) -> int:
    from foundryx.data.quickstart import prepare_quickstart

    out = prepare_quickstart(Path(args.out), seed=args.seed, force=args.force)
    print(f"quickstart data ready in {out}")
    return 0


def _tokenizer(path: str) -> Any:
    """A local folder's ``tokenizer.json`` through the ``tokenizers`` library alone where
    transformers would add nothing to it (:mod:`foundryx.data.json_tokenizer`: the same ids, no
    import of transformers, 2-3 s), else transformers' ``AutoTokenizer``; said in one line."""
    from foundryx.data.json_tokenizer import open_json_tokenizer
    from foundryx.data.tokenizers import build_hf_tokenizer

    folder = Path(path).expanduser()
    if folder.is_dir() and (folder / "tokenizer.json").is_file():
        tok = open_json_tokenizer(folder)
        if not isinstance(tok, str):
            log.info("tokenizer: %s/tokenizer.json through tokenizers alone (transformers adds "
                     "nothing to it)", folder)
            return tok
        log.info("tokenizer: transformers' AutoTokenizer (%s)", tok)
    return build_hf_tokenizer(path)


def cmd_data_convert(args: argparse.Namespace) -> int:
    from foundryx.data import partitions
    from foundryx.data import remote as remotes
    from foundryx.data.convert import convert_to_mds

    partition = None
    if args.num_partitions is not None or args.partition is not None:
        if args.num_partitions is None or args.partition is None:
            raise FoundryxError("foundryx data convert: give --num-partitions N and --partition "
                                "I together (I in 0 .. N-1), or neither")
        partition = (args.partition, args.num_partitions)
    tok = _tokenizer(args.tokenizer)
    if args.compression or remotes.is_remote(str(args.out)):
        # streaming's writer (compression, uploads) before the workers start, not in the
        # conversion's first batch, where its import (transformers, torch) takes their CPU
        import streaming  # noqa: F401
    manifest = convert_to_mds(
        args.input, args.out, tok, args.max_seq_len, text_field=args.text_field,
        split=args.split, subset=args.subset, compression=args.compression,
        overwrite=args.overwrite, workers=args.workers, resume=not args.no_resume,
        progress=not args.no_progress, partition=partition,
    )
    where = partitions.folder_of(args.out, *partition) if partition else args.out
    print(
        f"wrote {manifest['sequences']} sequences of {args.max_seq_len} tokens "
        f"({manifest['tokens']} tokens from {manifest['documents']} documents) to {where}"
    )
    return 0


def cmd_data_merge(args: argparse.Namespace) -> int:
    from foundryx.data import partitions
    from foundryx.runtime.log_setup import setup_logging

    setup_logging("info")
    manifest = partitions.merge(args.out, overwrite=args.overwrite)
    print(f"merged {len(manifest['partitions'])} partition(s) into {args.out}: "
          f"{manifest['sequences']} sequences of {manifest['max_seq_len']} tokens "
          f"({manifest['tokens']} tokens from {manifest['documents']} documents)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="prepare data")
    dsub = d.add_subparsers(dest="action", required=True)
    q = dsub.add_parser("quickstart", help="generate the offline quickstart corpus, tokenizer and MDS")
    q.add_argument("--out", default="data/quickstart")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--force", action="store_true", help="rebuild even if complete")
    q.set_defaults(fn=cmd_data_quickstart)
    c = dsub.add_parser("convert", help="text / jsonl / parquet / HF dataset → MDS token sequences")
    c.add_argument("--input", required=True, help="a .txt, .jsonl or .parquet file, a folder of "
                   ".txt or .parquet files, a save_to_disk folder, or hf://owner/name")
    c.add_argument("--out", required=True, help="output folder for the MDS shards, or "
                   "object storage: s3://bucket/path (see docs/storage.md)")
    c.add_argument("--tokenizer", required=True, help="a local tokenizer folder or a hub name")
    c.add_argument("--max-seq-len", type=int, required=True)
    c.add_argument("--text-field", default="text", help="jsonl field holding the text")
    c.add_argument("--compression", default=None, help="e.g. zstd")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--split", default=None, help="split of a Hugging Face dataset")
    c.add_argument("--subset", default=None, help="subset (config) of a hub dataset")
    c.add_argument("--workers", type=int, default=None,
                   help="tokenizer processes; default: one per CPU core (output is the same)")
    c.add_argument("--no-resume", action="store_true", help="start over instead of resuming")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--num-partitions", type=int, metavar="N", help="split the input's documents "
                   "into N contiguous shares, one per job (see docs/storage.md)")
    c.add_argument("--partition", type=int, metavar="I", help="convert share I (0 .. N-1) into "
                   "OUT/part-0000I-of-0000N; then `foundryx data merge OUT`")
    c.set_defaults(fn=cmd_data_convert)
    m = dsub.add_parser("merge", help="join the partitions of `convert --num-partitions` into one "
                        "dataset (their indexes; no shard is copied)")
    m.add_argument("out", help="the --out of the partitioned conversions (folder or s3://...)")
    m.add_argument("--overwrite", action="store_true", help="merge again over a merged index")
    m.set_defaults(fn=cmd_data_merge)
