"""The rules of a run config's hardware settings (``device``, ``precision``, ``float8``): each
problem one line that starts with its YAML path and ends with the fix. Two kinds:

- :func:`combination_problems`: settings that cannot go together on any machine (``float8``
  beside ``amp_fp8``, beside LoRA, beside tensor parallelism); :mod:`foundryx.config.load`
  reports them with every other problem of the config;
- :func:`machine_problems`: settings the machine a run is on cannot run (``device: gpu``
  without a GPU, fp16 on a CPU, bf16 before Ampere, FP8 without FP8 tensor cores). What a
  machine can do is :class:`foundryx.runtime.devices.Machine` (the capability); config imports
  nothing of foundryx but ``errors`` and ``registry``, so the entry points hand one in:
  ``precheck(..., machine=this_machine())`` before torch, ``train`` again with torch (which
  knows the GPU's model), ``foundryx eval`` for its ``device``.

    >>> class NoGpu:
    ...     gpus, why_none, name, capability = 0, "no /dev/nvidia*", None, None
    >>> machine_problems(NoGpu(), "gpu")[0][:36]
    "device: 'gpu' cannot run here: this "
"""

from __future__ import annotations

from typing import Protocol

from foundryx.config.schema import TrainConfig, tp_degree

# What a CPU run computes in: fp32, and amp_bf16 as foundryx runs it there (Composer 0.32 refuses
# every precision but fp32 on a CPU; foundryx gives it fp32 and autocasts to bf16 itself:
# foundryx.callbacks.cpu_autocast). fp16 and fp8 compute need a GPU.
CPU_PRECISIONS = ("fp32", "amp_bf16")
FLOAT8_GPUS = ("NVIDIA compute capability 8.9 or newer (Ada, Hopper, Blackwell) or AMD MI300 "
               "(gfx942) or newer")


class MachineFacts(Protocol):
    """What :func:`machine_problems` reads of a machine (:class:`foundryx.runtime.devices.Machine`
    has it): ``gpus`` 0 (none: ``why_none`` says how that is known), None (not known yet) or a
    count; the first GPU's ``name`` and NVIDIA ``capability``; the methods answer None when
    not known yet."""

    gpus: int | None
    why_none: str
    name: str | None
    capability: tuple[int, int] | None

    def bf16(self) -> bool | None: ...

    def fp8_tensor_cores(self) -> bool | None: ...

    def transformer_engine(self) -> bool: ...

    def words(self) -> str: ...


def combination_problems(cfg: TrainConfig) -> list[str]:
    """``float8.enabled`` beside a setting it cannot go with, on any machine."""
    if not cfg.float8.enabled:
        return []
    problems = []
    if cfg.precision == "amp_fp8":
        problems.append("float8.enabled: true with precision: 'amp_fp8': two float8 trainings "
                        "(torchao's and TransformerEngine's). Fix: set precision=amp_bf16 (float8 "
                        "then runs the linear layers' matmuls in float8)")
    if cfg.model.get("peft_config") or cfg.model.get("frozen_base"):
        problems.append("float8.enabled: true with LoRA (model.peft_config / frozen_base): float8 "
                        "training is for pretraining every linear layer. Fix: drop float8 (a "
                        "low-precision frozen base is model.frozen_base.dtype: fp8)")
    tp = tp_degree(cfg.parallelism)
    if tp > 1:
        problems.append(f"float8.enabled: true with parallelism.tp: {tp}: foundryx applies float8 "
                        "to data-parallel (FSDP2) runs only. Fix: set parallelism.tp=1, or drop "
                        "float8")
    return problems


def machine_problems(machine: MachineFacts, device: str | None, precision: str = "fp32",
                     float8: bool = False) -> list[str]:
    """One line per setting (a config's ``device``, ``precision``, ``float8.enabled``) that
    ``machine`` cannot run, naming what it has and what to set instead. A setting it may be
    able to run, as far as is known, is no problem."""
    m = machine
    if device == "gpu" and m.gpus == 0:
        also = ("" if precision in CPU_PRECISIONS
                else f" and precision=amp_bf16 or fp32 ({precision} needs a GPU)")
        return [f"device: 'gpu' cannot run here: this machine has no GPU that torch can use "
                f"({m.why_none}). Fix: set device=cpu{also}, or run on a machine with a GPU"]
    on_cpu = device == "cpu" or (device is None and m.gpus == 0)
    if on_cpu and precision not in CPU_PRECISIONS:
        where = ("the config sets device: cpu" if device == "cpu"
                 else f"this run is on the CPU: no device is set and this machine has no GPU "
                      f"({m.why_none})")
        return [f"precision: {precision!r} cannot run here: a CPU computes in fp32 or, under "
                f"autocast, bf16 (amp_bf16), and {where}. Fix: set precision=amp_bf16 or fp32"
                + (", or device=gpu on a machine with a GPU" if device == "cpu" else "")]
    if precision == "amp_fp8":
        return amp_fp8_problems(m)
    if precision == "amp_bf16" and m.bf16() is False and m.capability is not None:
        return [f"precision: 'amp_bf16' cannot run here: bf16 needs an NVIDIA GPU of compute "
                f"capability 8.0 (Ampere) or newer, and this machine's {m.name} is "
                f"{m.capability[0]}.{m.capability[1]}. Fix: set precision=amp_fp16"]
    return float8_machine_problems(m, device) if float8 else []


def float8_machine_problems(m: MachineFacts, device: str | None) -> list[str]:
    """``float8.enabled`` (torchao's float8 training) where ``m`` cannot run it: on the CPU or
    on a GPU without FP8 tensor cores. A GPU not yet known (no torch imported) is no problem
    here; the run checks again with torch."""
    if device == "cpu" or (device is None and m.gpus == 0):
        where = ("the config sets device: cpu" if device == "cpu"
                 else f"this machine has no GPU ({m.why_none})")
        return [f"float8.enabled: true cannot run on the CPU: torchao's float8 training multiplies "
                f"on FP8 tensor cores ({FLOAT8_GPUS}), and {where}. Fix: set float8.enabled=false, "
                "or run on such a GPU"]
    if m.fp8_tensor_cores() is False:
        return [f"float8.enabled: true cannot run here: this machine's GPU, {m.name} "
                f"({m.words()}), has no FP8 tensor cores; float8 training needs {FLOAT8_GPUS}. "
                "Fix: set float8.enabled=false (train in bf16: precision=amp_bf16)"]
    return []


def amp_fp8_problems(m: MachineFacts) -> list[str]:
    """Composer's ``amp_fp8`` runs through NVIDIA TransformerEngine on compute capability 8.9+."""
    if not m.transformer_engine():
        return ["precision: 'amp_fp8' cannot run here: Composer's fp8 needs NVIDIA "
                "TransformerEngine, which is not installed. Fix: set precision=amp_bf16, or "
                "install transformer-engine on a GPU of compute capability 8.9 or newer"]
    if m.capability is not None and m.fp8_tensor_cores() is False:
        return [f"precision: 'amp_fp8' cannot run here: fp8 needs an NVIDIA GPU of compute "
                f"capability 8.9 (Ada, Hopper) or newer, and this machine's {m.name} is "
                f"{m.capability[0]}.{m.capability[1]}. Fix: set precision=amp_bf16"]
    return []
