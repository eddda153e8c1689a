"""The example plugin as a user installs it: pip install into this venv (the fixture; uninstalled
after), `foundryx registry list` shows its four entries, and one run YAML uses all four (model
tiny_gpt, callback batch_counter, algorithm freeze_parameters, ICL metric icl_mc_top2_accuracy)
together with Composer's algorithms from the registry (EMA, sequence-length warmup, low-precision
layer norm, gradient clipping). The same run is then reported on with `foundryx report`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from foundryx.eval.quickstart_tasks import write_quickstart_tasks
from foundryx.loggers.jsonl import read_metrics
from foundryx.report import SIZE, make_report

ROOT = Path(__file__).parents[1]
PLUGIN = ROOT / "plugins" / "foundryx-example-plugin"
ENTRIES = {"models": "tiny_gpt", "callbacks": "batch_counter", "algorithms": "freeze_parameters",
           "metrics": "icl_mc_top2_accuracy"}


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.fixture(scope="module")
def installed_plugin():
    """pip install the plugin into the running venv (no deps: foundryx is there), as a user
    would; CI's fresh clone on both venvs gets it the same way. Uninstalled afterwards."""
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", str(PLUGIN)],
                   check=True, capture_output=True, timeout=300)
    yield
    subprocess.run([*pip, "uninstall", "-q", "-y", "foundryx-example-plugin"], check=True,
                   capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def plugin_run(installed_plugin, quickstart_data, tmp_path_factory):
    """One 6-batch run of a YAML that uses the plugin's four entries; its folder."""
    tmp = tmp_path_factory.mktemp("plugin_run")
    write_quickstart_tasks(tmp / "icl")
    cfg = yaml.safe_load((ROOT / "yamls" / "quickstart.yaml").read_text())
    cfg["model"] = {"name": "tiny_gpt", "width": 32, "depth": 2, "heads": 2,
                    "context": "${variables.max_seq_len}"}
    cfg["algorithms"] = {
        "gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0},
        "freeze_parameters": {"name_contains": ["wte"]},
        "ema": {"half_life": "2ba"},
        "seq_length_warmup": {"duration": 0.5, "min_seq_length": 32, "max_seq_length": 128,
                              "step_size": 32},
        "low_precision_layernorm": {},
    }
    cfg["callbacks"] = {"batch_counter": {"out_path": str(tmp / "count.json"), "record_shapes": True},
                        "speed_monitor": {"window_size": 2}, "lr_monitor": {}}
    cfg["icl_tasks"] = [{"label": "facts_mc", "dataset_uri": "facts_mc.jsonl",
                         "icl_task_type": "multiple_choice", "num_fewshot": [0],
                         "metric": "icl_mc_top2_accuracy"}]
    cfg["icl_data_root"] = str(tmp / "icl")
    cfg["icl_max_examples"] = 8
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = run("train.py", str(tmp / "run.yaml"), f"variables.data_root={quickstart_data}",
            "save_folder=null", f"loggers.jsonl.path={tmp}/run/metrics.jsonl",
            "max_duration=6ba", "eval_interval=3ba", "global_train_batch_size=8")
    assert r.returncode == 0, r.stderr[-4000:]
    return SimpleRun(tmp, r.stdout + r.stderr)


class SimpleRun:
    def __init__(self, tmp: Path, log: str):
        self.tmp, self.folder, self.log = tmp, tmp / "run", log


@pytest.mark.slow
def test_registry_lists_the_plugins_four_entries(installed_plugin):
    r = run("-m", "foundryx.cli", "registry", "list")
    assert r.returncode == 0, r.stderr
    for reg, name in ENTRIES.items():
        row = next(ln for ln in r.stdout.splitlines() if re.match(rf"{reg}\s+{name}\s", ln))
        assert "foundryx-example-plugin (foundryx_example_plugin." in row, row
    # its options dataclass is what --help-config shows
    r = run("-m", "foundryx.cli", "train", "--help-config", "algorithms.freeze_parameters")
    assert r.returncode == 0, r.stderr
    assert "options FreezeOptions" in r.stdout
    assert "name_contains: a list [['wte']]\n    freeze parameters whose names contain" in r.stdout


@pytest.mark.slow
def test_one_yaml_uses_the_plugins_four_entries_and_composers_algorithms(plugin_run):
    rows = read_metrics(plugin_run.folder / "metrics.jsonl")
    losses = [r["loss/train/total"] for r in rows if "loss/train/total" in r]
    assert len(losses) == 6 and all(map(torch.isfinite, torch.tensor(losses)))
    # the plugin's algorithm froze GPT-2's (tied) token embedding: one parameter
    assert [r["freeze_parameters/frozen"] for r in rows if "freeze_parameters/frozen" in r] == [1]
    # the plugin's ICL metric scored the task (0-shot, 8 examples: a multiple of 1/8)
    icl = [r["metrics/facts_mc/0-shot/ICLMCTop2Accuracy"] for r in rows
           if "metrics/facts_mc/0-shot/ICLMCTop2Accuracy" in r]
    assert len(icl) == 2 and all(abs(v * 8 - round(v * 8)) < 1e-9 for v in icl), icl
    # the plugin's callback saw 6 batches, their lengths warming up 32 -> 128 (seq_length_warmup)
    count = json.loads((plugin_run.tmp / "count.json").read_text())
    assert count["batches"] == 6
    lengths = [s[1] for s in count["shapes"]]
    assert lengths[0] == 32 and lengths[-1] == 128 and lengths == sorted(lengths), lengths
    # Composer's algorithms ran (run.json records them), and low-precision layer norm said why not
    hparams = json.loads((plugin_run.folder / "run.json").read_text())["hyperparameters"]
    for algo in ("EMA", "SeqLengthWarmup", "LowPrecisionLayerNorm", "FreezeParameters"):
        assert hparams.get(f"enabled_algorithms/{algo}") is True, algo
    assert "low_precision_layernorm: not applied: it acts only under autocast" in plugin_run.log


@pytest.mark.slow
def test_report_of_the_run(plugin_run):
    md = make_report(plugin_run.folder).read_text()
    out = plugin_run.folder / "report"
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    assert {"loss.png", "lr.png", "throughput.png", "eval.png", "icl.png"} <= set(linked), md
    for name in linked:
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.size == SIZE, (name, im.size)
    assert "| facts_mc/0-shot |" in md  # the ICL score table
    assert "name: tiny_gpt" in md and f"| torch | {torch.__version__} |" in md  # config, environment
    assert "| eval (metrics/eval/LanguageCrossEntropy, last) |" in md
