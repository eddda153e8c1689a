"""What differs between the transformers releases foundryx supports (4.57 on the pinned leg,
5.x on the modern one), in one place: each name here is the one public spelling foundryx uses,
whichever release is installed.

Imports nothing of foundryx (nor transformers until a function needs it): any part may use it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import re
from pathlib import Path

from packaging.version import Version

__all__ = ["TRANSFORMERS_5", "TRANSFORMERS_VERSION", "cache_argument", "crop_cache", "crop_removes",
           "newer_transformers_hint", "no_init_weights", "output_cache",
           "portable_tokenizer_config", "written_by_newer"]

# from the installed metadata: importing this module does not import transformers (heavy)
TRANSFORMERS_VERSION = Version(importlib.metadata.version("transformers"))
TRANSFORMERS_5 = TRANSFORMERS_VERSION.major >= 5


def no_init_weights():
    """transformers' context that skips weight init (``transformers.initialization`` in 5.x,
    ``transformers.modeling_utils`` in 4.x)."""
    try:
        from transformers.initialization import no_init_weights as skip
    except ImportError:
        from transformers.modeling_utils import no_init_weights as skip
    return skip()


def cache_argument(hf) -> str | None:
    """The name under which ``hf.forward`` takes its KV cache: ``cache`` (transformers 5.x),
    ``past_key_values`` (4.x), or None (a model that keeps none)."""
    names = inspect.signature(hf.forward).parameters
    return next((n for n in ("cache", "past_key_values") if n in names), None)


def output_cache(outputs):
    """The KV cache a forward returned (``outputs.cache`` in 5.x, ``past_key_values`` in 4.x)."""
    return getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)


def crop_removes(crop) -> bool:
    """Whether a cache's (or cache layer's) ``crop`` takes the number of tokens to remove, as a
    negative count (5.x), rather than the length to keep (4.x)."""
    return "tokens_to_remove" in inspect.signature(crop).parameters


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a KV cache (see :func:`crop_removes`)."""
    if crop_removes(cache.crop):
        cache.crop(-(cache.get_seq_length() - length))
    else:
        cache.crop(length)


# transformers 5 saves a tokenizer backed by a tokenizer.json as class "TokenizersBackend", a
# name 4.x cannot load ("does not exist or is not currently imported"); both majors load it as
# "PreTrainedTokenizerFast" (5.x maps that name to the same class)
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def portable_tokenizer_config(config: dict) -> dict:
    """``config`` (a tokenizer_config.json's fields) with a tokenizer class both transformers 4
    and 5 load."""
    name = config.get("tokenizer_class")
    if name in PORTABLE_TOKENIZER_CLASSES:
        config = {**config, "tokenizer_class": PORTABLE_TOKENIZER_CLASSES[name]}
    return config


def written_by_newer(*files) -> str | None:
    """When a config.json or tokenizer_config.json among ``files`` records a newer
    transformers than the installed one: "FILE was written by transformers V; this environment
    has W", else None (files that are missing or record no version are skipped)."""
    for file in map(Path, files):
        try:
            written = json.loads(file.read_text(encoding="utf-8")).get("transformers_version")
        except (OSError, ValueError):
            continue
        if not written:
            continue
        try:
            newer = Version(written).release[:2] > TRANSFORMERS_VERSION.release[:2]
        except ValueError:
            continue
        if newer:
            return (f"{file} was written by transformers {written}; this environment has "
                    f"transformers {TRANSFORMERS_VERSION}: install transformers>={written} "
                    f"(foundryx's modern leg has 5.x: make install-modern)")
    return None


def newer_transformers_hint(error: BaseException, folder) -> str | None:
    """Why a config or tokenizer in ``folder`` did not load, when the cause is the installed
    transformers being older than the one that wrote it (a model type or tokenizer class it
    does not know): the versions and the fix, else None."""
    folder = Path(folder)
    newer = written_by_newer(folder / "config.json", folder / "tokenizer_config.json")
    if newer:
        return newer
    unknown = re.search(r"model type `([\w-]+)`", str(error))
    if unknown:
        return (f"transformers {TRANSFORMERS_VERSION}, installed here, has no model type "
                f"{unknown.group(1)!r}: install a transformers release that has it "
                f"(pip install -U transformers; foundryx's modern leg: make install-modern), or "
                f"set trust_remote_code: true for a model folder that carries its own code")
    moved = re.search(r"Tokenizer class (\w+) does not exist", str(error))
    if moved and moved.group(1) in PORTABLE_TOKENIZER_CLASSES:
        return (f"tokenizer class {moved.group(1)!r} is transformers 5's name for a fast tokenizer; "
                f"this environment has transformers {TRANSFORMERS_VERSION}: install "
                f"transformers>=5, or set \"tokenizer_class\": "
                f"\"{PORTABLE_TOKENIZER_CLASSES[moved.group(1)]}\" in "
                f"{folder / 'tokenizer_config.json'} (foundryx writes that name)")
    return None
