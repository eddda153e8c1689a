"""Scoring forward with logits only at the continuations (foundryx.eval.score) vs Composer's
``eval_forward`` (every position's logits) on the same batches, in one process, alternating.

    python benchmarks/eval_scoring.py [--task arc_challenge] [--shots 25] [--examples 8] [--rounds 2]

The model is eval_vs_llmfoundry.py's (seeded random Llama, hidden 64, 2 layers, vocabulary
8192); the task is a quick-suite task (eval/yamls/tasks.yaml) on ../shared/eval_data, its first
``--examples`` examples, batch 4. Prints the seconds of each path per round and checks that both
give the same outcome for every example and the same score.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from eval_vs_llmfoundry import ROOT, SHARED, build_model, task_entries  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="arc_challenge")
    ap.add_argument("--shots", type=int, default=25)
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    from composer.utils import get_device

    from foundryx.eval import runner
    from foundryx.eval.config import EvalModelSpec
    from foundryx.eval.data import prepare_task
    from foundryx.eval.models import load_eval_model
    from foundryx.eval.task_config import ICLTaskConfig

    folder = build_model(Path("/tmp/foundryx-eval-vs-llmfoundry"))
    entry = next(t for t in task_entries(str(ROOT / "eval/yamls/tasks.yaml"), SHARED / "eval_data")
                 if t["label"] == args.task)
    entry["num_fewshot"] = [args.shots]
    model, tokenizer = load_eval_model(EvalModelSpec(label="bench", hf=str(folder)))
    task = prepare_task(ICLTaskConfig(**entry), tokenizer, 2048, args.examples)[0]
    device, scorer = get_device("cpu"), runner._scorer
    times: dict[str, list[float]] = {"eval_forward": [], "continuations": []}
    results = {}
    for i in range(args.rounds):
        order = ["eval_forward", "continuations"] if i % 2 == 0 else ["continuations", "eval_forward"]
        for side in order:
            runner._scorer = scorer if side == "continuations" else (lambda *a: None)
            start = time.perf_counter()
            res = runner.evaluate_task(model, task, tokenizer, batch_size=args.batch_size,
                                       device=device, progress=False)
            times[side].append(time.perf_counter() - start)
            results.setdefault(side, res)
            print(f"round {i + 1} {side}: {times[side][-1]:.2f} s", flush=True)
    runner._scorer = scorer
    same = (results["eval_forward"].outcomes == results["continuations"].outcomes
            and results["eval_forward"].score == results["continuations"].score)
    ratios = [a / b for a, b in zip(times["eval_forward"], times["continuations"])]
    print(f"{task.key}, {len(task.examples)} examples, batch {args.batch_size}: eval_forward / "
          f"continuations median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max "
          f"{max(ratios):.2f}); same outcomes and score: {same}")


if __name__ == "__main__":
    main()
