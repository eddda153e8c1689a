"""The run config schema: typed dataclasses with defaults and one-line docs.

Sections that name a registry entry (``model``, ``tokenizer``, ``train_loader``,
``optimizer``, ...) are ``{name: <registry key>, <kwargs>...}`` dicts; their kwargs are
checked against the registered object (see :mod:`foundryx.config.components`).
``algorithms``, ``callbacks`` and ``loggers`` map registry keys to kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Precision = Literal["fp32", "amp_fp16", "amp_bf16", "amp_fp8"]


def doc(text: str, **kw: Any) -> Any:
    """A dataclass field with a doc string (shown by ``foundryx train --help-config``)."""
    return field(metadata={"doc": text}, **kw)


@dataclass
class TrainConfig:
    # -- what to train ------------------------------------------------------------------
    model: dict[str, Any] = doc("model: {name: <models key>, ...model options}")
    tokenizer: dict[str, Any] = doc("tokenizer: {name: <tokenizers key>, ...kwargs}")
    train_loader: dict[str, Any] = doc("training data: {name: <dataloaders key>, ...}")
    max_duration: str = doc("training length, e.g. 4800ba, 1ep, 2000000tok")
    global_train_batch_size: int = doc("samples per optimizer step, summed over all ranks")
    optimizer: dict[str, Any] = doc("optimizer: {name: <optimizers key>, lr: ..., ...}")
    scheduler: dict[str, Any] = doc(
        "LR schedule: {name: <schedulers key>, ...}",
        default_factory=lambda: {"name": "constant_with_warmup", "t_warmup": "0ba"},
    )
    max_seq_len: int | None = doc("sequence length (used by model and data)", default=None)
    eval_loader: dict[str, Any] | None = doc("held-out data, same shape as train_loader", default=None)

    # -- batch --------------------------------------------------------------------------
    device_train_microbatch_size: int | None = doc(
        "samples per forward/backward on one device; default: the whole device batch", default=None
    )
    device_eval_batch_size: int | None = doc("eval samples per device; default: microbatch", default=None)

    # -- schedule of evaluation and logging ---------------------------------------------
    eval_interval: str = doc("how often to evaluate, e.g. 500ba or 1ep", default="1ep")
    eval_first: bool = doc("evaluate before the first step", default=False)
    eval_subset_num_batches: int = doc("eval batches per evaluation (-1: all)", default=-1)
    console_log_interval: str = doc("how often the console logger prints", default="10ba")
    log_to_console: bool = doc("print metrics to the console", default=True)
    progress_bar: bool = doc("show a tqdm progress bar instead of log lines", default=False)
    python_log_level: str | None = doc("log level of foundryx and composer", default="info")

    # -- extensions ---------------------------------------------------------------------
    algorithms: dict[str, dict[str, Any]] = doc("{<algorithms key>: kwargs}", default_factory=dict)
    callbacks: dict[str, dict[str, Any]] = doc("{<callbacks key>: kwargs}", default_factory=dict)
    loggers: dict[str, dict[str, Any]] = doc("{<loggers key>: kwargs}", default_factory=dict)

    # -- hardware -----------------------------------------------------------------------
    precision: Precision = doc("numeric precision of training", default="fp32")
    device: Literal["cpu", "gpu"] | None = doc("cpu or gpu; default: gpu when available", default=None)
    fsdp_config: dict[str, Any] | None = doc("FSDP2 settings; none: DDP or one process", default=None)
    dist_timeout: float = doc("seconds to wait for all ranks to start", default=600.0)
    seed: int = doc("random seed of weights, data order and dropout", default=17)

    # -- checkpoints --------------------------------------------------------------------
    run_name: str | None = doc("name of the run (checkpoint and logger names)", default=None)
    save_folder: str | None = doc("where checkpoints go; none: no checkpoints", default=None)
    save_interval: str = doc("checkpoint every ..., e.g. 1000ba", default="1000ba")
    save_num_checkpoints_to_keep: int = doc("keep the last K (-1: all)", default=-1)
    save_overwrite: bool = doc("overwrite checkpoints already in save_folder", default=False)
    load_path: str | None = doc("checkpoint to start from", default=None)
    load_weights_only: bool = doc("load only the weights from load_path", default=False)
    autoresume: bool = doc("resume from the latest checkpoint in save_folder", default=False)

    variables: dict[str, Any] = doc("values for ${variables.x} interpolation", default_factory=dict)


# Sections whose value names a registry entry, and the registry.
COMPONENT_SECTIONS: dict[str, str] = {
    "model": "models",
    "tokenizer": "tokenizers",
    "train_loader": "dataloaders",
    "eval_loader": "dataloaders",
    "optimizer": "optimizers",
    "scheduler": "schedulers",
}
# Sections mapping registry keys to kwargs.
NAMED_SECTIONS: dict[str, str] = {
    "algorithms": "algorithms",
    "callbacks": "callbacks",
    "loggers": "loggers",
}
# Constructor arguments the builders supply, so a YAML need not (and must not) give them.
SUPPLIED_ARGS: dict[str, set[str]] = {
    "models": {"tokenizer"},
    "tokenizers": set(),
    "dataloaders": {"cfg", "tokenizer", "device_batch_size"},
    "optimizers": {"params"},
    "schedulers": set(),
    "algorithms": set(),
    "callbacks": set(),
    "loggers": set(),
}
