"""``implementation`` of an eval model: the native Llama gives transformers' scores on real
task files (generation, language modeling, multiple choice, schema), a one-process eval of it
imports neither transformers nor Composer nor torchmetrics, auto says which it took and why,
and native refuses what it cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from foundryx.errors import ConfigError, FoundryxError
from foundryx.eval.config import load_eval_config
from foundryx.eval.run import run_eval

ROOT = Path(__file__).resolve().parents[1]
# one task of each kind from the quick suite: generation (with normalisation), language
# modeling with categories, multiple choice, schema (gsm8k's answers take more tokens than
# this tokenizer's model holds; benchmarks/eval_vs_llmfoundry.py compares it)
TASKS = ("triviaqa", "jeopardy", "arc_easy", "winograd")


def _llama_folder(out: Path, **config) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from foundryx.data.synthetic import generate_corpus
    from foundryx.data.tokenizers import train_bpe_tokenizer

    tok = train_bpe_tokenizer(generate_corpus(200, seed=1), vocab_size=400, out_dir=out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "initializer_range": 0.5,  # sharp, varied outputs
        "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id, **config})).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return _llama_folder(tmp_path_factory.mktemp("native_llama"))


def _config(tmp_path: Path, shared: Path, models: list[dict]) -> Path:
    """An eval config of :data:`TASKS` (left out where ``shared`` lacks their files)."""
    tasks = yaml.safe_load((ROOT / "eval/yamls/tasks.yaml").read_text())["icl_tasks"]
    cfg = {"models": models, "icl_tasks": [t for t in tasks if t["label"] in TASKS],
           "icl_data_root": str(shared / "eval_data"), "icl_max_examples": 4,
           "max_seq_len": 512, "device": "cpu", "output_dir": str(tmp_path / "out"),
           "skip_missing_data": True}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.needs_shared
@pytest.mark.usefixtures("one_thread")  # a small model's steps: no OpenMP spinning under load
def test_native_scores_are_transformers_scores(llama, tmp_path, shared_dir, capfd):
    path = _config(tmp_path, shared_dir, [
        {"label": "native", "hf": str(llama), "implementation": "native"},
        {"label": "hf", "hf": str(llama), "implementation": "hf"}])
    scores = run_eval(load_eval_config(path), write=False).results.scores
    assert set(scores["native"]) == set(scores["hf"]) and len(scores["hf"]) >= len(TASKS)
    assert scores["native"] == scores["hf"]
    # the sharp random model gets some of them right: the comparison is not of zeros only
    assert any(0 < v < 1 for v in scores["hf"].values()), scores["hf"]
    err = capfd.readouterr().err
    assert f"model native: {llama} on foundryx's native Llama" in err, err[-2000:]
    assert f"model hf: {llama} (" in err, err[-2000:]


def test_auto_takes_transformers_where_the_native_llama_cannot_and_says_why(tmp_path, caplog):
    from foundryx.eval.models import EvalModels

    folder = _llama_folder(tmp_path / "biased", attention_bias=True)
    caplog.set_level("INFO", logger="foundryx")
    spec = load_eval_config(_config(tmp_path, tmp_path, [{"label": "b", "hf": str(folder)}])
                            ).models[0]
    model, _ = EvalModels().load(spec)
    assert not getattr(model, "native", False)
    assert any("model b: transformers (the native Llama does not run it: " in r.getMessage()
               and "attention_bias" in r.getMessage() for r in caplog.records), caplog.text
    spec.implementation = "native"
    with pytest.raises(FoundryxError, match="implementation: native cannot run .*attention_bias"):
        EvalModels().load(spec)


def test_native_with_an_adapter_is_refused_up_front(llama, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"models\[0\].implementation: native runs a Hugging "
                                          r"Face folder \(hf\) without an adapter"):
        load_eval_config(_config(tmp_path, tmp_path, [
            {"label": "a", "hf": str(llama), "adapter": str(adapter), "implementation": "native"}]))


@pytest.mark.slow
@pytest.mark.needs_shared
def test_a_native_eval_process_imports_no_transformers_composer_or_compiler(
        llama, tmp_path, shared_dir):
    """The point of the native path: the command's start-up. A fresh process evaluates every
    kind of task and then lists what it imported."""
    path = _config(tmp_path, shared_dir, [{"label": "n", "hf": str(llama)}])
    code = ("import json, sys\n"
            "from foundryx.eval.run import load_eval_config, run_eval\n"
            f"out = run_eval(load_eval_config({str(path)!r}), write=False)\n"
            "heavy = ('transformers', 'composer', 'torchmetrics', 'peft', 'mcli', 'torchao',"
            " 'torch._dynamo')\n"  # torch's compiler: 1.4-2.4 s (meta-device init imports it)
            "print(json.dumps({'loaded': sorted(m for m in sys.modules if m in heavy),"
            " 'results': len(out.results.scores['n'])}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report == {"loaded": [], "results": report["results"]} and report["results"] >= len(TASKS)
