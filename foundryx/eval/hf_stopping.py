"""Stop sequences as transformers stopping criteria, for the batches Hugging Face ``generate``
runs (Composer's ``eval_forward``: ICL evaluators during training, several processes, models
the fast generation loop does not cover). Its own module: it imports transformers, which a
one-process ``foundryx eval`` of a native model does not load."""

from __future__ import annotations

from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList


class StopOnSequences(StoppingCriteria):
    """A transformers stopping criterion: a row is done once its new text holds a stop sequence."""

    def __init__(self, tokenizer: Any, stops: list[str], prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, list(stops), prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


def stopping_criteria(tokenizer: Any, stops: list[str], prompt_len: int) -> StoppingCriteriaList:
    """The criteria ``generate`` gets for a batch whose prompts are ``prompt_len`` tokens."""
    return StoppingCriteriaList([StopOnSequences(tokenizer, stops, prompt_len)] if stops else [])
