"""ICL tasks built from the quickstart corpus's own facts (``foundryx.data.synthetic``).

``facts_lm.jsonl`` (language_modeling): each fact's context and answer, e.g. ``The capital of
Veloria is`` → ``Quenport``. ``facts_mc.jsonl`` (multiple_choice): the same facts with the
answer among ``n_choices`` options; the others are answers of other facts of the same relation
(other capitals, other animals), so a model must know the fact, not just the answer's kind.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from foundryx.data.synthetic import world_facts
from foundryx.runtime.atomic_writes import write_text_atomically

LM_FILE = "facts_lm.jsonl"
MC_FILE = "facts_mc.jsonl"


def _relation(context: str) -> tuple[str, ...]:
    """The words of a fact that are not names: the same for every fact of one relation."""
    return tuple(w for w in context.split() if w.islower())


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))


def write_quickstart_tasks(out_dir: str | Path, seed: int = 0, n_choices: int = 4) -> dict[str, Path]:
    """Write the two task files for the world of ``seed`` (the quickstart's) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    facts = [(c, a.strip()) for c, a in world_facts(seed)]
    pools: dict[tuple[str, ...], list[str]] = {}
    for context, answer in facts:
        pool = pools.setdefault(_relation(context), [])
        if answer not in pool:
            pool.append(answer)
    rng = random.Random(seed)
    mc = []
    for context, answer in facts:
        others = [a for a in pools[_relation(context)] if a != answer]
        choices = rng.sample(others, min(n_choices - 1, len(others)))
        gold = rng.randrange(len(choices) + 1)
        choices.insert(gold, answer)
        mc.append({"query": context, "choices": choices, "gold": gold})
    paths = {"lm": out / LM_FILE, "mc": out / MC_FILE}
    _write_jsonl(paths["lm"], [{"context": c, "continuation": a} for c, a in facts])
    _write_jsonl(paths["mc"], mc)
    return paths


# Steps an eval config's ``setup:`` may run before data is read: name -> fn(**options), which
# returns {name: path} of the files it wrote.
SETUP_STEPS = {"quickstart_facts": write_quickstart_tasks}
