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
    units = {"loss": "nats/token", "lr": "per step", "throughput": "tokens/s", "memory": "GiB",
             "eval": "nats/token"}
    for name, plot in plots.items():
        fig = plot.figure()
        for ax in fig.axes:
            assert ax.get_xlabel() == "batch", name
            lo, hi = ax.get_xlim()
            shown = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert len(shown) >= 2 and all(float(t).is_integer() for t in shown), (name, shown)
            assert units[name] in ax.get_ylabel(), (name, ax.get_ylabel())
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
