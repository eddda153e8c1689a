"""Tasks prepared in a child process while the parent imports torch (foundryx.eval.ahead): the
same tasks, scores and log lines as preparing them in the parent; a bad task file stops the
eval with the same message; a child that dies leaves the work to the parent; and the cases the
parent keeps for itself."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from test_eval_native import ROOT, _llama_folder
from test_eval_native import _config as native_config

from foundryx.errors import DataError
from foundryx.eval.ahead import start
from foundryx.eval.config import load_eval_config
from foundryx.eval.prepare import read_tasks
from foundryx.eval.run import run_eval


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama_folder(tmp_path_factory.mktemp("ahead_llama"))


def _config(tmp_path, shared, models, *overrides):
    """test_eval_native's config of one task of each kind, its rows cut to 200 tokens (so the
    preparation says so in a line)."""
    return load_eval_config(native_config(tmp_path, shared, models), ["max_seq_len=200", *overrides])


def _cut_lines(err: str) -> list[str]:
    """The lines the preparation says (rows cut to max_seq_len), without their timestamps."""
    return [line.split(": INFO: ", 1)[1] for line in err.splitlines() if "cut on the left" in line]


@pytest.mark.needs_shared
@pytest.mark.usefixtures("one_thread")
def test_prepared_in_a_child_scores_and_says_what_the_parent_would(llama, tmp_path, shared_dir,
                                                                     capfd):
    loaded = _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    want = run_eval(loaded, write=False).results.scores
    said = _cut_lines(capfd.readouterr().err)
    ahead = start(loaded, 1, after_torch=True)
    assert ahead is not None
    taken = []
    result = ahead.result
    ahead.result = lambda: taken.append(result()) or taken[-1]
    got = run_eval(loaded, write=False, ahead=ahead).results.scores
    assert taken and taken[0] is not None and set(taken[0].tasks) == set(want_labels(loaded))
    assert got == want
    assert len(said) >= 2 and _cut_lines(capfd.readouterr().err) == said  # said in the parent


@pytest.mark.needs_shared
def test_the_command_prepares_its_tasks_in_a_child(llama, tmp_path, shared_dir):
    """A fresh ``foundryx eval`` process (torch not imported yet) takes the child's tasks."""
    _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    r = subprocess.run([sys.executable, "-m", "foundryx.cli", "eval", str(tmp_path / "eval.yaml"),
                        "max_seq_len=200", "python_log_level=debug", "progress_bar=false"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"tasks prepared for {llama} by a child process while torch was imported" in r.stderr
    assert "| arc_easy/3-shot |" in r.stdout
    # the chart drawn by the child (matplotlib imported there): not said as drawn here
    assert (tmp_path / "out/results.png").read_bytes()[:4] == b"\x89PNG"
    assert "chart drawn here" not in r.stderr


def want_labels(loaded):
    return [t.label for t in loaded.tasks if os.path.isfile(t.dataset_uri)]


def test_a_bad_task_file_fails_with_read_tasks_message(llama, tmp_path):
    (tmp_path / "t.jsonl").write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n{"query"\n')
    loaded = load_eval_config(_write(tmp_path, {
        "models": [{"label": "m", "hf": str(llama)}], "device": "cpu",
        "icl_tasks": [{"label": "t", "dataset_uri": str(tmp_path / "t.jsonl"),
                       "icl_task_type": "multiple_choice"}]}))
    with pytest.raises(DataError) as direct:
        read_tasks(loaded)
    ahead = start(loaded, 1, after_torch=True)
    with pytest.raises(DataError) as child:
        ahead.result()
    assert str(child.value) == str(direct.value) and "t.jsonl:2" in str(child.value)


def test_a_child_that_dies_leaves_the_preparing_to_the_parent(llama, tmp_path, shared_dir,
                                                              caplog, monkeypatch):
    import foundryx.eval.ahead as ahead_module

    loaded = _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    # the child (a fork: it runs this) is still preparing when it is killed
    monkeypatch.setattr(ahead_module, "_prepare", lambda *a: time.sleep(60))
    ahead = start(loaded, 1, after_torch=True)
    os.kill(ahead.pid, signal.SIGKILL)
    caplog.set_level(logging.DEBUG, logger="foundryx")
    assert ahead.result() is None
    assert "tasks prepared here: the preparing process sent nothing readable" in caplog.text


def test_a_parent_that_stops_first_ends_the_child(llama, tmp_path, shared_dir):
    ahead = start(_config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}]), 1,
                  after_torch=True)
    pid = ahead.pid
    ahead.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no child left behind


