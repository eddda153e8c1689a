"""Host (CPU) memory of a training run, per rank and per node, and the time to load its
pretrained weights.

A rank's host memory has two peaks that do not overlap: loading (the pretrained weights read
from the safetensors files into the rank's shards) and training (what stays in host memory:
offloaded shards, FSDP2's CPU offload, dataloader workers; on a CPU device, everything the
device plan counts). The rank's peak is the larger; a node's is its ranks' peaks summed (the
ranks load at once and train at once).

Loading follows the shard-on-read loader (``init_device: meta`` with a pretrained folder,
foundryx/loading): every rank builds on the meta device and reads only its own slices of the
files. A rank ends the load holding its shards as the model keeps them (a CPU device: all of
them, in host memory; a GPU: only the offloaded shards stay in host memory), and on the way
holds what is in flight: the file ranges mapped ahead of use, the largest tensor's slice as
stored, and the conversion's working set (NF4's float32 copies). The page cache the reads go
through is the kernel's, reclaimable, and not counted. Checked against the whole process's
peak on CPU ranks by benchmarks/load_memory.py (benchmarks/RESULTS.md). ``init_device: cpu``
reads the whole checkpoint on every rank (``from_pretrained``), ``mixed`` on rank 0:
``LOADER_SLACK`` x the checkpoint + the largest tensor + the reader buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from foundryx.plan.census import Census
from foundryx.plan.memory import Setup, frozen_linear_bytes, offloaded_activation_bytes, terms

GiB = 2**30
MiB = 2**20

# A whole-checkpoint read (init_device cpu / mixed): LOADER_SLACK x stored + the largest tensor
# + READER_THREADS x READER_BUFFER.
LOADER_SLACK = 1.25
READER_THREADS = 4
READER_BUFFER = 64 * MiB
# Shard-on-read (foundryx/loading): what a rank keeps, plus in flight READ_AHEAD bytes of file
# ranges mapped ahead of use (foundryx.loading.reader.AHEAD_BYTES) and the largest tensor's
# slice (an NF4 frozen base is encoded in place by a C kernel, foundryx.kernels.nf4_cpu, with
# 48 KiB of stack a reader thread; without a C compiler the torch-op encoder's scratch tensors
# take up to 40 MiB more a rank, not counted: the load says so when it happens); offloaded
# shards are moved into one host buffer at the end of the load a layer at a time, each
# layer's old copy dropped as it goes (foundryx.parallel.offload.pack_offloaded), so they
# are held OFFLOAD_PACK_COPIES times, plus one layer's (within the largest slice's term).
READ_AHEAD = 64 * MiB
OFFLOAD_PACK_COPIES = 1

# Measured by benchmarks/plan_host.py (benchmarks/RESULTS.md, "Host memory"): the resident
# memory of a process that has imported what train.py imports (torch, Composer, transformers,
# foundryx), before it builds anything; and the private (unshared) memory of one forked text
# dataloader worker after 20 batches (what it shares with its rank is counted once, there).
PROCESS_BASELINE = 813 * MiB
WORKER_BYTES = 12 * MiB
# Assumed, not measured here (no GPU on the machine that measured the two above): the host
# side of a CUDA / ROCm process once it has a context, cuBLAS / hipBLASLt and NCCL / RCCL
# loaded (their code and host buffers; 2-4 GiB is what such processes commonly show).
GPU_RUNTIME_HOST = 3 * GiB

LOAD_MODES = {
    "shard": "shard-on-read (init_device: meta): each rank reads only its slices",
    "every_rank": "init_device: cpu: every rank reads the whole checkpoint",
    "rank0": "init_device: mixed: rank 0 reads the whole checkpoint",
    "none": "no pretrained weights to read",
}

HOST_DOCS = {
    "process_baseline": "Python with torch, Composer, transformers, foundryx imported (measured)",
    "gpu_runtime": "host side of the CUDA / ROCm runtime and its libraries (3 GiB assumed)",
    "device_memory": "CPU device: what the device plan counts (weights, optimizer, activations)",
    "offloaded_shards": "offloaded frozen weights: offloaded bytes / N in one exact-size buffer "
                        "(pinned on a GPU)",
    "cpu_offload_state": "FSDP2 cpu_offload: the sharded weights, gradients and optimizer state",
    "offloaded_activations": "activation_checkpointing.cpu_offload: every checkpointed block's "
                             "input (pinned on a GPU)",
    "dataloader_workers": "dataloader worker processes (train + eval), private memory each",
    "loader_transient": "loading: the shards a rank keeps in host memory (a CPU device: all; "
                        "offloaded: moved into one buffer), file ranges read ahead, the largest "
                        "slice and its conversion",
}
TRAIN_TERMS = ("device_memory", "offloaded_shards", "cpu_offload_state", "offloaded_activations",
               "dataloader_workers")


@dataclass(frozen=True)
class HostSetup:
    """What decides host memory beyond the device Setup."""

    ranks_per_node: int
    load: str = "none"  # a LOAD_MODES key
    stored_bytes: int = 0  # the pretrained checkpoint's bytes (its files, or dtype x parameters)
    workers: int = 0  # dataloader worker processes per rank (train + eval loaders)
    batch_bytes: int = 0  # one device batch as the workers hand it over (prefetched twice)


@dataclass
class HostPlan:
    """Per-rank terms (at each phase's peak), per-node totals and the load estimate."""

    terms: dict[str, int]
    load_per_rank: int  # the loading peak of the rank that reads the most
    train_per_rank: int
    per_node: int
    capacity: int  # host memory per node
    node: str  # what the capacity is (a node kind, this machine, --host-memory)
    ranks_per_node: int
    load: str
    read_per_rank: int  # bytes the rank that reads the most reads
    read_per_node: int
    read_rate: float  # bytes/s per node
    load_seconds: float

    @property
    def per_rank(self) -> int:
        return max(self.load_per_rank, self.train_per_rank)

    @property
    def fits(self) -> bool:
        return self.per_node <= self.capacity

    def to_json(self) -> dict:
        return {"terms": self.terms, "load_per_rank": self.load_per_rank,
                "train_per_rank": self.train_per_rank, "per_rank": self.per_rank,
                "per_node": self.per_node, "capacity_bytes": self.capacity, "node": self.node,
                "ranks_per_node": self.ranks_per_node, "fits": self.fits, "load": self.load,
                "read_per_rank_bytes": self.read_per_rank,
                "read_per_node_bytes": self.read_per_node, "read_rate": self.read_rate,
                "load_seconds": self.load_seconds}


def _divisor(s: Setup) -> int:
    return max(s.shard_degree, 1) if s.zero_stage >= 3 else 1


def host_terms(c: Census, s: Setup, h: HostSetup) -> tuple[dict[str, int], int]:
    """(per-rank terms of the rank that loads the most, the other ranks' loader transient)."""
    n = _divisor(s)
    t: dict[str, float] = dict.fromkeys(HOST_DOCS, 0.0)
    t["process_baseline"] = PROCESS_BASELINE
    t["gpu_runtime"] = GPU_RUNTIME_HOST if s.device_kind != "cpu" else 0
    if s.device_kind == "cpu":
        t["device_memory"] = sum(terms(c, s).values())
    if s.lora and s.offload_fraction > 0:
        t["offloaded_shards"] = frozen_linear_bytes(c, s) * s.offload_fraction / n
    if s.fsdp_cpu_offload:
        on = terms(c, replace(s, fsdp_cpu_offload=False))
        t["cpu_offload_state"] = sum(on[k] for k in ("frozen_weights", "trainable_weights",
                                                     "gradients", "optimizer_state"))
    t["offloaded_activations"] = offloaded_activation_bytes(c.shape, s)
    t["dataloader_workers"] = h.workers * (WORKER_BYTES + 2 * h.batch_bytes)
    others = 0.0
    if h.load != "none" and h.stored_bytes:
        per_elem = h.stored_bytes / max(c.total, 1)
        readers = READER_THREADS * READER_BUFFER
        whole = LOADER_SLACK * h.stored_bytes + c.largest_param * per_elem + readers
        sharded = shard_on_read_bytes(c, s, n, per_elem, t["offloaded_shards"])
        t["loader_transient"] = sharded if h.load == "shard" else whole
        others = whole if h.load == "every_rank" else 0.0 if h.load == "rank0" else sharded
    return {k: int(math.ceil(v)) for k, v in t.items()}, int(math.ceil(others))


def shard_on_read_bytes(c: Census, s: Setup, n: int, per_elem: float, offloaded: float) -> float:
    """A rank's loading peak above its baseline under shard-on-read (see the module doc)."""
    kept = 0.0
    if s.device_kind == "cpu":
        on = terms(c, s)
        kept = on["frozen_weights"] + on["trainable_weights"]
    return kept + OFFLOAD_PACK_COPIES * offloaded + READ_AHEAD + c.largest_param * per_elem / n


def read_bytes(s: Setup, h: HostSetup) -> tuple[int, int]:
    """(bytes the rank that reads the most reads, bytes a node reads)."""
    if h.load == "none" or not h.stored_bytes:
        return 0, 0
    if h.load == "shard":
        per_rank = h.stored_bytes // _divisor(s)
        return per_rank, per_rank * h.ranks_per_node
    if h.load == "rank0":
        return h.stored_bytes, h.stored_bytes
    return h.stored_bytes, h.stored_bytes * h.ranks_per_node


def host_plan(c: Census, s: Setup, h: HostSetup, capacity: int, node: str,
              read_rate: float) -> HostPlan:
    t, others_load = host_terms(c, s, h)
    common = t["process_baseline"] + t["gpu_runtime"]
    train = common + sum(t[k] for k in TRAIN_TERMS)
    load = common + t["loader_transient"]
    rest = h.ranks_per_node - 1
    node_load = load + rest * (common + others_load)
    per_node = max(node_load, h.ranks_per_node * train)
    per_rank_read, per_node_read = read_bytes(s, h)
    return HostPlan(terms=t, load_per_rank=load, train_per_rank=train, per_node=per_node,
                    capacity=capacity, node=node, ranks_per_node=h.ranks_per_node, load=h.load,
                    read_per_rank=per_rank_read, read_per_node=per_node_read,
                    read_rate=read_rate, load_seconds=per_node_read / read_rate)


@dataclass
class HostFix:
    change: str
    overrides: str
    per_node_bytes: int
    device_bytes: int | None = None  # the per-device total after the change, where it moves


def host_fixes(c: Census, s: Setup, h: HostSetup, hp: HostPlan, device_capacity: int) -> list[HostFix]:
    """Single changes that bring the node's host memory under its capacity, each re-planned."""
    def again(s2: Setup = s, h2: HostSetup = h) -> HostPlan:
        return host_plan(c, s2, h2, hp.capacity, hp.node, hp.read_rate)

    fixes: list[HostFix] = []
    if s.lora and s.offload_fraction > 0:
        steps = [round(f / 20, 2) for f in range(int(s.offload_fraction * 20) - 1, -1, -1)]
        for f in steps:
            s2 = replace(s, offload_fraction=f)
            new = again(s2)
            if new.fits:
                dev = sum(terms(c, s2).values())
                tail = "" if dev <= device_capacity else " (but the device then needs more than it has)"
                fixes.append(HostFix(f"offload less: offload_fraction {f:g} instead of "
                                     f"{s.offload_fraction:g}{tail}",
                                     f"model.frozen_base.offload_fraction={f:g}", new.per_node, dev))
                break
    if h.load in ("every_rank", "rank0"):
        new = again(h2=replace(h, load="shard"))
        if new.fits:
            fixes.append(HostFix("read the checkpoint shard by shard (each rank its own slices)",
                                 "model.init_device=meta", new.per_node))
    if s.lora and s.frozen_dtype in ("bf16", "fp8", "int8", None) and s.offload_fraction > 0:
        s2 = replace(s, frozen_dtype="nf4")
        new = again(s2)
        if new.fits:
            fixes.append(HostFix("a smaller frozen base: nf4 (its offloaded shards shrink)",
                                 "model.frozen_base.dtype=nf4", new.per_node,
                                 sum(terms(c, s2).values())))
    if h.workers:
        new = again(h2=replace(h, workers=0))
        if new.fits:
            fixes.append(HostFix("no dataloader worker processes",
                                 "train_loader.num_workers=0 eval_loader.num_workers=0",
                                 new.per_node))
    per_rank = max(hp.per_rank, 1)  # the largest rank's (rank 0 when it alone loads)
    most = min(hp.capacity // per_rank, h.ranks_per_node - 1)
    world = s.world_size
    fewer = next((r for r in range(most, 0, -1) if world % r == 0
                  and again(h2=replace(h, ranks_per_node=r)).fits), 0)  # the same world size
    if fewer:
        fixes.append(HostFix(f"fewer ranks per node: {fewer} instead of {h.ranks_per_node} "
                             f"({world // fewer} nodes for the same {world} ranks)",
                             f"--gpus {fewer} --nodes {world // fewer}",
                             again(h2=replace(h, ranks_per_node=fewer)).per_node))
    return fixes
