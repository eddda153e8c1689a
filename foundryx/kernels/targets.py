"""Compile every Triton kernel foundryx ships for real GPU targets, on any machine (no GPU).

``python -m foundryx.kernels.targets [--targets sm80,sm90,gfx90a,gfx942] [--set small|full]
[--kernels bwd_atomic,...] [--head-dims 64,...] [--json]`` compiles the FlashAttention kernels
(forward, backward dK/dV, backward dQ, the one-kernel backward with atomic dQ and the
preprocess kernel) with each tuning configuration of ``kernels/tuning.py`` that the target's
family uses, for the feature combinations users hit, the FP8 row quantization kernel
(``kernels/fp8_rows.py``) on the targets with FP8 tensor cores (sm90, gfx942), and the fused
RMS norm, SwiGLU and RoPE kernels (``kernels/rms_norm.py``, ``swiglu.py``, ``rope.py``) and the
NF4 decoding kernel (``kernels/nf4_dequant.py``) on every target, ahead of time (``triton.compile`` with a ``GPUTarget``): NVIDIA to PTX and a
cubin with the ``ptxas`` inside the triton wheel, AMD to AMDGCN and an hsaco with an ``ld.lld`` (see :func:`find_lld`). It prints, per compilation, the
shared memory (LDS on AMD) against the target's limit, registers, spills and the occupancy
those allow, and exits 1 when anything fails to compile, exceeds the limit or spills.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from foundryx.kernels import tuning
from foundryx.kernels.resources import TARGETS, Resources, find_lld, measure

HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
# Feature sets: which constexpr flags are on. GQA is the runtime argument GROUP (no recompile).
FEATURES: dict[str, dict[str, bool]] = {
    "causal": {"CAUSAL": True},
    "full": {},
    "packed": {"CAUSAL": True, "HAS_DOCS": True},
    "alibi": {"CAUSAL": True, "HAS_ALIBI": True},
    "window": {"CAUSAL": True, "HAS_WINDOW": True},
    "padded": {"HAS_KPM": True},
    "all": {"CAUSAL": True, "HAS_DOCS": True, "HAS_WINDOW": True, "HAS_KPM": True,
            "HAS_ALIBI": True},
}
SETS = {  # (dtypes, feature sets); every head dim and kernel in both
    "small": (("bf16",), ("all",)),
    "full": (DTYPES, tuple(FEATURES)),
}
FLAGS = ("CAUSAL", "HAS_DOCS", "HAS_WINDOW", "HAS_KPM", "HAS_ALIBI")
PREPROCESS_ROWS = 64  # the preprocess kernel's BLOCK_M (flash_attention._backward)
# The FP8 row kernel: where FP8 GEMMs run (fp8_gemm.choose), in the target's float8 (Triton's
# name, torch's), for rows of 1024 (one block of 1024, 4 warps) and 4096+ (blocks of 4096, 8
# warps).
FP8_TARGETS = {"sm90": ("fp8e4nv", "float8_e4m3fn"), "gfx942": ("fp8e4b8", "float8_e4m3fnuz")}
FP8_ROWS = (1024, 4096)
# The fused RMS norm (forward; backward with dx, and with dx and dweight) for rows of 4096
# (Llama-3.1-8B, 8 warps) and 8192 (70B, 16 warps), and SwiGLU's product (elementwise, one
# configuration), on every target
NORM_ROWS = (4096, 8192)
NORM_KERNELS = {"rms_norm_fwd": ("-",), "rms_norm_bwd": ("dx", "dx+dw")}
ELEMENTWISE = ("swiglu_fwd", "swiglu_bwd")
ROPE_KERNELS = ("rope_fwd", "rope_bwd")  # at each head dim
# The NF4 decoding kernel (one configuration), writing the job's dtype, from NF4 tensors of
# each dtype foundryx builds (bfloat16 from a bf16 checkpoint, float32)
NF4_DTYPES = {"nf4 bf16": "bf16", "nf4 fp32": "fp32"}
KERNEL_NAMES = ("preprocess", *tuning.KERNELS, "fp8_rows", *NORM_KERNELS, *ELEMENTWISE,
                *ROPE_KERNELS, "nf4_dequant")


@dataclass(frozen=True)
class Job:
    target: str
    kernel: str  # fwd, bwd_dkdv, bwd_dq, bwd_atomic, preprocess, fp8_rows (head_dim: its rows)
    head_dim: int
    dtype: str
    features: str
    config: tuning.KernelConfig | None  # None: the preprocess kernel (fixed rows)


@dataclass
class Result:
    job: Job
    ok: bool
    error: str = ""
    resources: Resources | None = None
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        if not self.ok:
            return ["does not compile"]
        r, limit = self.resources, TARGETS[self.job.target].smem_limit
        out = []
        if r.shared > limit:
            out.append(f"shared memory {r.shared} B > {limit} B")
        if r.spills:
            out.append(f"spills {r.spills_text}")
        return out


def jobs(targets: list[str], which: str) -> list[Job]:
    dtypes, features = SETS[which]
    out = []
    for t in targets:
        family = TARGETS[t].family
        for hd in HEAD_DIMS:
            bucket = HEAD_DIMS.index(hd)
            for dtype in dtypes:
                out.append(Job(t, "preprocess", hd, dtype, "-", None))
                for kernel in tuning.KERNELS:
                    cfg = tuning.TABLE[family][kernel][bucket]
                    out += [Job(t, kernel, hd, dtype, f, cfg) for f in features]
        if t in FP8_TARGETS:  # head_dim: the row length; features: with dy's column scales
            for k in FP8_ROWS:
                for dtype in dtypes:
                    out += [Job(t, "fp8_rows", k, dtype, f, None) for f in ("x", "x*col")]
        for dtype in dtypes:  # head_dim: the norm's row length (0: elementwise)
            out += [Job(t, kernel, k, dtype, f, None) for kernel, feats in NORM_KERNELS.items()
                    for k in NORM_ROWS for f in feats]
            out += [Job(t, kernel, 0, dtype, "-", None) for kernel in ELEMENTWISE]
            out += [Job(t, kernel, hd, dtype, "-", None) for kernel in ROPE_KERNELS
                    for hd in HEAD_DIMS]
            out += [Job(t, "nf4_dequant", 0, dtype, f, None) for f in NF4_DTYPES]
    return out


def _signature(fn, kinds: dict[str, str]) -> tuple[dict[str, str], dict]:  # noqa: ANN001
    """Argument types of a kernel (``kinds`` by parameter name; any other is an ``i32``) and
    divisibility hints as a real launch gives them (pointers and strides divisible by 16)."""
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        sig[p.name] = "constexpr" if p.is_constexpr else kinds.get(p.name, "i32")
        if sig[p.name].startswith("*") or p.name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _flash_kinds(dtype: str, fp32_dq: bool = False) -> dict[str, str]:
    """The FlashAttention kernels' argument types: data pointers in ``dtype``; DQ float32
    where ``fp32_dq`` (the atomic backward's sum)."""
    data = {"Q", "K", "V", "Out", "DO", "DK", "DV", "DQ"} - ({"DQ"} if fp32_dq else set())
    return {"LSE": "*fp32", "DELTA": "*fp32", "SLOPES": "*fp32", "DOC_START": "*i32",
            "DOC_END": "*i32", "KPM": "*i8", "qk_scale": "fp32", "sm_scale": "fp32",
            "DQ": "*fp32", **{name: f"*{dtype}" for name in data}}


def compile_job(job: Job, lld: str | None) -> Result:
    """Compile one job and measure it (runs in a worker process)."""
    # Imported here, in the spawned worker, so that TRITON_INTERPRET is already cleared
    # (_compiler_env) when Triton and the kernels' @triton.jit are first loaded.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from foundryx.kernels import (  # Triton's @jit: after the env
        flash_bwd,
        flash_fwd,
        fp8_rows,
        nf4_dequant,
        rms_norm,
        rope,
        swiglu,
    )

    if lld:
        os.environ["TRITON_HIP_LLD_PATH"] = lld
    target = TARGETS[job.target]
    if job.kernel == "fp8_rows":
        return _compile(job, *_fp8_rows_source(job, fp8_rows), target, GPUTarget, ASTSource)
    if job.kernel in NORM_KERNELS or job.kernel in ELEMENTWISE:
        return _compile(job, *_fused_source(job, rms_norm, swiglu), target, GPUTarget, ASTSource)
    if job.kernel == "nf4_dequant":
        return _compile(job, *_nf4_source(job, nf4_dequant), target, GPUTarget, ASTSource)
    if job.kernel in ROPE_KERNELS:
        fn = rope.rope_kernel
        block, warps = rope.launch_config(job.head_dim)
        sig, attrs = _signature(fn, {n: f"*{job.dtype}" for n in ("Q", "K", "QO", "KO", "COS",
                                                                  "SIN")})
        return _compile(job, fn, sig, {"BACKWARD": job.kernel == "rope_bwd", "BLOCK": block},
                        attrs, {"num_warps": warps}, target, GPUTarget, ASTSource)
    block_d = max(16, triton.next_power_of_2(job.head_dim))
    consts: dict = {"HEAD_DIM": job.head_dim, "BLOCK_D": block_d}
    if job.kernel == "preprocess":
        fn, options = flash_bwd.flash_bwd_preprocess, {"num_warps": 4}
        consts["BLOCK_M"] = PREPROCESS_ROWS
    else:
        fn = {"fwd": flash_fwd.flash_fwd_kernel, "bwd_dkdv": flash_bwd.flash_bwd_dkdv_kernel,
              "bwd_dq": flash_bwd.flash_bwd_dq_kernel,
              "bwd_atomic": flash_bwd.flash_bwd_atomic_kernel}[job.kernel]
        cfg = job.config
        options = cfg.launch_options()
        consts.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=None,
                      **{f: FEATURES[job.features].get(f, False) for f in FLAGS})
    sig, attrs = _signature(fn, _flash_kinds(job.dtype, fp32_dq=job.kernel == "bwd_atomic"))
    return _compile(job, fn, sig, consts, attrs, options, target, GPUTarget, ASTSource)


