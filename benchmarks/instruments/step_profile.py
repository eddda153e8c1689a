"""One training step, profiled, in two small markdown files (issue 46): what the GPU ran and
what held its memory. Used by benchmarks/peer_lora.py (plain transformers + peft) and by
benchmarks/flagship.py's foundryx runs (as a Composer callback), so both sides of
benchmarks/flagship_vs_peer.py are profiled the same way.

    prof = StepProfile(out_dir, "peer", device)
    prof.start()                          # before the step's forward
    ...forward, backward, optimizer step...
    prof.stop(model, optimizer)           # writes out_dir/peer-kernels.md, peer-memory.md

- ``<side>-kernels.md``: the step's top kernels by device time (torch.profiler: every CUDA /
  HIP kernel, memcpy and memset of the step, summed by name), with the step's kernel count
  and total device time; on a CPU, the top operators by self CPU time instead.
- ``<side>-memory.md``: the allocator's figures (``torch.cuda.memory_stats``: peak allocated
  and reserved of the run so far, which the profile leaves as they are, so a run's own peak
  figures still cover every step; allocation retries), the memory that persists across steps
  split into parameters (trainable / frozen, by dtype), gradients and optimizer state, and, on
  a GPU, the step's own peak and the allocations alive there grouped by the first frame
  outside torch that made them (``torch.cuda.memory._record_memory_history``: the snapshot,
  replayed to its peak).

Each file is a few KB (``top`` rows each). A failure to summarise is written into the file
instead of stopping the run.
"""

from __future__ import annotations

import time
import traceback
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GiB = 2**30
MiB = 2**20
TOP = 15
SNAPSHOT_ENTRIES = 400_000  # allocator events recorded for the profiled step (an 8B step: ~10^5)


def _gib(n: float) -> str:
    """Bytes in GiB, or in MiB under 0.1 GiB (a tiny CPU model's state is not 0.00)."""
    return f"{n / GiB:,.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / MiB:,.1f} MiB"


def _short(name: str, width: int = 90) -> str:
    name = " ".join(name.split()).replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def kernel_table(events: Iterable[Any], top: int = TOP) -> str:
    """The top device kernels of a profile's events (``prof.events()``), summed by name. A
    ``record_function`` range shows on the device timeline too (a user annotation spanning the
    kernels it launched: Composer's ``Optimizer.step`` spans the whole step, its closure runs
    forward and backward): not a kernel, left out."""
    from torch.autograd import DeviceType

    device = {DeviceType.CUDA, getattr(DeviceType, "PrivateUse1", DeviceType.CUDA)}
    total, calls, n = defaultdict(float), defaultdict(int), 0
    for e in events:
        if e.device_type in device and not getattr(e, "is_user_annotation", False):
            total[e.name] += e.time_range.elapsed_us()
            calls[e.name] += 1
            n += 1
    whole = sum(total.values())
    lines = [f"{n:,} device kernels (and copies) in the step, {whole / 1e3:,.1f} ms of device "
             f"time in all; the top {min(top, len(total))} by device time:", "",
             "| kernel | calls | device ms | share |", "|---|---:|---:|---:|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {_short(name)} | {calls[name]:,} | {us / 1e3:,.2f} | "
                     f"{100 * us / max(whole, 1e-9):.1f}% |")
    return "\n".join(lines)


def cpu_op_table(averages: Iterable[Any], top: int = TOP) -> str:
    """The top operators by self CPU time (a CPU run: no device kernels)."""
    rows = sorted(averages, key=lambda a: -a.self_cpu_time_total)
    whole = sum(a.self_cpu_time_total for a in rows)
    lines = [f"CPU run: the top {min(top, len(rows))} operators by self CPU time of "
             f"{whole / 1e3:,.1f} ms in all:", "", "| operator | calls | self CPU ms | share |",
             "|---|---:|---:|---:|"]
    for a in rows[:top]:
        lines.append(f"| {_short(a.key)} | {a.count:,} | {a.self_cpu_time_total / 1e3:,.2f} | "
                     f"{100 * a.self_cpu_time_total / max(whole, 1e-9):.1f}% |")
    return "\n".join(lines)


