"""``foundryx plan``: will this run fit, and how long will it take? Seconds, on a laptop.

    plan = make_plan("yamls/finetune/llama-lora.yaml", gpus=8, gpu="h100")
    print(render(plan)); plan.to_json()
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundryx.config.load import LoadedConfig, load_config
from foundryx.devices import peak_flops
from foundryx.errors import ConfigError
from foundryx.plan.advice import Suggestion, largest_microbatch, suggestions
from foundryx.plan.census import Census
from foundryx.plan.gpus import DEFAULT_GPU, DEFAULT_MFU, GiB, find_gpu, parse_memory
from foundryx.plan.memory import TERM_DOCS, Setup, by_stage, terms
from foundryx.plan.settings import plan_setup


@dataclass
class Plan:
    census: Census
    setup: Setup
    device: str  # the GPU key, or "cpu"
    capacity: int  # bytes per device
    terms: dict[str, int]
    by_sharding: dict[str, int]
    suggestions: list[Suggestion]
    largest_microbatch: int
    flops_per_token: int
    peak_flops: float | None
    mfu: float
    notes: list[str] = field(default_factory=list)

    @property
    def per_device_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.per_device_bytes <= self.capacity

    @property
    def tokens_per_s(self) -> float | None:
        if self.peak_flops is None:
            return None
        return self.peak_flops * self.mfu * self.setup.world_size / self.flops_per_token

    def to_json(self) -> dict[str, Any]:
        tps = self.tokens_per_s
        return {
            "per_device_bytes": self.per_device_bytes,
            "capacity_bytes": self.capacity,
            "fits": self.fits,
            "headroom_bytes": self.capacity - self.per_device_bytes,
            "device": self.device,
            "world_size": self.setup.world_size,
            "terms": self.terms,
            "by_sharding": self.by_sharding,
            "suggestions": [vars(s) for s in self.suggestions],
            "largest_microbatch": self.largest_microbatch,
            "parameters": {"total": self.census.total,
                           "trainable": self.setup.lora_params or self.census.total},
            "throughput": {"flops_per_token": self.flops_per_token, "peak_flops": self.peak_flops,
                           "mfu": self.mfu, "tokens_per_s": tps,
                           "hours_per_1b_tokens": 1e9 / tps / 3600 if tps else None},
            "notes": self.notes,
        }


def flops_per_token(c: Census, seq_len: int) -> int:
    """Training FLOPs per token, the models' own count (``flops_per_batch`` / tokens):
    ``6 N + 12 n_layers d_model s``, N the parameters used in matmuls."""
    sh = c.shape
    return 6 * c.matmul + 12 * sh.n_layers * sh.d_model * seq_len


def make_plan(config: str | Path, overrides: list[str] | None = None, *, gpus: int | None = None,
              nodes: int = 1, gpu: str | None = None, gpu_memory: str | None = None,
              mfu: float = DEFAULT_MFU) -> Plan:
    """Plan the run ``config`` (with ``key=value`` overrides) on ``nodes`` x ``gpus`` devices."""
    if not 0 < mfu <= 1:
        raise ConfigError([f"--mfu: {mfu} is not a fraction in (0, 1]; e.g. --mfu 0.4"])
    if nodes < 1 or (gpus is not None and gpus < 1):
        raise ConfigError(["--gpus and --nodes: at least 1 each"])
    notes: list[str] = []
    per_node = gpus or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    world = per_node * nodes
    loaded = load_config(config, overrides, world_size=world,
                         component_sections=("model", "optimizer"))
    if (gpu or "").lower() == "cpu" or (loaded.cfg.device == "cpu" and gpu is None):
        # A CPU process: no CUDA / ROCm context and no caching allocator, so neither term.
        capacity = parse_memory(gpu_memory) if gpu_memory else _cpu_memory() // per_node
        why = "--gpu cpu" if gpu else "the config's device"
        where = "--gpu-memory" if gpu_memory else "this machine's memory / processes per node"
        notes.append(f"device: cpu ({why}): no GPU context or allocator margin; capacity: "
                     f"{where}; no MFU on CPU")
        return plan_loaded(loaded, per_node, "cpu", "cpu", None, capacity, mfu, notes)
    if gpu is None:
        notes.append(f"--gpu not given: planned for {DEFAULT_GPU}")
    spec = find_gpu(gpu or DEFAULT_GPU)
    capacity = parse_memory(gpu_memory) if gpu_memory else spec.memory
    return plan_loaded(loaded, per_node, spec.key, spec.kind, spec.device_name, capacity, mfu,
                       notes)


def plan_loaded(loaded: LoadedConfig, per_node: int, device: str, kind: str,
                device_name: str | None, capacity: int, mfu: float = DEFAULT_MFU,
                notes: list[str] | None = None) -> Plan:
    """Plan an already loaded run config on its world size of ``device`` (``kind``: cuda, rocm
    or cpu; ``device_name`` as torch names it, for the peak FLOP/s) of ``capacity`` bytes."""
    notes = list(notes or [])
    peak = None
    if device_name is not None:
        peak = peak_flops(device_name, loaded.cfg.precision, warn=False)
        if peak is None:
            notes.append(f"no peak FLOP/s for {device} at {loaded.cfg.precision}: no "
                         "throughput estimate")
    planned = plan_setup(loaded, loaded.derived.world_size, per_node, kind)
    c, s = planned.census, planned.setup
    t = terms(c, s)
    return Plan(
        census=c, setup=s, device=device, capacity=capacity, terms=t,
        by_sharding=by_stage(c, s, max(s.shard_degree, s.world_size)),
        suggestions=[] if sum(t.values()) <= capacity else suggestions(c, s, capacity),
        largest_microbatch=largest_microbatch(c, s, capacity),
        flops_per_token=flops_per_token(c, s.seq_len), peak_flops=peak, mfu=mfu,
        notes=notes + planned.notes,
    )


def plan_here(loaded: LoadedConfig, mfu: float = DEFAULT_MFU) -> Plan:
    """Plan a loaded run where it would run: this machine's GPU (its name and the memory torch
    reports) when there is one and the config does not ask for the CPU; a CPU process for
    ``device: cpu``; else the default GPU, with a note (``foundryx plan --gpu`` picks another)."""
    import torch  # here: make_plan users need no CUDA query

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if loaded.cfg.device == "cpu":
        note = "device: cpu (the config's device): no GPU context or allocator margin; " \
               "capacity: this machine's memory / processes per node"
        return plan_loaded(loaded, per_node, "cpu", "cpu", None, _cpu_memory() // per_node, mfu,
                           [note])
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        capacity = torch.cuda.get_device_properties(0).total_memory
        return plan_loaded(loaded, per_node, name, "rocm" if torch.version.hip else "cuda", name,
                           capacity, mfu)
    spec = find_gpu(DEFAULT_GPU)
    note = (f"no GPU on this machine: planned for one {spec.key} per process "
            "(`foundryx plan CONFIG --gpu NAME --gpus N` plans for another)")
    return plan_loaded(loaded, per_node, spec.key, spec.kind, spec.device_name, spec.memory, mfu,
                       [note])


def _cpu_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def count(n: float) -> str:
    """A parameter count in the unit that shows it: 8.03B, 41.9M, 1.57M, 12.3k."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def term_doc(name: str, p: Plan) -> str:
    if name != "logits_and_loss":
        return TERM_DOCS[name]
    how = ("MPT's fused loss: one chunk, in place" if p.census.shape.fused_loss
           else "whole: the model's own loss")
    return f"{TERM_DOCS[name]} ({how})"


