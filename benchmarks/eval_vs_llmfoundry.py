"""foundryx eval vs LLM Foundry 0.22's eval on the same model, tasks and machine: per-task
numbers side by side, and the wall time of each, alternating.

    python -m benchmarks.eval_vs_llmfoundry [--tasks eval/yamls/tasks.yaml] [--examples N]
            [--rounds 1] [--batch-size 4] [--generation-batch-size N] [--profile]
            [--out benchmarks/RESULTS.md]

Installs LLM Foundry 0.22 in its own venv as benchmarks/vs_llmfoundry.py does (once, under
``--venv``). Builds one Hugging Face model folder both sides read: a byte-level BPE (vocab
8192) trained on ../shared/corpus/tinyshakespeare.txt and a seeded random Llama-style model
(``--hidden`` 64, 2 layers, 2048 positions, fp32) saved beside it; no hub. The tasks are a
foundryx task file (default: the quick suite, every task on ../shared/eval_data), handed to
LLM Foundry converted to its option names with absolute paths. Each side runs in a fresh
process: foundryx's command as a user runs it (``foundryx eval <config>``, writing its results
files and chart; its "call" is the command after ``import foundryx.cli``: it imports torch and
prepares the tasks at once, foundryx.eval.ahead, so those imports are inside), LLM Foundry's
``eval_from_yaml`` (the call: model load, data preparation and evaluation, not the imports);
whole-process seconds beside each. ``--examples N`` gives both sides a copy of the first N rows of each file (at least the
most few-shot examples a task asks for plus one, 26 for the quick suite's 25-shot
arc_challenge, and 16 so jeopardy_small's categories are whole). ``--profile`` runs foundryx once more under cProfile and
prints where the time goes.

``--by-task`` runs each task result (a task at one shot count) as its own pair of processes,
the two sides one after the other (alternating which goes first), and appends each side's
result to ``WORK/units.jsonl`` as it ends. Run again with the same ``--work``, it skips the
pairs already there, so a whole-file comparison that takes hours survives an interrupted
session; the summary comes once every pair is done. With ``--only``, one side's results are
added (the other's may come from another run); ``--partial`` runs nothing and prints the table
of the task results that both sides have so far. The total of each side is the sum of its
eval calls, each loading the (tiny) model again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.instruments.report_out import emit
from benchmarks.vs_llmfoundry import ensure_llmfoundry  # the same pinned venv

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

VOCAB, MAX_LEN = 8192, 2048

FOUNDRYX_RUN = """
import atexit, json, logging, sys, time
t0 = time.perf_counter()
from foundryx.cli import run
t1 = time.perf_counter()
task_s, impl = {}, set()
class Seen(logging.Handler):  # the command's own lines: seconds per task result, the model's path
    def emit(self, record):
        if record.name == "foundryx.eval.runner" and record.msg.startswith("%s: %d examples"):
            task_s[record.args[0]] = record.args[3]
        elif record.name == "foundryx.eval.models" and record.args and record.args[0] == "bench":
            impl.add("native" if "native Llama" in record.getMessage() else "transformers")
for name in ("foundryx.eval.runner", "foundryx.eval.models"):
    logging.getLogger(name).addHandler(Seen())
def report():  # after the command's work and its own exit handlers
    t2 = time.perf_counter()
    res = json.load(open(sys.argv[2] + ".out/results.json"))
    scores = {k: v for k, v in res["scores"]["bench"].items() if res["kinds"][k] in ("task", "metric")}
    json.dump({"eval_s": t2 - t1, "import_s": t1 - t0, "scores": scores, "task_s": task_s,
               "implementation": sorted(impl)}, open(sys.argv[2], "w"))
atexit.register(report)
run(["eval", sys.argv[1], f"output_dir={sys.argv[2]}.out", "python_log_level=info",
     "progress_bar=false"])
