"""Every `foundryx plan ...` command docs/planning.md and docs/finetuning.md show with what it
prints: run as written, its output is the doc's, to the character (the planner's numbers move
with its model; a doc that shows old ones is wrong)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from foundryx.cli import main

ROOT = Path(__file__).parents[1]
SHOWN = re.compile(r"`foundryx (plan [^`]*?)`:\n\n```\n(.*?)```", re.S)
CASES = [(doc, m.group(1), m.group(2)) for doc in ("docs/planning.md", "docs/finetuning.md")
         for m in SHOWN.finditer((ROOT / doc).read_text())]


def test_the_docs_show_planner_runs():
    assert {doc for doc, *_ in CASES} == {"docs/planning.md", "docs/finetuning.md"}
    assert len(CASES) >= 4


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "command", "shown"), CASES,
                         ids=[f"{d}:{c.split()[1]}" for d, c, _ in CASES])
def test_a_plan_the_docs_show_is_what_the_planner_prints(doc, command, shown, capsys,
                                                        monkeypatch):
    monkeypatch.chdir(ROOT)
    main(shlex.split(" ".join(command.split())))
    assert capsys.readouterr().out.rstrip("\n") == shown.rstrip("\n"), (
        f"{doc}: `foundryx {command}` prints otherwise; rerun it and paste its output")