def render(p: Plan) -> str:
    """The plan as a table people read."""
    s, c = p.setup, p.census
    sharding = (f"FSDP2 over {s.shard_degree}" if s.zero_stage >= 3 and s.shard_degree > 1
                else "replicated" if s.world_size > 1 else "one device")
    trainable = s.lora_params or c.total
    lines = [
        f"foundryx plan: {count(c.total)} parameters ({count(trainable)} trainable), "
        f"{s.world_size} x {p.device}, {sharding}, microbatch {s.microbatch} x {s.seq_len} tokens, "
        f"{s.precision}{', activation checkpointing' if s.activation_checkpointing else ''}"
        f"{f', base {s.frozen_dtype}' if s.frozen_dtype else ''}"
        f"{f', offload {s.offload_fraction:g}' if s.offload_fraction else ''}",
        "",
        f"  {'per device':<22} {'':>14}",
    ]
    for name, value in p.terms.items():
        if value:
            lines.append(f"  {name:<22} {_gib(value):>14}   {term_doc(name, p)}")
    lines += [f"  {'total':<22} {_gib(p.per_device_bytes):>14}",
              f"  {'device memory':<22} {_gib(p.capacity):>14}", ""]
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: headroom {_gib(p.capacity - p.per_device_bytes)}; largest "
                 f"microbatch that fits: {p.largest_microbatch or 'none'}")
    lines += ["", f"  by sharding over {max(s.shard_degree, s.world_size)} (ZeRO stage): " +
              ", ".join(f"{k} {_gib(v)}" for k, v in p.by_sharding.items())]
    if p.suggestions:
        lines += ["", "To make it fit (cheapest first):"]
        for i, sug in enumerate(p.suggestions, 1):
            lines.append(f"  {i}. {sug.change}: {_gib(sug.per_device_bytes)}  [{sug.overrides}]  "
                         f"({sug.cost})")
    elif not p.fits:
        lines += ["", "No change the planner knows makes it fit: more devices with sharding, "
                  "a smaller model or a shorter sequence."]
    tps = p.tokens_per_s
    lines += ["", f"throughput: {p.flops_per_token / 1e9:,.2f} GFLOP per token"]
    if tps:
        lines[-1] += (f"; at {p.mfu:.0%} MFU of {p.peak_flops / 1e12:,.0f} TFLOP/s x "
                      f"{s.world_size}: {tps:,.0f} tokens/s, {1e9 / tps / 3600:,.1f} h per 1B tokens")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)

