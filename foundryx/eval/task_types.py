"""The ICL task types: how each reads, renders and scores its examples (``icl_tasks`` registry).

Every example is rendered as (context, continuation) pairs. A context is
``[example_delimiter] prelimiter TEXT continuation_delimiter`` (the example delimiter only
after earlier text: the prompt string or few-shot examples). A scored row is the context with
trailing whitespace removed, one space, and the continuation, tokenized as one text (see
:mod:`foundryx.eval.encode`), as LLM Foundry renders it. A few-shot example is its context
followed directly by its answer.

- ``language_modeling`` (context, continuation): correct when every continuation token is the
  model's argmax.
- ``multiple_choice`` (query, choices, gold): one row per choice; the lowest mean per-token
  loss of the continuation wins.
- ``schema`` (context_options, continuation, gold): the continuation scored under each
  context; the lowest mean per-token loss wins.
- ``generation_task_with_answers`` (context, answer, aliases, chain_of_thought): greedy
  generation, cut at stop sequences, optionally normalised; correct when it starts with the
  answer or an alias. A few-shot answer is ``chain_of_thought + cot_delimiter + answer`` where
  the example has a chain of thought (as LLM Foundry's has_cot).

``scoring: lm_eval`` (multiple_choice and schema) renders lm-eval-harness's way instead: a
document's text is ``prelimiter + TEXT + continuation_delimiter`` with the delimiter's trailing
whitespace removed (TEXT: the query, or a schema's context option, read from the file
unstripped, as lm-eval-harness reads it); the target delimiter is one space and few-shot examples end with
``"\n\n"`` (see :func:`foundryx.eval.prompts.render_lm_eval`).

A plugin adds a task type by subclassing :class:`ICLTaskType` and registering it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from foundryx.eval.task_config import GENERATION_OPTIONS, ICLTaskConfig


class ICLTaskType:
    """Base class of task types; an instance holds one task's config."""

    fields: ClassVar[dict[str, type]] = {}  # required jsonl fields and their JSON types
    metric: ClassVar[str] = ""  # default `metrics` registry key
    mode: ClassVar[str] = "icl_task"  # "icl_task": score rows; "generate": generate text
    options: ClassVar[frozenset[str]] = frozenset()  # task-type-specific config options

    def __init__(self, cfg: ICLTaskConfig):
        self.cfg = cfg

    def problems(self, ex: dict[str, Any]) -> list[str]:
        """What is wrong with one example (empty when it is fine)."""
        out = []
        for name, tp in self.fields.items():
            if name not in ex:
                need = ", ".join(self.fields)
                out.append(f"missing field {name!r} ({self.cfg.icl_task_type} examples need {need})")
            elif not isinstance(ex[name], tp) or (tp is int and isinstance(ex[name], bool)):
                out.append(f"field {name!r} must be {_json_type(tp)}, got {ex[name]!r:.60}")
        return out

    def context(self, text: str, first: bool) -> str:
        """``text`` as a context; ``first``: nothing precedes it in the prompt."""
        c = self.cfg
        return ("" if first else c.example_delimiter) + c.prelimiter + text + c.continuation_delimiter

    def solved(self, ex: dict[str, Any], first: bool) -> str:
        """``ex`` as a few-shot example: its context followed by its answer."""
        raise NotImplementedError

    def queries(self, ex: dict[str, Any], first: bool) -> list[tuple[str, str]]:
        """The (context, continuation) rows to score; generation: one (prompt, "") row."""
        raise NotImplementedError

    def gold(self, ex: dict[str, Any]) -> int:
        """Index of the correct row."""
        return 0

    def answers(self, ex: dict[str, Any]) -> tuple[str, ...]:
        """Accepted answers of a generation example."""
        return ()

    def random_baseline(self, options: list[int]) -> float | None:
        """The accuracy of guessing on examples with ``options`` scored rows each; None where
        guessing has no known accuracy (language modeling, generation)."""
        return None

    # lm-eval-harness's multiple_choice output type (scoring: lm_eval)
    def lm_eval_text(self, text: str) -> str:
        c = self.cfg
        return c.prelimiter + text + c.continuation_delimiter.rstrip()

    def lm_eval_solved(self, raw: dict[str, Any]) -> str:
        """``raw`` (the file's JSON object) as a few-shot example: text, space, answer."""
        raise NotImplementedError

    def lm_eval_queries(self, raw: dict[str, Any], before: str) -> list[tuple[str, str]]:
        """The (context, continuation) rows after the few-shot text ``before``."""
        raise NotImplementedError

    def lm_eval_lengths(self, raw: dict[str, Any]) -> tuple[int, ...]:
        """acc_norm's divisor per row: the length of each choice (lm-eval's ``len(choice)``)."""
        raise NotImplementedError


def _json_type(tp: type) -> str:
    return {str: "a string", int: "an integer", list: "a list"}.get(tp, tp.__name__)


def _strings_problem(ex: dict[str, Any], name: str) -> list[str]:
    value = ex.get(name)
    if isinstance(value, list) and (not value or not all(isinstance(v, str) and v.strip() for v in value)):
        return [f"field {name!r} must be a non-empty list of non-empty strings, got {value!r:.80}"]
    return []


