"""A resume must keep what the saved run had: the global batch, the sequence length, the
frozen base's storage and the training data's shards. A resume that differs stops before
loading anything, with one message naming each difference and the fix, exit 2, and the
save_folder as it was (issue 38, bad input)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_run_record import ROOT, TINY, contents, foundryx

from foundryx.checkpoint.run_shape import data_fingerprint, resume_problems, run_shape


def _index(folder: Path, shards: list[tuple[str, int]]) -> None:
    (folder / "train").mkdir(parents=True, exist_ok=True)
    (folder / "train" / "index.json").write_text(json.dumps(
        {"version": 2, "shards": [{"raw_data": {"basename": b}, "samples": n} for b, n in shards]}))


def test_each_difference_is_named(tmp_path):
    _index(tmp_path, [("shard.00000.mds", 10), ("shard.00001.mds", 7)])
    dataset = {"local": str(tmp_path), "split": "train"}
    saved = run_shape(8, 128, "nf4", dataset)
    assert saved["train_data"]["shards"] == 2 and saved["train_data"]["samples"] == 17
    assert resume_problems(saved, run_shape(8, 128, "nf4", dataset)) == []
    _index(tmp_path, [("shard.00000.mds", 10)])  # a shard removed
    found = resume_problems(saved, run_shape(16, 256, "fp8", dataset))
    assert found[:3] == ["global_train_batch_size: saved with 8, this run has 16",
                         "max_seq_len: saved with 128, this run has 256",
                         "frozen_base.dtype: saved with 'nf4', this run has 'fp8'"]
    assert found[3].startswith("the training data changed since the save: then 2 shards, 17 "
                               "samples in") and "now 1 shards, 10 samples" in found[3]
    assert data_fingerprint({"remote": "s3://b/x", "local": str(tmp_path)}) is None  # not checked
    assert resume_problems(None, saved) == []  # a checkpoint from before the record: as before


@pytest.mark.slow
def test_a_resume_that_differs_stops_before_loading_and_touches_nothing(quickstart_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(quickstart_data, data)
    run = ["train", str(ROOT / "yamls/quickstart.yaml"), f"variables.data_root={data}",
           f"save_folder={tmp_path}/ckpt", *TINY]
    first = foundryx(tmp_path, *run)
    assert first.returncode == 0, first.stderr[-3000:]
    before = contents(tmp_path / "ckpt")
    resume = [*run, "autoresume=true", "save_overwrite=false", "max_duration=4ba"]
    r = foundryx(tmp_path, *resume, "global_train_batch_size=8")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "cannot resume it: this run differs from the one that saved it" in r.stderr
    assert "global_train_batch_size: saved with 4, this run has 8" in r.stderr
    assert "load_weights_only=true with another save_folder" in r.stderr
    assert contents(tmp_path / "ckpt") == before
    index = data / "mds" / "train" / "index.json"  # a shard added to the training data
    meta = json.loads(index.read_text())
    added = json.loads(json.dumps(meta["shards"][0]))
    for key in ("raw_data", "zip_data"):
        if added.get(key):
            name = Path(added[key]["basename"])
            added[key]["basename"] = str(name.parent / f"added.{name.name}")
            shutil.copy(index.parent / name, index.parent / added[key]["basename"])
    meta["shards"].append(added)
    index.write_text(json.dumps(meta))
    r = foundryx(tmp_path, *resume)
    assert r.returncode == 2 and "the training data changed since the save" in r.stderr, \
        r.stderr[-3000:]
    assert contents(tmp_path / "ckpt") == before
