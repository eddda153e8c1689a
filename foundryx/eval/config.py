"""The standalone eval config (``foundryx eval CONFIG``): models, ICL tasks, gauntlet, outputs.

Loaded like a run config: YAML + dotlist overrides + ``${variables.x}``, and every problem is
reported at once with its path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from foundryx.checkpoint.metadata import has_model_record
from foundryx.config.load import read_merged, resolve
from foundryx.config.schema import Precision, doc
from foundryx.config.types import dataclass_problems, join
from foundryx.errors import ConfigError, did_you_mean
from foundryx.eval.gauntlet import Gauntlet, load_gauntlet
from foundryx.eval.quickstart_tasks import SETUP_STEPS
from foundryx.eval.task_config import ICLTaskConfig, load_icl_tasks, with_scoring


@dataclass
class EvalModelSpec:
    """One model to evaluate (an entry of ``models``): a foundryx checkpoint (with its run
    config, or rebuilt from its own record), or a Hugging Face model."""

    label: str = doc("the model's name in tables, e.g. my-run")
    checkpoint: str | None = doc(
        "a foundryx checkpoint: folder, save_folder (newest) or weights file", default=None)
    run_config: str | None = doc("the run YAML that trained `checkpoint` (model + tokenizer); "
                                 "default: the checkpoint's own record of them", default=None)
    overrides: list[str] = doc("key=value overrides of run_config", default_factory=list)
    hf: str | None = doc("a Hugging Face causal LM: local folder (also `foundryx export` "
                         "output) or hub name", default=None)
    tokenizer: str | None = doc("tokenizer folder or hub name; default: the model's", default=None)
    adapter: str | None = doc(
        "a PEFT LoRA adapter folder (adapter_config.json + weights, e.g. `foundryx export` "
        "output) applied to `hf`; models with the same hf load it once", default=None)
    implementation: Literal["auto", "native", "hf"] = doc(
        "how `hf` runs: native (foundryx's own Llama and the folder's tokenizer.json, no "
        "transformers import: Llama/Mistral-style folders), hf (transformers), auto: native "
        "where the folder allows it, else transformers (said in one line)", default="auto")
    share_context: bool = doc(
        "native Llama: the choices of a multiple-choice example compute their common context "
        "once (about a quarter of the work; logits differ from whole rows' in the last bits); "
        "false: whole rows, transformers' logits bit for bit", default=True)


@dataclass
class EvalConfig:
    models: list[dict[str, Any]] = doc("models to evaluate: [{label, checkpoint, run_config}, "
                                       "{label, hf} or {label, hf, adapter}]")
    icl_tasks: str | list[dict[str, Any]] = doc("a task file (eval/yamls/tasks.yaml) or a list")
    icl_data_root: str | None = doc(
        "folder of relative dataset_uri paths; default: the task file's data_root", default=None)
    eval_gauntlet: str | dict[str, Any] | None = doc(
        "a gauntlet file (eval/yamls/gauntlet.yaml) or mapping", default=None)
    max_seq_len: int = doc("token budget of a row, capped by the model's", default=2048)
    device_eval_batch_size: int = doc("examples per batch per device", default=4)
    generation_batch_size: int | Literal["auto"] | None = doc(
        "rows per batch of generation tasks; auto: as many as fit in the memory of a scoring "
        "batch's logits (a generation row holds a KV cache, not max_seq_len x vocabulary "
        "logits), at least device_eval_batch_size and at most 32, said in one line; None: "
        "device_eval_batch_size", default="auto")
    task_threads: int | Literal["auto"] = doc(
        "tasks evaluated at once in one process, the CPU's threads divided between them; auto: "
        "2 for the native Llama on a CPU with 2 or more threads and one process (a small "
        "model's steps are mostly per-operation overhead, which a task's own threads do not "
        "share), else 1 (1 too where task_processes took more than 1); said in one line",
        default="auto")
    task_processes: int | Literal["auto"] = doc(
        "processes evaluating tasks at once, the eval process forked once the model is loaded, "
        "the CPU's threads divided between them; auto: 2 for the native Llama on a Linux CPU "
        "with 2 or more threads, one process and task_threads: auto (two processes do not share "
        "Python's interpreter lock, two threads do), else 1; said in one line", default="auto")
    icl_max_examples: int | None = doc("evaluate the first N examples of each task", default=None)
    precision: Precision = doc("fp32, amp_bf16, ...", default="fp32")
    device: Literal["cpu", "gpu"] | None = doc("default: gpu when available", default=None)
    seed: int = doc("torch seed (few-shot draws have their own seeds)", default=17)
    output_dir: str | None = doc(
        "where results.{md,csv,json,png} go; default: the eval/ folder of the run that the first "
        "checkpoint or adapter model comes from (runs/<name>/eval, where foundryx report finds "
        "it), else eval_results", default=None)
    compare_to: str | None = doc(
        "a model label of this config, or a YAML of task -> score; see docs/eval.md", default=None)
    tolerance: float = doc("how far below the reference a score may be", default=0.02)
    tolerances: dict[str, float] = doc("per-result tolerances, e.g. {arc_easy/0-shot: 0.05}",
                                       default_factory=dict)
    dump_examples: int = doc("write rendered prompts and scores of the first N examples",
                             default=0)
    skip_missing_data: bool = doc("skip tasks whose data file is absent (logged) instead of "
                                  "failing", default=False)
    setup: dict[str, dict[str, Any]] = doc(
        "steps run before reading data, e.g. {quickstart_facts: {out_dir: ...}}",
        default_factory=dict)
    progress_bar: bool | None = doc(
        "null: a progress bar per task when stderr is a terminal, else (piped, redirected) a log "
        "line per task when it is done; true/false: always/never a bar", default=None)
    python_log_level: str | None = doc("log level of foundryx", default="info")
    variables: dict[str, Any] = doc("values for ${variables.x} interpolation", default_factory=dict)


@dataclass
class LoadedEvalConfig:
    cfg: EvalConfig
    models: list[EvalModelSpec]
    tasks: list[ICLTaskConfig]
    gauntlet: Gauntlet | None
    source: str
    resolved: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # lines for the log once it is set up


def _model_problems(models: list[Any]) -> tuple[list[EvalModelSpec], list[str]]:
    specs, problems, labels = [], [], set()
    for i, m in enumerate(models):
        path = join("models", i)
        if not isinstance(m, dict):
            problems.append(f"{path}: expected a mapping with label and checkpoint or hf")
            continue
        found = dataclass_problems(EvalModelSpec, m, path)
        if not found:
            spec = EvalModelSpec(**m)
            if (spec.checkpoint is None) == (spec.hf is None):
                found.append(f"{path}: give exactly one of checkpoint (with run_config) and hf")
            elif spec.adapter is not None and spec.hf is None:
                found.append(f"{path}.adapter: an adapter goes on a Hugging Face base; give the "
                             "base model as hf")
            elif spec.adapter is not None and not (Path(spec.adapter) / "adapter_config.json").is_file():
                found.append(f"{path}.adapter: {spec.adapter} has no adapter_config.json; give a "
                             "PEFT adapter folder (foundryx export output or "
                             "PeftModel.save_pretrained)")
            elif spec.checkpoint is not None and spec.run_config is None:
                if not has_model_record(spec.checkpoint):
                    found.append(f"{path}.run_config: missing, and {spec.checkpoint} holds no "
                                 "record of its model (components.json or hf/ folder); give the "
                                 "run YAML that trained the checkpoint")
            if spec.implementation == "native" and (spec.hf is None or spec.adapter is not None):
                found.append(f"{path}.implementation: native runs a Hugging Face folder (hf) "
                             "without an adapter; use auto or hf for this model")
            if spec.label in labels:
                found.append(f"{path}.label: {spec.label!r} is used twice")
            labels.add(spec.label)
            specs.append(spec)
        problems += found
    if not models:
        problems.append("models: the list is empty; add {label, hf} or {label, checkpoint, run_config}")
    return specs, problems


def _section(problems: list[str], fn, *args) -> Any:
    try:
        return fn(*args)
    except ConfigError as e:
        where = f"{e.source}: " if e.source else ""
        problems += [where + p for p in e.problems]
        return None


def icl_problems(icl_tasks: Any, icl_data_root: str | None, eval_gauntlet: Any,
                 check_files: bool = True, missing_hint: str = ""
                 ) -> tuple[list[ICLTaskConfig], Any, list[str]]:
    """``(tasks, gauntlet, problems)`` of the ICL sections of a run or eval config: the task
    file and entries, that each dataset file exists (``check_files``; not read yet), and the
    gauntlet."""
    problems: list[str] = []
    tasks = _section(problems, load_icl_tasks, icl_tasks, icl_data_root) or []
    if check_files:
        problems += [f"icl_tasks: {t.label}: dataset_uri {t.dataset_uri}: no such file; set "
                     f"icl_data_root, or data_root in the task file, to the folder that holds it{missing_hint}"
                     for t in tasks if not Path(t.dataset_uri).is_file()]
    gauntlet = None
    if eval_gauntlet is not None and tasks:
        keys = {t.key(s) for t in tasks for s in t.shots}
        gauntlet = _section(problems, load_gauntlet, eval_gauntlet, keys)
    return tasks, gauntlet, problems


def run_config_icl_problems(data: dict[str, Any]) -> list[str]:
    """The problems of the ICL sections of a resolved run config: a ``checks`` entry of
    :func:`foundryx.config.load_config`, passed by the entry points (``foundryx train``)."""
    if not isinstance(data.get("icl_tasks"), (str, list)):  # other types: a schema problem
        return []
    return icl_problems(data["icl_tasks"], data.get("icl_data_root"), data.get("eval_gauntlet"))[2]


def load_eval_config(path: str | Path, overrides: list[str] | None = None,
                     scoring: str | None = None) -> LoadedEvalConfig:
    """Read, merge, resolve and validate an eval config; raise ConfigError with every problem.
    ``scoring`` (``--scoring``): every task that can take it is scored so (see
    :func:`foundryx.eval.task_config.with_scoring`), said in a note."""
    merged, problems = read_merged(path, overrides)
    data = resolve(merged, "", problems)
    problems += dataclass_problems(EvalConfig, data)
    if problems:
        raise ConfigError(problems, source=path)
    data.pop("variables", None)
    cfg = EvalConfig(**data)
    specs, problems = _model_problems(cfg.models)
    for name in cfg.setup:
        if name not in SETUP_STEPS:
            problems.append(f"setup.{name}: unknown step{did_you_mean(name, SETUP_STEPS) or ''}; "
                            f"steps: {', '.join(SETUP_STEPS)}")
    generation = cfg.generation_batch_size if isinstance(cfg.generation_batch_size, int) else None
    threads = cfg.task_threads if isinstance(cfg.task_threads, int) else None
    processes = cfg.task_processes if isinstance(cfg.task_processes, int) else None
    for key, value in (("device_eval_batch_size", cfg.device_eval_batch_size),
                       ("generation_batch_size", generation), ("task_threads", threads),
                       ("task_processes", processes),
                       ("max_seq_len", cfg.max_seq_len), ("icl_max_examples", cfg.icl_max_examples)):
        if value is not None and value <= 0:
            problems.append(f"{key}: must be positive, got {value}")
    # setup steps write their tasks' files when the eval starts, so those are not there yet
    tasks, gauntlet, more = icl_problems(
        cfg.icl_tasks, cfg.icl_data_root, cfg.eval_gauntlet,
        check_files=not (cfg.setup or cfg.skip_missing_data),
        missing_hint=" (or skip_missing_data=true to leave such tasks out)")
    if any(o.startswith("icl_tasks") and "scoring" in o for o in overrides or []):
        # a task list replaced to change its scoring: say the one flag that does that
        at = next((i for i, p in enumerate(more) if "not among the ICL tasks evaluated" in p), None)
        if at is not None:
            more[at] += ("; to change only how the tasks are scored, keep icl_tasks as it is and "
                         "give foundryx eval --scoring lm_eval (or llmfoundry)")
    problems += more
    if problems:
        raise ConfigError(problems, source=path)
    notes = []
    if scoring is not None:
        try:
            tasks, note = with_scoring(tasks, scoring)
        except ConfigError as e:
            raise ConfigError(e.problems, source=path) from None
        notes.append(note)
    # the file's path as text: results.json records it (a Path from a library caller is not JSON)
    return LoadedEvalConfig(cfg, specs, tasks, gauntlet, str(path), data, notes)
