"""Seconds from typing a ``foundryx`` command with a mistake in it to its message, per class of
mistake (issue 26: a config mistake is reported in under 2 s, before torch is imported; since
issue 54 a mistake in the config's keys or values also loads the components' code, so that
their options' problems come in the same message: seconds more).

    python -m benchmarks.cli_errors [--rounds 5] [--baseline REF --baseline-rounds 3]
                                    [--cases TEXT ...] [--out benchmarks/RESULTS.md]

Each case runs ``python -m foundryx.cli ...`` as a new process in an empty folder, with this
checkout first on PYTHONPATH; the time is the process's wall time to its exit, which is when
the message has been printed. ``--baseline REF`` also runs every case on the foundryx of a git
commit (``git archive`` into a temporary folder), alternating with this checkout within each
round (which one goes first alternates too), so both see the same machine load. The table
gives the median over rounds and the range, the exit codes, and the ratio of the medians.
``--cases`` keeps the cases whose name contains one of the texts given (a quick look; the test
of this script runs two).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from foundryx.cli import versions

ROOT = Path(__file__).resolve().parents[1]
QS = str(ROOT / "yamls" / "quickstart.yaml")
EVAL = str(ROOT / "eval" / "yamls" / "quickstart.yaml")
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def cases(data_root: str, bad_yaml: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name: (foundryx arguments, environment); the quickstart's data where a run needs it."""
    d = f"variables.data_root={data_root}"
    return {
        "YAML syntax error (unclosed [)": (["train", bad_yaml], {}),
        "unknown key": (["train", QS, d, "seeed=3"], {}),
        "wrong type": (["train", QS, d, "global_train_batch_size=many"], {}),
        "unknown registry name": (["train", QS, d, "optimizer.name=adamx"], {}),
        "device: gpu without a GPU": (["train", QS, d, "device=gpu"], NO_GPU),
        "precision amp_fp16 on CPU": (["train", QS, d, "precision=amp_fp16"], {}),
        "plan: override after --gpus": (["plan", QS, "--gpus", "8", "seeed=3"], {}),
        "eval: unknown key": (["eval", EVAL, "icl_max_exampels=4"], {}),
        "export: unknown model name": (["export", "ckpt", "out", "--config", QS,
                                        "model.name=mpt_causal"], {}),
        "unknown flag (plan --bogus)": (["plan", QS, "--bogus"], {}),
        "dry run: LoRA target matches nothing (builds the model)": (
            ["train", "--dry-run", QS, d, "model.peft_config.target_modules=[q_proj,v_prj]"], {}),
    }


def run_once(tree: Path, args: list[str], env: dict[str, str]) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as cwd:
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "foundryx.cli", *args], cwd=cwd,
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(tree), **env})
        return time.perf_counter() - start, r.returncode


def extract(ref: str, into: Path) -> Path:
    """The foundryx package of git commit ``ref`` under ``into``."""
    archive = into / "baseline.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref, "foundryx"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", metavar="REF", help="also time the foundryx of this commit")
    ap.add_argument("--baseline-rounds", type=int, default=3, help="rounds that also run the "
                    "baseline (its cases take 10-40 s each)")
    ap.add_argument("--data-root", help="the quickstart data (default: generated, ~30 s)")
    ap.add_argument("--cases", nargs="+", metavar="TEXT",
                    help="only the cases whose name contains one of these texts")
    ap.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = ap.parse_args()
    if args.cases:
        known = cases("", "")
        if not any(t in name for t in args.cases for name in known):
            ap.error(f"--cases {' '.join(args.cases)}: no case matches; the cases: "
                     + "; ".join(known))

    tmp = Path(tempfile.mkdtemp(prefix="cli_errors-"))
    data_root = args.data_root
    if data_root is None:
        from foundryx.data.quickstart import prepare_quickstart

        data_root = str(prepare_quickstart(tmp / "quickstart", progress=False))
    bad = tmp / "bad.yaml"
    bad.write_text(Path(QS).read_text().replace("betas: [0.9, 0.95]", "betas: [0.9, 0.95"))
    trees = {"now": ROOT}
    if args.baseline:
        trees["baseline"] = extract(args.baseline, tmp)
    table = {name: case for name, case in cases(data_root, str(bad)).items()
             if not args.cases or any(t in name for t in args.cases)}
    times = {(c, t): [] for c in table for t in trees}
    codes = {(c, t): set() for c in table for t in trees}
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    for i in range(args.rounds):
        for name, (argv, env) in table.items():
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for t in order:
                if t == "baseline" and i >= args.baseline_rounds:
                    continue
                seconds, code = run_once(trees[t], argv, env)
                times[(name, t)].append(seconds)
                codes[(name, t)].add(code)
        print(f"round {i + 1}/{args.rounds} done ({time.monotonic() - started:.0f} s)",
              file=sys.stderr)
    load_after = os.getloadavg()[0]
    shutil.rmtree(tmp, ignore_errors=True)

    head = "| mistake | exit | seconds to the message, median (range) |"
    rule = "|---|---|---|"
    if args.baseline:
        head += f" before ({args.baseline}): exit | before: seconds | before / now |"
        rule += "---|---|---|"
    rows = [head, rule]
    for name in table:
        now = times[(name, "now")]
        row = f"| {name} | {','.join(map(str, sorted(codes[(name, 'now')])))} | {spread(now)} |"
        if args.baseline:
            old = times[(name, "baseline")]
            ratio = statistics.median(old) / statistics.median(now)
            row += (f" {','.join(map(str, sorted(codes[(name, 'baseline')])))} | {spread(old)} |"
                    f" {ratio:.1f}x |")
        rows.append(row)
    cpus = os.cpu_count()
    section = "\n".join([
        "## Time to the message of a command-line mistake (issue 26, part A)", "",
        f"{datetime.date.today()}. {platform.machine()} Linux VM, {cpus} cores, no GPU; "
        f"{versions()}, omegaconf {version('omegaconf')}. Command: `python -m benchmarks.cli_errors --rounds {args.rounds}"
        + "".join(f" --cases '{t}'" for t in args.cases or [])
        + (f" --baseline {args.baseline} --baseline-rounds {args.baseline_rounds}`"
           if args.baseline else "`")
        + f". Load average {load_before:.1f} before and {load_after:.1f} after (other jobs "
        "share the machine).", "", *rows, ""])
    print(section)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + section)


if __name__ == "__main__":
    main()
