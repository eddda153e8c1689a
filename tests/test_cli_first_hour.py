"""The first hour (issue 26): every command a newcomer types either works or says exactly what
to change. Each class of mistake runs the real ``foundryx`` command in a subprocess, in an
empty folder, and must give exit code 2, one message naming the fix, no traceback, and leave
the folder empty. A YAML or machine mistake answers before torch is imported (a second or
two); a mistake in the config's keys or values also loads the components' code to report their
options' problems with it (a few seconds). The time to the message is measured by
benchmarks/cli_errors.py, not here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.cli import main, parse, parser

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "yamls" / "quickstart.yaml")
EVAL = str(ROOT / "eval" / "yamls" / "quickstart.yaml")
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the same answer on a machine with a GPU

# Typical YAML mistakes: (name, text, the line that is wrong, words of the fix)
YAML_MISTAKES = [
    ("unclosed-bracket", "seed: 1\nbetas: [0.9, 0.95\neps: 1.0e-8\n", 2, "never closed"),
    ("missing-colon", "seed: 1\nmodel\n  name: mpt_causal_lm\n", 2, "no ':' after its key"),
    ("missing-colon-nested", "model:\n  name mpt_causal_lm\n  d_model: 64\n", 2,
     "no ':' after its key"),
    ("tab", "model:\n\tname: mpt_causal_lm\n", 2, "not tabs"),
    ("over-indented", "model:\n  name: mpt_causal_lm\n    d_model: 64\nseed: 1\n", 3,
     "indented deeper"),
    ("under-indented", "model:\n  name: mpt_causal_lm\n d_model: 64\nseed: 1\n", 3,
     "indentation matches no key"),
    ("unclosed-quote", "seed: 1\nrun_name: 'quick\nmax_duration: 2ba\n", 2, "never closed"),
    ("duplicate-key", "seed: 1\nmax_duration: 2ba\nseed: 2\n", 3, "duplicate key"),
]


def foundryx(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed ``foundryx`` command (``python -m foundryx.cli`` where it is not)."""
    script = Path(sys.executable).parent / "foundryx"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "foundryx.cli"]
    return subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def assert_one_fix(r: subprocess.CompletedProcess, cwd: Path, *needles: str) -> None:
    """Exit 2, one message (no traceback) holding every needle, and nothing written."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert r.stderr.count("error:") == 1, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    assert list(cwd.iterdir()) == [], f"the command wrote {list(cwd.iterdir())}"


@pytest.fixture
def empty(tmp_path) -> Path:
    """An empty working folder: a command that fails must leave it empty."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


# -- the table ---------------------------------------------------------------------------------
CASES = {
    # device and precision that this machine cannot run (CUDA_VISIBLE_DEVICES='' hides any GPU)
    "device-gpu-without-gpu": (["train", QUICKSTART, "device=gpu"], NO_GPU,
                               ["device: 'gpu' cannot run here", "CUDA_VISIBLE_DEVICES",
                                "Fix: set device=cpu"]),
    "amp-fp16-on-cpu": (["train", QUICKSTART, "precision=amp_fp16"], {},
                        ["precision: 'amp_fp16' cannot run here", "device: cpu",
                         "Fix: set precision=amp_bf16 or fp32"]),
    "amp-fp16-no-gpu": (["train", QUICKSTART, "device=null", "precision=amp_fp16"], NO_GPU,
                        ["precision: 'amp_fp16' cannot run here", "no GPU",
                         "Fix: set precision=amp_bf16 or fp32"]),
    "eval-device-gpu-without-gpu": (["eval", EVAL, "device=gpu"], NO_GPU,
                                    ["device: 'gpu' cannot run here", "Fix: set device=cpu"]),
    # overrides after the flags reach the config (a misspelt key proves it)
    "train-override-after-flag": (["train", QUICKSTART, "--dry-run", "seeed=3"], {},
                                  ["seeed: unknown key (did you mean 'seed'?)"]),
    "plan-override-after-flag": (["plan", QUICKSTART, "--gpus", "8", "--gpu", "h100",
                                  "seeed=3"], {}, ["seeed: unknown key (did you mean 'seed'?)"]),
    "eval-override-after-flag": (["eval", EVAL, "--tolerance", "0.1", "icl_max_exampels=4"], {},
                                 ["icl_max_exampels: unknown key (did you mean "
                                  "'icl_max_examples'"]),
    "doctor-override-after-flag": (["doctor", QUICKSTART, "--json", "seeed=3"], {},
                                   ["seeed: unknown key (did you mean 'seed'?)"]),
    "export-override-after-flag": (["export", "ckpt", "out", "--no-progress", "--config",
                                    QUICKSTART, "--overwrite", "model.name=mpt_causal"], {},
                                   ["model.name: unknown model 'mpt_causal'",
                                    "did you mean 'mpt_causal_lm'"]),
    "export-override-without-config": (["export", "ckpt", "out", "model.n_layers=2"], {},
                                       ["give it with --config RUN_YAML"]),
    "not-key-value-after-flag": (["plan", QUICKSTART, "--gpus", "8", "max_duration:5ba"], {},
                                 ["override 'max_duration:5ba': expected key=value"]),
}


