"""Every writer walked through a failure half-way (issue 11): its output location is byte for
byte what it was before, no temporary file is left beside it, and the user sees one message
naming the location (exit code 2 from the CLI, no traceback).

Writers: ``foundryx data convert``, ``foundryx export``, ``foundryx eval`` (results, comparisons
and dumped examples as one set) and the results report (``write_results``), plus the commit
step they share (:func:`foundryx.runtime.atomic_writes.write_together`). Each runs once successfully, then
again with a full disk (``ENOSPC``) injected in the middle. Checkpoint saves are covered by
the checkpoint tests.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import in_process
from test_convert import SEQ, expected, stored, write_txt
from test_eval_compare import setup as eval_setup  # noqa: F401 (a fixture: two fake models)

from foundryx.data.synthetic import generate_corpus
from foundryx.errors import EvalError
from foundryx.eval import report
from foundryx.eval.report import EvalResults, write_results
from foundryx.runtime.atomic_writes import write_together

FULL = os.strerror(errno.ENOSPC)  # "No space left on device"


def enospc(path) -> OSError:
    return OSError(errno.ENOSPC, FULL, str(path))


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and folder (None) below ``folder``, hidden ones included."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def fail_write_text(monkeypatch, root: Path, which: int | str) -> list[Path]:
    """Make ``Path.write_text`` below ``root`` raise ENOSPC: at its ``which``-th call, or for
    the file whose name holds ``which``. Returns the paths it was called with."""
    original, calls = Path.write_text, []

    def write_text(self, *args, **kwargs):
        if self.is_relative_to(root):
            calls.append(self)
            if (which == len(calls)) if isinstance(which, int) else (which in self.name):
                raise enospc(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    return calls


def attempt(capsys, *args: str) -> subprocess.CompletedProcess:
    """``foundryx ARGS`` in this process; a writer that lets its OSError through is still judged
    on what it left first (its returncode is then the exception, which fails the exit check)."""
    try:
        return in_process(capsys, *args)
    except OSError as e:
        return subprocess.CompletedProcess(["foundryx", *args], f"raised {e!r}", "", "")


def assert_one_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2 and one ``foundryx: error:`` message (after any log lines) holding
    ``needles``, no traceback; returns the message."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("foundryx: error: ") == 1, r.stderr
    message = r.stderr[r.stderr.index("foundryx: error: "):]
    for needle in needles:
        assert needle in message, message
    return message


# -- foundryx data convert ---------------------------------------------------------------------
@pytest.mark.parametrize("where", ["mid-conversion", "at-finish"])
def test_convert(tmp_path, tiny_tokenizer, capsys, monkeypatch, where):
    from foundryx.data import chunk_writer

    docs_a, docs_b = generate_corpus(40, seed=3), generate_corpus(40, seed=4)
    out = tmp_path / "mds"
    args = ["data", "convert", "--out", str(out), "--tokenizer", tiny_tokenizer.name_or_path,
            "--max-seq-len", str(SEQ), "--workers", "1", "--no-progress", "--overwrite"]
    src = write_txt(tmp_path / "a.txt", docs_a)
    assert in_process(capsys, *args, "--input", str(src)).returncode == 0
    write_txt(src, docs_b)  # new text for the same --out
    before = tree(tmp_path)

    if where == "mid-conversion":
        original, written = chunk_writer.write_rows, []

        def write_rows(writer, rows):  # the disk fills at the third sequence
            for i in range(len(rows)):
                written.append(1)
                if len(written) == 3:
                    raise enospc("shard.00000.mds")
                original(writer, rows[i:i + 1])

        monkeypatch.setattr(chunk_writer, "write_rows", write_rows)
    else:  # index.json is merged, the manifest (2nd write) fails
        fail_write_text(monkeypatch, tmp_path, 2)
    r = attempt(capsys, *args, "--input", str(src))
    monkeypatch.undo()

    after = tree(tmp_path)
    # the previous dataset is untouched; only the hidden work folder is added, deliberately
    # (the same command resumes from it): no lock, no .old-/.tmp- names
    assert {k: v for k, v in after.items() if not k.startswith(".mds.partial")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mds.partial", "a.txt", "mds"]
    assert_one_error(r, str(out), FULL, f"{out} is unchanged")
    if where == "mid-conversion":
        assert "resumes" in r.stderr and str(tmp_path / ".mds.partial") in r.stderr

    assert in_process(capsys, *args, "--input", str(src)).returncode == 0  # the same command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "mds"]
    np.testing.assert_array_equal(stored(out), expected(tiny_tokenizer, docs_b))


# -- foundryx export ---------------------------------------------------------------------------
def save_weights(folder: Path, tokenizer, seed: int) -> Path:
    """A tiny MPT's weights with the record export rebuilds it from (components of hf/)."""
    from hf_tiny import random_mpt

    from foundryx.checkpoint.metadata import write_model_metadata
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.mpt.configuration import FIELDS

    config = random_mpt(seed=seed).config.to_dict()
    torch.manual_seed(seed)
    model = ComposerMPTCausalLM(tokenizer, **{k: v for k, v in config.items() if k in FIELDS})
    folder.mkdir(exist_ok=True)
    torch.save(model.state_dict(), folder / "weights.pt")
    write_model_metadata(folder, model)
    return folder / "weights.pt"


