"""ICL results do not depend on the eval batch size, on 1 vs 2 processes (gloo), nor on
whether Composer's evaluators or the standalone loop run them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from icl_fakes import run, task, write_jsonl

from foundryx.data.synthetic import world_facts
from foundryx.eval.config import load_eval_config
from foundryx.eval.run import run_eval
from foundryx.eval.task_config import ICLTaskConfig
from foundryx.models.mpt.composer import ComposerMPTCausalLM

ROOT = Path(__file__).parents[1]


def tiny_mpt(tokenizer):
    torch.manual_seed(0)
    return ComposerMPTCausalLM(tokenizer, d_model=32, n_heads=2, n_layers=2, max_seq_len=96,
                               vocab_size=448, attn_config={"attn_impl": "torch", "rope": True})


def task_files(folder: Path) -> dict[str, Path]:
    """Small LM, MC, schema and generation files from the synthetic world (13 examples each)."""
    facts = [(c, a.strip()) for c, a in world_facts(2)[:13]]
    answers = [a for _, a in facts]
    return {
        "language_modeling": write_jsonl(folder / "lm.jsonl", [
            {"context": c, "continuation": a} for c, a in facts]),
        "multiple_choice": write_jsonl(folder / "mc.jsonl", [
            {"query": c, "choices": [answers[(i + k) % 13] for k in range(i % 3 + 2)], "gold": 0}
            for i, (c, _) in enumerate(facts)]),
        "schema": write_jsonl(folder / "schema.jsonl", [
            {"context_options": [c, facts[(i + 1) % 13][0]], "continuation": a, "gold": i % 2}
            for i, (c, a) in enumerate(facts)]),
        "generation_task_with_answers": write_jsonl(folder / "gen.jsonl", [
            {"context": c, "answer": a} for c, a in facts]),
    }


def test_results_do_not_depend_on_batch_size(tiny_tokenizer, tmp_path):
    model = tiny_mpt(tiny_tokenizer)
    for kind, path in task_files(tmp_path).items():
        cfg = task(path, kind, num_fewshot=2, example_delimiter=". ", max_new_tokens=3)
        runs = [run(model, tiny_tokenizer, cfg, batch_size=bs, max_seq_len=96, dump=13) for bs in (1, 5)]
        for results in runs[1:]:
            for ref, res in zip(runs[0], results):
                assert res.outcomes == ref.outcomes and res.score == ref.score, (kind, res.key)
                for a, b in zip(ref.dumped, res.dumped):
                    if kind == "generation_task_with_answers":
                        assert a["output"] == b["output"]  # left padding does not change generation
                    else:
                        assert a.get("chosen") == b.get("chosen")
                        for ra, rb in zip(a["rows"], b["rows"]):
                            assert ra.get("loss", 0) == pytest.approx(rb.get("loss", 0), abs=1e-5)


def test_logits_at_continuations_only_score_as_eval_forward(tiny_tokenizer, tmp_path, monkeypatch):
    """The scoring forward keeps only the positions a metric reads (foundryx.eval.score); every
    row's loss, log-likelihood and predicted tokens equal Composer's eval_forward path's, on a
    Hugging Face Llama (mpt_causal_lm's: test_composer_evaluators_match_the_standalone_loop)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundryx.eval import runner
    from foundryx.eval.models import wrap_hf_model

    torch.manual_seed(0)
    model = wrap_hf_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=96)), tiny_tokenizer)
    files = task_files(tmp_path)
    configs = [task(files[k], k, num_fewshot=2, example_delimiter=". ")
               for k in ("language_modeling", "multiple_choice", "schema")]
    configs.append(task(files["multiple_choice"], "multiple_choice", num_fewshot=2, scoring="lm_eval",
                        label="mc_lm_eval"))
    assert runner.scoring_forward(runner.generation_model(model)) is not None
    fast = [run(model, tiny_tokenizer, c, batch_size=5, max_seq_len=96, dump=13) for c in configs]
    calls = []
    monkeypatch.setattr(runner, "_scorer", lambda *a: calls.append(a) and None)
    full = [run(model, tiny_tokenizer, c, batch_size=5, max_seq_len=96, dump=13) for c in configs]
    assert len(calls) == len(configs)
    for a, b in zip(fast, full):
        assert a[0].outcomes == b[0].outcomes and a[0].metrics == b[0].metrics
        assert a[0].dumped == b[0].dumped  # losses, log-likelihoods, predictions: bit for bit