def _fp8_rows_source(job: Job, fp8_rows) -> tuple:  # noqa: ANN001  (the module, in the worker)
    """The FP8 row kernel, its signature, constants and launch options for ``job``."""
    import torch  # in the spawned worker (compile_job), as fp8_rows already did

    fn = fp8_rows.fp8_rows_kernel
    fp8, dtype = FP8_TARGETS[job.target]
    fmax, min_exp = fp8_rows.FORMATS[getattr(torch, dtype)]
    block, warps = fp8_rows.launch_config(job.head_dim)
    sig, attrs = _signature(fn, {"X": f"*{job.dtype}", "COL": "*fp32", "Q": f"*{fp8}",
                                 "S": "*fp32"})
    consts = {"FMAX": fmax, "MIN_SCALE": 1e-12, "MIN_EXP": min_exp,
              "HAS_COL": job.features == "x*col", "BLOCK_K": block}
    return fn, sig, consts, attrs, {"num_warps": warps}


def _nf4_source(job: Job, nf4_dequant) -> tuple:  # noqa: ANN001  (the module, in the worker)
    """The NF4 decoding kernel writing ``job.dtype`` from an NF4 tensor of the dtype its
    features name, with the launch's block size and warps."""
    import torch  # in the spawned worker (compile_job)

    fn = nf4_dequant.nf4_dequant_kernel
    nf4 = NF4_DTYPES[job.features]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    sig, attrs = _signature(fn, {"DATA": "*u8", "SCALERS": "*i8", "FACTORS": f"*{nf4}",
                                 "MEAN": f"*{nf4}", "LEVELS": f"*{nf4}", "OUT": f"*{job.dtype}"})
    consts = {"HALF_BLOCK": 32, "SCALER_BLOCK": 256,
              "NF4_KIND": nf4_dequant.KINDS[torch_dtype[nf4]],
              "OUT_KIND": nf4_dequant.KINDS[torch_dtype[job.dtype]], "BLOCK": nf4_dequant.BLOCK}
    return fn, sig, consts, attrs, {"num_warps": nf4_dequant.WARPS}


