"""What a person reads: the console line, eval table, progress bar, the run summary, the
known-warning filter and the memory monitor's keys."""

from __future__ import annotations

import io
import logging
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader, TensorDataset

from foundryx.callbacks.memory_monitor import MemoryMonitor
from foundryx.callbacks.speed_monitor import SpeedMonitor
from foundryx.errors import ConfigError
from foundryx.loggers.console import ConsoleLogger, format_eval_table, format_line
from foundryx.runtime import known_warnings
from foundryx.runtime.run_summary import RunFacts, summary


def test_line_format():
    metrics = {"loss/train/total": 2.345678, "lr-DecoupledAdamW/group0": 0.003,
               "throughput/tokens_per_sec": 12345.0, "throughput/device/mfu": 0.4123,
               "memory/allocated_gib": 1.25, "memory/reserved_gib": 2.0, "time/train": 1.0}
    assert format_line(20, 200, metrics, 65) == (
        "batch  20/200  loss 2.3457  lr 3.00e-03  12.3k tok/s  mfu 41.2%  mem 1.2/2.0 GiB  eta 1m05s")
    # CPU: RSS instead of GPU memory, no MFU, no throughput yet (window not full), no ETA
    assert format_line(5, None, {"loss/train/total": 7.0, "memory/rss_gib": 0.9}, None) == (
        "batch 5  loss 7.0000  rss 0.90 GiB")
    table = format_eval_table(100, {"metrics/eval/LanguageCrossEntropy": 4.48971,
                                    "metrics/eval/LanguagePerplexity": 89.09})
    assert table.splitlines() == ["eval at batch 100:",
                                  "  eval  LanguageCrossEntropy   4.4897",
                                  "  eval  LanguagePerplexity    89.0900"]


def test_bad_options_name_the_yaml_path():
    with pytest.raises(ConfigError) as e:
        ConsoleLogger(log_interval="1ep", level="loud")
    text = str(e.value)
    assert "loggers.console.log_interval: '1ep'" in text and "loggers.console.level: 'loud'" in text


def _fit(console: ConsoleLogger, batches: int = 8) -> Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=DataLoader(data, batch_size=4), eval_dataloader=DataLoader(data, batch_size=16),
        eval_interval="4ba", max_duration=f"{batches}ba", device="cpu", loggers=[console],
        callbacks=[SpeedMonitor(window_size=2), MemoryMonitor()], log_to_console=False,
        progress_bar=False, optimizers=None,
    )
    trainer.fit()
    trainer.close()
    return trainer


def test_a_run_prints_one_line_per_interval_and_eval_tables():
    stream = io.StringIO()
    console = ConsoleLogger(log_interval="2ba", stream=stream)
    _fit(console)
    lines = stream.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines if ln.startswith("batch")] == [
        "batch 2/8", "batch 4/8", "batch 6/8", "batch 8/8"]
    line4 = next(ln for ln in lines if ln.startswith("batch 4/8"))
    # speed and memory of that very batch are on its line (printed after every BATCH_END callback)
    assert "samples/s" in line4 and "rss " in line4 and "loss " in line4 and "eta " in line4
    # the eval table follows its batch's line
    assert lines[lines.index(line4) + 1] == "eval at batch 4:"
    assert len(lines) == 4 + 2 * 3  # four lines, two tables of a header and two metrics
    assert "\r" not in stream.getvalue()  # not a terminal: no progress bar
    assert console.first_loss is not None and console.last_loss is not None


def test_debug_level_prints_every_metric_and_bar_when_asked():
    stream = io.StringIO()
    _fit(ConsoleLogger(log_interval="4ba", level="debug", progress_bar=True, stream=stream))
    text = stream.getvalue()
    assert "  time/train: " in text and "  memory/peak_rss_gib: " in text
    assert "\r" in text and "8/8" in text  # the tqdm bar drew itself


def test_only_rank_zero_prints(monkeypatch):
    monkeypatch.setattr(dist, "get_global_rank", lambda: 1)
    quiet, loud = io.StringIO(), io.StringIO()
    ConsoleLogger(stream=quiet).write("hello")
    ConsoleLogger(stream=loud, all_ranks=True).write("hello")
    assert quiet.getvalue() == "" and "hello" in loud.getvalue()


def test_memory_monitor_keys_on_cpu():
    reading = MemoryMonitor.read(SimpleNamespace(device=SimpleNamespace(name="cpu")))
    assert set(reading) == {"memory/rss_gib", "memory/peak_rss_gib"}
    assert 0.01 < reading["memory/rss_gib"] <= reading["memory/peak_rss_gib"] * 1.01 < 24


