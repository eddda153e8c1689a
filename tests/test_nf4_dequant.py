"""The NF4 decoding operator (issue 51, ``fused_ops.nf4_dequantize``): its Triton kernel and its
torch form give torchao's own dequantization bit for bit (the kernel in Triton's interpreter on
a CPU: tests/conftest.py sets TRITON_INTERPRET=1; on the GPU in the run book), one op a call
priced at its bytes in the census, LoRA steps on an NF4 base fused and unfused, and where the
operator steps aside (said in one line)."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
from hf_tiny import HF_CONFIGS
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import op_census
from foundryx import builders
from foundryx.config.schema import FusedOpsConfig
from foundryx.errors import ConfigError
from foundryx.kernels import nf4_dequant_op
from foundryx.models.peft import frozen_base
from foundryx.models.peft.frozen_base import LowPrecisionLinear
from foundryx.models.peft.torchao_nf4 import nf4_parts, to_nf4
from foundryx.parallel.fused_ops import apply_fused_ops
from foundryx.parallel.policy import blocks

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weights(dtype: torch.dtype, rows: int = 24, cols: int = 64 * 7) -> torch.Tensor:
    """Rows of every magnitude (1e-4 to 1e3), a zero row (a block whose absmax is 0) and a
    row of one value repeated (every code the same level)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 3, rows)[:, None]
    w[2] = 0
    w[5] = 0.37
    return w.to(dtype)


def args(t) -> list:
    p = nf4_parts(t)
    return [p["quantized_data"], p["quantized_scalers"], p["quantization_factor"],
            p["scaler_mean"], p["nf4"], t.block_size, t.scaler_block_size]


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    ints = {4: torch.int32, 2: torch.int16}[want.element_size()]
    differ = (got.view(ints) != want.view(ints)).sum().item()
    assert differ == 0, f"{differ} of {want.numel()} values differ"


# 24 x 448 in blocks of 64: 168 blocks, in scaler groups of 7 (24 groups) and of 3 (56); 2,688
# bytes of codes: two whole programs of 1,024 bytes and a masked tail of 640
@pytest.mark.parametrize("nf4_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaler_block", [7, 3])
def test_the_kernel_gives_torchao_s_bits(nf4_dtype, out, scaler_block):
    pytest.importorskip("triton")
    from foundryx.kernels import nf4_dequant

    t = to_nf4(weights(nf4_dtype), 64, scaler_block)
    want = t.get_original_weight().to(out)
    got = nf4_dequant.dequantize(*[a.to(DEVICE) if isinstance(a, torch.Tensor) else a
                                   for a in args(t)], out)
    same_bits(got.cpu().view(t.shape), want)


def test_the_kernel_rounds_float16_and_from_float16_as_torch():
    pytest.importorskip("triton")
    from foundryx.kernels import nf4_dequant

    for nf4_dtype, out in ((torch.float16, torch.bfloat16), (torch.float32, torch.float16)):
        t = to_nf4(weights(nf4_dtype), 64, 8)
        got = nf4_dequant.dequantize(*[a.to(DEVICE) if isinstance(a, torch.Tensor) else a
                                       for a in args(t)], out)
        same_bits(got.cpu().view(t.shape), t.get_original_weight().to(out))


@pytest.mark.parametrize("chunk", [0, 5, 4096])  # the device's chunks; 5 blocks: a ragged end
def test_the_operator_on_a_cpu_is_torchao_s_decoding(chunk):
    t = to_nf4(weights(torch.bfloat16), 64, 7)
    for out in (torch.bfloat16, torch.float32):
        got = torch.ops.foundryx.nf4_dequantize(*args(t), out, chunk)
        same_bits(got.view(t.shape), t.get_original_weight().to(out))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args(t)]
        y = torch.ops.foundryx.nf4_dequantize(*fake, torch.bfloat16, chunk)
    assert y.shape == (t.numel(),) and y.dtype == torch.bfloat16


