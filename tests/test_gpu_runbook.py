"""benchmarks/gpu_runbook.sh: its dry run, its refusal without a GPU, its wheel list, a whole run
against a fake Python (every command answered with canned output) to check the report it
assembles and the time limits, the flagship benchmark's CPU mode on a tiny Llama, and the
install on a bare machine (only torch, Triton, transformers 5, peft and safetensors) from a
wheel folder built with `--wheel-list`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_runbook.sh"
NO_GPU = {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1"}  # even on a GPU machine
CACHE = Path.home() / ".cache" / "foundryx-bench"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def runbook(*args: str, python: str = sys.executable, script: Path = SCRIPT, **env: str):
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          cwd=script.parents[1], env={**os.environ, "PYTHON": python, **env},
                          timeout=600)  # fmt: skip


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_step_7s_sides_and_rounds_are_chosen_by_the_environment():
    """RUNBOOK_SIDES and RUNBOOK_ROUNDS reach step 7's command (the H200 run of 2026-11-29
    measured the peer against foundryx-full this way); without them, the default sides."""
    r = runbook("--only", "1,7", "--dry-run", RUNBOOK_SIDES="peer,foundryx-full", RUNBOOK_ROUNDS="3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--rounds 3 --steps 5 --sides peer,foundryx-full " in r.stdout
    r = runbook("--only", "1,7", "--dry-run")
    assert "--rounds 2 --steps 5 --sides peer,foundryx,foundryx-full " in r.stdout


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_dry_run_lists_the_steps_and_checks_files_and_flags(quick):
    r = runbook("--dry-run", *(["--quick"] if quick else []))
    assert r.returncode == 0, r.stdout + r.stderr
    for n in range(1, 11):
        assert f"[{n}/10]" in r.stdout
    assert "time limits: 90 230 30 60 40 50 360 150 240 300 s; steps 1,2,3,4,5,6: 500 s in all" in r.stdout
    assert "the time limits of steps 1,2,3,4,5,6 add up to at most 500 s (500)" in r.stdout
    assert "-m benchmarks.flagship_vs_peer --device cuda --shape " in r.stdout
    assert "--rounds 2 --steps " + ("3" if quick else "5") in r.stdout
    assert "-m benchmarks.flagship --device cuda --shape " in r.stdout
    assert "--bases bf16,fp8,nf4 --offload 0,0.5" in r.stdout
    assert "-m benchmarks.gpu_runbook.icl --out" in r.stdout
    assert "-m pytest" in r.stdout and "tests/test_triton_attention.py" in r.stdout
    assert "-k 'not test_every_combination'" in r.stdout
    assert "-m benchmarks.attention" in r.stdout and "-m benchmarks.train_throughput gpu" in r.stdout
    assert "-m venv --without-pip" in r.stdout and "--no-deps --no-index" in r.stdout
    assert "FAIL " not in r.stdout and ", 0 failed" in r.stdout
    for flag in ("--shape", "--bases", "--offload", "--steps", "--time-limit", "--settings",
                 "--models", "--seqs", "--out", "--rounds", "--profiles", "--table", "--profile",
                 "fp8-rowwise", "sel-compile"):
        assert f"accepts {flag}" in r.stdout, flag
    assert "every name in benchmarks/gpu_runbook/wheels.txt has a pin" in r.stdout
    assert ("llama-3.1-8b" in r.stdout) != quick and ("shapes/llama-tiny" in r.stdout) == quick
    step6 = "--models 125m --settings eager --batches 8" if quick else "--models 1b --settings eager --batches 15"
    assert step6 in r.stdout


def test_step_5_times_both_triton_backwards_when_asked():
    """RUNBOOK_BWD (issue 47): step 5 passes --bwd to attention.py, which accepts it."""
    r = runbook("--dry-run", "--only", "1,5", RUNBOOK_BWD="split atomic",
                RUNBOOK_LIMITS="90 230 30 60 100 50 360 150 240 300")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-m benchmarks.attention --seqs 4096 --head-dims 128 --no-mpt --bwd split atomic" \
        in r.stdout
    assert "ok    benchmarks.attention accepts --bwd" in r.stdout
    assert "--bwd" not in runbook("--dry-run").stdout


def test_a_limit_that_does_not_fit_fails_the_dry_run():
    r = runbook("--dry-run", RUNBOOK_LIMITS="100 300 35 60 45 50 360 150 240 300")
    assert r.returncode == 1
    assert "FAIL  the time limits of steps 1,2,3,4,5,6 add up to at most 500 s (590)" in r.stdout
    assert runbook("--dry-run", RUNBOOK_LIMITS="1 2 3").returncode == 2
    # the side-by-side (step 7) goes with step 1 in a loan of its own, not with the flagship
    assert "ok    the time limits of steps 1,7 add up to at most 500 s (450)" in \
        runbook("--dry-run", "--only", "1,7").stdout
    r = runbook("--dry-run", "--only", "1,2,7")
    assert r.returncode == 1 and "FAIL  the time limits of steps 1,2,7 add up" in r.stdout
    assert runbook("--dry-run", "--only", "11").returncode == 2
    # issue 47's steps: the attention table and MPT-1B compiled in one loan, the sizes in another
    assert "ok    the time limits of steps 1,8,9 add up to at most 500 s (480)" in \
        runbook("--dry-run", "--only", "1,8,9").stdout
    assert "ok    the time limits of steps 1,10 add up to at most 500 s (390)" in \
        runbook("--dry-run", "--only", "1,10").stdout


def test_issue_47_steps_in_the_dry_run():
    r = runbook("--dry-run", "--only", "1,8,9")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-m benchmarks.attention --seqs 2048 --head-dims 64 128 --table <tmp>/attention-table.json" in r.stdout
    assert ("-m benchmarks.train_throughput gpu --models 1b --settings compile sel-compile fp8-rowwise "
            "fp8-tensorwise --batches 12 --warmup 4 --profile ") in r.stdout
    assert ("benchmarks.train_throughput gpu --models 125m 350m --settings eager compile ac-compile "
            "sel-compile") in r.stdout


def test_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "report.md"
    r = runbook("--out", str(out), **NO_GPU)
    assert r.returncode == 2
    assert r.stderr.strip() == "no CUDA or ROCm GPU visible to torch; this run book needs one"
    assert not out.exists()


def test_bad_arguments_and_wheel_list():
    assert runbook("--bogus").returncode == 2
    r = runbook("--wheel-list")
    assert r.returncode == 0, r.stderr
    pins = dict(line.split("==") for line in r.stdout.split())
    names = {n.lower() for n in pins}
    assert {"mosaicml", "transformers", "tokenizers", "huggingface_hub", "peft", "torchao",
            "pytest", "pytest-timeout", "setuptools", "mosaicml-cli", "torchvision",
            "mosaicml-streaming", "zstd"} <= names  # foundryx's CLI refuses to start without streaming
    assert pins["transformers"] == "4.57.6" and pins["torchvision"] == "0.26.0"  # torch 2.11
    # the machine's own, and what no step imports
    assert not names & {"torch", "triton", "safetensors", "numpy", "ruff", "ziglang", "wandb",
                        "pyarrow", "datasets", "matplotlib", "boto3"}
    assert not any(n.startswith("nvidia-") for n in names)
    constraints = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split())
    # wheels.txt's own pin: constraints.txt's zstd has no cp312 wheel
    assert pins["zstd"] == "1.5.6.1"
    assert all(constraints[n] == v for n, v in pins.items() if n not in ("torchvision", "zstd"))
    assert runbook("--wheel-list", "--torch", "2.7.0").stdout.split()[-1] == "torchvision==0.22.0"
    assert runbook("--wheel-list", "--torch", "2.14.1").stdout.split()[-1] == "torchvision==0.29.1"
    bad = runbook("--wheel-list", "--torch", "nightly")
    assert bad.returncode == 1 and "--torch nightly is not a torch 2.N[.P] version" in bad.stderr


FAKE_PYTHON = r"""
import json, os, sys, time
from pathlib import Path
args, state = sys.argv[1:], Path(os.environ["FAKE_STATE"])
venv = os.environ.get("FAKE_VENV")
with (state / "calls").open("a") as f:
    f.write(("venv: " if venv else "") + " ".join(args) + "\n")
