"""Every Triton kernel compiles ahead of time for sm80, sm90, gfx90a and gfx942 with the
tuning table's configurations, within each target's shared memory, without spills."""

from __future__ import annotations

import os

import pytest

from foundryx.kernels import tuning
from foundryx.kernels.resources import TARGETS, Resources, find_lld, measure
from foundryx.kernels.targets import (
    FEATURES,
    HEAD_DIMS,
    Job,
    Result,
    compile_job_pool,
    jobs,
    main,
    table,
)

pytest.importorskip("triton")
LLD, LLD_WHY = find_lld()
NVIDIA = ["sm80", "sm90"]
AMD = ["gfx90a", "gfx942"]


def check(targets: list[str], which: str) -> None:
    """The rows fit on both CI legs' Tritons (3.3 with torch 2.7, 3.8 with torch 2.14): a spill
    or an overflow on either fails, with the table of the rows that do not fit."""
    results, skipped = compile_job_pool(jobs(targets, which), progress=False)
    assert not skipped
    assert len(results) == len(jobs(targets, which))
    bad = [r for r in results if r.problems]
    assert not bad, "\n" + table(bad)


def test_every_kernel_fits_nvidia():
    check(NVIDIA, "small")


@pytest.mark.skipif(LLD is None, reason=LLD_WHY or "")
def test_every_kernel_fits_amd():
    check(AMD, "small")


@pytest.mark.slow
@pytest.mark.skipif(LLD is None, reason=LLD_WHY or "")
@pytest.mark.skipif(os.environ.get("FOUNDRYX_KERNELS_FULL") != "1",
                    reason="840 compilations (20+ min on 2 cores): set FOUNDRYX_KERNELS_FULL=1, "
                           "or run python -m foundryx.kernels.targets --set full")
def test_every_feature_set_and_dtype_fits():
    check(list(TARGETS), "full")


def test_jobs_cover_the_table():
    """Each target compiles its own family's rows, for every kernel and head-dim bucket."""
    small = jobs(["sm90", "gfx942"], "small")
    for target in ("sm90", "gfx942"):
        family = TARGETS[target].family
        for kernel in tuning.KERNELS:
            got = {j.head_dim: j.config for j in small if (j.target, j.kernel) == (target, kernel)}
            assert got == {hd: tuning.TABLE[family][kernel][i] for i, hd in enumerate(HEAD_DIMS)}
    assert sum(j.kernel == "preprocess" for j in small) == 2 * len(HEAD_DIMS)
    # the FP8 row kernel where FP8 GEMMs run, with and without dy's column scales
    assert {(j.target, j.head_dim, j.features) for j in small if j.kernel == "fp8_rows"} == {
        (t, k, f) for t in ("sm90", "gfx942") for k in (1024, 4096) for f in ("x", "x*col")}
    assert not any(j.kernel == "fp8_rows" for j in jobs(["sm80", "gfx90a"], "full"))
    # the fused RMS norm (rows of 4096 and 8192; backward with and without dweight) and
    # SwiGLU on every target
    assert {(j.kernel, j.head_dim, j.features) for j in small if j.target == "gfx942"
            and j.kernel.startswith(("rms_norm", "swiglu"))} == {
        ("rms_norm_fwd", 4096, "-"), ("rms_norm_fwd", 8192, "-"), ("swiglu_fwd", 0, "-"),
        ("swiglu_bwd", 0, "-")} | {("rms_norm_bwd", k, f) for k in (4096, 8192)
                                   for f in ("dx", "dx+dw")}
    assert {(j.kernel, j.head_dim) for j in small if j.target == "sm90"
            and j.kernel.startswith("rope")} == {(k, hd) for k in ("rope_fwd", "rope_bwd")
                                                 for hd in HEAD_DIMS}
    # the NF4 decoding kernel on every target, from bf16 and float32 NF4 tensors
    assert {(j.target, j.dtype, j.features) for j in small if j.kernel == "nf4_dequant"} == {
        (t, "bf16", f) for t in ("sm90", "gfx942") for f in ("nf4 bf16", "nf4 fp32")}
    flash = set(tuning.KERNELS) | {"preprocess"}
    assert (sum(j.kernel in flash for j in jobs(["sm80"], "full"))
            > sum(j.kernel in flash for j in jobs(["sm80"], "small")) * 10)