def tensor_bytes(t: Any, device_type: str) -> int:
    """Bytes ``t`` holds on ``device_type``: a DTensor's local shard, a tensor subclass's inner
    tensors (FP8 rows and scales, NF4's parts), a plain tensor's elements."""
    import torch

    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return tensor_bytes(local, device_type)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name), device_type) for name in names)
    if not isinstance(t, torch.Tensor) or t.device.type != device_type:
        return 0
    return t.numel() * t.element_size()


def state_breakdown(model: Any, optimizer: Any, device_type: str) -> dict[str, int]:
    """What persists across steps on ``device_type``: parameters by role and dtype, gradients,
    optimizer state."""
    import torch

    out: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        role = "trainable" if p.requires_grad else "frozen"
        dtype = str(getattr(p, "dtype", "?")).replace("torch.", "")
        out[f"parameters, {role} ({dtype})"] += tensor_bytes(p, device_type)
        if p.grad is not None:
            out["gradients"] += tensor_bytes(p.grad, device_type)
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out["optimizer state"] += tensor_bytes(v, device_type)
    return dict(out)


def peak_sites(trace: list[dict], start_bytes: int = 0, top: int = TOP) -> tuple[int, list]:
    """Replay one device's allocator trace (``torch.cuda.memory._snapshot()['device_traces']
    [i]``, recorded from a moment ``start_bytes`` were allocated) to its peak: (the peak's
    bytes, [(site, bytes, blocks)] of the recorded allocations alive there, largest first).
    Bytes count from ``free_requested`` (where torch's allocated figure drops), so a block
    allocated before the recording and freed during it lowers the count. A site is the first
    frame outside torch (the model code, transformers, peft, foundryx, Composer) that made the
    allocation."""
    alive: dict[int, tuple[int, str]] = {}
    now = best = 0
    best_alive: dict[int, tuple[int, str]] = {}
    for ev in trace:
        action, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        if action == "alloc":
            alive[addr] = (size, _site(ev.get("frames") or []))
            now += size
            if now > best:
                best, best_alive = now, dict(alive)
        elif action in ("free_requested", "free"):
            now -= alive.pop(addr)[0] if addr in alive else size  # the latter: from before
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in best_alive.values():
        sites[site][0] += size
        sites[site][1] += 1
    ranked = sorted(((s, b, n) for s, (b, n) in sites.items()), key=lambda r: -r[1])
    return best + start_bytes, ranked[:top]


def _site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name or name.startswith("<") or "/contextlib.py" in name:
            continue
        short = "/".join(Path(name).parts[-2:])
        return f"{short}:{f.get('line')} {f.get('name')}"
    return "(torch internals / no Python frame)"


