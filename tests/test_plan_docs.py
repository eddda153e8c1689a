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


@pytest.mark.slow
def test_the_plan_check_lines_docs_planning_shows_are_what_the_planner_says(monkeypatch, caplog):
    """docs/planning.md's `plan_check` section: the estimate line a GPU run logs and the refusal
    of ``model.init_device=cpu``, for the 405B FP8 recipe on one of its 8 H100s of a DGX H100:
    each as :func:`foundryx.plan.prelaunch.check_fits` words it today."""
    import logging

    from foundryx.config import load_config
    from foundryx.errors import ConfigError
    from foundryx.plan.gpus import find_gpu
    from foundryx.plan.planner import HostSpec
    from foundryx.plan.prelaunch import check_fits

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    text = (ROOT / "docs" / "planning.md").read_text()
    h = find_gpu("h100")

    def check(*extra: str) -> None:
        loaded = load_config("yamls/finetune/llama-3.1-405b-lora-fp8.yaml",
                             ["variables.model_path=yamls/shapes/llama-3.1-405b", *extra],
                             world_size=8, component_sections=("model", "optimizer"))
        check_fits(loaded, (h.device_name, h.memory, h.kind), HostSpec(h.host_memory, h.node, h.read_rate))

    with caplog.at_level(logging.INFO, logger="foundryx"):
        check()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan: estimated")]
    assert f"```\n{line}\n```" in text, f"docs/planning.md: the estimate line is now:\n{line}"
    with pytest.raises(ConfigError) as refused:
        check("model.init_device=cpu")
    assert f"```\n{refused.value}\n```" in text, f"docs/planning.md: the refusal is now:\n{refused.value}"
