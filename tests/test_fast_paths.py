"""Every path a run config names is checked before anything is built: a missing ``load_path``,
data folder, tokenizer folder or model folder stops ``foundryx train`` with one message and
exit 2 before torch is even imported (a stand-in ``torch`` that refuses to import proves it),
and leaves the run folder alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.cli.config_paths import path_problems

ROOT = Path(__file__).parents[1]


def train_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text('raise ImportError("torch was imported")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "foundryx.cli", "train", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("override, needle", [
    ("load_path={missing}", "load_path: {missing} does not exist; give a checkpoint folder"),
    ("variables.data_root={missing}", "train_loader.dataset.local: folder {missing}/mds does not exist"),
    ("tokenizer.path={missing}", "tokenizer.path: folder {missing} does not exist"),
], ids=["load_path", "data", "tokenizer"])
def test_a_missing_path_stops_the_run_before_torch(quickstart_data, tmp_path, override, needle):
    missing = tmp_path / "not-here"
    args = [str(ROOT / "yamls/quickstart.yaml"), f"variables.data_root={quickstart_data}",
            override.format(missing=missing)]
    r = train_without_torch(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert needle.format(missing=missing) in r.stderr, r.stderr
    assert "torch was imported" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


def test_what_is_not_a_local_path_is_left_to_the_loaders(tmp_path, monkeypatch):
    monkeypatch.setattr("foundryx.runtime.hub.is_offline", lambda: False)  # hub names: the hub answers
    monkeypatch.setattr("foundryx.runtime.hub.hub_reachable", lambda: True)
    assert path_problems({"load_path": "s3://bucket/ckpt", "tokenizer": {"name": "hf", "path": "gpt2"},
                          "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": "meta-llama/x"},
                          "train_loader": {"name": "finetuning", "dataset": {"hf_name": "x"}}}) == []
    assert path_problems({"model": {"pretrained_model_name_or_path": "/nope", "pretrained": False}}) == []
    (problem,) = path_problems({"model": {"pretrained_model_name_or_path": str(tmp_path / "m")}})
    assert problem.startswith(f"model.pretrained_model_name_or_path: folder {tmp_path / 'm'} does not exist")
