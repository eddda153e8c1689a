"""The ``foundryx`` command: a thin shell over library functions.

User errors (:class:`foundryx.errors.FoundryxError`) print one message, no traceback, and
exit with code 2 (a :class:`~foundryx.errors.RunError`, such as a killed dataloader worker:
code 1, printed by the rank that saw it). Training, eval and export load torch and Composer
(seconds); their modules are imported when the command runs, after the config passed the
checks that need none of them (:func:`foundryx.config.load.precheck`), so ``foundryx --help``,
the data commands and a config's mistakes answer in a fraction of a second.

``train``, ``plan``, ``eval``, ``doctor`` and ``export`` take ``key=value`` overrides anywhere
on the line (:func:`split_overrides`), before or after the flags.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import NoReturn

from foundryx import __version__, known_warnings, registry
from foundryx.config.help import component_help, config_help
from foundryx.config.load import is_override, precheck, precheck_sections
from foundryx.config_paths import path_problems
from foundryx.data import partitions
from foundryx.data.convert import convert_to_mds
from foundryx.data.quickstart import prepare_quickstart
from foundryx.data.tokenizers import build_hf_tokenizer
from foundryx.devices import run_problems
from foundryx.errors import ConfigError, FoundryxError
from foundryx.eval.config import load_eval_config, run_config_icl_problems
from foundryx.eval.task_config import SCORINGS
from foundryx.plan.command import add_parser as add_plan_parser
from foundryx.runtime import setup_logging
from foundryx.stack import frozen_missing


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(config_help() if args.help_config is True else component_help(args.help_config))
        return 0
    if not args.config:
        raise FoundryxError("foundryx train: give a run config, e.g. yamls/quickstart.yaml")
    # Before torch: the config's mistakes in a fraction of a second. A dry run lists what this
    # machine cannot run after its plan (a GPU recipe checked on a laptop still shows one).
    precheck(args.config, args.overrides,
             checks=(run_config_icl_problems,) + (() if args.dry_run else (run_problems, path_problems)))
    from foundryx import train as training  # torch + Composer: only when a run is loaded

    if args.dry_run:  # the config, derived numbers and plan, then the problems (exit 2)
        text, problems = training.dry_run(args.config, args.overrides)
        print(text, flush=True)
        if problems:
            raise ConfigError(problems, source=str(args.config))
        return 0
    training.train(training.load_run_config(args.config, args.overrides))
    return 0


def cmd_registry_list(args: argparse.Namespace) -> int:
    regs = [registry.get_registry(args.registry)] if args.registry else registry.REGISTRIES.values()
    rows = [("registry", "name", "kind", "source")]
    for reg in regs:
        for name in reg.names():
            e = reg.entry(name)
            try:
                kind = e.kind
            except FoundryxError:
                kind = "BROKEN"
            rows.append((reg.name, name, kind, e.source))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_data_quickstart(args: argparse.Namespace) -> int:
    out = prepare_quickstart(Path(args.out), seed=args.seed, force=args.force)
    print(f"quickstart data ready in {out}")
    return 0


def cmd_data_convert(args: argparse.Namespace) -> int:
    partition = None
    if args.num_partitions is not None or args.partition is not None:
        if args.num_partitions is None or args.partition is None:
            raise FoundryxError("foundryx data convert: give --num-partitions N and --partition "
                                "I together (I in 0 .. N-1), or neither")
        partition = (args.partition, args.num_partitions)
    tok = build_hf_tokenizer(args.tokenizer)
    manifest = convert_to_mds(
        args.input, args.out, tok, args.max_seq_len, text_field=args.text_field,
        split=args.split, subset=args.subset, compression=args.compression,
        overwrite=args.overwrite, workers=args.workers, resume=not args.no_resume,
        progress=not args.no_progress, partition=partition,
    )
    where = partitions.folder_of(args.out, *partition) if partition else args.out
    print(
        f"wrote {manifest['sequences']} sequences of {args.max_seq_len} tokens "
        f"({manifest['tokens']} tokens from {manifest['documents']} documents) to {where}"
    )
    return 0


def cmd_data_merge(args: argparse.Namespace) -> int:
    setup_logging("info")
    manifest = partitions.merge(args.out, overwrite=args.overwrite)
    print(f"merged {len(manifest['partitions'])} partition(s) into {args.out}: "
          f"{manifest['sequences']} sequences of {manifest['max_seq_len']} tokens "
          f"({manifest['tokens']} tokens from {manifest['documents']} documents)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.overrides and not args.config:
        raise FoundryxError(f"foundryx export: the overrides {' '.join(args.overrides)} change a "
                            "run config: give it with --config RUN_YAML (without one the "
                            "checkpoint's own record of its model is used, as it was trained)")
    if args.config:  # before torch: the run config's mistakes in a fraction of a second
        precheck_sections(args.config, args.overrides,
                          ("model",) if args.tokenizer else ("model", "tokenizer"))
    from foundryx.export import export_checkpoint  # torch + transformers: only for an export

    setup_logging("info")
    config, overrides = args.config, args.overrides
    out = export_checkpoint(
        args.checkpoint, args.out, config=config, overrides=overrides,
        tokenizer=args.tokenizer, fmt=args.format, dtype=args.dtype, overwrite=args.overwrite,
        progress=not args.no_progress, verify=not args.no_verify, merged=args.merged,
    )
    print(f"exported {args.checkpoint} to {out}")
    return 0


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "export", help="checkpoint → Hugging Face folder (safetensors, config, tokenizer)",
        usage="foundryx export CHECKPOINT [OUT] [--config RUN_YAML] [KEY=VALUE ...] [--tokenizer T] "
              "[--format auto|llama|mpt] [--dtype fp32|bf16|fp16] [--overwrite] [--no-verify] "
              "[--no-progress] [--merged]",
    )
    e.add_argument("checkpoint", help="a checkpoint folder, a save_folder (its newest checkpoint), "
                   "or a weights file (.pt, .safetensors)")
    e.add_argument("out", nargs="?", help="the folder to write (appears complete or not at all); "
                   "default: the run folder's export/hf (export/adapter for a LoRA run, "
                   "export/merged with --merged)")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the --config "
                   "run YAML, e.g. model.peft_config.r=16")
    e.add_argument("--config", metavar="RUN_YAML", help="run YAML the checkpoint was trained with "
                   "(its model and tokenizer); default: the checkpoint's own record "
                   "(components.json, or hf/ in older ones)")
    e.add_argument("--tokenizer", help="tokenizer folder or hub name to write instead of the config's")
    e.add_argument("--format", default="auto", help="auto (default), llama or mpt; see docs/hf.md")
    e.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: as trained)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing export in OUT")
    e.add_argument("--no-verify", action="store_true", help="skip the checkpoint's hash check")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("--merged", action="store_true", help="a LoRA run: write the base with the "
                   "adapters merged (a plain model) instead of a PEFT adapter folder")
    e.set_defaults(fn=cmd_export)


def cmd_eval(args: argparse.Namespace) -> int:
    """Exit 0, or 1 when --compare-to finds a result short of the reference."""
    loaded = load_eval_config(args.config, args.overrides,  # before torch: mistakes answer fast
                              scoring=args.scoring)
    cannot = run_problems({"device": loaded.cfg.device})  # (eval on a CPU runs in fp32)
    if cannot:
        raise ConfigError(cannot, source=str(args.config))
    from foundryx.eval.run import run_eval  # torch + Composer: only for an eval

    outcome = run_eval(loaded, compare_to=args.compare_to, tolerance=args.tolerance,
                       dump_examples=args.dump_examples)
    if _is_rank_zero():
        print(outcome.report())
    return 0 if outcome.passed else 1


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
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


def cmd_report(args: argparse.Namespace) -> int:
    from foundryx.report import make_report  # matplotlib: only for a report

    path = make_report(args.run_folder, out=args.out, evals=args.eval)
    print(f"wrote {path} and its plots")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0, or 1 when a known-bad combination is found."""
    from foundryx.doctor import check, config_facts, probe, render  # torch: only for a doctor

    cfg = None
    if args.config:
        precheck(args.config, args.overrides, checks=(run_config_icl_problems,))  # before torch
        from foundryx import train as training

        cfg = training.load_run_config(args.config, args.overrides).cfg
    save_folder = args.save_folder or (cfg.save_folder if cfg is not None else None)
    facts = probe(save_folder=save_folder)
    if cfg is not None:
        facts = config_facts(facts, args.config, cfg)
    findings = check(facts)
    print(render(facts, findings, as_json=args.json))
    return 1 if any(f.bad for f in findings) else 0


