"""Tensor parallelism as docs/distributed.md tells a new user to find and run it (issue 39,
item 8): the 2-CPU-process command of "Tensor parallelism: running it", run as printed (only
the data folder and the output paths are added), and the two commands that section names for
looking around (`--help-config parallelism`, `foundryx plan ... parallelism.tp=2`), each as a
user runs it, in a subprocess. The run is also the 2-process run of item 10: its output holds
none of the known-harmless warnings that used to leak."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.config.schema import ParallelismConfig
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "distributed.md"


def _section() -> str:
    text = DOC.read_text()
    return text.split("## Tensor parallelism: running it", 1)[1].split("\n## ", 1)[0]


def _inline(prefix: str) -> str:
    """The inline command of the section that starts with ``prefix`` (joined over the line
    break a wrapped paragraph puts in it)."""
    prose = re.sub(r"```.*?```", "", _section(), flags=re.S)  # code blocks out
    found = [" ".join(m.split()) for m in re.findall(r"`([^`]+)`", prose)
             if " ".join(m.split()).startswith(prefix)]
    assert found, f"docs/distributed.md names no `{prefix}...` command"
    return found[0]


def _cli(argv: list[str], **kw) -> subprocess.CompletedProcess:
    assert argv[0] == "foundryx", argv
    return subprocess.run([sys.executable, "-m", "foundryx.cli", *argv[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, **kw)


def test_help_config_lists_the_sections_that_are_not_registries():
    r = _cli(["foundryx", "train", "--help-config"])
    assert r.returncode == 0, r.stderr
    for f in dataclasses.fields(ParallelismConfig):  # every key of the section, with its doc
        assert f"\nparallelism.{f.name}: " in r.stdout, f.name
    assert "sections with their own keys" in r.stdout and "parallelism" in r.stdout
    assert "activation_checkpointing.every: " in r.stdout and "compile.enabled: " in r.stdout
    assert "--help-config frozen_base" in r.stdout


@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
def test_help_config_parallelism_as_the_docs_print_it():
    argv = shlex.split(_inline("foundryx train --help-config parallelism"))
    r = _cli(argv)
    assert r.returncode == 0, r.stderr
    assert "no registry has an entry" not in r.stdout + r.stderr
    assert r.stdout.startswith("# parallelism: ")
    assert "tensor parallelism" in r.stdout.splitlines()[0]
    for f in dataclasses.fields(ParallelismConfig):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"parallelism.{f.name}: "))
        assert f.metadata["doc"] in r.stdout, (f.name, line)
    one = _cli(["foundryx", "train", "--help-config", "parallelism.tp"])
    assert one.returncode == 0 and one.stdout.startswith("parallelism.tp: an integer [1]")
    frozen = _cli(["foundryx", "train", "--help-config", "frozen_base"])
    assert frozen.returncode == 0, frozen.stderr
    assert "model.frozen_base.dtype: " in frozen.stdout
    assert "model.frozen_base.offload_fraction: " in frozen.stdout
    bad = _cli(["foundryx", "train", "--help-config", "paralelism"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "no config section, model option or registry entry" in bad.stderr


def test_plan_of_a_tp_only_run_says_what_it_does():
    """The planner on 2 devices at tp 2: tensor parallel over both, nothing sharded, the TP
    traffic in a unit that shows it, and why there is no time for it on CPU."""
    argv = shlex.split(_inline("foundryx plan yamls/quickstart.yaml parallelism.tp=2"))
    r = _cli(argv)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    head = out.splitlines()[0]
    assert "2 x cpu, tensor parallel over 2 devices (sequence parallel), no sharding" in head
    assert "one device" not in out and "ZeRO stage" not in out
    assert "by sharding: nothing to shard over (TP 2 splits the layers over all 2 devices" in out
    tp = next(ln for ln in out.splitlines() if ln.strip().startswith("tensor parallel "))
    assert re.search(r"\d+\.\d MB   TP 2: .*; \d+\.\d MB sent, no time estimate \(no link rate "
                     r"for cpu devices\)$", tp), tp
    assert "0.0 GB" not in tp and " - within" not in tp


def test_plan_of_tp_on_gpus_shards_over_the_data_parallel_ranks(capsys, monkeypatch):
    """The 8B LoRA recipe at tp 2: on 2 H100s nothing is sharded and the TP collectives get a
    time; on 8, FSDP2 shards over the 4 data-parallel ranks (not over 8); on 2 CPU processes
    that do not fit, no fix offers to shard where tp takes every device."""
    from foundryx.cli import main

    monkeypatch.chdir(ROOT)
    shape = ["variables.model_path=yamls/shapes/llama-3.1-8b", "parallelism.tp=2"]
    assert main(["plan", "yamls/finetune/llama-8b-lora-fp8.yaml", *shape, "--gpus", "2",
                 "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "2 x h100, tensor parallel over 2 devices (sequence parallel), no sharding" in out
    assert re.search(r"[\d,.]+ GB sent, \d+\.\d\d s within the node \(exposed\)", out), out
    assert "ZeRO stage" not in out
    assert main(["plan", "yamls/finetune/llama-8b-lora-fp8.yaml", *shape, "--gpus", "8",
                 "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "8 x h100, FSDP2 over 4 x TP 2 (sequence parallel)" in out
    assert "by sharding over 4 data-parallel ranks (ZeRO stage): " in out
    main(["plan", "yamls/finetune/llama-lora.yaml", *shape, "--gpus", "2"])
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "sharding_strategy=FULL_SHARD" not in out


@pytest.mark.slow
def test_the_docs_tp_command_trains_on_two_cpu_processes(quickstart_data, tmp_path):
    """`composer -n 2 train.py yamls/quickstart.yaml parallelism.tp=2 ...` as the docs print
    it: exit 0, the derived numbers and the summary line the docs quote, a falling loss; and
    no known-harmless warning from the ranks (streaming's `replication` reminder, torchao's
    import line, transformers' `torch_dtype`)."""
    blocks = re.findall(r"```bash\n(.*?)```", _section(), re.S)
    command = next(b for b in blocks if b.startswith("composer -n 2 "))
    argv = shlex.split(command.strip())
    assert argv[:4] == ["composer", "-n", "2", "train.py"] and "parallelism.tp=2" in argv
    composer = shutil.which("composer", path=str(Path(sys.executable).parent))
    cmd = [composer, *argv[1:3], "--stdout", str(tmp_path / "rank{rank}.out"),
           "--stderr", str(tmp_path / "rank{rank}.err"), *argv[3:],
           f"variables.data_root={quickstart_data}", f"save_folder={tmp_path}/ckpt",
           f"loggers.jsonl.path={tmp_path}/metrics.jsonl"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # local rank 0 writes to the launcher's own streams, rank 1 to the files
    ranks = "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.*")))
    said = r.stdout + r.stderr
    assert r.returncode == 0, (said[-3000:], ranks[-3000:])
    assert re.search(r"tensor_parallel\s+2\n", said) and re.search(r"data_parallel_ranks\s+1\n", said)
    quoted = " ".join(re.search(r"summary line `(parallelism: [^`]+)`", _section()).group(1).split())
    assert quoted in said, said[-3000:]
    losses = [row["loss/train/total"] for row in read_metrics(tmp_path / "metrics.jsonl")
              if "loss/train/total" in row]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.5, losses
    for text in (said, ranks):
        assert "The `replication` arg has been set" not in text
        assert "`torch_dtype` is deprecated" not in text
        assert "Traceback" not in text
    # torchao's import line: none from the ranks; the composer launcher process, which
    # imports transformers (and through it torchao) before any foundryx code runs, may print
    # it once (docs/operations.md, "Filtered warnings")
    assert "Skipping import of cpp extensions" not in ranks
    assert said.count("Skipping import of cpp extensions") <= 1, said[-3000:]
