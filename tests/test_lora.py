"""LoRA (``model.peft_config``): applied from outside to a built MPT or Hugging Face Llama,
only the adapters train (base weights bit-identical, the optimizer holds only adapters), the
counts are logged; bad sections and bad targets are one message each with their YAML path and
exit code 2 before anything is written."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from config_checks import section_problems
from distributed import run_distributed
from hf_tiny import HF_CONFIGS, LLAMA_STYLE, MPT_TINY, train_steps

from foundryx import builders
from foundryx.errors import ConfigError
from foundryx.models.peft.lora import apply_lora
from foundryx.models.peft.options import LoraOptions

MPT_TARGETS = ["Wqkv", "out_proj", "gate_proj", "up_proj", "down_proj"]
SECTIONS = {
    "mpt": {"name": "mpt_causal_lm", **MPT_TINY, **LLAMA_STYLE,
            "peft_config": {"peft_type": "LORA", "target_modules": MPT_TARGETS, "r": 4,
                            "lora_alpha": 16, "lora_dropout": 0.0}},
    "llama": {"name": "hf_causal_lm", "pretrained": False,
              "config": {"model_type": "llama", **HF_CONFIGS["llama"]},
              "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16,
                              "use_rslora": True}},
}


# tiny models: one intra-op thread is several times faster than two on a loaded CI box
pytestmark = pytest.mark.usefixtures("one_thread")


# the recipes' optimizer on the multi-tensor paths a GPU takes (auto on a CPU is Composer's loop)
OPTIMIZERS = {"mpt": "foreach", "llama": "fused"}


def build(kind: str, **peft) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer as ``foundryx train`` builds them (builders.build_model and
    build_optimizer on a config with these sections)."""
    section = {**SECTIONS[kind], "peft_config": {**SECTIONS[kind]["peft_config"], **peft}}
    cfg = SimpleNamespace(model=section, optimizer={"name": "decoupled_adamw", "lr": 1e-2,
                                                    "implementation": OPTIMIZERS[kind]})
    torch.manual_seed(0)
    model = builders.build_model(cfg, None)
    return model, builders.build_optimizer(cfg, model)


@pytest.mark.parametrize("kind", ["mpt", "llama"])
def test_only_adapters_train(kind, caplog):
    assert section_problems("models", SECTIONS[kind]["name"],
                            {k: v for k, v in SECTIONS[kind].items() if k != "name"}) == []
    with caplog.at_level(logging.INFO, logger="foundryx"):
        model, opt = build(kind)
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n for n in params if ".lora_" in n} == trainable
    n_layers = 2 * (len(MPT_TARGETS) if kind == "mpt" else 7)  # llama: q k v o gate up down
    assert len(trainable) == 2 * n_layers  # an A and a B per adapted layer, lm_head left out
    # The optimizer holds exactly the adapter parameters.
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(params[n]) for n in trainable}
    n_train = sum(params[n].numel() for n in trainable)
    n_total = sum(p.numel() for p in params.values())
    line = f"{n_train:,} of {n_total:,} parameters train ({100 * n_train / n_total:.4f}%)"
    assert any(line in r.getMessage() for r in caplog.records), caplog.text

    base = {n: p.detach().clone() for n, p in params.items() if n not in trainable}
    adapters = {n: params[n].detach().clone() for n in trainable}
    losses = train_steps(model, 15, opt=opt)
    # A frozen model would repeat its loss exactly; the near-uniform random Llama moves less.
    assert losses[-1] < losses[0] - 0.2, losses
    assert all(torch.equal(base[n], params[n]) for n in base)  # bit-identical
    assert all(params[n].grad is None for n in base)
    changed = [n for n in trainable if not torch.equal(adapters[n], params[n])]
    assert len(changed) == len(trainable)


@pytest.mark.parametrize("kind", ["mpt", "llama"])
@pytest.mark.parametrize(("peft", "extra", "needle"), [
    ({"peft_type": "IA3"}, {}, "peft_config.peft_type: 'IA3' is not supported: foundryx trains "
                               "LoRA only; write peft_type: LORA"),
    ({"peft_type": "LORRA"}, {}, "peft_config.peft_type: expected one of 'LORA', got 'LORRA' "
                                 "(did you mean 'LORA'?)"),
    ({"r": 0}, {}, "peft_config.r: expected an integer > 0, got 0"),
    ({"lora_dropout": 1.5}, {}, "peft_config.lora_dropout: expected a number >= 0 and < 1"),
    ({"target_modules": "q_proj"}, {}, "peft_config.target_modules: expected a list or one of "
                                       "'all-linear', got 'q_proj'"),
    ({"target_modules": []}, {}, "peft_config.target_modules: an empty list adapts nothing"),
    ({"lora_alpah": 8}, {}, "peft_config.lora_alpah: unknown option of the "),
], ids=["other-peft-type", "misspelt-type", "r-zero", "dropout", "target-string", "no-targets",
        "misspelt-key"])
