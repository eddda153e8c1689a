"""foundryx report: plots of the right size, linked from report.md; a plot the run could not
have is a line saying why; a missing or empty run folder is one message (exit 2). The report of
a real training run is in tests/test_plugin_e2e.py (the same run the plugin test makes)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from PIL import Image

from foundryx.cli import main
from foundryx.report import SIZE, make_report

PNG_LINK = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")


def write_run(folder: Path, batches: int = 40, restart_at: int | None = None) -> None:
    """A run folder as foundryx train leaves it: metrics.jsonl, run.json, and an eval's results
    with a reference model."""
    folder.mkdir(parents=True)
    rows = []
    for b in range(batches):
        rows += [{"batch": b, "loss/train/total": 6 * math.exp(-b / 15) + 0.3 * ((-1) ** b)},
                 {"batch": b, "lr-DecoupledAdamW/group0": 1e-3 * min(1, b / 5)},
                 {"batch": b, "time/batch": b, "time/token": 128 * b, "time/train": b / 3600}]
        if b >= 10:
            rows.append({"batch": b, "throughput/tokens_per_sec": 1000 + b,
                         "throughput/device/mfu": 0.3})
        if b % 10 == 9:
            rows.append({"batch": b, "metrics/eval/LanguageCrossEntropy": 5 - b / 10,
                         "metrics/facts_mc/0-shot/ICLMultipleChoiceAccuracy": 0.25 + b / 100,
                         "icl/gauntlet/quickstart_facts": 0.1})
    if restart_at is not None:  # a restarted run appends from batch 0 again
        rows += [{"batch": b, "loss/train/total": 1.0} for b in range(restart_at)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "run.json").write_text(json.dumps({"hyperparameters": {
        "foundryx/config": {"run_name": "tiny", "model": {"name": "mpt_causal_lm", "d_model": 64}},
        "foundryx/environment": {"torch": "2.x-test", "gpus": "none"}}}))
    results = folder / "eval"
    results.mkdir()
    (results / "results.json").write_text(json.dumps({
        "models": ["reference"], "scores": {"reference": {"facts_mc/0-shot": 0.5,
                                                           "gauntlet/quickstart_facts": 0.3}},
        "random_baselines": {"facts_mc/0-shot": 0.25}}))
    (results / "comparison_tiny.md").write_text("| result | reference | tiny |\n|---|---|---|\n")


def test_report_plots_are_images_linked_from_report_md(tmp_path):
    write_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 0
    out = tmp_path / "run" / "report"
    md = (out / "report.md").read_text()
    linked = PNG_LINK.findall(md)
    assert linked == ["loss.png", "lr.png", "throughput.png", "eval.png", "icl.png"]
    for name in linked:
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.size == SIZE, (name, im.size)
    # what the run did not log is a line saying why, not a plot
    assert not (out / "memory.png").exists()
    assert "- memory: not plotted: the run logged no memory/*_gib metrics" in md
    # the final numbers, the ICL scores against the reference model, config and environment
    assert "| train loss (loss/train/total, mean of the last 10) |" in md
    assert "| train loss (loss/train/total, last) |" in md  # the console's final loss
    assert "| facts_mc/0-shot | 0.6400 | 0.5000 |" in md  # this run (last logged), reference
    assert "| gauntlet/quickstart_facts | 0.1000 | 0.3000 |" in md
    assert "comparison_tiny.md" in md
    assert "| torch | 2.x-test |" in md and "d_model: 64" in md
    assert "# Run report: tiny" in md


def test_appended_runs_show_the_last_values_per_batch(tmp_path):
    write_run(tmp_path / "run", batches=30, restart_at=12)
    path = make_report(tmp_path / "run", out=tmp_path / "rep")
    md = path.read_text()
    assert "holds 2 runs appended" in md
    assert "| train loss (loss/train/total, mean of the last 10) | 1 |" in md


def test_a_run_without_metadata_says_what_is_missing(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        json.dumps({"batch": 0, "loss/train/total": 3.0}) + "\n")
    md = make_report(tmp_path / "run").read_text()
    assert "Not recorded: the folder has no run.json" in md
    assert "- learning rate: not plotted: the run logged no learning rate" in md
    assert "- ICL scores: not plotted" in md


@pytest.mark.parametrize("case", ["missing", "empty folder", "empty metrics", "no losses"])
def test_missing_or_empty_run_folder_is_one_message(case, tmp_path, capsys):
    folder = tmp_path / "run"
    if case != "missing":
        folder.mkdir()
    if case == "empty metrics":
        (folder / "metrics.jsonl").write_text("")
    if case == "no losses":
        (folder / "metrics.jsonl").write_text(json.dumps({"batch": 0, "time/batch": 0}) + "\n")
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foundryx: error: ") and err.count("\n") == 1, err
    assert str(folder) in err and "Traceback" not in err
    want = {"missing": "no such run folder", "empty folder": "holds no metrics.jsonl",
            "empty metrics": "holds no losses or metrics", "no losses": "holds no losses"}[case]
    assert want in err
    assert not (folder / "report").exists()  # nothing written


def test_a_speed_monitor_whose_window_never_filled_is_named(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps({"batch": b, "loss/train/total": 3.0 - b}) + "\n" for b in range(3)))
    (tmp_path / "run" / "run.json").write_text(json.dumps({"hyperparameters": {
        "foundryx/config": {"callbacks": {"speed_monitor": {"window_size": 10}}}}}))
    md = make_report(tmp_path / "run").read_text()
    assert ("- throughput: not plotted: the run logged no tokens/s or MFU: speed_monitor reports "
            "once its window (10 batches) is full, and the run stopped before") in md


def _short_cpu_run(folder: Path, batches: int = 5) -> None:
    """A short CPU run as foundryx train logs it (batches 1..N): no MFU, RSS memory."""
    folder.mkdir(parents=True)
    rows = []
    for b in range(1, batches + 1):
        rows += [{"batch": b, "loss/train/total": 5.0 - 0.5 * b, "time/batch": b - 1},
                 {"batch": b, "lr-DecoupledAdamW/group0": 1e-3, "memory/rss_gib": 0.9 + b / 100,
                  "memory/peak_rss_gib": 0.95 + b / 100}]
        if b >= 2:
            rows.append({"batch": b, "throughput/tokens_per_sec": 130.0 + b})
    rows.append({"batch": batches, "metrics/eval/LanguageCrossEntropy": 3.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plots_have_integer_batch_ticks_units_and_rates_from_zero(tmp_path):
    """What a person reads at a glance: the batch axis of a 5-batch run has whole batches only,
    every axis says its unit, rates and amounts start at 0, and a CPU run's throughput plot is
    not titled with an MFU it does not have."""
    from foundryx.report.plots import PLOTS
    from foundryx.report.run import read_run_folder

    _short_cpu_run(tmp_path / "run")
    run = read_run_folder(tmp_path / "run")
    plots = {p.name: p for p in (make(run) for make in PLOTS) if not p.skipped}
    assert set(plots) == {"loss", "lr", "throughput", "memory", "eval"}
    assert plots["throughput"].title == "tokens/s"
    units = {"loss": "nats/token", "lr": "learning rate", "throughput": "tokens/s",
             "memory": "GiB", "eval": "nats/token"}
    for name, plot in plots.items():
        fig = plot.figure()
        for ax in fig.axes:
            assert ax.get_xlabel() == "batch", name
            lo, hi = ax.get_xlim()
            shown = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert len(shown) >= 2 and all(float(t).is_integer() for t in shown), (name, shown)
            assert units[name] in ax.get_ylabel(), (name, ax.get_ylabel())
            if name == "lr":  # a learning rate has no unit ("per step" is none)
                assert ax.get_ylabel() == "learning rate"
            if name in ("lr", "throughput", "memory"):
                assert ax.get_ylim()[0] == 0, (name, ax.get_ylim())
    # the report's own PNGs are these figures
    path = make_report(tmp_path / "run")
    with Image.open(path.parent / "throughput.png") as im:
        assert im.size == SIZE


def test_mfu_appears_in_the_title_only_when_logged(tmp_path):
    from foundryx.report.plots import throughput_plot
    from foundryx.report.run import read_run_folder

    write_run(tmp_path / "run")  # logs throughput/device/mfu
    plot = throughput_plot(read_run_folder(tmp_path / "run"))
    assert plot.title == "tokens/s and MFU"
    ax_tps, ax_mfu = plot.figure().axes
    assert "%" in ax_mfu.get_ylabel() and ax_mfu.get_ylim()[0] == 0
    assert max(line.get_ydata().max() for line in ax_mfu.get_lines()) == pytest.approx(30.0)


def test_metrics_jsonl_numbers_batches_as_the_console_does(tmp_path):
    """A real (tiny) Composer run: the loss of batch N and its learning rate carry batch N,
    1..N, as the console prints them (Composer logs the loss before it counts the batch)."""
    from composer.callbacks import LRMonitor
    from test_guards import tiny_trainer

    from foundryx.loggers.jsonl import JSONLLogger, read_metrics

    jsonl = JSONLLogger(str(tmp_path / "metrics.jsonl"))
    trainer = tiny_trainer([LRMonitor()], batches=4, loggers=[jsonl])
    trainer.fit()
    trainer.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    loss = [r["batch"] for r in rows if "loss/train/total" in r]
    lr = [r["batch"] for r in rows if any(k.startswith("lr-") for k in r)]
    assert loss == [1, 2, 3, 4] and lr == [1, 2, 3, 4]


def _falling_loss(batches: int) -> tuple[list[int], list[float], list[float]]:
    """A short run's loss: falling fast, with batch-to-batch noise; (batches, loss, noiseless)."""
    steps = list(range(1, batches + 1))
    clean = [3.2 + 4.0 * math.exp(-b / 6) for b in steps]
    return steps, [c + 0.08 * (-1) ** b for b, c in zip(steps, clean)], clean