@pytest.mark.parametrize("where", ["2nd-code-file", "final-rename"])
def test_export(tmp_path, tiny_tokenizer, capsys, monkeypatch, where):
    out = tmp_path / "exported"
    weights = save_weights(tmp_path / "ckpt", tiny_tokenizer, seed=0)
    args = ["export", str(weights), str(out), "--overwrite", "--no-progress"]
    assert in_process(capsys, *args).returncode == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    save_weights(tmp_path / "ckpt", tiny_tokenizer, seed=1)  # other weights, same folder
    before = tree(tmp_path)

    if where == "2nd-code-file":  # format mpt: safetensors and tokenizer written, then code files
        fail_write_text(monkeypatch, tmp_path, 2)
    else:  # the complete new folder cannot be renamed (or exchanged) onto the old one
        from foundryx.runtime import atomic_writes

        original = os.replace

        def replace(src, dst):
            if Path(dst) == out and Path(src).name.startswith(f".{out.name}.tmp-"):
                raise enospc(dst)
            return original(src, dst)

        def exchange(a, b):
            assert Path(b) == out and Path(a).name.startswith(f".{out.name}.tmp-")
            raise enospc(b)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(atomic_writes, "_exchange", exchange)
    r = attempt(capsys, *args)
    monkeypatch.undo()

    assert tree(tmp_path) == before  # the previous export as it was; no .exported.tmp-/.old-
    assert_one_error(r, f"could not write the export to {out}", FULL,
                      "the previous export there is unchanged")


# -- foundryx eval: results, comparisons and examples as one set --------------------------------
@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
@pytest.mark.modern_leg
@pytest.mark.parametrize("where", ["2nd-file", "chart", "examples"])
def test_eval_outputs(eval_setup, capsys, monkeypatch, where):  # noqa: F811
    path, out = eval_setup
    args = ["eval", str(path), "--compare-to", "bad", "--dump-examples", "2"]
    assert in_process(capsys, *args).returncode == 0
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == ["comparison_good.md", "examples.jsonl", "results.csv", "results.json",
                     "results.md", "results.png", "scores/bad.yaml", "scores/good.yaml"]
    # mark the previous outputs: a run that rewrote one with equal bytes could not hide it
    for name in names:
        (out / name).write_bytes(f"previous {name}\n".encode())
    before = tree(out.parent)

    if where == "2nd-file":  # results.md written, results.json fails
        fail_write_text(monkeypatch, out, 2)
    elif where == "chart":  # every text file written, the chart fails
        def chart(results, png):
            raise enospc(png)

        monkeypatch.setattr(report, "bar_chart", chart)
    else:  # all results written, the last file of the set fails
        fail_write_text(monkeypatch, out, "examples")
    r = attempt(capsys, *args)
    monkeypatch.undo()

    assert tree(out.parent) == before
    assert_one_error(r, f"could not write the eval results to {out} ({FULL})",
                      "the files there are unchanged")
    assert "| mc/0-shot | all | 4 | 0.333333 | 1.0000 | 0.0000 |" in r.stderr  # the scores are not lost
    assert r.stdout == ""


