"""The machine a plan is for: a recipe states its node (``node:``), and ``foundryx plan`` and
``--dry-run`` plan for it on a machine without a GPU (a cluster's login node); a model folder
that is not on this machine is planned from the matching shape in ``yamls/shapes/``, said in
one note. A dry run checks the config for the machine the run will have: what this machine
cannot run is a note (exit 0), a plan that does not fit is a problem (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.errors import ConfigError
from foundryx.plan.node import machine, shape_override

ROOT = Path(__file__).parents[1]
NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
R405 = "yamls/finetune/llama-3.1-405b-lora-fp8.yaml"
R70 = "yamls/finetune/llama-3.1-70b-lora.yaml"


def foundryx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundryx.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **NO_GPU})


def test_flags_win_and_the_node_fills_the_rest():
    node = {"gpu": "h100", "gpus": 8, "host_memory": "2TB"}
    m = machine(node, None, None, None, None)
    assert (m.gpu, m.gpus, m.nodes, m.host_memory, m.host_source) == ("h100", 8, 1, "2TB", "node.host_memory")
    assert m.note.startswith("the recipe's node: gpu h100, gpus 8, host memory 2TB")
    m = machine(node, "a100-80gb", 4, 2, "1TB")
    assert (m.gpu, m.gpus, m.nodes, m.host_memory, m.note) == ("a100-80gb", 4, 2, "1TB", None)
    assert machine(None, None, None, None, None).gpus is None
    with pytest.raises(ConfigError, match="node.gpu: unknown GPU 'h1000'"):
        machine({"gpu": "h1000"}, None, None, None, None)


def test_a_missing_model_folder_is_planned_from_its_release_shape(tmp_path):
    config = ROOT / R405
    over, note = shape_override(config, {"pretrained_model_name_or_path": "/models/Llama-3.1-405B"})
    assert over and over[0].endswith("shapes/llama-3.1-405b") and "is not a folder on this machine" in note
    assert shape_override(config, {"pretrained_model_name_or_path": str(tmp_path)}) == ([], None)
    assert shape_override(config, {"pretrained_model_name_or_path": "/models/Unknown-7B"}) == ([], None)


def test_a_recipe_run_on_cpu_is_planned_for_cpu_not_its_node_gpu():
    """``device=cpu`` (the recipes' CPU tests, a laptop run) is the machine: the recipe's
    node.gpu does not turn the plan back into a GPU's (no GPU runtime in host memory)."""
    from foundryx.plan.planner import make_plan

    p = make_plan(ROOT / R405, ["variables.model_path=yamls/shapes/llama-3.1-405b", "device=cpu"],
                  gpus=2)
    assert p.device == "cpu", p.device
    assert p.host.terms["gpu_runtime"] == 0 and p.host.terms["device_memory"] > 0
    assert any("device: cpu (the config's device)" in n for n in p.notes), p.notes
    gpu = make_plan(ROOT / R405, ["variables.model_path=yamls/shapes/llama-3.1-405b"], gpus=2)
    assert gpu.device == "h100" and gpu.host.terms["gpu_runtime"] > 0  # without it: the node's
    # on a CPU device glibc's heap is left as it starts (host_heap: auto): the plan says what
    # that can cost and the setting that keeps the run to it; bounded, or a GPU: nothing to say
    heap = [n for n in p.notes if n.startswith("host_heap: auto on a CPU device")]
    assert len(heap) == 1 and "host_heap=bounded keeps the run to it" in heap[0], p.notes
    bounded = make_plan(ROOT / R405, ["variables.model_path=yamls/shapes/llama-3.1-405b",
                                      "device=cpu", "host_heap=bounded"], gpus=2)
    assert not [n for n in bounded.notes + gpu.notes if n.startswith("host_heap")]


@pytest.mark.slow
def test_plan_of_a_large_recipe_is_for_its_node_without_flags():
    r = foundryx("plan", R70)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8 x h100, FSDP2 over 8" in r.stdout
    assert "note: the recipe's node: gpu h100, gpus 8, host memory 2TB" in r.stdout
    assert "planned with the shape of that release, yamls/shapes/llama-3.1-70b" in r.stdout
    assert "per node: node.host_memory" in r.stdout and "FITS" in r.stdout


@pytest.mark.slow
def test_dry_run_on_a_login_node_plans_the_cluster_and_notes_what_it_cannot_run(quickstart_data):
    r = foundryx("train", "--dry-run", R405, "variables.model_path=yamls/shapes/llama-3.1-405b",
                 f"variables.data_root={quickstart_data}", "variables.max_seq_len=128")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "note: no GPU on this machine: the recipe's node: gpu h100, gpus 8" in r.stdout
    assert "note: this machine could not run it as it is (device: 'gpu' cannot run here" in r.stdout
    assert "FITS: device memory fits, host memory fits" in r.stdout


@pytest.mark.slow
def test_dry_run_whose_plan_does_not_fit_exits_2_with_the_fixes(quickstart_data):
    r = foundryx("train", "--dry-run", R70, "variables.model_path=yamls/shapes/llama-3.1-70b",
                 f"variables.data_root={quickstart_data}", "variables.max_seq_len=128", "node.gpus=1")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DOES NOT FIT" in r.stdout
    assert "plan_check: the run needs an estimated" in r.stderr and "see the plan's suggestions" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_context_parallel_recipe_is_planned_for_its_node_and_fits_at_4m(capsys):
    """``foundryx plan`` of the long-cp recipe, no flags: its cp of 8 is checked against its
    node's 8 GPUs (not this machine's one process), its model from the release's shape; each
    GPU holds 4,194,304 / 8 tokens and fits 80 GB (issue 52: >= 4M tokens on one node)."""
    from foundryx.cli import main

    rc = main(["plan", "yamls/finetune/llama-3.1-8b-lora-long-cp.yaml"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "8 x h100, FSDP2 over 8, microbatch 1 x 524288 tokens" in out, out
    assert "each holds 524,288 of every sequence's 4,194,304 tokens" in out
    total = float(next(line.split()[1] for line in out.splitlines()
                       if line.strip().startswith("total ")))
    assert total <= 76, out  # the budget on an 80 GB GPU, margin left
