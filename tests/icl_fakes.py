"""Helpers of the ICL eval tests: a word-level tokenizer, a causal LM whose next-token
probabilities are set by hand (a table keyed on the previous token), and task runners."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from foundryx.eval.data import prepare_task
from foundryx.eval.models import wrap_hf_model
from foundryx.eval.runner import evaluate_task
from foundryx.eval.task_config import ICLTaskConfig


def word_tokenizer(words: list[str]) -> Any:
    """One token per whitespace-separated word; ``<pad>`` is id 0, ``<unk>`` id 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


class LookupConfig(PretrainedConfig):
    model_type = "icl_lookup"

    def __init__(self, vocab_size: int = 8, **kwargs: Any):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.num_hidden_layers = 1  # generate() sizes its (unused) cache by it


class LookupLM(PreTrainedModel, GenerationMixin):
    """logits[t] = table[input_ids[t]]: the next token depends only on the current one."""

    config_class = LookupConfig

    def __init__(self, config: LookupConfig):
        super().__init__(config)
        self.table = nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return CausalLMOutputWithPast(logits=self.table[input_ids])

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class FakeLM:
    """A LookupLM over a word tokenizer, with ``set(prev, {next: p})`` for exact probabilities."""

    def __init__(self, words: list[str]):
        self.tokenizer = word_tokenizer(words)
        self.lm = LookupLM(LookupConfig(vocab_size=len(self.tokenizer)))
        self.model = wrap_hf_model(self.lm, self.tokenizer)

    def id(self, word: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(word)

    def set(self, prev: str, probs: dict[str, float]) -> None:
        """p(next | prev) as given; the remaining mass spread evenly over the other tokens."""
        v = self.lm.config.vocab_size
        rest = (1 - sum(probs.values())) / (v - len(probs))
        row = torch.full((v,), math.log(rest))
        for word, p in probs.items():
            row[self.id(word)] = math.log(p)
        with torch.no_grad():
            self.lm.table[self.id(prev)] = row

    def chain(self, *words: str) -> None:
        """Make each word the near-certain successor of the one before."""
        for prev, nxt in zip(words, words[1:]):
            self.set(prev, {nxt: 0.9})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task(path: Path, kind: str, **options: Any) -> ICLTaskConfig:
    return ICLTaskConfig(label=options.pop("label", path.stem), dataset_uri=str(path),
                         icl_task_type=kind, **options)


def run(model: Any, tokenizer: Any, cfg: ICLTaskConfig, batch_size: int = 4, max_seq_len: int = 64,
        dump: int = 0) -> list:
    """TaskResult per few-shot count of ``cfg``."""
    from composer.utils import get_device

    device = get_device("cpu")
    return [evaluate_task(model, t, tokenizer, batch_size=batch_size, device=device, dump=dump,
                          progress=False)
            for t in prepare_task(cfg, tokenizer, max_seq_len)]


def save_fake(fake: FakeLM, folder: Path) -> Path:
    """Save a FakeLM as a Hugging Face folder that ``hf: folder`` loads (in this process)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(LookupConfig.model_type, LookupConfig, exist_ok=True)
    AutoModelForCausalLM.register(LookupConfig, LookupLM, exist_ok=True)
    fake.lm.save_pretrained(folder)
    fake.tokenizer.save_pretrained(folder)
    return folder
