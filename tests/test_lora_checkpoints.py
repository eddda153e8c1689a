"""LoRA checkpoints, export and start-from-adapter (issue 12 part A).

MPT on 2 gloo processes under FSDP2 (the base from ``load_path``): checkpoints hold only the
adapters and their optimizer state, resume gives bitwise the losses of an uninterrupted run,
a different base is refused naming both; the PEFT export loads with plain transformers + peft
in a process that never imports foundryx (tests/peft_judge.py) on the Llama export of the
base, and the merged export matches too. A tiny Hugging Face Llama (``hf_causal_lm`` from a
pretrained folder): the same export round trip, then a run that starts from the exported
adapter with ``model.pretrained_lora_id_or_path``; an adapter that does not fit is one message.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hf_tiny import train_steps
from launcher import launch

from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
JUDGE = Path(__file__).with_name("peft_judge.py")
LOSS = "loss/train/total"
MPT_DIMS = {"d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 32, "vocab_size": 16384,
            "attn_config": {"rope": True}, "norm_type": "rmsnorm",
            "ffn_config": {"ffn_type": "swiglu"}, "no_bias": True}
TINY = [
    "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
    "model.vocab_size=16384", "global_train_batch_size=4", "eval_loader=null", "parallelism={}",
    "scheduler.t_warmup=2ba", "optimizer.lr=0.01", "max_duration=8ba", "save_interval=4ba",
    "save_overwrite=false", "console_log_interval=100ba", "save_num_checkpoints_to_keep=-1",
    "model.peft_config.target_modules=[Wqkv,out_proj,gate_proj,up_proj,down_proj]",
    "model.peft_config.r=4", "model.peft_config.lora_alpha=8",
]


def mpt_base(path: Path, seed: int) -> Path:
    """A random MPT's weights as a safetensors file (the base a LoRA run starts from)."""
    from safetensors.torch import save_file

    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    torch.manual_seed(seed)
    model = MPTForCausalLM(MPTConfig(**MPT_DIMS))
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def train(data: Path, out: Path, base: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    args = [f"variables.data_root={data}", f"save_folder={out}/ckpt",
            f"loggers.jsonl.path={out}/metrics.jsonl", f"load_path={base}", *TINY]
    return launch(["train.py", "yamls/quickstart.yaml", *args], nproc, out, ROOT, timeout=900)


def losses(out: Path) -> dict[int, float]:
    return {row["batch"]: row[LOSS] for row in read_metrics(out / "metrics.jsonl") if LOSS in row}


def ok(out: Path, r: subprocess.CompletedProcess) -> str:
    ranks = "".join(p.read_text()[-3000:] for p in sorted(out.glob("rank*.err")))
    return f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}\n{ranks}"


def judge(base: Path, adapter: Path, merged: Path, ids: torch.Tensor, tmp: Path) -> dict:
    """Logits of the adapter on ``base`` and of ``merged``, from a process without foundryx."""
    torch.save(ids, tmp / "ids.pt")
    r = subprocess.run([sys.executable, str(JUDGE), str(base), str(adapter), str(merged),
                        str(tmp / "ids.pt"), str(tmp / "judged.pt")],
                       capture_output=True, text=True, timeout=600, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp / "judged.pt", weights_only=False)


def trained_logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    """The trained model's logits, in float64 as the judge computes (see tests/peft_judge.py)."""
    from foundryx.checkpoint.rebuild import rebuild_model

    rebuilt = rebuild_model(checkpoint)
    with torch.no_grad():
        return rebuilt.model.model.double()(input_ids=ids).logits


def cli(*argv: str) -> int:
    from foundryx.cli import main

    return main(list(argv))


# -- MPT, 2 processes, FSDP2 --------------------------------------------------------------

