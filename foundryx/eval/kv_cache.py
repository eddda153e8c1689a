"""The KV cache of foundryx's greedy generation, built on transformers' public cache API: a
``Cache`` made from a list of layers, the full-attention ones :class:`GrowingLayer` s.

A ``CacheLayerMixin`` is the documented base class of one layer's cache, and
``Cache(layers=...)`` the documented way to assemble a cache from layers (both in 4.54+ and
5.x). Transformers' own ``DynamicLayer`` concatenates each new token onto a new tensor, a copy
of the whole cache per decoding step: a quarter of the CPU time of a gsm8k batch (32 rows of
1,000 tokens). :class:`GrowingLayer` holds the same keys and values in a buffer of the prompt's
tokens plus the new ones (doubled if ever outgrown) and hands attention a view of the filled
part: the same tensors, no copy. Sliding-window and other layers stay as ``DynamicCache``
makes them for the model's config. Transformers before 4.54 (no layer objects) keep their own
cache.

The mixin's abstract methods changed between 4.x and 5.x; :class:`GrowingLayer` implements
both sets: ``lazy_initialization`` takes the values too in 5.x, ``get_mask_sizes`` the cache
positions in 4.x and the query length in 5.x, the maximum length is ``get_max_cache_shape``
in 4.x and ``get_max_length`` in 5.x, and ``crop`` takes the length to keep in 4.x and the
(negative) count of tokens to remove in 5.x.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
except ImportError:  # transformers < 4.54: caches without layer objects
    Cache = CacheLayerMixin = DynamicLayer = None

from foundryx.runtime.hf_compat import crop_removes

_CROP_REMOVES = DynamicLayer is not None and crop_removes(DynamicLayer.crop)


class GrowingLayer(CacheLayerMixin or object):
    """One full-attention layer's keys and values in a buffer of ``capacity`` positions."""

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor,
                            value_states: torch.Tensor | None = None) -> None:
        values = key_states if value_states is None else value_states
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (*key_states.shape[:2], max(self.capacity, key_states.shape[-2]))
        self._k = key_states.new_empty((*shape, key_states.shape[3]))
        self._v = values.new_empty((*shape, values.shape[3]))
        self.length = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self._k[..., :self.length, :], self._v[..., :self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.length + key_states.shape[-2]
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

    def get_seq_length(self, *args: Any) -> int:
        return self.length

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        # 4.x passes the cache positions of the query, 5.x its length
        return self.length + (query if isinstance(query, int) else query.shape[0]), 0

    def get_max_length(self) -> int:  # 5.x: no maximum
        return -1

    get_max_cache_shape = get_max_length  # 4.x's name

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()

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
    """The cache ``generate`` would start with: a ``DynamicCache`` for ``hf``'s config where
    the model supports one. With ``capacity`` (the prompt's tokens + the new ones), a ``Cache``
    of the same layers with each plain full-attention one a :class:`GrowingLayer`."""
    supports = getattr(hf, "_supports_default_dynamic_cache", None)
    if not (callable(supports) and supports()):
        return None
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=hf.config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    if capacity is None or Cache is None or not getattr(cache, "layers", None):
        return cache
    return Cache(layers=[GrowingLayer(capacity) if type(layer) is DynamicLayer else layer
                         for layer in cache.layers])
