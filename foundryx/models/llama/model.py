"""A Llama decoder (transformers' ``LlamaForCausalLM`` architecture) in plain single-device
PyTorch, for inference: the forward computes every operation the way transformers 4.57 and 5.x
compute it with SDPA attention, so the logits are the same numbers (tests/test_native_llama.py
compares them), without the per-call work of transformers' modeling (mask functions, cache
objects, output records, decorators) that dominates a small model's step.

Operation by operation, as ``modeling_llama.py``: RMSNorm in float32 then cast back before the
weight; rotary cos/sin in float32 from ``position * inv_freq`` (transformers 4.57 writes it as a
matmul with an inner dimension of one: the same single product), cast to the activations'
dtype, q/k rotated by ``rotate_half``; attention through
``torch.nn.functional.scaled_dot_product_attention`` with ``scale = head_dim ** -0.5``: without
a mask ``is_causal`` (more than one query) and ``enable_gqa`` as transformers passes it, with a
mask the key/value heads repeated (``repeat_kv``) for several queries; SwiGLU MLP; final
norm, then the output projection (tied to the embeddings or not) of the positions asked for.

One place where transformers 4.57 and 5 compute different numbers (last bits, ~1e-5 in float32
logits): a single masked query (a decoding step with padding) of grouped-query attention.
4.57 repeats the key/value heads (``repeat_kv``), 5 groups the query heads onto their key/value
head (``pack_gqa``, no copy of the cache), and SDPA's sums differ in order. ``pack_gqa`` picks
one; its default follows the installed transformers release (read from the package metadata,
not imported) so the eval's results are those of its transformers path on either release.
Models with as many key/value heads as query heads are not affected.

Masks are the caller's: None means causal attention over the whole input (exact for right
padding, and for a single query over its cache), else a boolean or additive mask broadcastable
to (rows, 1, queries, keys). :func:`causal_padding_mask` makes the one transformers makes for a
padded batch, except that a padding query attends to itself rather than to nothing (so no row
of SDPA is empty: no NaN in padding positions that could reach real tokens; real rows are
unchanged).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from foundryx.models.llama.spec import LlamaSpec
from foundryx.runtime.hf_compat import TRANSFORMERS_5

__all__ = ["KVCache", "LlamaLM", "causal_padding_mask", "rope_inv_freq"]


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """The rotary inverse frequencies (float32, on the CPU) of ``spec``: transformers'
    ``_compute_default_rope_parameters`` and, for llama3 scaling, ``_compute_llama3_parameters``."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                                       device="cpu").float() / dim))
    s = spec.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Linear(nn.Module):
    """``nn.Linear`` without a bias and without its random initialisation: the weight is made
    empty and the loader assigns it. (``nn.Linear`` and ``nn.Embedding`` initialise on the meta
    device through torch's reference kernels, whose first call imports torch's compiler: 2.4 s
    of a small eval's command; ``torch.ones`` there costs 0.5 s more.) The same ``F.linear``
    call, the same ``weight`` name. Every weight of the model is made this way: a model built
    without the loader holds uninitialised memory until a state dict is loaded."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    """``nn.Embedding`` without its random initialisation (see :class:`Linear`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))  # assigned by the loader (see Linear)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Each layer's keys and values in a buffer of ``capacity`` positions (allocated at the
    first update, in the keys' dtype), filled in place: attention reads a view of the filled
    part. :meth:`select` keeps some rows (the others finished)."""

    def __init__(self, layers: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot hold {end}")
        if self.keys[layer] is None:
            self.keys[layer] = k.new_empty((k.shape[0], k.shape[1], self.capacity, k.shape[3]))
            self.values[layer] = v.new_empty((v.shape[0], v.shape[1], self.capacity, v.shape[3]))
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (indices, in their new order) of every layer."""
        self.keys = [None if k is None else k.index_select(0, rows) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, rows) for v in self.values]


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec, index: int, pack_gqa: bool):
        super().__init__()
        self.index, self.head_dim, self.pack_gqa = index, spec.head_dim, pack_gqa
        self.heads, self.kv_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim ** -0.5
        h, d = spec.hidden_size, spec.head_dim
        self.q_proj = Linear(h, self.heads * d)
        self.k_proj = Linear(h, self.kv_heads * d)
        self.v_proj = Linear(h, self.kv_heads * d)
        self.o_proj = Linear(self.heads * d, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        rows, n = x.shape[:2]
        shape = (rows, n, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.index, k, v)
        if mask is None:
            # transformers: SDPA's own causal masking, grouped-query attention by enable_gqa
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, is_causal=n > 1,
                                                 enable_gqa=self.groups > 1)
        elif self.groups > 1 and n == 1 and self.pack_gqa:
            # one query: its heads grouped onto their key/value head (transformers 5's pack_gqa)
            q = q.reshape(rows, self.kv_heads, self.groups, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
            out = out.reshape(rows, self.heads, n, self.head_dim)
        else:
            if self.groups > 1:  # transformers' repeat_kv
                k = k[:, :, None].expand(-1, -1, self.groups, -1, -1).reshape(
                    rows, self.heads, -1, self.head_dim)
                v = v[:, :, None].expand(-1, -1, self.groups, -1, -1).reshape(
                    rows, self.heads, -1, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(rows, n, -1))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.gate_proj = Linear(spec.hidden_size, spec.intermediate_size)
        self.up_proj = Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, index: int, pack_gqa: bool):
        super().__init__()
        self.self_attn = Attention(spec, index, pack_gqa)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """``LlamaModel``'s modules under its names (``model.`` in a checkpoint)."""

    def __init__(self, spec: LlamaSpec, pack_gqa: bool):
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, pack_gqa)
                                    for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaLM(nn.Module):
    """A Llama causal LM; its state dict has the names of transformers' ``LlamaForCausalLM``
    (``model.layers.0.self_attn.q_proj.weight``, ..., ``lm_head.weight``). ``pack_gqa``: how a
    single masked query of grouped-query attention is computed (see the module's docstring;
    default: as the installed transformers release does)."""

    def __init__(self, spec: LlamaSpec, *, pack_gqa: bool = TRANSFORMERS_5):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, pack_gqa)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(spec).to(self.lm_head.weight.device),
                             persistent=False)

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for inputs of up to ``capacity`` positions in all."""
        return KVCache(self.spec.num_hidden_layers, capacity)

    def kv_row_bytes(self, tokens: int) -> int:
        """One row's KV cache at ``tokens`` positions in the parameters' dtype (what
        :func:`foundryx.eval.batching.kv_row_bytes` gives a transformers model)."""
        s = self.spec
        width = self.lm_head.weight.element_size()
        return 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * tokens * width

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None,
                keep: torch.Tensor | int | None = None) -> torch.Tensor:
        """Logits (rows, kept positions, vocabulary) of ``input_ids`` (rows, n) at
        ``positions`` (rows or 1, n: each token's rotary position).

        ``cache``: the tokens before these (their keys and values); these are appended.
        ``attn_mask``: None for causal attention over the cache and these tokens (exact where
        every query may see every key before it; several queries need an empty cache), else a
        boolean (True: attend) or additive mask broadcastable to (rows, 1, n, keys).
        ``keep``: None for every position's logits, an int k for the last k positions', a 1D
        tensor of sorted positions for those."""
        if attn_mask is None and cache is not None and cache.length and input_ids.shape[1] > 1:
            raise ValueError("several new tokens after cached ones need an attn_mask")
        x = self.model.embed_tokens(input_ids)
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, attn_mask)
        if cache is not None:
            cache.length += input_ids.shape[1]
        x = self.model.norm(x)
        if isinstance(keep, int):
            x = x[:, -keep:]
        elif keep is not None:
            x = x[:, keep]
        return self.lm_head(x)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The boolean (rows, 1, n, n) mask of a padded batch (2D ``attention_mask``, 1 for real
    tokens): causal, real keys only, and a padding query sees itself (never an empty row).
    None where nothing is padding (causal alone)."""
    real = attention_mask.bool()
    if bool(real.all()):
        return None
    n = real.shape[1]
    idx = torch.arange(n, device=real.device)
    causal = idx[None, :] <= idx[:, None]
    mask = causal[None] & real[:, None, :]
    mask |= torch.eye(n, dtype=torch.bool, device=real.device)[None]
    return mask[:, None]
