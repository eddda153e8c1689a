"""Shard-on-read: a meta-device model, already LoRA-adapted, frozen-base-converted and sharded
by FSDP2, filled from a Hugging Face safetensors folder, each rank reading only its rows.

Two steps around :func:`foundryx.parallel.parallelize`:

1. :func:`prepare` (before parallelism, on every rank): reads the files' headers, maps each
   parameter of the model to its tensor in the files (PEFT's ``base_layer`` left out of the
   name; tied weights once), checks every shape, and marks the parameters it will fill so
   that meta materialisation does not initialise them. Every rank checks, and the ranks agree
   on the first problem before anything collective happens, so a bad folder is one
   :class:`~foundryx.loading.files.PretrainedLoadError` on every rank (exit 2), no rank left
   waiting.
2. :func:`load` (after parallelism): for each parameter, the rows of this rank's shard
   (``Shard(0)``: rows ``[offset, offset + local rows)``) are read as one byte range, converted
   to the parameter's dtype or quantized to its ``frozen_base`` storage right there
   (:mod:`foundryx.loading.quantize`, NF4 by :mod:`foundryx.loading.nf4_encode` and
   :mod:`foundryx.loading.nf4_shard`), and become the parameter's local shard. Under tensor
   parallelism a rank's block of a row-wise layer is some columns of its rows: the rows are
   read and converted whole (a row's scale needs all its columns), then cut. No rank holds a
   full-size copy of any tensor it does not keep whole.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from foundryx.loading.files import Entry, PretrainedLoadError, checkpoint_entries
from foundryx.loading.nf4_encode import nf4_encode
from foundryx.loading.nf4_shard import nf4
from foundryx.loading.quantize import rowwise
from foundryx.loading.reader import THREADS, Progress, Read, gb, peak_rss_gb, read_all
from foundryx.models.peft.frozen_base import LowPrecisionLinear, stored_bytes
from foundryx.models.peft.lora import inner_model
from foundryx.models.peft.parts import nf4_part
from foundryx.parallel import dist
from foundryx.parallel.materialize import LOADED_ATTR
from foundryx.parallel.offload_pack import pack_offloaded
from foundryx.runtime.host_heap import glibc

log = logging.getLogger(__name__)

PRETRAINED_ATTR = "pretrained_weights_folder"  # set by a model built on meta that wants weights


@dataclass
class Target:
    """One tensor of the model (all the places that hold it: tied weights share one) and the
    checkpoint tensor it is read from."""

    key: str
    entry: Entry
    holders: list[tuple[nn.Module, str]]
    kind: str  # "param", "buffer" or "offload" (a frozen weight kept in host memory)


@dataclass
class LoadPlan:
    folder: str
    targets: list[Target] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def wants_pretrained(model: nn.Module) -> str | None:
    """The folder a meta-built model's weights come from, or None."""
    for m in (model, inner_model(model)):
        folder = getattr(m, PRETRAINED_ATTR, None)
        if folder:
            return folder
    return None


def _candidates(name: str, prefix: str) -> list[str]:
    """Checkpoint keys that may hold the model's tensor ``name``: PEFT's ``base_layer`` is not
    in a base checkpoint; a checkpoint of the bare base model lacks the head's prefix."""
    key = ".".join(p for p in name.split(".") if p != "base_layer")
    out = [key]
    if prefix and key.startswith(prefix + "."):
        out.append(key[len(prefix) + 1:])
    elif prefix:
        out.append(f"{prefix}.{key}")
    return out


def _agree(problem: str | None) -> None:
    """Raise the same PretrainedLoadError on every rank when any rank found a problem (the
    lowest rank's), before anything else collective happens."""
    found = [p for p in dist.all_gather_object(problem) if p]
    if found:
        raise PretrainedLoadError(found[0])


def prepare(model: nn.Module, folder: str) -> LoadPlan:
    """Check ``folder`` against ``model`` and mark what :func:`load` will fill (see the module
    doc). Call on every rank, before parallelism."""
    problem, plan = None, LoadPlan(folder)
    try:
        plan = _plan(model, folder)
    except PretrainedLoadError as e:
        problem = str(e)
    _agree(problem)
    for t in plan.targets:
        for module, name in t.holders:
            loaded = getattr(module, LOADED_ATTR, set())
            loaded.add(name)
            setattr(module, LOADED_ATTR, loaded)
    return plan


