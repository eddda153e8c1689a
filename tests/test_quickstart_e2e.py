"""The quickstart end to end: one process and two (gloo), plus a plugin used by name."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.checkpoint import load_model_weights
from foundryx.checkpoint.layout import complete_checkpoints
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
pytestmark = pytest.mark.slow


def train(data: Path, out: Path, *overrides: str, nproc: int = 1,
          compile_default: bool = False) -> subprocess.CompletedProcess:
    args = [f"variables.data_root={data}", f"save_folder={out}/ckpt",
            f"loggers.jsonl.path={out}/metrics.jsonl", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "train.py", "yamls/quickstart.yaml", *args]
    else:  # the README's `foundryx launch -n 2 train.py yamls/quickstart.yaml max_duration=20ba`
        foundryx = shutil.which("foundryx", path=str(Path(sys.executable).parent))
        cmd = [foundryx, "launch", "-n", str(nproc), "--stdout", str(out / "rank{rank}.out"),
               "--stderr", str(out / "rank{rank}.err"), "train.py", "yamls/quickstart.yaml", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if compile_default:  # as `make train` runs it: compile.enabled auto, on where supported
        env.pop("FOUNDRYX_COMPILE", None)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


def losses(out: Path) -> list[float]:
    return [row[LOSS] for row in read_metrics(out / "metrics.jsonl") if LOSS in row]


def test_quickstart_loss_falls_and_checkpoint_written(quickstart_data, tmp_path):
    r = train(quickstart_data, tmp_path, compile_default=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile: torch.compile per transformer block on cpu" in r.stderr + r.stdout
    curve = losses(tmp_path)
    assert len(curve) == 200
    first, last = sum(curve[:5]) / 5, sum(curve[-20:]) / 20
    assert last < 0.5 * first, (first, last)
    (ckpt, manifest), *_ = complete_checkpoints(tmp_path / "ckpt")  # newest first
    assert ckpt.name == "ep0-ba200" and manifest is not None
    weights = load_model_weights(ckpt)
    assert any(k.endswith("Wqkv.weight") for k in weights)
    eval_rows = [r for r in read_metrics(tmp_path / "metrics.jsonl")
                 if "metrics/eval/LanguageCrossEntropy" in r]
    assert eval_rows and eval_rows[-1]["metrics/eval/LanguageCrossEntropy"] < first
    out = r.stdout + r.stderr  # `make train`'s output: a page (test_quickstart_console_page)
    assert len(out.splitlines()) < 60, out
    assert re.search(r"^done: quickstart: 200 batches in .*, loss \d+\.\d+ -> \d+\.\d+$", out, re.M), out


def test_quickstart_console_page(quickstart_data, tmp_path):
    """`make train` prints under 60 lines: a line per interval, two eval tables, the summary and
    the next commands, no known-harmless warnings. The run is make train's with every interval
    (200 batches, a line per 20, eval and save per 100) scaled by 1/10: the same lines."""
    r = train(quickstart_data, tmp_path, "max_duration=20ba", "console_log_interval=2ba",
              "eval_interval=10ba", "save_interval=10ba", compile_default=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    lines = out.splitlines()
    assert len(lines) < 60, out
    assert [int(m[1]) for m in re.finditer(r"^batch +(\d+)/20  loss ", out, re.M)] == list(range(2, 21, 2))
    assert out.count("eval at batch") == 2 and "Train time/" not in out
    for noise in ("TypedStorage is deprecated", "torch.distributed is disabled", "No CUDA runtime",
                  "Skipping import of cpp extensions"):
        assert noise not in out
    assert re.search(r"^done: quickstart: 20 batches in .*, loss \d+\.\d+ -> \d+\.\d+$", out, re.M), out
    (ckpt, _), *_ = complete_checkpoints(tmp_path / "ckpt")
    assert f"  checkpoint  {ckpt}" in lines and f"  metrics     {tmp_path}/metrics.jsonl" in lines
    assert f"  foundryx export {tmp_path}/ckpt {tmp_path}/export/hf" in lines
    assert f"  foundryx report {tmp_path}   # writes {tmp_path}/report/report.md" in lines
    assert (f"  foundryx eval eval/yamls/quickstart.yaml models='[{{label: quickstart, checkpoint: "
            f"{tmp_path}/ckpt}}]' output_dir={tmp_path}/eval") in lines
    assert "preemption: on (save_folder is set)" in out


def test_quickstart_two_processes_gloo(quickstart_data, tmp_path):
    r = train(quickstart_data, tmp_path, "max_duration=20ba", "eval_interval=20ba", nproc=2)
    logs = "".join(p.read_text() for p in tmp_path.glob("rank*.err"))
    assert r.returncode == 0, (r.stderr[-2000:], logs[-3000:])
    curve = losses(tmp_path)
    assert len(curve) == 20
    assert sum(curve[-5:]) / 5 < sum(curve[:3]) / 3 - 0.5
    # local rank 0 writes to the launcher's own streams, rank 1 to the files
    for text in (r.stdout + r.stderr, logs + (tmp_path / "rank1.out").read_text()):
        assert re.search(r"world_size\s+2\b", text), text[-2000:]


@pytest.fixture
def example_plugin():
    pip = [sys.executable, "-m", "pip"]
    plugin = ROOT / "plugins" / "foundryx-example-plugin"
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", str(plugin)],
                   check=True, capture_output=True, timeout=300)
    yield
    subprocess.run([*pip, "uninstall", "-q", "-y", "foundryx-example-plugin"], check=True,
                   capture_output=True, timeout=300)


def test_plugin_callback_by_name(example_plugin, quickstart_data, tmp_path):
    listing = subprocess.run([sys.executable, "-m", "foundryx.cli", "registry", "list", "callbacks"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
    row = next(ln for ln in listing.stdout.splitlines() if "batch_counter" in ln)
    assert "foundryx-example-plugin (foundryx_example_plugin.callbacks)" in row
    out = tmp_path / "count.json"
    r = train(quickstart_data, tmp_path, "max_duration=3ba", f"callbacks.batch_counter.out_path={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text()) == {"batches": 3}
