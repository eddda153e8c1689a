"""Where a rank's host memory goes, step by step and phase by phase (issue 38): the trace
behind the plan-vs-run gap of a LoRA run on CPU ranks.

    python -m benchmarks.host_trace [--hidden 1536] [--layers 24] [--steps 12] [--seq 256]
            [--config fp8-offload0.55] [--host-heap auto|bounded|glibc] [--trim]
            [--env NAME=VALUE ...] [--out benchmarks/RESULTS.md]

One real run on 2 CPU ranks (``composer -n 2 -m benchmarks.host_trace --worker ...``; this file
is the training script: it registers a ``host_trace`` callback and calls foundryx's CLI) of the
shipped ``yamls/finetune/llama-3.1-405b-lora-fp8.yaml`` with only model, data, sizes, device and
precision overridden, as issue 38 measured it: a Llama of ``--hidden`` x ``--layers`` (1536 x 24:
0.65B parameters) saved as bf16 safetensors, ``max_seq_len`` ``--seq``, global batch 2,
microbatch 1, fp32. ``--config`` picks the frozen base as benchmarks/rss_steps.py names them.

Each rank records, for each step and each phase of it (forward, backward, the rest: optimizer
step and callbacks), the phase's peak RSS (``VmHWM``, reset at the phase's start through
``/proc/self/clear_refs``), and at its end: RSS; glibc's heap in use and free-but-kept
(``mallinfo2``: ``uordblks`` + ``hblkhd``, ``fordblks``); and the tensors it can name, each
storage counted once: frozen weights (on the device and offloaded to host), trainable weights,
gradients, optimizer state. Also the RSS after imports (before the model is built) and after
loading. Printed: the plan's host terms per rank beside the measured peak, and a table per
phase of the last step: peak, what is named, what glibc keeps free, and the rest (activations
and a step's transients, Python objects, in glibc's heap; outside it: libraries, Python's own
arenas, mapped files). ``--env MALLOC_MMAP_THRESHOLD_=131072`` and the like
run the same with glibc tuned; ``--host-heap bounded`` with foundryx's own setting
(foundryx.runtime.host_heap); ``--trim`` calls glibc's ``malloc_trim(0)`` after each step. Each rank's
seconds a step (the median of steps 3 on) are printed too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.instruments.report_out import emit
from benchmarks.rss_steps import CONFIGS, RECIPE, llama

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def malloc_gib() -> dict[str, float]:
    """glibc's heap: bytes in use (arenas + mmapped chunks) and free bytes it keeps, in GiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"malloc_used": (m.uordblks + m.hblkhd) / GIB, "malloc_free": m.fordblks / GIB}


def status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GIB
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _storages(t, seen: set) -> int:  # noqa: ANN001
    """Bytes of ``t``'s storages not in ``seen`` (a DTensor's local part, a subclass's inner)."""
    t = getattr(t, "_local_tensor", t)
    if hasattr(t, "__tensor_flatten__"):
        return sum(_storages(getattr(t, n), seen) for n in t.__tensor_flatten__()[0])
    s = t.untyped_storage()
    if s.data_ptr() in seen or t.is_meta:
        return 0
    seen.add(s.data_ptr())
    return s.nbytes()


def named_gib(model, optimizers) -> dict[str, float]:  # noqa: ANN001
    seen: set = set()
    out = {"frozen": 0, "offloaded": 0, "trainable": 0, "grads": 0, "optimizer": 0}
    for p in model.parameters():
        out["trainable" if p.requires_grad else "frozen"] += _storages(p, seen)
    for m in model.modules():
        off = getattr(m, "offload", None)
        if off is not None and hasattr(off, "host"):
            buffer = getattr(off, "buffer", None)  # all of a rank's shards, once packed
            out["offloaded"] += _storages(off.host if buffer is None else buffer, seen)
    for p in model.parameters():
        if p.grad is not None:
            out["grads"] += _storages(p.grad, seen)
    for opt in optimizers:
        for st in opt.state.values():
            out["optimizer"] += sum(_storages(v, seen) for v in st.values() if hasattr(v, "untyped_storage"))
    return {k: v / GIB for k, v in out.items()}


def trace_callback(path: str):  # noqa: ANN201
    from composer.core import Callback

    class HostTrace(Callback):
        """Per step and phase: the phase's peak RSS and, at its end, what holds memory."""

        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.phase_of = {}

        def _read(self, state, phase: str) -> None:  # noqa: ANN001
            done = int(state.timestamp.batch)  # batches finished (batch_end: this one too)
            row = {"step": done + (phase in ("forward", "backward")), "phase": phase,
                   "time": time.perf_counter(),
                   "peak": status_gib("VmHWM"), "rss": status_gib("VmRSS"), **malloc_gib(),
                   **named_gib(state.model, state.optimizers or [])}
            self.rows.append(row)
            Path(path).write_text(json.dumps({"imports": IMPORTS, "rows": self.rows}))
            reset_peak()

        def fit_start(self, state, logger) -> None:  # noqa: ANN001
            self._read(state, "loaded")

        def after_forward(self, state, logger) -> None:  # noqa: ANN001
            self._read(state, "forward")

        def after_backward(self, state, logger) -> None:  # noqa: ANN001
            self._read(state, "backward")

        def batch_end(self, state, logger) -> None:  # noqa: ANN001
            if os.environ.get("HOST_TRACE_TRIM") == "1":  # --trim
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            self._read(state, "rest")

    return HostTrace()


