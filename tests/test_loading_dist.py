"""Shard-on-read on 2 gloo ranks: each rank reads only its rows of a tiny Llama saved in
several safetensors files with an index, and gets exactly what loading everything gives
(``from_pretrained``; every rank loading and quantizing the whole weight, ``init_device:
cpu``); offloaded frozen weights are sharded and train to the same losses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from distributed import run_distributed
from hf_tiny import HF_CONFIGS, train_steps

pytestmark = pytest.mark.slow

LORA = {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}


def save_llama(folder, dtype: torch.dtype, shard: str = "40KB", **config) -> str:
    """A tiny random Llama saved as ``dtype`` in several files with an index."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **{**HF_CONFIGS["llama"], **config},
                               torch_dtype=str(dtype).split(".")[1])
    AutoModelForCausalLM.from_config(cfg).to(dtype).save_pretrained(folder, max_shard_size=shard)
    return str(folder)


def _build(folder: str | dict, init_device: str, frozen: str | None = None, offload: float = 0.0,
           lora: bool = True):
    from foundryx import builders
    from foundryx.config.schema import ParallelismConfig

    source = ({"config": folder, "pretrained": False} if isinstance(folder, dict)
              else {"pretrained_model_name_or_path": folder})
    section = {"name": "hf_causal_lm", **source,
               "init_device": init_device, **({"peft_config": LORA} if lora else {})}
    if frozen:
        section["frozen_base"] = {"dtype": frozen, "offload_fraction": offload}
    cfg = SimpleNamespace(model=section, optimizer={"name": "adamw", "lr": 1e-2})
    torch.manual_seed(0)
    model = builders.build_model(cfg, None)
    model = builders.parallelize_and_load(model, ParallelismConfig(), device=torch.device("cpu"))
    return model, builders.build_optimizer(cfg, model)


