"""ICL evaluation inside training: ``icl_tasks`` and ``eval_gauntlet`` of a run config become
Composer evaluators (labels ``task/N-shot``, run at ``eval_interval``) and a gauntlet callback
(logs ``icl/gauntlet/<name>``)."""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger

from foundryx import registry
from foundryx.config import TrainConfig
from foundryx.config.schema import tp_degree
from foundryx.errors import ConfigError
from foundryx.eval.data import build_dataspec, data_parallel_share, prepare_task
from foundryx.eval.gauntlet import Gauntlet, gauntlet_scores, load_gauntlet
from foundryx.eval.generate_tp import use_sequence_parallel_generate
from foundryx.eval.models import model_max_len
from foundryx.eval.task_config import load_icl_tasks

log = logging.getLogger(__name__)


def add_icl_metrics(model: Any, metric_keys: set[str]) -> dict[str, str]:
    """Give a Composer HuggingFaceModel the ICL metrics; returns registry key -> metric name."""
    if not hasattr(model, "val_metrics"):
        raise ConfigError([f"icl_tasks: ICL eval needs a Hugging Face-style Composer model; "
                           f"{type(model).__name__} is not one"])
    model.val_metrics = model.val_metrics or {}
    names = {}
    for key in sorted(metric_keys):
        cls = registry.metrics.get(key)
        model.val_metrics.setdefault(cls.__name__, cls())
        names[key] = cls.__name__
    return names


def build_icl_evaluators(cfg: TrainConfig, tokenizer: Any, model: Any,
                         batch_size: int) -> tuple[list[Any], list[Any]]:
    """``(evaluators, callbacks)`` for the run's ICL tasks and gauntlet (empty without them)."""
    from composer.core import Evaluator
    from composer.utils import dist

    if cfg.icl_tasks is None:
        if cfg.eval_gauntlet is not None:
            raise ConfigError(["eval_gauntlet: needs icl_tasks to score"])
        return [], []
    tasks = load_icl_tasks(cfg.icl_tasks, cfg.icl_data_root)
    limit = model_max_len(model)
    prepared = [p for t in tasks for p in prepare_task(
        t, tokenizer, cfg.max_seq_len or limit or 2048, cfg.icl_max_examples, limit)]
    tp = tp_degree(cfg.parallelism)
    generating = sorted({p.cfg.label for p in prepared if p.task_type.mode == "generate"})
    if tp > 1 and generating:  # each step's input a multiple of tp long
        use_sequence_parallel_generate(model, tp)
    names = add_icl_metrics(model, {p.metric for p in prepared})
    # under tp the ranks of a group read the same examples, padded to a multiple of tp
    rank, world, counts = data_parallel_share(dist.get_global_rank(), dist.get_world_size(), tp)
    evaluators = []
    for p in prepared:
        size = p.cfg.batch_size or batch_size
        evaluators.append(Evaluator(
            label=p.key,
            dataloader=build_dataspec(p, tokenizer, size, rank, world, counts, pad_multiple=tp),
            metric_names=[names[p.metric]],
            subset_num_batches=-1,  # the whole task, whatever eval_subset_num_batches says
            # one forward per batch: Composer counts rows, a batch has one row per choice
            device_eval_microbatch_size=size * max(len(e.rows) for e in p.examples),
        ))
    log.info("ICL eval: %d evaluators (%s)", len(evaluators), ", ".join(p.key for p in prepared))
    callbacks = []
    if cfg.eval_gauntlet is not None:
        gauntlet = load_gauntlet(cfg.eval_gauntlet, {p.key for p in prepared})
        callbacks.append(GauntletCallback(gauntlet, {p.key: names[p.metric] for p in prepared},
                                          {p.key: len(p.examples) for p in prepared}))
    return evaluators, callbacks


class GauntletCallback(Callback):
    """Logs ``icl/gauntlet/<name>`` after each evaluation: during training and after
    ``Trainer.eval()``."""

    def __init__(self, gauntlet: Gauntlet, metric_names: dict[str, str], sizes: dict[str, int]):
        self.gauntlet, self.metric_names, self.sizes = gauntlet, metric_names, sizes

    def eval_standalone_end(self, state: State, logger: Logger) -> None:
        self.eval_after_all(state, logger)

    def eval_after_all(self, state: State, logger: Logger) -> None:
        scores = {}
        for key, name in self.metric_names.items():
            metric = state.eval_metrics.get(key, {}).get(name)
            if metric is not None:
                scores[key] = float(metric.compute())
        composite = gauntlet_scores(self.gauntlet, scores, self.sizes)
        logger.log_metrics({f"icl/gauntlet/{k}": v for k, v in composite.items()})
