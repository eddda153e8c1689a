"""``run_eval``: one standalone eval run (``foundryx eval`` and ``eval/eval.py`` end here)."""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundryx.checkpoint.layout import EVAL_DIR, run_folder
from foundryx.errors import ConfigError
from foundryx.eval.ahead import Ahead
from foundryx.eval.compare import Check, compare_scores, comparison_table, load_reference
from foundryx.eval.config import LoadedEvalConfig, load_eval_config
from foundryx.eval.models import EvalModels
from foundryx.eval.one_process import LocalDevice, launched_world_size, seed_all
from foundryx.eval.prepare import read_tasks
from foundryx.eval.quickstart_tasks import SETUP_STEPS
from foundryx.eval.report import EvalResults, markdown_table, results_set, write_results
from foundryx.eval.runner import add_model_results, evaluate_model
from foundryx.runtime.device_choice import composer_name, pick_device
from foundryx.runtime.log_setup import setup_logging
from foundryx.runtime.process_groups import with_host_collectives

log = logging.getLogger("foundryx")

__all__ = ["Comparison", "EvalOutcome", "load_eval_config", "run_eval"]


@dataclass
class Comparison:
    model: str
    reference: str
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def table(self) -> str:
        return comparison_table(self.checks, self.model, self.reference)


@dataclass
class EvalOutcome:
    results: EvalResults
    comparisons: list[Comparison] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    def report(self) -> str:
        """The results table and each comparison, as printed by ``foundryx eval``."""
        parts = [markdown_table(self.results)] + [c.table() for c in self.comparisons]
        if self.paths:
            parts.append("wrote " + ", ".join(str(p) for p in self.paths.values()))
        return "\n\n".join(parts)


def _reference(loaded: LoadedEvalConfig, compare_to: str | None):
    """(label or None, loaded reference file or None); raises ConfigError for neither."""
    if compare_to is None:
        return None, None
    labels = [m.label for m in loaded.models]
    if compare_to in labels:
        if len(labels) < 2:
            raise ConfigError([f"compare_to: {compare_to!r} is the only model; add the model to "
                               "check, or compare against a reference scores YAML"], loaded.source)
        return compare_to, None
    if Path(compare_to).is_file():
        return None, load_reference(compare_to)
    raise ConfigError([f"compare_to: {compare_to!r} is neither a model label of this config "
                       f"({', '.join(labels)}) nor a reference scores file"], loaded.source)


def _compare(results: EvalResults, loaded: LoadedEvalConfig, compare_to: str, ref_label, ref_file,
             tolerance: float) -> list[Comparison]:
    tolerances = loaded.cfg.tolerances
    if ref_label is not None:
        reference = {k: (v, None) for k, v in results.scores[ref_label].items()}
        models = [m for m in results.models if m != ref_label]
    else:
        reference, models, ref_label = ref_file, results.models, Path(compare_to).name
    return [Comparison(m, ref_label, compare_scores(results.scores[m], reference, tolerance, tolerances))
            for m in models]


def precision_note(device: str, precision: str) -> str | None:
    """The line that says a precision runs as fp32 here (Composer autocasts on GPUs only: on
    the CPU its precision context does nothing), or None."""
    if device != "cpu" or precision == "fp32":
        return None
    return (f"precision: {precision} runs as fp32 on the CPU (Composer autocasts on GPUs only); "
            "precision=fp32 says so")


def run_eval(loaded: LoadedEvalConfig, *, compare_to: str | None = None,
             tolerance: float | None = None, dump_examples: int | None = None,
             write: bool = True, ahead: Ahead | None = None) -> EvalOutcome:
    """Evaluate every model of ``loaded`` on every task; write the results (rank 0) and compare
    with the reference (``compare_to``/``tolerance``/``dump_examples`` override the config's).
    ``ahead``: the child process preparing the tasks and drawing the chart
    (:mod:`foundryx.eval.ahead`), ended here."""
    try:
        return _run_eval(loaded, compare_to, tolerance, dump_examples, write, ahead)
    finally:
        if ahead is not None:
            ahead.close()


