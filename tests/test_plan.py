"""foundryx plan: the memory terms, the ZeRO arithmetic to the byte, the counts against real
models, suggestions that re-plan to what they promise, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from foundryx.cli import main
from foundryx.errors import ConfigError
from foundryx.plan.census import build_meta, take_census
from foundryx.plan.gpus import GiB, parse_memory
from foundryx.plan.memory import terms
from foundryx.plan.planner import flops_per_token, make_plan

ROOT = Path(__file__).parents[1]

MPT = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 3, "max_seq_len": 64,
       "vocab_size": 256, "expansion_ratio": 4, "attn_config": {"rope": True},
       "ffn_config": {"ffn_type": "swiglu"}, "norm_type": "rmsnorm", "no_bias": True}
LLAMA = {"name": "hf_causal_lm", "pretrained": False, "config": {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 64}}


def _write(tmp_path: Path, model: dict, **top) -> Path:
    import yaml

    cfg = {
        "max_seq_len": 64, "model": model,
        "tokenizer": {"name": "hf", "path": "not/needed/to/plan"},
        "train_loader": {"name": "text", "dataset": {"local": "on/the/cluster", "split": "train",
                                                     "max_seq_len": 64}},
        "max_duration": "10ba", "global_train_batch_size": 8, "device_train_microbatch_size": 2,
        "optimizer": {"name": "decoupled_adamw", "lr": 1e-3}, "precision": "amp_bf16",
        "device": "gpu", **top,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_census_counts_what_the_real_model_holds():
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    model, shape, _ = build_meta(MPT)
    census = take_census(model, shape)
    real = ComposerMPTCausalLM(options=None, **{k: v for k, v in MPT.items() if k != "name"})
    assert census.total == sum(p.numel() for p in real.parameters())
    assert census.matmul == real.n_matmul_params
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long)}
    assert flops_per_token(census, 64) * 2 * 64 == real.flops_per_batch(batch)


def test_zero_stages_to_the_byte(tmp_path):
    """bf16 mixed precision and AdamW: 2 bytes per bf16 weight and gradient and 12 bytes of
    fp32 master weight and Adam moments per trainable parameter (16), the 12 sharded at stage
    1, the gradients too at stage 2, everything at stage 3 (FSDP2's fp32 weight 4 + gradient 4
    + Adam 8, the same 16 / N)."""
    path = _write(tmp_path, MPT, parallelism={"sharding_strategy": "FULL_SHARD"},
                  global_train_batch_size=16)  # 2 microbatches per step: gradients held throughout
    plan = make_plan(path, gpus=4, gpu="h100")
    p, s = plan.census.total, plan.setup
    assert (s.zero_stage, s.shard_degree, s.grad_accum) == (3, 4, 2)
    assert p % 4 == 0  # so each division below is exact: the planner's bytes, not a bound
    static = {z: sum(terms(plan.census, replace(s, zero_stage=z))[k] for k in
                     ("trainable_weights", "gradients", "optimizer_state")) for z in range(4)}
    assert static == {0: 16 * p, 1: 2 * p + 2 * p + 12 * p // 4, 2: 2 * p + 14 * p // 4,
                      3: 16 * p // 4}
    stage1 = terms(plan.census, replace(s, zero_stage=1))
    assert (stage1["gradients"], stage1["optimizer_state"]) == (2 * p, 8 * p // 4)
    assert plan.by_sharding["none"] > plan.by_sharding["optimizer"] > plan.by_sharding["+gradients"]
    assert plan.by_sharding["+weights"] == plan.per_device_bytes


def test_lora_counts_match_the_adapted_model(tmp_path):
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.peft.lora import apply_lora
    from foundryx.models.peft.options import LoraOptions

    lora = {"target_modules": ["Wqkv", "down_proj"], "r": 4}
    plan = make_plan(_write(tmp_path, {**MPT, "peft_config": lora}), gpu="h100")
    real = ComposerMPTCausalLM(options=None, **{k: v for k, v in MPT.items() if k != "name"})
    apply_lora(real, LoraOptions(**lora))
    trainable = sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert plan.setup.lora_params == trainable
    assert plan.terms["optimizer_state"] == 8 * trainable
    full = make_plan(_write(tmp_path, MPT), gpu="h100")
    assert plan.terms["optimizer_state"] < full.terms["optimizer_state"] / 10


def test_activation_checkpointing_and_microbatch_move_activations(tmp_path):
    base = make_plan(_write(tmp_path, LLAMA), gpu="h100")
    ac = make_plan(_write(tmp_path, LLAMA, activation_checkpointing=True), gpu="h100")
    assert ac.terms["activations"] < base.terms["activations"]
    double = make_plan(_write(tmp_path, LLAMA, device_train_microbatch_size=4), gpu="h100")
    assert double.terms["activations"] > 1.9 * base.terms["activations"]
    # the fused loss holds one chunk of logits, whatever the microbatch; the model's own
    # loss (fused_loss: false) holds them all
    assert base.census.shape.fused_loss
    assert double.terms["logits_and_loss"] < 2 * base.terms["logits_and_loss"]
    whole = {**LLAMA, "fused_loss": False}
    one, two = (make_plan(_write(tmp_path, whole, device_train_microbatch_size=m), gpu="h100")
                for m in (2, 4))
    assert two.terms["logits_and_loss"] == 2 * one.terms["logits_and_loss"]


def test_suggestions_replan_to_what_they_promise(tmp_path):
    """Each suggestion's overrides, applied to the config, give the total it printed."""
    path = _write(tmp_path, LLAMA, device_train_microbatch_size=8)
    roomy = make_plan(path, gpu="h100")
    fixed = roomy.terms["context"]
    memory = f"{fixed + int(0.7 * (roomy.per_device_bytes - fixed))}B"  # 70% of what it needs
    tight = make_plan(path, gpu="h100", gpu_memory=memory)
    assert not tight.fits and tight.suggestions
    for sug in tight.suggestions:
        assert sug.per_device_bytes <= tight.capacity
        if sug.overrides.startswith("--"):
            continue
        again = make_plan(path, sug.overrides.split(), gpu="h100", gpu_memory=memory)
        assert again.per_device_bytes == sug.per_device_bytes, sug
        assert again.fits
    mb = tight.largest_microbatch
    assert 0 < mb < 8
    # (a batch that the microbatch divides: the config check comes first)
    assert make_plan(path, [f"global_train_batch_size={8 * mb}", f"device_train_microbatch_size={mb}"],
                     gpu="h100", gpu_memory=memory).fits
    assert not make_plan(path, [f"global_train_batch_size={8 * (mb + 1)}",
                                f"device_train_microbatch_size={mb + 1}"],
                         gpu="h100", gpu_memory=memory).fits


