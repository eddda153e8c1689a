"""``foundryx train``: a run from a run config, ``--dry-run`` and ``--help-config``."""

from __future__ import annotations

import argparse

from foundryx.config.help import component_help, config_help
from foundryx.config.load import precheck
from foundryx.errors import ConfigError, FoundryxError
from foundryx.eval.config import run_config_icl_problems
from foundryx.runtime import preempt
from foundryx.runtime.devices import this_machine


def cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(config_help() if args.help_config is True else component_help(args.help_config))
        return 0
    if not args.config:
        raise FoundryxError("foundryx train: give a run config, e.g. yamls/quickstart.yaml")
    # Before torch: the config's mistakes in a fraction of a second. A dry run lists what this
    # machine cannot run after its plan (a GPU recipe checked on a laptop still shows one).
    from foundryx.cli.config_paths import path_problems  # numpy: imported by train alone

    precheck(args.config, args.overrides,
             checks=(run_config_icl_problems,) + (() if args.dry_run else (path_problems,)),
             machine=None if args.dry_run else this_machine())
    if not args.dry_run:  # a signal from here: one line and exit 75 (foundryx.runtime.preempt)
        preempt.take_over()
    with preempt.kept():  # Composer's import sets its own SIGTERM handler (exit 143 at once)
        from foundryx import train as training  # torch + Composer: only when a run is loaded

    if args.dry_run:  # the config, derived numbers and plan, then the problems (exit 2)
        text, problems = training.dry_run(args.config, args.overrides)
        print(text, flush=True)
        if problems:
            raise ConfigError(problems, source=str(args.config))
        return 0
    try:
        training.train(training.load_run_config(args.config, args.overrides))
        return preempt.exit_code()  # 75: stopped for a signal, with a checkpoint
    finally:
        if not preempt.owned():  # called in a process that goes on (tests): handlers given back
            preempt.restore()


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train from a run config (same as `composer train.py`)")
    t.add_argument("config", nargs="?", help="run config YAML, e.g. yamls/quickstart.yaml")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_duration=20ba")
    t.add_argument("--dry-run", action="store_true", help="print the resolved config, the derived "
                   "numbers and the plan, then the problems (exit 2 when there are any)")
    t.add_argument("--help-config", nargs="?", const=True, metavar="SECTION|REGISTRY.NAME",
                   help="list every config key with its doc; with a SECTION (e.g. parallelism, "
                   "parallelism.tp, frozen_base), its keys; with REGISTRY.NAME (e.g. "
                   "algorithms.ema, or a bare name), that component's options")
    t.set_defaults(fn=cmd_train)
