"""Few-shot prompts: the draw of in-context examples and the rendered rows of each example.

The draw is LLM Foundry's: one ``random.Random(fewshot_random_seed)`` per category (or per
task), consumed in file order, ``num_fewshot`` distinct examples that never include the
example itself. So a task file gives the same prompts here as there, on every rank.

With ``scoring: lm_eval`` the draw is lm-eval-harness's (its ContextSampler with the few-shot
split being the test split): one ``random.Random(fewshot_random_seed)`` per task, consumed in
file order; for each example ``num_fewshot + 1`` documents are sampled, those equal to the
example are dropped and the first ``num_fewshot`` kept (too few left, when the file holds copies
of the example: ``num_fewshot`` are drawn again from the rows unequal to it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from foundryx.eval.examples import Example
from foundryx.eval.task_types import ICLTaskType


@dataclass(frozen=True)
class Rendered:
    index: int  # the example's id: its position among the task's examples
    line: int
    category: str
    queries: tuple[tuple[str, str], ...]  # (context, continuation) per scored row
    gold: int
    answers: tuple[str, ...]  # generation tasks
    norm_lengths: tuple[int, ...] = ()  # scoring lm_eval: acc_norm's divisor per row


def fewshot_indices(n: int, k: int, idx: int, rng: random.Random) -> list[int]:
    """``min(k, n - 1)`` distinct indices in ``range(n)``, never ``idx``."""
    k = min(n - 1, k)
    if k <= 0:
        return []
    picked = set(rng.sample(range(n), k))
    if idx in picked:
        picked.remove(idx)
        if len(picked) < n - 1:
            extra = rng.choice(range(n))
            while extra in picked or extra == idx:
                extra = rng.choice(range(n))
            picked.add(extra)
    return list(picked)


def render(task_type: ICLTaskType, examples: list[Example], num_fewshot: int) -> list[Rendered]:
    """Every example with its prompt string and few-shot examples, in file order."""
    cfg = task_type.cfg
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.category, []).append(i)
    out: list[Rendered | None] = [None] * len(examples)
    for members in groups.values():
        rng = random.Random(cfg.fewshot_random_seed)
        for pos, i in enumerate(members):
            prompt = cfg.prompt_string
            for j in fewshot_indices(len(members), num_fewshot, pos, rng):
                prompt += task_type.solved(examples[members[j]].data, first=not prompt)
            ex = examples[i]
            queries = tuple(
                (prompt + context, continuation)
                for context, continuation in task_type.queries(ex.data, first=not prompt)
            )
            out[i] = Rendered(i, ex.line, ex.category, queries, task_type.gold(ex.data),
                              task_type.answers(ex.data))
    return out  # type: ignore[return-value]


def render_lm_eval(task_type: ICLTaskType, examples: list[Example], num_fewshot: int) -> list[Rendered]:
    """Every example as lm-eval-harness renders it (see module doc and
    :mod:`foundryx.eval.task_types`): ``prompt_string``, then each few-shot example's text, a
    space, its answer and ``"\n\n"``, then the example's text; each continuation is a space
    and the choice."""
    cfg = task_type.cfg
    rng = random.Random(cfg.fewshot_random_seed)
    docs = [ex.raw if ex.raw is not None else ex.data for ex in examples]
    out = []
    for i, ex in enumerate(examples):
        before = cfg.prompt_string
        if num_fewshot > 0:
            drawn = [docs[j] for j in rng.sample(range(len(docs)), num_fewshot + 1)]
            shots = [d for d in drawn if d != docs[i]][:num_fewshot]
            if len(shots) < num_fewshot:  # copies of the example were drawn: lm-eval draws again
                pool = [d for d in docs if d != docs[i]]
                shots = [pool[j] for j in rng.sample(range(len(pool)), num_fewshot)]
            for doc in shots:
                before += task_type.lm_eval_solved(doc) + "\n\n"
        out.append(Rendered(i, ex.line, ex.category, tuple(task_type.lm_eval_queries(docs[i], before)),
                            task_type.gold(ex.data), (), task_type.lm_eval_lengths(docs[i])))
    return out
