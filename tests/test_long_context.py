"""Long context (issue 52, one device): the MLP tiled along the sequence equals the untiled
MLP, offloaded checkpoints equal checkpoints kept on the device (losses and gradients to
float32 rounding), the planner's ``--search max_seq_len`` answers from the plan's own terms, and
the shipped long recipe trains as it ships at a tiny size."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from foundryx.parallel.offload_activations import ActivationOffload, offload_activations
from foundryx.parallel.tiling import mlp_modules, tile_mlp
from foundryx.parallel.wrappers import checkpoint_activations

ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(seed: int = 0, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, vocab_size=128, **over)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def with_lora(model, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(target_modules="all-linear", r=4, lora_alpha=8,
                                            lora_dropout=dropout, init_lora_weights=False))


def step(model, ids, seed: int = 3):
    torch.manual_seed(seed)  # the same dropout masks on both sides
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=rtol, atol=atol, msg=n)


def blocks_of(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def test_tiled_mlp_equals_untiled():
    """LoRA over every linear layer (the MLP's adapters train through the tiles), 37 tokens a
    sequence in tiles of 8 (the last one short), under activation checkpointing as the long
    recipe runs it: the loss and every gradient equal the untiled model's."""
    ref = with_lora(tiny_llama()).train()
    tiled = copy.deepcopy(ref)
    mlps = mlp_modules(tiled, blocks_of(tiled))
    assert len(mlps) == 2
    for m in mlps:
        tile_mlp(m, 8)
    for model in (ref, tiled):
        for b in blocks_of(model):
            checkpoint_activations(b)
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    calls = []
    hook = mlps[0].down_proj.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    a, b = step(ref, ids), step(tiled, ids)
    hook.remove()
    assert_same(a, b)
    # the tiled MLP saw tiles of at most 8 of the 74 tokens: forward, recompute, backward
    assert max(calls) == 8 and sum(calls) == 3 * 74, calls


def test_tiled_mlp_dropout_reruns_the_forward_masks():
    """With LoRA dropout each tile draws its own masks; the backward's rerun draws the same
    ones: the gradients equal those of the same tiles run with plain autograd (each tile's
    output kept, concatenated) from the same random state."""
    model = with_lora(tiny_llama(), dropout=0.3).train()
    mlp = mlp_modules(model, blocks_of(model))[0]
    x = torch.randn(3, 11, 32)
    params = [p for p in mlp.parameters() if p.requires_grad]
    w = torch.randn(3, 11, 32)

    torch.manual_seed(5)
    xr = x.clone().requires_grad_()
    flat = xr.reshape(-1, 32)
    ref = torch.cat([mlp(flat[i:i + 8]) for i in range(0, 33, 8)]).view(3, 11, 32)
    ref_grads = torch.autograd.grad((ref * w).sum(), [xr, *params])

    tile_mlp(mlp, 8)
    torch.manual_seed(5)
    xt = x.clone().requires_grad_()
    out = mlp(xt)
    torch.manual_seed(99)  # backward must not depend on the random state it finds
    grads = torch.autograd.grad((out * w).sum(), [xt, *params])
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    assert (ref == 0).sum() == 0 and grads[0].abs().sum() > 0


def test_tiled_mlp_full_finetuning_and_bf16_autocast():
    """Every weight trains (their gradients come out of the tiles) and under bf16 autocast
    the rerun in backward computes in bf16 as the forward did: equal to the untiled MLP's."""
    ref = tiny_llama().train()
    tiled = copy.deepcopy(ref)
    for m in mlp_modules(tiled, blocks_of(tiled)):
        tile_mlp(m, 16)
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(1))
    assert_same(step(ref, ids), step(tiled, ids))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = step(ref, ids), step(tiled, ids)
    assert_same(a, b, rtol=2e-2, atol=1e-3)  # bf16 products, the same ones on both sides


def test_offloaded_checkpoints_equal_checkpoints():
    """``activation_checkpointing.cpu_offload`` with checkpointing: each block's input goes to
    host memory (a real copy on CPU) and comes back for the recompute; the loss and every
    gradient equal the run that keeps them, and what was offloaded is the blocks' inputs."""
    ref = with_lora(tiny_llama(), 0.1).train()
    off = copy.deepcopy(ref)
    for b in blocks_of(ref):
        checkpoint_activations(b)
    offload = ActivationOffload("cpu", pin=False, min_bytes=1)
    for b in blocks_of(off):
        checkpoint_activations(b)
        offload_activations(b, offload)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    packed = []
    real = offload._to_host
    offload._to_host = lambda t: (packed.append(t.shape), real(t))[1]
    assert_same(step(ref, ids), step(off, ids))
    # only the two checkpointed blocks' hidden-state inputs: batch x seq x d_model each
    assert packed == [torch.Size([2, 40, 32])] * 2, packed
    assert_same(step(ref, ids, seed=4), step(off, ids, seed=4))  # a second step: reset, same


