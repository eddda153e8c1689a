"""foundryx.parallel's distributed pieces one at a time, on 2 processes (gloo) through the
per-function helper ``tests/distributed.py``: meta init of DTensor shards, rank-0 broadcast,
the Composer contract, and the helper itself.

The functions run on every rank live at module level (the helper imports them by name).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from distributed import RankFailed, run_distributed

# A tiny MPT whose vocabulary (63 rows) does not split evenly over 2 ranks.
MODEL = dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=63)


def tiny_mpt(init_device: str):
    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    return MPTForCausalLM(MPTConfig(**MODEL, init_device=init_device))


def shard(model) -> None:
    """FSDP2 as foundryx applies it: each block, then each top-level child, on a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from foundryx.config.schema import ParallelismConfig
    from foundryx.parallel.fsdp import shard_model
    from foundryx.parallel.policy import blocks

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("shard",))
    shard_model(model, [m for _, m in blocks(model)], mesh, ParallelismConfig(), "fp32")


def full_weights_digest(model) -> str:
    """sha256 of every parameter and buffer in full (gathered when sharded), in order."""
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode() + full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# -- init_meta: DTensor shards initialised as the unsharded init would -----------------------

def _meta_init_shards_match_unsharded_init(seed: int) -> dict:
    import torch.distributed as tdist
    from composer.utils import dist as cdist
    from torch.distributed.tensor import DTensor

    from foundryx.parallel.materialize import init_meta

    rank, world = tdist.get_rank(), tdist.get_world_size()
    reference = tiny_mpt("meta")  # the same model, unsharded, initialised in one piece
    torch.manual_seed(seed)
    init_meta(reference, torch.device("cpu"))
    expected = dict(reference.named_parameters())

    model = tiny_mpt("meta")
    shard(model)
    torch.manual_seed(seed)
    init_meta(model, torch.device("cpu"))
    mismatched, uneven = [], 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.to_local().is_meta, name
        mine = expected[name].detach().chunk(world, dim=0)[rank]  # FSDP2 shards dim 0 like chunk
        uneven += expected[name].shape[0] % world != 0
        if not torch.equal(p.to_local(), mine):
            mismatched.append(name)
    return {"rank": rank, "env": (cdist.get_global_rank(), cdist.get_local_rank(),
                                  cdist.get_world_size(), cdist.get_local_world_size()),
            "params": len(expected), "uneven": uneven, "mismatched": mismatched,
            "digest": full_weights_digest(model)}


def test_meta_init_of_shards_equals_the_unsharded_init():
    results = run_distributed(_meta_init_shards_match_unsharded_init, args=(5,))
    assert [r["env"] for r in results] == [(0, 0, 2, 2), (1, 1, 2, 2)]  # composer's dist agrees
    for r in results:
        assert r["mismatched"] == [], r
        assert r["params"] > 10 and r["uneven"] >= 1  # wte: 63 rows over 2 ranks
    assert results[0]["digest"] == results[1]["digest"]


# -- broadcast_from_rank0: rank 0's real weights reach every rank's shards -------------------

def _broadcast_from_rank0(seed: int) -> dict:
    import torch.distributed as tdist

    from foundryx.parallel import materialize as mat

    rank = tdist.get_rank()
    torch.manual_seed(seed)
    model = tiny_mpt("cpu" if rank == 0 else "meta")
    before = full_weights_digest(model) if rank == 0 else None
    assert mat.init_mode(model) == "rank0"
    full = mat.full_state_on_rank0(model)
    assert bool(full) == (rank == 0)
    shard(model)
    mat.broadcast_from_rank0(model, full, torch.device("cpu"))
    assert not mat.has_meta(model)
    return {"before": before, "after": full_weights_digest(model)}


def test_broadcast_from_rank0_fills_every_rank():
    rank0, rank1 = run_distributed(_broadcast_from_rank0, args=(7,))
    assert rank0["before"] is not None
    assert rank0["after"] == rank0["before"] and rank1["after"] == rank0["before"]


# -- the Composer contract: Composer sees the model foundryx sharded as FSDP ---------------

def _composer_sees_the_sharded_model() -> dict:
    from composer.core import State
    from composer.devices import DeviceCPU

    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.parallel import parallelize
    from foundryx.parallel.contract import check_composer_contract

    model = ComposerMPTCausalLM(None, **MODEL, init_device="meta")
    before = State(model=model, rank_zero_seed=0, run_name="contract", device=DeviceCPU()).fsdp_enabled
    parallelize(model, ParallelismConfig(), device=torch.device("cpu"))  # checks the contract
    check_composer_contract(model)
    after = State(model=model, rank_zero_seed=0, run_name="contract", device=DeviceCPU()).fsdp_enabled
    return {"before": before, "after": after}


def test_composer_treats_the_sharded_model_as_fsdp():
    assert run_distributed(_composer_sees_the_sharded_model) == [{"before": False, "after": True}] * 2


# -- the helper itself ------------------------------------------------------------------------

def _fail_on_rank1() -> int:
    import torch.distributed as tdist

    if tdist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    tdist.barrier()  # rank 0 waits for a peer that never comes; the helper stops it
    return 0


def test_helper_raises_the_failing_rank_exception_with_its_traceback():
    with pytest.raises(ValueError, match="rank 1 cannot go on") as e:
        run_distributed(_fail_on_rank1, timeout=60)
    note = "\n".join(e.value.__notes__)
    assert "rank 1 of 2 failed in _fail_on_rank1" in note
    assert 'raise ValueError("rank 1 cannot go on")' in note  # the remote traceback


def _unfaithful_exception() -> None:
    from foundryx.errors import ConfigError

    raise ConfigError(["model.d_model: expected an integer"])  # does not survive pickling


def test_helper_reports_an_exception_it_cannot_send_back():
    with pytest.raises(RankFailed, match=r"rank [01] of 2 failed(.|\n)*ConfigError: 1 problem"):
        run_distributed(_unfaithful_exception, timeout=60)
