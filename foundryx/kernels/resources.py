"""GPU targets foundryx compiles its kernels for, and what a compiled kernel uses of one.

Limits per target (the numbers the hardware enforces at launch):

- sm80 (A100): 163 KB shared memory per block (164 KB per SM, 1 KB reserved per block),
  65,536 32-bit registers and 64 resident warps per SM.
- sm90 (H100/H200): 227 KB per block (228 KB per SM), 65,536 registers, 64 warps per SM.
- gfx90a (MI200) and gfx942 (MI300X/MI325X): 64 KB LDS per workgroup and per CU, 512 VGPRs per
  lane per SIMD (architected + accumulation registers, allocated in blocks of 8), at most 8
  waves per SIMD, 4 SIMDs per CU.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Target:
    name: str
    backend: str  # cuda or hip
    arch: int | str
    warp_size: int
    family: str  # the tuning table's family (kernels/tuning.py)
    smem_limit: int  # bytes per block / workgroup
    smem_per_sm: int  # bytes per SM / CU
    max_warps: int  # resident warps per SM, or waves per CU

    def gpu_target(self, gpu_target_cls: Any) -> Any:
        return gpu_target_cls(self.backend, self.arch, self.warp_size)


KB = 1024
TARGETS: dict[str, Target] = {
    "sm80": Target("sm80", "cuda", 80, 32, "sm80", 163 * KB, 164 * KB, 64),
    "sm90": Target("sm90", "cuda", 90, 32, "sm90", 227 * KB, 228 * KB, 64),
    "gfx90a": Target("gfx90a", "hip", "gfx90a", 64, "cdna2", 64 * KB, 64 * KB, 32),
    "gfx942": Target("gfx942", "hip", "gfx942", 64, "cdna3", 64 * KB, 64 * KB, 32),
}
NV_REGS_PER_SM, NV_REG_UNIT, NV_MAX_BLOCKS, NV_SMEM_RESERVED = 65536, 256, 32, 1024
AMD_VGPRS, AMD_VGPR_UNIT, AMD_WAVES_PER_SIMD, AMD_SIMDS = 512, 8, 8, 4


@dataclass
class Resources:
    shared: int  # bytes of shared memory / LDS per block
    registers: int  # per thread (NVIDIA) or VGPRs per lane (AMD)
    spills: int  # bytes spilled to local memory (NVIDIA: stores + loads) or VGPRs spilled to
    #              scratch (AMD; SGPR spills go to VGPR lanes, not memory, and are not counted)
    occupancy: int  # resident warps per SM / waves per CU
    max_occupancy: int
    sgprs: int | None = None
    backend: str = "cuda"

    @property
    def registers_text(self) -> str:
        return str(self.registers) if self.sgprs is None else f"v{self.registers} s{self.sgprs}"

    @property
    def spills_text(self) -> str:
        return f"{self.spills} B" if self.backend == "cuda" else f"{self.spills} VGPRs"

    @property
    def occupancy_text(self) -> str:
        unit = "warps/SM" if self.backend == "cuda" else "waves/CU"
        return f"{self.occupancy}/{self.max_occupancy} {unit}"


def measure(kernel: Any, target: Target) -> Resources:
    """Shared memory, registers, spills and occupancy of a kernel compiled for ``target``."""
    warps = kernel.metadata.num_warps
    shared = kernel.metadata.shared
    if target.backend == "cuda":
        regs, spills = _ptxas_usage(kernel.asm["ptx"], target.arch)
        per_warp = math.ceil(regs * target.warp_size / NV_REG_UNIT) * NV_REG_UNIT
        blocks = min(NV_MAX_BLOCKS, target.max_warps // warps,
                     NV_REGS_PER_SM // (per_warp * warps) if per_warp else NV_MAX_BLOCKS)
        if shared:
            blocks = min(blocks, target.smem_per_sm // (shared + NV_SMEM_RESERVED))
        return Resources(shared, regs, spills, blocks * warps, target.max_warps)
    amd = kernel.asm["amdgcn"]
    vgprs, sgprs = _meta(amd, "vgpr_count"), _meta(amd, "sgpr_count")
    spills = _meta(amd, "vgpr_spill_count")
    alloc = max(AMD_VGPR_UNIT, math.ceil(vgprs / AMD_VGPR_UNIT) * AMD_VGPR_UNIT)
    per_simd = min(AMD_WAVES_PER_SIMD, AMD_VGPRS // alloc)
    waves = per_simd * AMD_SIMDS
    if shared:  # whole workgroups fit in the CU's LDS
        waves = min(waves, (target.smem_per_sm // shared) * warps)
    return Resources(shared, vgprs, spills, waves, target.max_warps, sgprs=sgprs, backend="hip")


def _meta(amdgcn: str, key: str) -> int:
    found = re.search(rf"\.{key}:\s+(\d+)", amdgcn)
    return int(found.group(1)) if found else 0


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill bytes) from ``ptxas -v`` (the ptxas in the triton wheel)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    tool = get_ptxas(arch)  # Triton >= 3.4: an NvidiaTool (.path, .version); before: a pair
    ptxas = tool.path if hasattr(tool, "path") else tool[0]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(src),
                              "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True)
    log = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return int(regs.group(1)) if regs else 0, sum(spill)


def find_lld() -> tuple[str | None, str]:
    """An ``ld.lld`` that Triton's AMD backend can link with, and where it came from.

    In order: ``TRITON_HIP_LLD_PATH``; ROCm's ``/opt/rocm/llvm/bin/ld.lld``; the ``ld.lld`` of
    the ``ziglang`` wheel (``pip install ziglang``), through a small wrapper that drops the
    ``-flavor gnu`` arguments Triton passes. Debian's ``lld`` (LLVM 14) is not picked: it
    cannot link Triton 3's code objects ("unknown abi version").
    """
    env = os.environ.get("TRITON_HIP_LLD_PATH")
    if env and Path(env).is_file():
        return env, "TRITON_HIP_LLD_PATH"
    rocm = Path("/opt/rocm/llvm/bin/ld.lld")
    if rocm.is_file():
        return str(rocm), "ROCm"
    try:
        import ziglang
    except ImportError:
        return None, ("no ld.lld for the AMD backend: set TRITON_HIP_LLD_PATH, install ROCm, or "
                      "`pip install ziglang`")
    zig = Path(ziglang.__file__).parent / "zig"
    wrapper = Path(tempfile.gettempdir()) / f"foundryx-zig-ld.lld-{os.getuid()}"
    script = (f'#!/bin/sh\n# Triton passes "-flavor gnu"; zig\'s ld.lld is the gnu flavour.\n'
              f'if [ "$1" = "-flavor" ]; then shift 2; fi\nexec "{zig}" ld.lld "$@"\n')
    if not wrapper.is_file() or wrapper.read_text() != script:
        tmp = wrapper.with_suffix(f".{os.getpid()}")
        tmp.write_text(script)
        tmp.chmod(0o755)
        tmp.replace(wrapper)
    return str(wrapper), f"ziglang {shutil.which('zig') or zig}"
