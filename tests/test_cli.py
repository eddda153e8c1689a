"""The CLI: bad input gives one message and exit code 2, never a traceback.

Two cases run as real processes (``train.py`` and ``python -m foundryx.cli``) to see what a
user sees; the others call ``foundryx.cli.main`` in this process, which is the same code
path without the ten seconds of interpreter start and imports each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def foundryx(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "foundryx.cli", *args)


def assert_user_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("foundryx: error:")
    for n in needles:
        assert n in r.stderr, r.stderr


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``foundryx ARGS`` run by ``main`` here, as a CompletedProcess."""
    from foundryx.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["foundryx", *args], code, out, err)


def test_missing_yaml_via_train_py():
    assert_user_error(run("train.py", "yamls/nope.yaml"), "yamls/nope.yaml: no such config file")


def test_unknown_registry_name_in_list():
    assert_user_error(foundryx("registry", "list", "callback"), "did you mean 'callbacks'")


def test_registry_list_shows_kind_and_source(capsys):
    r = in_process(capsys, "registry", "list", "optimizers")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "decoupled_adamw" in ln)
    assert line.split()[:4] == ["optimizers", "decoupled_adamw", "class", "foundryx"]


def test_dry_run_prints_resolved_config_and_derived(quickstart_data, capsys):
    r = in_process(capsys, "train", "--dry-run", "yamls/quickstart.yaml",
                 f"variables.data_root={quickstart_data}", "global_train_batch_size=32")
    assert r.returncode == 0, r.stderr
    assert "global_train_batch_size: 32" in r.stdout
    assert "grad_accum" in r.stdout and "tokens_per_step" in r.stdout
    assert "${" not in r.stdout  # interpolations are resolved


def test_bad_config_lists_all_problems(quickstart_data, capsys):
    r = in_process(capsys, "train", "--dry-run", "yamls/quickstart.yaml",
                 f"variables.data_root={quickstart_data}", "optimizer.name=adamx", "seeed=3")
    assert_user_error(r, "2 problems", "optimizer.name", "seeed: unknown key (did you mean 'seed'?)")


def test_mpt_1b_without_data_names_the_folder(tmp_path, capsys):
    r = in_process(capsys, "train", "--dry-run", "yamls/mpt-1b.yaml",
                 f"variables.data_local={tmp_path}/c4")
    assert_user_error(r, "train_loader.dataset.local", f"{tmp_path}/c4")


@pytest.mark.parametrize("argv", [["train"], ["data", "convert", "--input", "x"]])
def test_usage_errors_exit_2(argv):
    r = foundryx(*argv)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("overrides", "env", "needle"),
    [
        (["max_duraton=5ba"], {}, "max_duraton: unknown key (did you mean 'max_duration'?)"),
        (["global_train_batch_size=many"], {}, "global_train_batch_size: expected an integer"),
        (["optimizer.name=lamb"], {}, "optimizer.name: unknown optimizer 'lamb'"),
        (["model.attn_config.attn_impl=flashy"], {}, "model.attn_config.attn_impl"),
        (["train_loader.dataset.local=/nonexistent/mds"], {}, "/nonexistent/mds"),
        (["global_train_batch_size=10"], {"WORLD_SIZE": "4"},
         "global_train_batch_size: 10 does not divide by the world size 4"),
    ],
    ids=["misspelt-key", "wrong-type", "unknown-registry-name", "unknown-attn-impl",
         "missing-data", "batch-vs-world-size"],
)
def test_each_bad_input_is_one_message_and_exit_2(quickstart_data, overrides, env, needle,
                                                 monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    r = in_process(capsys, "train", "yamls/quickstart.yaml",
                   f"variables.data_root={quickstart_data}", *overrides)
    assert_user_error(r, needle)


def test_help_and_the_data_commands_do_not_load_torch():
    """Training, eval and export modules are imported when their command runs, so
    `foundryx --help` starts in a fraction of a second."""
    code = ("import sys, foundryx.cli; heavy = {'torch', 'composer', 'transformers'} & "
            "set(sys.modules); print(sorted(heavy))")
    r = run("-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
