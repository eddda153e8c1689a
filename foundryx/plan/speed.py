"""The planner's speed is the measured speed: model FLOPs utilisation per device kind and
workload, from GPU runs, instead of one assumed figure.

Each row is one measured configuration: the device kind (foundryx/runtime/devices.py's key, e.g.
``h100-sxm``), the precision, the model kind (``hf``: a Hugging Face causal LM; ``mpt``:
foundryx's MPT), what trains (``lora`` adapters over a frozen base, or ``full``: every weight),
how the frozen base computes (``bf16``; ``fp8-cast``: FP8 storage cast to bf16 per layer;
``fp8-tensor-core``: FP8 GEMMs, when foundryx runs them; ``nf4``; ``-`` for full training),
whether part of the base is offloaded, compiled or not, activation checkpointing (off, every
block recomputed, or selective: each block keeps its matmuls' outputs), and its MFU: measured
tokens/s x the planner's FLOPs per token (``6 N + 12 L d s``, the models' own count; for LoRA
it counts the weight gradients LoRA skips) / the device's peak. Expressed as
MFU, a row carries over to other sizes of the same kind of run (8B to 70B LoRA, MPT-1B to 7B),
which is the planner's assumption, not a measurement.

The rule (:func:`choose`): the rows of this device kind, precision, model kind, training and
base compute are the candidates; of those, the one whose offload, compile and checkpointing
settings differ least from the run's (offload weighs most, then checkpointing, then compile);
the plan names the row and any setting it differs in. No candidate: the default MFU
(gpus.DEFAULT_MFU, 40%), said in one line. ``--mfu`` overrides both. An FP8 base on a GPU
without FP8 tensor cores (A100, MI250X: no FP8 peak in devices.py) runs the cast path and
uses the cast path's row, said in one line.

Rows are added as the GPU run book measures them (benchmarks/gpu_runbook.sh,
benchmarks/RESULTS.md); a test keeps each row within 15% of the figure it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from foundryx.plan.gpus import DEFAULT_MFU
from foundryx.runtime.devices import find_device


@dataclass(frozen=True)
class SpeedRow:
    device: str  # foundryx.runtime.devices key: h100-sxm, mi300x, ...
    precision: str  # the run's precision: amp_bf16
    model: str  # hf | mpt
    training: str  # lora | full
    base: str  # bf16 | fp8-cast | fp8-tensor-core | nf4 | int8 | "-" (full training)
    offload: bool  # part of the frozen base offloaded to host memory
    compile: bool
    checkpointing: bool
    mfu: float
    measured: str  # what was measured, where, and where it is recorded
    selective: bool = False  # checkpointing selective (activation_checkpointing.mode)

    def describe(self) -> str:
        what = f"LoRA over {BASES.get(self.base, self.base)}" if self.training == "lora" else \
            "full training"
        return (f"{self.device}, {self.precision}, {self.model} {what}, "
                f"{'offload' if self.offload else 'no offload'}, "
                f"compile {'on' if self.compile else 'off'}, "
                f"checkpointing {checkpointing(self.checkpointing, self.selective)}")


def checkpointing(on: bool, selective: bool) -> str:
    """How a row or run checkpoints, as the plan says it: off, on (every block) or selective."""
    return ("selective" if selective else "on") if on else "off"


BASES = {"bf16": "a bf16 base", "fp8-cast": "an FP8 base cast to bf16 per layer",
         "fp8-tensor-core": "an FP8 base on FP8 tensor cores", "nf4": "an NF4 base",
         "int8": "an int8 base", "master": "the base in the trainable dtype"}

# The H100 rows: one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, foundryx at ea9e5db (before
# issue 51's fused path), the GPU run book (issue 46's and issue 47's tables;
# benchmarks/RESULTS.md's GPU section, 2026-11-27). The H200 rows: one NVIDIA H200, torch
# 2.11.0+cu130, foundryx at c003f7c (the one-pass adapter path and fused norms, SwiGLU and RoPE),
# the run book's step 7 (benchmarks/flagship_vs_peer.py; RESULTS.md's H200 section, 2026-11-29).
# The 8B rows: benchmarks/flagship.py, a Llama-3.1-8B-shaped model, LoRA r16 on all linear
# layers, 2 x 4096 tokens a step, one GPU; MFU = tokens/s x 51.47 GFLOP per token / 989 TFLOP/s.
# The MPT rows: benchmarks/train_throughput.py gpu --models 1b, seq 2048, batch 8;
# MFU = tokens/s x 9.075 GFLOP per token / 989 TFLOP/s (the speed monitor's MFU).
ROWS: tuple[SpeedRow, ...] = (
    SpeedRow("h100-sxm", "amp_bf16", "hf", "lora", "bf16", False, False, True, 0.303,
             "8B LoRA at 5,813 tokens/s (5,734 / 5,851 / 5,853)"),
    SpeedRow("h100-sxm", "amp_bf16", "hf", "lora", "fp8-cast", False, False, True, 0.278,
             "8B LoRA at 5,334 tokens/s (5,297 / 5,371)"),
    SpeedRow("h100-sxm", "amp_bf16", "hf", "lora", "fp8-cast", True, False, True, 0.270,
             "8B LoRA, offload 0.5, at 5,191 tokens/s"),
    SpeedRow("h100-sxm", "amp_bf16", "hf", "lora", "nf4", False, False, True, 0.238,
             "8B LoRA at 4,568 tokens/s (NF4 decode in 2^24-weight chunks)"),
    SpeedRow("h100-sxm", "amp_bf16", "mpt", "full", "-", False, False, False, 0.322,
             "MPT-1B pretraining at 35,141 tokens/s"),
    SpeedRow("h100-sxm", "amp_bf16", "mpt", "full", "-", False, True, False, 0.354,
             "MPT-1B pretraining at 38,560 tokens/s"),
    SpeedRow("h200", "amp_bf16", "hf", "lora", "bf16", False, False, True, 0.527,
             "8B LoRA at 10,126 tokens/s (10,107 / 10,145)"),
    SpeedRow("h200", "amp_bf16", "hf", "lora", "bf16", False, False, True, 0.617,
             "8B LoRA at 11,857 tokens/s (11,622 / 12,091)", selective=True),
)

# how much each setting's difference counts when no row matches the run exactly
_WEIGHTS = {"offload": 4, "checkpointing": 2, "compile": 1}


@dataclass(frozen=True)
class Run:
    """What the rule reads of a run."""

    device_name: str | None  # as torch names it (None: a CPU process)
    precision: str
    model: str  # hf | mpt | another registry name
    training: str  # lora | full
    frozen: str | None  # frozen_base.dtype (None: the weights in the trainable dtype)
    offload: bool
    compile: bool
    checkpointing: bool
    selective: bool = False  # checkpointing selective


@dataclass(frozen=True)
class Choice:
    mfu: float
    row: SpeedRow | None  # None: the default MFU or --mfu
    source: str  # table | default | --mfu
    differs: tuple[str, ...] = ()  # the run's settings the row was not measured with
    notes: tuple[str, ...] = ()  # for the plan's notes, one line each (the FP8 cast path)
    why: str = ""  # the default's reason: no measured row for this run

    @property
    def line(self) -> str:
        """What the plan prints after the MFU."""
        if self.source == "--mfu":
            return "--mfu"
        if self.row is None:
            return self.why
        line = f"measured: {self.row.describe()}: {self.row.measured}"
        if self.differs:
            line += f"; this run differs in {', '.join(self.differs)} (no row measured with it)"
        return line

    def to_json(self) -> dict[str, Any]:
        return {"mfu": self.mfu, "source": self.source, "row": vars(self.row) if self.row else None,
                "differs": list(self.differs), "line": self.line}


def base_compute(frozen: str | None, training: str, device_name: str | None,
                 rows: tuple[SpeedRow, ...] | list[SpeedRow] = ()) -> tuple[str, str | None]:
    """How the frozen base computes on this device (a row's ``base``), and a note when an FP8
    base's speed is not its own: cast because the device has no FP8 tensor cores, or on FP8
    tensor cores (foundryx runs its GEMMs there: models/peft/fp8_gemm.py) that no row of
    ``rows`` has measured on this device yet, the cast path's row standing in, a lower
    bound."""
    if training != "lora":
        return "-", None
    if frozen is None:
        return "master", None  # the base in the trainable dtype: no measured row yet
    if frozen != "fp8":
        return frozen, None
    device = find_device(device_name) if device_name else None
    if device is None:
        return "fp8-cast", None
    if "fp8" not in device.flops:
        return "fp8-cast", (f"{device.key} has no FP8 tensor cores: the FP8 base is cast to "
                            "bf16 per layer (the cast path's speed)")
    if any(r.device == device.key and r.base == "fp8-tensor-core" for r in rows):
        return "fp8-tensor-core", None
    return "fp8-cast", (f"{device.key} runs the FP8 base's GEMMs on FP8 tensor cores, which no "
                        "GPU has measured yet: the speed is the cast path's (measured), a lower "
                        "bound")


def _settings(x: SpeedRow | Run) -> dict[str, str]:
    """A row's or run's offload, compile and checkpointing as the plan says them."""
    return {"offload": "on" if x.offload else "off", "compile": "on" if x.compile else "off",
            "checkpointing": checkpointing(x.checkpointing, x.selective)}


def choose(run: Run, rows: tuple[SpeedRow, ...] | list[SpeedRow] = ROWS,
           default: float = DEFAULT_MFU) -> Choice:
    """The MFU for ``run``: the measured row of its kind that differs least, else ``default``."""
    base, note = base_compute(run.frozen, run.training, run.device_name, rows)
    notes = (note,) if note else ()
    device = find_device(run.device_name) if run.device_name else None
    key = device.key if device else None
    candidates = [r for r in rows if (r.device, r.precision, r.model, r.training, r.base) ==
                  (key, run.precision, run.model, run.training, base)]
    if not candidates:
        what = f"LoRA over {BASES.get(base, base)}" if run.training == "lora" else "full training"
        return Choice(default, None, "default", notes=notes, why=(
            f"assumed: no measured row for {key or run.device_name}, {run.precision}, "
            f"{run.model} {what} (foundryx/plan/speed.py)"))

    want = _settings(run)

    def differs(r: SpeedRow) -> tuple[str, ...]:
        have = _settings(r)
        return tuple(f"{k} {want[k]}" for k in _WEIGHTS if have[k] != want[k])

    def cost(r: SpeedRow) -> int:
        return sum(_WEIGHTS[d.split()[0]] for d in differs(r))

    best = min(candidates, key=cost)  # ties: the first listed
    return Choice(best.mfu, best, "table", differs(best), notes)
