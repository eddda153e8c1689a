"""The one peak-FLOPs table (foundryx.runtime.devices) and the speed monitor's MFU from it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from composer.core import Precision

from foundryx.callbacks import speed_monitor
from foundryx.callbacks.speed_monitor import SpeedMonitor
from foundryx.config.hardware import machine_problems
from foundryx.errors import ConfigError
from foundryx.runtime import devices

T = 1e12


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(devices, "_warned", set())


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA A100-SXM4-40GB", "bf16", 312 * T),
    ("NVIDIA A100-SXM4-80GB", "fp16", 312 * T),
    ("NVIDIA A100 80GB PCIe", "amp_bf16", 312 * T),
    ("NVIDIA H100 80GB HBM3", "bf16", 989 * T),
    ("NVIDIA H100 80GB HBM3", "fp8", 1979 * T),
    ("NVIDIA H100 PCIe", "bf16", 756 * T),
    ("NVIDIA H100 PCIe", "amp_fp8", 1513 * T),
    ("NVIDIA H200", "bf16", 989 * T),
    ("NVIDIA B200", "bf16", 2250 * T),
    ("NVIDIA B200", "fp8", 4500 * T),
    ("AMD Instinct MI250X", "bf16", 191.5 * T),
    ("AMD Instinct MI300X", "bf16", 1307.4 * T),
    ("AMD Instinct MI300X", "fp8", 2614.9 * T),
    ("AMD Instinct MI325X", "amp_bf16", 1307.4 * T),
])
def test_known_devices(name, dtype, expected, caplog):
    assert devices.peak_flops(name, dtype) == pytest.approx(expected)
    assert not caplog.records


@pytest.mark.parametrize("name, dtype, why", [
    ("NVIDIA GeForce RTX 4090", "bf16", "not in foundryx's device table"),
    ("NVIDIA H100 NVL", "bf16", "not in foundryx's device table"),     # lower peaks than SXM
    ("NVIDIA H200 NVL", "bf16", "not in foundryx's device table"),
    ("NVIDIA GH200 480GB", "bf16", "not in foundryx's device table"),
    ("AMD Instinct MI250X/MI250", "bf16", "not in foundryx's device table"),  # MI250 or X?
    ("NVIDIA A100-SXM4-80GB", "fp8", "a100 has no fp8 peak"),
    ("NVIDIA H100 80GB HBM3", "fp32", "bf16, fp16 and fp8 peaks only"),
])
def test_unknown_is_one_warning_and_no_number(name, dtype, why, caplog):
    with caplog.at_level(logging.WARNING, logger="foundryx.runtime.devices"):
        assert devices.peak_flops(name, dtype) is None
        assert devices.peak_flops(name, dtype) is None  # asked again: no second warning
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and why in warnings[0] and name in warnings[0]
    assert "callbacks.speed_monitor.peak_flops" in warnings[0]


class _Model:
    def flops_per_batch(self, batch):
        return 4 * T  # 4 TFLOP per batch


class _Logger:
    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics):
        self.rows.append(dict(metrics))


def _fake_gpu_state(precision: Precision) -> SimpleNamespace:
    return SimpleNamespace(device=SimpleNamespace(name="gpu", tensor_to_device=lambda t: t),
                           precision=precision, model=SimpleNamespace(module=_Model()), batch=None)


def test_mfu_on_a_fake_h100(monkeypatch, caplog):
    """4 TFLOP per batch at 10 batches/s on one device = 40 TFLOP/s = 40/989 of an H100's bf16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    state = _fake_gpu_state(Precision.AMP_BF16)
    monitor, logger = SpeedMonitor(window_size=2), _Logger()
    with caplog.at_level(logging.INFO, logger="foundryx"):
        monitor.init(state, logger)
    assert monitor.gpu_flops_available == pytest.approx(989 * T)
    assert any("989 TFLOP/s" in r.getMessage() for r in caplog.records)
    for i in range(4):
        state.timestamp = SimpleNamespace(
            sample=SimpleNamespace(value=16 * i), token=SimpleNamespace(value=2048 * i),
            total_wct=SimpleNamespace(total_seconds=lambda i=i: 0.1 * i))
        monitor.batch_end(state, logger)
    logged = {k: v for row in logger.rows for k, v in row.items()}
    assert logged["throughput/tokens_per_sec"] == pytest.approx(20480)
    assert logged["throughput/device/flops_per_sec"] == pytest.approx(40 * T)
    assert logged["throughput/device/mfu"] == pytest.approx(40 / 989)