def _fused_source(job: Job, rms_norm, swiglu) -> tuple:  # noqa: ANN001  (the modules)
    """A fused RMS norm or SwiGLU kernel, its signature, constants and launch options: data
    in ``job.dtype``, statistics and dweight partials in float32, as the operators launch
    them (an input of float32 weights: the same code)."""
    data = f"*{job.dtype}"
    if job.kernel in ELEMENTWISE:
        fn = swiglu.swiglu_fwd_kernel if job.kernel == "swiglu_fwd" else swiglu.swiglu_bwd_kernel
        sig, attrs = _signature(fn, {p.name: data for p in fn.params if not p.is_constexpr
                                     and p.name != "n"})
        return fn, sig, {"BLOCK": swiglu.BLOCK}, attrs, {"num_warps": swiglu.WARPS}
    block, warps = rms_norm.launch_config(job.head_dim)
    if job.kernel == "rms_norm_fwd":
        fn = rms_norm.rms_norm_fwd_kernel
        kinds = {"X": data, "W": data, "Y": data, "RSTD": "*fp32", "eps": "fp32"}
        consts = {"BLOCK_N": block}
    else:
        fn = rms_norm.rms_norm_bwd_kernel
        kinds = {"DY": data, "X": data, "W": data, "RSTD": "*fp32", "DX": data, "DW": "*fp32"}
        consts = {"HAS_DX": True, "HAS_DW": job.features == "dx+dw", "BLOCK_N": block}
    sig, attrs = _signature(fn, kinds)
    return fn, sig, consts, attrs, {"num_warps": warps}


