"""`foundryx eval` as a user runs it (issue 39, item 11): the printed table when the output is
piped (no progress bar glued to its header), its random-baseline column without a gauntlet,
`--scoring lm_eval` switching every task that can take it with one flag, and a gauntlet that
names a task the task list lacks (one message naming the task and the fixes, exit 2). Each
runs the real command in a subprocess; the mistakes answer before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.eval.report import EvalResults, markdown_table

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_EVAL = str(ROOT / "eval" / "yamls" / "quickstart.yaml")
NO_TTY = {"CUDA_VISIBLE_DEVICES": ""}


def foundryx(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed ``foundryx`` command, stdout and stderr into one pipe (as ``| tee log``
    or a batch job's log has them): not a terminal."""
    script = Path(sys.executable).parent / "foundryx"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "foundryx.cli"]
    return subprocess.run([*cmd, *args], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600,
                          env={**os.environ, **NO_TTY})


def one_message(r: subprocess.CompletedProcess, cwd: Path) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-3000:])
    assert "Traceback" not in r.stdout and r.stdout.count("foundryx: error:") == 1, r.stdout
    assert list(cwd.iterdir()) == [], f"the command wrote {list(cwd.iterdir())}"
    return r.stdout


@pytest.fixture
def empty(tmp_path) -> Path:
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


def test_a_gauntlet_naming_a_removed_task_says_which_and_how_to_fix(empty):
    """The issue's second try: the task list replaced by a one-task list with scoring: lm_eval,
    and the quickstart gauntlet still names facts_lm."""
    mc_only = ("icl_tasks=[{label: facts_mc, dataset_uri: facts_mc.jsonl, "
               "icl_task_type: multiple_choice, scoring: lm_eval}]")
    out = one_message(foundryx("eval", QUICKSTART_EVAL, mc_only, cwd=empty), empty)
    assert ("eval_gauntlet.categories[0].benchmarks[0]: the gauntlet scores facts_lm/0-shot, "
            "which is not among the ICL tasks evaluated (facts_mc/0-shot); add task 'facts_lm' "
            "(num_fewshot 0) to icl_tasks, remove this benchmark from category "
            "'quickstart_facts', or evaluate without the gauntlet: eval_gauntlet=null") in out
    assert "--scoring" in out  # the one-flag way, for what the user was doing

    # the task is there, at other shot counts: the fix is the shot count
    other_shots = ("icl_tasks=[{label: facts_mc, dataset_uri: facts_mc.jsonl, "
                   "icl_task_type: multiple_choice, num_fewshot: [3]}, {label: facts_lm, "
                   "dataset_uri: facts_lm.jsonl, icl_task_type: language_modeling}]")
    out = one_message(foundryx("eval", QUICKSTART_EVAL, other_shots, cwd=empty), empty)
    assert ("task 'facts_mc' is evaluated at 3 shots: add 0 to its num_fewshot, remove this "
            "benchmark from category 'quickstart_facts'") in out


def test_scoring_lm_eval_where_no_task_can_take_it_is_one_message(empty):
    lm_only = ("icl_tasks=[{label: facts_lm, dataset_uri: facts_lm.jsonl, "
               "icl_task_type: language_modeling}]")
    out = one_message(foundryx("eval", QUICKSTART_EVAL, lm_only, "eval_gauntlet=null",
                               "--scoring", "lm_eval", cwd=empty), empty)
    assert ("--scoring lm_eval: no task of icl_tasks can take it (lm_eval is for multiple_choice "
            "and schema tasks without has_categories); the tasks are facts_lm "
            "(language_modeling)") in out
    r = foundryx("eval", QUICKSTART_EVAL, "--scoring", "lm-eval", cwd=empty)
    assert r.returncode == 2 and "Traceback" not in r.stdout
    assert "argument --scoring: invalid choice: 'lm-eval'" in r.stdout
    assert "llmfoundry" in r.stdout and "lm_eval" in r.stdout


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer, saved as a Hugging Face folder that
    another process loads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundryx.data.synthetic import generate_corpus
    from foundryx.data.tokenizers import train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tiny_hf")
    tok = train_bpe_tokenizer(generate_corpus(200, seed=1), vocab_size=400, out_dir=out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)).save_pretrained(out)
    return out


