"""foundryx's ``scoring: lm_eval`` vs the real lm-eval-harness (the ``lm_eval`` package) on
every multiple-choice file of ../shared/eval_data: acc and acc_norm side by side.

    python -m benchmarks.eval_vs_lmeval [--examples N] [--batch-size 4] [--out benchmarks/RESULTS.md]
            [--only foundryx|lm_eval] [--reuse foundryx|lm_eval]

Installs ``lm_eval[hf]`` (``--lm-eval-version``, default 0.4.13) with the same torch and
transformers as foundryx's venv in a venv of its own (once, under ``--venv``); it is not a
foundryx dependency. Both sides read one Hugging Face model folder, built as
benchmarks/eval_vs_llmfoundry.py builds it (seeded random Llama-style model, BPE tokenizer; no
hub). For each task (the quick suite's multiple_choice and schema tasks, at their few-shot
counts) the script writes an lm-eval task YAML that reads the jsonl file locally
(``dataset_path: json``, the file as the test split and as the few-shot split), with
``doc_to_text`` = the query and the task's continuation delimiter without its trailing
whitespace, and runs ``lm_eval.simple_evaluate`` (``hf`` model, fp32, CPU, few-shot seed 1234);
foundryx runs the same tasks with ``scoring: lm_eval``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.eval_vs_llmfoundry import MAX_LEN, ROOT, SHARED, build_model, task_entries
from benchmarks.instruments.report_out import emit

LM_EVAL_RUN = """
import json, sys, time
import lm_eval
from lm_eval.tasks import TaskManager
cfg = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
out = lm_eval.simple_evaluate(
    model="hf", model_args=f"pretrained={cfg['model']},dtype=float32,max_length={cfg['max_length']}",
    tasks=cfg["tasks"], task_manager=TaskManager(include_path=cfg["include"]), device="cpu",
    batch_size=cfg["batch_size"], limit=cfg["limit"], fewshot_random_seed=1234, random_seed=0,
    numpy_random_seed=1234, torch_random_seed=1234, log_samples=False)
t1 = time.perf_counter()
scores = {}
for task, res in out["results"].items():
    scores[task] = {m: res[m + ",none"] for m in ("acc", "acc_norm") if m + ",none" in res}