def test_composer_evaluators_match_the_standalone_loop(tiny_tokenizer, tmp_path):
    from composer import Trainer
    from composer.loggers import InMemoryLogger

    from foundryx.config import TrainConfig
    from foundryx.eval.evaluators import build_icl_evaluators

    model = tiny_mpt(tiny_tokenizer)
    tasks = [{"label": kind, "dataset_uri": str(p), "icl_task_type": kind, "num_fewshot": 1,
              "max_seq_len": 96, **({"max_new_tokens": 3} if "generation" in kind else {})}
             for kind, p in task_files(tmp_path).items()]
    gauntlet = {"categories": [{"name": "all", "benchmarks": [
        {"name": t["label"], "num_fewshot": 1, "random_baseline": 0.1} for t in tasks]}]}
    cfg = TrainConfig(model={}, tokenizer={}, train_loader={}, max_duration="1ba", optimizer={},
                      global_train_batch_size=1, icl_tasks=tasks, eval_gauntlet=gauntlet)
    evaluators, callbacks = build_icl_evaluators(cfg, tiny_tokenizer, model, batch_size=4)
    logger = InMemoryLogger()
    trainer = Trainer(model=model, eval_dataloader=evaluators, callbacks=callbacks, loggers=[logger],
                      device="cpu", progress_bar=False, log_to_console=False)
    trainer.eval()
    in_training = {label: float(next(iter(m.values())).compute())
                   for label, m in trainer.state.eval_metrics.items()}
    standalone = {r.key: r.score for t in tasks
                  for r in run(model, tiny_tokenizer, ICLTaskConfig(**t), batch_size=3)}
    assert in_training == standalone and len(standalone) == 4
    rescaled = sum((s - 0.1) / 0.9 for s in standalone.values()) / 4
    assert logger.data["icl/gauntlet/all"][-1][1] == pytest.approx(rescaled)


def eval_config(folder: Path, model_dir: Path) -> Path:
    files = task_files(folder)
    tasks = [{"label": kind.split("_")[0], "dataset_uri": str(p), "icl_task_type": kind,
              "num_fewshot": 1, "example_delimiter": ". "} for kind, p in files.items()]
    tasks[-1]["max_new_tokens"] = 3
    cfg = {"models": [{"label": "tiny", "hf": str(model_dir)}], "icl_tasks": tasks,
           "max_seq_len": 96, "device_eval_batch_size": 3, "device": "cpu",
           "progress_bar": False, "dump_examples": 13}
    path = folder / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_results(tiny_tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    tiny_mpt(tiny_tokenizer).model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    cfg = eval_config(tmp_path, model_dir)
    outs = {1: tmp_path / "out1", 2: tmp_path / "out2"}
    run_eval(load_eval_config(str(cfg), [f"output_dir={outs[1]}"]))
    composer = shutil.which("composer", path=str(Path(sys.executable).parent))
    cmd = [composer, "-n", "2", "--stdout", str(tmp_path / "rank{rank}.out"), "--stderr",
           str(tmp_path / "rank{rank}.err"), "eval/eval.py", str(cfg), f"output_dir={outs[2]}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    logs = "".join(p.read_text() for p in tmp_path.glob("rank*.err"))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:], logs[-3000:])
    one, two = (json.loads((outs[n] / "results.json").read_text())["scores"]["tiny"] for n in (1, 2))
    assert len(one) == 4 and one == two
    dumps = [[json.loads(line) for line in (outs[n] / "examples.jsonl").read_text().splitlines()]
             for n in (1, 2)]
    assert len(dumps[0]) == 4 * 13 and len(dumps[1]) == len(dumps[0])
    for a, b in zip(*dumps):
        assert (a["task"], a["example"], a.get("output"), a.get("chosen"), a["correct"]) == (
            b["task"], b["example"], b.get("output"), b.get("chosen"), b["correct"])