def _plan(model: nn.Module, folder: str) -> LoadPlan:
    entries = checkpoint_entries(folder)
    inner = inner_model(model)
    prefix = getattr(inner, "base_model_prefix", "") or ""
    groups: dict[int, tuple[Any, list[tuple[nn.Module, str]], list[str], str]] = {}
    for mod_name, module in inner.named_modules(remove_duplicate=False):
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is None or (kind == "buffer" and name in module._non_persistent_buffers_set):
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                g = groups.setdefault(id(t), (t, [], [], kind))
                g[1].append((module, name))
                g[2].append(full)
        if isinstance(module, LowPrecisionLinear) and module.offload is not None:
            full = f"{mod_name}.weight" if mod_name else "weight"
            groups[id(module.offload)] = (module.offload.host, [(module, "weight")], [full], "offload")
    plan = LoadPlan(folder)
    missing, mismatched, used = [], [], set()
    for tensor, holders, names, kind in groups.values():
        key = next((k for n in names for k in _candidates(n, prefix) if k in entries), None)
        if key is None:
            if kind != "buffer" and not any(".lora_" in n for n in names):
                missing.append(names[0])
            continue  # adapters, buffers the model computes: initialised, not loaded
        entry = entries[key]
        if tuple(tensor.shape) != entry.shape:
            mismatched.append(f"{key!r} in {entry.file.name} is {list(entry.shape)} but the "
                              f"model's {names[0]} is {list(tensor.shape)}")
            continue
        used.add(key)
        plan.targets.append(Target(key, entry, holders, kind))
    if mismatched:
        raise PretrainedLoadError(
            f"{folder}: {len(mismatched)} tensor(s) do not match the model's config: "
            f"{'; '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''}; the folder's "
            "config.json and weights disagree, or config_overrides change a weight's shape "
            "(that needs pretrained: false)")
    if missing:
        raise PretrainedLoadError(
            f"{folder}: {len(missing)} weight(s) of the model are in none of its "
            f"safetensors files: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
            "the files are incomplete or belong to another model")
    plan.unused = sorted(set(entries) - used)
    return plan