"""

LLMFOUNDRY_RUN = """
import json, sys, time
t0 = time.perf_counter()
from llmfoundry.command_utils import eval_from_yaml
t1 = time.perf_counter()
trainers, _ = eval_from_yaml(sys.argv[1], [])
t2 = time.perf_counter()
by_task = {}
for label, metrics in trainers[0].state.eval_metrics.items():
    task = "/".join(label.split("/")[:2])  # jeopardy/3-shot/<category> -> jeopardy/3-shot
    for metric in metrics.values():
        by_task.setdefault(task, []).append(float(metric.compute()))
scores = {k: sum(v) / len(v) for k, v in by_task.items()}  # categories: their mean, as LLM Foundry reports
json.dump({"eval_s": t2 - t1, "import_s": t1 - t0, "scores": scores}, open(sys.argv[2], "w"))
"""


def log(msg: str) -> None:
    print(f"[eval_vs_llmfoundry] {msg}", file=sys.stderr, flush=True)


def build_model(work: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A BPE tokenizer and a seeded random Llama-style model in one HF folder (reused)."""
    folder = work / f"llama-h{hidden}-l{layers}-s{seed}"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundryx.data.tokenizers import train_bpe_tokenizer

    corpus = SHARED / "corpus" / "tinyshakespeare.txt"
    if not corpus.exists():
        sys.exit(f"eval_vs_llmfoundry: needs {corpus} (../shared beside the checkout)")
    tok = train_bpe_tokenizer(corpus.read_text(encoding="utf-8").split("\n\n"), VOCAB, folder)
    tok.model_max_length = MAX_LEN
    tok.save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=MAX_LEN, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False, torch_dtype="float32",
                      initializer_range=0.2)  # sharper preferences than 0.02 gives
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return folder


def task_entries(tasks_file: str, data_root: Path, examples: int | None = None,
                 work: Path | None = None) -> list[dict]:
    """The task file's entries with absolute dataset paths (foundryx's names); with
    ``examples``, each reads a copy of the first N lines of its file (both sides then draw
    few-shot examples from, and evaluate, the same N rows: LLM Foundry's icl_subset_num_batches
    counts batches of rows, batch_size // choices examples for multiple choice)."""
    data = yaml.safe_load(Path(tasks_file).read_text())
    root = data_root if data_root else Path(data.get("data_root", "."))
    out = []
    for t in data["icl_tasks"]:
        t = dict(t)
        path = (root / t["dataset_uri"]).resolve()
        if examples and work is not None:
            copy = work / f"data-{examples}" / t["dataset_uri"]
            copy.parent.mkdir(parents=True, exist_ok=True)
            with path.open(encoding="utf-8") as f:
                copy.write_text("".join(line for _, line in zip(range(examples), f)), encoding="utf-8")
            path = copy
        t["dataset_uri"] = str(path)
        out.append(t)
    return out


def llmfoundry_entries(entries: list[dict]) -> list[dict]:
    names = {"stop_sequences": "early_stopping_criteria"}
    out = []
    for t in entries:
        t = {names.get(k, k): v for k, v in t.items()}
        t["num_fewshot"] = t["num_fewshot"] if isinstance(t["num_fewshot"], list) else [t["num_fewshot"]]
        out.append(t)
    return out


def configs(work: Path, model: Path, entries: list[dict], examples: int | None, batch: int,
            generation_batch: int | None = None, max_seq_len: int = MAX_LEN) -> dict:
    fx = {"models": [{"label": "bench", "hf": str(model)}], "icl_tasks": entries,
          "max_seq_len": max_seq_len, "device_eval_batch_size": batch, "precision": "fp32",
          "device": "cpu", "progress_bar": False, "output_dir": str(work / "fx-out"),
          "python_log_level": "warning"}
    if generation_batch:
        fx["generation_batch_size"] = generation_batch
    lf = {"models": [{"model_name": "bench",
                      "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(model),
                                "pretrained": True},
                      "tokenizer": {"name": str(model), "kwargs": {"model_max_length": max_seq_len}}}],
          "icl_tasks": llmfoundry_entries(entries), "max_seq_len": max_seq_len,
          "device_eval_batch_size": batch, "precision": "fp32", "seed": 17, "loggers": {},
          "python_log_level": "warning"}
    paths = {}
    for side, cfg in (("foundryx", fx), ("llmfoundry", lf)):
        paths[side] = work / f"{side}.yaml"
        paths[side].write_text(yaml.safe_dump(cfg, sort_keys=False))
    return paths


