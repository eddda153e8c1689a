"""A model plugin: a small GPT-2 as a Composer model, with option names of its own.

Registered in pyproject.toml under ``foundryx_models`` as ``tiny_gpt``; a run YAML names it::

    model:
      name: tiny_gpt
      width: 64
      depth: 2
      heads: 4
      context: 128

Checkpoints record this section, so ``foundryx export`` (the GPT-2 inside, as a Hugging Face
folder) and ``foundryx eval`` rebuild the model by its name, as they do a built-in one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import HuggingFaceModel
from transformers import GPT2Config, GPT2LMHeadModel

from foundryx.config.types import option


@dataclass
class TinyGPTOptions:
    """The ``tiny_gpt`` model section."""

    width: int = option("hidden size", default=64, gt=0)
    depth: int = option("transformer blocks", default=2, gt=0)
    heads: int = option("attention heads; they divide width", default=4, gt=0)
    context: int = option("longest sequence, in tokens", default=128, gt=0)
    vocab: int | None = option("vocabulary size; default: the tokenizer's", default=None, gt=0)

    def problems(self) -> list[str]:
        if self.width % self.heads:
            return [f"heads: {self.heads} heads do not divide width {self.width}"]
        return []


class TinyGPT(HuggingFaceModel):
    """A randomly initialised GPT-2 of :class:`TinyGPTOptions`; the Hugging Face model is
    ``self.model`` (what ``foundryx export`` writes)."""

    def __init__(self, tokenizer: Any = None, options: TinyGPTOptions | None = None):
        o = options or TinyGPTOptions()
        vocab = o.vocab or (len(tokenizer) if tokenizer is not None else None)
        if vocab is None:
            raise ValueError("tiny_gpt: give the model a tokenizer or set vocab")
        config = GPT2Config(n_embd=o.width, n_layer=o.depth, n_head=o.heads, n_positions=o.context,
                            vocab_size=vocab)
        super().__init__(model=GPT2LMHeadModel(config), tokenizer=tokenizer, use_logits=True,
                         shift_labels=True, metrics=[LanguageCrossEntropy()],
                         eval_metrics=[LanguageCrossEntropy(), LanguagePerplexity()])
