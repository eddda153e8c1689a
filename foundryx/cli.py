"""The ``foundryx`` command: a thin shell over library functions.

User errors (:class:`foundryx.errors.FoundryxError`) print one message, no traceback, and
exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from foundryx.errors import FoundryxError


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def cmd_train(args: argparse.Namespace) -> int:
    from foundryx.config import load_config

    if args.help_config:
        from foundryx.config.help import config_help

        print(config_help())
        return 0
    if not args.config:
        raise FoundryxError("foundryx train: give a run config, e.g. yamls/quickstart.yaml")
    loaded = load_config(args.config, args.overrides)
    if args.dry_run:
        print(f"# resolved config of {loaded.source}")
        print(loaded.to_yaml())
        print("# derived numbers")
        print(loaded.derived.table())
        return 0
    from foundryx.train import train

    train(loaded)
    return 0


def cmd_registry_list(args: argparse.Namespace) -> int:
    from foundryx import registry

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
    from foundryx.data.quickstart import prepare_quickstart

    out = prepare_quickstart(Path(args.out), seed=args.seed, force=args.force)
    print(f"quickstart data ready in {out}")
    return 0


def cmd_data_convert(args: argparse.Namespace) -> int:
    from foundryx.data.convert import convert_to_mds
    from foundryx.data.tokenizers import build_hf_tokenizer

    tok = build_hf_tokenizer(args.tokenizer)
    manifest = convert_to_mds(
        args.input, args.out, tok, args.max_seq_len, text_field=args.text_field,
        compression=args.compression, overwrite=args.overwrite,
    )
    print(
        f"wrote {manifest['sequences']} sequences of {args.max_seq_len} tokens "
        f"({manifest['tokens']} tokens from {manifest['documents']} documents) to {args.out}"
    )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="foundryx", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a run config (same as `composer train.py`)")
    t.add_argument("config", nargs="?", help="run config YAML, e.g. yamls/quickstart.yaml")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_duration=20ba")
    t.add_argument("--dry-run", action="store_true", help="print the resolved config and derived numbers")
    t.add_argument("--help-config", action="store_true", help="list every config key with its doc")
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
    c = dsub.add_parser("convert", help="text / folder / jsonl → MDS shards of token sequences")
    c.add_argument("--input", required=True, help="a .txt file, a folder of .txt files, or a .jsonl file")
    c.add_argument("--out", required=True, help="output folder for the MDS shards")
    c.add_argument("--tokenizer", required=True, help="a local tokenizer folder or a hub name")
    c.add_argument("--max-seq-len", type=int, required=True)
    c.add_argument("--text-field", default="text", help="jsonl field holding the text")
    c.add_argument("--compression", default=None, help="e.g. zstd")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(fn=cmd_data_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except FoundryxError as e:
        if _is_rank_zero():
            print(f"foundryx: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
