"""The shipped eval YAMLs validate, and every task file reads the real eval data."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundryx.errors import ConfigError, DataError
from foundryx.eval.config import load_eval_config
from foundryx.eval.data import prepare_task
from foundryx.eval.gauntlet import load_gauntlet
from foundryx.eval.task_config import load_icl_tasks

ROOT = Path(__file__).parents[1]
ISSUE_TASKS = {"arc_easy", "arc_challenge", "piqa", "hellaswag", "winograd", "winogrande",
               "lambada_openai", "boolq", "copa", "openbook_qa", "siqa", "commonsense_qa",
               "jeopardy", "triviaqa", "simple_arithmetic_nospaces", "simple_arithmetic_withspaces",
               "gsm8k"}


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the YAMLs use paths relative to the repository root


def test_task_file_and_gauntlet_cover_the_standard_tasks():
    tasks = load_icl_tasks("eval/yamls/tasks.yaml")
    assert ISSUE_TASKS <= {t.label for t in tasks}
    keys = {t.key(s) for t in tasks for s in t.shots}
    g = load_gauntlet("eval/yamls/gauntlet.yaml", keys)
    assert {b.key for bs in g.categories.values() for b in bs} == keys
    assert tasks[0].dataset_uri == "../shared/eval_data/world_knowledge/jeopardy_small.jsonl"
    assert load_icl_tasks("eval/yamls/tasks.yaml", "/data")[0].dataset_uri.startswith("/data/")


@pytest.mark.parametrize(("name", "overrides"), [("hf_eval.yaml", ["skip_missing_data=true"]),
                                                 ("quickstart.yaml", [])])
def test_eval_configs_validate(name, overrides):
    loaded = load_eval_config(f"eval/yamls/{name}", overrides)
    assert loaded.models and loaded.tasks and loaded.gauntlet is not None


@pytest.mark.needs_shared
def test_missing_task_data_is_reported_before_any_model_loads(shared_dir):
    """../shared/eval_data has every standard task but hellaswag."""
    with pytest.raises(ConfigError) as e:
        load_eval_config("eval/yamls/hf_eval.yaml")
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith("icl_tasks: hellaswag: dataset_uri ../shared/eval_data/"
                                          "language_understanding/hellaswag.jsonl: no such file")
    assert "skip_missing_data=true" in e.value.problems[0]


@pytest.mark.needs_shared
def test_every_task_reads_the_shared_data(shared_dir, tiny_tokenizer):
    for cfg in load_icl_tasks("eval/yamls/tasks.yaml", str(shared_dir / "eval_data")):
        if cfg.label == "hellaswag":
            with pytest.raises(DataError, match="hellaswag.jsonl: no such ICL data file"):
                prepare_task(cfg, tiny_tokenizer, 2048, max_examples=4)
            continue
        prepared = prepare_task(cfg, tiny_tokenizer, 2048, max_examples=4)
        assert [len(p.examples) for p in prepared] == [4] * len(cfg.shots), cfg.label