@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_mistake_is_one_message_naming_the_fix(case, empty):
    args, env, needles = CASES[case]
    r = foundryx(*args, cwd=empty, env=env)
    assert_one_fix(r, empty, *needles)
    assert r.stderr.startswith("foundryx: error:"), r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("command", ["train", "plan", "eval", "doctor", "export"])
def test_an_unknown_flag_gets_the_commands_usage(command, empty):
    config = EVAL if command == "eval" else QUICKSTART
    positional = ["ckpt", "out", "--config", config] if command == "export" else [config]
    r = foundryx(command, *positional, "max_duration=4ba", "--bogus", cwd=empty)
    assert_one_fix(r, empty, f"usage: foundryx {command}",
                   f"foundryx {command}: error: unrecognized arguments: --bogus",
                   f"foundryx {command} --help")
    assert "usage: foundryx [-h]" not in r.stderr  # not the top-level usage


@pytest.mark.parametrize("name, text, line, fix", YAML_MISTAKES, ids=[m[0] for m in YAML_MISTAKES])
def test_a_yaml_mistake_names_its_line_with_a_caret(name, text, line, fix, tmp_path, empty):
    config = tmp_path / f"{name}.yaml"
    config.write_text(text)
    r = foundryx("train", str(config), cwd=empty)
    assert_one_fix(r, empty, f"{config}, line {line}: not valid YAML", fix)
    wrong = text.splitlines()[line - 1].rstrip()
    shown = r.stderr.splitlines()
    at = next(i for i, s in enumerate(shown) if s.endswith(f"{line:>5} | {wrong}"))
    caret = shown[at + 1]
    assert caret.rstrip().endswith("^") and set(caret.split("|")[1]) <= {" ", "^"}, r.stderr


def test_a_dry_run_with_a_model_build_problem_exits_2(quickstart_data, capsys, tmp_path,
                                                    monkeypatch):
    """LoRA target_modules that match no layer are found while building the model for the
    plan: the dry run prints what it can, then the problems, and exits 2 (CI gates on it)."""
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--dry-run", QUICKSTART, f"variables.data_root={quickstart_data}",
                 "model.peft_config.target_modules=[q_proj,v_prj]"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "no plan: the model cannot be built; see the problems below" in out
    assert "'v_prj' matches no linear layer" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_dry_run_with_a_model_build_problem_exits_2_as_a_command(quickstart_data, empty):
    r = foundryx("train", "--dry-run", QUICKSTART, f"variables.data_root={quickstart_data}",
                 "model.peft_config.target_modules=[q_proj,v_prj]", cwd=empty)
    assert_one_fix(r, empty, "'v_prj' matches no linear layer", "did you mean")
    assert "# resolved config" in r.stdout  # what it could show, before the problems


