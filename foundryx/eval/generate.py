"""Greedy generation for ICL generation tasks: the steps of Hugging Face's greedy ``generate``
(the model's own ``prepare_inputs_for_generation`` for the prompt, its KV cache, the last
position's logits in float32, argmax), without what the eval does not need, and rows leave the
batch as they finish.

A row finishes at the end-of-sequence token, at a stop sequence in its new text (checked on
the rows still running), or after ``max_new_tokens``. ``generate`` keeps finished rows in the
batch, padding them, until every row is done; here they are dropped (their KV cache rows too),
so a batch's later steps cost what its running rows cost. The text of each row is the same as
``generate``'s: the same calls on the same inputs give the same logits, and a row's tokens up to
its stop are decoded the same way. The KV cache keeps its tensors in place
(:mod:`foundryx.eval.kv_cache`), and for plain causal models the steps after the prompt's are
fed directly (:class:`_DirectSteps`): the same inputs, made without ``generate``'s per-step
work. Models whose generation config asks for more than greedy decoding (a repetition
penalty, forced tokens, ...) and models that are not Hugging Face generation models keep
Composer's ``eval_forward`` (``generate``); see :func:`fast_path_problem`.
"""

from __future__ import annotations

from typing import Any

import torch

from foundryx.eval.decoding import (
    StopChecker,
    decode_generations,  # noqa: F401  (its callers import it from here)
    greedy_next,
    mask_positions,
)
from foundryx.eval.plain_causal import plain_causal
from foundryx.runtime.hf_compat import cache_argument, output_cache

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
    return plain_greedy_problem({name: getattr(gen_cfg, name, plain)
                                 for name, plain in _PLAIN_GREEDY.items()})


def plain_greedy_problem(settings: dict[str, Any]) -> str | None:
    """Why a generation config's ``settings`` (its fields by name, e.g. a
    generation_config.json) ask for more than greedy decoding (None: they do not)."""
    for name, plain in _PLAIN_GREEDY.items():
        value = settings.get(name, plain)
        if value != plain and value not in (None, [], {}):
            return f"its generation config sets {name}={value!r}"
    return None


