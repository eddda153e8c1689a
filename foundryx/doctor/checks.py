"""Known-bad combinations, each a rule over :class:`~foundryx.doctor.facts.Facts` that returns
findings with the fix. ``bad`` findings make ``foundryx doctor`` exit 1; ``note`` findings
say what was looked at and found fine (or only worth knowing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from foundryx.doctor.facts import Facts

# torch releases foundryx is tested on with Composer 0.32.1 (README, "Installing on a current
# stack"): 2.7.0 within Composer's pin, 2.15.0 outside it with Composer installed --no-deps.
TESTED_TORCH = {"2.7.0": "make install, constraints.txt",
                "2.15.0": "make install-modern, constraints-modern.txt; Composer --no-deps"}
MIN_SHM = 1 << 30  # below 1 GiB, dataloader workers die with "bus error" on ordinary batches
MIN_OPEN_FILES = 4096  # streaming keeps shard files and locks open per worker
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    level: str  # "bad", "warn" (worth fixing, not known to fail) or "note"
    what: str
    fix: str = ""

    @property
    def bad(self) -> bool:
        return self.level == "bad"


def _release(v: str) -> str:
    """``2.14.1+cu130`` -> ``2.14.1``."""
    return v.split("+")[0]


def composer_torch_pin(f: Facts) -> list[Finding]:
    if f.torch is None or f.composer is None:
        missing = "torch" if f.torch is None else "Composer (mosaicml)"
        return [Finding("bad", f"{missing} is not installed",
                        "install foundryx with its requirements: make install (or pip install -c "
                        "constraints.txt -e .)")]
    pin = f.composer_torch_pin or ""
    try:
        inside = Version(_release(f.torch)) in SpecifierSet(pin)
    except InvalidVersion:
        inside = False
    release = _release(f.torch)
    if inside:
        return [Finding("note", f"torch {f.torch} is within Composer {f.composer}'s pin "
                        f"(torch{pin})" + (f"; tested ({TESTED_TORCH[release]})"
                                           if release in TESTED_TORCH else ""))]
    if release in TESTED_TORCH:
        return [Finding("note", f"torch {f.torch} is outside Composer {f.composer}'s pin "
                        f"(torch{pin}): a known, tested combination ({TESTED_TORCH[release]}); "
                        "pip check reports the pin, which is expected")]
    tested = " or ".join(f"{v} ({how})" for v, how in TESTED_TORCH.items())
    return [Finding("bad", f"torch {f.torch} is outside Composer {f.composer}'s pin (torch{pin}) "
                    "and not a tested combination",
                    f"use a tested torch: {tested}; see README, 'Installing on a current torch'")]


def flash_attn_build(f: Facts) -> list[Finding]:
    if f.flash_attn is None:
        return [Finding("note", "flash-attn is not installed (optional: attn_impl flash needs it; "
                        "auto picks triton or torch attention without it)")]
    if f.flash_attn_error is None:
        return [Finding("note", f"flash-attn {f.flash_attn} imports")]
    other_torch = "undefined symbol" in f.flash_attn_error
    what = (f"flash-attn {f.flash_attn} was built for another torch than the installed "
            f"{f.torch}" if other_torch else f"flash-attn {f.flash_attn} does not import")
    return [Finding("bad", f"{what}: {f.flash_attn_error}",
                    f"rebuild it against this torch: pip install --no-build-isolation "
                    f"--no-cache-dir --force-reinstall flash-attn=={f.flash_attn} (or uninstall "
                    "it: pip uninstall flash-attn)")]


def gpu_wanted(f: Facts) -> list[Finding]:
    if f.config_device != "gpu" or f.gpus:
        return []
    why = ("torch is a CPU-only build (torch.version.cuda and .hip are None)"
           if f.cuda is None and f.rocm is None else "torch sees no GPU")
    return [Finding("bad", f"{f.config} sets device: gpu, but {why}",
                    "install the CUDA or ROCm build of torch, check nvidia-smi / rocm-smi and "
                    "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or set device: cpu")]


def shm_size(f: Facts) -> list[Finding]:
    if f.shm_bytes is None:
        return [Finding("note", "no /dev/shm: dataloader workers share memory another way")]
    size = f"/dev/shm is {f.shm_bytes / GIB:.2f} GiB"
    if f.shm_bytes >= MIN_SHM:
        return [Finding("note", size)]
    if f.config is not None and f.config_num_workers == 0:
        return [Finding("note", f"{size} (small, but {f.config} uses no dataloader workers)")]
    users = (f"{f.config} uses {f.config_num_workers} dataloader workers" if f.config
             else "dataloader workers (num_workers > 0) need it")
    return [Finding("bad", f"{size}, below {MIN_SHM / GIB:.0f} GiB: {users}; they fail with "
                    "'bus error' or a killed worker", "give the container more: docker run "
                    "--shm-size=16g (or --ipc=host), or set num_workers: 0 in the loaders")]


def open_files(f: Facts) -> list[Finding]:
    if f.open_files is None:
        return []
    soft, hard = f.open_files
    if soft >= MIN_OPEN_FILES:
        return [Finding("note", f"open-file limit {soft} (hard {hard})")]
    return [Finding("warn", f"open-file limit {soft} is low for streaming datasets with many "
                    f"shards", f"ulimit -n {min(hard, 65536)} before training")]


def save_folder_space(f: Facts) -> list[Finding]:
    if f.save_folder is None:
        return []
    if f.save_folder_free_bytes is None:
        return [Finding("note", f"save folder {f.save_folder}: object storage, free space unknown")]
    return [Finding("note", f"save folder {f.save_folder}: "
                    f"{f.save_folder_free_bytes / GIB:.1f} GiB free")]


RULES: tuple[Callable[[Facts], list[Finding]], ...] = (
    composer_torch_pin, flash_attn_build, gpu_wanted, shm_size, open_files, save_folder_space)


def check(facts: Facts) -> list[Finding]:
    return [finding for rule in RULES for finding in rule(facts)]
