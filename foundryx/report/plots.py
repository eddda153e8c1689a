"""The report's plots: one PNG of a fixed size each (``SIZE`` pixels), or the reason it was
skipped. Every function returns a :class:`Plot`; matplotlib draws off-screen (Agg)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from foundryx.report.run import RunFolder, Series

WIDTH, HEIGHT, DPI = 8.0, 4.5, 100
SIZE = (int(WIDTH * DPI), int(HEIGHT * DPI))  # (800, 450) pixels
HEADROOM = 1.12  # an axis from 0 reaches this much above its highest value


@dataclass
class Plot:
    name: str  # file stem, e.g. "loss"
    title: str
    skipped: str | None = None  # why it was not drawn
    draw: Callable[[Any], None] | None = None  # fills a matplotlib Figure
    note: str | None = None  # what a reader would otherwise ask, shown under it in report.md

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


def fmt_number(v: float) -> str:
    """The one format of the report's numbers (tables and axes): from 1,000 up, and any whole
    number, with thousands separators and no decimals (``40,960``, ``102,400``); otherwise 4
    significant digits in plain notation (``3.352``, ``0.0003``), scientific only below 0.0001."""
    if not math.isfinite(v):
        return str(v)
    if abs(v) >= 1000 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:.4g}"


def smoothing_window(n: int) -> int:
    """Points in the smoothing window of a series of ``n``: about a tenth of it, odd, at least 5
    and at most 101 (never more than ``n``)."""
    return min(n, max(5, min(101, (n // 10) | 1)))


def smooth(steps: list[float], values: list[float], window: int | None = None) -> list[float]:
    """Each point replaced by a local linear fit (LOESS): the line fitted by least squares to
    the ``window`` points nearest to it (tricube weights: the nearer, the more), read at that
    point. Inside the series the window is centred; at its ends it is one-sided and follows the
    trend, so the last point of a falling loss is where the loss is now, not where it was: an
    exponential moving average of weight w lags about 1/(1 - w) points (10 for 0.9) behind a
    trend, however it is debiased. Exact for a straight line; fewer than 3 points are returned
    as they are."""
    n = len(values)
    if n < 3:
        return [float(v) for v in values]
    k = window or smoothing_window(n)
    x, y = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    out = np.empty(n)
    for lo in range(0, n, 4096):  # bounded memory on long runs: 4096 x k at a time
        i = np.arange(lo, min(n, lo + 4096))
        start = np.clip(i - k // 2, 0, n - k)
        idx = start[:, None] + np.arange(k)[None, :]
        xs, ys, x0 = x[idx], y[idx], x[i][:, None]
        dist = np.abs(xs - x0)
        reach = dist.max(axis=1, keepdims=True) * 1.0001 + 1e-12
        w = (1 - (dist / reach) ** 3) ** 3
        w /= w.sum(axis=1, keepdims=True)
        mx, my = (w * xs).sum(axis=1), (w * ys).sum(axis=1)
        dx = xs - mx[:, None]
        var = (w * dx * dx).sum(axis=1)
        cov = (w * dx * (ys - my[:, None])).sum(axis=1)
        slope = np.divide(cov, var, out=np.zeros_like(cov), where=var > 0)
        out[i] = my + slope * (x[i] - mx)
    return out.tolist()


def _lines(ax: Any, series: dict[str, Series], ylabel: str, *, scale: float = 1.0,
           from_zero: bool = False, labels: dict[str, str] | None = None) -> None:
    """Each series against the batch (1..N, the console's numbers) on integer ticks, values in
    the report's one number format; ``from_zero``: a rate or an amount, whose axis starts at 0
    so that its size reads right and ends with room above the highest value (a flat line is
    not drawn on the frame); ``labels``: legend text per key (default: the key)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for key, s in series.items():
        ax.plot(s.steps, [v * scale for v in s.values], label=(labels or {}).get(key, key),
                lw=1.2, marker="o" if len(s.values) < 20 else None)
    ax.set_xlabel("batch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a short run: no batch 2.5
    steps = [b for s in series.values() for b in s.steps]
    if steps and max(steps) - min(steps) < 2:  # one or two points: room for whole-batch ticks
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.set_ylabel(ylabel)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_number(v)))
    if from_zero:
        top = max((v * scale for s in series.values() for v in s.values), default=0.0)
        ax.set_ylim(0, max(ax.get_ylim()[1], top * HEADROOM) if top > 0 else None)
    ax.grid(alpha=0.3)
    if series or ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def loss_plot(run: RunFolder) -> Plot:
    found = run.find("loss/train/total", "loss/train*")
    if found is None:
        return Plot("loss", "training loss", skipped="the run logged no loss/train/* metric")
    key, s = found
    evals = run.matching(r"^metrics/eval/LanguageCrossEntropy$")

    window = smoothing_window(len(s.values))

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        ax.plot(s.steps, s.values, color="tab:blue", alpha=0.3, lw=0.8, label=f"{key} (raw)")
        if len(s.values) >= 3:
            ax.plot(s.steps, smooth(s.steps, s.values, window), color="tab:blue", lw=1.8,
                    label=f"smoothed (local linear fit over {window} batches)")
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
        fig.subplots(), lrs, "learning rate", from_zero=True))


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

    late = _speed_window(run, tps[1] if tps is not None else next(iter(mfu.values())))
    labels = {}
    if late is not None:
        window, first, start = late
        labels = {k: f"{k} (mean of {_batches(window)}; first at batch {first})"
                  for k in ([tps[0]] if tps is not None else []) + list(mfu)}

    def draw(fig: Any) -> None:
        axes = fig.subplots(1, 2 if tps and mfu else 1, squeeze=False)[0]
        if tps is not None:
            _lines(axes[0], {tps[0]: tps[1]}, "throughput (tokens/s)", from_zero=True,
                   labels=labels)
        if mfu:
            _lines(axes[-1], mfu, "MFU (% of peak)", scale=100.0, from_zero=True, labels=labels)

    title = " and ".join(t for t, has in (("tokens/s", tps is not None), ("MFU", bool(mfu))) if has)
    note = None
    if late is not None:
        window, first, start = late
        note = (f"Throughput starts at batch {first} (the loss at batch {start}): speed_monitor "
                f"reports the mean over its window, the last {_batches(window)} "
                "(callbacks.speed_monitor.window_size), timed from batch end to batch end, so "
                f"its first value needs {window + 1} batch ends.")
    return Plot("throughput", title, draw=draw, note=note)


