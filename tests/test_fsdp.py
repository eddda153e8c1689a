"""Parallelism policies in one process: blocks, activation checkpointing, compile, mixed
precision, mesh shapes, meta-device materialisation, the parallelism, activation_checkpointing
and compile sections, and the deprecated fsdp_config."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from foundryx.config.schema import ActivationCheckpointingConfig, CompileConfig, ParallelismConfig
from foundryx.errors import ConfigError
from foundryx.parallel import parallelize
from foundryx.parallel.fsdp import mesh_shape, mixed_precision_policy
from foundryx.parallel.policy import blocks, checkpoint_targets


def tiny_mpt(n_layers: int = 4, **kw):
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    torch.manual_seed(0)
    return ComposerMPTCausalLM(None, d_model=32, n_heads=2, n_layers=n_layers, max_seq_len=16,
                               vocab_size=64, **kw)


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model({"input_ids": ids})
    loss = model.loss(out, {"input_ids": ids})
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_blocks_come_from_the_model_hook_in_order():
    model = tiny_mpt()
    names = [n for n, _ in blocks(model)]
    assert names == [f"model.transformer.blocks.{i}" for i in range(4)]


def test_blocks_fall_back_to_no_split_modules():
    class Layer(nn.Linear):
        pass

    class HFish(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer(4, 4) for _ in range(3))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = HFish()

    assert [n for n, _ in blocks(Wrapper())] == [f"model.layers.{i}" for i in range(3)]


def test_checkpoint_every_nth_and_by_class():
    model = tiny_mpt()
    every2 = [n for n, _ in checkpoint_targets(model, None, 2)]
    assert every2 == ["model.transformer.blocks.1", "model.transformer.blocks.3"]
    ffns = checkpoint_targets(model, ["MLP"], 1)
    assert [type(m).__name__ for _, m in ffns] == ["MLP"] * 4
    with pytest.raises(ConfigError, match="no module of class 'MPTBlok'.*did you mean 'MPTBlock'"):
        checkpoint_targets(model, ["MPTBlok"], 1)
    with pytest.raises(ConfigError, match="must be >= 1"):
        checkpoint_targets(model, None, 0)


def test_activation_checkpointing_recomputes_and_keeps_gradients():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(tiny_mpt(), ids)
    model = tiny_mpt()
    parallelize(model, activation_checkpointing=ActivationCheckpointingConfig(enabled=True, every=2))
    calls = {i: 0 for i in range(4)}
    for i, block in enumerate(model.model.transformer.blocks):
        block.ffn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    loss, grads = loss_and_grads(model, ids)
    assert calls == {0: 1, 1: 2, 2: 1, 3: 2}  # blocks 1 and 3 run forward again in backward
    assert torch.equal(loss, ref_loss)
    assert all(torch.allclose(grads[n], ref_grads[n], atol=1e-7, rtol=0) for n in ref_grads)


def test_compile_per_block_and_offload_keep_names_and_numbers():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    ref_loss, ref_grads = loss_and_grads(tiny_mpt(2), ids)
    model = tiny_mpt(2)
    keys = list(model.state_dict())
    parallelize(model, activation_checkpointing=ActivationCheckpointingConfig(enabled=True, cpu_offload=True),
                compile=CompileConfig(enabled=True, options={"backend": "eager"}))
    assert all(getattr(b, "_foundryx_compiled", False) for b in model.model.transformer.blocks)
    assert list(model.state_dict()) == keys
    loss, grads = loss_and_grads(model, ids)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    assert all(torch.allclose(grads[n], ref_grads[n], atol=1e-6) for n in ref_grads)


def test_meta_init_materialises_like_the_model_init():
    model = tiny_mpt(init_device="meta")
    assert all(p.is_meta for p in model.parameters())
    parallelize(model, None)
    assert not any(p.is_meta for p in model.parameters())
    w = model.model.transformer.blocks[0].attn.out_proj.weight
    expected = (2 / 32) ** 0.5 / (2 * 4) ** 0.5  # kaiming normal, divided by sqrt(2 * n_layers)
    assert abs(w.std().item() / expected - 1) < 0.15
    assert torch.equal(model.model.transformer.norm_f.weight, torch.ones(32))


def test_mixed_precision_policies():
    bf16, fp32 = torch.bfloat16, torch.float32
    default = mixed_precision_policy("DEFAULT", "amp_bf16")
    assert (default.param_dtype, default.reduce_dtype) == (bf16, fp32)
    pure = mixed_precision_policy("PURE", "amp_bf16")
    assert (pure.param_dtype, pure.reduce_dtype) == (bf16, bf16)
    assert mixed_precision_policy("FULL", "amp_bf16").param_dtype is None
    explicit = mixed_precision_policy({"param_dtype": "bf16", "output_dtype": "fp32"}, "fp32")
    assert (explicit.param_dtype, explicit.reduce_dtype, explicit.output_dtype) == (bf16, None, fp32)
    with pytest.raises(ConfigError, match="param_dtype: unknown dtype 'bf61'.*did you mean 'bf16'"):
        mixed_precision_policy({"param_dtype": "bf61"}, "fp32")


def test_mesh_shapes():
    assert mesh_shape(ParallelismConfig(), 8, 4) == (1, 8)
    assert mesh_shape(ParallelismConfig(sharding_strategy="HYBRID_SHARD"), 8, 4) == (2, 4)
    assert mesh_shape(ParallelismConfig(data_parallel_shard_degree=2), 8, 4) == (4, 2)
    with pytest.raises(ConfigError, match="does not divide the world size 8"):
        mesh_shape(ParallelismConfig(data_parallel_shard_degree=3), 8, 4)


SUM_ONLY_REDUCTIONS = hasattr(FSDPModule, "set_force_sum_reduction_for_comms")  # torch >= 2.8


def test_only_hybrid_sharding_on_cpu_needs_sum_reductions():
    from foundryx.parallel.fsdp import sum_only_reductions

    assert not sum_only_reductions(1, "cpu") and not sum_only_reductions(2, "cuda")


@pytest.mark.skipif(not SUM_ONLY_REDUCTIONS, reason=f"torch {torch.__version__} < 2.8 has no "
                    "set_force_sum_reduction_for_comms; runs on the modern leg")
def test_hybrid_sharding_on_gloo_uses_sum_reductions():
    from foundryx.parallel.fsdp import sum_only_reductions

    assert sum_only_reductions(2, "cpu")  # the run itself: tests/test_hybrid_gloo.py


@pytest.mark.skipif(SUM_ONLY_REDUCTIONS, reason=f"torch {torch.__version__} >= 2.8 can run "
                    "HYBRID_SHARD on gloo (tests/test_hybrid_gloo.py)")
def test_hybrid_sharding_on_gloo_needs_torch_2_8():
    from foundryx.parallel.fsdp import sum_only_reductions

    with pytest.raises(ConfigError, match="HYBRID_SHARD on CPU .gloo. needs torch >= 2.8"):
        sum_only_reductions(2, "cpu")


def test_parallelism_sections_are_typed_and_checked(quickstart_data):
    from foundryx.config import load_config

    overrides = [f"variables.data_root={quickstart_data}", "parallelism.mixd_precision=PURE",
                 "parallelism.sharding_strategy=HYBRID", "activation_checkpointing.enabled=3",
                 "activation_checkpointing.every=0", "compile.enabeld=true"]
    with pytest.raises(ConfigError) as e:
        load_config("yamls/quickstart.yaml", overrides)
    msg = str(e.value)
    assert "parallelism.mixd_precision: unknown key (did you mean 'mixed_precision'?)" in msg
    assert "parallelism.sharding_strategy" in msg and "did you mean 'HYBRID_SHARD'" in msg
    assert "activation_checkpointing.enabled: expected true/false" in msg
    assert "activation_checkpointing.every: expected an integer >= 1, got 0" in msg
    assert "compile.enabeld: unknown key (did you mean 'enabled'?)" in msg
    ok = load_config("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}",
                                               "parallelism={}", "activation_checkpointing.every=2"])
    assert ok.cfg.parallelism == ParallelismConfig()
    assert ok.cfg.activation_checkpointing == ActivationCheckpointingConfig(every=2)
    assert ok.cfg.compile == CompileConfig()
    plain = load_config("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}"])
    assert plain.cfg.parallelism is None and plain.cfg.activation_checkpointing == ActivationCheckpointingConfig()


FSDP_CONFIG = ["fsdp_config.sharding_strategy=HYBRID_SHARD", "fsdp_config.mixed_precision=PURE",
               "fsdp_config.activation_checkpointing=true", "fsdp_config.activation_checkpointing_every=2",
               "fsdp_config.activation_cpu_offload=true", "fsdp_config.compile=true",
               "fsdp_config.compile_options.backend=eager", "fsdp_config.verbose=true"]
NEW_FORM = ["parallelism.sharding_strategy=HYBRID_SHARD", "parallelism.mixed_precision=PURE",
            "activation_checkpointing.enabled=true", "activation_checkpointing.every=2",
            "activation_checkpointing.cpu_offload=true", "compile.enabled=true",
            "compile.options.backend=eager", "parallelism.verbose=true"]


def test_deprecated_fsdp_config_means_the_new_sections(quickstart_data, monkeypatch):
    from foundryx.config import deprecations, load_config

    said: list[str] = []  # every warning the loader emits, whatever handlers earlier tests left
    monkeypatch.setattr(deprecations.log, "warning", lambda msg, *a: said.append(msg % a))
    data = f"variables.data_root={quickstart_data}"
    old = load_config("yamls/quickstart.yaml", [data, *FSDP_CONFIG])
    new = load_config("yamls/quickstart.yaml", [data, *NEW_FORM])
    assert (old.cfg.parallelism, old.cfg.activation_checkpointing, old.cfg.compile) == (
        new.cfg.parallelism, new.cfg.activation_checkpointing, new.cfg.compile)
    assert old.resolved == new.resolved  # --dry-run prints the new form
    assert said == [
        "fsdp_config is deprecated: write parallelism: {sharding_strategy: HYBRID_SHARD, "
        "mixed_precision: PURE, verbose: true}, activation_checkpointing: {enabled: true, every: 2, "
        "cpu_offload: true}, compile: {enabled: true, options: {backend: eager}} instead"]
    said.clear()
    empty = load_config("yamls/quickstart.yaml", [data, "fsdp_config={}"])
    off = load_config("yamls/quickstart.yaml", [data, "fsdp_config=null"])
    assert empty.cfg.parallelism == ParallelismConfig() and off.cfg.parallelism is None
    assert said == ["fsdp_config is deprecated: write parallelism: {} instead",
                    "fsdp_config is deprecated: write parallelism: null instead"]


def test_deprecated_fsdp_config_problems_name_its_keys(quickstart_data):
    from foundryx.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config("yamls/quickstart.yaml", [
            f"variables.data_root={quickstart_data}", "fsdp_config.mixd_precision=PURE",
            "fsdp_config.sharding_strategy=HYBRID", "fsdp_config.activation_checkpointing=3",
            "fsdp_config.activation_checkpointing_every=0"])
    msg = str(e.value)
    assert "4 problems" in msg, msg
    assert "fsdp_config.mixd_precision: unknown key (did you mean 'mixed_precision'?)" in msg
    assert "fsdp_config.sharding_strategy" in msg and "did you mean 'HYBRID_SHARD'" in msg
    assert "fsdp_config.activation_checkpointing: expected true/false" in msg
    assert "fsdp_config.activation_checkpointing_every: expected an integer >= 1, got 0" in msg


def test_fsdp_config_and_its_replacements_together_are_an_error(quickstart_data):
    from foundryx.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}",
                                              "fsdp_config.compile=true", "parallelism={}",
                                              "compile.enabled=false"])
    msg = str(e.value)
    assert "fsdp_config: given together with parallelism and compile, which replace it" in msg, msg
    assert "drop fsdp_config and write its settings in the new sections: parallelism: {}, " \
           "compile: {enabled: true}" in msg


def test_checkpointing_and_compile_apply_without_fsdp(quickstart_data):
    """A single process, parallelism null: the sections still reach the model."""
    from foundryx import builders
    from foundryx.config import load_config

    loaded = load_config("yamls/quickstart.yaml", [
        f"variables.data_root={quickstart_data}", "activation_checkpointing.enabled=true",
        "activation_checkpointing.every=2", "compile.enabled=true", "compile.options.backend=eager"])
    assert loaded.cfg.parallelism is None
    # The hooks below go on after compiling, and dynamo does not guard on module hooks
    # (skip_nnmodule_hook_guards): torch 2.14 reuses an earlier test's graph of the same
    # block forward, without them.
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = loss_and_grads(tiny_mpt(), ids)
    model = builders.build_parallelism(loaded.cfg, tiny_mpt())
    assert all(getattr(b, "_foundryx_compiled", False) for b in model.model.transformer.blocks)
    calls = {i: 0 for i in range(4)}
    for i, block in enumerate(model.model.transformer.blocks):
        block.ffn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    loss, grads = loss_and_grads(model, ids)
    assert calls == {0: 1, 1: 2, 2: 1, 3: 2}  # every 2nd block recomputed in backward
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    assert all(torch.allclose(grads[n], ref_grads[n], atol=1e-6) for n in ref_grads)


def test_composer_contract_check():
    from foundryx.parallel.contract import check_composer_contract, composer_sees_fsdp

    model = tiny_mpt(2)
    assert not composer_sees_fsdp(model)
    with pytest.raises(RuntimeError, match="Composer would wrap it in DDP as well.*State.fsdp_enabled"):
        check_composer_contract(model)


def test_llama_style_pretraining_config_is_valid(quickstart_data):
    from test_mpt_model import param_count

    from foundryx.config import load_config

    loaded = load_config("yamls/pretrain/llama-style-1b.yaml", [
        f"variables.data_local={quickstart_data}/mds", f"variables.tokenizer_name={quickstart_data}/tokenizer",
        "variables.max_seq_len=128", "eval_loader.dataset.split=val",
    ], world_size=8)
    model = {k: v for k, v in loaded.cfg.model.items() if k != "name"}
    assert model["attn_config"]["rope"] and model["attn_config"]["kv_n_heads"] == 4
    assert (model["norm_type"], model["ffn_config"]["ffn_type"], model["no_bias"]) == ("rmsnorm", "swiglu", True)
    assert 1.2e9 < param_count(model) < 1.35e9
    assert loaded.cfg.activation_checkpointing.every == 2 and loaded.cfg.compile.enabled
    assert loaded.cfg.parallelism.mixed_precision == "PURE"
