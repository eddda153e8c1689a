"""HYBRID_SHARD on CPU (gloo), which torch >= 2.8 makes possible: FSDP2 can then keep to SUM
reductions (``set_force_sum_reduction_for_comms``), and gloo has no AVG. On an older torch
foundryx refuses the configuration (tests/test_fsdp.py checks the message), so these tests skip.

One training step of a tiny MPT under ``parallelize`` with ``HYBRID_SHARD`` on 4 ranks (2
replicas x 2 shards), each rank on its own slice of the batch, gives the gradients of the
unsharded model on the whole batch (about 50 s on 2 cores: 4 fresh processes). The multi-node launch of
a whole run with hybrid sharding is tests/test_launch.py (slow).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from torch.distributed.fsdp import FSDPModule

pytestmark = pytest.mark.skipif(
    not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"),
    reason=f"torch {torch.__version__} < 2.8: no sum-only FSDP2 reductions, so HYBRID_SHARD on "
    "gloo is refused (tests/test_fsdp.py checks the message); runs on the modern leg",
)

MODEL = dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=63)
PER_RANK = 2  # sequences per rank


def _hybrid_step_matches_unsharded(shard_degree: int) -> dict:
    import torch.distributed as tdist

    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.parallel import parallelize

    rank, world = tdist.get_rank(), tdist.get_world_size()
    ids = torch.randint(0, MODEL["vocab_size"], (world * PER_RANK, MODEL["max_seq_len"]),
                        generator=torch.Generator().manual_seed(1))

    def step(model, batch):
        model.zero_grad()
        loss = model.loss(model({"input_ids": batch}), {"input_ids": batch})
        loss.backward()
        return loss.detach()

    torch.manual_seed(0)
    reference = ComposerMPTCausalLM(None, **MODEL)
    ref_loss = step(reference, ids)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    torch.manual_seed(0)
    model = ComposerMPTCausalLM(None, **MODEL)
    parallelize(model, ParallelismConfig(sharding_strategy="HYBRID_SHARD",
                                         data_parallel_shard_degree=shard_degree),
                device=torch.device("cpu"))
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    mesh = units[0].parameters().__next__().device_mesh
    loss = step(model, ids[rank * PER_RANK:(rank + 1) * PER_RANK])
    tdist.all_reduce(loss)  # SUM: gloo has no AVG
    worst = max((p.grad.full_tensor() - ref_grads[n]).abs().max().item()
                for n, p in model.named_parameters())
    return {"mesh": tuple(mesh.shape), "names": mesh.mesh_dim_names, "units": len(units),
            "loss": (loss / world).item(), "ref_loss": ref_loss.item(), "worst": worst}


def test_hybrid_sharding_on_gloo_gives_the_unsharded_gradients():
    results = run_distributed(_hybrid_step_matches_unsharded, world_size=4, args=(2,), timeout=300)
    assert len(results) == 4
    for r in results:
        assert (r["mesh"], r["names"]) == ((2, 2), ("replicate", "shard")), r
        assert r["units"] >= MODEL["n_layers"], r
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5, r
        assert r["worst"] < 1e-5, r  # averaged over replicas and shards, not summed