def test_the_census_counts_one_op_a_call_with_its_bytes():
    """An NF4 layer set to the operator: forward and backward each decode once (one op), priced
    at the codes, scalers, factors, mean and levels read and the bf16 weight written."""
    out_f, in_f = 192, 256
    torch.manual_seed(0)
    layer = LowPrecisionLinear(torch.nn.Linear(in_f, out_f, bias=False), "nf4", "w")
    layer.nf4_op = True
    x = torch.randn(4, in_f, dtype=torch.bfloat16, requires_grad=True)
    census = op_census.OpCensus({})
    with census:
        y = layer(x)
        with census.in_phase("backward"):
            y.sum().backward()
    rows = {(place.split(":")[0], op): r for (place, op), r in census.rows.items()}
    n = out_f * in_f
    blocks_ = n // 64
    scaler_block = layer.weight.scaler_block_size
    # codes (half a byte a weight), int8 scalers, float32 factors and mean, 16 float32 levels;
    # the bf16 weight written
    moved = n // 2 + blocks_ + 4 * (blocks_ // scaler_block) + 4 + 16 * 4 + 2 * n
    assert rows[("forward", "nf4_dequantize")][:2] == [1, moved]
    assert rows[("backward", "nf4_dequantize")][:2] == [1, moved]
    decode = {"index", "bitwise_and", "__rshift__", "bitwise_right_shift", "_to_copy", "copy_"}
    assert not decode & {op for _, op in rows}  # no torch op of the unfused decoding left
    assert op_census.kind_of("backward: _FrozenLinearFnBackward", "nf4_dequantize") == "NF4 decode"
    assert x.grad is not None


def test_a_weight_the_kernel_lacks_is_decoded_by_torch_ops_said_once(caplog):
    """float64 (not a kernel dtype): the torch ops' values, one line however many calls."""
    torch.manual_seed(0)
    layer = LowPrecisionLinear(torch.nn.Linear(128, 64, bias=False), "nf4", "w")
    frozen_base._say_unfused.cache_clear()
    with caplog.at_level(logging.INFO, logger="foundryx"):
        for _ in range(3):
            got = frozen_base.dequantize(layer.weight, torch.float64, nf4_op=True)
    assert torch.equal(got, layer.weight.get_original_weight().to(torch.float64))
    lines = [r.getMessage() for r in caplog.records if "nf4_dequantize" in r.getMessage()]
    assert lines == ["fused_ops.nf4_dequantize: an NF4 weight is decoded by torch ops, not the "
                     "fused operator: output dtype torch.float64 is not one of float32, "
                     "bfloat16, float16"]
    assert nf4_dequant_op.problem(*args(layer.weight)[:5], 63, 1, torch.bfloat16) is not None


def test_the_flagship_census_decodes_an_nf4_base_by_the_operator():
    """benchmarks.op_census's nf4 side (the flagship recipe on the tiny Llama shape: 2 layers
    of 7 NF4 layers): one nf4_dequantize a layer forward, in the recompute and in backward
    (see the step test below for the 3 fewer), and none of the unfused decoding's lookups."""
    from pathlib import Path

    tiny = Path(__file__).parents[1] / "benchmarks" / "gpu_runbook" / "shapes" / "llama-tiny"
    got = op_census.census("nf4", tiny, batch=1, seq=32)
    ops = op_census.op_counts(got)
    assert ops["nf4_dequantize"] == 14 + 14 + 11
    # in the frozen layers: the decoding and the GEMMs (and backward's sum of the gradients of
    # q, k and v's shared input), none of the unfused decoding's lookups, shifts and casts
    frozen = {key.split(" | ")[1] for key in got["places"]
              if "base_layer" in key or "_FrozenLinearFn" in key}
    assert frozen == {"nf4_dequantize", "mm", "add"}
    assert got["other_bytes_by_kind"]["NF4 decode"] > 0


# ---------------------------------------------------------------------------------------
# on a model
# ---------------------------------------------------------------------------------------
SECTION = {"name": "hf_causal_lm", "pretrained": False,
           "config": {"model_type": "llama", **HF_CONFIGS["llama"]},
           "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16,
                           "lora_dropout": 0.1},
           "frozen_base": {"dtype": "nf4"}}