@pytest.mark.parametrize("batches", [12, 20, 40, 200])
def test_the_smoothed_loss_ends_where_the_loss_is(batches):
    """Issue 39: an EMA (0.9) ended at 4.33 where the loss was 3.35 on a short run. The smoothed
    line's last point is within 3% of the loss now, and of the mean of the last 3 batches; a
    straight line is smoothed to itself. (The debiased EMA this replaced ends 10% and more above
    the loss on each of these runs.)"""
    from foundryx.report.plots import smooth

    steps, loss, clean = _falling_loss(batches)
    smoothed = smooth(steps, loss)
    assert len(smoothed) == batches
    assert abs(smoothed[-1] - clean[-1]) <= 0.03 * clean[-1], (smoothed[-1], clean[-1])
    recent = sum(loss[-3:]) / 3
    assert abs(smoothed[-1] - recent) <= 0.03 * recent, (smoothed[-1], recent)
    # no lag: the whole of a short run, the last quarter of a longer one (where a window wider
    # than the first fast drop rounds it off)
    tail = 0 if batches <= 40 else batches * 3 // 4
    assert all(abs(s - c) <= 0.03 * c for s, c in zip(smoothed[tail:], clean[tail:]))
    line = [7.0 - 0.2 * b for b in steps]
    assert smooth(steps, line) == pytest.approx(line)
    assert smooth([1, 2], [3.0, 2.0]) == [3.0, 2.0]


