"""Tokenizers: train a small byte-level BPE locally, or load a Hugging Face tokenizer.

``build_hf_tokenizer`` is the ``hf`` entry of the ``tokenizers`` registry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundryx.config.types import option
from foundryx.errors import ConfigError, DataError
from foundryx.runtime.hf_compat import newer_transformers_hint, portable_tokenizer_config
from foundryx.runtime.hub import looks_like_path, nearest_folder, resolve_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
_BYTE_ALPHABET = 256


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: Path | str
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and save it to ``out_dir``.

    ``<|endoftext|>`` is the only special token and serves as bos, eos, unk and pad (as in
    GPT-2); encoding adds no special tokens. The folder loads offline with
    ``AutoTokenizer.from_pretrained(out_dir)`` or ``build_hf_tokenizer(out_dir)``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= _BYTE_ALPHABET:
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs more than "
            f"{_BYTE_ALPHABET} (the byte alphabet plus {END_OF_TEXT}); use 300 or more."
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        name_or_path=str(out_dir),
    )
    fast.save_pretrained(str(out_dir))
    config = Path(out_dir) / "tokenizer_config.json"  # a class transformers 4 and 5 both load
    config.write_text(json.dumps(portable_tokenizer_config(json.loads(config.read_text())),
                                 indent=2, sort_keys=True) + "\n")
    return fast


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_FIX = (
    "Give a local folder with tokenizer files (e.g. data/quickstart/tokenizer from `make data`), "
    "or a hub name with network access or already in the Hugging Face cache."
)


def build_hf_tokenizer(path: str, **kwargs) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder or a Hugging Face hub name (``path``).

    ``kwargs`` (e.g. ``model_max_length``) pass through to ``AutoTokenizer.from_pretrained``.
    A tokenizer without a pad token gets ``pad_token = eos_token``.
    """
    from transformers import AutoTokenizer

    local = Path(path).expanduser()
    if not local.is_dir() and looks_like_path(path):
        raise DataError(f"tokenizer folder {path!r} does not exist. {_FIX}")
    if local.is_dir() and not any((local / f).is_file() for f in _TOKENIZER_FILES):
        raise DataError(
            f"could not load tokenizer {path!r} as a local folder: it has none of "
            f"{', '.join(_TOKENIZER_FILES)}. {_FIX}"
        )
    if not local.is_dir():  # a hub name: only when the hub answers or it is cached
        try:
            _, cached = resolve_source(path, "tokenizer.path", "tokenizer_config.json")
        except ConfigError as e:
            raise DataError(e.problems[0]) from None
        kwargs = {"local_files_only": True, **kwargs} if cached else kwargs
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else path, **kwargs)
    except (OSError, ValueError) as e:
        where = "local folder" if local.is_dir() else "hub name (no such tokenizer?)"
        newer = newer_transformers_hint(e, local) if local.is_dir() else None
        near = None if local.is_dir() else nearest_folder(path)
        raise DataError(
            f"could not load tokenizer {path!r} as a {where}: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. "
            + (f"{newer}." if newer else f"Did you mean {near}?" if near else _FIX)
        ) from e
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class HFTokenizerOptions:
    """The ``hf`` tokenizer section."""

    path: str = option("a local tokenizer folder or a hub name")
    model_max_length: int | None = option("longest input the tokenizer allows", default=None, gt=0)
    kwargs: dict[str, Any] = option("other keyword arguments of AutoTokenizer.from_pretrained",
                                    default_factory=dict)

    def problems(self) -> list[str]:
        if not self.path:
            return ["path: missing; give a local tokenizer folder or a hub name"]
        if looks_like_path(self.path) and not Path(self.path).expanduser().is_dir():
            return [f"path: tokenizer folder {self.path} does not exist. {_FIX}"]
        return []


def hf_tokenizer(options: HFTokenizerOptions) -> PreTrainedTokenizerBase:
    """The ``hf`` entry of the ``tokenizers`` registry: :func:`build_hf_tokenizer` from a
    config section."""
    extra = {} if options.model_max_length is None else {"model_max_length": options.model_max_length}
    return build_hf_tokenizer(options.path, **extra, **options.kwargs)
