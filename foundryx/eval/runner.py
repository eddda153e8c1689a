"""Evaluate a model on ICL tasks outside training: the loop, the example dumps, the results.

The loop calls the Composer model's ``eval_forward`` and ``update_metric`` exactly as Composer's
evaluators do during training, so both give the same numbers. With several processes
(``composer -n N eval/eval.py ...``) each evaluates its share of every task and the metrics
gather the rows (see :mod:`foundryx.eval.data`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from foundryx import registry
from foundryx.eval.ahead import Prepared
from foundryx.eval.batching import generation_rows
from foundryx.eval.config import LoadedEvalConfig
from foundryx.eval.data import build_dataloader
from foundryx.eval.examples import Example
from foundryx.eval.gauntlet import gauntlet_scores
from foundryx.eval.generate import (
    decode_generations,
    fast_path_problem,
    generation_model,
    greedy_generate,
)
from foundryx.eval.icl_rows import (
    GenerationRows,
    LanguageModelingRows,
    LMEvalRows,
    MultipleChoiceRows,
    macro_average,
)
from foundryx.eval.models import model_max_len
from foundryx.eval.one_process import precision_context, rank_and_world
from foundryx.eval.prepare import PreparedTask, prepare_task
from foundryx.eval.report import EvalResults
from foundryx.eval.score import scoring_forward
from foundryx.eval.task_processes import choose_task_processes, run_in_processes
from foundryx.eval.task_threads import choose_task_threads, run_tasks

log = logging.getLogger(__name__)


@dataclass
class TaskResult:
    key: str
    score: float
    examples: int
    categories: dict[str, float] = field(default_factory=dict)  # with has_categories
    outcomes: dict[int, bool] = field(default_factory=dict)  # example id -> correct
    dumped: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # more scores, e.g. acc_norm
    random_baseline: float | None = None  # the accuracy of guessing, where the task type knows it


def _row_records(task: PreparedTask, tokenizer: Any, batch: dict[str, Any], info: dict[str, Any],
                 limit: int) -> list[dict[str, Any]]:
    """One record per primary row of an example below ``limit``."""
    out = []
    for i, (eid, primary) in enumerate(zip(batch["example_id"].tolist(), batch["primary"].tolist())):
        if not primary or eid >= limit:
            continue
        ex = task.examples[eid]
        if task.task_type.mode == "generate":
            out.append({"example": eid, "prompt": ex.rendered.queries[0][0].rstrip(),
                        "answers": list(ex.rendered.answers), "output": info["output"][i],
                        "cleaned": info["cleaned"][i], "correct": info["correct"][i]})
            continue
        choice = int(batch["choice"][i])
        enc = ex.rows[choice]
        context, continuation = ex.rendered.queries[choice]
        rec = {"example": eid, "choice": choice, "context": context.rstrip(),
               "continuation": " " + continuation.strip(),
               "scored_tokens": tokenizer.convert_ids_to_tokens(list(enc.ids[enc.cont_start:enc.cont_end]))}
        if enc.truncated:
            rec["tokens_cut_on_the_left"] = enc.truncated
        for k in ("loss", "loglik", "tokens", "correct"):
            if k in info:
                rec[k] = info[k][i]
        if "predicted" in info:
            rec["predicted_tokens"] = tokenizer.convert_ids_to_tokens(info["predicted"][i])
        out.append(rec)
    return out


def _group_records(task: PreparedTask, rows: list[dict[str, Any]], outcomes: dict[int, bool]) -> list[dict]:
    """Per-example dump records: the example's rows (one per choice) and its outcome."""
    by_example: dict[int, list[dict]] = {}
    for r in rows:
        by_example.setdefault(r.pop("example"), []).append(r)
    out = []
    for eid in sorted(by_example):
        ex = task.examples[eid].rendered
        rec = {"task": task.key, "example": eid, "line": ex.line, "category": ex.category or None}
        if task.task_type.mode == "generate":
            rec.update(by_example[eid][0])
        else:
            rows = sorted(by_example[eid], key=lambda r: r["choice"])
            rec.update({"gold": ex.gold, "rows": rows, "correct": outcomes.get(eid)})
            if "loss" in rows[0]:
                rec["chosen"] = min(rows, key=lambda r: (r["loss"], r["choice"]))["choice"]
            elif "loglik" in rows[0]:
                rec["chosen"] = min(rows, key=lambda r: (-r["loglik"], r["choice"]))["choice"]
        out.append(rec)
    return out


def _generator(model: Any, task: PreparedTask, tokenizer: Any, world: int) -> Any:
    """For a generation task, a function batch -> texts by :func:`greedy_generate`; None where
    Composer's ``eval_forward`` (Hugging Face ``generate``) runs it instead: with several
    processes (``generate`` keeps them in step for FSDP) or a model the fast path does not
    cover (said in one line)."""
    if task.task_type.mode != "generate" or world > 1:
        return None
    if getattr(model, "native", False):  # foundryx's own Llama (foundryx.eval.native_models)
        return lambda batch: decode_generations(tokenizer, model.generate(batch))
    hf = generation_model(model)
    problem = fast_path_problem(hf)
    if problem is not None:
        log.info("%s: generating with Hugging Face generate (%s)", task.key, problem)
        return None

    def generate(batch: dict[str, Any]) -> list[str]:
        kw = batch["generation_kwargs"]
        tokens = greedy_generate(hf, tokenizer, batch["input_ids"], batch["attention_mask"],
                                 kw["max_new_tokens"], kw.get("eos_token_id"),
                                 batch["icl_options"]["stop_sequences"])
        return decode_generations(tokenizer, tokens)

    return generate


