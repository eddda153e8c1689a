"""ICL task entries: the ``icl_tasks`` list of an eval or run config, inline or in a task file.

A task file (``eval/yamls/tasks.yaml``) is YAML with ``icl_tasks:`` (a list of entries) and an
optional ``data_root:``; a relative ``dataset_uri`` is joined to the data root: the config's
``icl_data_root`` if set, else the task file's ``data_root``, else the current directory.

LLM Foundry's task files load as they are: its key names ``early_stopping_criteria`` and
``question_prelimiter`` are read as ``stop_sequences`` and ``prelimiter``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from foundryx import registry
from foundryx.config.load import read_yaml, resolve
from foundryx.config.schema import doc
from foundryx.config.types import dataclass_problems, join
from foundryx.errors import ConfigError, RegistryError

# Options read only by generation tasks; other task types reject them.
GENERATION_OPTIONS = frozenset({"max_new_tokens", "stop_sequences", "cot_delimiter", "do_normalization"})
# LLM Foundry's names of options (its task files use them) -> ours.
LLMFOUNDRY_NAMES = {"early_stopping_criteria": "stop_sequences", "question_prelimiter": "prelimiter"}
# Task types `scoring: lm_eval` applies to (lm-eval-harness's multiple_choice output type).
LM_EVAL_TYPES = ("multiple_choice", "schema")


@dataclass
class ICLTaskConfig:
    """One ICL task (LLM Foundry's task keys)."""

    label: str = doc("the task's name in results, e.g. arc_easy (results: arc_easy/0-shot)")
    dataset_uri: str = doc("a jsonl file in LLM Foundry's format; relative: under the data root")
    icl_task_type: str = doc(
        "an icl_tasks registry key: language_modeling, multiple_choice, schema, "
        "generation_task_with_answers"
    )
    num_fewshot: list[int] | int = doc("few-shot counts, one result each, e.g. [0, 5]", default=0)
    prompt_string: str = doc("text before the few-shot examples", default="")
    example_delimiter: str = doc("text between examples", default="\n")
    continuation_delimiter: str = doc("text between a context and its answer", default=" ")
    prelimiter: str = doc("text before each context, e.g. 'Q: '", default="")
    fewshot_random_seed: int = doc("seed of the few-shot draw", default=1234)
    has_categories: bool = doc("results per `category` field too (few-shots from the same one)",
                               default=False)
    max_seq_len: int | None = doc("token budget per row; default: the config's max_seq_len",
                                  default=None)
    batch_size: int | None = doc("examples per batch; default: device_eval_batch_size", default=None)
    metric: str | None = doc("a metrics registry key; default: the task type's", default=None)
    max_new_tokens: int | None = doc(
        "generation: tokens to generate; default: LLM Foundry's rule, the longest answer's "
        "tokens (after its chain of thought), + 10 with cot_delimiter", default=None
    )
    stop_sequences: list[str] = doc("generation: output is cut at the first of these",
                                    default_factory=list)
    cot_delimiter: str = doc("generation: answer follows the last one (chain of thought)",
                             default="")
    do_normalization: bool = doc(
        "generation: lower-case, drop punctuation and articles before matching", default=True
    )
    scoring: Literal["llmfoundry", "lm_eval"] = doc(
        "multiple choice: llmfoundry (lowest mean per-token loss wins) or lm_eval "
        "(lm-eval-harness's prompts and acc / acc_norm; see docs/eval.md)", default="llmfoundry"
    )

    @property
    def shots(self) -> list[int]:
        return [self.num_fewshot] if isinstance(self.num_fewshot, int) else list(self.num_fewshot)

    def key(self, shots: int) -> str:
        """The result key of this task at ``shots`` few-shot examples: ``label/N-shot``."""
        return f"{self.label}/{shots}-shot"


def _our_names(entry: dict[str, Any], path: str) -> tuple[dict[str, Any], list[str]]:
    """``entry`` with LLM Foundry's option names replaced by ours."""
    out, problems = dict(entry), []
    for theirs, ours in LLMFOUNDRY_NAMES.items():
        if theirs in out:
            if ours in out:
                problems.append(f"{join(path, theirs)}: LLM Foundry's name for {ours}, which is "
                                "set too; keep one")
            out[ours] = out.pop(theirs)
    return out, problems


def _entry_problems(entry: Any, path: str) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{path}: expected a mapping with label, dataset_uri, icl_task_type, got {entry!r}"]
    problems = dataclass_problems(ICLTaskConfig, entry, path)
    if problems:
        return problems
    kind = entry["icl_task_type"]
    try:
        task_cls = registry.icl_tasks.get(kind)
    except RegistryError as e:
        return [f"{join(path, 'icl_task_type')}: {e}"]
    own = getattr(task_cls, "options", frozenset())
    for key in sorted(GENERATION_OPTIONS & set(entry) - own):
        problems.append(f"{join(path, key)}: not an option of {kind} tasks; remove it")
    if entry.get("scoring") == "lm_eval":
        if kind not in LM_EVAL_TYPES:
            problems.append(f"{join(path, 'scoring')}: lm_eval is for multiple-choice tasks "
                            f"({', '.join(LM_EVAL_TYPES)}); {entry['label']!r} is a {kind} task. "
                            "Remove scoring, or set it to llmfoundry")
        elif entry.get("has_categories"):
            problems.append(f"{join(path, 'scoring')}: lm_eval scores a task as one (as "
                            "lm-eval-harness does); set has_categories: false, or split the file "
                            "by category into tasks")
    shots = entry.get("num_fewshot", 0)
    shots = [shots] if isinstance(shots, int) else shots
    if not shots or min(shots) < 0:
        problems.append(f"{join(path, 'num_fewshot')}: expected counts >= 0, got {shots!r}")
    for key in ("max_seq_len", "batch_size", "max_new_tokens"):
        if isinstance(entry.get(key), int) and entry[key] <= 0:
            problems.append(f"{join(path, key)}: must be positive, got {entry[key]}")
    if entry.get("metric") is not None:
        try:
            registry.metrics.entry(entry["metric"])
        except RegistryError as e:
            problems.append(f"{join(path, 'metric')}: {e}")
    return problems


SCORINGS = ("llmfoundry", "lm_eval")


def with_scoring(tasks: list[ICLTaskConfig], scoring: str) -> tuple[list[ICLTaskConfig], str]:
    """``(tasks, what was done)``: every task scored by ``scoring`` (``foundryx eval --scoring``)
    where it can be: ``lm_eval`` goes on multiple_choice and schema tasks without
    has_categories, the others keep their scoring and the line says which and why. ConfigError
    when no task can take it."""
    if scoring not in SCORINGS:
        raise ConfigError([f"--scoring: {scoring!r}; use one of {', '.join(SCORINGS)}"])
    out, scored, kept = [], [], []
    for t in tasks:
        why = None
        if scoring == "lm_eval" and t.icl_task_type not in LM_EVAL_TYPES:
            why = t.icl_task_type
        elif scoring == "lm_eval" and t.has_categories:
            why = "has_categories"
        if why is None:
            out.append(dataclasses.replace(t, scoring=scoring))
            scored.append(t.label)
        else:
            out.append(t)
            kept.append(f"{t.label} ({why})")
    rule = (f"lm_eval is for {' and '.join(LM_EVAL_TYPES)} tasks without has_categories"
            if scoring == "lm_eval" else "")
    if tasks and len(kept) == len(tasks):
        raise ConfigError([f"--scoring {scoring}: no task of icl_tasks can take it ({rule}); the "
                           f"tasks are {', '.join(kept)}. Leave --scoring out"])
    line = f"--scoring {scoring}: {', '.join(scored)} scored with {scoring}"
    if kept:
        line += f"; {', '.join(kept)} as set in the config ({rule})"
    return out, line


def _read_task_file(path: Path) -> tuple[list[Any], str | None]:
    """``(entries, data_root)`` of a task file."""
    problems: list[str] = []
    data = resolve(read_yaml(path), "", problems)
    if problems:
        raise ConfigError(problems, source=str(path))
    unknown = sorted(set(data) - {"icl_tasks", "data_root"})
    entries = data.get("icl_tasks")
    if unknown or not isinstance(entries, list):
        raise ConfigError(
            [f"{k}: unknown key; a task file has icl_tasks and data_root" for k in unknown]
            + ([] if isinstance(entries, list) else ["icl_tasks: missing; expected a list of tasks"]),
            source=str(path),
        )
    return entries, data.get("data_root")


def load_icl_tasks(
    source: str | list[Any], data_root: str | None = None, where: str = "icl_tasks"
) -> list[ICLTaskConfig]:
    """Validated task entries from a task file path or an inline list; relative dataset_uri
    paths are resolved under the data root (see module doc). Raises ConfigError with every
    problem."""
    origin = None
    if isinstance(source, str):
        origin = source
        entries, file_root = _read_task_file(Path(source))
        data_root = data_root or file_root
        where = "icl_tasks"
    else:
        entries = source
    problems: list[str] = []
    tasks: list[ICLTaskConfig] = []
    for i, entry in enumerate(entries):
        path = join(where, i)
        found = []
        if isinstance(entry, dict):
            entry, found = _our_names(entry, path)
        found += _entry_problems(entry, path)
        problems += found
        if not found:
            tasks.append(ICLTaskConfig(**entry))
    if not entries:
        problems.append(f"{where}: the list of tasks is empty")
    seen: set[str] = set()
    for t in tasks:
        if t.label in seen:
            problems.append(f"{where}: two tasks are labelled {t.label!r}; labels must be unique")
        seen.add(t.label)
    if problems:
        raise ConfigError(problems, source=origin)
    root = Path(data_root) if data_root else None
    return [
        dataclasses.replace(t, dataset_uri=str(root / t.dataset_uri))
        if root is not None and not Path(t.dataset_uri).is_absolute() else t
        for t in tasks
    ]