# -- the results report ------------------------------------------------------------------------
def results(score: float) -> EvalResults:
    res = EvalResults()
    for model in ("a", "b/c"):
        res.add(model, "mc/0-shot", score, "task", examples=10)
        res.add(model, "gauntlet/all", score / 2, "gauntlet")
    res.baselines["mc/0-shot"] = 0.25
    return res


@pytest.mark.parametrize("previous", [True, False], ids=["over-previous", "fresh-folder"])
@pytest.mark.parametrize("where", ["2nd-file", "chart"])
def test_report(tmp_path, monkeypatch, previous, where):
    out = tmp_path / "report"
    if previous:
        paths = write_results(results(0.5), out, "first.yaml")
        assert sorted(p.name for p in out.rglob("*")) == [
            "a.yaml", "b_c.yaml", "results.csv", "results.json", "results.md", "results.png",
            "scores"]
        assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    before = tree(tmp_path)

    if where == "2nd-file":
        calls = fail_write_text(monkeypatch, out, 2)
    else:
        def chart(res, png):
            raise enospc(png)

        monkeypatch.setattr(report, "bar_chart", chart)
    try:
        write_results(results(0.75), out, "second.yaml")
        raised = None
    except Exception as e:  # judged after the files
        raised = e
    monkeypatch.undo()

    assert tree(tmp_path) == before  # a fresh folder is not even created
    if where == "2nd-file":
        assert len(calls) == 2 and calls[0].parent == out  # it did fail half-way
    assert isinstance(raised, EvalError), repr(raised)
    assert str(raised).startswith(f"could not write the eval results to {out} ({FULL})")
    assert "| mc/0-shot |  | 10 | 0.25 | 0.7500 | 0.7500 |" in str(raised)  # the scores are not lost
    assert isinstance(raised.__cause__, OSError)

    write_results(results(0.75), out, "second.yaml")  # once the disk has room: complete
    assert sorted(p.name for p in out.rglob("*")) == [
        "a.yaml", "b_c.yaml", "results.csv", "results.json", "results.md", "results.png", "scores"]
    assert "0.75" in (out / "scores" / "a.yaml").read_text()


# -- the commit step they share ----------------------------------------------------------------
def test_a_rename_failing_half_way_through_the_commit_is_undone(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "b.txt").write_text("old b")
    before = tree(tmp_path)
    original, calls = os.replace, []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if len(calls) == 2:  # a.txt is already new; b.txt cannot be renamed
            raise enospc(dst)
        return original(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match=FULL):
        with write_together() as stage:
            for name in ("a.txt", "b.txt", "c.txt"):
                stage(tmp_path / name).write_text(f"new {name}")
    monkeypatch.undo()
    assert calls[:2] == ["a.txt", "b.txt"]
    assert tree(tmp_path) == before

    with write_together() as stage:
        for name in ("a.txt", "b.txt", "c.txt"):
            stage(tmp_path / name).write_text(f"new {name}")
    assert tree(tmp_path) == {n: f"new {n}".encode() for n in ("a.txt", "b.txt", "c.txt")}


