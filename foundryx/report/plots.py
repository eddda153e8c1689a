"""The report's plots: one PNG of a fixed size each (``SIZE`` pixels), or the reason it was
skipped. Every function returns a :class:`Plot`; matplotlib draws off-screen (Agg)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.report.run import RunFolder, Series

WIDTH, HEIGHT, DPI = 8.0, 4.5, 100
SIZE = (int(WIDTH * DPI), int(HEIGHT * DPI))  # (800, 450) pixels
SMOOTHING = 0.9  # TensorBoard-style debiased exponential moving average


@dataclass
class Plot:
    name: str  # file stem, e.g. "loss"
    title: str
    skipped: str | None = None  # why it was not drawn
    draw: Callable[[Any], None] | None = None  # fills a matplotlib Figure

    def figure(self) -> Any:
        """The drawn matplotlib Figure (off-screen: no pyplot, no display)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI)
        self.draw(fig)
        fig.suptitle(self.title)
        fig.tight_layout()
        return fig

    def save(self, path: Path) -> None:
        self.figure().savefig(path, dpi=DPI, format="png")  # no bbox_inches: the size stays SIZE


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def _lines(ax: Any, series: dict[str, Series], ylabel: str, *, scale: float = 1.0,
           from_zero: bool = False) -> None:
    """Each series against the batch (1..N, the console's numbers) on integer ticks;
    ``from_zero``: a rate or an amount, whose axis starts at 0 so that its size reads right."""
    from matplotlib.ticker import MaxNLocator

    for key, s in series.items():
        ax.plot(s.steps, [v * scale for v in s.values], label=key, lw=1.2,
                marker="o" if len(s.values) < 20 else None)
    ax.set_xlabel("batch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a short run: no batch 2.5
    steps = [b for s in series.values() for b in s.steps]
    if steps and max(steps) - min(steps) < 2:  # one or two points: room for whole-batch ticks
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.set_ylabel(ylabel)
    if from_zero:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if series or ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def loss_plot(run: RunFolder) -> Plot:
    found = run.find("loss/train/total", "loss/train*")
    if found is None:
        return Plot("loss", "training loss", skipped="the run logged no loss/train/* metric")
    key, s = found
    evals = run.matching(r"^metrics/eval/LanguageCrossEntropy$")

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        ax.plot(s.steps, s.values, color="tab:blue", alpha=0.3, lw=0.8, label=f"{key} (raw)")
        ax.plot(s.steps, smooth(s.values), color="tab:blue", lw=1.8,
                label=f"smoothed (EMA {SMOOTHING})")
        for k, e in evals.items():
            ax.plot(e.steps, e.values, "o-", color="tab:orange", label=k)
        _lines(ax, {}, "cross-entropy loss (nats/token)")

    return Plot("loss", "loss", draw=draw)


def lr_plot(run: RunFolder) -> Plot:
    lrs = run.matching(r"^lr-")
    if not lrs:
        return Plot("lr", "learning rate", skipped="the run logged no learning rate "
                    "(add callbacks.lr_monitor: {})")
    return Plot("lr", "learning rate", draw=lambda fig: _lines(
        fig.subplots(), lrs, "learning rate (per step)", from_zero=True))


def throughput_plot(run: RunFolder) -> Plot:
    tps = run.find("throughput/tokens_per_sec", "throughput/device/tokens_per_sec")
    mfu = run.matching(r"mfu$")
    if tps is None and not mfu:
        monitor = ((run.config or {}).get("callbacks") or {}).get("speed_monitor")
        if monitor is not None:
            window = (monitor or {}).get("window_size", "window_size")
            why = (f"the run logged no tokens/s or MFU: speed_monitor reports once its window "
                   f"({window} batches) is full, and the run stopped before")
        else:
            why = "the run logged no tokens/s or MFU (add callbacks.speed_monitor: {window_size: 10})"
        return Plot("throughput", "throughput", skipped=why)

    def draw(fig: Any) -> None:
        axes = fig.subplots(1, 2 if tps and mfu else 1, squeeze=False)[0]
        if tps is not None:
            _lines(axes[0], {tps[0]: tps[1]}, "throughput (tokens/s)", from_zero=True)
        if mfu:
            _lines(axes[-1], mfu, "MFU (% of peak)", scale=100.0, from_zero=True)

    title = " and ".join(t for t, has in (("tokens/s", tps is not None), ("MFU", bool(mfu))) if has)
    return Plot("throughput", title, draw=draw)


def memory_plot(run: RunFolder) -> Plot:
    mem = run.matching(r"^memory/.*_gib$")  # foundryx's memory_monitor: GiB
    if not mem:
        return Plot("memory", "memory", skipped="the run logged no memory/*_gib metrics (add "
                    "callbacks.memory_monitor: {})")
    return Plot("memory", "memory", draw=lambda fig: _lines(
        fig.subplots(), mem, "memory (GiB)", from_zero=True))


EVAL_UNITS = {"LanguageCrossEntropy": "nats/token", "LanguagePerplexity": "per token",
              "LossMetric": "nats/token"}


def eval_plot(run: RunFolder) -> Plot:
    ev = run.matching(r"^metrics/eval/")
    if not ev:
        return Plot("eval", "eval metrics", skipped="the run logged no eval metrics "
                    "(set eval_loader and eval_interval)")

    def draw(fig: Any) -> None:
        axes = fig.subplots(1, len(ev), squeeze=False)[0]
        for ax, (k, s) in zip(axes, ev.items()):
            name = k.rsplit("/", 1)[-1]
            _lines(ax, {k: s}, f"{name} ({EVAL_UNITS.get(name, 'score')})")

    return Plot("eval", "eval metrics", draw=draw)


def icl_scores(run: RunFolder) -> dict[str, dict[str, float]]:
    """Model label -> result key -> score: this run's last ICL scores, then each eval's
    models (reference models included)."""
    table: dict[str, dict[str, float]] = {}
    if scores := run.icl_scores():
        table[f"{run.name} (training)"] = scores
    for ev in run.evals:
        for model, scores in ev.scores.items():
            table.setdefault(model, {}).update(scores)
    return table


def icl_plot(run: RunFolder) -> Plot:
    table = icl_scores(run)
    if not table:
        return Plot("icl", "ICL scores", skipped="the run logged no ICL scores and the folder "
                    "holds no foundryx eval results (icl_tasks in the run config, or foundryx "
                    "eval with output_dir inside the run folder, or --eval DIR)")
    keys = sorted({k for scores in table.values() for k in scores})
    baselines = {k: v for ev in run.evals for k, v in ev.baselines.items()}

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        n = len(table)
        bar = 0.8 / n
        for j, (model, scores) in enumerate(table.items()):
            xs = [i + (j - (n - 1) / 2) * bar for i in range(len(keys))]
            ax.bar(xs, [scores.get(k, float("nan")) for k in keys], width=bar, label=model)
        for i, k in enumerate(keys):
            if k in baselines:
                ax.plot([i - 0.45, i + 0.45], [baselines[k]] * 2, "k--", lw=1)
        ax.set_xticks(range(len(keys)), keys, fontsize=7, rotation=20, ha="right")
        ax.set_ylabel("score (fraction correct)")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)

    return Plot("icl", "ICL scores" + (" (dashed: random baseline)" if baselines else ""),
                draw=draw)


PLOTS = (loss_plot, lr_plot, throughput_plot, memory_plot, eval_plot, icl_plot)
