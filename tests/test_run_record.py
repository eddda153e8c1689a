"""A run that stops before it starts leaves the run folder's record as it was: the previous
run's ``run.json`` (config and environment, what ``foundryx report`` shows) and metrics are
written by the ``jsonl`` logger only once the run starts (issue 39, item 1)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from composer.core import Callback

from foundryx.errors import CheckpointError

ROOT = Path(__file__).parents[1]
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "max_duration=2ba",
        "eval_interval=2ba", "save_interval=2ba", "global_train_batch_size=4",
        "device_eval_batch_size=4", "eval_subset_num_batches=1", "compile.enabled=false"]


def contents(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` (the lock file aside)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def foundryx(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FOUNDRYX_COMPILE": "0"}
    return subprocess.run([sys.executable, "-m", "foundryx.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_run_that_cannot_start_keeps_the_previous_record(quickstart_data, tmp_path):
    train = ["train", str(ROOT / "yamls/quickstart.yaml"), f"variables.data_root={quickstart_data}",
             *TINY]
    r = foundryx(tmp_path, *train)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart"
    before = contents(run)
    assert "run.json" in before and "metrics.jsonl" in before

    r = foundryx(tmp_path, *train, f"load_path={tmp_path / 'no-such-checkpoint'}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "load_path: " in r.stderr and "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert contents(run) == before  # run.json byte for byte, metrics, checkpoint

    r = foundryx(tmp_path, "report", "runs/quickstart")
    assert r.returncode == 0, r.stderr[-3000:]
    md = (run / "report" / "report.md").read_text()
    assert "Not recorded" not in md, md


class FailAfterLoad(Callback):
    """Stops the Trainer as a load_path that cannot be read does (after Composer logged its
    hyperparameters)."""

    def after_load(self, state, logger) -> None:
        raise CheckpointError("no such checkpoint folder or file")


def test_jsonl_writes_nothing_before_the_run_starts(tmp_path):
    from test_guards import tiny_trainer

    from foundryx.loggers.jsonl import JSONLLogger, read_hyperparameters, read_metrics

    folder = tmp_path / "run"
    trainer = tiny_trainer([], batches=2, loggers=[JSONLLogger(str(folder / "metrics.jsonl"))])
    trainer.logger.log_hyperparameters({"foundryx/config": {"seed": 1}})
    trainer.fit()
    trainer.close()
    before = contents(folder)
    assert read_hyperparameters(folder)["foundryx/config"] == {"seed": 1}
    assert [r["batch"] for r in read_metrics(folder / "metrics.jsonl") if "loss/train/total" in r] == [1, 2]

    with pytest.raises(CheckpointError):
        tiny_trainer([FailAfterLoad()], batches=2,
                     loggers=[JSONLLogger(str(folder / "metrics.jsonl"))])
    assert contents(folder) == before

    fresh = tmp_path / "fresh"  # a first run that cannot start makes no folder at all
    with pytest.raises(CheckpointError):
        tiny_trainer([FailAfterLoad()], loggers=[JSONLLogger(str(fresh / "metrics.jsonl"))])
    assert not fresh.exists()