def _compile(job: Job, fn, sig: dict, consts: dict, attrs: dict, options: dict,  # noqa: ANN001
             target, gpu_target_cls, source_cls) -> Result:  # noqa: ANN001
    import triton  # in the spawned worker (compile_job)

    start = time.perf_counter()
    try:
        kernel = triton.compile(source_cls(fn, sig, consts, attrs),
                                target=target.gpu_target(gpu_target_cls), options=options)
        resources = measure(kernel, target)
    except Exception as e:  # noqa: BLE001  (the compiler's error is the result)
        text = str(e).strip().splitlines()
        return Result(job, False, error=(text[0] if text else type(e).__name__)[:300],
                      seconds=time.perf_counter() - start)
    return Result(job, True, resources=resources, seconds=time.perf_counter() - start)


def run(targets: list[str], which: str = "small", workers: int | None = None,
        progress: bool = True, kernels: set[str] | None = None,
        head_dims: set[int] | None = None) -> tuple[list[Result], list[str]]:
    """Compile the tuning table's configurations (``which`` set) for ``targets``; only the
    given ``kernels`` and ``head_dims`` where named (checking one row of the table)."""
    todo = [j for j in jobs(targets, which) if (kernels is None or j.kernel in kernels)
            and (head_dims is None or j.head_dim in head_dims)]
    return compile_job_pool(todo, workers, progress)


def compile_job_pool(todo: list[Job], workers: int | None = None,
                     progress: bool = True) -> tuple[list[Result], list[str]]:
    """Compile ``todo`` in worker processes; ``(results, notes on skipped targets)``. Jobs of
    AMD targets are skipped, with the reason, when no ld.lld is found."""
    lld, why = find_lld()
    skipped = []
    if lld is None:
        amd = sorted({j.target for j in todo if TARGETS[j.target].backend == "hip"})
        skipped = [f"{t}: skipped ({why})" for t in amd]
        todo = [j for j in todo if j.target not in amd]
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    results: list[Result] = []
    with ProcessPoolExecutor(workers, mp_context=_spawn(), initializer=_compiler_env) as pool:
        for i, r in enumerate(pool.map(compile_job, todo, [lld] * len(todo)), 1):
            results.append(r)
            if progress:
                print(f"\r  compiled {i}/{len(todo)}", end="", file=sys.stderr, flush=True)
    if progress and todo:
        print(file=sys.stderr)
    return results, skipped


