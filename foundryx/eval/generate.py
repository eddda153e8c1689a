"""Greedy generation for ICL generation tasks: the steps of Hugging Face's greedy ``generate``
(the model's own ``prepare_inputs_for_generation``, its KV cache, the last position's logits in
float32, argmax), without what the eval does not need, and rows leave the batch as they finish.

A row finishes at the end-of-sequence token, at a stop sequence in its new text (checked on
the rows still running, on the new token only when it can have completed one), or after
``max_new_tokens``. ``generate`` keeps finished rows in the batch, padding them, until every
row is done; here they are dropped (their KV cache rows too), so a batch's later steps cost
what its running rows cost. The text of each row is the same as ``generate``'s: the same
calls on the same inputs give the same logits, and a row's tokens up to its stop are decoded
the same way. Models whose generation config asks for more than greedy decoding (a repetition
penalty, forced tokens, ...) and models that are not Hugging Face generation models keep
Composer's ``eval_forward`` (``generate``); see :func:`fast_path_problem`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# generation config fields that add logits processors or stopping rules to greedy decoding,
# with the value that adds none (transformers.GenerationConfig's defaults)
_PLAIN_GREEDY = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0,
    "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "exponential_decay_length_penalty": None, "renormalize_logits": False,
    "stop_strings": None, "max_time": None, "num_beams": 1, "guidance_scale": None,
}


def generation_model(model: Any) -> Any:
    """The Hugging Face module a Composer model generates with (a LoRA adapter's base with
    its adapter layers in place)."""
    hf = getattr(model, "model", model)
    peft_base = getattr(hf, "get_base_model", None)
    return peft_base() if callable(peft_base) and type(hf).__name__.startswith("Peft") else hf


def fast_path_problem(hf: Any) -> str | None:
    """Why ``hf`` cannot use :func:`greedy_generate` (None: it can)."""
    from transformers import GenerationMixin

    if not isinstance(hf, GenerationMixin) or not hasattr(hf, "prepare_inputs_for_generation"):
        return f"{type(hf).__name__} is not a Hugging Face generation model"
    gen_cfg = getattr(hf, "generation_config", None)
    for name, plain in _PLAIN_GREEDY.items():
        value = getattr(gen_cfg, name, plain)
        if value != plain and value not in (None, [], {}):
            return f"its generation config sets {name}={value!r}"
    return None


class _GrowingLayer(DynamicLayer):
    """A DynamicCache layer that holds the same keys and values as ``DynamicLayer`` without
    copying them all at every step: they live in a buffer of ``capacity`` positions (doubled
    if ever outgrown), and attention is handed a view of the filled part. ``DynamicLayer``
    concatenates each new token onto a new tensor, a copy of the whole cache per step: a
    quarter of the CPU time of a gsm8k batch (32 rows of 1,000 tokens)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def _views(self) -> None:
        self.keys, self.values = self._k[..., :self.length, :], self._v[..., :self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length + key_states.shape[-2]
        if not self.is_initialized:
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
        if max_length < 0:
            max_length = self.length + max_length
        if self.length > max_length:
            self.length = max_length
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("foundryx's greedy generation cache does not repeat rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("foundryx's greedy generation cache does not reorder beams")


def new_cache(hf: Any, capacity: int | None = None) -> Any:
    """The cache ``generate`` would start with: a DynamicCache where the model supports one.
    With ``capacity`` (the prompt's tokens + the new ones), its plain layers keep their keys
    and values in place (:class:`_GrowingLayer`): the same tensors for attention, no copy of
    the cache per step; sliding-window and other layers stay as transformers made them."""
    supports = getattr(hf, "_supports_default_dynamic_cache", None)
    if not (callable(supports) and supports()):
        return None
    try:
        cache = DynamicCache(config=hf.config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    if capacity is not None and getattr(cache, "layers", None):
        cache.layers = [_GrowingLayer(capacity) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
    return cache


def _select(value: Any, keep: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim >= 1:
        return value.index_select(0, keep)
    if hasattr(value, "batch_select_indices"):
        value.batch_select_indices(keep)
    return value


class _StopChecker:
    """Per-row stop-sequence checks on the decoded new text (as the collator's
    ``StopOnSequences`` does for ``generate``)."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]

    def done(self, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stops)


@torch.inference_mode()
def greedy_generate(hf: Any, tokenizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    max_new_tokens: int, eos_token_id: int | None = None,
                    stop_sequences: list[str] | tuple[str, ...] = ()) -> list[list[int]]:
    """The new tokens of each (left-padded) row, up to and including the token that finished
    it; ``generate(do_sample=False)``'s tokens for the row, cut at its stop."""
    n = input_ids.shape[0]
    out: list[list[int]] = [[] for _ in range(n)]
    if max_new_tokens <= 0 or n == 0:
        return out
    checker = _StopChecker(tokenizer, list(stop_sequences))
    rows = torch.arange(n)  # batch position -> original row
    ids = input_ids
    kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": True}
    cache = new_cache(hf, capacity=ids.shape[1] + max_new_tokens)
    if cache is not None:
        kwargs["past_key_values"] = cache
    if "logits_to_keep" in forward_params(hf):
        kwargs["logits_to_keep"] = 1
    kwargs["cache_position"] = torch.arange(ids.shape[1], device=ids.device)
    for step in range(max_new_tokens):
        inputs = hf.prepare_inputs_for_generation(ids, **kwargs)
        outputs = hf(**inputs, return_dict=True)
        nxt = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32).argmax(-1)
        cpu_next = nxt.tolist()
        finished = []
        for i, (r, tok) in enumerate(zip(rows.tolist(), cpu_next)):
            out[r].append(tok)
            if (eos_token_id is not None and tok == eos_token_id) or checker.done(out[r]):
                finished.append(i)
        if step == max_new_tokens - 1 or len(finished) == len(cpu_next):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=-1)
        kwargs["attention_mask"] = torch.cat(
            [kwargs["attention_mask"], kwargs["attention_mask"].new_ones((ids.shape[0], 1))], dim=-1)
        kwargs["cache_position"] = kwargs["cache_position"][-1:] + 1
        past = getattr(outputs, "past_key_values", None)
        if past is not None:
            kwargs["past_key_values"] = past
        if finished:  # the finished rows leave the batch
            keep = torch.tensor([i for i in range(len(cpu_next)) if i not in set(finished)],
                                device=ids.device)
            rows = rows[keep.cpu()]
            ids = ids.index_select(0, keep)
            kwargs["attention_mask"] = kwargs["attention_mask"].index_select(0, keep)
            if "past_key_values" in kwargs:
                kwargs["past_key_values"] = _select(kwargs["past_key_values"], keep)
    return out


def forward_params(hf: Any) -> set[str]:
    """The names ``hf.forward`` takes."""
    import inspect

    return set(inspect.signature(hf.forward).parameters)


def decode_generations(tokenizer: Any, tokens: list[list[int]]) -> list[str]:
    """The texts ICL metrics score, decoded as Composer's ``eval_forward`` decodes them
    (special tokens skipped; a leading space for tokenizers that do not fold one into the
    next token)."""
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    if len(tokenizer(" a", add_special_tokens=False)["input_ids"]) == 1:
        return texts
    return [" " + t for t in texts]
