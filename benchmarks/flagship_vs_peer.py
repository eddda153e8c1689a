"""foundryx against the peer a user would pick, side by side on one GPU (issue 46): the 8B LoRA
flagship over a bf16 base, and plain transformers + peft doing the same work, alternating, in
one invocation, with one profiled step of each side.

    python -m benchmarks.flagship_vs_peer --device cuda --profiles prof --out vs-peer.md
    python -m benchmarks.flagship_vs_peer --device cpu --shape benchmarks/gpu_runbook/shapes/llama-tiny \\
        --seq 64 --steps 3 --profiles prof --out tiny.md                  # a CPU smoke run

The work, the same for every side: the model folder benchmarks/flagship.py writes (random bf16
weights of ``--shape``, default yamls/shapes/llama-3.1-8b), LoRA r16 / alpha 32 / dropout 0.05
on all linear layers, activation checkpointing on every layer, ``--microbatch`` x ``--seq``
random tokens per step (labels = inputs), one optimizer step per batch, ``--steps`` steps, bf16
on a GPU (fp32 on a CPU). The sides (``--sides``):

- ``peer``: benchmarks/peer_lora.py, plain transformers + peft as a user writes it;
- ``foundryx``: benchmarks/flagship.py's single run (`foundryx train` of
  yamls/finetune/llama-8b-lora-fp8.yaml over a bf16 base, no offload) with compile off;
- ``foundryx-compile``: the same with the recipe's own ``compile: auto``;
- ``foundryx-unfused``: ``foundryx`` without issue 51's fused path (PEFT's own LoRA layer,
  ``model.peft_config.one_pass: false``, and every ``fused_ops`` switch off): the before of
  the fused path, measured beside it;
- ``foundryx-full``: ``foundryx`` with ``activation_checkpointing.mode=full`` (every layer
  recomputed, as the peer does): on a GPU with room the recipe's ``auto`` picks selective
  checkpointing, trading memory for speed; this side measures the memory-for-memory case
  (not in the default ``--sides``).

``--rounds`` rounds (default 2), each running every side once, the order reversed in every other
round; each run is a fresh process. Everything runs on the Python and packages this script runs
with (the run book points it at the machine's own transformers 5.x). tokens/s: mean of steps
2..N less the profiled step; peak allocated / reserved GPU memory over the steps. In the first
round each side's step ``--profile-step`` (default the last) is profiled by
benchmarks/step_profile.py into ``--profiles``: ``<side>-kernels.md`` (top kernels by GPU time)
and ``<side>-memory.md`` (allocator figures, persistent state by kind, allocations alive at the
step's peak by the code that made them), a few KB each. The report: every run, each side's mean,
and the ratios foundryx / peer of tokens/s and peak allocated memory (issue 46's goal for the
bf16 base: >= 1.5x the tokens/s at <= 0.8x the memory). ``--time-limit`` bounds the whole
invocation (a run that would start with under 10 s left is not run); exit 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import flagship  # the benchmarks' own module, beside this one

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SIDES = ("peer", "foundryx", "foundryx-compile", "foundryx-unfused")
SIDES = (*DEFAULT_SIDES, "foundryx-full")
COMPILE = {"foundryx": "false", "foundryx-compile": "auto", "foundryx-unfused": "false",
           "foundryx-full": "false"}
UNFUSED = ("model.peft_config.one_pass=false", "fused_ops.rms_norm=false",
           "fused_ops.swiglu=false", "fused_ops.rope=false")
# overrides of a side beyond benchmarks/flagship.py's
EXTRA = {"foundryx-unfused": UNFUSED, "foundryx-full": ("activation_checkpointing.mode=full",)}
GOAL_TPS, GOAL_MEM = 1.5, 0.8  # issue 46: the bf16 base against the peer


def run_peer(folder: Path, a: argparse.Namespace, rnd: int, timeout: float, logs: Path) -> dict:
    row: dict = {"side": "peer", "round": rnd}
    profile = a.profile_step if rnd == 1 and a.profiles else 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [sys.executable, "-m", "benchmarks.peer_lora", "--model", str(folder), "--device",
               a.device, "--steps", str(a.steps), "--seq", str(a.seq), "--batch",
               str(a.microbatch), "--json", str(out)]
        if profile:
            cmd += ["--profile-step", str(profile), "--profile-dir", str(a.profiles)]
        log = logs / f"peer-r{rnd}.log"
        start = time.perf_counter()
        with log.open("w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                    timeout=max(timeout, 1), start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row["wall_s"] = time.perf_counter() - start
        row["log"] = str(log)
        if out.is_file():
            row.update(json.loads(out.read_text()))
    if rc != 0:
        row["error"] = f"timed out after {timeout:.0f} s" if rc == "timeout" else f"exit {rc}"
        row["tail"] = "\n".join(log.read_text().splitlines()[-25:])
    return row


def run_foundryx(folder: Path, side: str, a: argparse.Namespace, rnd: int, timeout: float,
                 logs: Path) -> dict:
    profile = a.profile_step if rnd == 1 and a.profiles else 0
    ns = argparse.Namespace(device=a.device, seq=a.seq, microbatch=a.microbatch, steps=a.steps,
                            precision=None, nproc=1, compile=COMPILE[side], profile_step=profile,
                            profile_dir=a.profiles, profile_side=side, log_tag=f"-{side}-r{rnd}",
                            extra=list(EXTRA.get(side, ())))
    row = flagship.run_one(folder, "bf16", 0.0, ns, timeout, logs)
    row.update(side=side, round=rnd)
    return row


def versions() -> dict:
    """The packages every run uses (each a fresh process of this Python, this environment)."""
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "mosaicml", "torchao"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def fmt(x, spec: str = ".1f") -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def summary(rows: list[dict]) -> dict:
    """Per side: mean tokens/s over its rounds, the largest peaks; ratios to the peer."""
    out: dict = {}
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = [r for r in rows if r["side"] == side and not r.get("error")]
        tps = [r["tokens_per_s"] for r in mine if r.get("tokens_per_s")]
        s = {"runs": len(mine), "tokens_per_s": statistics.mean(tps) if tps else None,
             "tokens_per_s_rounds": tps}
        for k in ("cuda_max_allocated_gib", "cuda_max_reserved_gib"):
            values = [r[k] for r in mine if r.get(k) is not None]
            s[k] = max(values) if values else None
        plans = [r["plan_tokens_per_s"] for r in mine if r.get("plan_tokens_per_s")]
        s["plan_tokens_per_s"] = plans[0] if plans else None
        out[side] = s
    peer = out.get("peer")
    for side, s in out.items():
        if side == "peer" or not peer:
            continue
        s["tps_vs_peer"] = _ratio(s["tokens_per_s"], peer["tokens_per_s"])
        s["allocated_vs_peer"] = _ratio(s["cuda_max_allocated_gib"], peer["cuda_max_allocated_gib"])
        s["reserved_vs_peer"] = _ratio(s["cuda_max_reserved_gib"], peer["cuda_max_reserved_gib"])
    return out


def _ratio(a, b):
    return a / b if a and b else None


def render(meta: dict, rows: list[dict], summ: dict) -> str:
    v = meta["versions"]
    lines = [f"Command: `{meta['command']}`", "",
             f"Model: `{meta['shape']}` ({flagship.count(meta['params'])} parameters), random bf16 "
             f"weights at `{meta['folder']}` ({meta['written']}); LoRA r16 / alpha 32 / dropout "
             f"0.05 on all linear layers, activation checkpointing, {meta['microbatch']} x "
             f"{meta['seq']} random tokens per step, {meta['steps']} steps, "
             f"{'bf16' if meta['device'] == 'cuda' else 'fp32'} on {meta['where']}; "
             f"{meta['rounds']} round(s), the sides alternating. torch {v['torch']}, "
             f"transformers {v['transformers']}, peft {v['peft']}, Composer {v['mosaicml']}. "
             "tokens/s: mean of steps 2..N less the profiled step (round 1's step "
             f"{meta['profile_step'] or '-'}).", "",
             "| round | side | tokens/s | plan tokens/s | peak allocated GiB | peak reserved GiB "
             "| loss first -> last | wall s |", "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        loss = (f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r.get("losses") else "n/a")
        status = f" **{r['error']}**" if r.get("error") else ""
        lines.append(f"| {r['round']} | {r['side']}{status} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('plan_tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('cuda_max_allocated_gib'))} | {fmt(r.get('cuda_max_reserved_gib'))} | "
                     f"{loss} | {fmt(r.get('wall_s'), '.0f')} |")
    lines += ["", "| side | tokens/s (mean of rounds) | vs peer | peak allocated GiB | vs peer | "
              "peak reserved GiB | vs peer | measured / plan tokens/s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for side, s in summ.items():
        lines.append(f"| {side} | {fmt(s['tokens_per_s'], ',.0f')} | "
                     f"{fmt(s.get('tps_vs_peer'), '.2f')} | {fmt(s['cuda_max_allocated_gib'])} | "
                     f"{fmt(s.get('allocated_vs_peer'), '.2f')} | {fmt(s['cuda_max_reserved_gib'])} | "
                     f"{fmt(s.get('reserved_vs_peer'), '.2f')} | "
                     f"{fmt(_ratio(s['tokens_per_s'], s['plan_tokens_per_s']), '.2f')} |")
    fx = summ.get("foundryx", {})
    if fx.get("tps_vs_peer") is not None:
        met = (fx["tps_vs_peer"] >= GOAL_TPS and fx.get("allocated_vs_peer") is not None
               and fx["allocated_vs_peer"] <= GOAL_MEM)
        mem = fx.get("allocated_vs_peer")
        lines += ["", f"foundryx / peer (bf16 base, compile off): tokens/s "
                  f"{fx['tps_vs_peer']:.2f}x, peak allocated "
                  f"{'n/a (no GPU)' if mem is None else f'{mem:.2f}x'}; issue 46's goal (>= "
                  f"{GOAL_TPS}x tokens/s at <= {GOAL_MEM}x memory): {'met' if met else 'not met'}."]
    if meta.get("profiles"):
        files = sorted(Path(meta["profiles"]).glob("*.md"))
        lines += ["", f"Profiles of round 1's step {meta['profile_step']} "
                  f"(benchmarks/step_profile.py), in `{meta['profiles']}`: " +
                  (", ".join(f"`{f.name}` ({f.stat().st_size / 1e3:.1f} KB)" for f in files)
                   or "none written")]
    for r in rows:
        if r.get("error"):
            lines += ["", f"round {r['round']}, {r['side']} failed ({r['error']}); the last lines "
                      f"of its log ({r.get('log', '-')}):", "", "```text", r.get("tail", ""), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    intro, usage = __doc__.split("\n\n")[:2]
    p = argparse.ArgumentParser(description=intro.replace("\n", " "), epilog=usage,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                   help="cuda: one GPU, bf16; cpu: fp32 (a smoke run)")
    p.add_argument("--shape", type=Path, default=ROOT / "yamls" / "shapes" / "llama-3.1-8b",
                   help="a folder with a Llama config.json (default yamls/shapes/llama-3.1-8b)")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                   help=f"of {', '.join(SIDES)} (default {','.join(DEFAULT_SIDES)})")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every side (default 2)")
    p.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default 4096, at most the shape's positions)")
    p.add_argument("--microbatch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--profile-step", type=int, default=None,
                   help="the step profiled in round 1 (default the last; 0: none)")
    p.add_argument("--profiles", type=Path, default=None,
                   help="folder for the profiles (none profiled without it)")
    flagship.add_run_options(p, run_timeout=300, json_help="also write rows and summary as JSON")
    a = p.parse_args(argv)
    sides = [s for s in a.sides.split(",") if s]
    if not sides or set(sides) - set(SIDES):
        p.error(f"--sides: of {', '.join(SIDES)}, comma-separated")
    if a.steps < 3:
        p.error("--steps: at least 3 (tokens/s: steps 2..N less the profiled one)")
    a.profile_step = a.steps if a.profile_step is None else a.profile_step
    start = time.perf_counter()
    deadline = start + a.time_limit if a.time_limit else float("inf")
    cfg = flagship.shape_config(a.shape)
    a.seq = a.seq or min(4096, cfg.get("max_position_embeddings", 4096))
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA or ROCm GPU visible to torch", file=sys.stderr)
            return 2
        where = f"1 x {torch.cuda.get_device_name()}"
    else:
        import platform

        where = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    folder = a.cache or flagship.CACHE / f"{a.shape.resolve().name}-bf16"
    logs = a.logs or Path(tempfile.mkdtemp(prefix="vs-peer-"))
    logs.mkdir(parents=True, exist_ok=True)
    if a.profiles:
        a.profiles.mkdir(parents=True, exist_ok=True)
    print(f"model folder {folder} ...", flush=True)
    written, _ = flagship.ensure_model(a.shape, folder, a.device)
    meta = {"command": "python -m benchmarks.flagship_vs_peer " + " ".join(sys.argv[1:] if argv is None else argv),
            "shape": str(a.shape), "params": flagship.total_params(cfg), "folder": str(folder),
            "written": f"written in {written:.0f} s" if written else "written by an earlier run",
            "device": a.device, "where": where, "seq": a.seq, "microbatch": a.microbatch,
            "steps": a.steps, "rounds": a.rounds, "sides": sides, "versions": versions(),
            "profile_step": a.profile_step if a.profiles else 0,
            "profiles": str(a.profiles) if a.profiles else None}
    runs = [(rnd, side) for rnd in range(1, a.rounds + 1)
            for side in (sides if rnd % 2 else sides[::-1])]
    rows: list[dict] = []

    def write() -> None:
        summ = summary(rows)
        a.out.write_text(render(meta, rows, summ))
        if a.json:
            a.json.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summ}, indent=1))

    for i, (rnd, side) in enumerate(runs):
        left = deadline - time.perf_counter() - 5
        if left < 10:
            rows.append({"side": side, "round": rnd, "error": "not run: no time left"})
            continue
        print(f"[{i + 1}/{len(runs)}] round {rnd}, {side} ...", flush=True)
        timeout = min(a.run_timeout, left)
        row = (run_peer(folder, a, rnd, timeout, logs) if side == "peer"
               else run_foundryx(folder, side, a, rnd, timeout, logs))
        rows.append(row)
        print(f"[{i + 1}/{len(runs)}] {row.get('error') or 'ok'}: "
              f"{fmt(row.get('tokens_per_s'), ',.0f')} tokens/s, {row['wall_s']:.0f} s", flush=True)
        write()  # after each run: a cut-off leaves the others
    write()
    print(a.out.read_text())
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