given = list(args)
if args[:1] == ["-m"] and args[1].startswith("benchmarks."):  # a benchmark: matched by its file
    args = [args[1].replace(".", "/") + ".py", *args[2:]]
def value(flag):
    return next(a.split("=", 1)[1] if "=" in a else args[i + 1]
                for i, a in enumerate(args) if a.split("=")[0] == flag)
if args[0] == "-c":  # the GPU probe
    sys.exit(0)
if args[:2] == ["-m", "venv"]:
    bin = Path(args[-1]) / "bin"
    bin.mkdir(parents=True)
    (bin / "python").write_text(f'#!/bin/sh\nFAKE_VENV=1 exec "{sys.executable}" "{__file__}" "$@"\n')
    (bin / "python").chmod(0o755)
elif args[:2] == ["-m", "pip"]:
    (state / ("editable" if "-e" in args else "installed")).touch()
elif args[0].endswith("report.py") and args[1] == "probe":
    if venv and (state / "installed").exists() and (state / "editable").exists():
        print("all import")
        sys.exit(0)
    print("composer, transformers 5.17.0 (foundryx needs transformers<5,>=4.45)")
    sys.exit(1)
elif args[0].endswith("report.py") and args[1] == "sites":
    print("/machine/site-packages\n/machine/user site")
