"""Hugging Face Llama folders evaluated without transformers: foundryx's native Llama
(:mod:`foundryx.models.llama`) and the folder's ``tokenizer.json`` through ``tokenizers``
(:class:`~foundryx.data.json_tokenizer.JsonTokenizer`).

A model's ``implementation`` (eval config) decides: ``hf`` loads it with transformers as
before; ``native`` loads it natively or stops with the reason it cannot; ``auto`` (the
default) loads it natively where :func:`check_native` finds nothing against it, else with
transformers, and says which in one line. The native path gives the same scores as
transformers' (tests/test_eval_native.py runs both on the same tasks) and saves a small
eval's command the ~3 s of importing transformers and Composer and most of the per-step cost
of transformers' modeling for small models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundryx.data.json_tokenizer import JsonTokenizer, open_json_tokenizer
from foundryx.eval.config import EvalModelSpec
from foundryx.eval.decoding import decode_generations
from foundryx.eval.generate import plain_greedy_problem
from foundryx.eval.native_lm import native_greedy_generate, native_scoring_forward
from foundryx.eval.shared_context import shared_context_forward
from foundryx.models.llama.load import load_hf_llama
from foundryx.models.llama.load import native_problem as model_problem
from foundryx.models.llama.model import LlamaLM, causal_padding_mask
from foundryx.runtime.hf_compat import TRANSFORMERS_5


def check_native(spec: EvalModelSpec, world: int) -> JsonTokenizer | str:
    """The tokenizer the native Llama would evaluate ``spec`` with, or why it cannot run
    ``spec`` (in a few words). The tokenizer checked is the one used: its files are read once."""
    if not spec.hf:
        return "not a Hugging Face model"
    if spec.adapter:
        return "it has a LoRA adapter (PEFT applies it)"
    if world > 1:
        return "several processes"
    folder = Path(spec.hf).expanduser()
    reason = model_problem(folder)
    if reason is not None:
        return reason
    generation = folder / "generation_config.json"
    if generation.is_file():
        try:
            reason = plain_greedy_problem(json.loads(generation.read_text(encoding="utf-8")))
        except ValueError:
            reason = "its generation_config.json does not read"
        if reason is not None:
            return reason
    tokenizer = Path(spec.tokenizer or spec.hf).expanduser()
    if not tokenizer.is_dir():
        return "its tokenizer is not a local folder"
    checked = open_json_tokenizer(tokenizer)
    return f"its tokenizer: {checked}" if isinstance(checked, str) else checked


class NativeCausalLM(nn.Module):
    """A native Llama as the eval runs a model: ``config`` (its
    :class:`~foundryx.models.llama.spec.LlamaSpec`, with transformers' config names), scoring
    and greedy generation for the fast paths (:mod:`foundryx.eval.native_lm`), and
    ``eval_forward`` / ``update_metric`` as Composer's Hugging Face model gives them for a
    metric of a plugin (every position's logits; generation tasks' texts)."""

    native = True

    def __init__(self, lm: LlamaLM, tokenizer: Any, *, share_context: bool = True):
        super().__init__()
        self.lm = lm
        self.config = lm.spec
        self.tokenizer = tokenizer
        self.share_context = share_context

    def scoring_forward(self) -> Any:
        whole_rows = native_scoring_forward(self.lm)
        return shared_context_forward(self.lm, whole_rows) if self.share_context else whole_rows

    def generate(self, batch: dict[str, Any]) -> list[list[int]]:
        kw = batch["generation_kwargs"]
        return native_greedy_generate(self.lm, self.tokenizer, batch["input_ids"],
                                      batch["attention_mask"], kw["max_new_tokens"],
                                      kw.get("eos_token_id"),
                                      batch["icl_options"]["stop_sequences"])

    @torch.inference_mode()
    def eval_forward(self, batch: dict[str, Any], outputs: Any = None) -> Any:
        if batch.get("mode") == "generate":
            return decode_generations(self.tokenizer, self.generate(batch))
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.lm(ids, positions, attn_mask=causal_padding_mask(batch["attention_mask"]))

    def update_metric(self, batch: dict[str, Any], outputs: Any, metric: Any) -> Any:
        if getattr(metric, "needs_batch", False):
            return metric.update(batch=batch, outputs=outputs, labels=batch.get("labels"))
        return metric.update(outputs, batch.get("labels"))


def load_native(spec: EvalModelSpec, tokenizer: JsonTokenizer) -> NativeCausalLM:
    """``spec``'s model, native, with the tokenizer :func:`check_native` gave, in the dtype
    transformers' ``from_pretrained`` gives it without one: float32 on transformers 4, the
    checkpoint's own on 5 (``dtype="auto"``)."""
    lm = load_hf_llama(Path(spec.hf).expanduser(), dtype="auto" if TRANSFORMERS_5 else None)
    return NativeCausalLM(lm, tokenizer, share_context=spec.share_context).eval()
