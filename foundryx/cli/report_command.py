"""``foundryx report``: plots and report.md of a run folder."""

from __future__ import annotations

import argparse


def cmd_report(args: argparse.Namespace) -> int:
    from foundryx import report  # numpy, and matplotlib when it plots: this command's alone

    path = report.make_report(args.run_folder, out=args.out, evals=args.eval)
    print(f"wrote {path} and its plots")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="plots and report.md of a run folder (see docs/operations.md)")
    r.add_argument("run_folder", help="the folder the run's jsonl logger wrote metrics.jsonl to, "
                   "e.g. runs/quickstart")
    r.add_argument("--out", help="where to write report.md and the PNGs (default RUN_FOLDER/report)")
    r.add_argument("--eval", action="append", metavar="DIR", help="a foundryx eval output_dir whose "
                   "results (reference models, comparisons) to show; results inside the run "
                   "folder are found without it")
    r.set_defaults(fn=cmd_report)
