"""Greedy generation under tensor + sequence parallelism (``parallelism.tp`` > 1).

Sequence parallelism splits every sequence a block sees over the ``tp`` ranks of a group, so
the length of each forward pass's input must be a multiple of ``tp``; Hugging Face's
``generate`` feeds one new token a step (or, without a KV cache, a prefix that grows by one).
Here each step's input is right-padded to a multiple of ``tp`` and the logits are read at its
last real position. Padding on the right changes nothing before it: attention is causal, so
no real position attends to a pad. With a KV cache, the pads' entries are cropped from the cache
after the step, so the next step sees exactly the real tokens; without one, the whole prefix
runs each step, padded the same way. The prompt itself is left-padded to a multiple (the ICL
collator does that already), its pads masked as ``generate`` masks them.

:func:`use_sequence_parallel_generate` installs it as the model's ``generate`` for the
evaluators of a training run, with ``generate``'s signature as Composer calls it: the rows'
tokens come back after the prompt, a finished row padded with ``pad_token_id`` (the
end-of-sequence token kept), and with ``synced_gpus`` every rank runs forward steps until the
rows of all ranks are done (FSDP's all-gathers need every rank in every step).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from foundryx.eval.generate import (
    forward_params,
    generation_model,
    mask_positions,
    steps_by_position_ids,
)
from foundryx.eval.kv_cache import new_cache
from foundryx.runtime.hf_compat import cache_argument, crop_cache

log = logging.getLogger(__name__)


def _step_inputs(hf: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any, start: int,
                 pad: int, multiple: int, past: str, positions_v5: bool
                 ) -> tuple[dict[str, Any], int]:
    """The forward's keyword arguments for the real tokens ``ids[:, start:]`` (all of ``ids``
    without a cache) right-padded to a multiple, and the index of the last real one in them."""
    real = ids.shape[1] - start
    fill = (-real) % multiple
    n = ids.shape[0]
    ids = torch.cat([ids, ids.new_full((n, fill), pad)], dim=1)
    mask = torch.cat([mask, mask.new_ones((n, fill))], dim=1)
    kwargs: dict[str, Any] = {"attention_mask": mask, "use_cache": cache is not None}
    if positions_v5:  # transformers 5: the new tokens sliced by next_sequence_length
        kwargs["position_ids"] = mask_positions(mask)
        kwargs.update(is_first_iteration=start == 0,
                      next_sequence_length=ids.shape[1] - start if cache is not None else None)
        if cache is not None:
            kwargs[past] = cache
    elif cache is not None:
        kwargs.update({past: cache},
                      cache_position=torch.arange(start, ids.shape[1], device=ids.device))
    return hf.prepare_inputs_for_generation(ids, **kwargs), real - 1


@torch.no_grad()
def sequence_parallel_generate(hf: Any, input_ids: torch.Tensor, *, multiple: int,
                               attention_mask: torch.Tensor | None = None,
                               max_new_tokens: int = 20, eos_token_id: int | list[int] | None = None,
                               pad_token_id: int | None = None, stopping_criteria: Any = None,
                               synced_gpus: bool = False, do_sample: bool = False,
                               **unsupported: Any) -> torch.Tensor:
    """``generate(do_sample=False)``'s sequences (prompt, then new tokens) with every forward
    input a multiple of ``multiple`` long (see the module doc)."""
    if do_sample or unsupported:
        raise ValueError("generation under parallelism.tp is greedy only and takes "
                         "attention_mask, max_new_tokens, eos_token_id, pad_token_id, "
                         f"stopping_criteria and synced_gpus; got do_sample={do_sample}"
                         f"{', ' + ', '.join(sorted(unsupported)) if unsupported else ''}")
    n, prompt = input_ids.shape
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) \
        else list(eos_token_id)  # a generation config may name several
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    lead = (-prompt) % multiple  # the prompt left-padded to a multiple (masked)
    ids = torch.cat([input_ids.new_full((n, lead), pad), input_ids], dim=1)
    mask = torch.cat([mask.new_zeros((n, lead)), mask], dim=1)
    cache = new_cache(hf)
    past = cache_argument(hf) or "past_key_values"
    positions_v5 = steps_by_position_ids(forward_params(hf), past)
    done = torch.zeros(n, dtype=torch.bool, device=ids.device)
    start = 0  # the first position the cache does not hold
    for _ in range(max_new_tokens):
        inputs, last = _step_inputs(hf, ids, mask, cache, start, pad, multiple, past,
                                    positions_v5)
        logits = hf(**inputs, return_dict=True).logits
        nxt = logits[:, last, :].float().argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        if cache is not None and cache.get_seq_length() == 0:
            cache = None  # a model that keeps no cache (MPT's generation): the whole prefix
        if cache is not None:  # keep only the real tokens' keys and values
            start = ids.shape[1]
            crop_cache(cache, start)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        if eos:
            done |= torch.isin(nxt, torch.tensor(eos, device=nxt.device))
        if stopping_criteria:
            done |= torch.as_tensor(stopping_criteria(ids[:, lead:], None), device=ids.device)
        running = torch.tensor([0.0 if bool(done.all()) else 1.0], device=ids.device)
        if synced_gpus:
            torch.distributed.all_reduce(running)
        if running.item() == 0:
            break
    return ids[:, lead:]


def use_sequence_parallel_generate(model: Any, tp: int) -> None:
    """Make the Hugging Face model that Composer's ``eval_forward`` generates with (``model.
    model``) generate by :func:`sequence_parallel_generate` (said in one line)."""
    owner = getattr(model, "model", model)  # what Composer calls generate on (a PeftModel too)
    owner.generate = functools.partial(sequence_parallel_generate, generation_model(model),
                                       multiple=tp)
    log.info("parallelism.tp: %d: generation tasks decode greedily with each step's input "
             "padded to a multiple of %d (sequence parallelism splits it; the pads are after the "
             "real tokens and cropped from the KV cache)", tp, tp)