@pytest.mark.slow
def test_mpt_lora_checkpoints_resume_exactly_and_export_to_peft(quickstart_data, tmp_path, capsys):
    from foundryx.checkpoint.safe_dcp import read_metadata
    from foundryx.checkpoint.weights import model_tensor_shapes
    from foundryx.export import ExportSpec, export_checkpoint, export_weights
    from foundryx.models.mpt.configuration import MPTConfig

    base = mpt_base(tmp_path / "base.safetensors", seed=0)
    ref, res = tmp_path / "ref", tmp_path / "res"
    r = train(quickstart_data, ref, base)
    assert r.returncode == 0, ok(ref, r)

    # Adapter-only: the model tensors are the lora_A/lora_B weights, the files a fraction of the base.
    ckpt4 = ref / "ckpt" / "ep0-ba4"
    saved = model_tensor_shapes(read_metadata(ckpt4 / "dcp"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:5]
    assert len(saved) == 2 * 5 * MPT_DIMS["n_layers"]
    dcp_bytes = sum(p.stat().st_size for p in (ckpt4 / "dcp").iterdir())
    assert dcp_bytes < base.stat().st_size / 4, (dcp_bytes, base.stat().st_size)
    record = json.loads((ckpt4 / "lora_base.json").read_text())
    assert record["adapter_only"] and record["source"] == str(base.resolve()), record

    # Resume from batch 4: the same losses, bit for bit, as the uninterrupted run.
    (res / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt4, res / "ckpt" / "ep0-ba4")
    r = train(quickstart_data, res, base)
    assert r.returncode == 0, ok(res, r)
    want = losses(ref)
    assert sorted(want) == list(range(1, 9))
    assert losses(res) == {b: want[b] for b in range(5, 9)}

    # Another base on resume: one message naming both, exit 2, nothing written.
    other = mpt_base(tmp_path / "other.safetensors", seed=1)
    before = sorted(p.name for p in (res / "ckpt").iterdir())
    code = cli("train", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
               f"save_folder={res}/ckpt", f"loggers.jsonl.path={tmp_path}/bad/metrics.jsonl",
               f"load_path={other}", *TINY, "max_duration=12ba")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("foundryx: error:") == 1, err
    assert f"trained on load_path: {base.resolve()}" in err, err
    assert f"this run's base is load_path: {other.resolve()}" in err, err
    assert sorted(p.name for p in (res / "ckpt").iterdir()) == before
    assert not (tmp_path / "bad" / "metrics.jsonl").exists() or losses(tmp_path / "bad") == {}

    # PEFT export for the Llama export of the base, and the merged model.
    final = ref / "ckpt" / "ep0-ba8"
    adapter = export_checkpoint(final, tmp_path / "adapter", progress=False)
    merged = export_checkpoint(final, tmp_path / "merged", merged=True, progress=False)
    from safetensors.torch import load_file

    export_weights(load_file(str(base)), ExportSpec(MPTConfig(**MPT_DIMS), None, "the base"),
                   tmp_path / "base-llama", fmt="llama", progress=False)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                "q_proj", "up_proj", "v_proj"]
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(3))
    want_logits = trained_logits(final, ids)
    got = judge(tmp_path / "base-llama", adapter, merged, ids, tmp_path)
    assert got["base"] == "LlamaForCausalLM" and got["merged_class"] == "LlamaForCausalLM"
    assert (got["adapter"] - want_logits).abs().max() <= 1e-5
    assert (got["merged"] - want_logits).abs().max() <= 1e-5
    # the adapter changed the model: the logits are not the base's
    base_logits = judge(tmp_path / "base-llama", adapter, tmp_path / "base-llama", ids, tmp_path)["merged"]
    assert (base_logits - want_logits).abs().max() > 1e-3


# -- a tiny Hugging Face Llama from a pretrained folder -------------------------------------

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "vocab_size": 8192}


def llama_folder(out: Path, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides})).save_pretrained(out)
    return out