elif args[0].endswith("report.py") and args[1] == "machine-pth":
    print(args[2:])
elif args[0].endswith("report.py") and args[1] == "env":
    print("- GPU: Fake H100")
elif args[0].endswith("report.py"):
    os.execv(sys.executable, [sys.executable, *given])
elif args[0].endswith("flagship.py"):
    Path(value("--out")).write_text(
        "| base | offload | tokens/s |\n|---|---|---|\n| bf16 | 0 | 5,000 |\n")
    time.sleep(float(os.environ.get("FAKE_FLAGSHIP_SLEEP", "0")))
elif args[0].endswith("flagship_vs_peer.py"):
    with (state / "calls").open("a") as f:
        f.write(f"PYTHONPATH={os.environ.get('PYTHONPATH')}\n")
    prof = Path(value("--profiles"))
    prof.mkdir(parents=True, exist_ok=True)
    for side in ("peer", "foundryx"):
        (prof / f"{side}-kernels.md").write_text("| kernel | calls |\n")
    Path(value("--out")).write_text(
        "| side | tokens/s | vs peer |\n|---|---|---|\n| peer | 6,500 | n/a |\n| foundryx | 5,800 | 0.89 |\n")
elif args[0].endswith("icl.py"):
    Path(value("--out")).write_text("All 5 results are the same on cpu and gpu.\n")
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
    if "--table" in args:
        Path(value("--table")).write_text('[{"device": "Fake H100", "mask": "docs"}]\n')
    with open(value("--out"), "a") as f:
        f.write("\n## Attention kernels on Fake (today)\n\n| head_dim | fwd triton |\n|---|---|\n| 64 | 321 |\n")
elif args[0].endswith("train_throughput.py") and value("--out").endswith("throughput.json"):
    assert value("--models") == "1b" and value("--settings") == "eager", args
    rows = [{"case": "MPT-1B, no AC, eager", "tokens_per_sec": 1000.0, "mfu": 0.4}]
    Path(value("--out")).write_text(json.dumps(rows))