def run_side(side: str, py: Path, cfg: Path, work: Path, i: int, profile: bool = False) -> dict:
    result, script = work / f"{side}-{i}.json", work / f"{side}_run.py"
    script.write_text(FOUNDRYX_RUN if side == "foundryx" else LLMFOUNDRY_RUN)
    prof = ["-m", "cProfile", "-o", str(work / "foundryx.prof")] if profile else []
    cmd = [str(py), *prof, str(script), str(cfg), str(result)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if side == "foundryx":
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # as an installed package runs: its modules' bytecode cached (pip compiles LLM Foundry's at
    # install; a checkout's are written at the first import unless the caller's shell forbids
    # it, which would compile ~70 of foundryx's modules again in every process: ~0.15 s)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"eval_vs_llmfoundry: {side} failed:\n{p.stderr[-6000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(result.read_text())
    out["process_s"] = time.perf_counter() - start
    # the process's user + system CPU seconds: unlike wall time, not stretched by a busy neighbour
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out


def commit() -> str:
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "foundryx"],
                           capture_output=True, text=True).stdout.strip()
    return (p.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def task_units(entries: list[dict]) -> list[tuple[str, dict]]:
    """One (key, entry) per task result: a task with several shot counts becomes one each."""
    out = []
    for t in entries:
        shots = t["num_fewshot"] if isinstance(t["num_fewshot"], list) else [t["num_fewshot"]]
        out += [(f"{t['label']}/{n}-shot", {**t, "num_fewshot": [n]}) for n in shots]
    return out


def run_by_task(args, pys: dict, model: Path, entries: list[dict]) -> dict | None:
    """Each task result as its own pair of processes, resumable from WORK/units.jsonl; the
    per-side totals and scores once every pair is done, else None."""
    record = args.work / "units.jsonl"
    done = {}
    if record.exists():
        for line in record.read_text().splitlines():
            r = json.loads(line)
            done[(r["unit"], r["side"])] = r
    units, here = task_units(entries), {"commit": commit(), "cpu": cpu_model()}
    for i, (key, entry) in enumerate(units):
        unit_dir = args.work / "units" / key.replace("/", "_")
        unit_dir.mkdir(parents=True, exist_ok=True)
        cfgs = configs(unit_dir, model, [entry], args.examples, args.batch_size,
                       args.generation_batch_size, args.max_seq_len)
        order = ["foundryx", "llmfoundry"] if i % 2 == 0 else ["llmfoundry", "foundryx"]
        for side in order:
            if (key, side) in done or args.only not in (None, side) or args.partial:
                continue
            log(f"[{i + 1}/{len(units)}] {key}: {side}")
            out = run_side(side, pys[side], cfgs[side], unit_dir, 0)
            log(f"  {side}: {out['eval_s']:.1f} s ({out['cpu_s']:.1f} CPU s)")
            done[(key, side)] = {"unit": key, "side": side, **here, **out,
                                 "at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
            with record.open("a") as f:
                f.write(json.dumps(done[(key, side)]) + "\n")
    paired = [(k, e) for k, e in units if all((k, s) in done for s in ("foundryx", "llmfoundry"))]
    if len(paired) < len(units) and not (args.partial and paired):
        return None
    sides = {"of": len(units)}
    if len(paired) < len(units) and all((k, "foundryx") in done for k, _ in units):
        measured = {k for k, _ in paired}
        sides["foundryx_only"] = {k: done[(k, "foundryx")]["eval_s"] for k, _ in units
                                  if k not in measured}
    units = paired
    for s in ("foundryx", "llmfoundry"):
        runs = [done[(k, s)] for k, _ in units]
        sides[s] = {"eval_s": sum(r["eval_s"] for r in runs), "cpu_s": sum(r["cpu_s"] for r in runs),
                    "process_s": sum(r["process_s"] for r in runs),
                    "scores": {k: v for r in runs for k, v in r["scores"].items()},
                    "task_s": {k: done[(k, s)]["eval_s"] for k, _ in units}}
    sides["commits"] = sorted({done[(k, "foundryx")]["commit"] for k, _ in units})
    sides["cpus"] = sorted({done[(k, s)]["cpu"] for k, _ in units for s in ("foundryx", "llmfoundry")})
    sides["dates"] = sorted({done[(k, s)]["at"][:10] for k, _ in units for s in ("foundryx", "llmfoundry")})
    return sides


def by_task_text(res: dict, cmd: str) -> str:
    fx, lf = res["foundryx"], res["llmfoundry"]
    rows = "\n".join(
        f"| {k} | {fx['task_s'][k]:.1f} | {lf['task_s'][k]:.1f} | {lf['task_s'][k] / fx['task_s'][k]:.1f} |"
        for k in fx["task_s"])
    table, same, compared = scores_table(fx["scores"], lf["scores"])
    # each process pays a fixed cost (model load, trainer set-up) that a single run pays once.
    # LLM Foundry's total less (tasks - 1) x its shortest task's time, against foundryx's whole
    # total, is a floor of the single-run ratio: that task's time over-counts the fixed cost
    n = len(fx["task_s"]) - 1
    lf_floor = lf["eval_s"] - n * min(lf["task_s"].values())
    part = (f" ({len(fx['task_s'])} of {res['of']} task results: the others are not measured yet)"
            if len(fx["task_s"]) < res["of"] else "")
    bound = ""
    if res.get("foundryx_only"):  # foundryx ran every task result: LLM Foundry's part bounds the whole
        rows += "\n" + "\n".join(f"| {k} | {v:.1f} | not measured | |" for k, v in res["foundryx_only"].items())
        whole = fx["eval_s"] + sum(res["foundryx_only"].values())
        bound = (f"\n\nfoundryx's whole suite ({res['of']} task results): {whole:.1f} s. LLM Foundry's "
                 f"{len(fx['task_s'])} measured results alone take {lf['eval_s']:.1f} s ({lf_floor:.1f} s "
                 f"less the per-process cost), so on the whole suite LLM Foundry / foundryx is at least "
                 f"**{lf_floor / whole:.2f}**.")
    return (f"\n## foundryx eval vs LLM Foundry 0.22 eval, task by task, CPU (issue 25){part}\n\n"
            f"{', '.join(res['dates'])}. {', '.join(res['cpus'])}, {os.cpu_count()} cores; foundryx at "
            f"{', '.join(res['commits'])}. Command: `{cmd} --by-task`. Each task result is a pair of "
            f"fresh processes, one per side, one after the other; the totals are sums of the eval "
            f"calls.\n\n| task result | foundryx s | LLM Foundry s | LLM Foundry / foundryx |\n"
            f"|---|---:|---:|---:|\n{rows}\n| **total{' of the measured' if part else ''}** | **{fx['eval_s']:.1f}** | "
            f"**{lf['eval_s']:.1f}** | **{lf['eval_s'] / fx['eval_s']:.2f}** |\n| floor: LLM Foundry less "
            f"{n} x its shortest task (a per-process cost a single run pays once) | "
            f"{fx['eval_s']:.1f} | {lf_floor:.1f} | {lf_floor / fx['eval_s']:.2f} |{bound}\n\nProcess CPU "
            f"seconds: foundryx {fx['cpu_s']:.0f}, LLM Foundry {lf['cpu_s']:.0f} (ratio "
            f"{lf['cpu_s'] / fx['cpu_s']:.2f}). Scores: {same} of {compared} results identical."
            f"\n\n{table}\n")


def profile_summary(work: Path, top: int = 25) -> str:
    import io
    import pstats

    s = io.StringIO()
    pstats.Stats(str(work / "foundryx.prof"), stream=s).sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def scores_table(fx: dict, lf: dict) -> tuple[str, int, int]:
    keys = list(dict.fromkeys([*fx, *lf]))
    lines = ["| result | foundryx | LLM Foundry 0.22 | same |", "|---|---:|---:|---|"]
    same = 0
    for k in keys:
        a, b = fx.get(k), lf.get(k)
        # LLM Foundry's metrics are float32 (torchmetrics): k / n agrees to float32's precision
        eq = a is not None and b is not None and abs(a - b) <= 1e-6 * max(abs(b), 1e-6)
        same += eq
        cell = lambda v: "-" if v is None else f"{v:.6f}"  # noqa: E731
        lines.append(f"| {k} | {cell(a)} | {cell(b)} | {'yes' if eq else 'no'} |")
    compared = sum(1 for k in keys if k in fx and k in lf)
    return "\n".join(lines), same, compared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=str(ROOT / "eval/yamls/tasks.yaml"))
    ap.add_argument("--data-root", type=Path, default=SHARED / "eval_data")
    ap.add_argument("--examples", type=int, help="the first N examples of each task")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=MAX_LEN,
                    help=f"both sides' max_seq_len (the model has {MAX_LEN} positions)")
    ap.add_argument("--generation-batch-size", type=int,
                    help="foundryx's generation_batch_size (LLM Foundry has none: its generation "
                         "batches are --batch-size rows)")
    ap.add_argument("--profile", action="store_true", help="profile one more foundryx run")
    ap.add_argument("--by-task", action="store_true",
                    help="one pair of processes per task result, resumable from WORK/units.jsonl")
    ap.add_argument("--partial", action="store_true",
                    help="with --by-task: run nothing, print the table of the task results both sides "
                         "have so far")
    ap.add_argument("--only", choices=["foundryx", "llmfoundry"], help="run one side only")
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/foundryx-bench/llmfoundry")
    ap.add_argument("--work", type=Path,
                    default=Path(tempfile.gettempdir()) / "foundryx-eval-vs-llmfoundry")
    ap.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # --partial only reads the records: no LLM Foundry venv to install
    lf_py = ensure_llmfoundry(args.venv) if args.only != "foundryx" and not args.partial else None
    model = build_model(args.work, hidden=args.hidden)
    entries = task_entries(args.tasks, args.data_root, args.examples, args.work)
    most = max(max(t["num_fewshot"]) if isinstance(t["num_fewshot"], list) else t["num_fewshot"]
               for t in entries)
    if args.examples and args.examples < max(most + 1, 16):
        sys.exit(f"eval_vs_llmfoundry: --examples {args.examples} is too few: a task asks for "
                 f"{most} few-shot examples drawn from the same rows (and jeopardy_small's "
                 f"categories need 16); give at least {max(most + 1, 16)}")
    pys = {"foundryx": Path(sys.executable), "llmfoundry": lf_py}
    cmd = (f"python -m benchmarks.eval_vs_llmfoundry --tasks {os.path.relpath(args.tasks, ROOT)} "
           f"--rounds {args.rounds} --batch-size {args.batch_size} --hidden {args.hidden}"
           + (f" --examples {args.examples}" if args.examples else "")
           + (f" --max-seq-len {args.max_seq_len}" if args.max_seq_len != MAX_LEN else "")
           + (f" --generation-batch-size {args.generation_batch_size}" if args.generation_batch_size else ""))
    if args.by_task:
        res = run_by_task(args, pys, model, entries)
        if res is None:
            sys.exit("eval_vs_llmfoundry: not every task result has both sides yet; run again "
                     "(--partial: the table of those that have)")
        text = by_task_text(res, cmd)
        emit(text, args.out)
        return
    cfgs = configs(args.work, model, entries, args.examples, args.batch_size,
                   args.generation_batch_size, args.max_seq_len)
    rows = []
    for i in range(args.rounds):
        order = ["foundryx", "llmfoundry"] if i % 2 == 0 else ["llmfoundry", "foundryx"]
        order = [s for s in order if args.only in (None, s)]
        row = {"round": i + 1, "first": order[0]}
        for side in order:
            log(f"round {i + 1}/{args.rounds}: {side}")
            row[side] = run_side(side, pys[side], cfgs[side], args.work, i)
            log(f"  {side}: {row[side]['eval_s']:.1f} s (process {row[side]['process_s']:.1f} s, "
                f"{row[side]['cpu_s']:.1f} CPU s)")
            with (args.work / "runs.jsonl").open("a") as f:
                f.write(json.dumps({"round": i + 1, "side": side, **row[side]}) + "\n")
        rows.append(row)
    if args.profile:
        log("profiling foundryx")
        run_side("foundryx", pys["foundryx"], cfgs["foundryx"], args.work, 99, profile=True)
        print(profile_summary(args.work))
    if args.only:
        print(json.dumps(rows, indent=1))
        return
    times = "\n".join(
        f"| {r['round']} | {r['first']} | {r['foundryx']['eval_s']:.1f} / {r['foundryx']['process_s']:.1f} "
        f"| {r['llmfoundry']['eval_s']:.1f} / {r['llmfoundry']['process_s']:.1f} "
        f"| {r['llmfoundry']['eval_s'] / r['foundryx']['eval_s']:.2f} "
        f"| {r['foundryx']['cpu_s']:.0f} / {r['llmfoundry']['cpu_s']:.0f} |" for r in rows)
    ratios = [r["llmfoundry"]["eval_s"] / r["foundryx"]["eval_s"] for r in rows]
    # the whole command as a user times it (issue 55): each side's process, start to exit
    whole = [r["llmfoundry"]["process_s"] / r["foundryx"]["process_s"] for r in rows]
    impl = ", ".join(sorted({i for r in rows for i in r["foundryx"].get("implementation", [])}))
    table, same, compared = scores_table(rows[0]["foundryx"]["scores"], rows[0]["llmfoundry"]["scores"])
    import torch
    slowest = sorted(rows[0]["foundryx"].get("task_s", {}).items(), key=lambda kv: -kv[1])
    where = ", ".join(f"{k} {v:.1f} s" for k, v in slowest)
    text = (f"\n## foundryx eval vs LLM Foundry 0.22 eval, CPU (issue 25)\n\n{datetime.date.today()}. "
            f"{platform.machine()}, {os.cpu_count()} cores (shared with other work); torch "
            f"{torch.__version__} both sides; transformers: foundryx's venv vs LLM Foundry's pin "
            f"(4.51.3). Command: `{cmd}`. Model: seeded random Llama (hidden {args.hidden}, 2 "
            f"layers), byte-level BPE 8192 on tinyshakespeare; fp32, batch {args.batch_size}"
            + (f" (foundryx's generation tasks: generation_batch_size {args.generation_batch_size})"
               if args.generation_batch_size else "") + ", "
            f"max_seq_len {args.max_seq_len}; {'first ' + str(args.examples) if args.examples else 'all'} "
            f"examples of each task.\n\n| round | first | foundryx s (call / process) | LLM Foundry s "
            f"(call / process) | LLM Foundry / foundryx | process CPU s, foundryx / LLM Foundry |\n"
            f"|---|---|---:|---:|---:|---:|\n{times}\n\n"
            f"Speed-up (LLM Foundry / foundryx, the eval call): median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}); the whole processes: median "
            f"{statistics.median(whole):.2f} (min {min(whole):.2f}, max {max(whole):.2f}). "
            f"foundryx's model ran on: {impl or 'not recorded'}.\n\nScores (round 1): {same} of "
            f"{compared} results identical.\n\n{table}\n"
            + (f"\nfoundryx's time per task result (round 1, slowest first): {where}.\n"
               if where else ""))  # none with progress_bar: false (no line per task)
    emit(text, args.out)


if __name__ == "__main__":
    main()
