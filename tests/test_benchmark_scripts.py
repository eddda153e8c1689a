"""benchmarks/ is a package whose scripts run as ``python -m benchmarks.<name>`` (issue 53):
none of it reaches for ``sys.path``, every script is accounted for (run by the run book, by
another test, or here at a tiny size), and the ones run here still import, take their
arguments and print their table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# Run here, at a tiny size: arguments, and a line of the output that says it measured. In the
# arguments, {tmp} is the test's folder, {qs} the quickstart data, {peer} a stand-in venv of the
# peer (tests/peer_stubs: LLM Foundry, lm-eval-harness; tests never install one from PyPI),
# {corpus} a small text file and {tasks} a one-task eval file on ../shared/eval_data.
TINY = {
    "cli_errors": (["--rounds", "1", "--cases", "eval: unknown key", "unknown flag",
                    "--data-root", "{tmp}/no-data"], "| eval: unknown key | 2 |"),
    "convert": (["--corpus", "{corpus}", "--copies", "2", "--rounds", "1", "--workers", "1",
                 "2", "--max-seq-len", "64", "--llmfoundry", "--venv", "{peer}", "--work",
                 "{tmp}/w"],
                ("| LLM Foundry, 2 processes |", "| tokenizer alone, 1 process |",
                 "(what the machine gives a second process): ")),
    "cpu_matmul": (["--rounds", "1"], "| loss weight grad |"),
    "dataloader": (["--data", "{qs}", "--batches", "2", "--steps", "1"],
                   "| finetuning, packed (512 tokens) |"),
    "eval_generate": (["--examples", "2", "--batch-size", "2", "--new-tokens", "4", "--rounds",
                       "1"], "Ratio: median"),
    "eval_vs_llmfoundry": (["--tasks", "{tasks}", "--examples", "16", "--max-seq-len", "256",
                            "--venv", "{peer}", "--work", "{tmp}/w"], "| arc_easy/0-shot |"),
    "eval_vs_lmeval": (["--tasks", "{tasks}", "--examples", "4", "--venv", "{peer}", "--work",
                        "{tmp}/w"], "| arc_easy/0-shot | 4 |"),
    "finetune_memory": (["--model", "tiny", "--configs", "lora-int8", "--procs", "2", "--steps",
                         "2"], '"config": "lora-int8", "procs": 2'),
    "hf_models": (["--sizes", "quickstart"], "| quickstart (1M params"),
    "kv_cache": (["--examples", "2", "--batch-size", "2", "--new-tokens", "4", "--rounds", "1"],
                 "DynamicCache / foundryx median"),
    "native_llama": (["--repeat", "1", "--new-tokens", "3", "--imports", "--work", "{tmp}/w"],
                     "| generate 4 rows x 3 new tokens"),
    "plan_accuracy": (["--procs", "1", "--cases", "lora-int8", "--steps", "1"],
                      "| lora-int8 | 1 |"),
    "plan_host": (["--repeats", "1", "--workers", "1"], "torch "),
    "plan_vs_run": (["--recipes", "finetune/mpt-lora.yaml", "--data", "{qs}"],
                    "| finetune/mpt-lora.yaml |"),
    "plot_results": (["--images", "{tmp}/images"], "planner-device.png ("),
    "remote": (["--data", "{qs}", "--rounds", "1", "--batches", "2"], "| s3 cold |"),
    "remote_checkpoint": (["--mb", "1", "--rounds", "1", "--steps", "4"],
                          "process loss / sync upload time"),
    "tp": (["--world", "2", "--models", "mpt", "--layouts", "2", "--act-seq", "0", "--steps",
            "2"], "| mpt | shard 1 x tp 2 |"),
    "vs_llmfoundry": (["--rounds", "1", "--batches", "2", "--no-compile", "--corpus", "{corpus}",
                       "--venv", "{peer}", "--work", "{tmp}/w"], "| 1 | foundryx, llmfoundry |"),
}
# Run here in-process (planner arithmetic only, no process of its own to start): arguments and
# the line that says it planned; {tmp}/peer-8k.json and -16k.json: two traces of the peer.
IN_PROCESS = {
    "long_context": (["--peer", "{tmp}/peer-8k.json", "{tmp}/peer-16k.json", "--sizes", "24 GB"],
                     '"gpu": "24 GB", "foundryx bf16": '),
    "plan_tables": (["--models", "8b"], "| 8. + activations (checkpointed)"),
}
# Run by the run book (benchmarks/gpu_runbook.sh: its dry run checks each one's arguments) or
# by another test at a tiny size.
ELSEWHERE = {
    "attention": "the run book, steps 5 and 8; tests/test_attention_table.py",
    "flagship": "the run book, step 2; tests/test_gpu_runbook.py (CPU mode, tiny shape)",
    "cp_estimate": "tests/test_cp_estimate.py (a tiny Llama at cp 2)",
    "flagship_estimate": "tests/test_step_instruments.py (docs/planning.md's commands); "
                         "tests/test_long_context.py (--recipe)",
    "flagship_vs_peer": "the run book, step 7; tests/test_flagship_vs_peer.py",
    "gpu_runbook.icl": "the run book, step 3; tests/test_gpu_runbook.py",
    "gpu_runbook.report": "the run book, every step",
    "load_memory": "the run book, step 2 (flagship.py writes its model with it)",
    "op_census": "tests/test_step_instruments.py, tests/test_op_census.py",
    "peer_lora": "the run book, step 7 (flagship_vs_peer.py); tests/test_flagship_vs_peer.py",
    "pinned_rounding": "tests/test_pinned_rounding.py",
    "train_throughput": "the run book, steps 6, 9 and 10; tests/test_train_throughput.py",
}
# Cases whose arguments need a fixture, and the cases make test runs on the modern leg (about
# half of this file's time; tests/conftest.py).
QUICKSTART = {"dataloader", "plan_vs_run", "remote"}
SHARED = {"eval_generate", "kv_cache", "eval_vs_llmfoundry", "eval_vs_lmeval",
          "native_llama"}  # ../shared
MODERN = {"cli_errors", "convert", "dataloader", "eval_vs_llmfoundry", "eval_vs_lmeval",
          "vs_llmfoundry"}
# The costliest tiny runs (multi-process training per case, 30-60 CPU s each) run under make
# test-long, not make test (CI time, 2026-11-29): plan_accuracy's and plan_vs_run's mechanism
# (a run beside its plan) is also finetune_memory's, run here; tp's layouts are
# tests/test_tp.py's.
LONG = {"plan_accuracy", "plan_vs_run", "tp"}
PEER_STUBS = Path(__file__).parent / "peer_stubs"


def modules() -> set[str]:
    """Every script of benchmarks/ as a module name under ``benchmarks.`` (not the packages'
    ``__init__``, not the shared instruments)."""
    found = set()
    for path in BENCHMARKS.rglob("*.py"):
        rel = path.relative_to(BENCHMARKS)
        if path.name == "__init__.py" or rel.parts[0] in ("instruments", "history"):
            continue
        found.add(".".join(rel.with_suffix("").parts))
    return found


def test_every_script_is_accounted_for_and_none_reaches_for_sys_path():
    listed = [*TINY, *IN_PROCESS, *ELSEWHERE]
    assert len(listed) == len(set(listed)), "a script listed twice"
    assert set(listed) == modules(), (
        f"not listed: {sorted(modules() - set(listed))}; gone: {sorted(set(listed) - modules())}")
    hacks = [str(p.relative_to(ROOT)) for p in BENCHMARKS.rglob("*.py")
             if "history" not in p.parts and "sys.path" in p.read_text()]
    assert hacks == [], f"these reach for sys.path: {hacks}; import benchmarks.<module> instead"
    for path in (BENCHMARKS / "__init__.py", BENCHMARKS / "instruments" / "__init__.py",
                 BENCHMARKS / "gpu_runbook" / "__init__.py"):
        assert path.is_file(), path


def peer_venv(folder: Path) -> Path:
    """A venv-shaped folder whose ``bin/python`` is this Python with the stand-in peers first on
    its path: what a script's ``--venv`` of LLM Foundry or lm-eval points at."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{PEER_STUBS}${{PYTHONPATH:+:$PYTHONPATH}}" '
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return folder


