"""``foundryx report RUN_FOLDER``: PNG plots of a run and ``report.md`` with its config, its
environment, its final numbers and the plots embedded (see docs/operations.md, "Reports")."""

from __future__ import annotations

from pathlib import Path

import yaml

from foundryx.errors import ReportError
from foundryx.report.plots import PLOTS, SIZE, Plot, fmt_number, icl_scores
from foundryx.report.run import RunFolder, read_run_folder
from foundryx.runtime.atomic_writes import write_together

__all__ = ["SIZE", "fmt_number", "make_report", "read_run_folder"]


def final_numbers(run: RunFolder) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []

    def add(label: str, *keys: str, how: str = "last", scale: float = 1.0) -> None:
        found = run.find(*keys)
        if found is None:
            return
        key, s = found
        if how == "last":
            v = s.last
        elif how == "mean of the last 10":
            v = sum(s.values[-10:]) / len(s.values[-10:])
        else:  # max
            v = max(s.values)
        rows.append((f"{label} ({key}, {how})", fmt_number(v * scale)))

    add("batches", "time/batch")
    add("tokens", "time/token")
    add("training time, s", "time/train", scale=3600.0)  # Composer logs hours
    add("train loss", "loss/train/total", "loss/train*", how="last")  # the console's final loss
    add("train loss", "loss/train/total", "loss/train*", how="mean of the last 10")
    for key in run.matching(r"^metrics/eval/"):
        add("eval", key)
    add("tokens/s", "throughput/tokens_per_sec", how="mean of the last 10")
    for key in run.matching(r"mfu$"):
        add("MFU", key, how="mean of the last 10")
    for key in run.matching(r"^memory/peak"):
        add("memory", key, how="max")
    return rows


def _icl_table(run: RunFolder) -> list[str]:
    table = icl_scores(run)
    if not table:
        return []
    keys = sorted({k for scores in table.values() for k in scores})
    lines = ["## ICL scores", "", "| result | " + " | ".join(table) + " |",
             "|---|" + "---:|" * len(table)]
    for k in keys:
        cells = [f"{s[k]:.4f}" if k in s else "-" for s in table.values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    for ev in run.evals:
        for name, text in ev.comparisons.items():
            lines += ["", f"From {ev.path.parent / name}:", "", text.strip()]
    return lines + [""]


LOSS_NOTE = ("Train loss, last: the loss of the last batch, the one the console's final line "
             "prints (`done: ... loss FIRST -> LAST`). Mean of the last 10: the same loss "
             "averaged over the last 10 batches, less noisy; the two differ by the batch-to-batch "
             "noise.")


def render(run: RunFolder, plots: list[Plot]) -> str:
    lines = [f"# Run report: {run.name}", "", f"Run folder: `{run.path}` (metrics: "
             f"`{run.metrics_file.name}`, {sum(len(s.values) for s in run.series.values())} "
             "values)", "", "## Final numbers", "", "| what | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in final_numbers(run)] + [""]
    found = run.find("loss/train/total", "loss/train*")
    if found is not None:
        lines += [LOSS_NOTE, ""]
    if found is not None and found[1].restarts:
        lines += [f"The metrics file holds {found[1].restarts + 1} runs appended one after "
                  "another (restarts, resumes): for each batch, the values logged last are "
                  "shown.", ""]
    lines += ["## Plots", ""]
    for p in plots:
        if p.skipped:
            lines.append(f"- {p.title}: not plotted: {p.skipped}")
        else:
            lines += [f"### {p.title}", "", f"![{p.title}]({p.name}.png)", ""]
            if p.note:
                lines += [p.note, ""]
    lines += [""] + _icl_table(run)
    lines += ["## Environment", ""]
    if run.environment:
        lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in run.environment.items()]
    else:
        lines.append("Not recorded: the folder has no run.json with foundryx/environment "
                     "(written by `foundryx train` with the jsonl logger).")
    lines += ["", "## Config", ""]
    if run.config:
        lines += ["```yaml", yaml.safe_dump(run.config, sort_keys=False).rstrip(), "```"]
    else:
        lines.append("Not recorded: the folder has no run.json with foundryx/config "
                     "(written by `foundryx train` with the jsonl logger).")
    return "\n".join(lines) + "\n"


def make_report(folder: str | Path, out: str | Path | None = None,
                evals: list[str | Path] | None = None) -> Path:
    """Write ``report.md`` and the plots to ``out`` (default ``folder/report``), all together
    or nothing; return the path of ``report.md``. ReportError when ``folder`` holds no run
    or the files cannot be written."""
    run = read_run_folder(folder, evals)
    out = Path(out) if out is not None else run.path / "report"
    plots = [make(run) for make in PLOTS]
    try:
        with write_together() as stage:
            for p in plots:
                if not p.skipped:
                    p.save(stage(out / f"{p.name}.png"))
            stage(out / "report.md").write_text(render(run, plots), encoding="utf-8")
    except OSError as e:
        raise ReportError(f"could not write the report to {out} "
                          f"({e.strerror or e}); nothing there changed. Free space or fix its "
                          "permissions, or give --out DIR") from e
    return out / "report.md"