def _run_eval(loaded: LoadedEvalConfig, compare_to: str | None, tolerance: float | None,
              dump_examples: int | None, write: bool, ahead: Ahead | None) -> EvalOutcome:
    cfg = loaded.cfg
    compare_to = compare_to if compare_to is not None else cfg.compare_to
    tolerance = tolerance if tolerance is not None else cfg.tolerance
    dump = dump_examples if dump_examples is not None else cfg.dump_examples
    ref_label, ref_file = _reference(loaded, compare_to)
    setup_logging(cfg.python_log_level)
    for line in loaded.notes:
        log.info("%s", line)
    world = launched_world_size()
    device, rank, barrier = _processes(world, cfg.device, cfg.precision, cfg.seed)
    if rank == 0:
        for name, options in cfg.setup.items():
            written = SETUP_STEPS[name](**(options or {}))
            log.info("setup %s: wrote %s", name, ", ".join(map(str, written.values())))
    barrier()

    prepared = ahead.result() if ahead is not None else None
    # bad data fails before any model loads
    examples = prepared.examples if prepared is not None else read_tasks(loaded)
    results, dumped = EvalResults(), {}
    models = EvalModels(loaded.models)  # models sharing a Hugging Face base load it once
    order = models.order(loaded.models)
    for i, spec in enumerate(order):
        model, tokenizer = models.load(spec, world)
        device.module_to_device(model)
        task_results = evaluate_model(model, tokenizer, loaded, device, dump=dump, examples=examples,
                                      prepared=prepared)
        add_model_results(results, spec.label, task_results, loaded)
        dumped[spec.label] = [{"model": spec.label, **rec} for r in task_results for rec in r.dumped]
        del model
        if i + 1 < len(order):  # free its memory before the next model loads (0.24 s a call)
            gc.collect()
    models.release()
    results.models = [m.label for m in loaded.models if m.label in results.scores]  # config order
    results.scores = {m: results.scores[m] for m in results.models}
    dumped = [rec for m in results.models for rec in dumped[m]]
    outcome = EvalOutcome(results)
    if compare_to is not None:
        outcome.comparisons = _compare(results, loaded, compare_to, ref_label, ref_file, tolerance)
    if write and rank == 0:
        outcome.paths = _write_outputs(outcome, dumped if dump else None,
                                       cfg.output_dir or default_output_dir(loaded), loaded.source,
                                       ahead.draw if ahead is not None else None)
    return outcome


def _processes(world: int, device_name: str | None, precision: str,
               seed: int) -> tuple[Any, int, Any]:
    """(device, this process's rank, a barrier), seeded, for ``world`` processes. One: a
    :class:`~foundryx.eval.one_process.LocalDevice`, no Composer import; several (``composer
    -n N``): Composer's device and process group."""
    if world == 1:
        device: Any = LocalDevice(pick_device(device_name, say=True))
    else:
        from composer.utils import dist, get_device  # Composer: only for several processes

        device = with_host_collectives(get_device(composer_name(pick_device(device_name, say=True))),
                                       world)
    note = precision_note(device.name, precision)
    if note:
        log.info(note)
    seed_all(seed)
    if world == 1:
        return device, 0, lambda: None
    if not dist.is_initialized():
        dist.initialize_dist(device)
    return device, dist.get_global_rank(), dist.barrier


def default_output_dir(loaded: LoadedEvalConfig) -> str:
    """``output_dir`` when the config sets none: the ``eval/`` folder of the run folder that the
    first checkpoint or adapter among the models belongs to (``runs/x/eval`` for
    ``runs/x/checkpoints`` or ``runs/x/export/adapter``), else ``eval_results``; said in one line."""
    for spec in loaded.models:
        for path in (spec.checkpoint, spec.adapter):
            run = run_folder(path) if path else None
            if run is not None:
                out = run / EVAL_DIR
                log.info("eval: results to %s (the run folder of model %s; output_dir= to change)",
                         out, spec.label)
                return str(out)
    log.info("eval: results to eval_results (no model is a checkpoint or an adapter in a run "
             "folder; output_dir= to change)")
    return "eval_results"


def _write_outputs(outcome: EvalOutcome, dumped: list[dict] | None, output_dir: str,
                   source: str, draw: Any = None) -> dict[str, Path]:
    """The results files, each comparison and the dumped examples, as one set: all replace the
    previous ones or, when one cannot be written, none does (EvalError naming ``output_dir``)."""
    out = Path(output_dir)
    with results_set(out, outcome.results) as stage:
        paths = write_results(outcome.results, out, source, stage, draw)
        for c in outcome.comparisons:
            path = out / f"comparison_{c.model}.md".replace("/", "_")
            stage(path).write_text(c.table() + "\n", encoding="utf-8")
            paths[f"comparison {c.model}"] = path
        if dumped is not None:
            path = out / "examples.jsonl"
            stage(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in dumped),
                                   encoding="utf-8")
            paths["examples"] = path
    return paths
