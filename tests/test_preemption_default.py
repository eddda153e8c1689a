"""Preemption is on wherever a save_folder is set: a scheduler's SIGTERM to a run whose config
never mentions ``callbacks.preemption`` ends it with a checkpoint and exit 75 (preempted and
saved: foundryx.runtime.preempt.PREEMPTED; not exit 143 and nothing saved); ``callbacks.preemption: null`` turns it off. The 2-process preemption run
with autoresume to the same numbers is tests/test_guards_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundryx.checkpoint.layout import complete_checkpoints
from foundryx.config import load_config
from foundryx.loggers.jsonl import read_metrics
from foundryx.train import run_callbacks

ROOT = Path(__file__).parents[1]
TINY = ["variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        "global_train_batch_size=4", "eval_loader=null", "console_log_interval=1000ba"]


@pytest.mark.parametrize("overrides, on", [
    ([], True),                                   # save_folder set, preemption not named: on
    (["callbacks.preemption=null"], False),       # null: off
    (["callbacks.preemption={signals: [SIGUSR1]}"], True),  # the user's own options kept
    (["save_folder=null"], False),                # nothing to save to: not added
])
def test_preemption_is_added_where_a_save_folder_is_set(overrides, on, quickstart_data):
    cfg = load_config(ROOT / "yamls/quickstart.yaml",
                      [f"variables.data_root={quickstart_data}", *overrides]).cfg
    callbacks = run_callbacks(cfg)
    assert ("preemption" in callbacks) == on, callbacks
    if overrides and "signals" in overrides[0]:
        assert callbacks["preemption"] == {"signals": ["SIGUSR1"]}
    assert "speed_monitor" in callbacks  # the config's own callbacks stay


@pytest.mark.slow
def test_sigterm_without_a_preemption_section_saves_and_exits_75(quickstart_data, tmp_path):
    """A real process (python train.py, as `make train` runs it), SIGTERM after a few batches."""
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
           f"save_folder={out}/checkpoints", f"loggers.jsonl.path={out}/metrics.jsonl",
           "max_duration=5000ba", "save_interval=10000ba", *TINY]
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and sum("loss/train/total" in r for r in read_metrics(metrics)) >= 3):
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no batch 3 in 600 s"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=600)
    said = log.read_text()
    assert rc == 75, said[-3000:]
    assert "Traceback" not in said
    assert "preemption: on (save_folder is set)" in said
    stop = int(said.split("stopping after batch ")[1].split()[0])
    (ckpt, manifest), *_ = complete_checkpoints(out / "checkpoints")
    assert ckpt.name == f"ep0-ba{stop}" and manifest is not None and 3 <= stop < 5000
    # no eval loader, eval_interval never set: Composer is not handed an option with no effect
    assert "Specifying `eval_interval" not in said and "eval_subset_num_batches" not in said