@pytest.mark.slow
def test_piped_eval_with_one_scoring_flag_and_no_gauntlet(tiny_hf, tmp_path):
    """``foundryx eval eval/yamls/quickstart.yaml --scoring lm_eval`` without the gauntlet,
    output piped: one line says which tasks lm_eval scores and which keep theirs; the progress
    is a line per task, with no carriage returns, so the table's header starts its own line;
    the random-baseline column holds facts_mc's 1/4 (its 4 choices) and is empty for
    facts_lm, whose guessing has no known accuracy."""
    r = foundryx("eval", QUICKSTART_EVAL, f"variables.data_root={tmp_path / 'data'}",
                 f"models=[{{label: tiny, hf: {tiny_hf}}}]", "icl_max_examples=8",
                 f"output_dir={tmp_path / 'out'}", "eval_gauntlet=null", "--scoring", "lm_eval",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    out = r.stdout
    assert "\r" not in out, out[-3000:]
    lines = out.splitlines()
    assert any(ln.endswith("--scoring lm_eval: facts_mc scored with lm_eval; facts_lm "
                           "(language_modeling) as set in the config (lm_eval is for "
                           "multiple_choice and schema tasks without has_categories)")
               for ln in lines), out
    assert sum(ln.endswith(f"{task}: 8 examples") or f"{task}: 8 examples, score" in ln
               for ln in lines for task in ("facts_lm/0-shot", "facts_lm/3-shot",
                                            "facts_mc/0-shot")) == 3, out
    assert "| result | category | examples | random baseline | tiny |" in lines, out
    table = {ln.split(" | ")[0].strip("| "): ln.split(" | ") for ln in lines if ln.startswith("| ")}
    assert table["facts_mc/0-shot"][3] == "0.25"
    assert "facts_mc/0-shot/acc_norm" in table  # lm_eval scoring's second metric
    assert table["facts_lm/0-shot"][3] == ""
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["random_baselines"] == {"facts_mc/0-shot": 0.25}


def test_the_baseline_column_is_dropped_when_no_task_has_one():
    res = EvalResults()
    res.add("m", "lm/0-shot", 0.5, "task", 4)
    assert markdown_table(res).splitlines()[0] == "| result | category | examples | m |"
    assert markdown_table(res).splitlines()[2] == "| lm/0-shot |  | 4 | 0.5000 |"
    res.add("m", "mc/0-shot", 0.4, "task", 4)
    res.baselines["mc/0-shot"] = 1 / 3
    lines = markdown_table(res).splitlines()
    assert lines[0] == "| result | category | examples | random baseline | m |"
    assert "| mc/0-shot |  | 4 | 0.333333 | 0.4000 |" in lines


def test_guessing_baselines_of_the_task_types():
    from foundryx import registry
    from foundryx.eval.task_config import ICLTaskConfig

    def baseline(kind: str, options: list[int]) -> float | None:
        cfg = ICLTaskConfig(label="t", dataset_uri="t.jsonl", icl_task_type=kind)
        return registry.icl_tasks.get(kind)(cfg).random_baseline(options)

    assert baseline("multiple_choice", [4, 4, 4]) == pytest.approx(0.25)
    assert baseline("multiple_choice", [2, 4]) == pytest.approx(0.375)  # the mean of 1/choices
    assert baseline("schema", [2, 2]) == pytest.approx(0.5)
    assert baseline("language_modeling", [1, 1]) is None
    assert baseline("generation_task_with_answers", [1]) is None


def test_scoring_switches_every_task_that_can_take_it():
    from foundryx.errors import ConfigError
    from foundryx.eval.task_config import ICLTaskConfig, with_scoring

    tasks = [ICLTaskConfig(label="mc", dataset_uri="a", icl_task_type="multiple_choice"),
             ICLTaskConfig(label="sc", dataset_uri="b", icl_task_type="schema"),
             ICLTaskConfig(label="cat", dataset_uri="c", icl_task_type="multiple_choice",
                           has_categories=True),
             ICLTaskConfig(label="lm", dataset_uri="d", icl_task_type="language_modeling")]
    out, line = with_scoring(tasks, "lm_eval")
    assert [t.scoring for t in out] == ["lm_eval", "lm_eval", "llmfoundry", "llmfoundry"]
    assert line.startswith("--scoring lm_eval: mc, sc scored with lm_eval; cat (has_categories), "
                           "lm (language_modeling) as set in the config")
    back, line = with_scoring(out, "llmfoundry")
    assert [t.scoring for t in back] == ["llmfoundry"] * 4
    assert line == "--scoring llmfoundry: mc, sc, cat, lm scored with llmfoundry"
    with pytest.raises(ConfigError, match="no task of icl_tasks can take it"):
        with_scoring(tasks[2:], "lm_eval")


def test_the_lines_docs_eval_md_quotes_are_what_the_command_says():
    """docs/eval.md quotes the --scoring line of the quickstart eval and the message of a task
    list lm_eval cannot score: both as the code writes them."""
    from foundryx.errors import ConfigError
    from foundryx.eval.config import load_eval_config

    doc = (ROOT / "docs" / "eval.md").read_text()
    loaded = load_eval_config(QUICKSTART_EVAL, scoring="lm_eval")
    assert loaded.notes and loaded.notes[0] in doc
    assert [t.scoring for t in loaded.tasks] == ["llmfoundry", "lm_eval"]  # facts_lm, facts_mc
    with pytest.raises(ConfigError) as e:
        load_eval_config(QUICKSTART_EVAL, ["icl_tasks=[{label: facts_lm, dataset_uri: "
                                           "facts_lm.jsonl, icl_task_type: language_modeling}]",
                                           "eval_gauntlet=null"], scoring="lm_eval")
    assert f"`{e.value.problems[0]}`" in doc