# in one process, foundryx's own ICL metrics (by their registry targets) run their rules on
# plain lists (foundryx.eval.icl_rows): the same numbers without importing torchmetrics
_LOCAL_ROWS = {"foundryx.eval.metrics:ICLLanguageModelingAccuracy": LanguageModelingRows,
               "foundryx.eval.metrics:ICLMultipleChoiceAccuracy": MultipleChoiceRows,
               "foundryx.eval.metrics:ICLLMEvalAccuracy": LMEvalRows,
               "foundryx.eval.metrics:ICLGenerationAccuracy": GenerationRows}
_LOCAL_TARGETS = {cls: target for target, cls in _LOCAL_ROWS.items()}
# the metrics that read logits only at continuation positions: foundryx's own scoring ones
# (a plugin's may read others, a subclass too)
_SCORED_METRICS = {t for t, rows in _LOCAL_ROWS.items() if rows is not GenerationRows}


def _target(metric: Any) -> str:
    """``module:class`` of ``metric`` (of the registry class for plain-list rows)."""
    cls = type(metric)
    return _LOCAL_TARGETS.get(cls) or f"{cls.__module__}:{cls.__qualname__}"


def new_metric(name: str, world: int) -> Any:
    """A fresh metric of the ``metrics`` registry's ``name``; for one of foundryx's own ICL
    metrics in one process, its rules on plain lists (no torchmetrics import)."""
    entry = registry.metrics.entry(name)
    local = _LOCAL_ROWS.get(entry.target) if world == 1 else None
    return local() if local is not None else entry.load()()


def _scorer(model: Any, task: PreparedTask, metric: Any) -> Any:
    """For a scored task with a built-in ICL metric, a function batch -> (logits, compact
    batch) computing vocabulary logits only where the metric reads them
    (:mod:`foundryx.eval.score`); None where Composer's ``eval_forward`` runs it."""
    if task.task_type.mode == "generate" or _target(metric) not in _SCORED_METRICS:
        return None
    if getattr(model, "native", False):
        return model.scoring_forward()
    return scoring_forward(generation_model(model))


def progress_bar_here() -> bool:
    """Whether a progress bar can redraw in place: stderr (where tqdm writes) is a terminal.
    Piped or redirected, its carriage returns would leave the bar's last state on the line the
    results table starts on, so each task gets one log line when it is done instead."""
    return sys.stderr.isatty()


def evaluate_task(model: Any, task: PreparedTask, tokenizer: Any, *, batch_size: int, device: Any,
                  precision: str = "fp32", dump: int = 0, progress: bool | None = None,
                  alone: bool = True) -> TaskResult:
    """Accuracy of ``model`` (a Composer HuggingFaceModel) on one prepared task; ``progress``
    (the config's ``progress_bar``): None: a bar on a terminal, else a line when the task is
    done (see :func:`progress_bar_here`); True/False: always/never a bar. Not ``alone``
    (other tasks run at once, :mod:`foundryx.eval.task_threads`): the line, never a bar."""
    rank, world = rank_and_world()
    here = progress_bar_here()
    bar = rank == 0 and alone and (progress is True or (progress is None and here))
    line = rank == 0 and (progress is None and not here if alone else progress is not False)
    started = time.perf_counter()
    metric = device.module_to_device(new_metric(task.metric, world))
    model.eval()
    generate = _generator(model, task, tokenizer, world)
    loader = build_dataloader(task, tokenizer, task.cfg.batch_size or batch_size, rank, world,
                              hf_stopping=generate is None)
    rows: list[dict[str, Any]] = []
    score = _scorer(model, task, metric)
    with torch.inference_mode():
        for batch in tqdm(loader, desc=task.key, disable=not bar, leave=False):
            batch = device.batch_to_device(batch)
            with precision_context(precision):
                if generate is not None:
                    metric.update(batch=batch, outputs=generate(batch), labels=None)
                elif score is not None:
                    logits, compact = score(batch)
                    metric.update(batch=compact, outputs=logits, labels=None)
                else:
                    outputs = model.eval_forward(batch)
                    model.update_metric(batch, outputs, metric)
            if dump:
                rows += _row_records(task, tokenizer, batch, metric.last_update, dump)
    more = {}
    with metric.sync_context():  # every process's rows
        ids, correct, _ = metric.outcomes()
        by_category = metric.category_scores()
        if hasattr(metric, "acc_norm"):
            more["acc_norm"] = metric.acc_norm()
    outcomes = dict(zip(ids.tolist(), correct.tolist()))
    cats = {}
    if task.cfg.has_categories:
        cats = {task.categories[c]: s for c, s in sorted(by_category.items())}
    if world > 1 and dump:
        import torch.distributed as tdist

        parts: list[Any] = [None] * world
        tdist.all_gather_object(parts, rows)
        rows = [r for part in parts for r in part]
    score = macro_average(by_category)
    if line:
        log.info("%s: %d examples, score %.4f (%.1f s)", task.key, len(task.examples), score,
                 time.perf_counter() - started)
    baseline = task.task_type.random_baseline([len(ex.rows) for ex in task.examples])
    return TaskResult(task.key, score, len(task.examples), cats, outcomes,
                      _group_records(task, rows, outcomes) if dump else [], more, baseline)


