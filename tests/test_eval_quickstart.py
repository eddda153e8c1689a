"""The quickstart model, trained briefly with ICL eval in its run, beats the random baseline on
tasks built from its own corpus; standalone eval of its checkpoint gives the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from foundryx.config import load_config
from foundryx.eval.config import load_eval_config
from foundryx.eval.quickstart_tasks import write_quickstart_tasks
from foundryx.eval.run import run_eval
from foundryx.loggers.jsonl import read_metrics
from foundryx.train import train

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.slow


def test_quickstart_icl_above_baseline_in_training_and_standalone(quickstart_data, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    write_quickstart_tasks(tmp_path / "eval", seed=0)
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"data_root": str(tmp_path / "eval"), "icl_tasks": [
        {"label": "facts_lm", "dataset_uri": "facts_lm.jsonl", "icl_task_type": "language_modeling"},
        {"label": "facts_mc", "dataset_uri": "facts_mc.jsonl", "icl_task_type": "multiple_choice"},
    ]}))
    gauntlet = {"categories": [{"name": "facts", "benchmarks": [
        {"name": "facts_lm", "num_fewshot": 0, "random_baseline": 0.0},
        {"name": "facts_mc", "num_fewshot": 0, "random_baseline": 0.25}]}]}
    overrides = [f"variables.data_root={quickstart_data}", "max_duration=80ba",
                 "eval_interval=80ba", f"save_folder={tmp_path}/ckpt", f"loggers.jsonl.path={tmp_path}/m.jsonl",
                 f"icl_tasks={tasks}", f"eval_gauntlet={json.dumps(gauntlet)}", "progress_bar=false"]
    trainer = train(load_config("yamls/quickstart.yaml", overrides, world_size=1))

    in_training = {label: float(next(iter(metrics.values())).compute())
                   for label, metrics in trainer.state.eval_metrics.items() if "shot" in label}
    assert set(in_training) == {"facts_lm/0-shot", "facts_mc/0-shot"}
    assert in_training["facts_mc/0-shot"] > 0.25 + 0.08  # 176 questions, 4 choices (0.40 here)
    assert in_training["facts_lm/0-shot"] > 0.05  # exact answers; chance is ~0 (0.12 here)
    logged = [r for r in read_metrics(tmp_path / "m.jsonl") if "icl/gauntlet/facts" in r][-1]
    expected = (in_training["facts_lm/0-shot"] + (in_training["facts_mc/0-shot"] - 0.25) / 0.75) / 2
    assert logged["icl/gauntlet/facts"] == pytest.approx(expected)

    cfg = tmp_path / "eval.yaml"  # the checkpoint the run saved at its end, from its save_folder
    cfg.write_text(yaml.safe_dump({
        "models": [{"label": "qs", "checkpoint": f"{tmp_path}/ckpt", "run_config": "yamls/quickstart.yaml",
                    "overrides": [f"variables.data_root={quickstart_data}"]}],
        "icl_tasks": str(tasks), "eval_gauntlet": gauntlet, "device_eval_batch_size": 7,
        "device": "cpu", "progress_bar": False, "output_dir": str(tmp_path / "out")}))
    outcome = run_eval(load_eval_config(str(cfg)))
    standalone = outcome.results.scores["qs"]
    for key, score in in_training.items():  # other batch size, same numbers
        assert standalone[key] == pytest.approx(score, abs=1e-9), key
    assert standalone["gauntlet/facts"] == pytest.approx(expected)