def _add_report_and_doctor_parsers(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="plots and report.md of a run folder (see docs/operations.md)")
    r.add_argument("run_folder", help="the folder the run's jsonl logger wrote metrics.jsonl to, "
                   "e.g. runs/quickstart")
    r.add_argument("--out", help="where to write report.md and the PNGs (default RUN_FOLDER/report)")
    r.add_argument("--eval", action="append", metavar="DIR", help="a foundryx eval output_dir whose "
                   "results (reference models, comparisons) to show; results inside the run "
                   "folder are found without it")
    r.set_defaults(fn=cmd_report)
    d = sub.add_parser("doctor", help="versions, GPUs and limits, and known-bad combinations "
                       "with their fixes (exit 1 when one is found)")
    d.add_argument("config", nargs="?", help="a run config: also check what it asks for "
                   "(device: gpu, dataloader workers, save_folder)")
    d.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    d.add_argument("--save-folder", metavar="PATH", help="report the free disk space there")
    d.add_argument("--json", action="store_true", help="print the facts and findings as JSON")
    d.set_defaults(fn=cmd_doctor)


DESCRIPTION = """LLM training on Composer: train, evaluate, export and plan runs from one YAML config.

Commands that take a config also take key=value overrides of it, anywhere on the line:
  foundryx train yamls/quickstart.yaml max_duration=20ba --dry-run
  foundryx plan yamls/mpt-1b.yaml --gpus 8 global_train_batch_size=512
"""


