"""What differs between the transformers releases foundryx supports (4.57 on the pinned leg,
5.x on the modern one), in one place: each name here is the one public spelling foundryx uses,
whichever release is installed.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)
TRANSFORMERS_5 = TRANSFORMERS_VERSION.major >= 5

try:  # transformers 5: its own module
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights

__all__ = ["TRANSFORMERS_5", "TRANSFORMERS_VERSION", "cache_argument", "crop_cache", "no_init_weights", "output_cache"]


def cache_argument(hf) -> str | None:
    """The name under which ``hf.forward`` takes its KV cache: ``cache`` (transformers 5.x),
    ``past_key_values`` (4.x), or None (a model that keeps none)."""
    import inspect

    names = inspect.signature(hf.forward).parameters
    return next((n for n in ("cache", "past_key_values") if n in names), None)


def output_cache(outputs):
    """The KV cache a forward returned (``outputs.cache`` in 5.x, ``past_key_values`` in 4.x)."""
    return getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a KV cache (``Cache.crop`` takes the length to
    keep in 4.x and the number of tokens to remove, as a negative count, in 5.x)."""
    import inspect

    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-(cache.get_seq_length() - length))
    else:
        cache.crop(length)