@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
def test_train_py_at_the_root_is_the_same_command(empty):
    """``composer train.py CFG ...`` runs train.py once per process: the same parsing."""
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), QUICKSTART, "--dry-run",
                        "seeed=3"], cwd=empty, capture_output=True, text=True, timeout=300)
    assert_one_fix(r, empty, "seeed: unknown key (did you mean 'seed'?)")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), QUICKSTART, "--bogus"],
                       cwd=empty, capture_output=True, text=True, timeout=300)
    assert_one_fix(r, empty, "usage: foundryx train", "unrecognized arguments: --bogus")


# -- where overrides may go ------------------------------------------------------------------
@pytest.mark.parametrize("argv, expected", [
    (["train", "C", "--dry-run", "a=1"], {"config": "C", "overrides": ["a=1"], "dry_run": True}),
    (["train", "a=1", "C", "b.c[0]=x", "--dry-run", "a=2"],
     {"config": "C", "overrides": ["a=1", "b.c[0]=x", "a=2"]}),
    (["plan", "C", "--gpus", "8", "model.peft_config.r=64"],
     {"config": "C", "overrides": ["model.peft_config.r=64"], "gpus": 8}),
    (["plan", "--gpus", "8", "C", "a=1", "--json", "b=2"],
     {"config": "C", "overrides": ["a=1", "b=2"], "json": True}),
    (["plan", "C", "--gpu-mem", "80GB", "a=1"],  # an abbreviated option keeps its value
     {"overrides": ["a=1"], "gpu_memory": "80GB"}),
    (["eval", "E", "--tolerance", "0.1", "a=1"], {"config": "E", "overrides": ["a=1"]}),
    (["doctor", "C", "--json", "a=1"], {"config": "C", "overrides": ["a=1"]}),
    (["doctor", "--save-folder", "runs/x=y", "C"],  # an option's value is never an override
     {"config": "C", "overrides": [], "save_folder": "runs/x=y"}),
    (["export", "K", "O", "--config", "C", "a=1", "--overwrite", "b=2"],
     {"checkpoint": "K", "out": "O", "config": "C", "overrides": ["a=1", "b=2"]}),
    (["export", "--config", "C", "a=1", "K", "O"],
     {"checkpoint": "K", "out": "O", "config": "C", "overrides": ["a=1"]}),
    (["export", "s3://bucket/run=3/ckpt", "O"],  # a path with '=' is not an override
     {"checkpoint": "s3://bucket/run=3/ckpt", "out": "O", "overrides": []}),
])
def test_overrides_anywhere_on_the_line(argv, expected):
    args = parse(argv)
    for key, value in expected.items():
        assert getattr(args, key) == value, (key, vars(args))


def test_plan_applies_an_override_after_its_flags(capsys):
    """The issue's own line: ``foundryx plan CFG --gpus 8 key=value``."""
    assert main(["plan", QUICKSTART, "--gpus", "8", "--gpu", "h100",
                 "device_train_microbatch_size=1", "global_train_batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "8 x h100" in out and "microbatch 1 x 128 tokens" in out


# -- small things -----------------------------------------------------------------------------
def test_version(empty):
    r = foundryx("--version", cwd=empty)
    assert r.returncode == 0 and r.stdout.startswith("foundryx 0."), (r.stdout, r.stderr)
    assert "composer" in r.stdout and "torch" in r.stdout


def _all_parsers(p):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_help_is_plain_text():
    """No reStructuredText (``x``, :class:`y`) in any command's --help."""
    for p in _all_parsers(parser()):
        text = p.format_help()
        for markup in ("``", ":class:", ":func:", ":mod:", ":meth:"):
            assert markup not in text, (p.prog, markup, text)


def test_export_usage_reads_right():
    text = next(p for p in _all_parsers(parser()) if p.prog.endswith(" export")).format_help()
    assert "[RUN_YAML ...]" not in text and "--config RUN_YAML" in text
    assert "[KEY=VALUE ...]" in text
