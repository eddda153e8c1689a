"""``train(cfg)``: build every part through the registries and run ``Trainer.fit()``.

``train.py`` at the repository root and ``foundryx train`` both end here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from composer import Trainer
from composer.core import Evaluator
from composer.utils import dist, get_device, reproducibility

from foundryx import builders
from foundryx.algorithms import check_algorithms
from foundryx.callbacks.cpu_autocast import CpuAutocast
from foundryx.callbacks.preemption import Preemption
from foundryx.checkpoint.layout import complete_checkpoints
from foundryx.config import LoadedConfig, TrainConfig, load_config
from foundryx.config.components import component_options
from foundryx.config.hardware import machine_problems
from foundryx.config.load import read_resolved
from foundryx.config.schema import COMPONENT_SECTIONS, NAMED_SECTIONS
from foundryx.data.quickstart import STAMP as QUICKSTART_STAMP
from foundryx.data.workers import unraisable_deaths_kept_quiet, worker_death_error
from foundryx.doctor.facts import environment
from foundryx.errors import ConfigError, FoundryxError
from foundryx.eval.config import run_config_icl_problems
from foundryx.eval.evaluators import build_icl_evaluators
from foundryx.loggers.console import ConsoleLogger
from foundryx.loggers.jsonl import JSONLLogger
from foundryx.models.peft.frozen_base import storage_on_rank
from foundryx.parallel.tp import missing_op_error
from foundryx.plan.census import NotPlannable
from foundryx.plan.checkpointing import choose_mode, is_auto, with_mode
from foundryx.plan.node import machine, processes_per_node
from foundryx.plan.planner import plan_here
from foundryx.plan.prelaunch import check_fits, gpu_facts, host_problem, longest_line
from foundryx.plan.render import render
from foundryx.runtime import host_heap, known_warnings, preempt
from foundryx.runtime.device_choice import composer_name, pick_device
from foundryx.runtime.devices import machine_from_torch
from foundryx.runtime.log_setup import setup_logging
from foundryx.runtime.process_groups import with_host_collectives
from foundryx.runtime.run_summary import RunFacts, summary

log = logging.getLogger("foundryx")

# Checks of a run config by layers above foundryx.config, run with its own by load_run_config.
RUN_CONFIG_CHECKS = (run_config_icl_problems, builders.tp_run_problems,
                     builders.frozen_base_checkpoint_problems)


def load_run_config(path: str | Path, overrides: list[str] | None = None,
                    world_size: int | None = None) -> LoadedConfig:
    """``load_config`` with every check of a run config, the ICL tasks' included (what
    ``foundryx train`` and ``--dry-run`` report)."""
    return load_config(path, overrides, world_size, checks=RUN_CONFIG_CHECKS)


def dry_run(path: str | Path, overrides: list[str] | None = None) -> tuple[str, list[str]]:
    """What ``foundryx train --dry-run`` shows, and the problems that would stop the run.

    The text is the resolved config, the derived numbers and the plan (the per-device memory
    on this machine's GPU, or on the default GPU where there is none). It is shown even when
    sections have problems that do not stop it from being resolved, e.g. a data folder that
    exists only on the cluster: those sections are then left unchecked for the text, and
    their problems are returned with every other, as are a ``device`` or ``precision`` this
    machine cannot run and the problems found while building the model (on the meta device,
    for the plan). A config that cannot be resolved at all raises its ConfigError, as
    ``foundryx train`` would."""
    problems: list[str] = []
    world = dry_run_world(path, overrides)
    try:
        loaded = load_run_config(path, overrides, world)
    except ConfigError as e:
        problems = e.problems
        bad = {p.split(":", 1)[0].split(".", 1)[0] for p in problems}
        sections = [s for s in (*COMPONENT_SECTIONS, *NAMED_SECTIONS) if s not in bad]
        try:
            loaded = load_config(path, overrides, world, component_sections=sections)
        except ConfigError:
            raise e from None
    # A dry run checks the config for the machine the run will have (a login node has no GPU):
    # what this machine could not run is a note, not a problem; a real run here stops on it.
    c = loaded.cfg
    elsewhere = machine_problems(machine_from_torch(), c.device, c.precision, c.float8.enabled)
    parts = [f"# resolved config of {loaded.source}", loaded.to_yaml(), "# derived numbers",
             loaded.derived.table(), "# plan (`foundryx plan` for other devices)"]
    try:
        plan = plan_here(loaded)
        parts.append(render(plan))
        on_gpu = plan.device != "cpu"  # the plan's GPU: this machine's, else the run's
        if not plan.device_fits and on_gpu and loaded.cfg.plan_check:  # train stops there
            problems.append(f"plan_check: the run needs an estimated {plan.per_device_bytes / 2**30:.1f} "
                            f"GiB per device and the {plan.device} has {plan.capacity / 2**30:.1f} "
                            "GiB; see the plan's suggestions above")
        if not plan.host_fits and on_gpu and loaded.cfg.plan_check:
            problems.append(host_problem(plan) + "; see the plan's host fixes above")
        if not plan.fits and on_gpu and loaded.cfg.plan_check:
            problems += longest_line(plan)
    except NotPlannable as e:  # a plugin model, ...: it may train all the same
        parts.append(f"no plan: {e}")
    except ConfigError as e:  # building the model: e.g. LoRA target_modules that match nothing
        parts.append("no plan: the model cannot be built; see the problems below")
        # the options check may have said it already, under another path: one line each,
        # under the longer (fuller) path
        best: dict[str, str] = {}
        for p in [*problems, *e.problems]:
            said = p.split(": ", 1)[-1]
            best[said] = max(best.get(said, ""), p, key=len)
        problems[:] = list(dict.fromkeys(best[p.split(": ", 1)[-1]] for p in [*problems, *e.problems]))
    except FoundryxError as e:  # a hub name not cached, ...: the run would stop there too
        parts.append("no plan: the model cannot be built; see the problems below")
        problems.append(f"model: {e}")
    parts += [f"note: this machine could not run it as it is ({p}); the dry run checked the "
              "config for the machine the run will have" for p in elsewhere]
    parts += first_rows_checked(loaded, problems)
    return "\n".join(parts), problems


DRY_RUN_ROWS = 1000  # examples a dry run reads of each dataset that says how to check them


def first_rows_checked(loaded: LoadedConfig, problems: list[str]) -> list[str]:
    """A dry run's look at the data: each loader whose options can check their first rows
    (``first_rows_problems``, e.g. the ``finetuning`` loader's chat lines, with the run's own
    message and file:line) does so; their problems join ``problems``. The lines to show."""
    shown, tokenizer = [], None
    for section in ("train_loader", "eval_loader"):
        options = component_options(COMPONENT_SECTIONS[section], getattr(loaded.cfg, section))
        check = getattr(options, "first_rows_problems", None)
        if not callable(check) or any(p.startswith(f"{section}.") for p in problems):
            continue  # no such check, or the section's options are wrong already
        try:
            tokenizer = tokenizer or builders.build_tokenizer(loaded.cfg)
        except FoundryxError as e:  # the run would stop there too
            said = f"tokenizer: {e}"
            problems += [said] if said not in problems else []
            return shown
        found, what = check(tokenizer, DRY_RUN_ROWS)
        problems += [f"{section}.{p}" for p in found]
        shown.append(f"# data: {section}: {what}")
    return shown


def dry_run_world(path: str | Path, overrides: list[str] | None) -> int | None:
    """The world size a dry run plans: the launcher's (WORLD_SIZE), else the recipe's node
    (``node.gpus`` x ``node.nodes``), else one process (None)."""
    if "WORLD_SIZE" in os.environ:
        return None
    data, _ = read_resolved(Path(path), overrides)  # its problems: load_run_config's
    target = machine(data.get("node"), None, None, None, None)
    return target.gpus * target.nodes if target.gpus else None


def resolve_auto_mode(loaded: LoadedConfig, picked: str,
                      facts: tuple[str, int, str] | None = None) -> LoadedConfig:
    """``loaded`` with ``activation_checkpointing.mode: auto`` decided for this process's device
    (``picked``: Composer's gpu or cpu; ``facts``: the GPU's name, bytes and kind, default this
    process's): selective where the planner's peak with it fits, else full; one log line. A
    model the planner cannot size takes full, said in the line."""
    if picked != "gpu":
        choice = choose_mode(loaded, 1, "cpu", 0, "cpu")
    else:
        name, capacity, kind = facts or gpu_facts()
        try:
            choice = choose_mode(loaded, processes_per_node(None), kind, capacity, name)
        except NotPlannable as e:
            log.info("activation_checkpointing.mode: auto -> full (the planner cannot size this "
                     "run: %s)", e)
            return with_mode(loaded, "full")
    log.info("%s", choice.line)
    return with_mode(loaded, choice.mode)


def train(loaded: LoadedConfig):
    """Train a model as ``loaded`` describes; return the fitted Composer Trainer."""
    cfg, derived = loaded.cfg, loaded.derived
    cannot = machine_problems(machine_from_torch(), cfg.device, cfg.precision, cfg.float8.enabled)
    if cannot:  # before anything is set up or written
        raise ConfigError(cannot, source=loaded.source)
    setup_logging(cfg.python_log_level)
    known_warnings.install()
    picked = composer_name(pick_device(cfg.device, say=True))  # gpu or cpu, Composer's names
    host_heap.configure(cfg.host_heap, picked)  # before the load and the steps free anything
    if is_auto(loaded):  # activation_checkpointing.mode: auto, decided once, said in one line
        loaded = resolve_auto_mode(loaded, picked)
        cfg = loaded.cfg
    if picked == "gpu" and cfg.plan_check:
        check_fits(loaded)  # before anything is built on the GPU: stop a run that cannot fit
    device = with_host_collectives(get_device(picked), derived.world_size)
    if derived.world_size > 1 and not dist.is_initialized():
        dist.initialize_dist(device, timeout=cfg.dist_timeout)
    reproducibility.seed_all(cfg.seed)
    precision, autocast = composer_precision(cfg.precision, picked)

    tokenizer = builders.build_tokenizer(cfg)
    model = builders.build_model(cfg, tokenizer)  # a LoRA target that matches nothing: said here
    log.info("derived numbers:\n%s", derived.table())  # after the model's own problems
    algorithms = builders.build_named("algorithms", cfg.algorithms)
    check_algorithms(algorithms, model)  # surgery that does not apply: refused before any write
    model = builders.build_parallelism(cfg, model)  # FSDP2 etc., before the optimizer sees it
    held = storage_on_rank(model)
    if held:
        log.info("frozen_base on this rank: %s", json.dumps(held))
    builders.replicate_data_for_tp(cfg)
    train_loader = builders.build_dataloader(
        cfg.train_loader, tokenizer, derived.device_train_batch_size
    )
    evaluators = []
    if cfg.eval_loader is not None:
        eval_loader = builders.build_dataloader(
            cfg.eval_loader, tokenizer, derived.device_eval_batch_size
        )
        metric_names = list(model.get_metrics(is_train=False))
        evaluators.append(Evaluator(label="eval", dataloader=eval_loader, metric_names=metric_names))
    icl_evaluators, icl_callbacks = build_icl_evaluators(
        cfg, tokenizer, model, derived.device_eval_batch_size
    )
    evaluators += icl_evaluators
    optimizer = builders.build_optimizer(cfg, model)
    run_name = builders.stable_run_name(cfg, loaded.source)
    checkpointer = builders.build_checkpointer(cfg, run_name)  # saves, autoresume, load_path
    loggers = build_loggers(cfg)

    trainer = Trainer(
        run_name=run_name,
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=evaluators or None,
        max_duration=cfg.max_duration,
        optimizers=optimizer,
        schedulers=builders.build_scheduler(cfg),
        algorithms=algorithms,
        callbacks=builders.build_named("callbacks", run_callbacks(cfg)) + icl_callbacks + autocast
        + ([checkpointer] if checkpointer else []),
        loggers=loggers,
        precision=precision,
        device=device,
        device_train_microbatch_size=derived.device_train_microbatch_size,
        # without evaluators these only make Composer warn that they have no effect: its defaults
        eval_interval=cfg.eval_interval if evaluators else 1,
        eval_subset_num_batches=cfg.eval_subset_num_batches if evaluators else -1,
        seed=cfg.seed,
        console_log_interval=cfg.console_log_interval,
        log_to_console=False,  # foundryx's console logger (build_loggers) prints instead
        progress_bar=False,
        dist_timeout=cfg.dist_timeout,
    )
    if not any(isinstance(c, Preemption) for c in trainer.state.callbacks):
        preempt.watch((), training=False)  # preemption off: the signals are Composer's again
    # run.json beside the jsonl metrics (foundryx report), the W&B config, ...
    trainer.logger.log_hyperparameters({"foundryx/config": loaded.resolved,
                                        "foundryx/environment": environment()})
    started, first_batch = time.monotonic(), int(trainer.state.timestamp.batch)
    fit(trainer, cfg, eval_first=cfg.eval_first and bool(evaluators), checkpointer=checkpointer)
    if dist.get_global_rank() == 0:
        text = summary(run_facts(trainer, loaded, first_batch, time.monotonic() - started))
        console = next((lg for lg in loggers if isinstance(lg, ConsoleLogger)), None)
        console.write(text) if console is not None else log.info("%s", text)
    return trainer


def composer_precision(precision: str, device: str) -> tuple[str, list[Any]]:
    """The precision Composer gets and the callbacks that do the rest: ``amp_bf16`` on a CPU
    is Composer's ``fp32`` plus :class:`CpuAutocast` (Composer refuses it there), said in one
    line; FSDP2's mixed-precision policy follows the config's precision either way."""
    if device == "cpu" and precision == "amp_bf16":
        if dist.get_global_rank() == 0:
            log.info("precision: amp_bf16 on the CPU: Composer trains on a CPU in fp32 only, so "
                     "foundryx gives it fp32 and runs the forward and loss under torch's CPU "
                     "autocast to bf16 (FSDP2's mixed precision is amp_bf16's)")
        return "fp32", [CpuAutocast()]
    return precision, []


def run_callbacks(cfg: TrainConfig) -> dict[str, dict[str, Any] | None]:
    """The ``callbacks`` section, with ``preemption`` added wherever a ``save_folder`` is set
    (said in one log line): a scheduler's SIGTERM then ends the run with a checkpoint, not
    with exit 143. A callback set to null is off: ``callbacks.preemption: null``."""
    callbacks = {name: kwargs for name, kwargs in cfg.callbacks.items() if kwargs is not None}
    if cfg.save_folder and "preemption" not in cfg.callbacks:  # null (off) or the user's own
        callbacks["preemption"] = {}
        if dist.get_global_rank() == 0:
            log.info("preemption: on (save_folder is set): on SIGTERM or SIGUSR1 the run saves a "
                     "checkpoint after the current batch and exits 75 (preempted, saved); "
                     "callbacks.preemption: null turns it off")
    return callbacks


def build_loggers(cfg: TrainConfig) -> list[Any]:
    """The ``loggers`` section's loggers, and the console logger when ``log_to_console``
    (``console_log_interval`` its interval; ``python_log_level: debug`` prints every metric)."""
    sections = {name: dict(kwargs or {}) for name, kwargs in cfg.loggers.items()}
    if "console" in sections:
        sections["console"].setdefault("log_interval", cfg.console_log_interval)
    loggers = builders.build_named("loggers", sections)
    if cfg.log_to_console and not any(isinstance(lg, ConsoleLogger) for lg in loggers):
        debug = (cfg.python_log_level or "").lower() == "debug"
        loggers.append(ConsoleLogger(log_interval=cfg.console_log_interval,
                                     level="debug" if debug else "info",
                                     progress_bar=cfg.progress_bar))
    return loggers


def run_facts(trainer: Trainer, loaded: LoadedConfig, first_batch: int, seconds: float) -> RunFacts:
    """What the run summary says, from the fitted trainer and the config."""
    cfg, state = loaded.cfg, trainer.state
    console = next((d for d in trainer.logger.destinations if isinstance(d, ConsoleLogger)), None)
    metrics = next((d.path for d in trainer.logger.destinations
                    if isinstance(d, JSONLLogger) and d.path is not None), None)
    checkpoint = None
    if cfg.save_folder and Path(cfg.save_folder).is_dir():
        found = complete_checkpoints(cfg.save_folder)
        checkpoint = str(found[0][0]) if found else None
    eval_config, eval_to_add = eval_choice(loaded)
    lora_base = None
    if cfg.model.get("peft_config") is not None and cfg.model.get("pretrained_model_name_or_path"):
        lora_base = str(cfg.model["pretrained_model_name_or_path"])
    last_batch = int(state.timestamp.batch)
    return RunFacts(
        run_name=state.run_name, config=str(loaded.source), batches=last_batch - first_batch,
        last_batch=last_batch, tokens=int(state.timestamp.token), seconds=seconds,
        first_loss=getattr(console, "first_loss", None), last_loss=getattr(console, "last_loss", None),
        save_folder=cfg.save_folder, checkpoint=checkpoint,
        metrics=str(metrics) if metrics else None, eval_config=eval_config,
        eval_to_add=eval_to_add, lora_base=lora_base,
    )


def eval_choice(loaded: LoadedConfig) -> tuple[str | None, str | None]:
    """``(eval YAML the summary suggests, or None; where this run's own would go, or None)``:
    the run's own (``eval/yamls/<run config's name>.yaml``), else the quickstart's for a run on
    the quickstart's data (its tasks are facts of the quickstart's invented world, which no
    other data teaches), else none."""
    own = Path("eval/yamls") / f"{Path(loaded.source).stem}.yaml"
    if own.is_file():
        return str(own), None
    quickstart = Path("eval/yamls/quickstart.yaml")
    if quickstart.is_file() and trains_on_quickstart_data(loaded.cfg):
        return str(quickstart), None
    return None, str(own)


def trains_on_quickstart_data(cfg: TrainConfig) -> bool:
    """Whether the train loader reads the quickstart's data (a folder under one that
    ``foundryx data quickstart`` stamped complete)."""
    dataset = (cfg.train_loader or {}).get("dataset") or {}
    where = dataset.get("local") or dataset.get("path") if isinstance(dataset, dict) else None
    if not isinstance(where, str):
        return False
    folder = Path(where).expanduser()
    return any((p / QUICKSTART_STAMP).is_file() for p in [folder, *folder.parents][:3])


def fit(trainer: Trainer, cfg: TrainConfig, *, eval_first: bool, checkpointer: Any) -> None:
    """``trainer.fit()``, after a first ``trainer.eval()`` when asked. A dataloader worker
    killed meanwhile (the OOM killer, ``kill -9``) becomes one RunError (exit code 1) naming
    the loader, the worker, the signal and the batch reached, instead of torch's traceback
    (see foundryx.data.workers); every other error propagates unchanged."""
    with unraisable_deaths_kept_quiet() as kept:
        try:
            if eval_first:
                trainer.eval()
            trainer.fit()
        except ValueError as e:  # Composer: a resume at or past max_duration trains nothing
            if "No training would occur" not in str(e):
                raise
            log.info("nothing to train: the checkpoint this run resumed from is already at "
                     "max_duration %s (the run had finished); raise max_duration to train on",
                     cfg.max_duration)
            # every rank has loaded before any leaves: the first to exit would take the
            # resume state streaming shares between them (its shared memory) with it
            dist.barrier()
        except NotImplementedError as e:  # an operator this torch cannot run under TP
            error = missing_op_error(e, builders.tp_degree(cfg.parallelism))
            if error is None:
                raise
            raise error from e
        except (RuntimeError, ConnectionError, EOFError) as e:  # see foundryx.data.workers
            def translate(err: BaseException) -> Any:
                return worker_death_error(
                    err, trainer.state, save_folder=cfg.save_folder,
                    autoresume=bool(checkpointer and checkpointer.autoresume))
            try:
                error = translate(e)
            except RuntimeError as late:  # torch's SIGCHLD handler fired as translation began
                error = translate(late)
            if error is None and kept:  # the death came first, raised inside a finalizer
                error = translate(kept[0])
            if error is None:
                raise
            raise error from e