def _local_bytes(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a (sharded) parameter really stores on this rank, by name."""
    local = getattr(t, "_local_tensor", t)
    if hasattr(local, "__tensor_flatten__"):
        return {n: getattr(local, n).clone() for n in local.__tensor_flatten__()[0]}
    return {"": local.detach().clone()}


def _on_ranks(folders: dict[str, str]) -> dict:
    from transformers import AutoModelForCausalLM

    from foundryx.models.peft.frozen_base import LowPrecisionLinear, stored_bytes
    from foundryx.parallel import dist

    out: dict = {"rank": dist.rank()}
    # 1. the whole model, no LoRA: bit for bit from_pretrained's (float32) weights
    for name, folder in folders.items():
        model, _ = _build(folder, "meta", lora=False)
        ref = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).state_dict()
        mine = {k.removeprefix("model."): p.full_tensor() for k, p in model.state_dict().items()}
        out[f"exact_{name}"] = sorted(k for k in ref if not torch.equal(ref[k], mine[k]))
        out[f"keys_{name}"] = sorted(set(ref) ^ set(mine))
    folder = folders["bf16"]
    # 2. quantize on load: each rank's stored bytes = quantizing the whole weight, then sharding
    for frozen in (None, "int8", "fp8", "nf4"):  # fp8 and nf4: the bytes (fp8 trains as int8)
        runs = {}
        for init in ("cpu", "meta"):
            model, opt = _build(folder, init, frozen)
            state = {n: _local_bytes(p) for n, p in model.named_parameters()}
            runs[init] = (state, train_steps(model, 3, opt=opt) if frozen != "fp8" else [])
        (cpu_state, cpu_losses), (meta_state, meta_losses) = runs["cpu"], runs["meta"]
        out[f"same_{frozen}"] = sorted(  # frozen weights kept as bf16 on meta: the same values
            n for n in cpu_state if n.endswith("weight") and not all(
                torch.equal(a, meta_state[n][k].to(a.dtype)) for k, a in cpu_state[n].items()))
        out[f"losses_{frozen}"] = (cpu_losses, meta_losses)
        out[f"bf16_{frozen}"] = sorted(n for n, p in model.named_parameters()
                                       if p.dtype == torch.bfloat16)
    # 3. sharded offload: same losses, each rank holds half the offloaded bytes
    for frozen in ("int8", "nf4"):
        for offload in (0.0, 0.5, 1.0):
            for init in ("meta", "cpu") if offload == 1.0 and frozen == "int8" else ("meta",):
                model, opt = _build(folder, init, frozen, offload)
                off = [m.offload for m in model.modules()
                       if isinstance(m, LowPrecisionLinear) and m.offload is not None]
                held = sum(stored_bytes(o.host) for o in off)
                out[f"offload_{frozen}_{offload}_{init}"] = {
                    "losses": train_steps(model, 3, opt=opt), "held": held, "n": len(off),
                    "rows": [(o.rows, o.host.shape[0]) for o in off]}
    return out


def test_shard_on_read_is_exact_and_trains_as_loading_everything(tmp_path):
    folders = {"bf16": save_llama(tmp_path / "bf16", torch.bfloat16),
               "fp32": save_llama(tmp_path / "fp32", torch.float32)}
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    results = run_distributed(_on_ranks, args=(folders,), timeout=900)
    for r in results:
        for name in folders:
            assert r[f"keys_{name}"] == [] and r[f"exact_{name}"] == [], (r["rank"], name)
        for frozen in (None, "int8", "fp8", "nf4"):
            assert r[f"same_{frozen}"] == [], (frozen, r[f"same_{frozen}"])
            cpu, meta = r[f"losses_{frozen}"]
            assert cpu == meta, (frozen, cpu, meta)
            # the all-frozen top-level FSDP2 unit keeps the checkpoint's bf16 (half the bytes)
            kept = r[f"bf16_{frozen}"]
            assert len(kept) == 3 and all(n.endswith(("model.embed_tokens.weight", "lm_head.weight",
                                                      "model.norm.weight")) for n in kept), kept
        for frozen in ("int8", "nf4"):
            base = r[f"offload_{frozen}_0.0_meta"]
            assert base["n"] == 0
            for key in ("0.5_meta", "1.0_meta", "1.0_cpu") if frozen == "int8" else ("0.5_meta", "1.0_meta"):
                run = r[f"offload_{frozen}_{key}"]
                assert run["losses"] == base["losses"], (frozen, key, run["losses"], base["losses"])
                assert run["n"] > 0
                # each rank holds its half of every offloaded weight's rows
                assert all(host == rows // 2 for rows, host in run["rows"]), run["rows"]
    # the two ranks together hold each offloaded weight once: total / N each
    for frozen in ("int8", "nf4"):
        held = [r[f"offload_{frozen}_1.0_meta"]["held"] for r in results]
        assert held[0] == held[1] > 0
    assert results[0]["offload_int8_1.0_meta"]["held"] == results[0]["offload_int8_1.0_cpu"]["held"]
    assert results[0]["losses_int8"] == results[1]["losses_int8"]


def _tied_on_ranks(folder: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    out: dict = {}
    config = {"model_type": "llama", **HF_CONFIGS["llama"], "tie_word_embeddings": True}
    for init, source in (("cpu", folder), ("meta", folder), ("scratch", config)):
        model, opt = _build(source, "meta" if init == "scratch" else init, lora=False)
        hf = model.model
        out[f"{init}_tied"] = hf.lm_head.weight is hf.model.embed_tokens.weight
        out[f"{init}_losses"] = train_steps(model, 3, opt=opt)
        # FSDP2 manages the shared parameter once, in the unit that holds both modules
        ends = {id(hf.lm_head): "lm_head", id(hf.model.embed_tokens): "embed_tokens"}
        out[f"{init}_managed"] = [
            sorted(ends.get(id(m), "?") for m in (p._module_info.module, *p._module_info.shared_modules))
            for u in model.modules() if isinstance(u, FSDPModule)
            for g in [u._get_fsdp_state()._fsdp_param_group] if g is not None
            for p in g.fsdp_params
            if {id(p._module_info.module), *map(id, p._module_info.shared_modules)} & set(ends)]
        out[f"{init}_tied_after"] = hf.lm_head.weight is hf.model.embed_tokens.weight
        # what an export writes: the trained full weights, head and embedding one tensor
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[f"{init}_equal"] = torch.equal(full["model.lm_head.weight"],
                                           full["model.model.embed_tokens.weight"])
    return out


def test_tied_embeddings_stay_one_parameter_under_meta_init(tmp_path):
    """A config with tie_word_embeddings: under init_device meta (shard-on-read, and random
    init from a config) lm_head and embed_tokens are one parameter, sharded once by FSDP2, and
    train exactly as the tied model every rank loads whole (init_device cpu)."""
    folder = save_llama(tmp_path / "tied", torch.bfloat16, tie_word_embeddings=True)
    results = run_distributed(_tied_on_ranks, args=(folder,), timeout=600)
    for r in results:
        for init in ("cpu", "meta", "scratch"):
            assert r[f"{init}_tied"] and r[f"{init}_tied_after"] and r[f"{init}_equal"], (init, r)
            assert r[f"{init}_managed"] == [["embed_tokens", "lm_head"]], (init, r)
            losses = r[f"{init}_losses"]
            assert losses[-1] < losses[0], (init, losses)
        assert r["meta_losses"] == r["cpu_losses"], r
    assert results[0]["meta_losses"] == results[1]["meta_losses"]


def _tp_build(folder: str, frozen: str | None, init: str, offload: float = 0.0) -> dict:
    """One build at (shard 2 x tp 2), a fresh launch each (torch 2.7's DTensor caches the
    vocabulary-parallel embedding's mask between models of one process: the second model's
    forward failed); its stored bytes, placements and 2 training steps; for the meta-built
    whole model, the tensors that differ from from_pretrained's."""
    from transformers import AutoModelForCausalLM

    from foundryx import builders
    from foundryx.config.schema import ParallelismConfig

    torch.set_num_threads(1)  # 4 processes on a 2-core machine
    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder, "init_device": init}
    if frozen:
        section.update(peft_config=LORA, frozen_base={"dtype": frozen, "offload_fraction": offload})
    parallelism = ParallelismConfig(data_parallel_shard_degree=2, tp=2)
    cfg = SimpleNamespace(model=section, optimizer={"name": "adamw", "lr": 1e-2},
                          parallelism=parallelism)
    torch.manual_seed(0)
    model = builders.parallelize_and_load(builders.build_model(cfg, None), parallelism,
                                          device=torch.device("cpu"))
    out = {"placements": sorted({str(p.placements) for p in model.parameters()}),
           "state": {n: _local_bytes(p) for n, p in model.named_parameters()}}
    out["state"].update({f"{n} (offloaded)": _local_bytes(m.offload.host)
                         for n, m in model.named_modules() if getattr(m, "offload", None)})
    if frozen is None and init == "meta":  # bit for bit from_pretrained's weights
        ref = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).state_dict()
        mine = {k.removeprefix("model."): p.full_tensor() for k, p in model.state_dict().items()}
        out["exact"] = sorted(k for k in ref if not torch.equal(ref[k], mine[k]))
    out["losses"] = train_steps(model, 2, opt=builders.build_optimizer(cfg, model))
    return out