def _select(value: Any, keep: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim >= 1:
        return value.index_select(0, keep)
    if hasattr(value, "batch_select_indices"):
        value.batch_select_indices(keep)
    return value


@torch.inference_mode()
def greedy_generate(hf: Any, tokenizer: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    max_new_tokens: int, eos_token_id: int | None = None,
                    stop_sequences: list[str] | tuple[str, ...] = ()) -> list[list[int]]:
    """The new tokens of each (left-padded) row, up to and including the token that finished
    it; ``generate(do_sample=False)``'s tokens for the row, cut at its stop."""
    from foundryx.eval.kv_cache import new_cache  # transformers' cache classes: HF models only
    n = input_ids.shape[0]
    out: list[list[int]] = [[] for _ in range(n)]
    if max_new_tokens <= 0 or n == 0:
        return out
    checker = StopChecker(tokenizer, list(stop_sequences))
    rows = torch.arange(n)  # batch position -> original row
    ids = input_ids
    kwargs: dict[str, Any] = {"attention_mask": attention_mask, "use_cache": True}
    cache = new_cache(hf, capacity=ids.shape[1] + max_new_tokens)
    past = cache_argument(hf)  # its name: "cache" (transformers 5) or "past_key_values"
    if cache is not None and past is not None:
        kwargs[past] = cache
    params = forward_params(hf)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    positions_v5 = steps_by_position_ids(params, past)
    if positions_v5:
        kwargs["position_ids"] = mask_positions(attention_mask)
    else:
        kwargs["cache_position"] = torch.arange(ids.shape[1], device=ids.device)
    steps = _DirectSteps(hf, cache, attention_mask, max_new_tokens, past, positions_v5, params)
    nxt = ids[:, -1]  # each step's new tokens (the first step's input is the prompt)
    for step in range(max_new_tokens):
        if step and steps.on:
            inputs = steps.inputs(nxt, kwargs)
        elif positions_v5:
            inputs = hf.prepare_inputs_for_generation(
                ids, next_sequence_length=1 if step else None, is_first_iteration=not step,
                **kwargs)
        else:
            inputs = hf.prepare_inputs_for_generation(ids, **kwargs)
        outputs = hf(**inputs, return_dict=True)
        nxt = greedy_next(outputs.logits[:, -1, :])
        cpu_next = nxt.tolist()
        finished = []
        for i, (r, tok) in enumerate(zip(rows.tolist(), cpu_next)):
            out[r].append(tok)
            if (eos_token_id is not None and tok == eos_token_id) or checker.done(out[r]):
                finished.append(i)
        if step == max_new_tokens - 1 or len(finished) == len(cpu_next):
            break
        if not steps.on:
            ids = torch.cat([ids, nxt[:, None]], dim=-1)
            kwargs["attention_mask"] = torch.cat(
                [kwargs["attention_mask"], kwargs["attention_mask"].new_ones((ids.shape[0], 1))], dim=-1)
            if positions_v5:
                pos = kwargs["position_ids"]
                kwargs["position_ids"] = torch.cat([pos, pos[:, -1:] + 1], dim=-1)
        if not positions_v5:
            kwargs["cache_position"] = kwargs["cache_position"][-1:] + 1
        returned = output_cache(outputs)
        if returned is not None and past is not None:
            kwargs[past] = returned
        if finished:  # the finished rows leave the batch
            keep = torch.tensor([i for i in range(len(cpu_next)) if i not in set(finished)],
                                device=ids.device)
            rows = rows[keep.cpu()]
            nxt = nxt.index_select(0, keep)
            steps.select(keep)
            if not steps.on:
                ids = ids.index_select(0, keep)
                kwargs["attention_mask"] = kwargs["attention_mask"].index_select(0, keep)
                if positions_v5:
                    kwargs["position_ids"] = kwargs["position_ids"].index_select(0, keep)
            if past in kwargs:
                kwargs[past] = _select(kwargs[past], keep)
    return out


class _DirectSteps:
    """The inputs of decoding steps after the prompt's, made without ``generate``'s per-step
    work. ``prepare_inputs_for_generation`` clones the ids, recomputes every row's positions
    from the whole attention mask, and the model then builds a 4D mask from it (a vmapped
    function and a conversion of booleans to an additive mask in each layer): a third of a
    decoding step of a small model. For a step of one new token after the prompt, those are
    the previous positions + 1 and, for attention, the padding of the prompt (the new tokens
    see every real token before them): kept here as one additive mask (0 or -inf, what
    ``scaled_dot_product_attention`` makes of a boolean mask) that the model uses as given.
    On where the cache is foundryx's (:class:`GrowingLayer`: full attention, no sliding window)
    and the model is :func:`~foundryx.eval.plain_causal.plain_causal`."""

    def __init__(self, hf: Any, cache: Any, attention_mask: torch.Tensor, max_new_tokens: int,
                 past: str | None, positions_v5: bool, params: set[str]):
        # past: the name of the cache argument; positions_v5: transformers 5 (no cache_position);
        # params: the names hf.forward takes
        from foundryx.eval.kv_cache import GrowingLayer  # as greedy_generate: HF models only

        self.past, self.positions_v5 = past, positions_v5
        needs = {"position_ids"} if positions_v5 else {"position_ids", "cache_position"}
        self.on = (cache is not None and past is not None and bool(getattr(cache, "layers", None))
                   and all(type(layer) is GrowingLayer for layer in cache.layers)
                   and plain_causal(hf) and needs <= params)
        if not self.on:
            return
        self.length = attention_mask.shape[1]
        self.positions = attention_mask.long().sum(-1) - 1  # the last prompt token's
        self.mask = None
        self._prompt_mask, self._new = attention_mask, max_new_tokens

    def _build_mask(self, dtype: torch.dtype) -> None:
        rows, prompt = self._prompt_mask.shape
        mask = torch.zeros((rows, 1, 1, prompt + self._new), dtype=dtype,
                           device=self._prompt_mask.device)
        mask[:, 0, 0, :prompt].masked_fill_(self._prompt_mask == 0, float("-inf"))
        self.mask = mask

    def inputs(self, nxt: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
        cache = kwargs[self.past]
        if self.mask is None:
            self._build_mask(cache.layers[0].keys.dtype)
        self.positions = self.positions + 1
        self.length += 1
        out = {"input_ids": nxt[:, None], "position_ids": self.positions[:, None],
               "attention_mask": self.mask[..., :self.length], self.past: cache,
               "use_cache": True}
        if not self.positions_v5:
            out["cache_position"] = kwargs["cache_position"]
        if "logits_to_keep" in kwargs:
            out["logits_to_keep"] = kwargs["logits_to_keep"]
        return out

    def select(self, keep: torch.Tensor) -> None:
        if self.on:
            self.positions = self.positions.index_select(0, keep)
            self._prompt_mask = self._prompt_mask.index_select(0, keep)
            if self.mask is not None:
                self.mask = self.mask.index_select(0, keep)


def steps_by_position_ids(params: set[str], past: str | None) -> bool:
    """Whether a model whose forward takes ``params`` steps as transformers 5's ``generate``
    does: position_ids kept from the prompt's mask (:func:`mask_positions`) and the new tokens
    sliced by ``next_sequence_length``; else transformers 4's ``cache_position``."""
    return "cache_position" not in params and past == "cache"


def forward_params(hf: Any) -> set[str]:
    """The names ``hf.forward`` takes."""
    import inspect

    return set(inspect.signature(hf.forward).parameters)
