"""Bad pretrained folders under shard-on-read (init_device: meta): each is one
PretrainedLoadError (exit code 2) naming the file or tensor and the fix, raised before any
weight is read, on every rank (2 ranks: the rank with a good folder does not wait for the
other); and loading logs its progress and summary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from hf_tiny import HF_CONFIGS

from foundryx.errors import CheckpointError
from foundryx.loading import PretrainedLoadError, load, prepare
from foundryx.models.hf import ComposerHFCausalLM


def saved(folder, shard="40KB") -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **HF_CONFIGS["llama"], torch_dtype="bfloat16")
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size=shard)
    return str(folder)


def meta_model(folder: str, **overrides):
    return ComposerHFCausalLM(pretrained_model_name_or_path=folder, init_device="meta",
                              config_overrides=overrides)


def check(folder: str, **overrides) -> str:
    with pytest.raises(PretrainedLoadError) as e:
        prepare(meta_model(folder, **overrides), folder)
    assert isinstance(e.value, CheckpointError) and e.value.exit_code == 2
    return str(e.value)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("good") / "llama")


def copy(good: str, tmp_path) -> str:
    return shutil.copytree(good, tmp_path / "m")


def test_index_naming_a_missing_file(good, tmp_path):
    folder = copy(good, tmp_path)
    (folder / "model-00002-of-00003.safetensors").unlink()
    msg = check(str(folder))
    assert "model-00002-of-00003.safetensors" in msg and "not in" in msg and "incomplete" in msg


def test_index_naming_a_tensor_its_file_lacks(good, tmp_path):
    folder = copy(good, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name, file = next(iter(index["weight_map"].items()))
    index["weight_map"] = {**index["weight_map"], "model.extra.weight": file}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "'model.extra.weight'" in check(str(folder)) and file in check(str(folder))


@pytest.mark.parametrize("damage, needle", [
    (lambda b: b[:5], "too short for a safetensors header"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header claims 1000000000 bytes"),
    (lambda b: b[:8] + b"{" + b"x" * (int.from_bytes(b[:8], "little") - 1) + b[8 + int.from_bytes(b[:8], "little"):],
     "header is not valid JSON"),
    (lambda b: b[:-100], "ends at byte"),
])
def test_truncated_or_corrupt_file(good, tmp_path, damage, needle):
    folder = copy(good, tmp_path)
    file = folder / "model-00001-of-00003.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    msg = check(str(folder))
    assert str(file) in msg and needle in msg and "truncated or not a safetensors file" in msg


def test_shape_not_matching_the_config(good):
    msg = check(good, intermediate_size=48)
    assert "'model.layers.0.mlp.gate_proj.weight'" in msg and "[64, 32]" in msg
    assert "[48, 32]" in msg and "config_overrides" in msg


def test_pickle_checkpoint_is_refused_with_the_conversion(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "bin"
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **HF_CONFIGS["llama"]))
    model.config.save_pretrained(folder)  # a pickled checkpoint, as transformers 4 wrote them
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    msg = check(str(folder))
    assert "pytorch_model.bin" in msg and "no safetensors" in msg
    assert "save_pretrained(" in msg and "safe_serialization=True" in msg


def test_missing_tensor_is_named(good, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(f"{good}/config.json", folder)
    state = {}
    for f in sorted(Path(good).glob("*.safetensors")):
        state.update(load_file(f))
    state.pop("model.norm.weight")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    msg = check(str(folder))
    assert "model.norm.weight" in msg and "in none of its safetensors files" in msg


def test_load_logs_progress_and_summary(good, caplog, monkeypatch):
    import foundryx.loading.reader as reader

    monkeypatch.setattr(reader, "LOG_EVERY_S", 0.0)
    model = meta_model(good)
    plan = prepare(model, good)
    with caplog.at_level("INFO"):
        summary = load(model, plan, torch.device("cpu"))
    text = caplog.text
    assert "loading: " in text and "GB/s" in text and "s left" in text
    assert f"loaded {good} in" in text and "peak host memory per rank" in text
    assert summary["bytes_read"] == sum(p.numel() * 2 for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())


def _bad_on_one_rank(good: str, bad: str) -> str:
    from foundryx.parallel import dist

    folder = bad if dist.rank() == 1 else good
    try:
        prepare(meta_model(folder), folder)
    except PretrainedLoadError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_every_rank_stops_on_a_problem_only_one_rank_sees(good, tmp_path):
    folder = copy(good, tmp_path)
    (folder / "model-00003-of-00003.safetensors").unlink()
    results = run_distributed(_bad_on_one_rank, args=(good, str(folder)), timeout=300)
    assert results[0] == results[1] and "model-00003-of-00003.safetensors" in results[0]


@pytest.mark.parametrize("frozen, offload", [(None, 0.0), ("int8", 0.5), ("fp8", 1.0),
                                             ("nf4", 0.5), ("bf16", 1.0)])
def test_one_process_meta_load_equals_cpu_load(good, frozen, offload):
    """On 1 rank too, init_device meta + shard-on-read gives the model init_device cpu builds
    (every frozen_base dtype, offloaded or not): the same weights, the same loss."""
    from types import SimpleNamespace

    from hf_tiny import token_batch

    from foundryx import builders
    from foundryx.models.peft.frozen_base import dequantize

    def build(init_device):
        section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": good,
                   "init_device": init_device,
                   "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}}
        if frozen:
            section["frozen_base"] = {"dtype": frozen, "offload_fraction": offload}
        torch.manual_seed(0)
        model = builders.build_model(SimpleNamespace(model=section), None)
        return builders.parallelize_and_load(model, None, device=torch.device("cpu"))

    cpu, meta = build("cpu"), build("meta")
    a, b = cpu.state_dict(), meta.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(dequantize(a[k], torch.float32), dequantize(b[k], torch.float32)), k
    batch = token_batch()
    with torch.no_grad():
        assert cpu.loss(cpu(batch), batch).item() == meta.loss(meta(batch), batch).item()


@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16"])
def test_chunked_quantize_on_load_equals_quantizing_the_whole_weight(kind, monkeypatch):
    """The loader quantizes a slice a few rows at a time through a reused float32 scratch
    buffer: bit for bit what quantize_rows gives for the whole weight, whatever the chunk,
    from any stored dtype to any model dtype (zero rows, tiny and huge values, an infinity)."""
    import foundryx.loading.quantize as quantize
    from foundryx.models.peft.rowwise import RowScaledTensor

    torch.manual_seed(0)
    w = torch.randn(37, 96, dtype=torch.float64) * 0.05
    w[3], w[4], w[6] = 0.0, -0.0, 1e-30
    w[5, 7], w[7, 9] = 1e30, float("-inf")
    for stored in (torch.bfloat16, torch.float16, torch.float32):
        for dtype in (torch.float32, torch.bfloat16):
            whole = RowScaledTensor.from_weight(w.to(stored).to(dtype), kind)
            for chunk in (96 * 5, 1 << 18):  # 5 rows at a time; all at once
                monkeypatch.setattr(quantize, "CHUNK", chunk)
                monkeypatch.setattr(quantize, "_scratch", __import__("threading").local())
                mine = quantize.rowwise(w.to(stored), kind, dtype)
                bits = torch.int16 if kind == "bf16" else torch.uint8
                assert mine.dtype == whole.dtype and torch.equal(mine.scale, whole.scale)
                assert torch.equal(mine.qdata.view(bits), whole.qdata.view(bits)), (stored, dtype, chunk)


def test_nf4_on_load_equals_torchao_bit_for_bit():
    """The loader's NF4 (a table look-up per element, the exact two-level search near a
    decision boundary) picks torchao's level for every bfloat16 / float16 value in [-1, 1],
    for float32 values a rounding either side of each boundary, NaN and the ends; and a
    weight with a zero block and a zero row gives torchao's NF4Tensor exactly."""
    from foundryx.loading import nf4_codes, nf4_shard
    from foundryx.models.peft.torchao_nf4 import NF4Tensor, to_nf4

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lut = nf4_codes.levels(dtype)
        mids = (lut[1:].double() + lut[:-1].double()) / 2
        v = torch.cat([torch.rand(20000, dtype=torch.float64) * 2 - 1, lut.double(), mids,
                       mids.nextafter(torch.tensor(2.0, dtype=torch.float64)),
                       mids.nextafter(torch.tensor(-2.0, dtype=torch.float64)),
                       torch.tensor([float("nan"), 1.5, -1.5, 0.0, -0.0])]).to(dtype)
        if dtype != torch.float32:  # every value of the dtype in [-1, 1]
            every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
            v = torch.cat([v, every[every.float().abs() <= 1]])
        if dtype == torch.float32:  # every float32 value of each bucket a boundary falls in
            edges = nf4_codes.code_tables(dtype)[1].isfinite().nonzero().squeeze(1)
            assert len(edges) == 15, edges  # one bucket for each of the 15 boundaries
            top = (edges << 16).to(torch.int32)  # the bucket's top 16 bits, unsigned
            v = torch.cat([v, *(((top | low).view(torch.float32)) for low in range(1 << 16))])
        want = NF4Tensor.quantize_tensor_nearest(v, lut).to(torch.uint8)
        assert torch.equal(nf4_codes.lookup_codes(v, lut), want), dtype
        inside = v[v.abs() <= 1]  # as nf4_encode calls it on a block scaled by its absmax
        assert torch.equal(nf4_codes.lookup_codes(inside, lut, within=True), want[v.abs() <= 1]), dtype
        w = (torch.randn(64, 512, dtype=torch.float64) * 0.02).to(torch.bfloat16)
        w[3], w[5, :64] = 0, 0
        ref, mine = to_nf4(w.to(dtype), 64, 256), nf4_shard.nf4(w, to_nf4(w.to(dtype), 64, 256), dtype)
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(mine, part), getattr(ref, part)), (dtype, part)


