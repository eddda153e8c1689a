"""A Hugging Face tokenizer folder's ``tokenizer.json`` through the ``tokenizers`` library
alone, with the part of ``PreTrainedTokenizerFast``'s API the ICL eval calls.

``from transformers import AutoTokenizer`` costs 2-3 s (it loads transformers' auto classes,
which import torch's compiler stack); a small eval's whole command is a few seconds. For a
folder whose ``tokenizer_config.json`` names the generic ``PreTrainedTokenizerFast`` (or
transformers 5's ``TokenizersBackend``), transformers adds nothing of its own to the Rust
tokenizer's encoding: :func:`json_tokenizer_problem` checks the rest of what it would change
(special tokens missing from the file, ``split_special_tokens``, class-specific options,
and the two rules transformers 4 and 5 apply differently: ``clean_up_tokenization_spaces``
and a pre-tokenizer's ``add_prefix_space`` other than the config's), and
:class:`JsonTokenizer` reproduces the calls: encoding with the same ids, offsets and
special-token masks, decoding, the special tokens and their ids, ``pad_token`` = ``eos_token`` when the folder has none (as
:func:`foundryx.data.tokenizers.build_hf_tokenizer` sets it). tests/test_json_tokenizer.py
compares every call with ``AutoTokenizer``'s on both transformers versions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
           "mask_token")
# tokenizer_config.json keys that change nothing JsonTokenizer does (padding side and the
# like are the eval's own business: it pads and truncates itself)
_INERT = {"added_tokens_decoder", "tokenizer_class", "model_max_length", "clean_up_tokenization_spaces",
          "extra_special_tokens", "additional_special_tokens", "padding_side", "truncation_side",
          "model_input_names", "name_or_path", "auto_map", "chat_template", "errors",
          "add_prefix_space", "split_special_tokens", "backend", "is_local", *SPECIAL}


def _config(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    special_map = folder / "special_tokens_map.json"
    if special_map.is_file():  # tokenizer_config.json's own entries win, as in transformers
        for key, value in json.loads(special_map.read_text(encoding="utf-8")).items():
            config.setdefault(key, value)
    return config


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read(folder: Path) -> tuple[dict[str, Any], Any] | str:
    """``(tokenizer config, Rust tokenizer)`` of ``folder``, or why they do not load."""
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        return "no tokenizer.json and tokenizer_config.json"
    try:
        from tokenizers import Tokenizer

        return _config(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any unreadable file: say why
        return f"its tokenizer files do not load ({type(e).__name__})"


def json_tokenizer_problem(folder: str | Path) -> str | None:
    """Why :class:`JsonTokenizer` cannot stand in for ``AutoTokenizer`` on ``folder`` (None:
    it can), in a few words."""
    read = _read(Path(folder))
    return read if isinstance(read, str) else _problem(*read)


def open_json_tokenizer(folder: str | Path) -> JsonTokenizer | str:
    """``folder``'s :class:`JsonTokenizer`, or :func:`json_tokenizer_problem`'s reason it
    cannot be one; its files are read once (a large vocabulary takes a noticeable part of a
    second to parse)."""
    read = _read(Path(folder))
    if isinstance(read, str):
        return read
    return _problem(*read) or JsonTokenizer(folder, *read)


def _problem(config: dict[str, Any], backend: Any) -> str | None:
    cls = config.get("tokenizer_class")
    if cls not in GENERIC_CLASSES:
        return f"tokenizer_class {cls} (transformers applies its own rules)"
    other = sorted(set(config) - _INERT)
    if other:
        return f"tokenizer_config.json sets {', '.join(other)}"
    if config.get("split_special_tokens"):
        return "split_special_tokens is set"
    # where transformers 4 and 5 differ, transformers decides: 4 cleans up spaces on decoding
    # and forces the pre-tokenizer's add_prefix_space to the config's (default false); 5 does
    # neither for a BPE
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces is set"
    try:
        state = json.loads(backend.pre_tokenizer.__getstate__())
    except Exception:  # noqa: BLE001 - no pre-tokenizer, or one that does not serialize
        state = {}
    if state.get("add_prefix_space", False) != bool(config.get("add_prefix_space", False)):
        return "add_prefix_space differs between tokenizer.json and tokenizer_config.json"
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        if _token_text(token) not in added or backend.token_to_id(_token_text(token)) != int(index):
            return f"added token {_token_text(token)!r} is not in tokenizer.json as id {index}"
    for key in SPECIAL:
        text = _token_text(config.get(key))
        if text is not None and text not in added:
            return f"{key} {text!r} is not an added token of tokenizer.json"
    extra = config.get("additional_special_tokens") or []
    if any(_token_text(t) not in added for t in extra):
        return "an additional special token is not in tokenizer.json"
    return None


class JsonTokenizer:
    """The tokenizer of a folder :func:`json_tokenizer_problem` accepts."""

    is_fast = True

    def __init__(self, folder: str | Path, config: dict[str, Any] | None = None,
                 backend: Any = None):
        """``config`` and ``backend``: the folder's, when already read (they are read here
        without)."""
        folder = Path(folder)
        if config is None or backend is None:
            from tokenizers import Tokenizer

            config = _config(folder)
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.name_or_path = str(folder)
        self.backend_tokenizer = backend
        self.backend_tokenizer.no_truncation()  # the eval truncates and pads rows itself
        self.backend_tokenizer.no_padding()
        self.backend_tokenizer.encode_special_tokens = False  # split_special_tokens: false
        self.model_max_length = config.get("model_max_length")
        for key in SPECIAL:
            setattr(self, key, _token_text(config.get(key)))
        if self.pad_token is None and self.eos_token is not None:
            self.pad_token = self.eos_token

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False, return_special_tokens_mask: bool = False,
                 return_attention_mask: bool = True, verbose: bool = True) -> dict[str, Any]:
        """``input_ids`` (and the other lists asked for) of one text or a list of them."""
        one = isinstance(text, str)
        encodings = self.backend_tokenizer.encode_batch([text] if one else text,
                                                        add_special_tokens=add_special_tokens)
        out: dict[str, Any] = {"input_ids": [e.ids for e in encodings]}
        if return_attention_mask:
            out["attention_mask"] = [e.attention_mask for e in encodings]
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encodings]
        if return_special_tokens_mask:
            out["special_tokens_mask"] = [e.special_tokens_mask for e in encodings]
        return {k: v[0] for k, v in out.items()} if one else out

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows: Any, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(r, skip_special_tokens=skip_special_tokens) for r in rows]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

