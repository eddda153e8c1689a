"""The default process group of a GPU run carries host tensors too: on a GPU node NCCL takes
CUDA tensors only, and the load of an NF4 base with offload (its block maxima are gathered from
host memory) and the tensor-parallel re-cut of offloaded weights run collectives on host
tensors. These run on 2 CPU ranks through a backend that refuses host tensors as NCCL does
(``tests/nccl_like.py``), with the group built as a GPU run builds it
(:func:`foundryx.runtime.process_groups.process_group_backend`), and with today's Composer construction (the
device's backend alone), which must fail."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from distributed import run_distributed
from hf_tiny import train_steps
from nccl_like import NAME
from test_loading_dist import save_llama

from foundryx.errors import ConfigError
from foundryx.runtime.process_groups import process_group_backend, with_host_collectives

GPU_RUN = process_group_backend(NAME)  # what foundryx gives Composer on a GPU node
COMPOSER = NAME  # Composer's own: DeviceGPU.dist_backend alone
LORA = {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}


def _load_and_train(folder: str, tp: int, init: str) -> dict:
    """An NF4 base, half of its frozen layers offloaded, loaded shard-on-read (``init`` meta) or
    built whole and re-cut (``cpu``: the tensor-parallel re-cut gathers the offloaded rows from
    host memory), then 2 training steps."""
    from foundryx import builders
    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.peft.frozen_base import LowPrecisionLinear

    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder, "init_device": init,
               "peft_config": LORA, "frozen_base": {"dtype": "nf4", "offload_fraction": 0.5}}
    parallelism = ParallelismConfig(tp=tp)
    cfg = SimpleNamespace(model=section, optimizer={"name": "adamw", "lr": 1e-2}, parallelism=parallelism)
    torch.manual_seed(0)
    model = builders.parallelize_and_load(builders.build_model(cfg, None), parallelism,
                                          device=torch.device("cpu"))
    offloaded = [m for m in model.modules() if isinstance(m, LowPrecisionLinear) and m.offload is not None]
    return {"backend": str(torch.distributed.get_backend()), "offloaded": len(offloaded),
            "losses": train_steps(model, 2, opt=builders.build_optimizer(cfg, model))}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    # NF4 under TP needs each rank's columns of a row to be whole groups of 64-weight blocks
    return save_llama(tmp_path_factory.mktemp("wide"), torch.bfloat16, hidden_size=128,
                      intermediate_size=256)


@pytest.mark.parametrize("tp,init", [(1, "meta"), (2, "cpu")], ids=["nf4-offload-load", "tp-recut"])
def test_host_collectives_run_on_the_group_a_gpu_run_makes(wide, tp, init):
    results = run_distributed(_load_and_train, args=(wide, tp, init), backend=GPU_RUN, timeout=300)
    for r in results:
        assert r["backend"] == f"cpu:gloo,cuda:{NAME}"
        assert r["offloaded"] == 7  # half of the 14 frozen linear layers
        assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert results[0]["losses"] == results[1]["losses"]


def _host_collectives(which: str) -> list[float]:
    """One of the two host-tensor collectives of those paths, alone (on CPU ranks every tensor
    is a host tensor, so with the device's backend alone the whole load would stop at its first
    collective of any kind): ``nf4``, a rank's rows of an NF4 weight finished with the whole
    weight's scaler mean, its block maxima gathered from host memory; ``recut``, an offloaded
    weight's host rows gathered whole to be cut for tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from foundryx.loading.nf4_shard import nf4
    from foundryx.models.peft.parts import STORAGE_ROWS
    from foundryx.models.peft.rowwise import RowScaledTensor
    from foundryx.models.peft.torchao_nf4 import to_nf4
    from foundryx.parallel.offload import Offloaded
    from foundryx.parallel.tp_offload import split_for_tp

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    rows = weight[rank * 32:(rank + 1) * 32]
    if which == "nf4":
        whole = to_nf4(weight, 64, 64)  # each rank: 128 blocks, 2 scaler blocks
        mine = nf4(rows, whole, torch.float32, group=torch.distributed.group.WORLD, start=rank * 32)
        return [float(mine.scaler_mean), float(whole.scaler_mean)]
    int8 = RowScaledTensor.from_weight(weight, "int8")  # an offloaded frozen weight's storage
    off = Offloaded(RowScaledTensor(int8.qdata[rank * 32:(rank + 1) * 32], int8.scale[rank * 32:(rank + 1) * 32],
                                    dtype=torch.float32), STORAGE_ROWS, rows=64, world=world, name="layer")
    mesh = init_device_mesh("cpu", (world,))
    split_for_tp(off, mesh, Shard(1), mesh.get_group(0))  # row-wise: this rank's columns, its rows
    cut = slice(rank * 32, (rank + 1) * 32), slice(rank * 128, (rank + 1) * 128)
    return [float(off.host.qdata.float().sum()), float(int8.qdata[cut].float().sum())]


@pytest.mark.parametrize("which", ["nf4", "recut"])
def test_host_collectives_need_the_host_backend(which):
    """Each host-tensor collective: right on the group a GPU run makes; refused by the device's
    backend alone, which is the group Composer makes from a GPU device (today's construction)."""
    for got, want in run_distributed(_host_collectives, args=(which,), backend=GPU_RUN):
        assert got == want
    with pytest.raises(Exception, match="No backend type associated with device type cpu"):
        run_distributed(_host_collectives, args=(which,), backend=COMPOSER)


class _Device:
    dist_backend = "nccl"


def test_a_gpu_device_gets_the_pair_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        device = with_host_collectives(_Device(), world_size=8)
    assert device.dist_backend == "cpu:gloo,cuda:nccl"
    assert [r.getMessage() for r in caplog.records if "process group" in r.getMessage()] == [
        "process group: cpu:gloo,cuda:nccl (nccl for GPU tensors; gloo for host tensors: "
        "offloaded and NF4 weights' collectives on load)"]
    assert with_host_collectives(_Device(), world_size=1).dist_backend == "nccl"  # no group
    cpu = _Device()
    cpu.dist_backend = "gloo"
    assert with_host_collectives(cpu, world_size=2).dist_backend == "gloo"


def test_a_torch_without_nccl_is_said_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError, match="no nccl backend.*install a CUDA or ROCm build of torch"):
        with_host_collectives(_Device(), world_size=2)
