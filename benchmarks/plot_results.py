"""Plots of the RESULTS.md tables a reader takes as curves, drawn from the tables themselves.

    python -m benchmarks.plot_results   # writes benchmarks/images/loading-grid.png and
                                        # benchmarks/images/planner-device.png
    python -m benchmarks.plot_results --images DIR   # the same two files into DIR

The shard-on-read grid (section "Loading"): per frozen-base dtype, the measured peak host
memory per rank (VmHWM) and the planner's figure against the number of ranks, and the load's
speed against `cat`'s, at offload 0, 0.5 and 1. The planner's device memory against the
measured peaks on CPU (section "Planner accuracy"): planned against measured per case, with
the line of equality and the 15% band.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
GRID_HEADER = "| ranks | frozen base | offload | above base per rank"
DEVICE_HEADER = "| case | processes | measured peak (MiB) | planner (MiB) | error |"


def grid_rows(text: str, start: str = GRID_HEADER) -> list[dict[str, str]]:
    """The rows of every table in ``text`` whose header starts with ``start``."""
    rows, header = [], None
    for line in text.splitlines():
        if line.startswith(start):
            header = [c.strip() for c in line.strip("|").split("|")]
        elif header and line.startswith("|") and not line.startswith("|---"):
            rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
        elif not line.startswith("|"):
            header = None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, default=HERE / "images",
                    help="the folder the plots are written to")
    images = ap.parse_args().images
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = grid_rows((HERE / "RESULTS.md").read_text())
    by = defaultdict(list)
    for r in rows:
        by[(r["frozen base"], float(r["offload"]))].append(r)
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"bf16": "C0", "fp8": "C1", "int8": "C2", "nf4": "C3"}
    for (dtype, offload), rs in sorted(by.items()):
        rs.sort(key=lambda r: int(r["ranks"]))
        ranks = [int(r["ranks"]) for r in rs]
        if offload == 0:
            mem.plot(ranks, [float(r["VmHWM (GiB)"]) for r in rs], "o-", color=colors[dtype],
                     label=f"{dtype} measured")
            mem.plot(ranks, [float(r["planned (GiB)"]) for r in rs], "x--", color=colors[dtype],
                     label=f"{dtype} planned")
        style = {0.0: "o-", 0.5: "s:", 1.0: "^--"}[offload]
        speed.plot(ranks, [float(r["load / cat"]) for r in rs], style, color=colors[dtype],
                   label=f"{dtype}, offload {offload:g}")
    mem.set(xlabel="ranks", ylabel="peak host memory per rank (GiB)", xticks=[1, 2, 4],
            title="load peak per rank (offload 0): measured vs planned")
    speed.axhline(0.8, color="grey", lw=0.8)
    speed.text(1, 0.82, "target 0.8x cat", color="grey", fontsize=8)
    speed.set(xlabel="ranks", ylabel="load speed / cat speed", xticks=[1, 2, 4],
              title="load throughput against reading the files (cat)")
    mem.legend(fontsize=7, ncol=2)
    speed.legend(fontsize=6, ncol=2)
    for ax in (mem, speed):
        ax.grid(alpha=0.3)
    fig.suptitle(f"shard-on-read grid: {len(rows)} rows (0.75B Llama, bf16 safetensors, CPU ranks)")
    fig.tight_layout()
    out = images / "loading-grid.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(rows)} rows)")
    plot_planner_device(plt, images)


def plot_planner_device(plt, images: Path) -> None:  # noqa: ANN001
    """Planned against measured device memory per case (the planner-accuracy table)."""
    rows = [r for r in grid_rows((HERE / "RESULTS.md").read_text(), DEVICE_HEADER)
            if r["processes"] in ("1", "2")]
    fig, ax = plt.subplots(figsize=(6, 5))
    for procs, marker in (("1", "o"), ("2", "s")):
        rs = [r for r in rows if r["processes"] == procs]
        ax.scatter([float(r["measured peak (MiB)"]) for r in rs],
                   [float(r["planner (MiB)"]) for r in rs], marker=marker,
                   label=f"{procs} process{'es' if procs == '2' else ''}")
    top = max(float(r["measured peak (MiB)"]) for r in rows) * 1.1
    line = [0, top]
    ax.plot(line, line, color="grey", lw=0.8, label="planned = measured")
    ax.fill_between(line, [0.85 * x for x in line], [1.15 * x for x in line], color="grey",
                    alpha=0.15, label="within 15%")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured peak (MiB)", ylabel="planned (MiB)",
           title=f"planner's device memory vs CPU runs ({len(rows)} cases)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = images / "planner-device.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
