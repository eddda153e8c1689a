"""NF4 on load on a GPU (foundryx.loading.nf4_device.encode_on_device), run here on CPU tensors:
torchao's bytes for every source and NF4 dtype, blocks of zeros, infinities and NaNs
included, and at most one host sync per weight however many chunks it spans."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundryx.kernels import nf4_cpu
from foundryx.loading import nf4_device, nf4_encode, nf4_shard

aten = torch.ops.aten


def _weight(stored: torch.dtype) -> torch.Tensor:
    """A weight of 64 rows of 512 (512 blocks of 64) with each kind of block that needs
    torchao's own search: a zero row, a zero block, an infinity, a negative infinity, a NaN,
    and a block holding an infinity and a NaN."""
    torch.manual_seed(0)
    w = (torch.randn(64, 512, dtype=torch.float64) * 0.02).to(stored)
    w[3] = 0
    w[5, :64] = 0
    w[7, 3] = float("inf")
    w[9, 70] = float("-inf")
    w[11, 200] = float("nan")
    w[13, 64], w[13, 65] = float("inf"), float("nan")
    return w


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, a NaN equal to a NaN."""
    return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_device_path_gives_torchaos_nf4(stored, dtype, monkeypatch):
    """Block maxima and codes of the device path, over many chunks, equal torchao's to_nf4 of
    the weight in the NF4 dtype and, bit for bit, the CPU path's; and the NF4 tensor built from
    them equals torchao's, part for part."""
    from foundryx.models.peft.torchao_nf4 import get_block_absmax, to_nf4

    monkeypatch.setattr(nf4_device, "DEVICE_CHUNK", 64 * 24)  # 22 chunks, the last one short
    w = _weight(stored)
    ref = to_nf4(w.to(dtype), 64, 256)
    mine = nf4_device.encode_on_device(w, 64, dtype)
    assert torch.equal(mine.codes, ref.quantized_data), (stored, dtype)
    assert _same(mine.absmax, get_block_absmax(w.to(dtype).reshape(-1), 64))
    cpu = nf4_encode.nf4_encode(w, 64, dtype)
    assert torch.equal(mine.codes, cpu.codes)
    assert torch.equal(mine.absmax.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       cpu.absmax.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    got = nf4_shard.nf4(mine, ref, dtype)
    for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        assert _same(getattr(got, part), getattr(ref, part)), (stored, dtype, part)


def test_a_weight_of_zeros_is_recoded_a_chunk_at_a_time(monkeypatch):
    """Every block odd (a weight of zeros, as a zero-initialized checkpoint tensor gives): torchao's
    codes, its search run on at most a chunk of blocks at a time (16 differences a value: on
    the whole weight at once it would hold 64 bytes a weight)."""
    from foundryx.models.peft.torchao_nf4 import NF4Tensor, to_nf4

    monkeypatch.setattr(nf4_device, "DEVICE_CHUNK", 64 * 8)
    w = torch.zeros(16, 256, dtype=torch.bfloat16)
    want = to_nf4(w, 64, 64).quantized_data
    nf4_device._device_lut(torch.bfloat16, w.device)  # found by the same search: before counting
    sizes = []
    search = NF4Tensor.quantize_tensor_nearest
    monkeypatch.setattr(NF4Tensor, "quantize_tensor_nearest",
                        staticmethod(lambda v, lut: sizes.append(v.numel()) or search(v, lut)))
    mine = nf4_device.encode_on_device(w, 64, torch.bfloat16)
    assert torch.equal(mine.codes, want)
    assert sizes == [64 * 8] * 8


class _HostSyncs(TorchDispatchMode):
    """Counts the operations that make the host wait for a GPU: reading a value (``bool``,
    ``item``, ``int``), ``nonzero`` and the other ops whose output size depends on the data,
    and indexing with a boolean mask (a ``nonzero`` inside)."""

    SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
             aten.unique_consecutive.default}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        if func in self.SYNCS or masked:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def _host_syncs(monkeypatch, run) -> list[str]:
    """The host syncs (see :class:`_HostSyncs`, and ``tolist``) that ``run()`` makes."""
    lists: list[str] = []
    tolist = torch.Tensor.tolist
    with monkeypatch.context() as mp, _HostSyncs() as syncs:
        mp.setattr(torch.Tensor, "tolist", lambda t: lists.append("tolist") or tolist(t))
        run()
    return syncs.calls + lists


@pytest.mark.parametrize("odd", [False, True])
def test_the_device_path_syncs_with_the_host_at_most_once_per_weight(odd, monkeypatch):
    """A weight of 64 chunks, with or without blocks that need torchao's search: one host sync
    in all (``nonzero`` of the odd blocks), where the CPU path's chunk loop (the counter's
    check) takes one or two per chunk."""
    monkeypatch.setattr(nf4_device, "DEVICE_CHUNK", 512)
    monkeypatch.setattr(nf4_encode, "CHUNK", 512)
    monkeypatch.setattr(nf4_cpu, "_lib", {"lib": "off: the CPU path's chunk loop"})
    w = (torch.randn(64, 512) * 0.02).to(torch.bfloat16)
    if odd:
        w[3], w[40, 7] = 0, float("nan")
    nf4_device.encode_on_device(w, 64, torch.float32)  # the levels' first copy to the device
    device = _host_syncs(monkeypatch, lambda: nf4_device.encode_on_device(w, 64, torch.float32))
    assert len(device) <= 1, device
    assert len(_host_syncs(monkeypatch, lambda: nf4_encode.nf4_encode(w, 64, torch.float32))) >= 64


def test_a_tensor_on_a_device_takes_the_device_path(monkeypatch):
    """nf4_encode hands any tensor off the CPU to the device path, before touching its data."""
    seen = []
    monkeypatch.setattr(nf4_encode, "encode_on_device", lambda rows, block, dtype: seen.append(rows.device))
    nf4_encode.nf4_encode(torch.empty(4, 64, device="meta"), 64, torch.float32)
    assert seen == [torch.device("meta")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_device_path_gives_the_cpus_bytes_with_one_sync(monkeypatch):
    """On a real GPU: the bytes of the CPU path, and torch's own sync check (``warn``) counts at
    most one synchronizing call for a weight of many chunks."""
    import warnings

    monkeypatch.setattr(nf4_device, "DEVICE_CHUNK", 64 * 16)
    w = _weight(torch.bfloat16)
    cpu = nf4_encode.nf4_encode(w, 64, torch.float32)
    gpu = w.cuda()
    nf4_encode.nf4_encode(gpu, 64, torch.float32)  # the levels' first copy to the device
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            mine = nf4_encode.nf4_encode(gpu, 64, torch.float32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(s.message) for s in said if "synchroniz" in str(s.message)]
    assert len(syncs) <= 1, syncs
    assert torch.equal(mine.codes.cpu(), cpu.codes) and _same(mine.absmax.cpu(), cpu.absmax)
