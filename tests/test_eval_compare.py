"""`foundryx eval`: results files, --dump-examples, and --compare-to passing and failing."""

from __future__ import annotations

import csv
import json

import pytest
import yaml
from icl_fakes import FakeLM, save_fake, write_jsonl

from foundryx.cli import main

WORDS = "q a b c x y z w".split()


@pytest.fixture
def setup(tmp_path):
    """Two models (one knows the answers, one guesses) and an eval config over two tasks."""
    good, bad = FakeLM(WORDS), FakeLM(WORDS)
    good.set("q", {"b": 0.5})
    good.set("y", {"z": 0.5})
    save_fake(good, tmp_path / "good")
    save_fake(bad, tmp_path / "bad")
    write_jsonl(tmp_path / "mc.jsonl", [{"query": "q", "choices": ["a", "b", "c"], "gold": 1}] * 4)
    write_jsonl(tmp_path / "lm.jsonl", [{"context": "x y", "continuation": "z"}] * 3)
    cfg = {
        "models": [{"label": "good", "hf": str(tmp_path / "good")},
                   {"label": "bad", "hf": str(tmp_path / "bad")}],
        "icl_tasks": [{"label": "mc", "dataset_uri": "mc.jsonl", "icl_task_type": "multiple_choice"},
                      {"label": "lm", "dataset_uri": "lm.jsonl", "icl_task_type": "language_modeling",
                       "num_fewshot": [0, 1]}],
        "icl_data_root": str(tmp_path),
        "eval_gauntlet": {"categories": [{"name": "all", "benchmarks": [
            {"name": "mc", "num_fewshot": 0, "random_baseline": 1 / 3},
            {"name": "lm", "num_fewshot": 0, "random_baseline": 0.0}]}]},
        "output_dir": str(tmp_path / "out"), "device": "cpu", "progress_bar": False,
    }
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp_path / "out"


def test_results_table_files_and_dump(setup, capsys):
    path, out = setup
    assert main(["eval", str(path), "--dump-examples", "2"]) == 0
    printed = capsys.readouterr().out
    assert "| result | category | examples | random baseline | good | bad |" in printed
    assert "| mc/0-shot | all | 4 | 0.333333 | 1.0000 | 0.0000 |" in printed  # ties: first choice
    assert "| lm/1-shot |  | 3 |  | 1.0000 | 0.0000 |" in printed  # not in the gauntlet
    assert "| gauntlet/all |  |  |  | 1.0000 | -0.2500 |" in printed
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["result"] for r in rows] == ["mc/0-shot", "lm/0-shot", "lm/1-shot", "gauntlet/all",
                                           "gauntlet/average"]
    assert float(rows[1]["good"]) == 1.0 and float(rows[1]["bad"]) == 0.0
    data = json.loads((out / "results.json").read_text())
    assert data["scores"]["bad"]["mc/0-shot"] == 0.0 and data["random_baselines"]["mc/0-shot"] == pytest.approx(1 / 3)
    assert data["gauntlet_categories"] == {"all": ["mc/0-shot", "lm/0-shot"]}
    assert data["table"][0] == {"result": "mc/0-shot", "kind": "task", "category": "all", "examples": 4,
                                "random_baseline": pytest.approx(1 / 3),
                                "scores": {"good": 1.0, "bad": 0.0}}
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert yaml.safe_load((out / "scores" / "good.yaml").read_text())["lm/1-shot"] == 1.0
    dumped = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    assert len(dumped) == 2 * 2 * 3  # 2 models x 3 task/shot results x 2 examples
    first = dumped[0]
    assert (first["model"], first["task"], first["example"], first["gold"], first["chosen"]) == ("good", "mc/0-shot", 0, 1, 1)
    assert [r["continuation"] for r in first["rows"]] == [" a", " b", " c"]
    assert first["rows"][1]["loss"] == pytest.approx(0.6931, abs=1e-4)  # -log 0.5
    one_shot = next(d for d in dumped if d["task"] == "lm/1-shot")
    assert one_shot["rows"][0]["context"] == "x y z\nx y"


def test_compare_to_a_model_in_the_same_run(setup, capsys):
    path, out = setup
    assert main(["eval", str(path), "--compare-to", "bad"]) == 0  # good is at least as good
    assert "good vs bad: all 5 results pass" in capsys.readouterr().out
    assert main(["eval", str(path), "--compare-to", "good"]) == 1  # bad falls short
    printed = capsys.readouterr().out
    assert "| mc/0-shot | 1.0000 | 0.0000 | -1.0000 | 0.0200 | FAIL |" in printed
    assert "bad vs good: 5 of 5 results fall short" in printed
    assert (out / "comparison_bad.md").is_file()
    assert main(["eval", str(path), "--compare-to", "good", "--tolerance", "1.25"]) == 0


def test_compare_to_recorded_scores(setup, capsys, tmp_path):
    path, out = setup
    ref = tmp_path / "ref.yaml"
    ref.write_text(yaml.safe_dump({"mc/0-shot": 0.99, "lm/0-shot": {"score": 1.0, "tolerance": 0.0}}))
    cfg = yaml.safe_load(path.read_text())
    cfg["models"] = cfg["models"][:1]
    path.write_text(yaml.safe_dump(cfg))
    assert main(["eval", str(path), "--compare-to", str(ref)]) == 0
    assert "good vs ref.yaml: all 2 results pass" in capsys.readouterr().out
    ref.write_text(yaml.safe_dump({"mc/0-shot": 0.99, "piqa/0-shot": 0.5}))
    assert main(["eval", str(path), "--compare-to", str(ref)]) == 1
    assert "| piqa/0-shot | 0.5000 | - | - | 0.0200 | FAIL (not evaluated) |" in capsys.readouterr().out


def test_user_errors_exit_2_without_traceback(setup, capsys, tmp_path):
    path, _ = setup
    assert main(["eval", str(path), "--compare-to", "nobody"]) == 2
    err = capsys.readouterr().err
    assert "compare_to: 'nobody' is neither a model label of this config (good, bad)" in err
    assert "Traceback" not in err
    assert main(["eval", str(path), "device_eval_batch_size=0", "eval_gauntlet.weighting=ALL"]) == 2
    err = capsys.readouterr().err
    assert "device_eval_batch_size: must be positive, got 0" in err
    assert "eval_gauntlet.weighting: expected one of 'EQUAL', 'SAMPLE_SZ', 'LOG_SAMPLE_SZ', got 'ALL'" in err
    assert main(["eval", str(path), "icl_tasks.0.num_fewshot=3"]) == 2
    assert "a list is replaced whole" in capsys.readouterr().err
    bad_ref = tmp_path / "bad_ref.yaml"
    bad_ref.write_text("mc/0-shot: high\n")
    assert main(["eval", str(path), "--compare-to", str(bad_ref)]) == 2
    assert "mc/0-shot: expected a number or {score: x, tolerance: y}" in capsys.readouterr().err
