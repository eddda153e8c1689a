"""``foundryx eval``: the ICL eval of a config (as ``eval/eval.py``)."""

from __future__ import annotations

import argparse
import os

from foundryx.cli.common import is_rank_zero
from foundryx.config.hardware import machine_problems
from foundryx.errors import ConfigError
from foundryx.eval.ahead import start as start_preparing
from foundryx.eval.config import load_eval_config
from foundryx.eval.task_config import SCORINGS
from foundryx.runtime.devices import this_machine


def cmd_eval(args: argparse.Namespace) -> int:
    """Exit 0, or 1 when --compare-to finds a result short of the reference."""
    loaded = load_eval_config(args.config, args.overrides,  # before torch: mistakes answer fast
                              scoring=args.scoring)
    cannot = machine_problems(this_machine(), loaded.cfg.device)  # (eval on a CPU runs in fp32)
    if cannot:
        raise ConfigError(cannot, source=str(args.config))
    # the tasks are read and tokenized in a child process while this one imports torch
    ahead = start_preparing(loaded, int(os.environ.get("WORLD_SIZE", "1") or 1))
    try:
        from foundryx.eval.run import run_eval  # torch (+ Composer on several processes)

        outcome = run_eval(loaded, compare_to=args.compare_to, tolerance=args.tolerance,
                           dump_examples=args.dump_examples, ahead=ahead)
    finally:
        if ahead is not None:
            ahead.close()
    if is_rank_zero():
        print(outcome.report())
    return 0 if outcome.passed else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("eval", help="ICL eval of checkpoints and HF models (same as eval/eval.py)")
    v.add_argument("config", help="eval config YAML, e.g. eval/yamls/quickstart.yaml")
    v.add_argument("overrides", nargs="*", help="key=value overrides, e.g. icl_max_examples=100")
    v.add_argument("--compare-to", metavar="REF", help="a model label of the config, or a YAML of "
                   "result -> score; exit 1 when a result falls short by more than the tolerance")
    v.add_argument("--tolerance", type=float, help="allowed shortfall (default: the config's, 0.02)")
    v.add_argument("--dump-examples", type=int, metavar="N",
                   help="write prompts, continuations and scores of N examples per task")
    v.add_argument("--scoring", choices=SCORINGS, help="score every task of the config this way "
                   "where it can be: lm_eval (lm-eval-harness's acc and acc_norm) goes on the "
                   "multiple_choice and schema tasks without has_categories; llmfoundry on all "
                   "(see docs/eval.md)")
    v.set_defaults(fn=cmd_eval)