@pytest.mark.parametrize("precision", ["amp_bf16", "fp32"])
def test_one_process_under_amp_bf16_keeps_the_frozen_weights_read_in_bf16(good, precision,
                                                                           caplog):
    """One process, LoRA, a bf16 checkpoint read shard by shard under amp_bf16: every frozen
    weight that is not a frozen linear layer's (embedding, head, norms in and outside the
    blocks) keeps bf16, as an FSDP2 run computes them, said in one line; the adapters stay
    float32, and the loss under autocast equals the fp32 model's within bf16 rounding. In fp32
    nothing changes (issue 46)."""
    import logging
    from types import SimpleNamespace

    from hf_tiny import token_batch

    from foundryx import builders

    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": good,
               "init_device": "meta", "frozen_base": {"dtype": "bf16"},
               "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16}}
    model = builders.build_model(SimpleNamespace(model=section), None)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        model = builders.parallelize_and_load(model, None, device=torch.device("cpu"),
                                              precision=precision)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad
              and any(k in n for k in ("norm", "embed", "lm_head"))}
    assert {n.split(".")[-2] for n in frozen} >= {"embed_tokens", "lm_head", "input_layernorm",
                                                  "post_attention_layernorm", "norm"}
    lines = [r.getMessage() for r in caplog.records if "keep the checkpoint" in r.getMessage()]
    if precision == "fp32":
        assert lines == [] and all(d == torch.float32 for d in dtypes.values())
        return
    assert {dtypes[n] for n in frozen} == {torch.bfloat16}, dtypes
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert len(lines) == 1 and "computed in bfloat16" in lines[0]
    batch = token_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        kept = model.loss(model(batch), batch).item()
    model.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        wide = model.loss(model(batch), batch).item()
    assert kept == pytest.approx(wide, rel=2e-2)
