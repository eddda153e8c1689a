"""`foundryx eval` on bad input: one message naming the thing and the fix, exit 2, no
traceback, nothing written, and no model evaluated first."""

from __future__ import annotations

import pytest
import yaml
from icl_fakes import FakeLM, save_fake, write_jsonl

from foundryx.cli import main

MC = [{"query": "q", "choices": ["a", "b"], "gold": 1}] * 3
GEN = [{"context": "q", "answer": "a"}] * 3


@pytest.fixture
def config(tmp_path):
    """A function writing an eval config over one task (options and rows given) and a
    gauntlet; returns (path, output_dir)."""
    save_fake(FakeLM("q a b".split()), tmp_path / "model")

    def write(task: dict, rows: list[dict], gauntlet_task: str | None = None, shots: int = 0):
        write_jsonl(tmp_path / "t.jsonl", rows)
        entry = {"label": "t", "dataset_uri": "t.jsonl", "icl_task_type": "multiple_choice", **task}
        cfg = {"models": [{"label": "m", "hf": str(tmp_path / "model")}], "icl_tasks": [entry],
               "icl_data_root": str(tmp_path), "output_dir": str(tmp_path / "out"),
               "device": "cpu", "progress_bar": False,
               "eval_gauntlet": {"categories": [{"name": "c", "benchmarks": [
                   {"name": gauntlet_task or "t", "num_fewshot": shots}]}]}}
        path = tmp_path / "eval.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path, tmp_path / "out"

    return write


@pytest.mark.parametrize(("task", "rows", "gauntlet_task", "message"), [
    ({}, [MC[0], {"query": "q", "choices": ["a", "b"]}, MC[0]], None,
     "t.jsonl:2: missing field 'gold' (multiple_choice examples need query, choices, gold)"),
    ({"num_fewshot": [0, 5]}, MC, None,
     "task 't' asks for 5 few-shot examples, but the file has 3 examples (2 besides the one "
     "asked); lower num_fewshot to at most 2"),
    ({"icl_task_type": "generation_task_with_answers", "scoring": "lm_eval"}, GEN, None,
     "icl_tasks[0].scoring: lm_eval is for multiple-choice tasks (multiple_choice, schema); 't' "
     "is a generation_task_with_answers task"),
    ({}, MC, "nope", "eval_gauntlet.categories[0].benchmarks[0]: the gauntlet scores nope/0-shot, "
                     "which is not among the ICL tasks evaluated (t/0-shot); add task 'nope' "
                     "(num_fewshot 0) to icl_tasks, remove this benchmark from category 'c', or "
                     "evaluate without the gauntlet: eval_gauntlet=null"),
], ids=["missing-field", "too-many-shots", "lm-eval-on-generation", "gauntlet-unknown-task"])
def test_bad_input_exits_2_with_one_message_and_writes_nothing(config, capsys, task, rows,
                                                               gauntlet_task, message):
    path, out = config(task, rows, gauntlet_task)
    assert main(["eval", str(path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""  # no results table printed
    assert not out.exists()


def test_too_many_shots_for_a_category(config, capsys):
    rows = [{**MC[0], "category": c} for c in ("big", "big", "big", "small", "small")]
    path, out = config({"num_fewshot": 2, "has_categories": True}, rows, "t", shots=2)
    assert main(["eval", str(path)]) == 2
    assert ("task 't' asks for 2 few-shot examples, but category 'small' has 2 examples (1 besides "
            "the one asked)") in capsys.readouterr().err
    assert not out.exists()


def test_a_gpu_precision_on_the_cpu_is_said_not_silent():
    from foundryx.eval.run import precision_note

    assert "amp_bf16 runs as fp32 on the CPU" in precision_note("cpu", "amp_bf16")
    assert precision_note("cpu", "fp32") is None and precision_note("gpu", "amp_bf16") is None
