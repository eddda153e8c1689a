"""Multi-node launch on localhost: 2 "nodes" x 2 processes through launch/slurm_node.sh
(`foundryx launch` with Composer's launcher flags --world_size/--node_rank/--master_addr),
FSDP2 over all 4 ranks, or hybrid (2 replicas x 2 shards) where this torch can do that on gloo
(>= 2.8).

StreamingDataset keys its shared memory per host and cannot run two "nodes" on one host, so
the run trains on random tokens from a dataloader this file registers (its ``__main__``).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
NODE = ROOT / "launch" / "slurm_node.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slurm_scripts_parse_and_demand_their_environment():
    for script in ("slurm.sbatch", "slurm_node.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    r = subprocess.run([str(NODE), "train.py"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "MASTER_ADDR" in r.stderr


@pytest.mark.slow
def test_two_nodes_of_two_processes(quickstart_data, tmp_path):
    from torch.distributed.fsdp import FSDPModule

    hybrid = hasattr(FSDPModule, "set_force_sum_reduction_for_comms")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "SLURM_NNODES": "2",
           "NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "1"}
    args = [
        str(Path(__file__).resolve()), "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
        "train_loader.name=synthetic",
        "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        "model.init_device=meta", "global_train_batch_size=8", "max_duration=4ba",
        "eval_loader=null", f"parallelism.sharding_strategy={'HYBRID_SHARD' if hybrid else 'FULL_SHARD'}", "save_interval=4ba",
        f"save_folder={tmp_path}/ckpt", f"loggers.jsonl.path={tmp_path}/metrics.jsonl",
        "console_log_interval=100ba",
    ]
    nodes = [subprocess.Popen([str(NODE), *args], cwd=ROOT, env={**env, "SLURM_NODEID": str(n)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert f"over 4 ranks (mesh {'2x2' if hybrid else '1x4'}" in outs[0]
    manifest = json.loads((tmp_path / "ckpt" / "ep0-ba4" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    curve = [r["loss/train/total"] for r in read_metrics(tmp_path / "metrics.jsonl")
             if "loss/train/total" in r]
    assert len(curve) == 4 and all(math.isfinite(x) for x in curve)
    from foundryx.checkpoint import load_model_weights

    weights = load_model_weights(tmp_path / "ckpt")
    assert weights["model.transformer.wte.weight"].shape == (1024, 32)


def synthetic_loader(cfg, tokenizer, device_batch_size, **_):
    """Fixed random token sequences, split across ranks by a DistributedSampler."""
    import torch
    from composer.utils import dist
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, len(tokenizer), (32,), generator=g)} for _ in range(64)]
    return DataLoader(data, batch_size=device_batch_size, sampler=dist.get_sampler(data))


if __name__ == "__main__":
    from foundryx import registry
    from foundryx.cli import run

    registry.dataloaders.register("synthetic", synthetic_loader)
    run(["train", *sys.argv[1:]])
