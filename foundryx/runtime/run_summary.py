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
    eval_to_add: str | None = None    # without one: where an eval YAML of this run would go
    lora_base: str | None = None      # a LoRA run: the Hugging Face base it adapts


# A run folder's layout (foundryx.checkpoint.layout.EXPORT_DIR and EVAL_DIR): the folder above
# the save_folder holds export/ (hf, adapter, merged) and eval/ beside metrics.jsonl and report/.
EXPORT_DIR, EVAL_DIR = "export", "eval"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _tokens(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _q(path: str | Path) -> str:
    return shlex.quote(str(path))


def next_commands(f: RunFacts) -> list[str]:
    """The commands that follow this run, each on the paths the one before it writes: eval of
    the checkpoint (a LoRA run: export of its adapter, then eval of the adapter on its base,
    and the merged export), the export, and the report; eval results and exports go under
    the run folder (the save_folder's parent), where ``foundryx report`` finds them."""
    nxt = []
    if f.save_folder:
        run_dir = Path(f.save_folder).parent
        if f.lora_base:
            adapter = run_dir / EXPORT_DIR / "adapter"
            nxt.append(f"foundryx export {_q(f.save_folder)} {_q(adapter)}")
            model = f"[{{label: {f.run_name}, hf: {f.lora_base}, adapter: {adapter}}}]"
            export = f"{_q(run_dir / EXPORT_DIR / 'merged')} --merged"
        else:
            model = f"[{{label: {f.run_name}, checkpoint: {f.save_folder}}}]"
            export = _q(run_dir / EXPORT_DIR / "hf")
        if f.eval_config:
            nxt.append(f"foundryx eval {f.eval_config} models={shlex.quote(model)} "
                       f"output_dir={_q(run_dir / EVAL_DIR)}")
        nxt.append(f"foundryx export {_q(f.save_folder)} {export}")
    if f.metrics:
        folder = Path(f.metrics).parent
        nxt.append(f"foundryx report {_q(folder)}   # writes {folder / 'report' / 'report.md'}")
    return nxt


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
        lines.append(f"  metrics     {f.metrics}")
    nxt = next_commands(f)
    if nxt:
        lines.append("next:")
        lines += [f"  {c}" for c in nxt]
    if f.save_folder and not f.eval_config and f.eval_to_add:
        lines.append(f"  (no eval command: this run names no eval config; write one as "
                     f"{f.eval_to_add} (docs/eval.md) and the summary prints its command)")
    return "\n".join(lines)
