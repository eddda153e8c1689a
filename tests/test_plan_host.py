"""foundryx plan's host memory: the per-rank terms on a known shape (by hand), the loading
modes, the verdict that flips with --host-memory, the fixes that re-plan to what they
promise, the load-time estimate, and the pre-launch refusal (one message, exit 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from foundryx.cli import main
from foundryx.errors import ConfigError
from foundryx.plan.census import build_meta, take_census
from foundryx.plan.gpus import GiB, parse_rate
from foundryx.plan.host import (
    GPU_RUNTIME_HOST,
    OFFLOAD_PACK_COPIES,
    PROCESS_BASELINE,
    READ_AHEAD,
    READER_BUFFER,
    READER_THREADS,
    WORKER_BYTES,
    HostSetup,
    host_plan,
    host_terms,
)
from foundryx.plan.memory import Setup, terms
from foundryx.plan.planner import make_plan

ROOT = Path(__file__).parents[1]
# A tiny Llama: 106,816 parameters. Embedding and lm_head 256 x 64 each (16,384, the largest);
# a block: q 64x64, k and v 32x64, o 64x64, gate / up / down 128x64 (36,864 linear weights,
# 512 output rows) and two norms of 64; a final norm of 64.
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 64, "torch_dtype": "bfloat16"}
TOTAL, LARGEST, BLOCK_LINEAR, ROWS = 106_816, 16_384, 2 * 36_864, 2 * 512
READERS = READER_THREADS * READER_BUFFER


def census():
    model, shape, _ = build_meta({"name": "hf_causal_lm", "pretrained": False, "config": LLAMA})
    return take_census(model, shape)


def test_known_shape_counts():
    c = census()
    assert (c.total, c.largest_param, c.block_linear) == (TOTAL, LARGEST, BLOCK_LINEAR)
    assert sum(o for o, _ in c.linears.values()) == ROWS


def test_host_terms_by_hand():
    """2 GPU ranks per node, FSDP2 over 2, LoRA over an FP8 base, half of it offloaded, 3
    dataloader workers, shard-on-read of a bf16 checkpoint."""
    c = census()
    s = Setup(world_size=2, shard_degree=2, zero_stage=3, microbatch=1, seq_len=64,
              device_kind="cuda", lora_params=1000, lora_params_per_block=500,
              frozen_dtype="fp8", offload_fraction=0.5)
    stored = 2 * TOTAL
    h = HostSetup(ranks_per_node=2, load="shard", stored_bytes=stored, workers=3, batch_bytes=1024)
    t, others = host_terms(c, s, h)
    offloaded = (BLOCK_LINEAR * 1 + ROWS * 4) * 0.5 / 2  # fp8 bytes + fp32 row scales, half, / N
    # on a GPU a rank keeps only its offloaded shards in host memory (moved into one buffer at the
    # end), plus the ranges read ahead and the largest tensor's slice (bf16, / N)
    loader = OFFLOAD_PACK_COPIES * offloaded + READ_AHEAD + LARGEST * 2 / 2
    assert t == {"process_baseline": PROCESS_BASELINE, "gpu_runtime": GPU_RUNTIME_HOST,
                 "device_memory": 0, "offloaded_shards": offloaded, "cpu_offload_state": 0,
                 "offloaded_activations": 0, "dataloader_workers": 3 * (WORKER_BYTES + 2 * 1024),
                 "loader_transient": loader}
    assert others == loader  # every rank reads its own slices
    hp = host_plan(c, s, h, capacity=10 * GiB, node="test", read_rate=1e9)
    common = PROCESS_BASELINE + GPU_RUNTIME_HOST
    assert hp.load_per_rank == common + loader
    assert hp.train_per_rank == common + offloaded + 3 * (WORKER_BYTES + 2048)
    assert hp.per_node == 2 * max(hp.load_per_rank, hp.train_per_rank)
    assert (hp.read_per_rank, hp.read_per_node) == (stored // 2, stored)
    assert hp.load_seconds == stored / 1e9


def test_loading_modes_and_cpu_device():
    """init_device cpu: every rank reads the whole checkpoint; mixed: rank 0 alone; a CPU
    device holds the device plan in host memory too."""
    c = census()
    stored = 2 * TOTAL
    s = Setup(world_size=4, shard_degree=4, zero_stage=3, microbatch=1, seq_len=64,
              device_kind="cpu")
    whole = 1.25 * stored + LARGEST * 2 + READERS
    every = host_plan(c, s, HostSetup(4, "every_rank", stored), GiB, "t", 1e9)
    assert every.terms["loader_transient"] == whole and every.terms["gpu_runtime"] == 0
    assert every.terms["device_memory"] > 0
    assert every.read_per_node == 4 * stored
    rank0 = host_plan(c, s, HostSetup(4, "rank0", stored), GiB, "t", 1e9)
    common = PROCESS_BASELINE
    node_load = common + whole + 3 * common
    assert rank0.per_node == max(node_load, 4 * rank0.train_per_rank)
    assert rank0.read_per_node == stored
    # shard-on-read on a CPU device: each rank keeps its weights in host memory, plus the
    # ranges read ahead and the largest tensor's slice
    shard = host_plan(c, s, HostSetup(4, "shard", stored), GiB, "t", 1e9)
    kept = terms(c, s)["trainable_weights"]
    assert kept == TOTAL * 4 / 4
    assert shard.terms["loader_transient"] == math.ceil(kept + READ_AHEAD + LARGEST * 2 / 4)
    none = host_plan(c, s, HostSetup(4, "none", 0), GiB, "t", 1e9)
    assert none.terms["loader_transient"] == 0 and none.load_seconds == 0


def test_fsdp_cpu_offload_holds_the_sharded_state_in_host_memory_by_hand():
    """FSDP2's cpu_offload: a rank's shard of the fp32 weights, their gradients and AdamW's
    two states live in host memory (4 x 4 bytes a parameter / 2 ranks), none on the device."""
    c = census()
    s = Setup(world_size=2, shard_degree=2, zero_stage=3, microbatch=1, seq_len=64,
              device_kind="cuda", fsdp_cpu_offload=True)
    hp = host_plan(c, s, HostSetup(ranks_per_node=2), 10 * GiB, "test", 1e9)
    assert hp.terms["cpu_offload_state"] == TOTAL * 4 * 4 / 2 == 854_528
    assert hp.train_per_rank == PROCESS_BASELINE + GPU_RUNTIME_HOST + 854_528
    on_device = terms(c, s)
    assert [on_device[k] for k in ("trainable_weights", "gradients", "optimizer_state")] == [0] * 3


def _folder(tmp_path: Path) -> Path:
    """A model folder with only a config.json (the planner reads no weights)."""
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["LlamaForCausalLM"]}))
    return folder


def _config(tmp_path: Path, **model) -> Path:
    cfg = {
        "max_seq_len": 64,
        "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(_folder(tmp_path)),
                  "pretrained": True, "init_device": "cpu",
                  "peft_config": {"peft_type": "LORA", "target_modules": "all-linear", "r": 4},
                  "frozen_base": {"dtype": "int8", "offload_fraction": 1.0}, **model},
        "tokenizer": {"name": "hf", "path": "not/needed/to/plan"},
        "train_loader": {"name": "text", "num_workers": 2,
                         "dataset": {"local": "x", "split": "train", "max_seq_len": 64}},
        "max_duration": "10ba", "global_train_batch_size": 8, "device_train_microbatch_size": 1,
        "optimizer": {"name": "decoupled_adamw", "lr": 1e-3}, "precision": "amp_bf16",
        "parallelism": {"sharding_strategy": "FULL_SHARD"}, "device": "gpu",
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def meta_load_refused(folder: Path) -> bool:
    """Whether this checkout still refuses init_device: meta with pretrained weights (before
    the shard-on-read loader, foundryx/loading)."""
    from foundryx.models.hf import HFCausalLMOptions

    opts = HFCausalLMOptions(pretrained_model_name_or_path=str(folder), init_device="meta")
    return any("init_device" in p for p in opts.problems())


def test_verdict_flips_with_host_memory_and_fixes_replan(tmp_path, capsys):
    path = _config(tmp_path)
    refused = meta_load_refused(tmp_path / "tiny-llama")
    roomy = make_plan(path, gpus=8, gpu="h100")
    assert roomy.fits and roomy.host.node.startswith("DGX H100")
    assert roomy.host.capacity == 2 * 10**12
    need = roomy.host.per_node
    tight = f"{need - 1}B"
    small = make_plan(path, gpus=8, gpu="h100", host_memory=tight)
    assert small.device_fits and not small.host_fits and not small.fits
    assert small.host_fixes
    for fix in small.host_fixes:
        assert fix.per_node_bytes <= small.host.capacity, fix
        if fix.overrides.startswith("--"):
            gpus, nodes = (int(x) for x in fix.overrides.split()[1::2])
            again = make_plan(path, gpus=gpus, nodes=nodes, gpu="h100", host_memory=tight)
        elif fix.overrides == "model.init_device=meta" and refused:
            continue  # re-planned once the loader's branch accepts it
        else:
            again = make_plan(path, fix.overrides.split(), gpus=8, gpu="h100", host_memory=tight)
        assert again.host_fits and again.host.per_node == fix.per_node_bytes, fix
    changes = " | ".join(f.change for f in small.host_fixes)
    assert "shard by shard" in changes and "fewer ranks per node" in changes
    assert main(["plan", str(path), "--gpus", "8", "--gpu", "h100", "--host-memory", tight]) == 1
    out = capsys.readouterr().out
    assert "host memory DOES NOT FIT" in out and "To make it fit in host memory" in out
    assert "DOES NOT FIT: device memory fits, host memory does not" in out


def test_offload_fix_and_smaller_base(tmp_path):
    """Shard-on-read already: lowering the offload fraction is what brings host memory down."""
    from foundryx.plan.host import host_fixes

    c = census()
    s = Setup(world_size=8, shard_degree=8, zero_stage=3, microbatch=1, seq_len=64,
              device_kind="cuda", lora_params=1000, lora_params_per_block=500,
              frozen_dtype="fp8", offload_fraction=1.0)
    h = HostSetup(ranks_per_node=8, load="none", workers=0)
    full = host_plan(c, s, h, GiB, "t", 1e9)
    tight = host_plan(c, s, h, full.per_node - 1, "t", 1e9)
    fixes = host_fixes(c, s, h, tight, 80 * GiB)
    offload = [f for f in fixes if "offload_fraction" in f.overrides]
    assert offload and offload[0].overrides == "model.frozen_base.offload_fraction=0.95"
    assert any(f.overrides == "model.frozen_base.dtype=nf4" for f in fixes)


def test_load_time_and_read_rate(tmp_path, capsys):
    path = _config(tmp_path, init_device="mixed")
    plan = make_plan(path, gpus=8, gpu="h100", read_rate="1MB/s")
    stored = 2 * TOTAL
    assert plan.host.load == "rank0" and plan.host.read_per_node == stored
    assert plan.host.load_seconds == pytest.approx(stored / 1e6)
    assert parse_rate("2GB/s") == 2e9 and parse_rate("500 MiB/s") == 500 * 2**20
    assert main(["plan", str(path), "--read-rate", "fast"]) == 2
    assert "--read-rate: cannot read 'fast'" in capsys.readouterr().err
    assert main(["plan", str(path), "--gpus", "8", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["host"]["per_node"] >= out["host"]["per_rank"] and out["host"]["ranks_per_node"] == 8


def test_wording_hf_loss_and_lora_counts(tmp_path, capsys):
    """A Llama's loss is planned as the fused loss (models/hf.py fuses it), not named MPT's; a
    LoRA count prints in a unit that shows it."""
    path = _config(tmp_path)
    assert main(["plan", str(path), "--gpus", "2", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "MPT" not in out and "(the fused loss: one chunk, in place)" in out
    head = out.splitlines()[0]
    assert "107k parameters" in head and "0.000B" not in head
    assert "8.19k trainable" in head


def test_prelaunch_refuses_a_run_the_node_cannot_hold(tmp_path, monkeypatch, capsys):
    """foundryx train on a GPU node whose RAM cannot hold the run: one message with the
    numbers and the fixes, exit 2, nothing built."""
    from foundryx import builders, train
    from foundryx.plan import prelaunch
    from foundryx.plan.planner import HostSpec

    path = _config(tmp_path)
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    plan = make_plan(path, gpus=2, gpu="h100")
    small = HostSpec(plan.host.per_node - 1, "this machine", 1e9)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(train, "machine_problems", lambda *args: [])  # a GPU machine, as far
    monkeypatch.setattr(train, "pick_device", lambda requested, **k: torch.device("cuda"))  # as asked
    monkeypatch.setattr(prelaunch, "gpu_facts", lambda: ("NVIDIA H100 80GB HBM3", 80 * GiB, "cuda"))
    monkeypatch.setattr(prelaunch, "this_machine", lambda: small)

    def never(*args, **kwargs):
        raise AssertionError("built before the plan check")

    monkeypatch.setattr(builders, "build_model", never)
    monkeypatch.setattr(builders, "build_tokenizer", never)
    loaded = train.load_config(path, [f"train_loader.dataset.local={data}"], world_size=2,
                               component_sections=("model", "optimizer"))
    with pytest.raises(ConfigError) as e:
        train.train(loaded)
    text = str(e.value)
    assert "of host memory per node (2 rank(s)" in text and "this machine has" in text
    assert "loading" in text and "training" in text
    assert "fix: read the checkpoint shard by shard" in text and "model.init_device=meta" in text
    assert "GiB per device" not in text  # the device fits: only the host is refused


def test_frozen_embedding_and_head_read_shard_by_shard_count_in_the_checkpoint_dtype(tmp_path):
    """Under LoRA on 2+ ranks, read shard by shard with a casting mixed-precision policy, the
    loader keeps the frozen embedding, final norm and head in the checkpoint's bf16
    (foundryx/loading/dtypes.py); the planner counts them so, and so on one rank under
    amp_bf16 (autocast computes in bf16 there). Every rank loading, a policy that does not
    cast, or one rank in fp32: the stored (master) bytes."""
    path = _config(tmp_path, init_device="meta", frozen_base={"dtype": "int8"})
    sharded = make_plan(path, gpus=2, gpu="h100")
    s, c = sharded.setup, sharded.census
    assert s.frozen_other_bytes == 2 and s.master_bytes == 4
    # int8 rows and a float32 scale per row; the embedding, head and norms in bf16; / 2 ranks
    want = (BLOCK_LINEAR * 1 + ROWS * 4 + (TOTAL - BLOCK_LINEAR) * 2) / 2
    assert terms(c, s)["frozen_weights"] == want == 72_000
    assert make_plan(path, gpus=1, gpu="h100").setup.frozen_other_bytes == 2
    for overrides, gpus in ((["model.init_device=cpu"], 2), (["precision=fp32"], 1),
                            (["parallelism.mixed_precision=FULL"], 2)):
        other = make_plan(path, overrides, gpus=gpus, gpu="h100")
        assert other.setup.frozen_other_bytes == 0, overrides