def versions() -> str:
    """``foundryx --version``: foundryx and what it runs on (read without importing them)."""
    def v(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (f"foundryx {__version__} (composer {v('mosaicml')}, torch {v('torch')}, "
            f"transformers {v('transformers')}, python {platform.python_version()})")


class _Version(argparse.Action):
    """``--version``: the versions are read only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the versions of foundryx and what it runs on, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(versions())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="foundryx", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    r = sub.add_parser("registry", help="inspect registries")
    rsub = r.add_subparsers(dest="action", required=True)
    rl = rsub.add_parser("list", help="print name, kind and source of each entry")
    rl.add_argument("registry", nargs="?", help="one registry, e.g. callbacks")
    rl.set_defaults(fn=cmd_registry_list)

    d = sub.add_parser("data", help="prepare data")
    dsub = d.add_subparsers(dest="action", required=True)
    q = dsub.add_parser("quickstart", help="generate the offline quickstart corpus, tokenizer and MDS")
    q.add_argument("--out", default="data/quickstart")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--force", action="store_true", help="rebuild even if complete")
    q.set_defaults(fn=cmd_data_quickstart)
    c = dsub.add_parser("convert", help="text / jsonl / parquet / HF dataset → MDS token sequences")
    c.add_argument("--input", required=True, help="a .txt, .jsonl or .parquet file, a folder of "
                   ".txt or .parquet files, a save_to_disk folder, or hf://owner/name")
    c.add_argument("--out", required=True, help="output folder for the MDS shards, or "
                   "object storage: s3://bucket/path (see docs/storage.md)")
    c.add_argument("--tokenizer", required=True, help="a local tokenizer folder or a hub name")
    c.add_argument("--max-seq-len", type=int, required=True)
    c.add_argument("--text-field", default="text", help="jsonl field holding the text")
    c.add_argument("--compression", default=None, help="e.g. zstd")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--split", default=None, help="split of a Hugging Face dataset")
    c.add_argument("--subset", default=None, help="subset (config) of a hub dataset")
    c.add_argument("--workers", type=int, default=None,
                   help="tokenizer processes; default: one per CPU core (output is the same)")
    c.add_argument("--no-resume", action="store_true", help="start over instead of resuming")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--num-partitions", type=int, metavar="N", help="split the input's documents "
                   "into N contiguous shares, one per job (see docs/storage.md)")
    c.add_argument("--partition", type=int, metavar="I", help="convert share I (0 .. N-1) into "
                   "OUT/part-0000I-of-0000N; then `foundryx data merge OUT`")
    c.set_defaults(fn=cmd_data_convert)
    m = dsub.add_parser("merge", help="join the partitions of `convert --num-partitions` into one "
                        "dataset (their indexes; no shard is copied)")
    m.add_argument("out", help="the --out of the partitioned conversions (folder or s3://...)")
    m.add_argument("--overwrite", action="store_true", help="merge again over a merged index")
    m.set_defaults(fn=cmd_data_merge)
    _add_export_parser(sub)
    _add_eval_parser(sub)
    add_plan_parser(sub)
    _add_report_and_doctor_parsers(sub)
    return p


# Commands whose config takes key=value overrides (their ``overrides`` argument).
OVERRIDE_COMMANDS = ("train", "plan", "eval", "doctor", "export")


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})


def _innermost(p: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser the words ``argv`` end up in, e.g. ``foundryx data convert``'s."""
    for word in argv:
        inner = _subcommands(p).get(word)
        if inner is not None:
            p = inner
    return p


def _takes_value(sub: argparse.ArgumentParser, word: str) -> bool:
    """Whether ``word`` is one of ``sub``'s options that is followed by its value."""
    if not word.startswith("-") or "=" in word:
        return False
    action = sub._option_string_actions.get(word)
    if action is None:  # an abbreviation (--gpu-mem): argparse accepts unique prefixes
        found = [a for o, a in sub._option_string_actions.items() if o.startswith(word)]
        action = found[0] if len({id(a) for a in found}) == 1 else None
    return action is not None and action.nargs != 0


def split_overrides(sub: argparse.ArgumentParser, words: list[str]) -> tuple[list[str], list[str]]:
    """``(words without the key=value overrides, the overrides)``: an override is a word of
    the form ``key=value`` (``a.b[0]=x``) anywhere, except as the value of an option."""
    rest, overrides = [], []
    for i, word in enumerate(words):
        after_option = i > 0 and _takes_value(sub, words[i - 1])
        (overrides if is_override(word) and not after_option else rest).append(word)
    return rest, overrides


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a Namespace; a usage error exits 2 with the usage of the command
    it is in (``foundryx plan: error: ...``), not the top-level one."""
    p = parser()
    command = next((w for w in argv if not w.startswith("-")), None)
    sub = _subcommands(p).get(command) if command in OVERRIDE_COMMANDS else None
    overrides: list[str] = []
    if sub is not None:
        at = argv.index(command) + 1
        rest, overrides = split_overrides(sub, argv[at:])
        argv = argv[:at] + rest
    args, extras = p.parse_known_args(argv)
    if sub is None:
        if extras:
            _innermost(p, argv).error(f"unrecognized arguments: {' '.join(extras)}")
        return args
    # Words after the flags that are not key=value: shown as malformed overrides, not a usage.
    args.overrides = [*args.overrides, *overrides, *(w for w in extras if not w.startswith("-"))]
    flags = [w for w in extras if w.startswith("-")]
    if flags:
        sub.error(f"unrecognized arguments: {' '.join(flags)} (see foundryx {command} --help)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    known_warnings.install(preimport=False)  # every subcommand: see docs/operations.md
    problem = frozen_missing() if args.command != "doctor" else None
    if problem:
        print(f"foundryx: error: {problem}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except FoundryxError as e:
        if _is_rank_zero() or not e.rank_zero_only:
            print(f"foundryx: error: {e}", file=sys.stderr)
        return e.exit_code


def run(argv: list[str] | None = None) -> NoReturn:
    """A foundryx process from start to exit: the console script, ``train.py`` (once per rank
    under the composer launcher) and ``eval/eval.py``. ``main`` and then exit, skipping the
    interpreter's final garbage collection, which walks every object torch, transformers and
    Composer made and takes ~3 s of a 2-core machine's time per process (measured: ``import
    composer`` then exit, 13.0 s; with the objects frozen first, 10.3 s). atexit handlers and
    every module's cleanup still run; only cyclic garbage is left to the operating system (not in
a process that loaded Triton's nanobind extension: :func:`_nanobind_extension_loaded`)."""
    code = main(argv)
    if not _nanobind_extension_loaded():
        gc.freeze()
    sys.exit(code)


def _nanobind_extension_loaded() -> bool:
    """Whether Triton's nanobind-built extension is loaded (Triton >= 3.9, torch 2.15): nanobind
    reports every object of its types still alive when the interpreter ends ("nanobind: leaked
    514 functions!", ~100 lines on stderr), which frozen objects are, so such a process exits
    with the ordinary final collection (its ~3 s) instead."""
    ext = sys.modules.get("triton._C.libtriton")
    context = getattr(getattr(ext, "ir", None), "context", None)
    return context is not None and type(context).__name__.startswith("nb_type")


if __name__ == "__main__":
    run()
