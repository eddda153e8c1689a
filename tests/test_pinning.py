"""The offloaded weights' host buffer is pinned in place with ``cudaHostRegister`` and
unregistered before it is freed (also when tensor parallelism re-packs it); a host that
refuses to pin is said once per process, with the cost and the fix, and offload still works.
CUDA is faked on CPU: ``torch.cuda.is_available`` and ``torch.cuda.cudart``."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from hf_tiny import LLAMA_STYLE, MPT_TINY, token_batch, train_steps

from foundryx.builders import apply_frozen_storage

# at the top: a module it imports keeps the traceback of a failed optional import (paramiko:
# invoke), which would keep the frame, and the models, of a test that imported it first
from foundryx.models.mpt.composer import ComposerMPTCausalLM
from foundryx.models.peft.frozen_base import LowPrecisionLinear
from foundryx.models.peft.frozen_options import FrozenBaseOptions
from foundryx.models.peft.lora import apply_lora
from foundryx.models.peft.options import LoraOptions
from foundryx.parallel import pinning
from foundryx.parallel.offload_pack import inner_tensors, pack_offloaded
from foundryx.parallel.pinning import HostPin

SIZES = {**MPT_TINY, "d_model": 64, **LLAMA_STYLE}
LORA = LoraOptions(target_modules=["Wqkv", "out_proj", "up_proj"], r=4, lora_alpha=8)


class FakeError:
    """torch's binding returns a pybind11 enum (``.value``), not an int."""

    def __init__(self, value: int) -> None:
        self.value = value


class FakeCudart:
    """Records the calls; ``watched`` maps a pointer to a weakref of the tensor that owns it,
    so that an unregister can say whether its memory was still alive."""

    def __init__(self, result: object = 0) -> None:
        self.result = result
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[tuple[int, bool]] = []
        self.drained = 0
        self.watched: dict[int, weakref.ref] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> object:
        self.registered.append((ptr, size, flags))
        return self.result

    def cudaHostUnregister(self, ptr: int) -> object:
        ref = self.watched.get(ptr)
        self.unregistered.append((ptr, ref is not None and ref() is not None))
        return FakeError(0)

    def cudaGetLastError(self) -> object:
        self.drained += 1
        return FakeError(0)

    def cudaGetErrorString(self, error: object) -> str:
        return {2: "out of memory"}.get(pinning._code(error), "unknown error")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A GPU as far as pinning can tell, with ``cudart`` answering; a fresh process's warning."""
    monkeypatch.setattr(pinning, "_warned", False)

    def install(cudart: FakeCudart, m: pytest.MonkeyPatch = monkeypatch) -> FakeCudart:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "cudart", lambda: cudart)
        return cudart

    return install


def offloaded_model(seed: int = 0, device: str = "cuda"):
    torch.manual_seed(seed)
    model = ComposerMPTCausalLM(**SIZES)
    apply_lora(model, LORA)
    apply_frozen_storage(model, FrozenBaseOptions(dtype="int8", offload_fraction=1.0),
                         device=device)
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear) and m.offload is not None]
    assert len(layers) >= 2
    return model, layers


def recut(layers) -> None:
    """What tensor parallelism's split_for_tp leaves: each layer's host weight a tensor of its
    own again, out of the buffer (which the layers still hold)."""
    for m in layers:
        names, meta = inner_tensors(m.offload.host)
        m.offload.host = type(m.offload.host).__tensor_unflatten__(
            {n: getattr(m.offload.host, n).clone() for n in names}, meta, m.offload.host.shape,
            m.offload.host.stride())


def test_a_pinned_buffer_is_unregistered_once_before_it_is_freed_on_repack_and_release(fake_cuda):
    cudart = fake_cuda(FakeCudart(FakeError(0)))
    model, layers = offloaded_model()
    buffer = layers[0].offload.buffer
    assert all(m.offload.buffer is buffer and m.offload.pin.pinned for m in layers)
    assert layers[0].offload.pin.tensor is buffer  # the pin keeps what it unregisters alive
    assert cudart.registered == [(buffer.data_ptr(), buffer.numel(), 0)]
    assert buffer.numel() > 0 and cudart.unregistered == []
    old_ptr, old = buffer.data_ptr(), weakref.ref(buffer)
    cudart.watched[old_ptr] = old
    del buffer

    recut(layers)  # then the re-pack builders runs after tensor parallelism
    pack_offloaded(layers, "cuda")
    assert cudart.unregistered == [(old_ptr, True)]  # once, while its memory was alive
    assert old() is None  # and then freed
    buffer = layers[0].offload.buffer
    new_ptr = buffer.data_ptr()
    assert cudart.registered[1:] == [(new_ptr, buffer.numel(), 0)]
    assert all(m.offload.host.qdata.untyped_storage().data_ptr() == new_ptr
               for m in layers)
    del buffer

    del model, layers  # the model goes: its buffer is unregistered (once) as well
    gc.collect()
    assert [ptr for ptr, _ in cudart.unregistered] == [old_ptr, new_ptr]


