"""What ``foundryx doctor`` looks at, probed once into a :class:`Facts` (tests build their own
Facts instead: every known-bad combination is a set of facts)."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from foundryx.runtime.devices import find_device, peak_flops


@dataclass
class GPU:
    name: str
    memory_gib: float
    table_key: str | None = None  # the device table's entry (foundryx/runtime/devices.py), if any
    peak_bf16_tflops: float | None = None


@dataclass
class Facts:
    python: str
    torch: str | None = None
    cuda: str | None = None  # torch.version.cuda: the CUDA torch was built with
    rocm: str | None = None  # torch.version.hip
    triton: str | None = None
    flash_attn: str | None = None  # the installed distribution's version
    flash_attn_error: str | None = None  # importing it failed: the first line of the error
    nccl: str | None = None  # NCCL, or RCCL on ROCm, as torch reports it
    composer: str | None = None
    composer_torch_pin: str | None = None  # Composer's requirement on torch, e.g. "<2.7.1,>=2.4.0"
    transformers: str | None = None
    foundryx: str | None = None
    gpus: list[GPU] = field(default_factory=list)
    shm_bytes: int | None = None  # size of /dev/shm (None: no /dev/shm)
    open_files: tuple[int, int] | None = None  # soft, hard
    save_folder: str | None = None
    save_folder_free_bytes: int | None = None
    # from a run config, when one is given
    config: str | None = None
    config_device: str | None = None  # "gpu", "cpu" or None (auto)
    config_num_workers: int = 0  # the largest num_workers of its loaders

    @property
    def nccl_name(self) -> str:
        return "RCCL" if self.rocm else "NCCL"


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def requirement_on(dist: str, target: str) -> str | None:
    """The version specifier ``dist`` declares on ``target`` (e.g. Composer's on torch)."""
    from packaging.requirements import Requirement

    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return None
    for r in map(Requirement, reqs):
        if r.name == target and not r.marker:
            return str(r.specifier)
    return None


def _flash_attn_error() -> str | None:
    """Import flash-attn's compiled extension in a fresh process: an extension built against
    another torch fails there with an undefined symbol (and may crash: hence the process)."""
    code = "import flash_attn, flash_attn_2_cuda"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not import it: {e}"
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"python exited with {r.returncode} importing it"


def _gpus(torch) -> list[GPU]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpu = GPU(props.name, round(props.total_memory / 2**30, 1))
        entry = find_device(props.name)  # the device table the speed monitor's MFU uses
        gpu.table_key = entry.key if entry else None
        peak = peak_flops(props.name, "bf16", warn=False)
        gpu.peak_bf16_tflops = peak / 1e12 if peak else None
        gpus.append(gpu)
    return gpus


def probe(save_folder: str | None = None) -> Facts:
    """The facts of this machine and Python environment."""
    facts = Facts(python=platform.python_version())
    for attr, dist in (("torch", "torch"), ("triton", "triton"), ("flash_attn", "flash-attn"),
                       ("composer", "mosaicml"), ("transformers", "transformers"),
                       ("foundryx", "foundryx")):
        setattr(facts, attr, version(dist))
    facts.triton = facts.triton or version("pytorch-triton-rocm")
    facts.composer_torch_pin = requirement_on("mosaicml", "torch")
    if facts.torch is not None:
        import torch

        facts.cuda, facts.rocm = torch.version.cuda, getattr(torch.version, "hip", None)
        facts.gpus = _gpus(torch)
        if facts.gpus and torch.distributed.is_nccl_available():
            v = torch.cuda.nccl.version()
            facts.nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    if facts.flash_attn is not None:
        facts.flash_attn_error = _flash_attn_error()
    if os.path.isdir("/dev/shm"):
        facts.shm_bytes = shutil.disk_usage("/dev/shm").total
    facts.open_files = resource.getrlimit(resource.RLIMIT_NOFILE)
    if save_folder is not None:
        facts.save_folder = save_folder
        facts.save_folder_free_bytes = _free_bytes(save_folder)
    return facts


def _free_bytes(folder: str) -> int | None:
    """Free bytes where ``folder`` is or would be made (its nearest existing parent); None for
    object storage (s3://...)."""
    if "://" in folder:
        return None
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def environment() -> dict[str, str]:
    """The short environment a run records in run.json (what ``foundryx report`` shows): cheap
    to take, no imports beyond what a run has loaded."""
    import torch

    env = {"host": platform.node(), "python": platform.python_version(),
           "platform": platform.platform(), "torch": torch.__version__,
           "cuda" if not getattr(torch.version, "hip", None) else "rocm":
               str(torch.version.cuda or getattr(torch.version, "hip", None)),
           "composer": str(version("mosaicml")), "transformers": str(version("transformers")),
           "foundryx": str(version("foundryx"))}
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpus"] = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        env["gpus"] = "none"
    env["cpus"] = str(os.cpu_count())
    return env