def test_bad_sections_are_config_problems_with_their_path(kind, peft, extra, needle):
    section = {k: v for k, v in SECTIONS[kind].items() if k != "name"}
    section = {**section, **extra, "peft_config": {**section["peft_config"], **peft}}
    found = section_problems("models", SECTIONS[kind]["name"], section)
    assert any(needle in p for p in found), found
    if "lora_alpah" in peft:
        assert "did you mean 'lora_alpha'?" in found[0]


def test_bad_targets_and_rank_raise_before_anything_changes():
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    plain = ComposerMPTCausalLM(**MPT_TINY, **LLAMA_STYLE)
    before = [n for n, _ in plain.named_parameters()]
    with pytest.raises(ConfigError) as e:
        apply_lora(plain, LoraOptions(target_modules=["Wqkv", "up_prj", "attn"]))
    text = str(e.value)
    assert "model.peft_config.target_modules[1]: 'up_prj' matches no linear layer (did you mean " \
           "'up_proj' or 'out_proj'?); the model's linear layers are: Wqkv, down_proj, " \
           "gate_proj, out_proj, up_proj" in text, text
    assert "model.peft_config.target_modules[2]: 'attn' names MPTAttention " in text, text
    with pytest.raises(ConfigError, match=r"model.peft_config.r: 40 is larger than the smaller "
                       r"dimension of target '.*' \(32 in, \d+ out\); use r <= 32"):
        apply_lora(plain, LoraOptions(target_modules="all-linear", r=40))
    assert [n for n, _ in plain.named_parameters()] == before  # nothing was injected
    assert all(p.requires_grad for p in plain.parameters())


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.peft_config.target_modules=[Wqkv,up_prj]"],
     "model.peft_config.target_modules[1]: 'up_prj' matches no linear layer (did you mean "
     "'up_proj'"),
    (["model.peft_config.target_modules=all-linear", "model.peft_config.r=200"],
     "model.peft_config.r: 200 is larger than the smaller dimension of target"),
    (["model.peft_config.target_modules=[Wqkv]", "model.peft_config.peft_type=LOHA"],
     "model.peft_config.peft_type: 'LOHA' is not supported: foundryx trains LoRA only"),
], ids=["unmatched-target", "rank-too-large", "other-peft-type"])
def test_cli_bad_lora_input_is_one_message_exit_2_nothing_written(
        quickstart_data, overrides, needle, tmp_path, capsys):
    from foundryx.cli import main

    run = tmp_path / "run"
    code = main(["train", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
                 f"save_folder={run}/ckpt", f"loggers.jsonl.path={run}/metrics.jsonl",
                 "max_duration=2ba", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.count("foundryx: error:") == 1 and needle in err.split("foundryx: error:")[1], err
    assert not run.exists()


def test_cli_dry_run_accepts_a_lora_section(quickstart_data, capsys):
    from foundryx.cli import main

    code = main(["train", "--dry-run", "yamls/quickstart.yaml",
                 f"variables.data_root={quickstart_data}",
                 "model.peft_config.target_modules=[Wqkv,out_proj]", "model.peft_config.r=8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "peft_config" in out and "Wqkv" in out


# -- FSDP2 on 2 gloo processes ----------------------------------------------------------

def _lora_under_fsdp2() -> dict:
    from torch.distributed.fsdp import FSDPModule

    from foundryx.config.schema import ParallelismConfig
    from foundryx.parallel import parallelize

    model, _ = build("mpt")
    parallelize(model, ParallelismConfig(), device=torch.device("cpu"))
    blocks = list(model.model.transformer.blocks)  # each block is one FSDP unit
    mixed_units = sum(1 for b in blocks if isinstance(b, FSDPModule)
                      and {p.requires_grad for p in b.parameters()} == {True, False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)

    def full(trainable_flag: bool) -> dict:
        return {n: p.full_tensor().clone() for n, p in model.named_parameters()
                if p.requires_grad == trainable_flag}

    base, adapters = full(False), full(True)
    losses = train_steps(model, 8, opt=opt)
    base_after, adapters_after = full(False), full(True)
    return {"mixed_units": mixed_units, "losses": losses,
            "base_same": all(torch.equal(base[n], base_after[n]) for n in base),
            "adapters_changed": all(not torch.equal(adapters[n], adapters_after[n])
                                    for n in adapters)}


@pytest.mark.slow
def test_lora_under_fsdp2_on_two_processes():
    results = run_distributed(_lora_under_fsdp2)
    for r in results:
        assert r["mixed_units"] == MPT_TINY["n_layers"], r  # every block: frozen + adapters
        assert r["base_same"] and r["adapters_changed"], r
        assert r["losses"][-1] < 0.8 * r["losses"][0], r["losses"]
    assert results[0]["losses"] == results[1]["losses"]
