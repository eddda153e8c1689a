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

# Run here, at a tiny size: arguments, and a line of the output that says it measured.
TINY = {
    "cpu_matmul": (["--rounds", "1"], "| loss weight grad |"),
    "eval_generate": (["--examples", "2", "--batch-size", "2", "--new-tokens", "4", "--rounds",
                       "1"], "Ratio: median"),
    "hf_models": (["--sizes", "quickstart"], "| quickstart (1M params"),
    "kv_cache": (["--examples", "2", "--batch-size", "2", "--new-tokens", "4", "--rounds", "1"],
                 "DynamicCache / foundryx median"),
    "plan_host": (["--repeats", "1", "--workers", "1"], "torch "),
    "remote_checkpoint": (["--mb", "1", "--rounds", "1", "--steps", "4"],
                          "process loss / sync upload time"),
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
# Not run by any test or by the run book yet (issue 53 left them, each with what it needs):
# each is to get a tiny case above or be deleted.
NOT_RUN = {
    "cli_errors": "times every command-line mistake; minutes at its smallest",
    "convert": "reads ../shared/corpus",
    "dataloader": "a quickstart training step beside its loaders",
    "eval_vs_llmfoundry": "LLM Foundry 0.22 in its own venv (installed from PyPI)",
    "eval_vs_lmeval": "lm-eval-harness in its own venv (installed from PyPI)",
    "finetune_memory": "a 130M-parameter MPT on 1-2 processes",
    "host_trace": "2 ranks of a LoRA recipe",
    "legs": "both venvs (torch 2.7 and 2.15)",
    "long_context": "the 8B traces it reads take minutes each; its arithmetic: "
                    "tests/test_long_context.py",
    "plan_accuracy": "training runs on 1-2 processes per case",
    "plan_tables": "the planner's tables of the 405B, 70B and 8B models (about 3 minutes)",
    "plan_vs_run": "every finetune recipe on 2 ranks",
    "plot_results": "matplotlib; writes benchmarks/images/",
    "remote": "an S3 API server on localhost",
    "rss_steps": "2 ranks, more than 10 steps (3 minutes at its smallest); writes "
                 "benchmarks/images/",
    "tp": "4 processes per layout",
    "vs_llmfoundry": "LLM Foundry 0.22 in its own venv (installed from PyPI)",
}


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
    listed = [*TINY, *ELSEWHERE, *NOT_RUN]
    assert len(listed) == len(set(listed)), "a script listed twice"
    assert set(listed) == modules(), (
        f"not listed: {sorted(modules() - set(listed))}; gone: {sorted(set(listed) - modules())}")
    hacks = [str(p.relative_to(ROOT)) for p in BENCHMARKS.rglob("*.py")
             if "history" not in p.parts and "sys.path" in p.read_text()]
    assert hacks == [], f"these reach for sys.path: {hacks}; import benchmarks.<module> instead"
    for path in (BENCHMARKS / "__init__.py", BENCHMARKS / "instruments" / "__init__.py",
                 BENCHMARKS / "gpu_runbook" / "__init__.py"):
        assert path.is_file(), path


SHARED = {"eval_generate", "kv_cache"}  # read ../shared/eval_data


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.needs_shared) if n in SHARED
                                  else n for n in sorted(TINY)])
def test_the_script_runs_at_a_tiny_size(name, tmp_path, request):
    if name in SHARED:
        request.getfixturevalue("shared_dir")  # skips when ../shared is absent
    args, needle = TINY[name]
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert needle in r.stdout, r.stdout[-3000:]