def test_large_model_standard_arithmetic():
    """Llama 3.1 70B full fine-tuning, bf16 + AdamW, FSDP2 over 64 H100s: the static terms are
    16 bytes per parameter / 64, and the planner says it does not fit on 8."""
    cfg = ROOT / "yamls" / "shapes" / "llama-3.1-70b"
    model, shape, _ = build_meta({"name": "hf_causal_lm", "pretrained_model_name_or_path": str(cfg)})
    census = take_census(model, shape)
    assert 70.5e9 < census.total < 70.6e9


def test_cli_json_and_exit_codes(tmp_path, capsys):
    path = _write(tmp_path, MPT, parallelism={"sharding_strategy": "FULL_SHARD"})
    assert main(["plan", str(path), "--gpus", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["per_device_bytes"] == sum(out["terms"].values())
    assert set(out["by_sharding"]) == {"none", "optimizer", "+gradients", "+weights"}
    assert main(["plan", str(path), "--gpu-memory", "1MB"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "total" in text
    assert main(["plan", str(path), "--search", "microbatch"]) == 0
    assert "largest microbatch that fits" in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--gpu", "h10"], "unknown GPU 'h10' (did you mean 'h100'"),
    (["--gpu-memory", "80 gigs"], "cannot read '80 gigs'"),
])
def test_bad_device_arguments(tmp_path, capsys, args, expected):
    path = _write(tmp_path, MPT)
    assert main(["plan", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_hub_name_offline_says_use_a_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _write(tmp_path, {"name": "hf_causal_lm",
                             "pretrained_model_name_or_path": "nobody/not-cached-model"})
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not in the Hugging Face cache" in err and "--local-dir" in err


def test_missing_sequence_length_is_named(tmp_path):
    path = _write(tmp_path, {**LLAMA})
    text = path.read_text().replace("max_seq_len: 64\n", "", 1)
    path.write_text(text)
    with pytest.raises(ConfigError, match="max_seq_len"):
        make_plan(path, gpu="h100")


def test_memory_units():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("79.1 GiB") == int(79.1 * GiB)


def test_train_stops_before_building_when_the_run_cannot_fit(quickstart_data, monkeypatch, caplog):
    """On a GPU, foundryx train plans first: a run that cannot fit stops with the plan's
    suggestions before a model or a dataloader is built; plan_check: false skips the check."""
    from foundryx import builders, train
    from foundryx.plan import prelaunch
    from foundryx.plan.planner import plan_loaded

    overrides = [f"variables.data_root={quickstart_data}"]
    loaded = train.load_run_config(ROOT / "yamls" / "quickstart.yaml", overrides)
    need = plan_loaded(loaded, 1, "h100", "cuda", None, 80 * GiB)
    fixed = need.terms["context"]
    small = fixed + int(0.9 * (need.per_device_bytes - fixed))  # 90% of what it needs
    expected = plan_loaded(loaded, 1, "h100", "cuda", None, small).suggestions
    assert expected
    monkeypatch.setattr(train, "pick_device", lambda requested, **k: torch.device("cuda"))
    monkeypatch.setattr(prelaunch, "gpu_facts", lambda: ("NVIDIA H100 80GB HBM3", small, "cuda"))

    def never(*args, **kwargs):
        raise AssertionError("built before the plan check")

    monkeypatch.setattr(builders, "build_model", never)
    monkeypatch.setattr(builders, "build_dataloader", never)
    with pytest.raises(ConfigError) as e:
        train.train(loaded)
    text = str(e.value)
    assert "needs an estimated" in text and "plan_check: false" in text
    assert f"fix: {expected[0].change}" in text
    loaded = train.load_run_config(ROOT / "yamls" / "quickstart.yaml", overrides + ["plan_check=false"])
    monkeypatch.setattr(train, "get_device", never)
    with pytest.raises(AssertionError, match="built before the plan check"):
        train.train(loaded)  # no check: it goes on to the GPU (and the stub stops it)


def test_activations_match_what_autograd_saves(tmp_path):
    """The activation term is the bytes of the tensors autograd keeps for backward in a real
    MPT forward pass (fp32 on CPU), the fused loss's own saved gradients aside."""
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    path = _write(tmp_path, MPT, precision="fp32", device="cpu")
    plan = make_plan(path, gpu="cpu")
    model = ComposerMPTCausalLM(options=None, **{k: v for k, v in MPT.items() if k != "name"})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.zeros(2, 64, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(model(batch), batch)
    vocab, d = MPT["vocab_size"], MPT["d_model"]
    loss_saved = vocab * d * 4 + 2 * 63 * d * 4  # the fused loss's weight and input gradients
    kept = sum(saved.values()) - loss_saved
    assert abs(plan.terms["activations"] - kept) <= 0.05 * kept, (plan.terms["activations"], kept)


def test_cpu_device_has_no_gpu_overheads(tmp_path):
    path = _write(tmp_path, MPT)
    cpu = make_plan(path, gpu="cpu", gpu_memory="1GiB")
    gpu = make_plan(path, gpu="h100")
    assert cpu.device == "cpu" and cpu.capacity == GiB and cpu.peak_flops is None
    assert cpu.terms["context"] == 9 * 2**20 and cpu.terms["fragmentation"] == 0
    assert gpu.terms["context"] == GiB and gpu.terms["fragmentation"] > 0


def test_gradients_and_activations_peak_apart_unless_accumulating(tmp_path):
    """Without gradient accumulation the activations are freed as gradients are made, so the
    total is less than the sum of both; with it the gradients are held through the forward."""
    one = make_plan(_write(tmp_path, MPT, global_train_batch_size=2), gpu="h100")
    assert one.setup.grad_accum == 1 and one.terms["not_held_together"] < 0
    accum = make_plan(_write(tmp_path, MPT, global_train_batch_size=4), gpu="h100")
    assert accum.setup.grad_accum == 2
    t = accum.terms
    assert accum.per_device_bytes - one.per_device_bytes >= t["gradients"] - 1


def test_dry_run_prints_config_numbers_and_plan_then_problems(tmp_path, capsys):
    """The README's `foundryx train --dry-run yamls/mpt-1b.yaml` on a fresh clone (no data
    folder): the resolved config, the derived numbers and the plan, then the two missing-folder
    problems, exit 2."""
    missing = tmp_path / "no-data-here"
    assert main(["train", "--dry-run", str(ROOT / "yamls" / "mpt-1b.yaml"),
                 f"variables.data_local={missing}"]) == 2
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert out.index("# resolved config") < out.index("# derived numbers") < out.index("foundryx plan:")
    assert "grad_accum" in out and "per device" in out and "total" in out
    assert err.count("does not exist") == 2 and "train_loader.dataset.local" in err
    assert "Traceback" not in err
