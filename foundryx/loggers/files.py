"""Reading what the ``jsonl`` logger writes, without loading Composer (``foundryx report``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"  # beside the metrics file: {"hyperparameters": {...}}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows a JSONLLogger wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_hyperparameters(folder: str | Path) -> dict[str, Any]:
    """The hyperparameters a JSONLLogger kept in ``folder/run.json`` ({} when there is none)."""
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("hyperparameters", {})