def test_the_smoothing_window_is_what_docs_operations_md_says():
    """About a tenth of the run, odd, at least 5 and at most 101 (never more than the run)."""
    from foundryx.report.plots import smoothing_window

    assert [smoothing_window(n) for n in (3, 5, 20, 40, 200, 211, 5000)] == [3, 5, 5, 5, 21, 21, 101]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    assert "about a tenth of the run, at least 5 and at most 101" in " ".join(doc.split())


def test_the_loss_plot_draws_that_smoothed_line(tmp_path):
    from foundryx.report.plots import loss_plot
    from foundryx.report.run import read_run_folder

    steps, loss, clean = _falling_loss(20)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({"batch": b, "loss/train/total": v}) + "\n" for b, v in zip(steps, loss)))
    ax = loss_plot(read_run_folder(tmp_path / "run")).figure().axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("smoothed"))
    assert "EMA" not in line.get_label() and "batches" in line.get_label()
    assert abs(line.get_ydata()[-1] - clean[-1]) <= 0.03 * clean[-1]


def test_axes_from_zero_leave_room_above_a_flat_line(tmp_path):
    """The peak-RSS line (flat at its maximum) is drawn below the frame, not on it."""
    from foundryx.report.plots import memory_plot
    from foundryx.report.run import read_run_folder

    _short_cpu_run(tmp_path / "run", batches=30)
    ax = memory_plot(read_run_folder(tmp_path / "run")).figure().axes[0]
    bottom, top = ax.get_ylim()
    highest = max(max(ln.get_ydata()) for ln in ax.get_lines())
    assert bottom == 0 and top >= 1.1 * highest, (top, highest)


