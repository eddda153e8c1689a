"""What every benchmark does with its result section: print it, and append it to ``--out``."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: Path | None) -> None:
    """Print ``text``; append it to ``out`` too when given (benchmarks/RESULTS.md, say)."""
    print(text)
    if out:
        with Path(out).open("a") as f:
            f.write(text)
