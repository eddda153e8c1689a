"""Choose tuning-table rows on paper: compile candidate configurations for a target and keep
those that fit (no spills, shared memory / LDS within the limit), best first.

``python -m foundryx.kernels.search --targets sm80,sm90 [--head-dims 64,128,256] [--full]``
compiles every candidate of each kernel (tiles x 4 or 8 warps x 1-4 pipeline stages on NVIDIA,
x ``waves_per_eu`` 1 or 2 on AMD) with every feature on in bf16, ranks those that fit by, in
order: arithmetic intensity of the tile (``bm*bn/(bm+bn)``: fewer loads per FLOP), occupancy,
pipeline stages (NVIDIA) and fewer warps; then checks the best few with each other feature
set (``--full``: and fp16 too, i.e. every dtype and feature set of ``targets.py --set full``) and
prints, per (target, kernel, head dim), the best one that fits them all. It ranks with the Triton
it runs on: the table must fit on both CI legs (3.3 and 3.8), so check the winner with the other
venv too (``python -m foundryx.kernels.targets --set full``). A GPU benchmark
(``python -m benchmarks.attention --tune``) has the last word; this ranking only rules out what cannot
run well on the target at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from foundryx.kernels import tuning
from foundryx.kernels.resources import TARGETS
from foundryx.kernels.targets import DTYPES, FEATURES, HEAD_DIMS, Job, Result, compile_job_pool

C = tuning.KernelConfig
_TILES = {
    "fwd": ((128, 128), (128, 64), (64, 64), (128, 32), (64, 32), (32, 32)),
    "bwd_dkdv": ((64, 128), (32, 128), (64, 64), (32, 64), (16, 64), (32, 32), (16, 32)),
    "bwd_dq": ((128, 64), (128, 32), (64, 64), (64, 32), (32, 32), (64, 16), (32, 16)),
    "bwd_atomic": ((64, 128), (32, 128), (64, 64), (32, 64), (16, 64), (32, 32), (16, 32)),
}


def candidates(target: str, kernel: str) -> list[tuning.KernelConfig]:
    if TARGETS[target].backend == "cuda":
        return [C(bm, bn, w, s) for bm, bn in _TILES[kernel] for w in (4, 8) for s in (1, 2, 3, 4)]
    return [C(bm, bn, w, 1, {"waves_per_eu": e}) for bm, bn in _TILES[kernel] for w in (4, 8)
            for e in (1, 2)]


def rank(results: list[Result]) -> list[Result]:  # noqa: D103
    """Fitting results, best first (see the module docstring)."""
    def key(r: Result):
        c = r.job.config
        return (c.block_m * c.block_n / (c.block_m + c.block_n), r.resources.occupancy,
                c.num_stages, -c.num_warps)
    return sorted((r for r in results if not r.problems), key=key, reverse=True)


def verified(groups: list[tuple[str, str, int]], results: list[Result], tries: int,
             full: bool = False, workers: int | None = None,
             ) -> dict[tuple[str, str, int], Result | None]:
    """Per group, the best-ranked candidate that also fits with every other feature set in bf16
    (``full``: in every dtype) (register allocation is not monotonic in the features: a subset
    can spill where all of them do not); None when none of the first ``tries`` does."""
    ranked = {g: rank([r for r in results if (r.job.target, r.job.kernel, r.job.head_dim) == g])
              for g in groups}
    sets = [(d, f) for d in (DTYPES if full else ("bf16",)) for f in FEATURES
            if (d, f) != ("bf16", "all")]
    todo = [dataclasses.replace(r.job, dtype=d, features=f) for g in groups
            for r in ranked[g][:tries] for d, f in sets]
    checked, _ = compile_job_pool(todo, workers)
    bad = [dataclasses.replace(r.job, dtype="bf16", features="all") for r in checked if r.problems]
    return {g: next((r for r in ranked[g][:tries] if r.job not in bad), None) for g in groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foundryx.kernels.search",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--kernels", default=",".join(tuning.KERNELS))
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--tries", type=int, default=4,
                        help="ranked candidates per group checked with every feature set")
    parser.add_argument("--full", action="store_true",
                        help="check them in fp16 too (every dtype and feature set, as --set full)")
    parser.add_argument("--workers", type=int, default=None, help="compiler processes")
    args = parser.parse_args(argv)
    groups = [(t, k, int(hd)) for t in args.targets.split(",") for k in args.kernels.split(",")
              for hd in args.head_dims.split(",")]
    todo = [Job(t, k, hd, "bf16", "all", c) for t, k, hd in groups for c in candidates(t, k)]
    results, skipped = compile_job_pool(todo, args.workers)
    for line in skipped:
        print(line)
    for (t, k, hd), best in verified(groups, results, args.tries, args.full, args.workers).items():
        fit = rank([r for r in results if (r.job.target, r.job.kernel, r.job.head_dim) == (t, k, hd)])
        none = "none of the first tries fits every feature set" + (" and dtype" * args.full)
        what = none if best is None else (
            f"{best.job.config} ({best.resources.registers_text} regs, "
            f"{best.resources.shared // 1024} KB, {best.resources.occupancy_text})")
        print(f"{t} {k} hd{hd}: {len(fit)} of {len(candidates(t, k))} fit with every feature on; "
              f"best that fits them all: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