def _compiler_env() -> None:
    """Workers compile real kernels, even when the parent runs Triton's interpreter (tests)."""
    os.environ.pop("TRITON_INTERPRET", None)


def _spawn():
    import multiprocessing  # only the command line starts workers; importing the module should not


    return multiprocessing.get_context("spawn")  # compilers hold threads: never fork them


def table(results: list[Result]) -> str:
    """A markdown table, one row per compilation."""
    head = ("target", "kernel", "head dim", "dtype", "features", "configuration", "result",
            "smem/LDS KB (limit)", "regs", "spills", "occupancy")
    rows = [head, tuple("---" for _ in head)]
    for r in results:
        j, t = r.job, TARGETS[r.job.target]
        if not r.ok:
            rows.append((j.target, j.kernel, str(j.head_dim), j.dtype, j.features, _cfg(j),
                         f"error: {r.error}", "", "", "", ""))
            continue
        res = r.resources
        verdict = "; ".join(r.problems) or "ok"
        rows.append((j.target, j.kernel, str(j.head_dim), j.dtype, j.features, _cfg(j), verdict,
                     f"{res.shared / 1024:.0f} ({t.smem_limit // 1024})", res.registers_text,
                     res.spills_text, res.occupancy_text))
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _cfg(job: Job) -> str:
    if job.kernel == "fp8_rows" or job.kernel in NORM_KERNELS:
        return f"rows of {job.head_dim}"
    if job.kernel in ELEMENTWISE or job.kernel == "nf4_dequant":
        return "elementwise"
    if job.kernel in ROPE_KERNELS:
        return f"heads of {job.head_dim}"
    return str(job.config) if job.config else f"{PREPROCESS_ROWS} rows"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foundryx.kernels.targets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, from {', '.join(TARGETS)}")
    parser.add_argument("--set", default="small", choices=sorted(SETS),
                        help="small: bf16 with every feature on; full: every dtype and feature set")
    parser.add_argument("--kernels", default=None,
                        help=f"comma-separated, from {', '.join(KERNEL_NAMES)} (default: all)")
    parser.add_argument("--head-dims", default=None,
                        help=f"comma-separated, from {', '.join(map(str, HEAD_DIMS))} (default: "
                             "all; for fp8_rows, its row lengths)")
    parser.add_argument("--workers", type=int, default=None, help="compiler processes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    kernels = {k.strip() for k in args.kernels.split(",")} if args.kernels else None
    if kernels and kernels - set(KERNEL_NAMES):
        print(f"error: unknown kernel(s) {', '.join(sorted(kernels - set(KERNEL_NAMES)))}; "
              f"choose from {', '.join(KERNEL_NAMES)}", file=sys.stderr)
        return 2
    try:
        head_dims = {int(h) for h in args.head_dims.split(",")} if args.head_dims else None
    except ValueError:
        print(f"error: --head-dims takes integers, e.g. 64,128; got {args.head_dims!r}",
              file=sys.stderr)
        return 2
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        print(f"error: unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}",
              file=sys.stderr)
        return 2
    results, skipped = run(names, args.set, args.workers, progress=not args.json,
                           kernels=kernels, head_dims=head_dims)
    bad = [r for r in results if r.problems]
    if args.json:
        print(json.dumps({"results": [dataclasses.asdict(r) for r in results], "skipped": skipped,
                          "failed": len(bad)}, indent=1))
    else:
        print(table(results))
        for line in skipped:
            print(line)
        print(f"\n{len(results)} compiled, {len(bad)} with problems"
              + "".join(f"\n  {r.job.target} {r.job.kernel} hd{r.job.head_dim} {r.job.features}: "
                        f"{'; '.join(r.problems)} {r.error}" for r in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
