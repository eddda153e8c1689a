"""One layout for what follows a run: exports and eval results live in the run folder (the
save_folder's parent), where the run summary's commands put them and `foundryx report` finds
them. The defaults here; the whole sequence on real runs is tests/test_walkthrough.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from foundryx.checkpoint.layout import MANIFEST, run_folder
from foundryx.cli import main
from foundryx.errors import ExportError
from foundryx.eval.config import EvalModelSpec
from foundryx.eval.run import default_output_dir
from foundryx.export.core import default_out


def fake_run(root: Path, name: str, lora: bool = False) -> Path:
    """runs/<name>/checkpoints/ep0-ba4 with a manifest (enough to be found, not to be loaded)."""
    ckpt = root / "runs" / name / "checkpoints" / "ep0-ba4"
    ckpt.mkdir(parents=True)
    (ckpt / MANIFEST).write_text("{}")
    if lora:
        (ckpt / "lora_base.json").write_text(json.dumps({"source": "base"}))
    return ckpt.parent


def test_run_folder_of_checkpoints_and_exports(tmp_path):
    save = fake_run(tmp_path, "q")
    run = tmp_path / "runs" / "q"
    assert run_folder(save) == run                     # a save_folder
    assert run_folder(save / "ep0-ba4") == run         # a checkpoint folder
    assert run_folder(save / "ep0-ba4" / MANIFEST) == run
    assert run_folder(run / "export" / "adapter") == run  # an export (need not exist yet)
    assert run_folder(tmp_path / "weights.safetensors") is None
    assert run_folder("s3://bucket/runs/q/checkpoints") is None


def test_export_writes_into_the_run_folder_by_default(tmp_path):
    save, lora = fake_run(tmp_path, "q"), fake_run(tmp_path, "l", lora=True)
    assert default_out(save) == tmp_path / "runs/q/export/hf"
    assert default_out(save, fmt="mpt") == tmp_path / "runs/q/export/mpt"
    assert default_out(lora) == tmp_path / "runs/l/export/adapter"
    assert default_out(lora, merged=True) == tmp_path / "runs/l/export/merged"
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ExportError, match="no default output: give one"):
        default_out(weights)


def test_export_without_out_on_a_weights_file_is_one_message(tmp_path, capsys):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    assert main(["export", str(weights)]) == 2
    err = capsys.readouterr().err
    assert "give one, e.g. foundryx export" in err and "Traceback" not in err


def test_eval_results_go_to_the_evaluated_runs_folder(tmp_path):
    save = fake_run(tmp_path, "q")
    adapter = tmp_path / "runs" / "l" / "export" / "adapter"

    def loaded(*models: EvalModelSpec) -> SimpleNamespace:
        return SimpleNamespace(models=list(models))

    base = EvalModelSpec(label="base", hf=str(tmp_path / "runs/q/export/hf"))
    assert default_output_dir(loaded(EvalModelSpec(label="q", checkpoint=str(save)))) == \
        str(tmp_path / "runs/q/eval")
    # an hf base alone does not decide; the adapter evaluated on it does
    assert default_output_dir(loaded(base, EvalModelSpec(label="l", hf=base.hf,
                                                         adapter=str(adapter)))) == \
        str(tmp_path / "runs/l/eval")
    assert default_output_dir(loaded(base)) == "eval_results"
