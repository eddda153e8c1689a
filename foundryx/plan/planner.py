"""``foundryx plan``: will this run fit, and how long will it take? Seconds, on a laptop.

    plan = make_plan("yamls/finetune/llama-lora.yaml", gpus=8, gpu="h100")
    plan.to_json()  # foundryx.plan.render.render(plan): the text `foundryx plan` prints
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from foundryx.config.load import LoadedConfig, load_config, read_resolved
from foundryx.errors import ConfigError
from foundryx.plan.advice import Suggestion, largest_microbatch, suggestions
from foundryx.plan.census import Census
from foundryx.plan.checkpointing import choose_mode, is_auto, with_mode
from foundryx.plan.gpus import DEFAULT_GPU, DEFAULT_MFU, GB, find_gpu, parse_memory, parse_rate
from foundryx.plan.host import HostFix, HostPlan, HostSetup, host_fixes, host_plan
from foundryx.plan.length import Longest, longest
from foundryx.plan.memory import Setup, by_stage, full_checkpointing, terms
from foundryx.plan.node import machine, processes_per_node, shape_override
from foundryx.plan.settings import plan_setup
from foundryx.plan.speed import Choice, Run, choose
from foundryx.plan.tp import (
    Comm,
    Links,
    TpOption,
    communication,
    propose_tp,
    tp_options,
)
from foundryx.runtime.devices import peak_flops

# Reading the weights on a machine with no node kind (a CPU run, this machine): assumed.
CPU_READ_RATE = 1 * GB


@dataclass(frozen=True)
class HostSpec:
    """Host memory per node, what it is, and the node's read rate for the weights."""

    memory: int
    node: str
    read_rate: float


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
    host: HostPlan | None = None
    host_fixes: list[HostFix] = field(default_factory=list)
    comm: Comm | None = None
    tp_options: list[TpOption] = field(default_factory=list)  # the run at each TP degree
    tp_proposal: TpOption | None = None  # a TP degree that fits, or ends all-gather binding
    speed: Choice | None = None  # where the MFU came from (None: no peak FLOP/s, no estimate)
    host_setup: HostSetup | None = None  # what the host terms were planned from
    seq_key: str = "max_seq_len"  # the override that sets the run's length
    seq_share: int = 1  # devices a sequence is split over (context parallelism): setup.seq_len x it
    ac_auto: bool = False  # activation_checkpointing.mode: auto (setup: the mode it took here)

    @property
    def search_setup(self) -> Setup:
        """The setup the searches (longest sequence, largest microbatch) size: under ``mode:
        auto``, full checkpointing's, which auto takes wherever selective would not fit."""
        return full_checkpointing(self.setup) if self.ac_auto else self.setup

    def longest_sequence(self) -> Longest:
        """The longest sequence this run fits on its device and node (``--search
        max_seq_len``), from the same terms as the plan; under context parallelism the whole
        sequence (each device planned at its share)."""
        cap = self.host.capacity if self.host is not None else None
        answer = longest(self.census, self.search_setup, self.capacity, self.host_setup, cap)
        if self.seq_share > 1:
            k = self.seq_share
            answer = replace(answer, seq_len=answer.seq_len * k, next_len=answer.next_len * k)
        return answer

    @property
    def per_device_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def device_fits(self) -> bool:
        return self.per_device_bytes <= self.capacity

    @property
    def host_fits(self) -> bool:
        return self.host is None or self.host.fits

    @property
    def fits(self) -> bool:
        """Device memory and the node's host memory both."""
        return self.device_fits and self.host_fits

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
            "device_fits": self.device_fits,
            "host": self.host.to_json() if self.host else None,
            "host_fixes": [vars(f) for f in self.host_fixes],
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
                           "mfu_source": self.speed.to_json() if self.speed else None,
                           "hours_per_1b_tokens": 1e9 / tps / 3600 if tps else None},
            "parallel": {"tp": self.setup.tp, "sequence_parallel": self.setup.sequence_parallel,
                         "shard_degree": self.setup.shard_degree},
            "communication": self.comm.to_json() if self.comm else None,
            "tp_options": [o.to_json() for o in self.tp_options],
            "tp_proposal": self.tp_proposal.to_json() if self.tp_proposal else None,
            "notes": self.notes,
        }


