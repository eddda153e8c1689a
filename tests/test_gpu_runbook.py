"""benchmarks/gpu_runbook.sh: its dry run, its refusal without a GPU, and a whole run against a
fake Python (every command answered with canned output) to check the report it assembles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_runbook.sh"
NO_GPU = {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1"}  # even on a GPU machine

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def runbook(*args: str, python: str = sys.executable, **env: str):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHON": python, **env}, timeout=300)  # fmt: skip


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_dry_run_lists_the_steps_and_checks_files_and_flags(quick):
    r = runbook("--dry-run", *(["--quick"] if quick else []))
    assert r.returncode == 0, r.stdout + r.stderr
    for n in range(1, 6):
        assert f"[{n}/5]" in r.stdout
    assert "-m pytest" in r.stdout and "tests/test_triton_attention.py" in r.stdout
    assert "benchmarks/attention.py" in r.stdout and "train_throughput.py gpu" in r.stdout
    assert "FAIL " not in r.stdout and ", 0 failed" in r.stdout
    assert "accepts --out" in r.stdout and "accepts --models" in r.stdout
    assert ("--batches 8" in r.stdout) == quick and (
        "not test_every_combination" in r.stdout
    ) == quick
    assert ("--models 1b" in r.stdout) != quick
    if not (ROOT / "benchmarks" / "fp8_base_memory.py").exists():
        assert "not built yet" in r.stdout


def test_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "report.md"
    r = runbook("--out", str(out), **NO_GPU)
    assert r.returncode == 2
    assert r.stderr.strip() == "no CUDA or ROCm GPU visible to torch; this run book needs one"
    assert not out.exists()


def test_bad_arguments_and_wheel_list():
    assert runbook("--bogus").returncode == 2
    r = runbook("--wheel-list")
    names = {line.split("==")[0].lower() for line in r.stdout.split()}
    assert {"mosaicml", "transformers", "pytest", "setuptools", "wheel"} <= names
    assert not names & {"torch", "triton", "torchvision", "ruff", "ziglang"}
    assert not any(n.startswith("nvidia-") for n in names)


FAKE_PYTHON = r"""
import json, os, sys
from pathlib import Path
args, state = sys.argv[1:], Path(os.environ["FAKE_STATE"])
with (state / "calls").open("a") as f:
    f.write(" ".join(args) + "\n")
def value(flag):
    return next(a.split("=", 1)[1] if "=" in a else args[i + 1]
                for i, a in enumerate(args) if a.split("=")[0] == flag)
if args[0] == "-c":  # the GPU probe
    sys.exit(0)
if args[:2] == ["-m", "pip"]:
    (state / "installed").touch()
elif args[0].endswith("report.py") and args[1] == "probe":
    print("all import" if (state / "installed").exists() else "composer")
    sys.exit(0 if (state / "installed").exists() else 1)
elif args[0].endswith("report.py") and args[1] == "env":
    print("- GPU: Fake H100")
elif args[0].endswith("report.py"):
    os.execv(sys.executable, [sys.executable, *args])
elif args[:2] == ["-m", "pytest"]:
    with (state / "calls").open("a") as f:
        f.write(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}\n")
    Path(value("--junit-xml")).write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0" time="2">'
        '<testcase classname="t" name="ok"/><testcase classname="t" name="ok2"/>'
        '<testcase classname="t" name="bad"><failure/></testcase></testsuite></testsuites>')
    print("1 failed, 2 passed")
    sys.exit(1)
elif args[0].endswith("attention.py"):
    with open(value("--out"), "a") as f:
        f.write("\n## Attention kernels on Fake (today)\n\n| head_dim | fwd triton |\n|---|---|\n| 64 | 321 |\n")
elif args[0].endswith("train_throughput.py"):
    model = value("--models")
    if model != "125m":
        print("torch.OutOfMemoryError: CUDA out of memory", file=sys.stderr)
        sys.exit(1)
    rows = [{"case": "MPT-125M, no AC, eager", "tokens_per_sec": 1000.0, "mfu": 0.4},
            {"case": "MPT-125M, no AC, compile", "tokens_per_sec": 1500.0, "mfu": float("nan")}]
    Path(value("--out")).write_text(json.dumps(rows))
else:
    sys.exit(f"fake python: unexpected {args}")
"""


def test_a_run_on_a_fake_gpu_records_every_step(tmp_path):
    (tmp_path / "fake.py").write_text(textwrap.dedent(FAKE_PYTHON))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake.py"}" "$@"\n')
    python.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "composer.whl").touch()
    (wheels / "wheel-list.txt").touch()  # not a package: left out
    out = tmp_path / "report.md"
    r = runbook("--out", str(out), "--wheels", str(wheels), python=str(python),
                FAKE_STATE=str(tmp_path), TMPDIR=str(tmp_path), TRITON_INTERPRET="1")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "[3/5] attention TFLOP/s table ... (about 5 min; log: " in r.stderr
    text = out.read_text()
    calls = (tmp_path / "calls").read_text()
    assert (
        f"-m pip install --no-deps --no-index --find-links {wheels} {wheels}/composer.whl\n"
        in calls
    )
    assert f"- Dependencies: installed from {wheels}" in text
    assert "### 1. environment: ok, 0 min" in text and "Fake H100" in text
    assert "### 2. Triton attention tests on the GPU: FAILED (exit 1)" in text
    assert "**2 passed, 1 failed, 0 errors, 0 skipped**" in text and "`t::bad`" in text
    assert "### 3. attention TFLOP/s table: ok" in text and "| 64 | 321 |" in text
    assert "## Attention kernels on" not in text  # its heading is the run book's
    assert "### 4. MPT-125M/350M/1B tokens/s and MFU: FAILED (exit 1)" in text
    assert "| MPT-125M | no AC, compile | 1,500 | 1.50x | n/a |" in text
    assert "MPT-350M failed" in text and "CUDA out of memory" in text
    if not (ROOT / "benchmarks" / "fp8_base_memory.py").exists():
        assert "### 5. FP8-base fine-tuning memory: ok" in text and "Not built yet" in text
    assert text.rstrip().endswith("Steps failed: 2 of 5.")
    assert "TRITON_INTERPRET=None" in calls and "smoke run" not in text