def _rows(p: torch.Tensor) -> tuple[int, int, tuple[int, int] | None, Any]:
    """``(start, stop, columns, group)``: the rows of ``p``'s dim 0 this rank holds, the
    columns ``(start, stop)`` when it holds only some (a tensor-parallel row-wise layer's
    input features; None: all), and the process group the rows are split over (None when it
    holds them all; on a 2-D mesh, the group of the mesh dimension that splits rows, or every
    rank when several do)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = p.shape[0] if p.dim() else 1
    if not isinstance(p, DTensor):
        return 0, rows, None, None
    group, splits = None, 0
    for i, pl in enumerate(p.placements):  # _StridedShard: FSDP2 over rows TP split already
        split = isinstance(pl, (Shard, _StridedShard))
        if split and pl.dim == 0:
            group, splits = group or p.device_mesh.get_group(i), splits + 1
        elif not (isinstance(pl, Replicate) or (split and pl.dim == 1)):
            raise PretrainedLoadError(f"cannot load into a parameter placed as {p.placements}: "
                                      "only Shard(0), Shard(1) and Replicate are supported")
    if not p.dim():
        return 0, 1, None, None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    columns = None
    if p.dim() > 1 and shape[1] != p.shape[1]:
        columns = (offset[1], offset[1] + shape[1])
    if splits > 1:  # rows split over several mesh dimensions (TP, then FSDP): every rank
        group = torch.distributed.group.WORLD
    return offset[0], offset[0] + shape[0], columns, group


def _columns(local: torch.Tensor, columns: tuple[int, int] | None) -> torch.Tensor:
    """This rank's ``columns`` of whole converted rows, as a tensor of its own (a row-scaled
    storage keeps each row's scale, computed from the whole row: the same bytes as
    quantizing the whole weight, then cutting it)."""
    if columns is None:
        return local
    start, stop = columns
    if hasattr(local, "quantized_scalers"):  # NF4: whole groups of blocks of each row
        return nf4_part(local, columns=columns)
    inner = getattr(local, "__tensor_flatten__", None)
    if inner is None:
        return local[:, start:stop].clone()
    names, meta = inner()
    parts = {n: getattr(local, n) for n in names}
    parts = {n: t[:, start:stop].clone() if t.dim() == 2 else t for n, t in parts.items()}
    shape = (local.shape[0], stop - start)
    return type(local).__tensor_unflatten__(parts, (shape, *meta[1:]), shape, None)


def _offload_rows(t: Target) -> tuple[int, int, tuple[int, int] | None, Any]:
    """:func:`_rows` of an offloaded weight: this rank's rows of it, its columns under
    tensor parallelism (a row-wise layer's), and the group its rows are split over."""
    off = t.holders[0][0].offload
    start, stop = off.shard_range()
    group = None if off.rows is None else (off.group or torch.distributed.group.WORLD)
    if off.placed is not None and off.columns is None:  # TP's rows, then their part: all ranks
        group = torch.distributed.group.WORLD
    return start, stop, off.columns, group


def _collective(t: Target, module: nn.Module) -> bool:
    """Whether converting ``t`` takes a collective (NF4's whole-weight scaler mean), so it
    runs on the loading thread, in the same order on every rank."""
    return (t.kind != "buffer" and isinstance(module, LowPrecisionLinear)
            and t.holders[0][1] == "weight" and module.storage == "nf4")


def _convert(t: Target, module: nn.Module, rows: torch.Tensor, like: torch.Tensor,
             device: torch.device) -> torch.Tensor:
    """The checkpoint ``rows`` in the form the model keeps them: its int8/FP8/bf16 frozen-base
    storage (NF4 is finished in ``load``'s ``use``: :func:`_collective`), or its dtype, on
    ``device`` (offloaded weights stay in host memory). Always a new tensor: ``rows`` views
    the file's mapping, which must not outlive the load."""
    if t.kind != "buffer" and isinstance(module, LowPrecisionLinear) and t.holders[0][1] == "weight":
        rows = rows if t.kind == "offload" else rows.to(device)
        return rowwise(rows, module.storage, like.dtype)
    return torch.empty(rows.shape, dtype=like.dtype, device=device).copy_(rows)


def _place(t: Target, like: torch.Tensor, local: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if t.kind == "offload":
        t.holders[0][0].offload.host = local
        return
    value = local
    if isinstance(like, DTensor):
        value = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                   shape=like.shape, stride=like.stride())
    if t.kind == "param":
        value = nn.Parameter(value, requires_grad=like.requires_grad)
    for module, name in t.holders:
        (module._parameters if t.kind == "param" else module._buffers)[name] = value
        getattr(module, LOADED_ATTR, set()).discard(name)


def _current(t: Target) -> torch.Tensor:
    module, name = t.holders[0]
    if t.kind == "offload":
        return module.offload.host
    return (module._parameters if t.kind == "param" else module._buffers)[name]


TRIM_EVERY_BYTES = 64 * 2**20


def release_freed_memory() -> None:
    """Hand the memory of freed read buffers and conversion temporaries back to the OS
    (glibc's ``malloc_trim``; elsewhere nothing). glibc keeps freed chunks below its mmap
    threshold (which grows to 32 MiB after the first large free) in its arenas, one per reader
    thread, and a load frees hundreds of them between the weights it keeps: measured on a 1.1B
    model, 2 ranks, fp8, that retention was about 0.9 GiB per rank, more than the weights kept."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the readers run: the load makes no cycles,
    and the collections its many small tensor objects set off took about 9% of an NF4 load's
    CPU time (perf, benchmarks/RESULTS.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load(model: nn.Module, plan: LoadPlan, device: torch.device) -> dict[str, Any]:
    """Fill the tensors :func:`prepare` marked, each rank its own rows (see the module doc);
    logs progress on rank 0 and a summary (load time, peak host memory per rank). Returns
    the numbers of that summary."""
    rss0 = peak_rss_gb()
    reads, jobs = [], {}
    for t in plan.targets:
        like = _current(t)
        start, stop, columns, group = _rows(like) if t.kind != "offload" else _offload_rows(t)
        r = Read(t.key, t.entry, start, stop)
        reads.append(r)
        jobs[id(r)] = (t, like, group, columns)
    total = sum(r.byte_range[1] - r.byte_range[0] for r in reads)
    dtypes = sorted({str(t.entry.dtype).removeprefix("torch.") for t in plan.targets})
    if dist.rank() == 0:
        log.info("loading %s: %d tensors (%s) from %d file(s), %s for this rank, %d reader threads",
                 plan.folder, len(reads), ", ".join(dtypes),
                 len({t.entry.file for t in plan.targets}), gb(total), THREADS)
    progress = Progress(total, dist.rank() == 0)
    converted: dict[str, set[str]] = {}
    since_trim = [0]

    def early(r: Read, rows: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """In a reader thread: (done, the rows converted), or (False, the rows encoded as
        NF4) when finishing them takes a collective, left to ``use``."""
        t, like, _, columns = jobs[id(r)]
        module = t.holders[0][0]
        if _collective(t, module):  # all but the whole weight's scaler mean, here
            rows = rows if t.kind == "offload" else rows.to(device)
            block = getattr(like, "_local_tensor", like).block_size
            return False, nf4_encode(rows, block, like.dtype)
        # whole rows converted (a row's scale needs all its columns), then this rank's columns
        return True, _columns(_convert(t, module, rows, like, device), columns)

    def use(r: Read, value: tuple[bool, torch.Tensor]) -> None:
        t, like, group, columns = jobs[id(r)]
        module = t.holders[0][0]
        done, local = value
        if not done:  # whole rows, as with every storage, then this rank's columns
            local = _columns(nf4(local, getattr(like, "_local_tensor", like), like.dtype, group,
                                 r.start), columns)
        since_trim[0] += r.byte_range[1] - r.byte_range[0]
        if since_trim[0] >= TRIM_EVERY_BYTES:
            since_trim[0] = 0
            release_freed_memory()
        if local.dtype != r.entry.dtype or type(local) is not torch.Tensor:
            what = getattr(module, "storage", None) if isinstance(module, LowPrecisionLinear) \
                and t.kind != "buffer" else str(local.dtype).removeprefix("torch.")
            converted.setdefault(f"{str(r.entry.dtype).removeprefix('torch.')} -> {what}",
                                 set()).add(t.key)
        _place(t, like, local)

    with torch.no_grad(), _gc_paused():
        read_all(reads, use, progress, prepare=early)
    release_freed_memory()
    offloaded = [t.holders[0][0] for t in plan.targets if t.kind == "offload"]
    if offloaded:
        pack_offloaded(offloaded, device, release=release_freed_memory)  # pinned for a GPU
    if converted and dist.rank() == 0:
        log.info("loading: converted shard by shard: %s", "; ".join(
            f"{k} ({len(v)} tensors)" for k, v in sorted(converted.items())))
    stored = sum(stored_bytes(_current(t)) for t in plan.targets)
    peaks = dist.all_gather_object((peak_rss_gb(), peak_rss_gb() - rss0, stored))
    summary = {"seconds": progress.seconds, "bytes_read": total, "peak_rss_gb": [p[0] for p in peaks],
               "stored_bytes": [p[2] for p in peaks]}
    if dist.rank() == 0:
        log.info("loaded %s in %.1f s (%s read by rank 0, %.2f GB/s); peak host memory per rank: "
                 "%s GB; weights kept per rank: %s%s", plan.folder, progress.seconds, gb(total),
                 total / 1e9 / max(progress.seconds, 1e-9),
                 ", ".join(f"{p[0]:.2f}" for p in peaks), ", ".join(gb(p[2]) for p in peaks),
                 f"; {len(plan.unused)} tensors of the files unused ({', '.join(plan.unused[:3])}"
                 f"{' ...' if len(plan.unused) > 3 else ''})" if plan.unused else "")
    return summary