def one_task_file(folder: Path, shared: Path) -> Path:
    """eval/yamls/tasks.yaml's arc_easy at 0 shots, on ../shared/eval_data."""
    import yaml

    path = folder / "tasks.yaml"
    path.write_text(yaml.safe_dump({"icl_tasks": [{
        "label": "arc_easy", "dataset_uri": "world_knowledge/arc_easy.jsonl",
        "icl_task_type": "multiple_choice", "num_fewshot": [0],
        "continuation_delimiter": "\nAnswer: "}], "data_root": str(shared / "eval_data")}))
    return path


def _case(name: str):
    marks = [pytest.mark.needs_shared] if name in SHARED else []
    marks += [pytest.mark.modern_leg] if name in MODERN else []
    marks += [pytest.mark.long] if name in LONG else []
    return pytest.param(name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("name", [_case(n) for n in sorted(TINY)])
def test_the_script_runs_at_a_tiny_size(name, tmp_path, request):
    args, needle = TINY[name]
    places = {"tmp": str(tmp_path)}
    if name in SHARED:
        request.getfixturevalue("shared_dir")  # skips when ../shared is absent
        places["tasks"] = str(one_task_file(tmp_path, request.getfixturevalue("shared_dir")))
    if name in QUICKSTART:
        places["qs"] = str(request.getfixturevalue("quickstart_data"))
    if any("{peer}" in a for a in args):
        places["peer"] = str(peer_venv(tmp_path / "peer-venv"))
    if any("{corpus}" in a for a in args):
        from foundryx.data.synthetic import generate_corpus

        places["corpus"] = str(tmp_path / "corpus.txt")
        Path(places["corpus"]).write_text("\n\n".join(generate_corpus(400, seed=1)))
    args = [a.format(**places) for a in args]
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    for one in needle if isinstance(needle, tuple) else (needle,):
        assert one in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_the_planner_script_runs(name, tmp_path, monkeypatch, capsys):
    import importlib
    import json

    args, needle = IN_PROCESS[name]
    for seq, peak in ((8192, 12.0), (16384, 20.0)):  # flagship_estimate.py --sides peer's form
        (tmp_path / f"peer-{seq // 1024}k.json").write_text(
            json.dumps({"peer": {"seq": seq, "peak_gib": peak}}))
    args = [a.format(tmp=tmp_path) for a in args]
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", *args])
    assert importlib.import_module(f"benchmarks.{name}").main() in (None, 0)
    assert needle in capsys.readouterr().out