def test_a_spill_is_reported_and_fails_the_command(capsys):
    """A configuration far too large for the registers (128x64 tiles, 2 warps, head dim 128)."""
    job = Job("sm90", "fwd", 128, "bf16", "all", tuning.KernelConfig(128, 64, 2, 1))
    [result], _ = compile_job_pool([job], progress=False)
    assert result.ok and result.resources.spills > 0
    assert any(p.startswith("spills ") for p in result.problems)
    assert main(["--targets", "nosuch"]) == 2
    assert "unknown target(s) nosuch" in capsys.readouterr().err


def test_one_row_of_the_table_can_be_checked_alone(monkeypatch, capsys):
    """``--kernels`` and ``--head-dims`` compile only those jobs of the set (a stand-in
    compiler counts them); unknown names exit 2 with the choices."""
    from foundryx.kernels import targets

    seen: list[Job] = []

    def compile_stand_in(todo, workers=None, progress=True):
        seen.extend(todo)
        return [Result(j, True, resources=Resources(1024, 128, 0, 16, 64)) for j in todo], []

    monkeypatch.setattr(targets, "compile_job_pool", compile_stand_in)
    assert main(["--targets", "sm90", "--set", "full", "--kernels", "bwd_atomic",
                 "--head-dims", "64"]) == 0
    assert {(j.target, j.kernel, j.head_dim) for j in seen} == {("sm90", "bwd_atomic", 64)}
    assert len(seen) == 2 * len(FEATURES)  # bf16 and fp16, every feature set
    assert all(j.config == tuning.TABLE["sm90"]["bwd_atomic"][0] for j in seen)
    capsys.readouterr()
    assert main(["--kernels", "bwd"]) == 2
    assert "unknown kernel(s) bwd; choose from preprocess, fwd" in capsys.readouterr().err
    assert main(["--head-dims", "sixty-four"]) == 2


def test_search_full_checks_every_dtype(monkeypatch):
    """``search --full`` checks the ranked candidates with fp16 as well as bf16 and drops one
    that spills with a single dtype and feature set (no compilation: a stand-in compiler)."""
    from foundryx.kernels import search

    best, next_ = tuning.KernelConfig(128, 64, 8, 3), tuning.KernelConfig(128, 32, 8, 3)
    fits, spills = Resources(1024, 128, 0, 16, 64), Resources(1024, 255, 8, 8, 64)
    ranked = [Result(Job("sm90", "fwd", 64, "bf16", "all", c), True, resources=fits)
              for c in (best, next_)]
    seen: list[Job] = []

    def compile_stand_in(todo, workers=None, progress=True):
        seen.extend(todo)
        bad = [(j.config, j.dtype, j.features) == (best, "fp16", "window") for j in todo]
        return [Result(j, True, resources=spills if b else fits) for j, b in zip(todo, bad)], []

    monkeypatch.setattr(search, "compile_job_pool", compile_stand_in)
    group = ("sm90", "fwd", 64)
    assert search.verified([group], ranked, 2)[group].job.config == best  # bf16 only
    assert {j.dtype for j in seen} == {"bf16"} and len(seen) == 2 * (len(FEATURES) - 1)
    seen.clear()
    assert search.verified([group], ranked, 2, full=True)[group].job.config == next_
    assert len(seen) == 2 * (2 * len(FEATURES) - 1)


class _Meta:
    def __init__(self, warps, shared):
        self.num_warps, self.shared = warps, shared


class _Kernel:
    def __init__(self, warps, shared, asm):
        self.metadata, self.asm = _Meta(warps, shared), asm


def test_amd_occupancy_from_vgprs_and_lds():
    amdgcn = ".vgpr_count: 130\n.sgpr_count: 90\n.vgpr_spill_count: 0\n.sgpr_spill_count: 4\n"
    r = measure(_Kernel(4, 20 * 1024, {"amdgcn": amdgcn}), TARGETS["gfx942"])
    # 130 VGPRs -> 136 allocated -> 3 waves per SIMD -> 12 per CU; LDS allows 3 groups x 4 waves
    assert (r.registers, r.sgprs, r.spills, r.occupancy) == (130, 90, 0, 12)
    r = measure(_Kernel(8, 40 * 1024, {"amdgcn": amdgcn}), TARGETS["gfx942"])
    assert r.occupancy == 8  # one 8-wave workgroup fits in 64 KB of LDS
    assert isinstance(r, Resources) and r.occupancy_text == "8/32 waves/CU"