@pytest.mark.parametrize("kill_before", ["link", "replace", "nothing"])
def test_a_kill_inside_an_atomic_replace_leaves_the_old_or_the_new_file_whole(
        tmp_path, monkeypatch, kill_before):
    """``write_text_atomically`` over an existing file (a checkpoint's JSON, a results file),
    the process dying before each file-system step (no except or finally runs): the path
    holds, whole, what it held or the new text; never nothing (the old one is kept by a hard
    link while the new one is renamed over it)."""
    import types

    from foundryx.runtime import atomic_writes

    class Killed(BaseException):
        pass

    path = tmp_path / "trainer_state.json"
    path.write_text("old " * 1000)
    steps = []

    def step(name):
        real = getattr(os, name)

        def run(*args, **kwargs):
            steps.append(name)
            if name == kill_before:
                raise Killed
            return real(*args, **kwargs)
        return run

    fake_os = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
    fake_os.link, fake_os.replace = step("link"), step("replace")
    monkeypatch.setattr(atomic_writes, "os", fake_os)
    try:
        atomic_writes.write_text_atomically(path, "new " * 2000)
    except Killed:
        pass
    monkeypatch.undo()
    assert path.exists(), "the kill left nothing at the path"
    assert path.read_text() == ("new " * 2000 if kill_before == "nothing" else "old " * 1000)
    assert steps == {"link": ["link"], "replace": ["link", "replace"],
                     "nothing": ["link", "replace"]}[kill_before]


KILL_INSIDE = r"""
import os, sys, types
from pathlib import Path
from foundryx.runtime import atomic_writes as aw
kill_at, new, final, can_exchange = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
steps = []

def step(name, real):
    def run(*args, **kwargs):
        steps.append(name)
        print(name, flush=True)
        if len(steps) == kill_at:
            os._exit(9)  # killed before this step: no except, no finally runs
        return real(*args, **kwargs)
    return run

fake_os = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
fake_os.replace = step("replace", os.replace)
aw.os = fake_os
aw._exchange = step("exchange", aw._exchange if can_exchange else lambda a, b: False)
aw._remove = step("remove", aw._remove)
aw.replace_all([(new, final)])
"""


@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "no-exchange"])
def test_a_kill_inside_a_folder_replace_leaves_the_old_or_the_new_folder_whole(
        tmp_path, can_exchange):
    """``replace_all`` of a folder onto an existing one (an export or a dataset with
    --overwrite), the process killed (``os._exit``) before each of its file-system steps in
    turn: the path then holds, whole, the old folder or the new one; never a mix and never
    nothing. Where the system cannot exchange two names, a kill between its two renames leaves
    the old folder aside, which the next replace onto the path puts back first."""
    import sys

    from foundryx.runtime.atomic_writes import restore_set_aside

    def fill(folder: Path, tag: str) -> dict:
        (folder / "sub").mkdir(parents=True)
        (folder / "config.json").write_text(f'{{"tag": "{tag}"}}')
        (folder / "sub" / "model.safetensors").write_bytes(tag.encode() * 50_000)
        return tree(folder)

    expected_steps = ["exchange", "remove"] if can_exchange else [
        "exchange", "replace", "replace", "remove"]
    for kill_at in range(1, len(expected_steps) + 2):  # the last: not killed
        work = tmp_path / f"kill{kill_at}"
        final, new = work / "out", work / ".out.tmp-1234"
        old_tree, new_tree = fill(final, "old"), fill(new, "new")
        r = subprocess.run([sys.executable, "-c", KILL_INSIDE, str(kill_at), str(new), str(final),
                            "1" if can_exchange else "0"], capture_output=True, text=True,
                           timeout=120)
        killed = kill_at <= len(expected_steps)
        assert r.returncode == (9 if killed else 0), r.stderr
        assert r.stdout.split() == expected_steps[:kill_at], r.stdout
        if not final.exists():  # the fallback's two renames, killed between them
            assert not can_exchange and kill_at == 3, kill_at
            restore_set_aside(final)
        got = tree(final)
        assert got in (old_tree, new_tree), f"killed at step {kill_at}: a mix"
        # once the folder in place is the new one, the commit has happened
        new_by_then = kill_at > expected_steps.index("remove")
        assert got == (new_tree if new_by_then else old_tree), kill_at
        if not killed:
            assert sorted(p.name for p in work.iterdir()) == ["out"]
