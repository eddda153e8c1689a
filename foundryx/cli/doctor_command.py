"""``foundryx doctor``: versions, GPUs and limits, and known-bad combinations with their fixes."""

from __future__ import annotations

import argparse

from foundryx.config.load import precheck
from foundryx.eval.config import run_config_icl_problems


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0, or 1 when a known-bad combination is found."""
    cfg = None
    if args.config:
        precheck(args.config, args.overrides, checks=(run_config_icl_problems,))  # before torch
        from foundryx import train as training  # torch + Composer: only with a config

        cfg = training.load_run_config(args.config, args.overrides).cfg
    save_folder = args.save_folder or (cfg.save_folder if cfg is not None else None)
    from foundryx import doctor  # no torch until it probes; packaging: this command's alone

    facts = doctor.probe(save_folder=save_folder)
    if cfg is not None:
        facts = doctor.config_facts(facts, args.config, cfg)
    findings = doctor.check(facts)
    print(doctor.render(facts, findings, as_json=args.json))
    return 1 if any(f.bad for f in findings) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="versions, GPUs and limits, and known-bad combinations "
                       "with their fixes (exit 1 when one is found)")
    d.add_argument("config", nargs="?", help="a run config: also check what it asks for "
                   "(device: gpu, dataloader workers, save_folder)")
    d.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    d.add_argument("--save-folder", metavar="PATH", help="report the free disk space there")
    d.add_argument("--json", action="store_true", help="print the facts and findings as JSON")
    d.set_defaults(fn=cmd_doctor)