def test_throughput_says_why_it_starts_late(tmp_path):
    """A run (batches 1..N, as foundryx train logs them) whose tokens/s starts at batch 11: the
    speed monitor's window of 10 batches, timed end to end (11 batch ends), is said in the
    legend and under the plot in report.md."""
    from foundryx.report.plots import throughput_plot
    from foundryx.report.run import read_run_folder

    def run_folder(name: str, first: int, config: bool) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"batch": b, "loss/train/total": 5.0 - b / 10} for b in range(1, 31)]
        rows += [{"batch": b, "throughput/tokens_per_sec": 1000.0 + b} for b in range(first, 31)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if config:
            (folder / "run.json").write_text(json.dumps({"hyperparameters": {"foundryx/config": {
                "callbacks": {"speed_monitor": {"window_size": 10}}}}}))
        return folder

    for config in (True, False):  # the window from the config, or from the gap
        folder = run_folder(f"run-{config}", 11, config)
        plot = throughput_plot(read_run_folder(folder))
        assert plot.note.startswith("Throughput starts at batch 11 (the loss at batch 1)"), plot.note
        assert "the last 10 batches (callbacks.speed_monitor.window_size)" in plot.note
        assert "needs 11 batch ends" in plot.note
        labels = [t.get_text() for ax in plot.figure().axes for t in ax.get_legend().get_texts()]
        assert labels == ["throughput/tokens_per_sec (mean of 10 batches; first at batch 11)"]
        assert plot.note in make_report(folder).read_text()
    # throughput from the first batch: nothing to explain
    assert throughput_plot(read_run_folder(run_folder("from-1", 1, True))).note is None


def test_a_negative_gauntlet_score_shows_below_a_zero_line(tmp_path):
    """A gauntlet score below chance is negative: the axis reaches below it, has a zero line,
    and does not call it a fraction correct."""
    from foundryx.report.plots import icl_plot
    from foundryx.report.run import read_run_folder

    write_run(tmp_path / "run", batches=10)
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"batch": 10, "icl/gauntlet/quickstart_facts": -0.2}) + "\n")
    ax = icl_plot(read_run_folder(tmp_path / "run")).figure().axes[0]
    assert ax.get_ylim()[0] < -0.2
    assert any(list(ln.get_ydata()) == [0, 0] for ln in ax.get_lines())  # the zero line
    assert "0 = chance" in ax.get_ylabel() and "< 0" in ax.get_ylabel()
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights[0] == pytest.approx(-0.2)


@pytest.mark.parametrize(("value", "text"), [
    (40960, "40,960"), (102400, "102,400"), (1234567.8, "1,234,568"), (40, "40"),
    (3.35117, "3.351"), (0.25, "0.25"), (0.0003, "0.0003"), (1.5e-5, "1.5e-05"), (0, "0"),
    (-0.12, "-0.12"), (999.4, "999.4")])
def test_one_number_format(value, text):
    from foundryx.report import fmt_number

    assert fmt_number(value) == text


def test_report_numbers_and_axes_use_that_format(tmp_path):
    """The numbers issue 39 saw formatted two ways ('4.096e+04' beside '102,400')."""
    from foundryx.report.plots import throughput_plot
    from foundryx.report.run import read_run_folder

    write_run(tmp_path / "run", batches=320)  # 320 x 128 = 40,960 tokens
    md = make_report(tmp_path / "run").read_text()
    assert "| tokens (time/token, last) | 40,832 |" in md and "e+0" not in md
    ax = throughput_plot(read_run_folder(tmp_path / "run")).figure().axes[0]
    assert ax.yaxis.get_major_formatter()(1200.0, 0) == "1,200"


def test_the_two_train_losses_are_named_and_explained(tmp_path):
    steps, loss, _ = _falling_loss(20)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({"batch": b, "loss/train/total": v}) + "\n" for b, v in zip(steps, loss)))
    md = make_report(tmp_path / "run").read_text()
    from foundryx.report import fmt_number

    assert f"| train loss (loss/train/total, last) | {fmt_number(loss[-1])} |" in md
    assert f"| train loss (loss/train/total, mean of the last 10) | {fmt_number(sum(loss[-10:]) / 10)} |" in md
    assert "the console's final line" in md and "batch-to-batch noise" in md
