"""A 2-process (gloo) run streaming its train and eval data from a bucket (a real S3 API on
localhost) into empty local caches: the loss falls, and the shards land in the caches."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_storage_data import upload_folder

from foundryx.data.remote import CACHE_ENV
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
TINY = [
    "variables.max_seq_len=64", "model.d_model=64", "model.n_heads=2", "model.n_layers=2",
    "global_train_batch_size=8", "parallelism={}", "max_duration=12ba", "save_interval=12ba",
    "eval_interval=12ba", "eval_subset_num_batches=1", "console_log_interval=100ba",
    "callbacks.speed_monitor.window_size=1", "scheduler.t_warmup=2ba",
]
pytestmark = pytest.mark.slow


def test_two_processes_stream_from_a_bucket(s3, quickstart_data, tmp_path):
    bucket = s3.bucket()
    upload_folder(s3, quickstart_data / "mds", bucket, "qs/mds")
    cache = tmp_path / "cache"
    args = [f"variables.data_root={quickstart_data}", f"save_folder={tmp_path}/ckpt",
            f"loggers.jsonl.path={tmp_path}/metrics.jsonl", *TINY,
            f"train_loader.dataset.remote=s3://{bucket}/qs/mds", "train_loader.dataset.local=null",
            f"eval_loader.dataset.remote=s3://{bucket}/qs/mds",
            f"eval_loader.dataset.local={tmp_path}/eval-cache"]
    cmd = [str(Path(sys.executable).parent / "composer"), "-n", "2",
           "--stderr", str(tmp_path / "rank{rank}.err"), "--stdout", str(tmp_path / "rank{rank}.out"),
           "train.py", "yamls/quickstart.yaml", *args]
    env = {**os.environ, **s3.env, CACHE_ENV: str(cache), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    logs = r.stdout + r.stderr + "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.*")))
    assert r.returncode == 0, logs[-4000:]
    curve = [row[LOSS] for row in read_metrics(tmp_path / "metrics.jsonl") if LOSS in row]
    assert len(curve) == 12 and all(math.isfinite(x) for x in curve)
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.3, curve
    assert f"dataset.remote: s3://{bucket}/qs/mds is cached in {cache}/" in logs
    assert list(cache.rglob("train/**/*.mds")) and list((tmp_path / "eval-cache").rglob("*.mds"))
