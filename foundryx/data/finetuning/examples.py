"""One fine-tuning example → ``input_ids`` and ``labels`` (-100 where no loss is taken).

An example is a mapping with either

* ``prompt`` and ``response`` (strings): ``[bos] + prompt + response + [eos]``, where bos is
  added only when the tokenizer has one distinct from eos; or
* ``messages``: a list of ``{role, content}`` with roles ``system``, ``user`` and
  ``assistant``, ending with an assistant message. It is rendered with the tokenizer's chat
  template, or, when it has none, the ChatML-style :data:`CHATML` template
  (``<|im_start|>role\\ncontent<|im_end|>\\n``). Each assistant message is a response; its
  prompt is everything rendered since the previous response (the generation prompt
  included). eos is appended when the rendering does not end with it.

Loss masking: ``target_prompts`` is ``none`` (prompts get -100) or ``all``; ``target_responses``
is ``last`` (only the final response is learned) or ``all``. Text pieces are tokenized one by
one without special tokens, so token boundaries never straddle a prompt and a response.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from foundryx.errors import DataError

IGNORE = -100
ROLES = ("system", "user", "assistant")
TARGET_PROMPTS = ("none", "all")
TARGET_RESPONSES = ("last", "all")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}, "
                        f"got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
            raise DataError(f"{where}: messages[{i}] must have 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, "
                            f"got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: messages[{i}].content must be a string, "
                            f"got {type(m['content']).__name__}")
    if value[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be from the assistant (the response "
                        f"to learn), got role {value[-1]['role']!r}")
    if not value[-1]["content"].strip():
        raise DataError(f"{where}: the last assistant message is empty: nothing to learn")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def chat_renderer(tokenizer: Any) -> Callable[[list[dict], bool], str]:
    """``render(messages, add_generation_prompt) -> text`` with the tokenizer's template."""
    template = getattr(tokenizer, "chat_template", None) or CHATML

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    return render


def turns(record: Any, where: str, render: Callable[[list[dict], bool], str]
          ) -> list[tuple[str, str]]:
    """``[(prompt text, response text), ...]`` of one example (see the module docstring)."""
    if isinstance(record, Mapping) and "messages" in record:
        messages = _messages(record["messages"], where)
        out, done = [], ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            asked, full = render(messages[:i], True), render(messages[: i + 1], False)
            if not asked.startswith(done) or not full.startswith(asked):
                raise DataError(f"{where}: the chat template does not render the conversation "
                                f"as a sequence of growing prefixes, so responses cannot be "
                                f"located; use a template that does")
            out.append((asked[len(done):], full[len(asked):]))
            done = full
        return out
    if isinstance(record, Mapping) and {"prompt", "response"} <= set(record):
        for key in ("prompt", "response"):
            if not isinstance(record[key], str):
                raise DataError(f"{where}: {key!r} must be a string, "
                                f"got {type(record[key]).__name__}")
        if not record["response"].strip():
            raise DataError(f"{where}: 'response' is empty: nothing to learn")
        return [(record["prompt"], record["response"])]
    found = ", ".join(map(repr, record)) if isinstance(record, Mapping) else type(record).__name__
    raise DataError(f"{where}: expected 'prompt' and 'response', or 'messages' "
                    f"(found: {found})")


def encode(record: Any, where: str, tokenizer: Any, render: Callable[[list[dict], bool], str],
           max_seq_len: int, target_prompts: str = "none", target_responses: str = "last"
           ) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one example; DataError when it is malformed or too long."""
    pieces = turns(record, where, render)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids: list[int] = []
    labels: list[int] = []
    if "messages" not in record and bos is not None and bos != eos:
        ids.append(bos)
        labels.append(bos if target_prompts == "all" else IGNORE)
    for j, (prompt, response) in enumerate(pieces):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        r = tokenizer(response, add_special_tokens=False)["input_ids"] if response else []
        if j == len(pieces) - 1 and eos is not None and (not r or r[-1] != eos):
            r = [*r, eos]
        ids += p + r
        labels += p if target_prompts == "all" else [IGNORE] * len(p)
        learn = target_responses == "all" or j == len(pieces) - 1
        labels += r if learn else [IGNORE] * len(r)
    if len(ids) > max_seq_len:
        raise DataError(f"{where}: {len(ids)} tokens, longer than max_seq_len {max_seq_len}; "
                        f"shorten the example or raise max_seq_len")
    return ids, labels
