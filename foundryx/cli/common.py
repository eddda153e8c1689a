"""What several ``foundryx`` subcommands share."""

from __future__ import annotations

import os


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"
