"""The KV cache of foundryx's greedy generation: Hugging Face's ``DynamicCache`` whose plain
layers keep their keys and values in place.

``DynamicLayer`` concatenates each new token onto a new tensor, a copy of the whole cache per
decoding step: a quarter of the CPU time of a gsm8k batch (32 rows of 1,000 tokens).
:class:`GrowingLayer` holds the same keys and values in a buffer of the prompt's tokens plus
the new ones (doubled if ever outgrown) and hands attention a view of the filled part: the
same tensors, no copy. Transformers without ``DynamicLayer`` (before 4.54) keep their own
cache. The layer interface differs between 4.x and 5.x (``lazy_initialization`` takes the
values too in 5.x; ``crop`` takes a final length in 4.x and a count of tokens to remove in
5.x): :class:`GrowingLayer` follows the installed one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from foundryx.hf_compat import crop_removes

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.54: caches without layer objects
    DynamicLayer = None

# 5.x: lazy_initialization(keys, values), crop(tokens_to_remove); 4.x: (keys), crop(max_length)
_INIT_TAKES_VALUES = DynamicLayer is not None and len(
    inspect.signature(DynamicLayer.lazy_initialization).parameters) == 3
_CROP_REMOVES = DynamicLayer is not None and crop_removes(DynamicLayer.crop)


class GrowingLayer(DynamicLayer or object):
    """A ``DynamicLayer`` whose keys and values live in a buffer of ``capacity`` positions."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def _views(self) -> None:
        self.keys, self.values = self._k[..., :self.length, :], self._v[..., :self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length + key_states.shape[-2]
        if not self.is_initialized:
            if _INIT_TAKES_VALUES:
                self.lazy_initialization(key_states, value_states)
            else:
                self.lazy_initialization(key_states)
            self._k = key_states.new_empty((*key_states.shape[:2], max(self.capacity, n), key_states.shape[3]))
            self._v = value_states.new_empty((*value_states.shape[:2], self._k.shape[2], value_states.shape[3]))
        if n > self._k.shape[-2]:  # outgrown: twice the length, the filled part copied once
            k, v = self._k, self._v
            self._k = k.new_empty((*k.shape[:2], 2 * n, k.shape[3]))
            self._v = v.new_empty((*v.shape[:2], 2 * n, v.shape[3]))
            self._k[..., :self.length, :] = k[..., :self.length, :]
            self._v[..., :self.length, :] = v[..., :self.length, :]
        self._k[..., self.length:n, :] = key_states
        self._v[..., self.length:n, :] = value_states
        self.length = n
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._k, self._v = self._k[indices, ...], self._v[indices, ...]
            self._views()

    def crop(self, max_length: int) -> None:
        # 4.x: the length to keep (negative: tokens to remove); 5.x: tokens to remove (<= 0)
        if max_length < 0 or _CROP_REMOVES:
            max_length = self.length - abs(max_length)
        if self.length > max_length:
            self.length = max_length
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("foundryx's greedy generation cache does not repeat rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("foundryx's greedy generation cache does not reorder beams")


def new_cache(hf: Any, capacity: int | None = None) -> Any:
    """The cache ``generate`` would start with: a DynamicCache where the model supports one.
    With ``capacity`` (the prompt's tokens + the new ones), its plain layers are
    :class:`GrowingLayer` s; sliding-window and other layers stay as transformers made them."""
    supports = getattr(hf, "_supports_default_dynamic_cache", None)
    if not (callable(supports) and supports()):
        return None
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=hf.config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    if capacity is not None and DynamicLayer is not None and getattr(cache, "layers", None):
        cache.layers = [GrowingLayer(capacity) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
    return cache