def evaluate_model(model: Any, tokenizer: Any, loaded: LoadedEvalConfig, device: Any, *,
                   dump: int = 0, examples: dict[str, list[Example]] | None = None,
                   prepared: Prepared | None = None) -> list[TaskResult]:
    """Every task of ``loaded`` at every few-shot count, for one model (``examples``: the
    tasks' examples from :func:`read_tasks`; read here without; ``prepared``: tasks prepared
    by :mod:`foundryx.eval.ahead`, used where they are this model's)."""
    cfg = loaded.cfg
    limit = model_max_len(model)
    if limit is not None and limit < cfg.max_seq_len:
        log.info("rows are cut to the model's %d tokens (max_seq_len is %d)", limit, cfg.max_seq_len)
    where = (getattr(device, "name", "cpu"), rank_and_world()[1], torch.get_num_threads(),
             getattr(model, "native", False))
    processes, why = choose_task_processes(cfg.task_processes, cfg.task_threads, *where)
    if processes > 1:
        at_once = cfg.task_threads if isinstance(cfg.task_threads, int) else 1
    else:
        at_once, why = choose_task_threads(cfg.task_threads, *where)
    if len(loaded.tasks) > 1:
        log.info("%s", why)
    generation_size: int | None = None  # picked at the first generation task, said once

    def batch_size(task: PreparedTask) -> int:
        nonlocal generation_size
        if task.task_type.mode != "generate":
            return cfg.device_eval_batch_size
        if generation_size is None:
            hf_cfg = getattr(generation_model(model), "config", None)
            vocab = getattr(hf_cfg, "vocab_size", None) or len(tokenizer)
            tokens = min(cfg.max_seq_len, limit or cfg.max_seq_len)
            generation_size, said = generation_rows(cfg.generation_batch_size,
                                                    cfg.device_eval_batch_size, model, tokens, vocab)
            log.info("%s", said)
        return generation_size

    def evaluate(task: PreparedTask) -> TaskResult:
        return evaluate_task(model, task, tokenizer, batch_size=batch_size(task), device=device,
                             precision=cfg.precision, dump=dump, progress=cfg.progress_bar,
                             alone=at_once == 1 and processes == 1)

    def each_task() -> Iterator[PreparedTask]:
        """Each task at each shot count, prepared as it is reached (one at a time holds one
        task's rows in memory, as before several ran at once)."""
        for task_cfg in loaded.tasks:
            if cfg.skip_missing_data and not Path(task_cfg.dataset_uri).is_file():
                log.info("skipping task %s: %s is absent (skip_missing_data)", task_cfg.label,
                         task_cfg.dataset_uri)
                continue
            tasks = prepared.tasks_for(task_cfg.label, tokenizer, limit) if prepared else None
            if tasks is None:
                tasks = prepare_task(task_cfg, tokenizer, cfg.max_seq_len, cfg.icl_max_examples,
                                     limit, (examples or {}).get(task_cfg.label))
            yield from tasks

    if at_once == 1 and processes == 1:
        return [evaluate(task) for task in each_task()]
    tasks = list(each_task())
    for task in tasks:  # the generation batch picked (and said) once, before the others start
        batch_size(task)
    if processes == 1:
        return run_tasks(tasks, lambda i: evaluate(tasks[i]), at_once)
    return run_in_processes(tasks, lambda i: evaluate(tasks[i]), processes, at_once)


def add_model_results(results: EvalResults, label: str, task_results: list[TaskResult],
                      loaded: LoadedEvalConfig) -> None:
    """Record one model's task, category and gauntlet scores."""
    for r in task_results:
        results.add(label, r.key, r.score, "task", r.examples)
        if r.random_baseline is not None:  # the gauntlet's stated baseline, if any, wins below
            results.baselines[r.key] = r.random_baseline
        for name, score in r.categories.items():
            results.add(label, f"{r.key}/{name}", score, "category")
        for name, score in r.metrics.items():
            results.add(label, f"{r.key}/{name}", score, "metric")
    if loaded.gauntlet is not None:
        scores = {r.key: r.score for r in task_results}
        sizes = {r.key: r.examples for r in task_results}
        for name, score in gauntlet_scores(loaded.gauntlet, scores, sizes).items():
            results.add(label, f"gauntlet/{name}", score, "gauntlet")
        results.baselines.update(loaded.gauntlet.baselines)
        results.groups = {name: [b.key for b in benches]
                          for name, benches in loaded.gauntlet.categories.items()}
