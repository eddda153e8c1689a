"""Bad task files and configs: one clear message naming the file and line (or YAML path)."""

from __future__ import annotations

import pytest
from icl_fakes import task, word_tokenizer, write_jsonl

from foundryx.errors import ConfigError, DataError
from foundryx.eval.config import load_eval_config
from foundryx.eval.data import prepare_task
from foundryx.eval.task_config import load_icl_tasks

TOK = word_tokenizer(["a", "b", "c"])


def prepare(path, kind, **options):
    return prepare_task(task(path, kind, **options), TOK, 32)


@pytest.mark.parametrize("rows, kind, message", [
    ([{"query": "a", "choices": ["b", "c"]}], "multiple_choice",
     r"mc\.jsonl:1: missing field 'gold' \(multiple_choice examples need query, choices, gold\)"),
    ([{"query": "a", "choices": ["b", "c"], "gold": 0}, {"query": "a", "choices": ["b", "c"], "gold": 2}],
     "multiple_choice", r"mc\.jsonl:2: gold 2 is out of range: 'choices' has 2 entries"),
    ([{"context_options": ["a"], "continuation": "b", "gold": True}], "schema",
     r"mc\.jsonl:1: field 'gold' must be an integer, got True"),
    ([{"context": "a", "continuation": "  "}], "language_modeling", r"mc\.jsonl:1: field 'continuation' is empty"),
    ([{"context": "a"}], "generation_task_with_answers", r"mc\.jsonl:1: missing field 'answer'"),
])
def test_bad_examples_name_file_and_line(tmp_path, rows, kind, message):
    with pytest.raises(DataError, match=message):
        prepare(write_jsonl(tmp_path / "mc.jsonl", rows), kind)


def test_bad_json_empty_file_and_missing_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "continuation": "b"}\n{"context": "a",\n\n[1, 2]\n')
    with pytest.raises(DataError) as e:
        prepare(bad, "language_modeling")
    assert "bad.jsonl:2: not valid JSON" in str(e.value) and "bad.jsonl:4: expected a JSON object" in str(e.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no examples \(the file is empty\)"):
        prepare(empty, "language_modeling")
    with pytest.raises(DataError, match=r"hellaswag\.jsonl: no such ICL data file \(task 'hellaswag'\). Set icl_data_root"):
        prepare(tmp_path / "hellaswag.jsonl", "multiple_choice")


def test_task_entries_are_checked_all_at_once(tmp_path):
    tasks = [
        {"label": "a", "dataset_uri": "a.jsonl", "icl_task_type": "multiple_choise"},
        {"label": "b", "dataset_uri": "b.jsonl", "icl_task_type": "language_modeling",
         "stop_sequences": ["\n"], "num_fewshot": [-1]},
        {"label": "a", "dataset_uri": "c.jsonl", "icl_task_type": "schema", "num_fewshots": 3},
        {"label": "d", "dataset_uri": "d.jsonl", "icl_task_type": "schema", "metric": "icl_mc_acuracy"},
    ]
    path = tmp_path / "tasks.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"data_root": "/data", "icl_tasks": tasks}))
    with pytest.raises(ConfigError) as e:
        load_icl_tasks(str(path))
    text = str(e.value)
    assert f"in the config in {path}" in text
    assert "icl_tasks[0].icl_task_type: unknown icl_task 'multiple_choise' in registry 'icl_tasks' (did you mean 'multiple_choice'?)" in text
    assert "icl_tasks[1].stop_sequences: not an option of language_modeling tasks" in text
    assert "icl_tasks[1].num_fewshot: expected counts >= 0" in text
    assert "icl_tasks[2].num_fewshots: unknown key (did you mean 'num_fewshot'?)" in text
    assert "icl_tasks[3].metric: unknown metric 'icl_mc_acuracy'" in text
    tasks = [t for t in tasks if t["label"] == "d"]
    tasks[0].pop("metric")
    path.write_text(yaml.safe_dump({"data_root": "/data", "icl_tasks": tasks}))
    (d,) = load_icl_tasks(str(path))
    assert d.dataset_uri == "/data/d.jsonl"
    (d,) = load_icl_tasks(str(path), data_root="/elsewhere")
    assert d.dataset_uri == "/elsewhere/d.jsonl"


def test_eval_config_problems_are_reported_together(tmp_path):
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(
        "models:\n  - {label: m, checkpoint: ck}\n  - {label: m, hf: x, checkpoint: y}\n"
        "icl_tasks:\n  - {label: t, dataset_uri: t.jsonl, icl_task_type: schema, num_fewshot: [0]}\n"
        "eval_gauntlet:\n  categories:\n    - name: c\n      benchmarks:\n"
        "        - {name: t, num_fewshot: 5, random_baseline: 0.5}\n"
        "setup: {quickstart_fact: {}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_eval_config(str(cfg))
    text = str(e.value)
    assert "models[0].run_config: missing" in text
    assert "models[1]: give exactly one of checkpoint (with run_config) and hf" in text
    assert "models[1].label: 'm' is used twice" in text
    assert "setup.quickstart_fact: unknown step (did you mean 'quickstart_facts'?)" in text
    assert ("eval_gauntlet.categories[0].benchmarks[0]: the gauntlet scores t/5-shot, which is not "
            "among the ICL tasks evaluated (t/0-shot); task 't' is evaluated at 0 shots: add 5 to "
            "its num_fewshot") in text


def test_run_config_checks_its_icl_tasks_up_front(tmp_path, quickstart_data, capsys):
    """`foundryx train --dry-run` reports a bad task entry and a missing dataset with the rest
    (load_run_config: load_config with the ICL check that foundryx.eval plugs into it)."""
    from foundryx.train import load_run_config

    write_jsonl(tmp_path / "here.jsonl", [{"context": "a", "continuation": "b"}])
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(
        f"data_root: {tmp_path}\nicl_tasks:\n"
        "  - {label: here, dataset_uri: here.jsonl, icl_task_type: language_modeling}\n"
        "  - {label: gone, dataset_uri: gone.jsonl, icl_task_type: language_modeling}\n"
        "  - {label: typo, dataset_uri: here.jsonl, icl_task_type: multiple_choise}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_run_config("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}",
                                                  f"icl_tasks={tasks}", "max_durration=3ba"])
    text = str(e.value)
    assert "2 problems" in text, text
    assert "max_durration: unknown key (did you mean 'max_duration'?)" in text
    assert f"{tasks}: icl_tasks[2].icl_task_type: unknown icl_task 'multiple_choise'" in text
    assert "did you mean 'multiple_choice'?" in text
    tasks.write_text(tasks.read_text().replace("multiple_choise", "multiple_choice"))
    with pytest.raises(ConfigError) as e:
        load_run_config("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}",
                                                  f"icl_tasks={tasks}"])
    missing = (f"icl_tasks: gone: dataset_uri {tmp_path}/gone.jsonl: no such file; set "
               "icl_data_root, or data_root in the task file, to the folder that holds it")
    assert e.value.problems == [missing]
    # the CLI passes the same checks: --dry-run reports it
    from foundryx.cli import main

    args = ["train", "--dry-run", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
            f"icl_tasks={tasks}"]
    assert main(args) == 2
    assert missing in capsys.readouterr().err