IMPORTS = 0.0


def worker(stats_dir: str, argv: list[str]) -> int:
    global IMPORTS
    import composer  # noqa: F401 - imported before the reading, as a run has them
    import transformers  # noqa: F401

    from foundryx import registry, train  # noqa: F401
    from foundryx.cli import main

    IMPORTS = status_gib("VmRSS")  # the process with torch, Composer, foundryx imported
    rank = int(os.environ.get("RANK", 0))
    registry.callbacks.register("host_trace", lambda: trace_callback(f"{stats_dir}/rank{rank}.json"))
    return main(["train", *argv, "callbacks.host_trace={}"])


def plan_terms(argv: list[str]) -> dict:
    out = subprocess.run([str(Path(sys.executable).parent / "foundryx"), "plan", *argv, "--gpus", "2",
                          "--json"], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--config", default="fp8-offload0.55", choices=[c for c in CONFIGS if c != "quickstart"])
    ap.add_argument("--host-heap", default="auto", choices=["auto", "bounded", "glibc"],
                    help="the run's host_heap (auto: glibc on a CPU device)")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each step")
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE set for the ranks")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from foundryx.data.quickstart import prepare_quickstart

    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_quickstart(Path(tmp) / "qs", progress=False, max_seq_len=a.seq)
        model = llama(Path(tmp) / "llama", data / "tokenizer", a.hidden, a.layers)
        args = [str(ROOT / RECIPE), f"variables.model_path={model}", f"variables.data_root={data}",
                f"variables.max_seq_len={a.seq}", "precision=fp32", f"max_duration={a.steps}ba",
                "global_train_batch_size=2", "device_train_microbatch_size=1", "device=cpu",
                "save_folder=null", "eval_loader=null", "eval_interval=100000ba",
                "progress_bar=false", f"host_heap={a.host_heap}", *CONFIGS[a.config][1]]
        plan = plan_terms(args)
        env = {**os.environ, **dict(e.split("=", 1) for e in a.env),
               **({"HOST_TRACE_TRIM": "1"} if a.trim else {})}
        cmd = [str(Path(sys.executable).parent / "composer"), "-n", "2", "--stderr",
               f"{tmp}/rank{{rank}}.err", "--stdout", f"{tmp}/rank{{rank}}.out", "-m",
               "benchmarks.host_trace", "--worker", tmp, *args,
               f"loggers.jsonl.path={tmp}/metrics.jsonl"]
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # -m from tmp
        r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False)
        if r.returncode:
            sys.exit(f"the run failed:\n{r.stderr[-2000:]}\n" + "".join(
                p.read_text()[-3000:] for p in sorted(Path(tmp).glob("rank*.err"))))
        traces = [json.loads(Path(tmp, f"rank{k}.json").read_text()) for k in (0, 1)]
    emit(report(a, plan, traces), a.out)


def report(a, plan: dict, traces: list[dict]) -> str:  # noqa: ANN001
    host = plan["host"]
    terms = ", ".join(f"{k} {v / GIB:.3f}" for k, v in host["terms"].items() if v)
    lines = [f"\n### Host memory per rank, phase by phase: {a.config}, hidden {a.hidden} x "
             f"{a.layers} layers, seq {a.seq}, {a.steps} steps (issue 38)\n",
             f"Command: `python -m benchmarks.host_trace --hidden {a.hidden} --layers {a.layers} "
             f"--steps {a.steps} --seq {a.seq} --config {a.config} --host-heap {a.host_heap}"
             + (" --trim" if a.trim else "") + (f" --env {' '.join(a.env)}`" if a.env else "`") + ".",
             f"Planned host per rank {host['per_rank'] / GIB:.3f} GiB (terms, GiB: {terms}).", "",
             "| rank | step | phase | peak GiB | RSS at end | frozen | offloaded | trainable | grads | "
             "optimizer | heap in use, not named | heap free, kept | outside the heap |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, tr in enumerate(traces):
        rows = [r for r in tr["rows"] if r["step"] in (0, 1, 2, a.steps)]
        for r in rows:
            named = r["frozen"] + r["offloaded"] + r["trainable"] + r["grads"] + r["optimizer"]
            lines.append(f"| {k} | {r['step']} | {r['phase']} | {r['peak']:.3f} | {r['rss']:.3f} | "
                         f"{r['frozen']:.3f} | {r['offloaded']:.3f} | {r['trainable']:.3f} | "
                         f"{r['grads']:.3f} | {r['optimizer']:.3f} | {r['malloc_used'] - named:.3f} | "
                         f"{r['malloc_free']:.3f} | {r['rss'] - r['malloc_used'] - r['malloc_free']:.3f} |")
        peak = max(r["peak"] for r in tr["rows"])
        ends = [r["time"] for r in tr["rows"] if r["phase"] == "rest"]
        gaps = sorted(b - a for a, b in zip(ends[1:], ends[2:]))  # steps 3.. (2: warm-up)
        secs = f"; {gaps[len(gaps) // 2]:.2f} s a step (median of steps 3-{len(ends)})" if gaps else ""
        lines.append(f"| {k} | all | after imports {tr['imports']:.3f}; whole-run peak{secs} | "
                     f"{peak:.3f} | | | | | | | | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