def test_a_pin_unregisters_on_unpin_or_when_dropped_while_its_buffer_lives(fake_cuda):
    cudart = fake_cuda(FakeCudart(0))  # an int works as well as the enum
    buffer = torch.empty(4096, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    cudart.watched[ptr] = weakref.ref(buffer)
    pin = HostPin(buffer, "cuda")
    assert pin.pinned and cudart.registered == [(ptr, 4096, 0)]
    pin.unpin()
    pin.unpin()
    assert cudart.unregistered == [(ptr, True)] and not pin.pinned
    del pin
    gc.collect()
    assert cudart.unregistered == [(ptr, True)]  # not twice

    pin = HostPin(buffer, "cuda")
    del buffer, pin  # the pin held the last reference: unregistered before the memory went
    assert cudart.unregistered == [(ptr, True), (ptr, True)]
    assert HostPin(torch.empty(0, dtype=torch.uint8), "cuda").pinned is False  # nothing to pin
    assert len(cudart.registered) == 2


@pytest.mark.parametrize("error", [2, FakeError(2)], ids=["int", "enum"])
def test_a_refused_pin_is_said_once_and_offload_still_trains(fake_cuda, monkeypatch, caplog, error):
    caplog.set_level(logging.WARNING, logger=pinning.__name__)
    cudart = FakeCudart(error)
    with monkeypatch.context() as m:
        fake_cuda(cudart, m)
        model, layers = offloaded_model()
        other, _ = offloaded_model()  # a second buffer: no second warning
        recut(layers)
        pack_offloaded(layers, "cuda")  # and a re-pack: none either
    assert len(cudart.registered) == 3 and cudart.drained == 3  # each failure read off
    warnings = [r for r in caplog.records if r.name == pinning.__name__]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    text = warnings[0].getMessage()
    size = layers[0].offload.buffer.numel()
    for words in (f"{size / 2**30:.2f} GiB", "error 2: out of memory",
                  "offload copies will not overlap compute: each layer's copy blocks the step",
                  "ulimit -l unlimited", "--ulimit memlock=-1"):
        assert words in text, (words, text)
    assert not layers[0].offload.pin.pinned

    # the buffer is still used, as it is: the same losses as without a GPU in sight
    plain, _ = offloaded_model(device="cpu")
    losses = train_steps(model, 3)
    assert losses == train_steps(plain, 3) and losses[-1] < losses[0]
    assert all(m.offload.copies >= 3 for m in layers)
    del model, layers, other
    gc.collect()
    assert cudart.unregistered == []  # never registered: never unregistered


def test_torchs_own_error_values_read_as_codes():
    """torch's binding (2.7: a pybind11 enum naming only ``success``) as the fakes assume."""
    cudart = getattr(torch._C, "_cudart", None)
    if cudart is None:
        pytest.skip("this torch is built without CUDA")
    error = cudart.cudaError(2)
    assert pinning._code(error) == 2 and pinning._code(cudart.cudaError.success) == 0
    assert pinning._describe(cudart, error) == "error 2: out of memory"


def test_the_runtime_libraries_are_found_to_read_a_pending_error_off():
    maps = [
        "7f00-7f10 r-xp 00000000 08:01 1 /site/nvidia/cuda_runtime/lib/libcudart.so.12",
        "7f10-7f20 r--p 00010000 08:01 1 /site/nvidia/cuda_runtime/lib/libcudart.so.12",
        "7f20-7f30 r-xp 00000000 08:01 2 /site/torch/lib/libcudart-9335f6a2.so.12 (deleted)",
        "7f30-7f40 r-xp 00000000 08:01 3 /opt/rocm/lib/libamdhip64.so.6",
        "7f40-7f50 r-xp 00000000 08:01 4 /site/torch/lib/libtorch_cuda.so",
        "7f50-7f60 rw-p 00000000 00:00 0",
    ]
    assert pinning.runtime_paths(maps) == ["/site/nvidia/cuda_runtime/lib/libcudart.so.12",
                                           "/site/torch/lib/libcudart-9335f6a2.so.12",
                                           "/opt/rocm/lib/libamdhip64.so.6"]
    if torch.version.cuda is None:
        return
    with open("/proc/self/maps") as f:  # this torch's own runtime, called for real
        assert any("libcudart" in p for p in pinning.runtime_paths(f))
    pinning._drain_pending_error(object())  # no cudaGetLastError binding: through ctypes


def test_the_docs_quote_the_warning_as_it_is(fake_cuda, caplog):
    from pathlib import Path

    caplog.set_level(logging.WARNING, logger=pinning.__name__)
    fake_cuda(FakeCudart(2))
    HostPin(torch.empty(1 << 20, dtype=torch.uint8), "cuda")
    [record] = [r for r in caplog.records if r.name == pinning.__name__]
    said = record.getMessage()
    assert said.startswith("could not pin the 0.00 GiB host buffer"), said
    quoted = said.split(" GiB ", 1)[1].split(" `ulimit")[0]  # up to the fix itself
    docs = " ".join((Path(__file__).parents[1] / "docs/finetuning.md").read_text().split())
    assert f"`could not pin the ... GiB {quoted} ...`" in docs, quoted
    for words in ("`ulimit -l unlimited`", "`--ulimit memlock=-1`"):
        assert words in docs and words.strip("`") in said


class NoCuda:
    """A CUDA call a CPU run must not make: each one recorded, and refused."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str):
        def refuse(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"a device: cpu run called torch.cuda.{name}")
        return refuse


def test_a_cpu_run_on_a_machine_with_a_gpu_pins_nothing_and_never_touches_cuda(monkeypatch):
    """Pinning follows the run's device, not the machine's: ``device: cpu`` where
    ``torch.cuda.is_available()`` is true builds the offloaded model, applies activation
    offload and trains without a CUDA call (no ``cudaHostRegister``, no pinned activations)."""
    from types import SimpleNamespace

    from foundryx import builders
    from foundryx.config.schema import ActivationCheckpointingConfig, CompileConfig, TilingConfig

    refused = NoCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node, as far as asked
    for name in ("cudart", "current_device", "init", "synchronize", "Stream"):
        monkeypatch.setattr(torch.cuda, name, refused(name))
    section = {"name": "mpt_causal_lm", **SIZES,
               "peft_config": {"target_modules": LORA.target_modules, "r": 4, "lora_alpha": 8},
               "frozen_base": {"dtype": "int8", "offload_fraction": 1.0}}
    cfg = SimpleNamespace(model=section, device="cpu", parallelism=None, precision="fp32",
                          activation_checkpointing=ActivationCheckpointingConfig(cpu_offload=True),
                          compile=CompileConfig(enabled=False), cpu_matmul=None, float8=None,
                          tiling=TilingConfig(), device_train_microbatch_size=1, max_seq_len=None)
    assert builders.pick_device(cfg.device) == torch.device("cpu")  # the one picker
    torch.manual_seed(0)
    model = builders.build_parallelism(cfg, builders.build_model(cfg, None))
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear) and m.offload is not None]
    assert layers and all(m.offload.pin is not None and not m.offload.pin.pinned for m in layers)
    batch = token_batch()  # forward and backward: activation offload saves to unpinned memory
    model.loss(model(batch), batch).backward()  # (the optimizer's step is torch's own to check)
    assert any(p.grad is not None for p in model.parameters()) and refused.calls == []


@pytest.mark.parametrize("device,pinned", [("cpu", False), (torch.device("cpu"), False),
                                           ("cuda", True), (torch.device("cuda", 0), True)])
def test_a_buffer_is_pinned_for_a_gpu_run_only(fake_cuda, device, pinned):
    cudart = fake_cuda(FakeCudart(0))
    assert pinning.pins(device) is pinned
    assert HostPin(torch.empty(4096, dtype=torch.uint8), device).pinned is pinned
    assert len(cudart.registered) == int(pinned)


def test_a_pending_error_that_cannot_be_read_off_is_said_once(monkeypatch, caplog):
    """No ``cudaGetLastError`` in torch's binding and no runtime library in this process's maps:
    one line says the next CUDA call may report the failure as its own."""
    caplog.set_level(logging.WARNING, logger=pinning.__name__)
    monkeypatch.setattr(pinning, "_undrained_said", False, raising=False)
    monkeypatch.setattr(pinning, "runtime_paths", lambda lines: [])
    pinning._drain_pending_error(object())
    pinning._drain_pending_error(object())  # once per process
    said = [r.getMessage() for r in caplog.records if r.name == pinning.__name__]
    assert len(said) == 1, said
    assert "could not read off the error" in said[0] and "no CUDA or HIP runtime library" in said[0]
    assert "the next CUDA call may report it as its own failure" in said[0]

    monkeypatch.setattr(pinning, "_undrained_said", False)
    monkeypatch.setattr(pinning, "runtime_paths", lambda lines: ["/nowhere/libcudart.so.12"])
    pinning._drain_pending_error(object())  # a library named, but it cannot be called
    said = [r.getMessage() for r in caplog.records if r.name == pinning.__name__]
    assert len(said) == 2 and "none of /nowhere/libcudart.so.12 answered" in said[1]
