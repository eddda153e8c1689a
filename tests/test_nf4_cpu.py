"""The one-pass C encoder of NF4 on load (foundryx.kernels.nf4_cpu): torchao's codes for every
value that matters, torchao's NF4 weights through the loader, the torch-op encoder where it
cannot run, and one line saying so when there is no C compiler."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys

import pytest
import torch

from foundryx.kernels import nf4_cpu
from foundryx.loading import nf4_codes, nf4_encode, nf4_shard

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")


def _values(dtype: torch.dtype) -> torch.Tensor:
    """Values of ``dtype`` in [-1, 1] where a code can go wrong: every one of a 16-bit dtype; for
    float32 every value of the 15 buckets (top 16 bits) that hold a decision boundary, the
    levels, their midpoints a rounding either side, and random ones."""
    lut = nf4_codes.levels(dtype)
    mids = (lut[1:].double() + lut[:-1].double()) / 2
    v = torch.cat([torch.rand(20000, dtype=torch.float64) * 2 - 1, lut.double(), mids,
                   mids.nextafter(torch.tensor(2.0, dtype=torch.float64)),
                   mids.nextafter(torch.tensor(-2.0, dtype=torch.float64)),
                   torch.tensor([1.0, -1.0, 0.0, -0.0])]).to(dtype)
    if dtype != torch.float32:
        v = torch.cat([v, torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)])
    else:
        edges = nf4_codes.code_tables(dtype)[1].isfinite().nonzero().squeeze(1)
        top = (edges << 16).to(torch.int32)
        v = torch.cat([v, *(((top | low).view(torch.float32)) for low in range(1 << 16))])
    return v[v.float().abs() <= 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_boundary_value_gets_torchaos_code(dtype):
    """Blocks of 1.0 (the absmax: each value divides by it exactly) and 63 test values: the
    kernel's code for each is torchao's nearest level, for every bfloat16 value in [-1, 1] and
    every float32 value of the buckets that hold a boundary (15 x 65536)."""
    from foundryx.models.peft.torchao_nf4 import NF4Tensor

    v = _values(dtype)
    v = torch.cat([v, v[: (-len(v)) % 63]])  # a whole number of blocks of 63
    rows = torch.cat([torch.ones(len(v) // 63, 1, dtype=dtype), v.view(-1, 63)], dim=1).contiguous()
    absmax, packed = torch.empty(rows.shape[0]), torch.empty(rows.numel() // 2, dtype=torch.uint8)
    assert nf4_cpu.encode(rows, 64, dtype, nf4_codes.thresholds(dtype), absmax, packed) == 0
    codes = torch.stack([packed >> 4, packed & 15], dim=1).view(rows.shape)[:, 1:].reshape(-1)
    want = NF4Tensor.quantize_tensor_nearest(v, nf4_codes.levels(dtype)).to(torch.uint8)
    assert torch.equal(absmax, torch.ones(rows.shape[0]))
    wrong = (codes != want).nonzero().squeeze(1)
    assert not len(wrong), (dtype, v[wrong[:5]].tolist(), codes[wrong[:5]].tolist(), want[wrong[:5]].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float32])
def test_loader_nf4_equals_torchao(stored, dtype):
    """The loader's NF4 of a weight stored in any dtype equals torchao's to_nf4 of the weight
    in the model's dtype, part for part; a block of zeros, an infinity or a NaN sends the slice
    to the torch-op encoder, which gives torchao's bytes too."""
    from foundryx.models.peft.torchao_nf4 import to_nf4

    torch.manual_seed(0)
    w = (torch.randn(64, 512, dtype=torch.float64) * 0.02).to(stored)
    assert nf4_cpu.available()  # this machine built the kernel: the next line runs it
    fused = nf4_encode.nf4_encode(w, 64, dtype)  # no zero block: the kernel's bytes
    with pytest.MonkeyPatch.context() as mp:  # as on a machine without the kernel
        mp.setattr(nf4_cpu, "_lib", {"lib": "switched off by the test"})
        unfused = nf4_encode.nf4_encode(w, 64, dtype)
    assert torch.equal(fused.codes, unfused.codes) and torch.equal(fused.absmax, unfused.absmax)
    w[5, :64] = 0
    w[3] = 0
    w[7, 3] = float("inf")
    for weight in (w[:32], w[32:], w):
        ref, mine = to_nf4(weight.to(dtype), 64, 256), nf4_shard.nf4(weight, to_nf4(weight.to(dtype), 64, 256), dtype)
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            a, b = getattr(mine, part), getattr(ref, part)
            assert a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all()), (stored, dtype, part)


