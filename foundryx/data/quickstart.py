"""The quickstart's offline data: a generated corpus, a BPE tokenizer and MDS shards.

Layout of ``out_dir`` (``data/quickstart`` for ``make data``)::

    corpus/train.txt  corpus/val.txt   generated documents, separated by blank lines
    tokenizer/                         byte-level BPE, load with build_hf_tokenizer(path)
    mds/train/  mds/val/               MDS shards and foundryx_manifest.json
    quickstart.json                    the parameters used; written last, marks it complete
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from foundryx.data.convert import MANIFEST, convert_to_mds
from foundryx.data.synthetic import generate_corpus
from foundryx.data.tokenizers import train_bpe_tokenizer

log = logging.getLogger(__name__)

STAMP = "quickstart.json"
SPLITS = ("train", "val")
VAL_FRACTION = 0.05
DEFAULT_N_DOCS = 40_000
DEFAULT_VOCAB_SIZE = 2048


def _is_complete(out: Path, params: dict) -> bool:
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    if json.loads(stamp.read_text()) != params:
        log.info("%s was prepared with other parameters; rebuilding it", out)
        return False
    return (out / "tokenizer" / "tokenizer.json").is_file() and all(
        (out / "mds" / split / MANIFEST).is_file() for split in SPLITS
    )


def prepare_quickstart(
    out_dir: Path | str,
    *,
    seed: int = 0,
    n_docs: int = DEFAULT_N_DOCS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_seq_len: int = 128,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build the quickstart data under ``out_dir`` (see module doc) and return ``out_dir``.

    Returns at once when ``out_dir`` is already complete for the same parameters, unless
    ``force``.
    """
    out = Path(out_dir)
    params = {"seed": seed, "n_docs": n_docs, "vocab_size": vocab_size, "max_seq_len": max_seq_len}
    if not force and _is_complete(out, params):
        return out
    (out / STAMP).unlink(missing_ok=True)

    docs = generate_corpus(n_docs, seed)
    n_val = max(1, round(n_docs * VAL_FRACTION))
    splits = {"train": docs[n_val:], "val": docs[:n_val]}
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for split, split_docs in splits.items():
        (corpus / f"{split}.txt").write_text("\n\n".join(split_docs) + "\n", encoding="utf-8")

    tokenizer = train_bpe_tokenizer(splits["train"], vocab_size, out / "tokenizer")
    for split in SPLITS:
        convert_to_mds(corpus / f"{split}.txt", out / "mds" / split, tokenizer, max_seq_len,
                       overwrite=True, progress=progress)
    (out / STAMP).write_text(json.dumps(params, indent=2) + "\n")
    return out