def flops_per_token(c: Census, seq_len: int) -> int:
    """Training FLOPs per token, the models' own count (``flops_per_batch`` / tokens):
    ``6 N + 12 n_layers d_model s``, N the parameters used in matmuls."""
    sh = c.shape
    return 6 * c.matmul + 12 * sh.n_layers * sh.d_model * seq_len


def make_plan(config: str | Path, overrides: list[str] | None = None, *, gpus: int | None = None,
              nodes: int | None = None, gpu: str | None = None, gpu_memory: str | None = None,
              mfu: float | None = None, host_memory: str | None = None,
              read_rate: str | None = None, tp: int | None = None) -> Plan:
    """Plan the run ``config`` (with ``key=value`` overrides) on ``nodes`` x ``gpus`` devices,
    nodes of ``host_memory`` (default: the GPU's reference node's, this machine's for a CPU)
    reading the weights at ``read_rate`` (e.g. ``2GB/s``); ``tp``: at this tensor-parallel
    degree instead of the config's ``parallelism.tp``; ``mfu``: this MFU instead of the
    measured table's (foundryx/plan/speed.py)."""
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError([f"--mfu: {mfu} is not a fraction in (0, 1]; e.g. --mfu 0.4"])
    if (nodes is not None and nodes < 1) or (gpus is not None and gpus < 1):
        raise ConfigError(["--gpus and --nodes: at least 1 each"])
    if tp is not None and tp < 1:
        raise ConfigError([f"--tp: {tp} is not a degree; a divisor of --gpus, e.g. --tp 2"])
    notes: list[str] = []
    data, _ = read_resolved(Path(config), overrides)  # its problems: load_config's, below
    by_config = gpu is None and str(data.get("device") or "").lower() == "cpu"
    if by_config:  # the config runs on CPU: its node's GPU (a recipe's) is not the machine
        gpu = "cpu"
    target = machine(data.get("node"), gpu, gpus, nodes, host_memory)
    gpu, gpus, nodes, host_memory = target.gpu, target.gpus, target.nodes, target.host_memory
    notes += [target.note] if target.note else []
    shape, said = shape_override(config, data.get("model"))
    notes += [said] if said else []
    per_node = processes_per_node(gpus)
    world = per_node * nodes
    loaded = load_config(config, [*(overrides or []), *shape], world_size=world,
                         component_sections=("model", "optimizer"))
    if (gpu or "").lower() == "cpu":  # --gpu cpu, or the config's device (by_config)
        # A CPU process: no CUDA / ROCm context and no caching allocator, so neither term.
        capacity = parse_memory(gpu_memory) if gpu_memory else _cpu_memory() // per_node
        why = "the config's device" if by_config else "--gpu cpu"
        where = "--gpu-memory" if gpu_memory else "this machine's memory / processes per node"
        notes.append(f"device: cpu ({why}): no GPU context or allocator margin; capacity: "
                     f"{where}; no MFU on CPU")
        if loaded.cfg.host_heap != "bounded":  # what glibc keeps is not planned (host_heap.py)
            notes.append(f"host_heap: {loaded.cfg.host_heap} on a CPU device: glibc may keep a "
                         "step's freed temporaries above this plan at large sizes (1.5-2.1x at "
                         "0.65B); host_heap=bounded keeps the run to it, at more step time "
                         "(docs/planning.md)")
        host = _host_spec(host_memory, read_rate, this_machine(), target.host_source)
        plan = plan_loaded(loaded, per_node, "cpu", "cpu", None, capacity, mfu, notes, host,
                           tp=tp)
        return plan
    if gpu is None:
        notes.append(f"--gpu not given: planned for {DEFAULT_GPU}")
    spec = find_gpu(gpu or DEFAULT_GPU)
    capacity = parse_memory(gpu_memory) if gpu_memory else spec.memory
    node = HostSpec(spec.host_memory, f"{spec.node} (--host-memory for yours)", spec.read_rate)
    plan = plan_loaded(loaded, per_node, spec.key, spec.kind, spec.device_name, capacity, mfu,
                       notes, _host_spec(host_memory, read_rate, node, target.host_source),
                       Links(spec.link_rate, spec.net_rate), tp=tp)
    return plan


