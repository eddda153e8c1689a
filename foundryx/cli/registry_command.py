"""``foundryx registry list``: the entries of the registries."""

from __future__ import annotations

import argparse

from foundryx import registry
from foundryx.errors import FoundryxError


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("registry", help="inspect registries")
    rsub = r.add_subparsers(dest="action", required=True)
    rl = rsub.add_parser("list", help="print name, kind and source of each entry")
    rl.add_argument("registry", nargs="?", help="one registry, e.g. callbacks")
    rl.set_defaults(fn=cmd_registry_list)
