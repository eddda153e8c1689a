"""``alibi`` and ``gated_linear_units``: Composer's model-surgery algorithms, which replace
modules of Hugging Face BERT and GPT-2 models. Before the run starts, each checks that its
surgery applies to the run's model and otherwise refuses with the reason and what to do
instead (``problems_with_model``; see :func:`foundryx.algorithms.check_algorithms`).

Where they apply with Composer 0.32.1 and transformers 4.x:

- MPT (``mpt_causal_lm``): neither. MPT has ALiBi built in (``model.attn_config.alibi: true``)
  and gated FFNs (``model.ffn_config.ffn_type: swiglu``).
- Llama-style HF models (llama, mistral, qwen2, gpt_neox): neither; Composer has no surgery
  policy for them (they use rotary embeddings, and their MLPs are gated already).
- GPT-2: Composer's alibi surgery replaces ``GPT2Attention._attn``, a method transformers
  stopped calling (its attention goes through ``attention_interface``): on such a
  transformers the surgery would zero the position embeddings and add no ALiBi, so it is
  refused. GLU surgery has no GPT-2 policy.
- BERT: both apply, but BERT is not a causal LM (no foundryx model trains it).
"""

from __future__ import annotations

from typing import Any

import torch
from composer.algorithms import Alibi as _ComposerAlibi
from composer.algorithms import GatedLinearUnits as _ComposerGLU
from composer.core import Event, State
from composer.loggers import Logger

from foundryx.errors import ConfigError


def _inner(model: Any) -> torch.nn.Module:
    """The model inside a Composer wrapper (``.model``), or the model itself."""
    return getattr(model, "model", model)


def _describe(model: torch.nn.Module) -> str:
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__}" + (f" (model_type {kind})" if kind else "")


def _has(model: torch.nn.Module, names: set[str]) -> set[str]:
    return {type(m).__name__ for m in model.modules()} & names


def _is_mpt(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in ("mpt", "foundryx_mpt")


class _Refusing:
    """Runs ``problems_with_model`` again at INIT, for Trainers built without foundryx train."""

    def problems_with_model(self, model: Any) -> list[str]:
        raise NotImplementedError

    def apply(self, event: Event, state: State, logger: Logger) -> Any:
        problems = self.problems_with_model(state.model)
        if problems:
            raise ConfigError(problems)
        return super().apply(event, state, logger)


class Alibi(_Refusing, _ComposerAlibi):
    """Composer's ALiBi surgery (GPT-2 and BERT modules), refused where it does not apply."""


    def problems_with_model(self, model: Any) -> list[str]:
        inner = _inner(model)
        where = f"algorithms.alibi: {_describe(inner)}"
        if _is_mpt(inner):
            return [f"{where}: MPT has ALiBi built in; set model.attn_config.alibi: true "
                    "(and rope: false) instead of the alibi algorithm"]
        targets = _has(inner, {"GPT2Attention", "GPT2Model", "BertSelfAttention", "BertEmbeddings"})
        if not targets:
            return [f"{where}: Composer's alibi surgery has policies for GPT-2 and BERT modules "
                    "only, and this model has none (Llama-style models use rotary embeddings); "
                    "remove algorithms.alibi, or train an MPT with attn_config.alibi: true"]
        if "GPT2Attention" in targets:
            from transformers import __version__ as tf_version
            from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

            if not hasattr(GPT2Attention, "_attn"):
                return [f"{where}: Composer's alibi surgery replaces GPT2Attention._attn, which "
                        f"transformers {tf_version} no longer calls: it would zero GPT-2's "
                        "position embeddings and add no ALiBi; remove algorithms.alibi, or train "
                        "an MPT with attn_config.alibi: true"]
        return []


class GatedLinearUnits(_Refusing, _ComposerGLU):
    """Composer's GLU surgery (BERT's feed-forward modules), refused where it does not apply."""


    def problems_with_model(self, model: Any) -> list[str]:
        inner = _inner(model)
        where = f"algorithms.gated_linear_units: {_describe(inner)}"
        if _is_mpt(inner):
            return [f"{where}: Composer's GLU surgery replaces BERT feed-forward modules only; "
                    "an MPT gets gated units from model.ffn_config.ffn_type: swiglu"]
        if not _has(inner, {"BertIntermediate", "BertOutput"}):
            gated = _has(inner, {"LlamaMLP", "MistralMLP", "Qwen2MLP"})
            extra = (" (its MLP is gated already)" if gated else "")
            return [f"{where}{extra}: Composer's GLU surgery replaces BERT's BertIntermediate and "
                    "BertOutput modules only, and this model has none; remove "
                    "algorithms.gated_linear_units"]
        return []