def _gold_problem(ex: dict[str, Any], options: str) -> list[str]:
    gold, n = ex.get("gold"), len(ex.get(options) or [])
    if isinstance(gold, int) and not isinstance(gold, bool) and not 0 <= gold < n:
        return [f"gold {gold} is out of range: {options!r} has {n} entries (gold counts from 0)"]
    return []


def _nonempty(ex: dict[str, Any], *names: str) -> list[str]:
    return [f"field {n!r} is empty" for n in names if isinstance(ex.get(n), str) and not ex[n].strip()]


class LanguageModeling(ICLTaskType):
    fields = {"context": str, "continuation": str}
    metric = "icl_lm_accuracy"

    def problems(self, ex):
        return super().problems(ex) or _nonempty(ex, "continuation")

    def solved(self, ex, first):
        return self.context(ex["context"], first) + ex["continuation"]

    def queries(self, ex, first):
        return [(self.context(ex["context"], first), ex["continuation"])]


def _one_of(options: list[int]) -> float | None:
    """The expected accuracy of a uniform guess among each example's options."""
    return sum(1 / n for n in options) / len(options) if options and min(options) > 0 else None


class MultipleChoice(ICLTaskType):
    fields = {"query": str, "choices": list, "gold": int}
    metric = "icl_mc_accuracy"

    def random_baseline(self, options):
        return _one_of(options)

    def problems(self, ex):
        return super().problems(ex) or _strings_problem(ex, "choices") or _gold_problem(ex, "choices")

    def solved(self, ex, first):
        return self.context(ex["query"], first) + ex["choices"][ex["gold"]]

    def queries(self, ex, first):
        context = self.context(ex["query"], first)
        return [(context, choice) for choice in ex["choices"]]

    def gold(self, ex):
        return ex["gold"]

    def lm_eval_solved(self, raw):
        return self.lm_eval_text(raw["query"]) + " " + raw["choices"][raw["gold"]]

    def lm_eval_queries(self, raw, before):
        context = before + self.lm_eval_text(raw["query"])
        return [(context, " " + choice) for choice in raw["choices"]]

    def lm_eval_lengths(self, raw):
        return tuple(len(c) for c in raw["choices"])


class Schema(ICLTaskType):
    fields = {"context_options": list, "continuation": str, "gold": int}
    metric = "icl_mc_accuracy"

    def random_baseline(self, options):
        return _one_of(options)

    def problems(self, ex):
        return (super().problems(ex) or _strings_problem(ex, "context_options")
                or _gold_problem(ex, "context_options") or _nonempty(ex, "continuation"))

    def solved(self, ex, first):
        return self.context(ex["context_options"][ex["gold"]], first) + ex["continuation"]

    def queries(self, ex, first):
        return [(self.context(c, first), ex["continuation"]) for c in ex["context_options"]]

    def gold(self, ex):
        return ex["gold"]

    # lm-eval's multiple-input form: one context per option, the continuation scored after each
    def lm_eval_solved(self, raw):
        return self.lm_eval_text(raw["context_options"][raw["gold"]]) + " " + raw["continuation"]

    def lm_eval_queries(self, raw, before):
        return [(before + self.lm_eval_text(c), " " + raw["continuation"])
                for c in raw["context_options"]]

    def lm_eval_lengths(self, raw):
        return tuple(len(c) for c in raw["context_options"])  # lm-eval divides by the options'


class GenerationWithAnswers(ICLTaskType):
    fields = {"context": str, "answer": str}
    metric = "icl_generation_accuracy"
    mode = "generate"
    options = GENERATION_OPTIONS

    def problems(self, ex):
        out = super().problems(ex) or _nonempty(ex, "answer")
        if "aliases" in ex:
            out += _strings_problem(ex, "aliases") or (
                [] if isinstance(ex["aliases"], list) else ["field 'aliases' must be a list"])
        if self.cfg.cot_delimiter and not isinstance(ex.get("chain_of_thought"), str):
            out.append("missing field 'chain_of_thought' (cot_delimiter is set)")
        elif "chain_of_thought" in ex and not isinstance(ex["chain_of_thought"], str):
            out.append(f"field 'chain_of_thought' must be a string, got {ex['chain_of_thought']!r:.60}")
        return out

    def answer_text(self, ex: dict[str, Any], answer: str | None = None) -> str:
        """An answer (default: the example's) as a few-shot example shows it: after the
        example's chain of thought and the cot delimiter where it has one (LLM Foundry's)."""
        answer = ex["answer"] if answer is None else answer
        if "chain_of_thought" in ex:
            return ex["chain_of_thought"] + self.cfg.cot_delimiter + answer
        return answer

    def solved(self, ex, first):
        return self.context(ex["context"], first) + self.answer_text(ex)

    def queries(self, ex, first):
        return [(self.context(ex["context"], first), "")]

    def answers(self, ex):
        return tuple(dict.fromkeys([ex["answer"], *ex.get("aliases", [])]))
