"""``foundryx export``: a checkpoint as a Hugging Face folder (or a PEFT adapter)."""

from __future__ import annotations

import argparse

from foundryx.config.load import precheck_sections
from foundryx.errors import FoundryxError
from foundryx.runtime.log_setup import setup_logging


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


def add_parser(sub: argparse._SubParsersAction) -> None:
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
