"""Tokenize scored rows as one text and find the continuation's tokens by character offsets.

A row is ``context.rstrip() + " " + continuation``, tokenized in one call (with the
tokenizer's special tokens, e.g. a BOS), so the model sees exactly the tokens it would see in
running text, whether the tokenizer folds the space into the next token (byte-level BPE's
``Ġword``, SentencePiece's ``▁word``) or emits it alone. The continuation is every
non-special token that ends after the context (or starts at or after its end), up to the last
non-special token. Rows longer than the token budget lose tokens on the left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from foundryx.errors import DataError


@dataclass(frozen=True)
class Encoded:
    ids: tuple[int, ...]
    cont_start: int  # first continuation token (generation prompts: len(ids))
    cont_end: int  # one past the last continuation token
    truncated: int  # tokens dropped on the left


def _check_fast(tokenizer: Any) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"ICL eval needs a fast (Rust) tokenizer for character offsets; "
            f"{type(tokenizer).__name__} is not one. Load it with use_fast=True, or convert it "
            f"with transformers' convert_slow_tokenizer."
        )


def _tokenize(tokenizer: Any, texts: list[str]) -> Any:
    return tokenizer(
        texts, add_special_tokens=True, return_offsets_mapping=True,
        return_special_tokens_mask=True, return_attention_mask=False, verbose=False,
    )


def encode_rows(
    tokenizer: Any, rows: list[tuple[str, str]], max_len: int
) -> list[Encoded | str]:
    """Each (context, continuation) row as tokens, or a problem string when it cannot fit."""
    _check_fast(tokenizer)
    contexts = [c.rstrip() for c, _ in rows]
    texts = [c + " " + cont.strip() for c, (_, cont) in zip(contexts, rows)]
    enc = _tokenize(tokenizer, texts)
    out: list[Encoded | str] = []
    for context, ids, offsets, special in zip(
        contexts, enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"]
    ):
        boundary = len(context)
        end = len(ids)
        while end and special[end - 1]:
            end -= 1  # an EOS the tokenizer appends is not part of the continuation
        start = next(
            (i for i in range(end) if not special[i]
             and (offsets[i][1] > boundary or offsets[i][0] >= boundary)),
            end,
        )
        if start == end:
            out.append("the continuation has no tokens of its own")
            continue
        cut = max(0, end - max_len)
        if start - cut < 1:
            out.append(
                f"the continuation ({end - start} tokens) plus one context token does not fit "
                f"in max_seq_len {max_len}; raise max_seq_len or shorten the continuation"
            )
            continue
        out.append(Encoded(tuple(ids[cut:end]), start - cut, end - cut, cut))
    return out


def encode_prompts(tokenizer: Any, prompts: list[str], max_len: int) -> list[Encoded]:
    """Generation prompts (trailing whitespace removed), left-truncated to ``max_len``."""
    _check_fast(tokenizer)
    enc = _tokenize(tokenizer, [p.rstrip() for p in prompts])
    out = []
    for ids, special in zip(enc["input_ids"], enc["special_tokens_mask"]):
        end = len(ids)
        while end > 1 and special[end - 1]:
            end -= 1
        cut = max(0, end - max_len)
        kept = tuple(ids[cut:end])
        out.append(Encoded(kept, len(kept), len(kept), cut))
    return out


def encode_rows_lm_eval(tokenizer: Any, rows: list[tuple[str, str]], max_len: int) -> list[Encoded | str]:
    """Rows tokenized as lm-eval-harness's Hugging Face model does (``scoring: lm_eval``): the
    context's trailing whitespace moves to the continuation; ``context + continuation`` and the
    context are tokenized apart (each with the tokenizer's own special tokens) and the
    continuation is the whole's tokens past the context's. Rows longer than ``max_len`` lose
    tokens on the left."""
    moved = []
    for context, continuation in rows:
        stripped = context.rstrip()
        moved.append((stripped, context[len(stripped):] + continuation))
    whole = tokenizer([c + cont for c, cont in moved], verbose=False)["input_ids"]
    contexts = tokenizer([c for c, _ in moved], verbose=False)["input_ids"]
    out: list[Encoded | str] = []
    for ids, ctx in zip(whole, contexts):
        start = len(ctx)
        if start == 0:
            out.append("the context is empty; lm_eval scoring needs a text before each choice")
        elif start >= len(ids):
            out.append("the continuation has no tokens of its own")
        else:
            cut = max(0, len(ids) - max_len)
            if start - cut < 1:
                out.append(f"the continuation ({len(ids) - start} tokens) plus one context token "
                           f"does not fit in max_seq_len {max_len}; raise max_seq_len")
                continue
            out.append(Encoded(tuple(ids[cut:]), start - cut, len(ids) - cut, cut))
    return out


def max_answer_tokens(tokenizer: Any, responses: list[str], cot: bool) -> int:
    """LLM Foundry's generation length: the most tokens of any response (an answer or alias,
    after its chain of thought), tokenized alone with the tokenizer's special tokens and no
    leading space, plus a buffer of 10 for chain-of-thought tasks; at least 1."""
    longest = max((len(ids) for ids in tokenizer(responses, verbose=False)["input_ids"]), default=0)
    return max(longest + (COT_BUFFER if cot else 0), 1)


COT_BUFFER = 10  # LLM Foundry's _MAX_ANSWER_BUFFER_LENGTH