@pytest.mark.parametrize("models, extra, world", [
    ([{"label": "m", "hf": "LLAMA"}], [], 2),                                        # processes
    ([{"label": "m", "hf": "LLAMA", "implementation": "hf"}], [], 1),               # transformers
    ([{"label": "m", "hf": "LLAMA"}], ["setup={quickstart_facts: {out_dir: TMP}}"], 1),  # writes tasks
], ids=["two-processes", "implementation-hf", "setup-steps"])
def test_the_parent_prepares_where_the_child_cannot_know(llama, tmp_path, models, extra, world):
    for m in models:
        m["hf"] = str(llama)
    extra = [e.replace("TMP", str(tmp_path)) for e in extra]
    assert start(_config(tmp_path, tmp_path, models, *extra), world, after_torch=True) is None


def test_a_process_that_imported_torch_prepares_itself(llama, tmp_path):
    assert start(_config(tmp_path, tmp_path, [{"label": "m", "hf": str(llama)}]), 1) is None


def test_tasks_for_another_tokenizer_or_limit_are_not_used(llama, tmp_path, shared_dir):
    from foundryx.data.json_tokenizer import open_json_tokenizer

    loaded = _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    prepared = start(loaded, 1, after_torch=True).result()
    label = next(iter(prepared.tasks))
    tokenizer = open_json_tokenizer(llama)
    assert prepared.tasks_for(label, tokenizer, prepared.limit) is prepared.tasks[label]
    assert prepared.tasks_for(label, tokenizer, 32) is None
    other = _llama_folder(tmp_path / "other")
    assert prepared.tasks_for(label, open_json_tokenizer(other), prepared.limit) is None


def _write(tmp_path, cfg):
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _results():
    from foundryx.eval.report import EvalResults

    results = EvalResults()
    for key, score in (("arc_easy/3-shot", 0.25), ("piqa/0-shot", 0.5)):
        results.add("m", key, score, "task", 4)
    results.models = ["m"]
    return results


def _waiting_child(llama, tmp_path, shared_dir):
    ahead = start(_config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}]),
                  1, after_torch=True)
    assert ahead.result() is not None and ahead.drawing
    return ahead


def test_the_child_draws_the_chart_the_parent_would(llama, tmp_path, shared_dir, caplog):
    from foundryx.eval.report import bar_chart

    ahead = _waiting_child(llama, tmp_path, shared_dir)
    caplog.set_level(logging.DEBUG, logger="foundryx")
    ahead.draw(_results(), tmp_path / "child.png")
    assert ahead.pid is None and "chart drawn here" not in caplog.text  # drawn, then reaped
    bar_chart(_results(), tmp_path / "here.png")
    assert (tmp_path / "child.png").read_bytes() == (tmp_path / "here.png").read_bytes()


def test_a_chart_the_child_cannot_write_is_the_oserror_here(llama, tmp_path, shared_dir):
    ahead = _waiting_child(llama, tmp_path, shared_dir)
    with pytest.raises(FileNotFoundError, match="No such file or directory"):
        ahead.draw(_results(), tmp_path / "absent" / "results.png")


def test_without_a_waiting_child_the_parent_draws(llama, tmp_path, shared_dir, caplog):
    ahead = _waiting_child(llama, tmp_path, shared_dir)
    os.kill(ahead.pid, signal.SIGKILL)
    caplog.set_level(logging.DEBUG, logger="foundryx")
    ahead.draw(_results(), tmp_path / "results.png")
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert "chart drawn here" in caplog.text


@pytest.mark.needs_shared
def test_past_its_token_budget_the_child_leaves_the_rest_to_the_parent(llama, tmp_path,
                                                                       shared_dir, monkeypatch):
    import foundryx.eval.ahead as ahead_module

    loaded = _config(tmp_path, shared_dir, [{"label": "m", "hf": str(llama)}])
    want = run_eval(loaded, write=False).results.scores
    monkeypatch.setattr(ahead_module, "MAX_TOKENS", 0)  # past it after the first task
    ahead = start(loaded, 1, after_torch=True)
    taken = []
    result = ahead.result
    ahead.result = lambda: taken.append(result()) or taken[-1]
    assert run_eval(loaded, write=False, ahead=ahead).results.scores == want
    labels = want_labels(loaded)
    assert list(taken[0].tasks) == labels[:1] and len(labels) > 1