def test_offloaded_activations_without_checkpointing():
    """Offload without checkpointing keeps everything a block saves on the host: equal too."""
    ref = tiny_llama().train()
    off = copy.deepcopy(ref)
    offload = ActivationOffload("cpu", pin=False, min_bytes=64)
    for b in blocks_of(off):
        offload_activations(b, offload)
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    assert_same(step(ref, ids), step(off, ids))
    assert offload.offloaded_bytes > 2 * 48 * 32 * 4  # more than the blocks' inputs


def test_tiling_config_auto_and_errors(caplog):
    """``tiling: auto`` tiles the MLPs and the RMS norms from ``auto_tokens`` tokens a
    microbatch, saying so in one line; ``true`` on a model without them says what to set."""
    import logging

    from foundryx.config.schema import TilingConfig
    from foundryx.errors import ConfigError
    from foundryx.parallel.parallelize import apply_tiling

    model = tiny_llama()
    bl = blocks_of(model)
    assert apply_tiling(model, bl, TilingConfig(auto_tokens=1024), 512) == []
    with caplog.at_level(logging.INFO, logger="foundryx.parallel.parallelize"):
        said = apply_tiling(model, bl, TilingConfig(auto_tokens=1024), 2048)
    # d_model tokens a tile; 2 norms a block and the final one
    assert said == ["MLP tiled by 32 tokens in 2 blocks", "5 RMS norms tiled by 32 tokens"]
    assert sum("tiling: MLP tiled by 32 tokens" in r.message for r in caplog.records) == 1
    with pytest.raises(ConfigError, match="tiling.mlp_modules"):
        apply_tiling(model, bl, TilingConfig(mlp=True, mlp_modules=["NoSuchMLP"]), 64)
    with pytest.raises(ConfigError, match="tiling.norm: false"):
        apply_tiling(nn.Sequential(nn.Linear(2, 2)), [], TilingConfig(mlp=False, norm=True), 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rms_norm_equals_hf(dtype):
    """The tiled RMS norm against Hugging Face's LlamaRMSNorm: output, input gradient and (full
    fine-tuning) weight gradient, float32 and bf16 (the bf16 weight of a frozen-only unit)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from foundryx.parallel.tiling import tile_rms_norm

    torch.manual_seed(0)
    ref = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.add_(torch.randn(48).to(dtype))
    norm = copy.deepcopy(ref)
    tile_rms_norm(norm, 7)
    x = (3 * torch.randn(2, 19, 48)).to(dtype)
    g = torch.randn(2, 19, 48).to(dtype)
    outs = []
    for m in (ref, norm):
        xi = x.clone().requires_grad_()
        y = m(xi)
        dx, dw = torch.autograd.grad(y, [xi, m.weight], g)
        outs.append((y, dx, dw))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(*outs):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, **tol)
    assert outs[1][0].grad_fn.name().startswith("_TiledRMSNorm")


def test_tiled_model_equals_untiled_under_autocast():
    """A LoRA model with its MLPs and norms tiled (13-token tiles of 2 x 40 tokens), its
    blocks checkpointed and their inputs offloaded, under bf16 autocast as the long recipe
    runs: the loss and the adapters' gradients equal the plain model's to bf16 rounding."""
    from foundryx.config.schema import TilingConfig
    from foundryx.parallel.parallelize import apply_tiling

    ref = with_lora(tiny_llama()).train()
    long = copy.deepcopy(ref)
    assert len(apply_tiling(long, blocks_of(long), TilingConfig(mlp_tokens=13, auto_tokens=80), 80)) == 2
    offload = ActivationOffload("cpu", pin=False, min_bytes=1)
    for b in blocks_of(long):
        checkpoint_activations(b)
        offload_activations(b, offload)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = step(ref, ids), step(long, ids)
    assert_same(a, b, rtol=3e-2, atol=2e-3)


class _Square(nn.Module):
    def forward(self, x):
        return x * x


def test_tile_mlp_short_input_runs_untiled():
    m = _Square()
    tile_mlp(m, 8)
    x = torch.randn(1, 8, 3, requires_grad=True)
    y = m(x)
    assert y.grad_fn.name() == "MulBackward0"  # not the tiled function: one tile's worth


# ---------------------------------------------------------------------------------------
# The shipped recipe, as it ships, at a tiny size
# ---------------------------------------------------------------------------------------
LONG_RECIPE = "yamls/finetune/llama-3.1-8b-lora-long.yaml"


@pytest.mark.slow
def test_long_recipe_trains_as_it_ships(quickstart_data, tmp_path, monkeypatch):
    """yamls/finetune/llama-3.1-8b-lora-long.yaml on one CPU process with a tiny Llama of the
    8B release's shape (bf16 safetensors), 128 tokens a sequence: its LoRA, bf16 base, amp_bf16,
    checkpointing with offloaded inputs and auto tiling (its threshold lowered to this length,
    48-token tiles: three a sequence) as the recipe has them; the loss falls and the checkpoint
    holds the adapters only."""
    from test_recipes_2rank import check_adapter_only, tiny_llama

    from foundryx.checkpoint.layout import complete_checkpoints
    from foundryx.config import load_config
    from foundryx.loggers.jsonl import read_metrics
    from foundryx.train import train

    monkeypatch.chdir(tmp_path)
    model = tiny_llama("llama-3.1-8b", tmp_path / "model", quickstart_data / "tokenizer")
    overrides = [f"variables.model_path={model}", f"variables.data_root={quickstart_data}",
                 "variables.max_seq_len=128", "tiling.auto_tokens=128", "tiling.mlp_tokens=48",
                 "device=cpu", "max_duration=4ba", "global_train_batch_size=2",
                 "device_train_microbatch_size=1", "save_interval=4ba", "optimizer.lr=5.0e-3",
                 "scheduler.t_warmup=0ba", "progress_bar=false",
                 f"loggers.jsonl.path={tmp_path}/m.jsonl"]
    trainer = train(load_config(ROOT / LONG_RECIPE, overrides, world_size=1))
    trainer.close()
    modules = list(trainer.state.model.modules())
    assert [getattr(m, "_foundryx_mlp_tokens", 0) for m in modules].count(48) == 2
    assert [getattr(m, "_foundryx_norm_tokens", 0) for m in modules].count(48) == 5
    offload = {getattr(m, "_foundryx_activation_offload", None) for m in modules} - {None}
    # the two blocks' inputs, 128 tokens x d_model 128 in bf16 each, in host memory
    assert len(offload) == 1 and next(iter(offload)).offloaded_bytes == 2 * 128 * 128 * 2
    losses = [r["loss/train/total"] for r in read_metrics(tmp_path / "m.jsonl")
              if "loss/train/total" in r]
    assert len(losses) == 4 and sum(losses[-2:]) / 2 < losses[0], losses
    saved = complete_checkpoints(tmp_path / "runs/llama-3.1-8b-lora-long/checkpoints")
    assert saved and saved[0][1].batch == 4
    check_adapter_only(saved[0][0])


# ---------------------------------------------------------------------------------------
# The planner: --search max_seq_len
# ---------------------------------------------------------------------------------------
SHAPE_8B = ["variables.model_path=yamls/shapes/llama-3.1-8b"]


def test_search_max_seq_len_answers_from_the_plan(monkeypatch, capsys):
    """The longest length the search prints fits when the recipe is planned at it, the next
    1,024 tokens do not (each planned afresh, as `foundryx plan` plans a config), and on an
    80 GB H100 it is at least the recipe's 524,288 tokens."""
    from foundryx.cli import main
    from foundryx.plan.planner import make_plan

    monkeypatch.chdir(ROOT)
    answer = make_plan(LONG_RECIPE, SHAPE_8B).longest_sequence()
    assert answer.seq_len >= 524288 and answer.ran_out == "activations"
    fit = make_plan(LONG_RECIPE, [*SHAPE_8B, f"variables.max_seq_len={answer.seq_len}"])
    past = make_plan(LONG_RECIPE, [*SHAPE_8B, f"variables.max_seq_len={answer.next_len}"])
    assert fit.fits and not past.fits and answer.next_len == answer.seq_len + 1024
    assert fit.per_device_bytes == answer.device_bytes
    assert fit.host.terms["offloaded_activations"] == 32 * answer.seq_len * 4096 * 2
    assert main(["plan", LONG_RECIPE, *SHAPE_8B, "--search", "max_seq_len"]) == 0
    out = capsys.readouterr().out
    assert f"{answer.seq_len:,} tokens (variables.max_seq_len={answer.seq_len})" in out


def test_search_names_what_runs_out(monkeypatch):
    """Host memory that cannot hold the offloaded checkpoints stops the search there; a device
    that cannot hold the weights fits no length."""
    from foundryx.plan.planner import make_plan

    monkeypatch.chdir(ROOT)
    host = make_plan(LONG_RECIPE, SHAPE_8B, host_memory="64GiB").longest_sequence()
    # 32 block inputs of 8 KiB a token in 64 GiB less the process's own ~5 GiB
    assert host.ran_out == "host" and 200_000 < host.seq_len < 64 * 2**30 // (32 * 8192)
    small = make_plan(LONG_RECIPE, SHAPE_8B, gpu_memory="12GB").longest_sequence()
    assert small.seq_len == 0 and small.ran_out == "weights"


def test_plan_check_says_the_longest_that_fits():
    """A length that does not fit stops the run before anything is built (plan_check), with
    the longest length that does and the part that runs out."""
    from foundryx.config import load_config
    from foundryx.errors import ConfigError
    from foundryx.plan.planner import HostSpec
    from foundryx.plan.prelaunch import check_fits

    loaded = load_config(ROOT / LONG_RECIPE, [*SHAPE_8B, "variables.max_seq_len=1048576"],
                         world_size=1, component_sections=("model", "optimizer"))
    with pytest.raises(ConfigError) as e:
        check_fits(loaded, ("NVIDIA H100 80GB HBM3", 80 * 10**9, "cuda"),
                   HostSpec(2 * 2**40, "a 2 TiB node", 1e10))
    said = "\n".join(e.value.problems)
    assert "plan_check: fix: the longest sequence that fits is" in said
    assert "(variables.max_seq_len=" in said and "at 1,048,576 activations" in said


# ---------------------------------------------------------------------------------------
# The estimator at the recipe's length
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_estimator_traces_the_long_recipe_with_host_apart():
    """python -m benchmarks.flagship_estimate --recipe (the long recipe) on the tiny Llama shape at
    128 tokens, tiled (16-token tiles): the offloaded checkpoints are host memory (2 layers x
    128 tokens x d_model 64 in bf16), not in the device's peak; the untiled step on the device
    is larger; --layers 1 scales the per-layer categories back to the shape's 2 layers."""
    from benchmarks import flagship_estimate

    tiny = ROOT / "benchmarks" / "gpu_runbook" / "shapes" / "llama-tiny"
    recipe = ROOT / LONG_RECIPE
    tiled = ["tiling.auto_tokens=64", "tiling.mlp_tokens=16"]
    row = flagship_estimate.estimate("bf16", tiny, 1, 128, tiled, recipe)
    assert row["host_peak_gib"] * 2**30 == 2 * 128 * 64 * 2
    kept = flagship_estimate.estimate("bf16", tiny, 1, 128,
                                      [*tiled, "activation_checkpointing.cpu_offload=false"], recipe)
    assert "host_peak_gib" not in kept and kept["peak_gib"] > row["peak_gib"]
    one = flagship_estimate.estimate("bf16", tiny, 1, 128, tiled, recipe, layers=1)
    assert one["traced_layers"] == 1 and one["host_peak_gib"] == row["host_peak_gib"]
    assert one["categories"]["frozen base"] == pytest.approx(row["categories"]["frozen base"])


def test_long_context_table_arithmetic(tmp_path):
    """python -m benchmarks.long_context: the line through two traces and its longest length with the
    planner's margin and context, by hand; the 512K step's attention FLOPs as the census's
    flash kernel counts them (benchmarks/instruments/fake_step.py), forward, recompute and 2.5x backward."""
    import json

    from benchmarks import long_context as lc

    for seq, peak in ((1024, 10.0), (3072, 14.0)):
        (tmp_path / f"{seq}.json").write_text(json.dumps({"peer": {"seq": seq, "peak_gib": peak}}))
    b0, b1, _ = lc.line([tmp_path / "3072.json", tmp_path / "1024.json"], "peer")
    assert (b0, b1 * 1024) == pytest.approx((8.0, 2.0))
    # (23 GiB - 1 GiB context) / 1.1 = 20 GiB usable: (20 - 8) / 2 GiB per 1K = 6K tokens
    assert lc.longest_on_line(b0, b1, 23.0) == 6 * 1024
    from benchmarks.instruments import fake_step

    paper = lc.on_paper(4096)
    one = fake_step.attention_flops(torch.Size([1, 32, 4096, 128]), torch.Size([1, 8, 4096, 128]),
                                    True)
    assert paper["attention_tflop"] * 1e12 == pytest.approx(32 * one * 4.5)
    assert paper["copy_gib_each_way"] == 32 * 4096 * 4096 * 2 / 2**30