def _build(fused: bool):
    from foundryx.parallel.wrappers import checkpoint_activations

    cfg = SimpleNamespace(model=dict(SECTION), optimizer={"name": "adamw", "lr": 1e-2})
    torch.manual_seed(0)
    model = builders.build_model(cfg, None)
    block_list = [m for _, m in blocks(model)]
    said = apply_fused_ops(model, block_list, FusedOpsConfig(False, False, False, fused), CPU)
    assert said == (["14 NF4 layers decoded by one kernel"] if fused else [])
    for m in block_list:  # recomputed in backward, as the recipes run
        checkpoint_activations(m)
    return model, builders.build_optimizer(cfg, model)


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _steps(fused: bool, n: int = 8):
    model, opt = _build(fused)
    ids = torch.randint(0, HF_CONFIGS["llama"]["vocab_size"], (n, 2, 24),
                        generator=torch.Generator().manual_seed(1))
    losses, count = [], Count()
    model.train()
    torch.manual_seed(3)  # LoRA's dropout: the same masks when drawn in the same order
    for i in range(n):
        batch = {"input_ids": ids[i]}
        with count if i == 0 else contextlib.nullcontext():
            loss = model.loss(model(batch), batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, count.ops.get("nf4_dequantize", 0)


def test_eight_lora_steps_on_an_nf4_base_fused_equal_the_unfused():
    """On a CPU the operator runs the torch ops of the unfused path: the same losses exactly.
    Each of the 14 NF4 layers decodes once forward, once in the recompute and once in backward
    (but layer 0's q, k and v: their input, the frozen embedding's normed output, wants no
    gradient)."""
    fused, calls = _steps(True)
    plain, none = _steps(False)
    assert fused == plain and len(set(fused)) > 1
    assert calls == 14 + 14 + (14 - 3) and none == 0


def test_auto_is_off_on_a_cpu_and_true_without_an_nf4_base_is_an_error():
    model, _ = _build(False)
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    assert apply_fused_ops(model, [], FusedOpsConfig(), CPU) == []
    assert not any(m.nf4_op for m in layers)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="fused_ops.nf4_dequantize: true, but the model has no "
                                          "NF4 frozen base"):
        apply_fused_ops(plain, [], FusedOpsConfig(False, False, False, True), CPU)
    assert apply_fused_ops(plain, [], FusedOpsConfig(False, False, False, "auto"),
                           torch.device("cuda")) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CUDA device that cannot run")
def test_a_kernel_that_fails_its_first_call_keeps_the_torch_ops_said_in_one_line(caplog):
    from foundryx.kernels import checks

    checks.first_call_problem.cache_clear()
    model, _ = _build(False)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        said = apply_fused_ops(model, [], FusedOpsConfig(False, False, False, "auto"),
                               torch.device("cuda"))
    checks.first_call_problem.cache_clear()
    assert said == []
    assert not any(getattr(m, "nf4_op", False) for m in model.modules())
    lines = [r.getMessage() for r in caplog.records if "nf4_dequantize" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "fused_ops.nf4_dequantize: the kernel failed its first check on cuda")
    assert lines[0].endswith("the NF4 layers keep decoding by torch ops")


def _nf4_under_fsdp2() -> dict:
    """An MPT with LoRA over an NF4 base, sharded by FSDP2 over the ranks, 4 steps with the
    weights decoded by the operator (from ``fused_ops``, through ``parallelize``) and by torch
    ops; how often the operator ran."""
    from hf_tiny import MPT_TINY, train_steps

    from foundryx.builders import apply_frozen_storage
    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.peft.frozen_options import FrozenBaseOptions
    from foundryx.models.peft.lora import apply_lora
    from foundryx.models.peft.options import LoraOptions
    from foundryx.parallel import parallelize

    out = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = ComposerMPTCausalLM(**{**MPT_TINY, "d_model": 64})
        apply_lora(model, LoraOptions(target_modules=["Wqkv", "out_proj", "up_proj"], r=4,
                                      lora_alpha=8))
        apply_frozen_storage(model, FrozenBaseOptions(dtype="nf4"))
        parallelize(model, ParallelismConfig(), device=CPU,
                    fused_ops=FusedOpsConfig(False, False, False, fused))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        count = Count()
        with count:
            losses = train_steps(model, 1, opt=opt)
        out[fused] = {"losses": losses + train_steps(model, 3, opt=opt),
                      "calls": count.ops.get("nf4_dequantize", 0)}
    out["fell back"] = frozen_base._say_unfused.cache_info().currsize
    return out


@pytest.mark.slow
def test_an_fsdp2_sharded_nf4_base_decodes_its_gathered_weights_by_the_operator():
    """Two processes: FSDP2 all-gathers each NF4 weight and the layer decodes the whole of it
    by one operator call (no line saying a weight fell back to torch ops), with the losses of
    the torch-op decoding exactly; both ranks alike."""
    from distributed import run_distributed

    results = run_distributed(_nf4_under_fsdp2, timeout=300)
    assert results[0] == results[1]
    r = results[0]
    assert r[True]["losses"] == r[False]["losses"] and len(set(r[True]["losses"])) > 1
    # the 8 frozen linear layers (2 blocks: the bases of Wqkv, out_proj and up_proj, and
    # down_proj) forward, 7 in backward (block 0's Wqkv: its input wants no gradient)
    assert r[True]["calls"] == 8 + 7 and r[False]["calls"] == 0 and r["fell back"] == 0