def this_machine() -> HostSpec:
    """This machine's RAM, and the assumed read rate of a machine with no node kind."""
    return HostSpec(_cpu_memory(), "this machine", CPU_READ_RATE)


def _host_spec(memory: str | None, rate: str | None, default: HostSpec,
               where: str = "--host-memory") -> HostSpec:
    return HostSpec(parse_memory(memory, where) if memory else default.memory,
                    where if memory else default.node,
                    parse_rate(rate) if rate else default.read_rate)


def plan_loaded(loaded: LoadedConfig, per_node: int, device: str, kind: str,
                device_name: str | None, capacity: int, mfu: float | None = None,
                notes: list[str] | None = None, host: HostSpec | None = None,
                links: Links | None = None, tp: int | None = None, here: bool = False) -> Plan:
    """Plan an already loaded run config on its world size of ``device`` (``kind``: cuda, rocm
    or cpu; ``device_name`` as torch names it, for the peak FLOP/s) of ``capacity`` bytes, on
    nodes of ``host`` (default: this machine) whose devices talk at ``links`` (None: no
    communication times), at TP degree ``tp`` (default: the config's); ``mfu``: given, else
    the measured table's for this device and run (:func:`foundryx.plan.speed.choose`);
    ``here``: the run is this process's (its environment's FOUNDRYX_COMPILE=0 counts)."""
    notes = list(notes or [])
    peak = None
    if device_name is not None:
        peak = peak_flops(device_name, loaded.cfg.precision, warn=False)
        if peak is None:
            notes.append(f"no peak FLOP/s for {device} at {loaded.cfg.precision}: no "
                         "throughput estimate")
    auto, planned = is_auto(loaded), None
    if auto:  # the mode auto takes on this device, said in a note (planned in that mode)
        choice = choose_mode(loaded, per_node, kind, capacity, device, tp)
        loaded, planned = with_mode(loaded, choice.mode), choice.planned
        notes.append(choice.line)
    if planned is None:
        planned = plan_setup(loaded, loaded.derived.world_size, per_node, kind, tp)
    c, s = planned.census, planned.setup
    t = terms(c, s)
    fpt = flops_per_token(c, s.seq_len)
    speed = None
    if peak is not None:
        speed = (choose(speed_run(loaded, s, device_name, kind, here)) if mfu is None
                 else Choice(mfu, None, "--mfu"))
        notes += list(speed.notes)
    mfu = speed.mfu if speed else (mfu or DEFAULT_MFU)
    comm = communication(c, s, fpt, peak, mfu, links)
    options = tp_options(c, s, fpt, peak, mfu, links)
    fits = sum(t.values()) <= capacity
    proposal = (propose_tp(options, s.tp, capacity, comm.all_gather_bound)
                if not fits or comm.all_gather_bound else None)
    host = host or this_machine()
    hp = host_plan(c, s, planned.host, host.memory, host.node, host.read_rate)
    return Plan(
        census=c, setup=s, device=device, capacity=capacity, terms=t,
        by_sharding=by_stage(c, s, data_parallel(s)),
        suggestions=[] if fits else suggestions(c, s, capacity),
        largest_microbatch=largest_microbatch(c, full_checkpointing(s) if auto else s, capacity),
        flops_per_token=fpt, peak_flops=peak, mfu=mfu,
        notes=notes + planned.notes,
        host=hp,
        host_fixes=[] if hp.fits else host_fixes(c, s, planned.host, hp, capacity),
        comm=comm, tp_options=options, tp_proposal=proposal, speed=speed,
        host_setup=planned.host, seq_key=seq_key(loaded.source), ac_auto=auto,
        seq_share=max(int(getattr(loaded.cfg.parallelism, "cp", 1) or 1), 1)
        if loaded.cfg.parallelism is not None else 1,
    )


