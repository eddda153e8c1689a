"""ICL evaluators in a training run on several processes, with and without tensor parallelism:
the ranks of a tensor-parallel group read the same examples (padded to a multiple of tp for
sequence parallelism) and only the first counts them, so the results equal FSDP's; generation
tasks under tp generate the texts of FSDP."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from distributed import run_distributed
from launcher import launch
from safetensors.torch import load_file

from foundryx.checkpoint.layout import DCP_DIR
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


MESHES = {"shard4": (4, 1), "shard2xtp2": (2, 2)}


def _generations(tokenizer: Any, task_file: str) -> dict[str, dict[int, str]]:
    """Every example's generated text, by example id, for an MPT and a Llama at each mesh,
    through the run's own path: the ICL evaluator's batches and Composer's ``eval_forward``
    (Hugging Face ``generate`` under FSDP; foundryx's padded steps under tp)."""
    import torch.distributed as tdist

    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.hf import ComposerHFCausalLM
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.parallel import parallelize

    torch.set_num_threads(1)
    vocab = len(tokenizer)
    builders = {
        "mpt": lambda: ComposerMPTCausalLM(tokenizer, d_model=32, n_heads=4, n_layers=2,
                                           max_seq_len=128, vocab_size=vocab,
                                           attn_config={"rope": True}, norm_type="rmsnorm"),
        "llama": lambda: ComposerHFCausalLM(tokenizer, config=dict(
            model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
            max_position_embeddings=128, tie_word_embeddings=False), pretrained=False,
            attn_implementation="sdpa"),
    }
    tasks = [{"label": "gen", "dataset_uri": task_file, "icl_task_type": "generation_task_with_answers",
              "num_fewshot": [1], "stop_sequences": ["."], "batch_size": 3}]
    out: dict[str, dict[int, str]] = {}
    for kind, build in builders.items():
        for name, (shard, tp) in MESHES.items():
            torch.manual_seed(0)
            model = build()
            parallelize(model, ParallelismConfig(data_parallel_shard_degree=shard, tp=tp),
                        device=torch.device("cpu"))
            model.eval()
            cfg = SimpleNamespace(icl_tasks=tasks, eval_gauntlet=None, icl_data_root=None,
                                  max_seq_len=128, icl_max_examples=None,
                                  parallelism=SimpleNamespace(tp=tp))
            (evaluator,), _ = build_icl_evaluators(cfg, tokenizer, model, 3)
            texts = {}
            with torch.no_grad():
                for batch in evaluator.dataloader.dataloader:
                    ids = batch["example_id"].tolist()
                    texts.update(zip(ids, model.eval_forward(batch)))
            every: list[Any] = [None] * tdist.get_world_size()
            tdist.all_gather_object(every, texts)
            out[f"{kind} {name}"] = {k: v for t in every for k, v in t.items()}
    return out


def test_generation_tasks_under_tp_give_the_texts_of_fsdp(tiny_tokenizer, tmp_path):
    """A generation task (1-shot, a stop sequence, batches of 3: the data-parallel groups
    decode different rows for different numbers of steps) on 4 processes: (shard 2 x tp 2)
    generates, for every example, the text (shard 4) generates, for an MPT (no KV cache) and a
    Llama (KV cache, grouped kv heads)."""
    rows = [{"context": f"Question {i}: what comes after {i}?", "answer": f" {i + 1}."}
            for i in range(13)]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = run_distributed(_generations, world_size=4, args=(tiny_tokenizer, str(tmp_path / "gen.jsonl")),
                          timeout=600)[0]
    for kind in ("mpt", "llama"):
        ref, tp = got[f"{kind} shard4"], got[f"{kind} shard2xtp2"]
        assert sorted(ref) == list(range(13)), ref
        assert tp == ref, (kind, {k: (ref[k], tp.get(k)) for k in ref if tp.get(k) != ref[k]})
        assert len(set(ref.values())) > 1, ref  # the texts differ: the rows were decoded


@pytest.mark.slow
@pytest.mark.modern_leg
def test_icl_in_training_on_two_processes_equals_with_tensor_parallelism(quickstart_data, tmp_path):
    """The quickstart recipe (an MPT) on 2 processes with its ICL tasks (a generation task
    too), once as FSDP (shard 2) and once as tp 2; the learning rate is 0, so both evaluate the same weights. Both save a
    checkpoint and an hf_export: the tp run's hold the same tensors as FSDP's (MPT's fused Wqkv
    in its logical row order, not the TP ranks'), and the same sample and token counts."""
    write_quickstart_tasks(tmp_path / "eval", seed=0)
    facts = [json.loads(line) for line in (tmp_path / "eval/facts_lm.jsonl").read_text().splitlines()]
    (tmp_path / "eval/facts_gen.jsonl").write_text("".join(  # the facts as questions to answer
        json.dumps({"context": f["context"], "answer": f["continuation"]}) + "\n" for f in facts))
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"data_root": str(tmp_path / "eval"), "icl_tasks": [
        {"label": "facts_lm", "dataset_uri": "facts_lm.jsonl", "icl_task_type": "language_modeling"},
        {"label": "facts_mc", "dataset_uri": "facts_mc.jsonl", "icl_task_type": "multiple_choice"},
        {"label": "facts_gen", "dataset_uri": "facts_gen.jsonl",
         "icl_task_type": "generation_task_with_answers", "max_new_tokens": 4},
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
    assert len(results["fsdp"]) == 3, results
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
