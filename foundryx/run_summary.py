"""The lines a run ends on: what it did (loss first -> last, time, tokens), where its outputs
are (checkpoint, metrics, report) and the next commands with the run's real paths.

Imports nothing of foundryx: the entry shell (foundryx.train) gathers the facts.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunFacts:
    run_name: str
    config: str                       # the run YAML as given
    batches: int                      # batches trained by this process (a resumed run: this part)
    last_batch: int
    tokens: int
    seconds: float
    first_loss: float | None = None
    last_loss: float | None = None
    save_folder: str | None = None    # None: no checkpoints saved
    checkpoint: str | None = None     # the newest checkpoint folder, when known
    metrics: str | None = None        # the jsonl logger's file
    eval_config: str | None = None    # an eval YAML to suggest


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _tokens(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def summary(f: RunFacts) -> str:
    """The summary block (no trailing newline)."""
    what = f"{f.batches} batches" + (f" (to batch {f.last_batch})" if f.batches != f.last_batch else "")
    lines = [f"done: {f.run_name}: {what} in {_duration(f.seconds)}, {_tokens(f.tokens)} tokens"
             + (f", loss {f.first_loss:.4f} -> {f.last_loss:.4f}"
                if f.first_loss is not None and f.last_loss is not None else "")]
    if f.save_folder:
        lines.append(f"  checkpoint  {f.checkpoint or f.save_folder}")
    else:
        lines.append("  checkpoint  none (save_folder is not set)")
    if f.metrics:
        folder = Path(f.metrics).parent
        lines.append(f"  metrics     {f.metrics}")
        lines.append(f"  report      {folder / 'report' / 'report.md'} (written by foundryx report)")
    nxt = []
    if f.save_folder:
        run_dir = Path(f.save_folder).parent
        if f.eval_config:
            model = f"[{{label: {f.run_name}, checkpoint: {f.save_folder}}}]"
            nxt.append(f"foundryx eval {f.eval_config} models={shlex.quote(model)}")
        nxt.append(f"foundryx export {shlex.quote(f.save_folder)} "
                   f"{shlex.quote(str(run_dir / 'hf'))}")
    if f.metrics:
        nxt.append(f"foundryx report {shlex.quote(str(Path(f.metrics).parent))}")
    if nxt:
        lines.append("next:")
        lines += [f"  {c}" for c in nxt]
    return "\n".join(lines)
