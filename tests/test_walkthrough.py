"""The first hour, as the README and docs/ tell it, on a fresh copy of the repository in a
temporary folder, offline: the quickstart, then the commands its summary prints (eval, export,
report), then the LoRA fine-tune of that export (docs/finetuning.md), then the commands its
summary prints (the PEFT adapter's export, the adapter's eval). Each command's exit code and
the files it should leave are checked, and each next command is the one the previous run
printed, so the paths connect. Only sizes are swapped (key=value overrides); the data step
(`foundryx data quickstart`, tested in test_data_quickstart.py) is the session's copy."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.slow

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "max_duration=4ba",
        "eval_interval=4ba", "save_interval=4ba", "global_train_batch_size=4",
        "device_eval_batch_size=4", "eval_subset_num_batches=1", "console_log_interval=2ba"]
LORA_TINY = [o for o in TINY if not o.startswith("model.")]
EVAL_TINY = ["icl_max_examples=4", "progress_bar=false"]
# known-harmless warnings (foundryx/runtime/known_warnings.py) and options that only make warnings
NOISE = ("torch.distributed is disabled", "Skipping import of cpp extensions",
         "Specifying `eval_interval", "TypedStorage is deprecated", "Traceback")


def fresh_checkout(dest: Path, data: Path) -> Path:
    for part in ("foundryx", "yamls", "eval", "train.py"):
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / part)
    shutil.copytree(data, dest / "data" / "quickstart")  # what `foundryx data quickstart` writes
    return dest


def run(cwd: Path, argv: list[str], *extra: str) -> str:
    """One command as a user types it (``foundryx ...`` is the CLI module of the copy)."""
    if argv[0] == "foundryx":
        argv = [sys.executable, "-m", "foundryx.cli", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([*argv, *extra], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=900)
    said = r.stdout + r.stderr
    assert r.returncode == 0, f"{shlex.join(argv)}: exit {r.returncode}\n{said[-4000:]}"
    for noise in NOISE:
        assert noise not in said, f"{shlex.join(argv)} printed {noise!r}:\n{said[-4000:]}"
    return said


def next_commands(said: str) -> list[list[str]]:
    """The ``next:`` block of a run's summary, each line split as a shell would."""
    block = said.split("\nnext:\n", 1)[1].splitlines()
    return [shlex.split(line, comments=True) for line in block if line.startswith("  foundryx ")]


def test_readme_and_docs_command_sequence(quickstart_data, tmp_path):
    repo = fresh_checkout(tmp_path / "foundryx", quickstart_data)

    # README "Two commands": make train = python train.py yamls/quickstart.yaml
    said = run(repo, ["python", "train.py", "yamls/quickstart.yaml"], *TINY)
    assert (repo / "runs/quickstart/checkpoints/ep0-ba4/manifest.json").is_file()
    assert (repo / "runs/quickstart/metrics.jsonl").is_file()
    evaluate, export, report = next_commands(said)
    assert evaluate[:3] == ["foundryx", "eval", "eval/yamls/quickstart.yaml"], evaluate
    assert export == ["foundryx", "export", "runs/quickstart/checkpoints", "runs/quickstart/export/hf"]
    assert report == ["foundryx", "report", "runs/quickstart"]
    for doc in ("README.md", "docs/hf.md", "docs/finetuning.md"):  # the docs show this path
        assert shlex.join(export) in (ROOT / doc).read_text(), doc

    run(repo, evaluate, *EVAL_TINY)
    scores = json.loads((repo / "runs/quickstart/eval/results.json").read_text())["scores"]
    assert "facts_mc/0-shot" in scores["quickstart"]
    run(repo, export)
    hf = repo / "runs/quickstart/export/hf"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    run(repo, report)
    md = (repo / "runs/quickstart/report/report.md").read_text()
    assert "## ICL scores" in md and "| facts_mc/0-shot |" in md  # the eval above, found
    assert (repo / "runs/quickstart/report/loss.png").is_file()

    # docs/finetuning.md: LoRA on the export, then what its summary prints
    said = run(repo, ["python", "train.py", "yamls/finetune/llama-lora.yaml"], *LORA_TINY)
    assert (repo / "runs/llama-lora/checkpoints/ep0-ba4/manifest.json").is_file()
    export, evaluate, merged, report = next_commands(said)
    assert export == ["foundryx", "export", "runs/llama-lora/checkpoints",
                      "runs/llama-lora/export/adapter"]
    assert merged == [*export[:3], "runs/llama-lora/export/merged", "--merged"]
    assert re.search(r"hf: \./runs/quickstart/export/hf, adapter: runs/llama-lora/export/adapter",
                     shlex.join(evaluate)), evaluate
    finetuning = (ROOT / "docs/finetuning.md").read_text()
    assert shlex.join(export) in finetuning and shlex.join(merged) in finetuning
    run(repo, export)
    adapter = repo / "runs/llama-lora/export/adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    run(repo, evaluate, *EVAL_TINY)
    scores = json.loads((repo / "runs/llama-lora/eval/results.json").read_text())["scores"]
    assert "facts_mc/0-shot" in scores["llama-lora"]
