"""Read an ICL task's jsonl file, checking every line; bad lines are reported as file:line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.errors import DataError
from foundryx.eval.task_types import ICLTaskType

MAX_REPORTED = 10  # problems listed per file before "... and N more"


@dataclass(frozen=True)
class Example:
    line: int  # 1-based line number in the file
    data: dict[str, Any]  # the JSON object, top-level strings stripped (as LLM Foundry does)
    category: str  # "" without has_categories
    raw: dict[str, Any] | None = None  # the JSON object as in the file (lm-eval-harness reads that)


def read_examples(path: str | Path, task_type: ICLTaskType) -> list[Example]:
    """Every example of ``path``; raises DataError naming each bad line, or the empty file."""
    path = Path(path)
    label = task_type.cfg.label
    if not path.is_file():
        raise DataError(
            f"{path}: no such ICL data file (task {label!r}). Set icl_data_root (or the task "
            f"file's data_root) to the folder holding the eval data, or fix dataset_uri."
        )
    examples, problems = [], []
    with path.open(encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(data, dict):
                problems.append(f"{path}:{n}: expected a JSON object, got {type(data).__name__}")
                continue
            raw, data = data, {k: v.strip() if isinstance(v, str) else v for k, v in data.items()}
            found = task_type.problems(data)
            if task_type.cfg.has_categories and not isinstance(data.get("category"), str):
                found.append("missing field 'category' (has_categories is true)")
            problems += [f"{path}:{n}: {p}" for p in found]
            if not found:
                category = data.get("category", "") if task_type.cfg.has_categories else ""
                examples.append(Example(n, data, category, raw))
    if problems:
        more = len(problems) - MAX_REPORTED
        listed = problems[:MAX_REPORTED] + ([f"... and {more} more"] if more > 0 else [])
        raise DataError(f"bad examples for ICL task {label!r}:\n  " + "\n  ".join(listed))
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty); task {label!r} needs at least one")
    return examples
