"""Eval results as a markdown table, CSV, JSON, per-model score YAMLs and a PNG bar chart.

One table holds every model side by side (one column each): the tasks grouped by their gauntlet
category (with their categories and further metrics such as ``acc_norm`` under them), the tasks
outside the gauntlet, then the gauntlet's category scores and averages.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from foundryx.errors import EvalError
from foundryx.runtime.atomic_writes import write_together

KINDS = ("task", "category", "metric", "gauntlet")


@dataclass
class EvalResults:
    """Scores of every model on every result key (``task/N-shot``, ``task/N-shot/category``,
    ``task/N-shot/acc_norm`` (a further metric), ``gauntlet/name``), in the order they were
    added."""

    models: list[str] = field(default_factory=list)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    examples: dict[str, int] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)  # gauntlet category -> task keys

    def add(self, model: str, key: str, score: float, kind: str, examples: int | None = None) -> None:
        if model not in self.scores:
            self.models.append(model)
            self.scores[model] = {}
        self.scores[model][key] = score
        self.kinds.setdefault(key, kind)
        if examples is not None:
            self.examples[key] = examples

    def task_of(self, key: str) -> str:
        """The ``task/N-shot`` a result belongs to (itself for a task)."""
        return "/".join(key.split("/")[:2])

    def category_of(self, key: str) -> str:
        """The gauntlet category of a task result (``""`` outside the gauntlet)."""
        task = self.task_of(key)
        return next((c for c, tasks in self.groups.items() if task in tasks), "")

    def keys(self, *kinds: str) -> list[str]:
        """Result keys of the given kinds (all by default): tasks in the gauntlet's order (each
        followed by its categories and metrics), then the other tasks, gauntlet last."""
        wanted = kinds or KINDS
        tasks = [k for k in self.kinds if self.kinds[k] == "task"]
        grouped = [t for g in self.groups.values() for t in g if t in self.kinds]
        order = {t: i for i, t in enumerate(dict.fromkeys([*grouped, *tasks]))}
        rest = [k for k in self.kinds if self.kinds[k] != "gauntlet"]
        rest.sort(key=lambda k: order.get(self.task_of(k), len(order)))  # stable: task first
        keys = rest + [k for k in self.kinds if self.kinds[k] == "gauntlet"]
        return [k for k in keys if self.kinds[k] in wanted]

    def cell(self, model: str, key: str) -> str:
        v = self.scores.get(model, {}).get(key)
        return "-" if v is None or math.isnan(v) else f"{v:.4f}"


def _baseline(results: EvalResults, key: str) -> str:
    v = results.baselines.get(key) if results.kinds[key] == "task" else None
    return "" if v is None else f"{v:g}"


def markdown_table(results: EvalResults) -> str:
    """The results table; its random-baseline column only when a task has one (the gauntlet's,
    or the task type's: 1 / the number of choices for multiple choice and schema)."""
    with_baseline = any(results.kinds[k] == "task" and k in results.baselines for k in results.kinds)
    head = ["result", "category", "examples", *(["random baseline"] if with_baseline else []),
            *results.models]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for key in results.keys():
        kind = results.kinds[key]
        name = ("  " if kind in ("category", "metric") else "") + key
        cells = [name, results.category_of(key) if kind == "task" else "",
                 str(results.examples.get(key, ""))]
        if with_baseline:
            cells.append(_baseline(results, key))
        lines.append("| " + " | ".join(cells + [results.cell(m, key) for m in results.models]) + " |")
    return "\n".join(lines)


def result_rows(results: EvalResults) -> list[dict]:
    """The table as JSON rows: result, kind, category, examples, random baseline, scores."""
    return [{"result": k, "kind": results.kinds[k], "category": results.category_of(k) or None,
             "examples": results.examples.get(k), "random_baseline": results.baselines.get(k),
             "scores": {m: results.scores[m].get(k) for m in results.models}}
            for k in results.keys()]


def bar_chart(results: EvalResults, path: Path) -> None:
    """Horizontal grouped bars: every model on every task (and gauntlet score), baselines marked.
    Drawn on a bare ``Figure`` (off-screen, Agg): no pyplot, whose import is 0.3 s more of the
    command (foundryx/report/plots.py draws the same way)."""
    from matplotlib.figure import Figure  # heavy: only when results are written

    panels = [(k, t) for k, t in ((results.keys("task"), "accuracy"),
                                  (results.keys("gauntlet"), "gauntlet score (0 = chance)")) if k]
    heights = [max(1.5, 0.25 * len(keys) * max(1, len(results.models)) + 0.8) for keys, _ in panels]
    fig = Figure(figsize=(9, sum(heights) + 0.6))
    axes = fig.subplots(len(panels), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)
    n = len(results.models)
    bar = 0.8 / max(n, 1)
    for ax, (keys, xlabel) in zip(axes[:, 0], panels):
        for j, model in enumerate(results.models):
            ys = [i + (j - (n - 1) / 2) * bar for i in range(len(keys))]
            vals = [results.scores[model].get(k, float("nan")) for k in keys]
            ax.barh(ys, vals, height=bar, label=model)
            for y, v in zip(ys, vals):
                if not math.isnan(v):
                    ax.text(v, y, f" {v:.3f}", va="center", fontsize=7)
        for i, k in enumerate(keys):
            if k in results.baselines:
                ax.plot([results.baselines[k]] * 2, [i - 0.45, i + 0.45], "k--", lw=1)
        ax.set_yticks(range(len(keys)), keys, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        finite = [v for m in results.models for k in keys
                  if not math.isnan(v := results.scores[m].get(k, float("nan")))]
        ax.set_xlim(min([0.0, *finite]) - 0.02, 1.08)
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].legend(loc="lower right", fontsize=8)
    axes[0, 0].set_title("ICL eval" + ("  (dashed: random baseline)" if results.baselines else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


Stage = Callable[[Path], Path]


@contextlib.contextmanager
def results_set(out_dir: str | Path, results: EvalResults) -> Iterator[Stage]:
    """Stage the files of one results set in ``out_dir`` (see
    :func:`foundryx.runtime.atomic_writes.write_together`): they replace the previous ones together, or, when
    one cannot be written, none does and an EvalError names ``out_dir`` (with the scores, so a
    long eval is not lost)."""
    try:
        with write_together() as stage:
            yield stage
    except OSError as e:
        raise EvalError(
            f"could not write the eval results to {out_dir} ({e.strerror or e}); the files there "
            f"are unchanged. Free space or fix its permissions (or set output_dir) and run the "
            f"eval again. The scores were:\n{markdown_table(results)}"
        ) from e


def write_results(results: EvalResults, out_dir: str | Path, source: str = "",
                  stage: Stage | None = None,
                  draw: Callable[[EvalResults, Path], None] | None = None) -> dict[str, Path]:
    """results.md/.csv/.json/.png and scores/<model>.yaml (usable with --compare-to), all
    replaced together or not at all; ``stage``: add them to a set the caller writes; ``draw``:
    what draws the chart (:func:`bar_chart` here by default)."""
    if stage is None:
        with results_set(out_dir, results) as stage:
            return write_results(results, out_dir, source, stage, draw)
    out = Path(out_dir)
    paths = {ext: out / f"results.{ext}" for ext in ("md", "csv", "json", "png")}
    stage(paths["md"]).write_text(markdown_table(results) + "\n", encoding="utf-8")
    with stage(paths["csv"]).open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["result", "kind", "category", "examples", *results.models])
        for key in results.keys():
            w.writerow([key, results.kinds[key], results.category_of(key), results.examples.get(key, ""),
                        *[results.scores[m].get(key, "") for m in results.models]])
    stage(paths["json"]).write_text(json.dumps({
        "config": source, "models": results.models, "scores": results.scores,
        "kinds": results.kinds, "examples": results.examples, "random_baselines": results.baselines,
        "gauntlet_categories": results.groups, "table": result_rows(results),
    }, indent=2) + "\n", encoding="utf-8")
    for model in results.models:
        p = out / "scores" / f"{model.replace('/', '_')}.yaml"
        stage(p).write_text(yaml.safe_dump({k: results.scores[model][k] for k in results.keys()
                                            if k in results.scores[model]}, sort_keys=False),
                            encoding="utf-8")
    (draw or bar_chart)(results, stage(paths["png"]))
    return paths
