"""A YAML syntax error as a person reads it: the file, the line that is wrong with a caret
under the column, and what to change.

    yamls/run.yaml, line 2: not valid YAML: the '[' opened here is never closed ...
        2 | betas: [0.9, 0.95
          |        ^

The YAML parser names the place where it gave up, which is often the line after the mistake
(a key without its colon is only found out on the next line); for each such message the
place the mistake is (the parser's "context" mark, or the line before) is named instead.
"""

from __future__ import annotations

from pathlib import Path

import yaml

# parser context (how the message starts) -> what went wrong there; the context mark is the place
CONTEXTS = {
    "while parsing a flow sequence": "the '[' opened here is never closed: close it with ']' "
                                     "(and separate the items with ', ')",
    "while parsing a flow mapping": "the '{' opened here is never closed: close it with '}' "
                                    "(and separate the items with ', ')",
    "while scanning a simple key": "this line has no ':' after its key: write `key: value`",
    "while scanning a quoted scalar": "the quote opened here is never closed",
    "while scanning a double-quoted scalar": "the quote opened here is never closed",
    "while scanning a single-quoted scalar": "the quote opened here is never closed",
}


def describe(error: yaml.YAMLError, path: Path) -> str:
    """The one problem a YAML error of the file ``path`` makes: ``path, line N: ...`` with
    the line and a caret, and the fix."""
    context, problem = getattr(error, "context", None), getattr(error, "problem", None)
    context_mark, mark = getattr(error, "context_mark", None), getattr(error, "problem_mark", None)
    if mark is None:
        return f"{path}: not valid YAML: {str(error).strip()}"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    what = f"{problem}" if problem else "cannot be parsed"
    line, column = mark.line, mark.column
    known = next((v for k, v in CONTEXTS.items() if context and context.startswith(k)), None)
    if known is not None and context_mark is not None:
        line, column, what = context_mark.line, context_mark.column, known
    elif context and context.startswith("while constructing a mapping") and "duplicate key" in what:
        what = f"{what}: a key may appear once in a mapping; remove one of them"
    elif "cannot start any token" in what and _char(lines, line, column) == "\t":
        what = "a tab: YAML indents with spaces, not tabs; replace it with spaces"
    elif "mapping values are not allowed" in what:
        line, column, what = _mapping_value_here(lines, line, column)
    elif "did not find expected key" in what or "expected <block end>" in what:
        what = ("this line's indentation matches no key above it: indent it as its siblings "
                "are (the same number of spaces)")
    text = lines[line] if 0 <= line < len(lines) else ""
    number = f"{line + 1:>5} | "
    return (f"{path}, line {line + 1}: not valid YAML: {what}\n"
            f"{number}{text.rstrip()}\n{' ' * (len(number) - 2)}| {' ' * column}^")


def _char(lines: list[str], line: int, column: int) -> str:
    return lines[line][column] if 0 <= line < len(lines) and column < len(lines[line]) else ""


def _mapping_value_here(lines: list[str], line: int, column: int) -> tuple[int, int, str]:
    """A ':' the parser did not expect: the key above has no colon (the two lines read as one
    value), or this line is indented deeper than its siblings, or a value holds ': '."""
    prev = next((i for i in range(line - 1, -1, -1)
                 if lines[i].strip() and not lines[i].lstrip().startswith("#")), None)
    indent = _indent(lines[line]) if 0 <= line < len(lines) else 0
    if prev is not None and _indent(lines[prev]) == indent and ":" not in lines[prev]:
        return prev, indent, "this line has no ':' after its key: write `key: value`"
    if prev is not None and _indent(lines[prev]) < indent and not lines[prev].rstrip().endswith(":"):
        return line, indent, ("this line is indented deeper than the key above it, which "
                              "already has a value: indent it as its siblings are")
    return line, column, ("a ':' the parser did not expect: quote a value that holds ': ' "
                          "(\"a: b\"), or check this line's indentation")


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip(" "))