class StepProfile:
    """Profile one step of ``side`` on ``device`` ("cuda" or "cpu") into ``out``."""

    def __init__(self, out: Path | str, side: str, device: str, top: int = TOP):
        self.out, self.side, self.device, self.top = Path(out), side, device, top
        self.prof = None
        self.cuda = device == "cuda"

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.out.mkdir(parents=True, exist_ok=True)
        self.errors: list[str] = []
        if self.cuda:
            torch.cuda.synchronize()
            self.start_bytes = torch.cuda.memory_allocated()  # the peaks are not reset
            try:
                torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES,
                                                         stacks="python")
                self.recording = True
            except Exception as e:  # noqa: BLE001 - the rest of the profile still comes back
                self.recording = False
                self.errors.append(f"memory history not recorded: {type(e).__name__}: {e}")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self, model: Any, optimizer: Any) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        snapshot = None
        if self.cuda and self.recording:
            try:
                snapshot = torch.cuda.memory._snapshot()
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"snapshot failed: {type(e).__name__}: {e}")
            torch.cuda.memory._record_memory_history(enabled=None)
        head = (f"# {self.side}: one profiled step on {self.device} ({seconds:.2f} s wall with "
                "the profiler on; its tokens/s are left out of the means)\n\n")
        try:
            table = (kernel_table(self.prof.events(), self.top) if self.cuda
                     else cpu_op_table(self.prof.key_averages(), self.top))
        except Exception:  # noqa: BLE001
            table = "Summarising the profile failed:\n\n```text\n" + traceback.format_exc() + "```"
        (self.out / f"{self.side}-kernels.md").write_text(head + table + "\n")
        try:
            memory = self._memory(model, optimizer, snapshot)
        except Exception:  # noqa: BLE001
            memory = "Summarising memory failed:\n\n```text\n" + traceback.format_exc() + "```"
        (self.out / f"{self.side}-memory.md").write_text(head + memory + "\n")

    def _memory(self, model: Any, optimizer: Any, snapshot: dict | None) -> str:
        import torch

        lines: list[str] = []
        state = state_breakdown(model, optimizer, self.device)
        held = sum(state.values())
        if self.cuda:
            s = torch.cuda.memory_stats()
            lines += ["| allocator (torch.cuda.memory_stats) | size |", "|---|---:|",
                      f"| peak allocated, the run so far | "
                      f"{_gib(s.get('allocated_bytes.all.peak', 0))} |",
                      f"| allocated when the step began | {_gib(self.start_bytes)} |",
                      f"| allocated after the step | {_gib(s.get('allocated_bytes.all.current', 0))} |",
                      f"| peak reserved, the run so far | {_gib(s.get('reserved_bytes.all.peak', 0))} |",
                      f"| peak inactive split (fragmentation) | "
                      f"{_gib(s.get('inactive_split_bytes.all.peak', 0))} |",
                      f"| allocation retries / OOMs | {s.get('num_alloc_retries', 0)} / "
                      f"{s.get('num_ooms', 0)} |", ""]
        lines += [f"| what persists across steps (on {self.device}) | size |", "|---|---:|"]
        lines += [f"| {k} | {_gib(v)} |" for k, v in sorted(state.items(), key=lambda kv: -kv[1])]
        lines += [f"| all of these | {_gib(held)} |"]
        if snapshot is not None:
            index = torch.cuda.current_device()
            traces = snapshot.get("device_traces") or []
            trace = traces[index] if index < len(traces) else []
            peak, sites = peak_sites(trace, self.start_bytes, self.top)
            lines += ["", f"This step's peak allocated: {_gib(peak)} ({_gib(self.start_bytes)} "
                      f"allocated before the step, {_gib(peak - self.start_bytes)} during it). "
                      "Allocations of the step alive at its peak ("
                      f"{len(trace):,} allocator events), by the first frame outside torch that "
                      "made them:", "", "| site | size | blocks |", "|---|---:|---:|"]
            lines += [f"| {_short(site)} | {_gib(b)} | {n:,} |" for site, b, n in sites]
        lines += [f"\n{e}" for e in self.errors]
        return "\n".join(lines)


def composer_callback(out: Path | str, side: str, step: int):
    """A Composer callback that profiles batch ``step`` (1-based) of a run into ``out``."""
    import torch
    from composer.core import Callback

    class _Profile(Callback):
        def __init__(self) -> None:
            self.prof: StepProfile | None = None

        def batch_start(self, state, logger) -> None:
            if int(state.timestamp.batch) + 1 == step:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                self.prof = StepProfile(out, side, device)
                self.prof.start()

        def batch_end(self, state, logger) -> None:
            if self.prof is not None:
                prof, self.prof = self.prof, None
                prof.stop(state.model, state.optimizers[0] if state.optimizers else None)

    return _Profile()