def test_without_a_compiler_the_loader_says_so_once_and_encodes_with_torch(tmp_path, monkeypatch, caplog):
    from foundryx.models.peft.torchao_nf4 import to_nf4

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FOUNDRYX_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nf4_cpu, "_lib", {})
    w = (torch.randn(64, 256, dtype=torch.float64) * 0.02).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="foundryx.kernels.nf4_cpu"):
        for _ in range(2):
            got = nf4_shard.nf4(w, to_nf4(w.float(), 64, 256), torch.float32)
    assert torch.equal(got.quantized_data, to_nf4(w.float(), 64, 256).quantized_data)
    said = [r for r in caplog.records if "NF4 on load" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    line = said[0].getMessage()  # why, what it costs, and the fix
    assert "no-such-cc" in line and "3x the load's CPU time" in line and "set CC" in line, line
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.so"))


def test_the_library_is_built_once_and_then_reused(tmp_path, monkeypatch):
    """A second process (here: a fresh handle on the library) finds the built file and does not
    run the compiler again; a failed build says why and leaves no file behind."""
    calls = tmp_path / "calls"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("cc") or shutil.which("gcc")} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("FOUNDRYX_KERNEL_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        monkeypatch.setattr(nf4_cpu, "_lib", {})
        assert not isinstance(nf4_cpu.library(), str)
    builds = [line for line in calls.read_text().splitlines() if "--version" not in line]
    assert len(builds) == 1, builds
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    monkeypatch.setattr(nf4_cpu, "_lib", {})
    monkeypatch.setattr(nf4_cpu, "SOURCE", nf4_cpu.SOURCE + "\nthis is not C;\n")
    why = nf4_cpu.library()
    assert isinstance(why, str) and "failed" in why and "error" in why, why
    assert list((tmp_path / "cache").iterdir()) == built


# Any use of the type in the source fails the build, as on gcc < 12 on x86-64 (Ubuntu 22.04's
# gcc 11, RHEL 8/9), where the type does not exist.
WITHOUT_FLOAT16 = "-D_Float16=_Float16_is_not_available"


@pytest.fixture(scope="module", params=["cc", "zig"])
def built_without_float16(request, tmp_path_factory):
    """The kernel's source built with ``_Float16`` poisoned, by the system's C compiler and by
    zig's clang (the ``ziglang`` package of the dev dependencies), as a loaded library."""
    if request.param == "zig":
        if importlib.util.find_spec("ziglang") is None:
            pytest.skip("the ziglang package is not installed")
        cc = [sys.executable, "-m", "ziglang", "cc"]
    else:
        cc = [shutil.which("cc") or shutil.which("gcc")]
    folder = tmp_path_factory.mktemp(f"nf4-{request.param}")
    flags = [*nf4_cpu.FLAGS, WITHOUT_FLOAT16]
    with pytest.MonkeyPatch.context() as mp:  # the flags do take the type away from this compiler
        mp.setattr(nf4_cpu, "SOURCE", nf4_cpu.SOURCE + "\n_Float16 uses_the_type;\n")
        assert nf4_cpu._compile(cc, flags, folder / "poisoned.so") is not None
    assert nf4_cpu._compile(cc, flags, folder / "nf4_cpu.so") is None
    lib = nf4_cpu._load(folder / "nf4_cpu.so")
    assert not isinstance(lib, str), lib
    return lib


def _every_float16() -> torch.Tensor:
    """The 65536 float16 values, by bit pattern."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)


def test_every_float16_converts_exactly_without_the_type(built_without_float16, monkeypatch):
    """Each float16 pattern alone in a block of two (the other value 0): the block's absmax is
    the pattern's magnitude as torch converts it to float32, bit for bit: zeros, subnormals,
    normals, infinities, and NaNs with their payloads; the blocks left to the torch-op encoder
    are exactly those of a zero, an infinity or a NaN."""
    monkeypatch.setattr(nf4_cpu, "_lib", {"lib": built_without_float16})
    x = _every_float16()
    rows = torch.stack([x, torch.zeros_like(x)], dim=1).contiguous()
    absmax, packed = torch.empty(len(x)), torch.empty(len(x), dtype=torch.uint8)
    left = nf4_cpu.encode(rows, 2, torch.float32, nf4_codes.thresholds(torch.float32), absmax, packed)
    assert left == int(((x == 0) | ~x.isfinite()).sum())  # 2 zeros, 2 infinities, 2046 NaNs
    want = x.float().view(torch.int32) & 0x7FFFFFFF
    wrong = (absmax.view(torch.int32) != want).nonzero().squeeze(1)
    assert not len(wrong), [hex(int(b)) for b in x.view(torch.int16)[wrong[:5]].to(torch.int32) & 0xFFFF]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float16_weights_get_torchaos_nf4_without_the_type(built_without_float16, monkeypatch, dtype):
    """Every finite float16 value, shuffled into blocks of 64 (absmax of every size: subnormal,
    normal, up to 65504), then every one in [-1, 1] in blocks led by 1.0 (each value's own code
    at every decision boundary): codes and block maxima are torchao's for the weight in the NF4
    dtype."""
    from foundryx.models.peft.torchao_nf4 import get_block_absmax, to_nf4

    monkeypatch.setattr(nf4_cpu, "_lib", {"lib": built_without_float16})
    x = _every_float16()
    finite = x[x.isfinite()]
    shuffled = finite[torch.randperm(len(finite), generator=torch.Generator().manual_seed(0))]
    unit = finite[finite.float().abs() <= 1]
    unit = torch.cat([unit, unit[: (-len(unit)) % 63]]).view(-1, 63)
    unit = torch.cat([torch.ones(len(unit), 1, dtype=torch.float16), unit], dim=1)
    w = torch.cat([shuffled, unit.reshape(-1)])
    assert len(w) % 64 == 0
    absmax, packed = torch.empty(len(w) // 64), torch.empty(len(w) // 2, dtype=torch.uint8)
    assert nf4_cpu.encode(w, 64, dtype, nf4_codes.thresholds(dtype), absmax, packed) == 0
    ref = w.to(dtype)
    assert torch.equal(absmax, get_block_absmax(ref, 64).float())
    want = to_nf4(ref, 64, 1).quantized_data
    wrong = (packed != want).nonzero().squeeze(1)
    assert not len(wrong), (dtype, w[2 * wrong[:3]].tolist(), packed[wrong[:3]].tolist(), want[wrong[:3]].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_tensors_built_from_parts_are_torchaos_own(dtype):
    """The one way foundryx builds an NF4 tensor from its parts (loading, TP cuts, offload
    gathers) gives back, for to_nf4's own parts, a tensor equal to to_nf4's: shape, stride,
    dtype, block sizes, every part, and the dequantized weight bit for bit. A torchao that
    changes its subclass protocol fails here, on each leg's torchao."""
    from foundryx.models.peft.parts import nf4_part
    from foundryx.models.peft.torchao_nf4 import NF4Tensor, nf4_from_parts, nf4_parts, to_nf4

    torch.manual_seed(0)
    ref = to_nf4(torch.randn(96, 512).to(dtype), 64, 8)
    mine = nf4_from_parts(NF4Tensor, ref.shape, dtype, ref.device, block_size=64,
                          scaler_block_size=8, **nf4_parts(ref))
    assert type(mine) is NF4Tensor and mine.shape == ref.shape and mine.stride() == ref.stride()
    assert (mine.dtype, mine.block_size, mine.scaler_block_size, mine.n_blocks) == \
        (ref.dtype, ref.block_size, ref.scaler_block_size, ref.n_blocks)
    assert all(torch.equal(a, b) for a, b in zip(nf4_parts(mine).values(), nf4_parts(ref).values()))
    assert torch.equal(mine.get_original_weight(), ref.get_original_weight())
    rows = nf4_part(ref, rows=slice(32, 64))  # a part of it: rows 32..63, their bytes
    assert rows.shape == (32, 512) and rows.n_blocks == 32 * 512 // 64
    assert torch.equal(rows.get_original_weight(), ref.get_original_weight()[32:64])