json.dump({"eval_s": t1 - t0, "scores": scores, "version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else ""},
          open(sys.argv[2], "w"))
"""

FOUNDRYX_RUN = """
import json, sys, time
from foundryx.eval.run import load_eval_config, run_eval
t0 = time.perf_counter()
out = run_eval(load_eval_config(sys.argv[1]), write=False)
t1 = time.perf_counter()
res = out.results
json.dump({"eval_s": t1 - t0, "scores": res.scores[res.models[0]]}, open(sys.argv[2], "w"))
"""


def log(msg: str) -> None:
    print(f"[eval_vs_lmeval] {msg}", file=sys.stderr, flush=True)


def ensure_lmeval(venv: Path, version: str) -> Path:
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import lm_eval"], capture_output=True).returncode == 0:
        return py
    import tokenizers
    import torch
    import transformers

    log(f"installing lm_eval {version} into {venv} (once; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                    f"transformers=={transformers.__version__}", f"tokenizers=={tokenizers.__version__}",
                    f"lm_eval[hf]=={version}"], check=True)
    return py


def lm_eval_yaml(task: dict, shots: int) -> dict:
    """An lm-eval task reading the task's jsonl file as its test and few-shot split."""
    delimiter = task.get("continuation_delimiter", " ").rstrip()
    prelimiter = task.get("prelimiter", "")
    schema = task["icl_task_type"] == "schema"
    text = "context_options" if schema else "query"
    if prelimiter or delimiter:  # a template; else the field itself
        doc_to_text = prelimiter + "{{" + text + "}}" + delimiter
    else:
        doc_to_text = text
    if schema:  # lm-eval's multiple-input form: doc_to_text is the gold index
        doc_to_text, choice, target = "gold", "context_options", "continuation"
        if prelimiter or delimiter:
            raise SystemExit(f"{task['label']}: a schema task with a prelimiter or delimiter is "
                             "not written for lm-eval here")
    else:
        choice, target = "choices", "gold"
    return {
        "task": f"fx_{task['label']}_{shots}shot", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": task["dataset_uri"]}},
        "test_split": "test", "fewshot_split": "test", "num_fewshot": shots,
        "output_type": "multiple_choice", "doc_to_text": doc_to_text, "doc_to_choice": choice,
        "doc_to_target": target, "target_delimiter": " ", "fewshot_delimiter": "\n\n",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=str(ROOT / "eval/yamls/tasks.yaml"))
    ap.add_argument("--data-root", type=Path, default=SHARED / "eval_data")
    ap.add_argument("--examples", type=int, help="the first N examples of each task")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lm-eval-version", default="0.4.13")
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/foundryx-bench/lmeval")
    ap.add_argument("--work", type=Path,
                    default=Path(tempfile.gettempdir()) / "foundryx-eval-vs-lmeval")
    ap.add_argument("--out", type=Path, help="append the result section to this markdown file")
    ap.add_argument("--reuse", choices=["foundryx", "lm_eval"],
                    help="read this side's result from the last run in --work (same settings) "
                         "instead of running it again")
    ap.add_argument("--only", choices=["foundryx", "lm_eval"],
                    help="run this side only and save its result for a later --reuse")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    py = ensure_lmeval(args.venv, args.lm_eval_version)
    # the model folder eval_vs_llmfoundry.py builds (and reuses) under its default --work
    model = build_model(Path(tempfile.gettempdir()) / "foundryx-eval-vs-llmfoundry",
                        hidden=args.hidden)
    tasks = [t for t in task_entries(args.tasks, args.data_root)
             if t["icl_task_type"] in ("multiple_choice", "schema") and not t.get("has_categories")]
    include = args.work / "lm_eval_tasks"
    include.mkdir(exist_ok=True)
    names, fx_tasks = {}, []
    for t in tasks:
        shots = t["num_fewshot"] if isinstance(t["num_fewshot"], list) else [t["num_fewshot"]]
        for k in shots:
            spec = lm_eval_yaml(t, k)
            (include / f"{spec['task']}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
            names[spec["task"]] = f"{t['label']}/{k}-shot"
        fx_tasks.append({**t, "scoring": "lm_eval"})
    lm_cfg = args.work / "lm_eval.json"
    lm_cfg.write_text(json.dumps({"model": str(model), "tasks": list(names), "include": str(include),
                                  "batch_size": args.batch_size, "limit": args.examples,
                                  "max_length": MAX_LEN}))
    fx_cfg = args.work / "foundryx.yaml"
    fx_cfg.write_text(yaml.safe_dump({
        "models": [{"label": "bench", "hf": str(model)}], "icl_tasks": fx_tasks,
        "max_seq_len": MAX_LEN, "device_eval_batch_size": args.batch_size, "precision": "fp32",
        "device": "cpu", "progress_bar": False, "python_log_level": "warning",
        "output_dir": str(args.work / "fx-out"),
        **({"icl_max_examples": args.examples} if args.examples else {})}, sort_keys=False))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(args.work / "hf-datasets")}
    runs = {}
    for side, interpreter, code, cfg in (("foundryx", Path(sys.executable), FOUNDRYX_RUN, fx_cfg),
                                         ("lm_eval", py, LM_EVAL_RUN, lm_cfg)):
        script, result = args.work / f"{side}_run.py", args.work / f"{side}.json"
        stamp = json.dumps({"cfg": Path(cfg).read_text(), "examples": args.examples})
        if args.only not in (None, side):
            continue
        if side == args.reuse:
            last = json.loads(result.read_text()) if result.exists() else {}
            if last.get("settings") != stamp:
                sys.exit(f"eval_vs_lmeval: --reuse {side}: no result of these settings in {args.work}")
            runs[side] = last
            log(f"{side}: reusing {result} ({last['eval_s']:.1f} s)")
            continue
        log(f"{side} on {len(names)} task results")
        script.write_text(code)
        side_env = {**env, "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")} \
            if side == "foundryx" else env
        start = time.perf_counter()
        p = subprocess.run([str(interpreter), str(script), str(cfg), str(result)], cwd=args.work,
                           capture_output=True, text=True, env=side_env)
        if p.returncode != 0:
            sys.exit(f"eval_vs_lmeval: {side} failed:\n{p.stderr[-6000:]}")
        runs[side] = {**json.loads(result.read_text()), "process_s": time.perf_counter() - start,
                      "settings": stamp}
        result.write_text(json.dumps(runs[side]))
        log(f"  {runs[side]['eval_s']:.1f} s")
    if args.only:
        return
    fx, lm = runs["foundryx"]["scores"], runs["lm_eval"]["scores"]
    lines = ["| task | examples | foundryx acc | lm_eval acc | foundryx acc_norm | lm_eval acc_norm | same |",
             "|---|---:|---:|---:|---:|---:|---|"]
    same = 0
    for lm_name, key in names.items():
        a, an = fx.get(key), fx.get(f"{key}/acc_norm")
        b, bn = lm.get(lm_name, {}).get("acc"), lm.get(lm_name, {}).get("acc_norm")
        eq = a is not None and b is not None and a == b and an == bn
        same += eq
        n = sum(1 for _ in open(next(t["dataset_uri"] for t in tasks if key.startswith(t["label"] + "/"))))
        n = min(n, args.examples) if args.examples else n
        cell = lambda v: "-" if v is None else f"{v:.10f}".rstrip("0")  # noqa: E731
        lines.append(f"| {key} | {n} | {cell(a)} | {cell(b)} | {cell(an)} | {cell(bn)} | {'yes' if eq else 'NO'} |")
    import torch
    import transformers
    cmd = ("python -m benchmarks.eval_vs_lmeval" + (f" --examples {args.examples}" if args.examples else "")
           + f" --batch-size {args.batch_size} --hidden {args.hidden}")
    text = (f"\n## foundryx `scoring: lm_eval` vs lm-eval-harness {args.lm_eval_version} (issue 25)\n\n"
            f"{datetime.date.today()}. {platform.machine()}, {os.cpu_count()} cores; torch "
            f"{torch.__version__}, transformers {transformers.__version__} on both sides. Command: "
            f"`{cmd}`. The multiple-choice tasks of eval/yamls/tasks.yaml on ../shared/eval_data, "
            f"one seeded random Llama-style model (eval_vs_llmfoundry.py's), fp32, CPU, batch "
            f"{args.batch_size}. {same} of {len(names)} task results identical in acc and acc_norm "
            f"(printed to 10 digits). Time: foundryx {runs['foundryx']['eval_s']:.0f} s, lm_eval "
            f"{runs['lm_eval']['eval_s']:.0f} s.\n\n" + "\n".join(lines) + "\n")
    emit(text, args.out)


if __name__ == "__main__":
    main()
