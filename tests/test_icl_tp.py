"""ICL evaluators in a training run on several processes, with and without tensor parallelism:
the ranks of a tensor-parallel group read the same examples (padded to a multiple of tp for
sequence parallelism) and only the first counts them, so the results equal FSDP's; generation
tasks under tp are refused with the way out."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from launcher import launch
from safetensors.torch import load_file

from foundryx.checkpoint.layout import DCP_DIR
from foundryx.errors import ConfigError
from foundryx.eval.data import data_parallel_share, rank_share
from foundryx.eval.evaluators import build_icl_evaluators
from foundryx.eval.quickstart_tasks import write_quickstart_tasks
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]


def test_each_example_is_counted_once_over_data_parallel_ranks_and_tp_groups():
    n, world, tp = 13, 4, 2
    counted, seen = [], {}
    for rank in range(world):
        dp_rank, dp_world, counts = data_parallel_share(rank, world, tp)
        items = rank_share(n, dp_rank, dp_world, counts)
        seen[rank] = [i for i, _ in items]
        counted += [i for i, primary in items if primary]
        assert len(items) == -(-n // dp_world)  # every rank runs as many batches
    assert sorted(counted) == list(range(n))
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]  # tp groups (0,1), (2,3)


def test_generation_tasks_under_tp_are_refused_with_the_way_out(tiny_tokenizer, tmp_path):
    rows = [{"context": f"Question {i}:", "answer": f" {i}"} for i in range(4)]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = [{"label": "gen", "dataset_uri": str(tmp_path / "gen.jsonl"),
              "icl_task_type": "generation_task_with_answers"}]
    cfg = SimpleNamespace(icl_tasks=tasks, eval_gauntlet=None, icl_data_root=None, max_seq_len=64,
                          icl_max_examples=None, parallelism=SimpleNamespace(tp=2))
    with pytest.raises(ConfigError) as err:
        build_icl_evaluators(cfg, tiny_tokenizer, SimpleNamespace(), 4)
    said = str(err.value)
    assert "icl_tasks: gen: generation tasks do not run under parallelism.tp: 2" in said, said
    assert "foundryx eval" in said and "tp: 1" in said, said


@pytest.mark.slow
@pytest.mark.modern_leg
def test_icl_in_training_on_two_processes_equals_with_tensor_parallelism(quickstart_data, tmp_path):
    """The quickstart recipe (an MPT) on 2 processes with its ICL tasks, once as FSDP (shard 2)
    and once as tp 2; the learning rate is 0, so both evaluate the same weights. Both save a
    checkpoint and an hf_export: the tp run's hold the same tensors as FSDP's (MPT's fused Wqkv
    in its logical row order, not the TP ranks'), and the same sample and token counts."""
    write_quickstart_tasks(tmp_path / "eval", seed=0)
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"data_root": str(tmp_path / "eval"), "icl_tasks": [
        {"label": "facts_lm", "dataset_uri": "facts_lm.jsonl", "icl_task_type": "language_modeling"},
        {"label": "facts_mc", "dataset_uri": "facts_mc.jsonl", "icl_task_type": "multiple_choice"},
    ]}))
    weights = _weights_file(tmp_path / "start.safetensors")
    results = {}
    for name, parallelism in (("fsdp", "parallelism={}"), ("tp", "parallelism.tp=2")):
        out = tmp_path / name
        r = launch(["train.py", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
                    "max_duration=2ba", "eval_interval=2ba", "optimizer.lr=0.0",
                    "global_train_batch_size=4", f"icl_tasks={tasks}",
                    f"loggers.jsonl.path={out}/metrics.jsonl", "device_eval_batch_size=8",
                    "eval_subset_num_batches=1", "progress_bar=false", parallelism,
                    f"load_path={weights}", f"save_folder={out}/ckpt", "save_interval=2ba",
                    f"callbacks.hf_export.save_folder={out}/hf"],
                   2, out, ROOT)
        said = "".join(p.read_text() for p in sorted(out.glob("rank*.*")))
        assert r.returncode == 0, said[-6000:]
        results[name] = {k: v for row in read_metrics(out / "metrics.jsonl")
                         for k, v in row.items() if "-shot/" in k}
    assert len(results["fsdp"]) == 2, results
    # 176 questions each; a random model: chance on the 4 choices, ~0 on exact answers
    assert 0.15 < results["fsdp"]["metrics/facts_mc/0-shot/ICLMultipleChoiceAccuracy"] < 0.35
    assert results["tp"] == results["fsdp"]
    # each sample counted once, not once per TP rank: what max_duration in samples or tokens
    # counts, and the data position a resume starts from (streaming's state wants unique samples)
    saved = {run: json.loads((tmp_path / run / "ckpt/latest/trainer_state.json").read_text())
             for run in results}
    for key, want in (("sample", 8), ("sample_in_epoch", 8), ("token", 8 * 128)):
        assert saved["tp"]["timestamp"][key] == saved["fsdp"]["timestamp"][key] == want, key
    assert saved["tp"]["dataset"] == saved["fsdp"]["dataset"]
    start = load_file(weights)
    for name in ("checkpoint", "hf_export"):
        fsdp, tp = (_saved_tensors(tmp_path / run, name) for run in ("fsdp", "tp"))
        assert any(q in k for k in fsdp for q in ("Wqkv", "q_proj")) and fsdp.keys() == tp.keys()
        assert all(torch.equal(fsdp[k], tp[k]) for k in fsdp), (
            name, [k for k in fsdp if not torch.equal(fsdp[k], tp[k])])
        if name == "checkpoint":  # what both runs loaded (its Wqkv put in TP order, under tp)
            assert all(torch.equal(fsdp[k], start[k.removeprefix("model.")]) for k in fsdp)


def _weights_file(path: Path) -> Path:
    """A weights file of the quickstart's MPT with weights of another seed than the runs'."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "yamls/quickstart.yaml"), resolve=True)
    torch.manual_seed(123)
    model = ComposerMPTCausalLM(None, **{k: v for k, v in cfg["model"].items() if k != "name"})
    save_file({k: v.contiguous() for k, v in model.model.state_dict().items()}, path)
    return path


def _saved_tensors(out: Path, kind: str) -> dict[str, torch.Tensor]:
    """The model tensors of a run's checkpoint (DCP) or of its hf_export (safetensors)."""
    if kind == "hf_export":
        (path,) = out.glob("hf/*/model.safetensors")
        return load_file(path)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp = out / "ckpt" / "latest" / DCP_DIR
    dcp_to_torch_save(dcp, out / "ckpt.pt")
    return {k: v for k, v in torch.load(out / "ckpt.pt")["model"].items() if isinstance(v, torch.Tensor)}