def test_cpu_and_unknown_gpu_log_no_mfu(monkeypatch, caplog):
    cpu = SimpleNamespace(device=SimpleNamespace(name="cpu"), precision=Precision.FP32)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        monitor = SpeedMonitor()
        monitor.init(cpu, _Logger())
    assert monitor.gpu_flops_available == 0  # Composer logs no MFU at 0
    assert any("MFU: not reported on cpu" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")
    with caplog.at_level(logging.INFO, logger="foundryx"):
        monitor = SpeedMonitor()
        monitor.init(_fake_gpu_state(Precision.AMP_BF16), _Logger())
    assert monitor.gpu_flops_available == 0
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    # given by hand, the number wins over the table
    monitor = SpeedMonitor(peak_flops=5e14)
    monitor.init(_fake_gpu_state(Precision.AMP_BF16), _Logger())
    assert monitor.gpu_flops_available == 5e14
    assert speed_monitor.device_peak  # the function the planner-facing docs point to


def test_bad_options_name_the_yaml_path():
    with pytest.raises(ConfigError) as e:
        SpeedMonitor(window_size=0, peak_flops="fast")
    text = str(e.value)
    assert "callbacks.speed_monitor.window_size" in text and "callbacks.speed_monitor.peak_flops" in text


# -- can this machine run a config's device and precision? (the rules: foundryx.config.hardware;
# the machine's capability: devices.Machine) ---------------------------------------------------
def run_problems(data, machine):
    return machine_problems(machine, data.get("device"), data.get("precision", "fp32"))


NO_GPU = devices.Machine(0, "no NVIDIA or AMD GPU device: no /dev/nvidia*, no /dev/kfd")
V100 = devices.Machine(1, name="Tesla V100-SXM2-16GB", capability=(7, 0))
A100 = devices.Machine(1, name="NVIDIA A100-SXM4-40GB", capability=(8, 0))
UNKNOWN = devices.Machine(None)  # device files present, torch not imported yet


@pytest.mark.parametrize("data, machine, needles", [
    ({"device": "gpu"}, NO_GPU, ["device: 'gpu' cannot run here", "/dev/nvidia*",
                                 "Fix: set device=cpu, or run on a machine with a GPU"]),
    ({"device": "gpu", "precision": "amp_fp16"}, NO_GPU,
     ["Fix: set device=cpu and precision=amp_bf16 or fp32 (amp_fp16 needs a GPU)"]),
    ({"device": "gpu", "precision": "amp_bf16"}, NO_GPU,  # a CPU runs amp_bf16 (autocast)
     ["Fix: set device=cpu, or run on a machine with a GPU"]),
    ({"device": "cpu", "precision": "amp_fp16"}, A100,
     ["precision: 'amp_fp16' cannot run here", "the config sets device: cpu",
      "Fix: set precision=amp_bf16 or fp32, or device=gpu"]),
    ({"precision": "amp_fp16"}, NO_GPU, ["this run is on the CPU: no device is set",
                                         "Fix: set precision=amp_bf16 or fp32"]),
    ({"device": "gpu", "precision": "amp_bf16"}, V100,
     ["bf16 needs an NVIDIA GPU of compute capability 8.0", "Tesla V100-SXM2-16GB is 7.0",
      "Fix: set precision=amp_fp16"]),
], ids=["gpu-without-gpu", "gpu-and-fp16-without-gpu", "gpu-and-bf16-without-gpu", "fp16-on-cpu", "fp16-no-device-no-gpu",
        "bf16-on-v100"])
def test_what_this_machine_cannot_run_is_one_line_with_the_fix(data, machine, needles):
    problems = run_problems(data, machine)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    for needle in needles:
        assert needle in problems[0], problems[0]


@pytest.mark.parametrize("data, machine", [
    ({}, NO_GPU), ({"device": "cpu"}, NO_GPU), ({"precision": "amp_bf16"}, A100),
    ({"device": "cpu", "precision": "amp_bf16"}, NO_GPU),  # CPU autocast (train.composer_precision)
    ({"precision": "amp_bf16"}, NO_GPU),
    ({"device": "gpu", "precision": "amp_fp16"}, V100),
    ({"device": "gpu", "precision": "amp_bf16"}, UNKNOWN),  # torch decides, later
    ({"device": "tpu"}, NO_GPU),  # the schema's problem, reported as such
])
def test_what_this_machine_can_run_is_no_problem(data, machine):
    assert run_problems(data, machine) == []


def test_amp_fp8_needs_transformer_engine(monkeypatch):
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    (problem,) = run_problems({"device": "gpu", "precision": "amp_fp8"}, A100)
    assert "TransformerEngine, which is not installed" in problem
    assert "Fix: set precision=amp_bf16" in problem
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object())
    (problem,) = run_problems({"device": "gpu", "precision": "amp_fp8"}, A100)
    assert "compute capability 8.9" in problem and "is 8.0" in problem


def test_no_gpu_is_known_without_torch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    m = devices.machine_without_torch()
    assert m.gpus == 0 and "CUDA_VISIBLE_DEVICES=''" in m.why_none
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert devices.machine_without_torch().gpus == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available():  # then device files are present: torch decides
        assert devices.machine_without_torch().gpus in (None, 0)
    else:
        assert devices.machine_from_torch().gpus == 0