elif args[0].endswith("train_throughput.py"):  # issue 47's steps 9 and 10
    rows = [{"case": "MPT-1B, no AC, compile", "tokens_per_sec": 2000.0, "mfu": 0.5},
            {"case": "MPT-1B, no AC, compile, float8 rowwise", "tokens_per_sec": float("nan"),
             "mfu": float("nan"), "error": "float8.enabled: true cannot run here"}]
    if "--profile" in args:
        folder = Path(value("--profile"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mpt-1b-no-ac-compile.txt").write_text("one step: 400.0 ms of GPU time\n 30.0% sm90_gemm\n")
    Path(value("--out")).write_text(json.dumps(rows))
else:
    sys.exit(f"fake python: unexpected {args}")
"""


def fake_python(tmp_path: Path) -> Path:
    (tmp_path / "fake.py").write_text(textwrap.dedent(FAKE_PYTHON))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake.py"}" "$@"\n')
    python.chmod(0o755)
    return python


def fake_gpu_run(tmp_path: Path, only: str, **env: str):
    """The run book's ``--only`` steps on a fake GPU (the fake Python), with a wheel folder and
    its own venv under ``tmp_path``: (the completed process, the report's path)."""
    python = fake_python(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "composer.whl").touch()
    out = tmp_path / "report.md"
    r = runbook("--out", str(out), "--only", only, "--wheels", str(wheels), "--venv",
                str(tmp_path / "venv"), python=str(python), FAKE_STATE=str(tmp_path),
                TMPDIR=str(tmp_path), **env)
    return r, out


def test_a_run_on_a_fake_gpu_records_every_step(tmp_path):
    python = fake_python(tmp_path)
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    wheels.mkdir()
    (wheels / "composer.whl").touch()
    (wheels / "wheel-list.txt").touch()  # not a package: left out
    out = tmp_path / "report.md"
    r = runbook("--out", str(out), "--wheels", str(wheels), "--venv", str(venv),
                python=str(python), FAKE_STATE=str(tmp_path), TMPDIR=str(tmp_path),
                TRITON_INTERPRET="1", RUNBOOK_LIMITS="60 3 35 60 45 50 60 60 60 60",
                FAKE_FLAGSHIP_SLEEP="30")  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "[3/10] ICL eval on the GPU against the CPU ... (limit 35 s, ~26 s; log: " in r.stderr
    text = out.read_text()
    calls = (tmp_path / "calls").read_text()
    # step 1: the machine's Python lacks Composer and has transformers 5: the run book's own
    # venv over the machine's packages, the wheel folder, then foundryx (editable)
    assert f"-m venv --without-pip {venv}\n" in calls
    assert "venv: -m benchmarks.gpu_runbook.report machine-pth /machine/site-packages " \
           "/machine/user site\n" in calls
    assert (f"venv: -m pip install --no-deps --no-index --no-compile --find-links {wheels} "
            f"{wheels}/composer.whl\n") in calls
    assert "venv: -m pip install --no-deps --no-index --no-build-isolation -e .\n" in calls
    assert (f"- Dependencies: installed from {wheels} (1 files) into the run book's venv {venv}, "
            f"over the packages of {python}") in text
    assert f"- Python: {venv}/bin/python" in text
    assert "### 1. environment: ok, 0 min" in text and "Fake H100" in text
    # every later step runs with the venv's Python
    later = [c for c in calls.splitlines() if "benchmarks.flagship" in c or "benchmarks.gpu_runbook.icl" in c
             or "-m pytest" in c or "benchmarks.attention" in c or "benchmarks.train_throughput" in c]
    assert len(later) == 5 and all(c.startswith("venv: ") for c in later), later
    # step 2 ran past its limit: stopped there, its finished rows kept, the next step ran
    assert "### 2. flagship: Llama-3.1-8B shape, LoRA over bf16 / FP8 / NF4 bases, offload 0 " \
           "/ 0.5: FAILED (timed out at its limit of 3 s)" in text
    assert "| bf16 | 0 | 5,000 |" in text and "**Stopped at the step's limit of 3 s**" in text
    assert "### 3. ICL eval on the GPU against the CPU: ok" in text
    assert "All 5 results are the same on cpu and gpu." in text
    assert "### 4. Triton kernel tests on the GPU: FAILED (exit 1)" in text
    assert "**2 passed, 1 failed, 0 errors, 0 skipped**" in text and "`t::bad`" in text
    assert "### 5. attention TFLOP/s table: ok" in text and "| 64 | 321 |" in text
    assert "## Attention kernels on" not in text  # its heading is the run book's
    assert "### 6. MPT-1B tokens/s and MFU: ok" in text
    assert "| MPT-1B | no AC, eager | 1,000 | 1.00x | 40.0% |" in text
    assert "### 7. foundryx vs plain transformers + peft: 8B LoRA, bf16 base, side by side, " \
           "profiled: skipped (--only 1,2,3,4,5,6)" in text
    assert "### 9. MPT-1B compiled: no AC, selective AC, float8; one step profiled: skipped" in text
    assert "Steps failed: 2 of 10. Total 0 min" in text.rstrip().splitlines()[-1]
    assert "TRITON_INTERPRET=None" in calls and "smoke run" not in text

    # a second run finds the venv ready: nothing made or installed again
    before = calls.count("-m pip install")
    r = runbook("--install-only", "--venv", str(venv), python=str(python),
                FAKE_STATE=str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"Dependencies: all import in the run book's venv {venv} (made by an earlier run)" in r.stdout
    assert (tmp_path / "calls").read_text().count("-m pip install") == before


def test_the_side_by_side_runs_on_the_machines_transformers(tmp_path):
    """Step 7 (`--only 1,7`) after step 1 made the run book's venv: the side-by-side runs with
    the machine Python's site-packages first on PYTHONPATH (its transformers 5.x, not the
    venv's 4.57), the peer and foundryx with and without issue 51's fused path, and its
    profiles come back beside the report."""
    r, out = fake_gpu_run(tmp_path, "1,7", PYTHONPATH="")
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text()
    (line,) = [c for c in calls.splitlines() if "benchmarks.flagship_vs_peer" in c]
    assert line.startswith("venv: -m benchmarks.flagship_vs_peer --device cuda --shape "
                           "yamls/shapes/llama-3.1-8b --rounds 2 --steps 5 --sides "
                           "peer,foundryx,foundryx-full --time-limit 350 ")
    assert f"--profiles {tmp_path}/report-profiles " in line
    assert "PYTHONPATH=/machine/site-packages:/machine/user site\n" in calls
    text = out.read_text()
    assert "### 7. foundryx vs plain transformers + peft: 8B LoRA, bf16 base, side by side, " \
           "profiled: ok" in text
    assert "| foundryx | 5,800 | 0.89 |" in text
    assert "PYTHONPATH first: /machine/site-packages:/machine/user site." in text
    assert f"Profile files in {tmp_path}/report-profiles: foundryx-kernels.md peer-kernels.md." in text
    assert "### 2. flagship: Llama-3.1-8B shape" in text and "skipped (--only 1,7)" in text
    assert (tmp_path / "report-profiles" / "peer-kernels.md").is_file()


def test_install_only_without_a_wheel_folder_says_so(tmp_path):
    python = fake_python(tmp_path)
    r = runbook("--install-only", "--wheels", str(tmp_path / "none"), "--venv",
                str(tmp_path / "venv"), python=str(python), FAKE_STATE=str(tmp_path))  # fmt: skip
    assert r.returncode == 1
    assert "missing: composer, transformers 5.17.0 (foundryx needs transformers<5,>=4.45); " \
           f"no wheel folder {tmp_path / 'none'}" in r.stdout
    assert not (tmp_path / "venv").exists()


@pytest.mark.slow
def test_flagship_trains_a_tiny_llama_on_cpu(tmp_path):
    """benchmarks/flagship.py's CPU mode, end to end: the model folder written (sharded bf16
    safetensors with an index), then a fresh `foundryx train` of the large-model recipe per
    base, each row with tokens/s, peak host memory and the plan's, and the load."""
    out, raw = tmp_path / "flagship.md", tmp_path / "flagship.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.flagship", "--device", "cpu", "--shape",
         "benchmarks/gpu_runbook/shapes/llama-tiny", "--bases", "fp8,nf4", "--offload", "0.5",
         "--steps", "2", "--cache", str(tmp_path / "model"), "--logs", str(tmp_path / "logs"),
         "--json", str(raw), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    folder = tmp_path / "model"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2 and (folder / "tokenizer.json").is_file()
    rows = json.loads(raw.read_text())["rows"]
    assert [(row["base"], row["offload"]) for row in rows] == [("fp8", 0.5), ("nf4", 0.5)]
    for row in rows:
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and len(row["losses"]) == 2
        assert all(x == x for x in row["losses"])  # finite
        assert row["load_bytes"] > 0 and row["load_s"] > 0
        assert 0.5 < row["vmhwm_gib"] / row["plan_host_gib"] < 2, row  # the plan's, wired
    text = out.read_text()
    assert "| fp8 | 0.5 |" in text and "| nf4 | 0.5 |" in text and "host / plan" in text
    log = (tmp_path / "logs" / "flagship-nf4-offload0.5.log").read_text()
    assert "stored as nf4" in log and "offloaded to host memory" in log


@pytest.mark.slow
def test_icl_check_compares_two_devices(tmp_path):
    """benchmarks/gpu_runbook/icl.py, the run book's step 3, with the CPU on both sides."""
    out = tmp_path / "icl.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_runbook.icl", "--devices", "cpu", "cpu",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "| facts_mc/0-shot |" in text and "| gauntlet/average |" in text
    assert "All 5 results are the same on cpu and cpu." in text


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def machine_python(home: Path) -> Path:
    """A Python like the GPU machine's: a venv that sees only torch, Triton and torch's own
    requirements (symlinked from this environment: no download of torch), plus transformers
    5.17, peft and safetensors installed from PyPI (with their requirements). Cached."""
    import importlib.metadata as md

    import torch
    from packaging.requirements import Requirement

    marker = home / ".ready"
    want = f"{sys.prefix} {torch.__version__}"
    if marker.is_file() and marker.read_text() == want:
        return home / "bin" / "python"
    shutil.rmtree(home, ignore_errors=True)
    links = home / "torch-packages"
    links.mkdir(parents=True)
    todo, seen = ["torch"], set()
    while todo:  # torch and its requirements, as installed here
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "bin")}:
            if not (links / top).exists() and (site / top).exists():
                (links / top).symlink_to(site / top)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(home)], check=True)
    python = home / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "torch-packages.pth").write_text(f"{links}\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "transformers==5.17.0", "peft",
                    "safetensors"], check=True, timeout=600)
    marker.write_text(want)
    return python


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the run book's machines are Linux")
def test_wheel_folder_installs_on_a_bare_machine(tmp_path):
    """The wheel list, downloaded (`pip download --no-deps`), installed by the run book's step 1
    (`--install-only`) on a Python with only torch, Triton, transformers 5.17, peft and
    safetensors: every module the steps import then imports, in the run book's own venv, and
    `foundryx --help` runs; the machine's Python is left as it was."""
    if not pypi_reachable():
        pytest.skip("PyPI is unreachable: this test downloads the wheel folder and the bare "
                    "machine's transformers 5.17")
    import torch

    machine = machine_python(CACHE / f"bare-machine-py{sys.version_info[0]}{sys.version_info[1]}")
    # a copy of the checkout: the editable install writes into it, not into this one
    repo = tmp_path / "repo"
    for part in ("pyproject.toml", "README.md", "constraints.txt", "foundryx",
                 "benchmarks/__init__.py", "benchmarks/gpu_runbook.sh", "benchmarks/gpu_runbook"):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (repo / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / part, repo / part)
    script = repo / "benchmarks" / "gpu_runbook.sh"
    listed = runbook("--wheel-list", "--torch", torch.__version__.split("+")[0], script=script)
    assert listed.returncode == 0, listed.stderr
    # the folder, downloaded once per list (kept under ~/.cache/foundryx-bench)
    wheels = CACHE / f"wheels-py{sys.version_info[0]}{sys.version_info[1]}-gpu-runbook"
    done = wheels / ".list"
    if not (done.is_file() and done.read_text() == listed.stdout):
        shutil.rmtree(wheels, ignore_errors=True)
        (tmp_path / "wheel-list.txt").write_text(listed.stdout)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels),
                        "--no-deps", "-r", str(tmp_path / "wheel-list.txt")], check=True, timeout=600)
        done.write_text(listed.stdout)
    size = sum(f.stat().st_size for f in wheels.glob("*") if f.name != ".list")
    assert size < 60e6, f"the wheel folder is {size / 1e6:.1f} MB"

    venv = tmp_path / "venv"
    r = runbook("--install-only", "--wheels", str(wheels), "--venv", str(venv), python=str(machine),
                script=script, RUNBOOK_LIMITS="300 230 35 60 45 50 360 150 240 300")  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"Python: {venv}/bin/python" in r.stdout and "into the run book's venv" in r.stdout
    probe = subprocess.run([str(venv / "bin" / "python"), "-m", "benchmarks.gpu_runbook.report", "probe"],
                           cwd=repo, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.strip() == "all import", probe.stdout + probe.stderr
    cli = subprocess.run([str(venv / "bin" / "foundryx"), "--help"], capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0 and "usage: foundryx" in cli.stdout, cli.stderr
    versions = "import torch, transformers; print(torch.__version__, transformers.__version__)"
    mine = subprocess.run([str(venv / "bin" / "python"), "-c", versions], capture_output=True,
                          text=True, timeout=300).stdout.split()
    theirs = subprocess.run([str(machine), "-c", versions], capture_output=True, text=True,
                            timeout=300).stdout.split()
    assert mine == [torch.__version__, "4.57.6"], mine  # the machine's torch, foundryx's transformers
    assert theirs == [torch.__version__, "5.17.0"], theirs  # the machine's Python untouched


def test_issue_47_steps_on_a_fake_gpu(tmp_path):
    """Steps 8-10 (`--only 1,8,9,10`): the attention table's rows as JSON in the report, the
    MFU rows with a failed case's reason and the formula, one step's top kernels."""
    r, out = fake_gpu_run(tmp_path, "1,8,9,10")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "### 8. attn_impl auto's attention table for this GPU: ok" in text
    assert '[{"device": "Fake H100", "mask": "docs"}]' in text and "--apply-table rows.json" in text
    assert "### 9. MPT-1B compiled: no AC, selective AC, float8; one step profiled: ok" in text
    assert "| MPT-1B | no AC, compile | 2,000 | 1.00x | 50.0% |" in text
    assert "- MPT-1B, no AC, compile, float8 rowwise failed: float8.enabled: true cannot run here" in text
    assert "flops_per_batch = 3 * b * (2 * N * s + 4 * n_layers * d_model * s^2)" in text
    assert "Top kernels of one step, mpt-1b-no-ac-compile" in text and "30.0% sm90_gemm" in text
    assert (tmp_path / "report-mfu-profiles" / "mpt-1b-no-ac-compile.txt").is_file()
    assert "### 10. MFU table: MPT-125M and 350M, eager / compiled / AC / selective AC: ok" in text
    assert "Steps failed: 0 of 10." in text