@pytest.mark.modern_leg  # CI time: the torch 2.7 leg is the longer one (passes on both)
def test_shard_on_read_reads_each_ranks_2d_block_under_tensor_parallelism(tmp_path):
    """Under (shard 2 x tp 2) a meta-built Llama reads its 2-D blocks (column-wise layers: rows
    split by TP, then by FSDP; row-wise ones: columns by TP; the vocabulary-parallel embedding
    and head): bit for bit from_pretrained's weights, each rank the same stored bytes as when
    every rank loads the whole model (an int8 base quantized from whole rows, then cut; an NF4
    base, half of it offloaded, its scaler mean over every rank's rows), and the same losses
    (within 1e-6: the first loss differs in its last bits, weights equal)."""
    folder = save_llama(tmp_path / "bf16", torch.bfloat16)
    # NF4 needs each rank's columns of a row to be whole groups of 64-weight blocks: wider
    wide = save_llama(tmp_path / "wide", torch.bfloat16, hidden_size=128, intermediate_size=256)
    for frozen, src, offload in ((None, folder, 0.0), ("int8", folder, 0.0), ("nf4", wide, 0.5)):
        cpu, meta = (run_distributed(_tp_build, world_size=4, args=(src, frozen, init, offload),
                                     timeout=600) for init in ("cpu", "meta"))
        if offload:  # half of the frozen layers in host memory, each rank its part of its block
            assert sum(n.endswith("(offloaded)") for n in meta[0]["state"]) == 7, meta[0]["state"].keys()
        for c, m in zip(cpu, meta):
            assert m.get("exact", []) == [], m["exact"]
            assert c["placements"] == m["placements"]
            differ = sorted(n for n in c["state"] if not all(
                torch.equal(a, m["state"][n][k].to(a.dtype)) for k, a in c["state"][n].items()))
            assert differ == [], (frozen, differ)
            assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(c["losses"], m["losses"])), (
                frozen, c["losses"], m["losses"])
            assert m["losses"][-1] < m["losses"][0]
        # both kinds of split were read: rows over (shard, tp) and columns over tp
        kinds = " ".join(meta[0]["placements"])
        assert "Shard(dim=1)" in kinds and "_StridedShard" in kinds, kinds
