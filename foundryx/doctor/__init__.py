"""``foundryx doctor [CONFIG] [--save-folder PATH] [--json]``: the versions, devices and limits
a run depends on, and the known-bad combinations among them with their fixes. Exit code 0 when
nothing known-bad is found, 1 otherwise (see docs/operations.md, "Doctor")."""

from __future__ import annotations

import dataclasses
import json

from foundryx.doctor.checks import GIB, Finding, check
from foundryx.doctor.facts import Facts, environment, probe

__all__ = ["Facts", "Finding", "check", "config_facts", "environment", "probe", "render"]


def config_facts(facts: Facts, config: str, cfg) -> Facts:
    """``facts`` with what the run config ``cfg`` (a TrainConfig of ``config``) asks for."""
    loaders = [s for s in (cfg.train_loader, cfg.eval_loader) if isinstance(s, dict)]
    workers = max([int(s.get("num_workers") or 0) for s in loaders], default=0)
    return dataclasses.replace(facts, config=config, config_device=cfg.device,
                               config_num_workers=workers)


def _rows(f: Facts) -> list[tuple[str, str]]:
    def v(x) -> str:
        return "not installed" if x is None else str(x)

    rows = [("python", f.python), ("torch", v(f.torch)),
            ("CUDA" if not f.rocm else "ROCm", v(f.rocm or f.cuda) if f.torch else "-"),
            ("triton", v(f.triton)), ("flash-attn", v(f.flash_attn)),
            (f.nccl_name, v(f.nccl) if f.gpus else "- (no GPU)"),
            ("composer", v(f.composer) + (f" (requires torch{f.composer_torch_pin})"
                                          if f.composer_torch_pin else "")),
            ("transformers", v(f.transformers)), ("foundryx", v(f.foundryx))]
    for i, g in enumerate(f.gpus):
        peak = (f"{g.table_key}: {g.peak_bf16_tflops:g} TFLOP/s bf16 dense" if g.peak_bf16_tflops
                else "not in the device table (foundryx/runtime/devices.py): no MFU")
        rows.append((f"gpu {i}", f"{g.name}, {g.memory_gib:g} GiB; peak {peak}"))
    if not f.gpus:
        rows.append(("gpus", "none"))
    rows.append(("/dev/shm", "absent" if f.shm_bytes is None else f"{f.shm_bytes / GIB:.2f} GiB"))
    if f.open_files:
        rows.append(("open files", f"{f.open_files[0]} (hard {f.open_files[1]})"))
    if f.save_folder:
        free = ("unknown (object storage)" if f.save_folder_free_bytes is None
                else f"{f.save_folder_free_bytes / GIB:.1f} GiB free")
        rows.append(("save folder", f"{f.save_folder}: {free}"))
    return rows


def render(facts: Facts, findings: list[Finding], as_json: bool = False) -> str:
    if as_json:
        return json.dumps({"facts": dataclasses.asdict(facts),
                           "findings": [dataclasses.asdict(x) for x in findings],
                           "ok": not any(x.bad for x in findings)}, indent=2)
    rows = _rows(facts)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {val}" for k, val in rows] + [""]
    bad = [x for x in findings if x.bad]
    for x in findings:
        lines.append(f"{ {'bad': 'BAD ', 'warn': 'warn'}.get(x.level, 'ok  ')}  {x.what}")
        if x.fix:
            lines.append(f"        fix: {x.fix}")
    lines.append("")
    lines.append(f"{len(bad)} known-bad combination{'s' if len(bad) != 1 else ''} found"
                 if bad else "nothing known-bad found")
    return "\n".join(lines)