def test_summary_names_outputs_and_next_commands():
    text = summary(RunFacts(
        run_name="quickstart", config="yamls/quickstart.yaml", batches=200, last_batch=200,
        tokens=409600, seconds=151, first_loss=8.0155, last_loss=2.9, save_folder="runs/quickstart/checkpoints",
        checkpoint="runs/quickstart/checkpoints/ep0-ba200", metrics="runs/quickstart/metrics.jsonl",
        eval_config="eval/yamls/quickstart.yaml"))
    assert text.splitlines() == [
        "done: quickstart: 200 batches in 2m31s, 409.6k tokens, loss 8.0155 -> 2.9000",
        "  checkpoint  runs/quickstart/checkpoints/ep0-ba200",
        "  metrics     runs/quickstart/metrics.jsonl",
        "next:",
        "  foundryx eval eval/yamls/quickstart.yaml "
        "models='[{label: quickstart, checkpoint: runs/quickstart/checkpoints}]' "
        "output_dir=runs/quickstart/eval",
        "  foundryx export runs/quickstart/checkpoints runs/quickstart/export/hf",
        "  foundryx report runs/quickstart   # writes runs/quickstart/report/report.md",
    ]
    lora = summary(RunFacts(
        run_name="llama-lora", config="yamls/finetune/llama-lora.yaml", batches=50, last_batch=50,
        tokens=1, seconds=1, save_folder="runs/llama-lora/checkpoints",
        metrics="runs/llama-lora/metrics.jsonl", eval_config="eval/yamls/quickstart.yaml",
        lora_base="./runs/quickstart/export/hf"))
    assert lora.splitlines()[-5:] == [
        "next:",
        "  foundryx export runs/llama-lora/checkpoints runs/llama-lora/export/adapter",
        "  foundryx eval eval/yamls/quickstart.yaml models='[{label: llama-lora, hf: "
        "./runs/quickstart/export/hf, adapter: runs/llama-lora/export/adapter}]' "
        "output_dir=runs/llama-lora/eval",
        "  foundryx export runs/llama-lora/checkpoints runs/llama-lora/export/merged --merged",
        "  foundryx report runs/llama-lora   # writes runs/llama-lora/report/report.md",
    ]
    no_eval = summary(RunFacts(
        run_name="qwen3-lora", config="my-qwen3-lora.yaml", batches=2, last_batch=2, tokens=1,
        seconds=1, save_folder="runs/qwen3-lora/checkpoints", lora_base="./models/tiny-qwen3",
        eval_to_add="eval/yamls/my-qwen3-lora.yaml"))
    assert no_eval.splitlines()[-4:] == [
        "next:",
        "  foundryx export runs/qwen3-lora/checkpoints runs/qwen3-lora/export/adapter",
        "  foundryx export runs/qwen3-lora/checkpoints runs/qwen3-lora/export/merged --merged",
        "  (no eval command: this run names no eval config; write one as "
        "eval/yamls/my-qwen3-lora.yaml (docs/eval.md) and the summary prints its command)",
    ]
    bare = summary(RunFacts(run_name="r", config="r.yaml", batches=5, last_batch=5, tokens=10, seconds=3))
    assert bare.splitlines() == ["done: r: 5 batches in 3s, 10 tokens",
                                 "  checkpoint  none (save_folder is not set)"]


def test_known_warnings_are_filtered_and_others_are_not(monkeypatch, capsys, caplog):
    monkeypatch.delenv("FOUNDRYX_ALL_WARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        known_warnings.install()
        warnings.warn("TypedStorage is deprecated. It will be removed in the future", UserWarning,
                      stacklevel=1)
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the "
                      "intent is to save in a single process.", UserWarning, stacklevel=1)
        warnings.warn("something nobody has seen before", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something nobody has seen before"]
    with known_warnings.filtered_stderr():
        print("No CUDA runtime is found, using CUDA_HOME='/usr/local'", file=sys.stderr)
        print("a line that matters", file=sys.stderr)
    assert capsys.readouterr().err == "a line that matters\n"
    torch_log = logging.getLogger("torch.utils.cpp_extension")  # where torch >= 2.8 says it
    with caplog.at_level(logging.WARNING):
        torch_log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        torch_log.warning("a warning that matters")
    assert [r.getMessage() for r in caplog.records] == ["a warning that matters"]
    assert all(k.reason for k in known_warnings.KNOWN + known_warnings.KNOWN_PRINTS)


def _host_readings() -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from foundryx.callbacks.memory_monitor import host_per_rank

    if dist.get_rank() == 1:  # rank 1 holds 256 MiB more, touched so it is resident
        held = torch.ones(64 * 2**20)
        held.add_(1)
    return host_per_rank()


@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
@pytest.mark.modern_leg
def test_memory_monitor_logs_every_ranks_host_memory():
    """Each rank's host RSS and peak reach rank 0's loggers, and the largest peak (what the
    planner's host-memory-per-rank figure is compared with)."""
    from distributed import run_distributed

    results = run_distributed(_host_readings, world_size=2)
    assert results[0] == results[1]  # every rank has every rank's readings
    r = results[0]
    assert set(r) == {"memory/host_rss_gib/rank0", "memory/host_rss_gib/rank1",
                      "memory/host_peak_gib/rank0", "memory/host_peak_gib/rank1",
                      "memory/host_peak_gib_max"}
    assert r["memory/host_peak_gib/rank1"] - r["memory/host_peak_gib/rank0"] > 0.2, r
    assert r["memory/host_peak_gib_max"] == r["memory/host_peak_gib/rank1"]
    assert 0.01 < r["memory/host_rss_gib/rank0"] <= r["memory/host_peak_gib/rank0"] * 1.01
