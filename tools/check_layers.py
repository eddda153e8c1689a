"""Checks foundryx's imports against its layers (``layers.toml`` beside ``foundryx/``).

    python tools/check_layers.py [PROJECT_DIR] [--graph]

Every import of foundryx, absolute or relative, at module level or inside a function, is
charged from the part of the importing file (the first name under ``foundryx/``) to the part
it names. Prints one line per import a rule forbids (``file:line  part -> part``), one per
cycle between two parts (entry shells aside), and a summary with the number of foundryx
imports inside functions (each should be a lazy load of a heavy dependency, commented);
exits 1 when anything is forbidden or cyclic, 2 when the project or its rules are missing.
``--graph`` also prints the import graph between parts: one line per part, the parts it imports
with the number of import statements naming each (what a note's before/after compares).
The rules file is TOML kept to ``name = "words"`` lines, read here without a TOML library
(Python 3.10 has none).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path


def read_rules(path: Path) -> tuple[dict[str, list[str]], set[str]]:
    """``({part: words of its never-rule}, entry shells)`` from the rules file."""
    section, never, shells = None, {}, set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.fullmatch(r'(\w+)\s*=\s*"([^"]*)"', line):
            key, words = m.group(1), m.group(2).split()
            if section == "never":
                never[key] = words
            elif section == "entry" and key == "shells":
                shells = set(words)
        else:
            raise ValueError(f"{path}: cannot read {line!r}")
    return never, shells


def forbidden(src: str, dst: str, never: dict[str, list[str]]) -> bool:
    words = never.get(src)
    if not words or src == dst:
        return False
    if words[0] == "*":
        return dst not in {w[1:] for w in words[1:] if w.startswith("-")}
    return dst in words


def imported(node: ast.AST, module: str) -> list[str]:
    """The dotted foundryx names an import node brings in (relative ones resolved against
    ``module``, the importing file's dotted name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".")[:-node.level] if node.level else []
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def check(root: Path) -> tuple[list[str], list[tuple[str, str]], int, dict[tuple[str, str], int]]:
    """(forbidden import lines, cycles, foundryx imports inside functions, the import graph
    ``{(part, part it imports): import statements}``) of ``root``."""
    pkg = root / "foundryx"
    never, shells = read_rules(root / "layers.toml")
    parts = {p.stem for p in pkg.iterdir() if p.suffix == ".py"}
    parts |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    bad, edges, lazy = [], defaultdict(int), 0
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(root)
        module = ".".join(rel.with_suffix("").parts)
        if f.name == "__init__.py":
            module += ".__init__"  # so that a relative import resolves from the package
        src = rel.parts[1].removesuffix(".py")
        tree = ast.parse(f.read_text(), str(f))
        inside = {id(n) for fn in ast.walk(tree)
                  if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(fn)}
        for node in ast.walk(tree):
            names = [n for n in imported(node, module) if n.startswith("foundryx.")]
            dsts = {n.split(".")[1] for n in names} & parts
            if names and id(node) in inside:
                lazy += 1
            for dst in dsts - {src}:
                edges[(src, dst)] += 1
                if forbidden(src, dst, never):
                    bad.append(f"{rel}:{node.lineno}  {src} -> {dst}")
    cycles = sorted({tuple(sorted((a, b))) for (a, b) in edges
                     if (b, a) in edges and not {a, b} & shells})
    return bad, cycles, lazy, dict(edges)


def graph_lines(edges: dict[tuple[str, str], int]) -> list[str]:
    """``part -> other (n), ...`` per importing part, parts and targets sorted by name."""
    out = defaultdict(list)
    for (src, dst), n in sorted(edges.items()):
        out[src].append(f"{dst} ({n})")
    return [f"{src} -> {', '.join(dsts)}" for src, dsts in sorted(out.items())]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    graph = "--graph" in args
    args = [a for a in args if a != "--graph"]
    root = Path(args[0] if args else ".").resolve()
    if not (root / "foundryx").is_dir() or not (root / "layers.toml").is_file():
        print(f"check_layers: {root} has no foundryx/ and layers.toml", file=sys.stderr)
        return 2
    bad, cycles, lazy, edges = check(root)
    if graph:
        print("\n".join(graph_lines(edges)))
    for line in bad:
        print(line)
    for a, b in cycles:
        print(f"cycle: {a} <-> {b}")
    print(f"{len(bad)} forbidden imports, {len(cycles)} part cycles, {lazy} foundryx imports "
          "inside functions")
    return 1 if bad or cycles else 0


if __name__ == "__main__":
    sys.exit(main())