def seq_key(source: str) -> str:
    """``variables.max_seq_len`` where the config file sets its length there (its loaders read
    it too), else ``max_seq_len``."""
    import yaml  # here: only to read the file's variables

    try:
        data = yaml.safe_load(Path(source).read_text())
    except (OSError, yaml.YAMLError):
        data = None
    variables = data.get("variables") if isinstance(data, dict) else None
    if isinstance(variables, dict) and "max_seq_len" in variables:
        return "variables.max_seq_len"
    return "max_seq_len"


MODEL_KINDS = {"hf_causal_lm": "hf", "mpt_causal_lm": "mpt"}  # the speed table's model kinds


def speed_run(loaded: LoadedConfig, s: Setup, device_name: str | None, kind: str,
              here: bool = False) -> Run:
    """What the speed table's rule reads of a run: its device, precision, model kind, what
    trains, the frozen base, offload, compile (``auto``: on a GPU, as training resolves it;
    ``here``, this process's FOUNDRYX_COMPILE=0 turns it off as it does training's) and
    activation checkpointing."""
    enabled = getattr(getattr(loaded.cfg, "compile", None), "enabled", False)
    if enabled == "auto":
        enabled = kind in ("cuda", "rocm") and not (here and os.environ.get("FOUNDRYX_COMPILE") == "0")
    name = str(loaded.cfg.model.get("name"))
    return Run(device_name, s.precision, MODEL_KINDS.get(name, name), "lora" if s.lora else "full",
               s.frozen_dtype, s.offload_fraction > 0, bool(enabled), s.activation_checkpointing,
               s.activation_checkpointing and s.ac_selective)


def plan_here(loaded: LoadedConfig, mfu: float | None = None) -> Plan:
    """Plan a loaded run where it would run: this machine's GPU (its name and the memory torch
    reports) when there is one and the config does not ask for the CPU; a CPU process for
    ``device: cpu``; else the default GPU, with a note (``foundryx plan --gpu`` picks another)."""
    import torch  # here: make_plan users need no CUDA query

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if loaded.cfg.device == "cpu":
        note = "device: cpu (the config's device): no GPU context or allocator margin; " \
               "capacity: this machine's memory / processes per node"
        return plan_loaded(loaded, per_node, "cpu", "cpu", None, _cpu_memory() // per_node, mfu,
                           [note], this_machine())
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        capacity = torch.cuda.get_device_properties(0).total_memory
        return plan_loaded(loaded, per_node, name, "rocm" if torch.version.hip else "cuda", name,
                           capacity, mfu, None, this_machine(), here=True)
    target = machine(loaded.resolved.get("node"), None, None, None, None)
    if target.gpu is not None:  # the recipe's node (a login node plans the cluster's)
        spec = find_gpu(target.gpu)
        node = HostSpec(*_node_host(spec, target.host_memory))
        return plan_loaded(loaded, target.gpus or per_node, spec.key, spec.kind, spec.device_name,
                           spec.memory, mfu, [f"no GPU on this machine: {target.note}"], node,
                           Links(spec.link_rate, spec.net_rate))
    spec = find_gpu(DEFAULT_GPU)
    note = (f"no GPU on this machine: planned for one {spec.key} per process "
            "(`foundryx plan CONFIG --gpu NAME --gpus N` plans for another)")
    node = HostSpec(spec.host_memory, spec.node, spec.read_rate)
    return plan_loaded(loaded, per_node, spec.key, spec.kind, spec.device_name, spec.memory, mfu,
                       [note], node, Links(spec.link_rate, spec.net_rate))


def _node_host(spec: Any, host_memory: str | None) -> tuple[int, str, float]:
    """A node of ``spec``'s GPUs: its reference host memory, or ``host_memory``."""
    if host_memory:
        return parse_memory(host_memory, "node.host_memory"), "node.host_memory", spec.read_rate
    return spec.host_memory, spec.node, spec.read_rate


def _cpu_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def data_parallel(s: Setup) -> int:
    """The ranks one copy of the weights can be sharded over: the world size over the TP
    degree (a TP group holds one copy between its ranks)."""
    return max(s.shard_degree, s.world_size // max(s.tp, 1), 1)