def _batches(n: int) -> str:
    return f"{n} batch" + ("" if n == 1 else "es")


def _speed_window(run: RunFolder, speed: Series) -> tuple[int, int, int] | None:
    """``(window, its first batch, the loss's first batch)`` when throughput starts later than
    the loss (the speed monitor's window filling), else None; the window from the run config,
    else from the gap."""
    loss = run.find("loss/train/total", "loss/train*")
    start = loss[1].steps[0] if loss is not None else 1
    if not speed.steps or speed.steps[0] <= start:
        return None
    monitor = ((run.config or {}).get("callbacks") or {}).get("speed_monitor") or {}
    window = monitor.get("window_size") if isinstance(monitor, dict) else None
    if not isinstance(window, int) or isinstance(window, bool):
        window = speed.steps[0] - start
    return window, speed.steps[0], start


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
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=bottom)  # below the lowest score: a negative bar shows
        ax.axhline(0, color="black", lw=0.8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)

    scores = [v for s in table.values() for v in s.values() if math.isfinite(v)]
    low, high = min([0.0, *scores]), max([0.0, *scores, *baselines.values()])
    bottom = low - 0.08 * (high - low) if low < 0 else 0.0
    gauntlet = any(k.startswith("gauntlet/") for k in keys)
    ylabel = ("score: tasks, fraction correct\n(gauntlet: 0 = chance, < 0 worse)" if gauntlet
              else "score (fraction correct)")
    return Plot("icl", "ICL scores" + (" (dashed: random baseline)" if baselines else ""),
                draw=draw)


PLOTS = (loss_plot, lr_plot, throughput_plot, memory_plot, eval_plot, icl_plot)