def llama_yaml(tmp: Path, data: Path, model: dict) -> Path:
    cfg = yaml.safe_load((ROOT / "yamls/quickstart.yaml").read_text())
    cfg["model"] = model
    cfg["variables"].update({"data_root": str(data), "max_seq_len": 32})
    cfg.update({"max_duration": "4ba", "save_interval": "4ba", "global_train_batch_size": 4,
                "eval_loader": None, "save_folder": str(tmp / "ckpt"), "save_overwrite": False,
                "console_log_interval": "100ba"})
    cfg["scheduler"]["t_warmup"] = "1ba"
    cfg["optimizer"]["lr"] = 0.02
    cfg["loggers"]["jsonl"]["path"] = str(tmp / "metrics.jsonl")
    cfg["callbacks"]["hf_export"] = {"save_folder": str(tmp / "hf")}
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def check_llama_exports(ckpt: Path, adapter: Path, during: Path, base: Path,
                        tmp: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The hf_export callback's adapter (in ``during``) is the checkpoint's export
    (``adapter``), and that adapter in plain peft and the merged export in plain transformers
    give the trained model's logits; returns the adapter's tensors, the ids and those logits."""
    from safetensors.torch import load_file

    written = load_file(str(during / "adapter_model.safetensors"))
    exported = load_file(str(adapter / "adapter_model.safetensors"))
    assert sorted(written) == sorted(exported) and len(exported) == 2 * 7 * LLAMA["num_hidden_layers"]
    assert all(torch.equal(written[k], exported[k]) for k in exported)
    assert cli("export", str(ckpt), str(tmp / "merged"), "--merged", "--no-progress") == 0
    ids = torch.randint(0, 1024, (2, 20), generator=torch.Generator().manual_seed(5))
    want = trained_logits(ckpt, ids)
    got = judge(base, adapter, tmp / "merged", ids, tmp)
    assert (got["adapter"] - want).abs().max() <= 1e-5
    assert (got["merged"] - want).abs().max() <= 1e-5
    return exported, ids, want


@pytest.mark.slow
def test_llama_lora_export_and_start_from_the_adapter(quickstart_data, tmp_path, capsys):
    from types import SimpleNamespace

    from foundryx import builders
    from foundryx.errors import ConfigError
    from foundryx.export import export_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = llama_folder(tmp_path / "llama")
        peft = {"target_modules": "all-linear", "r": 4, "lora_alpha": 16, "use_rslora": True}
        section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(base),
                   "peft_config": peft}
        run = tmp_path / "run"
        run.mkdir()
        assert cli("train", str(llama_yaml(run, quickstart_data, section))) == 0, capsys.readouterr().err
        ckpt = run / "ckpt" / "ep0-ba4"
        record = json.loads((ckpt / "lora_base.json").read_text())
        assert record["source_field"] == "model.pretrained_model_name_or_path", record
        dcp = sum(p.stat().st_size for p in (ckpt / "dcp").iterdir())
        assert dcp < (base / "model.safetensors").stat().st_size / 4

        adapter = export_checkpoint(ckpt, tmp_path / "adapter", progress=False)
        # the hf_export callback wrote the same adapter at the end of training
        _, ids, want = check_llama_exports(ckpt, adapter, run / "hf" / "ba4", base, tmp_path)
        assert json.loads((run / "hf" / "ba4" / "adapter_config.json").read_text())["r"] == 4

        # Start from the adapter: peft_config taken from it, the trained model's logits, and
        # training continues from there.
        cfg = SimpleNamespace(model={"name": "hf_causal_lm", "pretrained_model_name_or_path": str(base),
                                     "pretrained_lora_id_or_path": str(adapter)},
                              optimizer={"name": "adamw", "lr": 1e-2})
        model = builders.build_model(cfg, None)
        assert cfg.model["peft_config"]["r"] == 4 and cfg.model["peft_config"]["use_rslora"]
        with torch.no_grad():
            assert (model.model(input_ids=ids).logits.double() - want).abs().max() <= 1e-5
        steps = train_steps(model, 6, opt=builders.build_optimizer(cfg, model))
        assert steps[-1] < steps[0], steps

        # A peft_config that disagrees with the adapter's config: one message, both values.
        cfg.model["peft_config"] = {**peft, "r": 8}
        with pytest.raises(ConfigError, match=r"model.peft_config.r is 8, the adapter's is 4"):
            builders.build_model(cfg, None)

        # An adapter that does not fit the base: the first mismatching weight and both shapes.
        narrow = llama_folder(tmp_path / "narrow", intermediate_size=48)
        (tmp_path / "bad").mkdir()
        code = cli("train", str(llama_yaml(tmp_path / "bad", quickstart_data, {
            "name": "hf_causal_lm", "pretrained_model_name_or_path": str(narrow),
            "pretrained_lora_id_or_path": str(adapter)})))
        err = capsys.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err and err.count("foundryx: error:") == 1, err
        assert ("model.pretrained_lora_id_or_path: the adapter in " in err
                and "'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' has shape "
                    "(4, 64) in the adapter, (4, 48) in the model" in err), err
        assert not (tmp_path / "bad" / "ckpt").exists()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_llama_lora_on_two_processes_resumes_exactly(quickstart_data, tmp_path):
    """A Hugging Face Llama with LoRA under FSDP2 on 2 gloo processes: the loss falls, the
    checkpoints hold only the adapters, and a resume from batch 4 gives the uninterrupted
    run's losses bit for bit."""
    from foundryx.checkpoint.safe_dcp import read_metadata
    from foundryx.checkpoint.weights import model_tensor_shapes

    base = llama_folder(tmp_path / "llama")
    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(base),
               "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}}
    ref, res = tmp_path / "ref", tmp_path / "res"

    def run(out: Path) -> subprocess.CompletedProcess:
        out.mkdir(parents=True, exist_ok=True)
        config = llama_yaml(out, quickstart_data, section)
        cfg = yaml.safe_load(config.read_text())
        del cfg["callbacks"]["hf_export"]
        config.write_text(yaml.safe_dump(cfg))
        return launch(["train.py", str(config), "max_duration=8ba",
                       "save_num_checkpoints_to_keep=-1"], 2, out, ROOT, timeout=900)

    r = run(ref)
    assert r.returncode == 0, ok(ref, r)
    want = losses(ref)
    assert sorted(want) == list(range(1, 9)) and want[8] < want[1], want
    ckpt4 = ref / "ckpt" / "ep0-ba4"
    saved = model_tensor_shapes(read_metadata(ckpt4 / "dcp"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:5]
    assert len(saved) == 2 * 7 * LLAMA["num_hidden_layers"]

    (res / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt4, res / "ckpt" / "ep0-ba4")
    r = run(res)
    assert r.returncode == 0, ok(res, r)
    assert losses(res) == {b: want[b] for b in range(5, 9)}


@pytest.mark.slow
@pytest.mark.modern_leg
def test_llama_lora_trained_under_tensor_parallelism_exports_to_peft(quickstart_data, tmp_path):
    """4 processes started as the composer launcher starts them, parallelism.tp: 2 (2
    data-parallel ranks x TP 2): the loss falls, the checkpoint holds only the adapters, and its PEFT export (and the
    hf_export callback's, written by the TP ranks at the end) gives the trained model's logits
    in plain peft; so does the merged export in plain transformers."""

    from foundryx.export import export_checkpoint

    base = llama_folder(tmp_path / "llama")
    run = tmp_path / "run"
    run.mkdir()
    config = llama_yaml(run, quickstart_data, {
        "name": "hf_causal_lm", "pretrained_model_name_or_path": str(base), "init_device": "cpu",
        "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}})
    r = launch(["train.py", str(config), "parallelism.tp=2", "global_train_batch_size=4",
                "max_duration=6ba", "save_interval=6ba"], 4, run, ROOT, timeout=900)
    assert r.returncode == 0, ok(run, r)
    said = r.stdout + r.stderr  # rank 0's output
    assert "tensor_parallel               2" in said and "data_parallel_ranks           2" in said, said
    got_losses = losses(run)
    assert sorted(got_losses) == list(range(1, 7)) and got_losses[6] < got_losses[1], got_losses
    ckpt = run / "ckpt" / "ep0-ba6"
    adapter = export_checkpoint(ckpt, tmp_path / "adapter", progress=False)
    exported, _, _ = check_llama_exports(ckpt, adapter, run / "hf" / "ba6", base, tmp_path)
    # the adapters moved from their initialisation (lora_B starts at zero)
    assert any(k.endswith("lora_B.weight") and exported[k].abs().max() > 0 for k in exported)


# -- fast: the name and weight mappings ----------------------------------------------------

def test_wqkv_adapter_splits_exactly_into_q_k_v_and_names_round_trip():
    """The Llama export of an MPT adapter on the fused Wqkv (grouped-query: k and v narrower
    than q): the three adapters' updates, stacked, are the fused one's; PEFT names round-trip."""
    from hf_tiny import LLAMA_STYLE, MPT_TINY

    from foundryx.export.lora import adapter_weights, to_llama
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.peft.adapters import from_peft_key, to_peft_key
    from foundryx.models.peft.lora import apply_lora
    from foundryx.models.peft.options import LoraOptions

    torch.manual_seed(0)
    attn = {**LLAMA_STYLE["attn_config"], "kv_n_heads": 2}
    model = apply_lora(ComposerMPTCausalLM(**{**MPT_TINY, **LLAMA_STYLE, "attn_config": attn}),
                       LoraOptions(target_modules=["Wqkv", "out_proj", "down_proj"], r=4)).model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    weights = adapter_weights(model)
    mapped = to_llama(model.config, weights)
    assert len(mapped) == len(weights) + 2 * 2 * MPT_TINY["n_layers"]  # Wqkv's pair -> 3 pairs
    for i in range(MPT_TINY["n_layers"]):
        fused = f"transformer.blocks.{i}.attn.Wqkv.lora_%s.default.weight"
        delta = weights[fused % "B"] @ weights[fused % "A"]
        split = f"model.layers.{i}.self_attn.%s_proj.lora_%s.default.weight"
        parts = [mapped[split % (p, "B")] @ mapped[split % (p, "A")] for p in "qkv"]
        assert [x.shape[0] for x in parts] == [32, 16, 16]
        assert torch.allclose(torch.cat(parts), delta, rtol=0, atol=1e-6)
        assert torch.equal(mapped[f"model.layers.{i}.self_attn.o_proj.lora_A.default.weight"],
                           weights[f"transformer.blocks.{i}.attn.out_proj.lora_A.default.weight"])
    for key in weights:
        peft_name = to_peft_key(key)
        assert peft_name.startswith("base_model.model.transformer.") and ".default." not in peft_name
        assert from_peft_key(peft_name) == key


def test_slice_adapters_export_to_llama_and_merge_with_the_trained_logits():
    """MPT's logical q/v targets: on the Llama export of the base, each slice's pair is that
    projection's PEFT adapter, and the merged model gives the same logits (fp32, <= 1e-5)."""
    from hf_tiny import LLAMA_STYLE, MPT_TINY
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaForCausalLM

    from foundryx.errors import ExportError
    from foundryx.export.llama import llama_config, llama_state_dict
    from foundryx.export.lora import adapter_weights, merge_adapters, to_llama, write_adapter
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.peft.adapters import base_key, is_adapter_key
    from foundryx.models.peft.lora import apply_lora
    from foundryx.models.peft.options import LoraOptions

    torch.manual_seed(0)
    attn = {**LLAMA_STYLE["attn_config"], "kv_n_heads": 2}
    options = LoraOptions(target_modules=["q", "v", "o"], r=4, lora_alpha=8)
    model = apply_lora(ComposerMPTCausalLM(**{**MPT_TINY, **LLAMA_STYLE, "attn_config": attn}),
                       options).model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    ids = torch.randint(0, MPT_TINY["vocab_size"], (2, 16))
    with torch.no_grad():  # in float64: the weights are compared, not float32 rounding
        trained = copy.deepcopy(model).double()(input_ids=ids).logits

    weights = adapter_weights(model)
    assert any(".Wqkv.lora_A.q." in k for k in weights) and not any(".k." in k for k in weights)
    base_state = {base_key(k): v for k, v in model.state_dict().items() if not is_adapter_key(k)}
    llama = LlamaForCausalLM(llama_config(model.config)).eval()
    llama.load_state_dict(llama_state_dict(model.config, base_state))
    mapped = to_llama(model.config, weights)
    targets = sorted({k.split(".")[-4] for k in mapped})
    assert targets == ["o_proj", "q_proj", "v_proj"]
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets), llama)
    missing = llama.load_state_dict(mapped, strict=False)
    assert not [k for k in missing.missing_keys if is_adapter_key(k)]
    with torch.no_grad():
        assert torch.allclose(llama.double()(input_ids=ids).logits, trained, rtol=0, atol=1e-5)

    with pytest.raises(ExportError, match="--format llama"):
        write_adapter(model, options, None, "/nonexistent/never-written", fmt="mpt", base=None)
    merged = merge_adapters(model)
    assert not [n for n, _ in merged.named_parameters() if is_adapter_key(n)]
    assert merged.transformer.blocks[0].attn.Wqkv.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(merged.double()(input_ids=ids).logits, trained, rtol=0, atol=1e-5)
