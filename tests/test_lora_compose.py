"""LoRA beyond the first slice: MPT's logical targets (q, k, v slices of the fused Wqkv; o, up,
down, gate), adapters that init from the run's seed (the same on CPU, after meta-device init
and on every rank), and LoRA composed with FSDP2, activation checkpointing, torch.compile, bf16
mixed precision, meta init and rank-0 load + broadcast on 2 gloo processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from distributed import run_distributed
from hf_tiny import LLAMA_STYLE, MPT_TINY, hf_folder, token_batch, train_steps

from foundryx import builders
from foundryx.config.schema import ActivationCheckpointingConfig, CompileConfig, ParallelismConfig
from foundryx.errors import ConfigError
from foundryx.models.peft.fused import FusedLoraLinear
from foundryx.parallel import parallelize

GQA = {**LLAMA_STYLE, "attn_config": {"rope": True, "kv_n_heads": 2}}  # q 32 rows, k and v 16


pytestmark = pytest.mark.usefixtures("one_thread")


def mpt(targets, init_device="cpu", seed=0, **peft):
    section = {"name": "mpt_causal_lm", **MPT_TINY, **GQA, "init_device": init_device,
               "peft_config": {"target_modules": targets, "r": 4, "lora_alpha": 8, **peft}}
    torch.manual_seed(seed)
    return builders.build_model(SimpleNamespace(model=section), None)


def adapters(model) -> dict[str, torch.Tensor]:
    def full(p):
        return p.full_tensor() if hasattr(p, "full_tensor") else p
    return {n: full(p).detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_logical_targets_adapt_only_their_rows_of_wqkv():
    model = mpt(["q", "v", "o", "up"])
    attn = model.model.transformer.blocks[0].attn
    assert isinstance(attn.Wqkv, FusedLoraLinear) and list(attn.Wqkv.lora_A) == ["q", "v"]
    names = {n.removeprefix("model.transformer.blocks.0.") for n in adapters(model)
             if ".blocks.0." in n}
    assert names == {"attn.Wqkv.lora_A.q.weight", "attn.Wqkv.lora_B.q.weight",
                     "attn.Wqkv.lora_A.v.weight", "attn.Wqkv.lora_B.v.weight",
                     "attn.out_proj.lora_A.default.weight", "attn.out_proj.lora_B.default.weight",
                     "ffn.up_proj.lora_A.default.weight", "ffn.up_proj.lora_B.default.weight"}
    assert all(torch.count_nonzero(p) == 0 for n, p in adapters(model).items() if "lora_B" in n)
    wqkv = attn.Wqkv
    with torch.no_grad():  # a non-zero update, to see where it lands
        for b in wqkv.lora_B.values():
            b.weight.normal_()
    x = torch.randn(3, 5, 32)
    base, out = wqkv.base_layer(x), wqkv(x)
    q, k, v = (slice(0, 32), slice(32, 48), slice(48, 64))
    assert torch.equal(out[..., k], base[..., k])  # k rows: exactly the base model's
    for s, rows in (("q", q), ("v", v)):
        update = wqkv.lora_B[s](wqkv.lora_A[s](x)) * (8 / 4)
        torch.testing.assert_close(out[..., rows], base[..., rows] + update)
        assert not torch.allclose(out[..., rows], base[..., rows])


def test_logical_targets_train_under_activation_checkpointing_with_the_same_gradients():
    def grads(ac: bool) -> tuple[dict, float]:
        model = mpt(["q", "k", "v", "gate", "down"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        parallelize(model, None, activation_checkpointing=ActivationCheckpointingConfig(enabled=ac),
                    device=torch.device("cpu"))
        batch = token_batch()
        loss = model.loss(model(batch), batch)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, loss

    plain, loss_plain = grads(False)
    checkpointed, loss_ac = grads(True)
    assert torch.equal(loss_plain, loss_ac)
    assert plain.keys() == checkpointed.keys() and len(plain) == 2 * 2 * 5
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=0, atol=1e-6)

    model = mpt(["q", "v"])
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = train_steps(model, 10, opt=opt)
    assert losses[-1] < losses[0] - 0.2, losses
    assert all(torch.equal(base[n], p) for n, p in model.named_parameters() if n in base)


def test_hf_lora_under_activation_checkpointing_has_the_plain_gradients():
    """hf_causal_lm's training forward runs without a KV cache: under activation checkpointing
    the recomputed forward used to append to the cache again and fail on the shapes."""
    from hf_tiny import HF_CONFIGS

    def grads(ac: bool) -> dict:
        section = {"name": "hf_causal_lm", "pretrained": False,
                   "config": {"model_type": "llama", **HF_CONFIGS["llama"]},
                   "peft_config": {"target_modules": "all-linear", "r": 4}}
        torch.manual_seed(0)
        model = builders.build_model(SimpleNamespace(model=section), None)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        parallelize(model, None, activation_checkpointing=ActivationCheckpointingConfig(enabled=ac),
                    device=torch.device("cpu"))
        batch = token_batch()
        model.loss(model(batch), batch).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and plain
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("targets", "needle"), [
    (["Wqkv", "q"], "model.peft_config.target_modules: q and Wqkv both adapt Wqkv; name either "
                    "the whole layer or its slices"),
    (["qq"], "model.peft_config.target_modules[0]: 'qq' matches no linear layer (did you mean "),
])
def test_bad_logical_targets_are_one_message(targets, needle):
    with pytest.raises(ConfigError) as e:
        mpt(targets)
    assert needle in str(e.value), str(e.value)
    assert "its logical targets are: down, gate, k, o, q, up, v" in str(e.value) or "Wqkv" in targets
    section = {"name": "mpt_causal_lm", **MPT_TINY, "peft_config": {"target_modules": ["gate"]}}
    with pytest.raises(ConfigError, match=r"'gate' \(the model's gate_proj\) matches no linear "
                                          r"layer"):
        builders.build_model(SimpleNamespace(model=section), None)  # gelu MLP: no gate_proj
    with pytest.raises(ConfigError, match=r"r: 20 is larger than the smaller dimension of target "
                                          r"'transformer.blocks.0.attn.Wqkv\[k\]' \(32 in, 16 out\)"):
        mpt(["q", "k"], r=20)


def test_meta_init_gives_the_adapters_of_a_cpu_build():
    """Adapters are drawn from the run's seed and their names: a meta-device model materialised
    by foundryx.parallel gets exactly the CPU-built adapters (B zero), whatever the RNG did."""
    cpu = adapters(mpt(["q", "v", "o"], "cpu", seed=3))
    model = mpt(["q", "v", "o"], "meta", seed=3)
    assert all(p.is_meta for p in model.parameters())
    torch.rand(7)  # the global RNG moved on: the adapters must not care
    parallelize(model, None, device=torch.device("cpu"))
    meta = adapters(model)
    assert meta.keys() == cpu.keys()
    assert all(torch.equal(meta[n], cpu[n]) for n in cpu)
    assert all(torch.count_nonzero(meta[n]) == 0 for n in meta if "lora_B" in n)
    assert all(torch.count_nonzero(meta[n]) > 0 for n in meta if "lora_A" in n)


# -- everything together on 2 gloo processes ---------------------------------------------

def _compose(folder: str) -> dict:
    """hf_causal_lm + LoRA under FSDP2 and bf16 mixed precision,
    loaded plainly on every rank (init_device: cpu) and shard by shard (meta);
    then an MPT with logical targets built on meta, initialised per shard, and trained under
    FSDP2, activation checkpointing and torch.compile (aot_eager: dynamo traces the LoRA
    layers without a C++ toolchain)."""
    from foundryx.parallel import dist

    def fit(model, cfg, steps=4) -> dict:
        opt = builders.build_optimizer(cfg, model)
        frozen = {n: p.full_tensor().clone() for n, p in model.named_parameters()
                  if not p.requires_grad}
        start = adapters(model)
        losses = train_steps(model, steps, opt=opt)
        return {"losses": losses, "start": start, "frozen": frozen,
                "base_same": all(torch.equal(frozen[n], p.full_tensor())
                                 for n, p in model.named_parameters() if n in frozen)}

    def hf(init_device: str) -> dict:
        section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder,
                   "init_device": init_device,
                   "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}}
        cfg = SimpleNamespace(model=section, optimizer={"name": "adamw", "lr": 1e-2})
        torch.manual_seed(0)
        model = builders.build_model(cfg, None)
        builders.parallelize_and_load(model, ParallelismConfig(mixed_precision="DEFAULT"),
                                      precision="amp_bf16", device=torch.device("cpu"))
        return fit(model, cfg)

    plain, rank0 = hf("cpu"), hf("meta")
    meta = mpt(["q", "v", "up"], "meta")
    parallelize(meta, ParallelismConfig(),
                activation_checkpointing=ActivationCheckpointingConfig(enabled=True),
                compile=CompileConfig(enabled=True, options={"backend": "aot_eager"}),
                device=torch.device("cpu"))
    compiled = sum(bool(getattr(m, "_foundryx_compiled", False)) for m in meta.modules())
    meta_run = fit(meta, SimpleNamespace(optimizer={"name": "adamw", "lr": 1e-2}))
    return {"rank": dist.rank(), "plain": plain, "rank0": rank0, "meta": meta_run,
            "compiled": compiled}


@pytest.mark.slow
def test_lora_composes_with_fsdp2_bf16_shard_on_read_and_meta_ac_compile(tmp_path):
    folder = hf_folder("llama", tmp_path / "llama")
    results = run_distributed(_compose, args=(str(folder),), timeout=1200)
    cpu_adapters = adapters(mpt(["q", "v", "up"], "cpu"))
    for r in results:
        for run in (r["plain"], r["rank0"], r["meta"]):
            assert run["base_same"], r["rank"]
            assert run["losses"][-1] < run["losses"][0] - 0.1, run["losses"]
        # Shard-on-read is the plain load: same base, same adapters, same losses.
        assert all(torch.equal(r["plain"]["frozen"][n], r["rank0"]["frozen"][n])
                   for n in r["plain"]["frozen"])
        assert all(torch.equal(r["plain"]["start"][n], r["rank0"]["start"][n])
                   for n in r["plain"]["start"])
        assert r["rank0"]["losses"][0] == r["plain"]["losses"][0]
        torch.testing.assert_close(r["rank0"]["losses"], r["plain"]["losses"], rtol=1e-3, atol=0)
        # Meta init under FSDP2 (compiled, checkpointed blocks): the adapters of a CPU build.
        assert r["compiled"] == MPT_TINY["n_layers"]
        meta = r["meta"]["start"]
        assert meta.keys() == cpu_adapters.keys()
        assert all(torch.equal(meta[n], cpu_adapters[n]) for n in cpu_adapters)
    assert results[0]["plain"]["losses"] == results[1]["plain"]["losses"]
    assert results[0]["meta"]["losses"] == results[1]["meta"]["losses"]
