"""End to end: train a small quickstart MPT, export its checkpoint as Llama, load it with plain
transformers, and fine-tune the export with hf_causal_lm under FSDP2 on 2 gloo processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
SMALL = ["model.d_model=64", "model.n_layers=2", "global_train_batch_size=8", "eval_interval=100ba"]
pytestmark = pytest.mark.slow


def run(cmd: list[str], nproc: int = 1, out: Path | None = None) -> subprocess.CompletedProcess:
    if nproc > 1:
        composer = shutil.which("composer", path=str(Path(sys.executable).parent))
        cmd = [composer, "-n", str(nproc), "--stdout", str(out / "rank{rank}.out"),
               "--stderr", str(out / "rank{rank}.err"), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def losses(path: Path) -> list[float]:
    return [row[LOSS] for row in read_metrics(path) if LOSS in row]


PLAIN_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({"cls": type(model).__name__, "foundryx": "foundryx" in sys.modules,
                  "logits": logits.tolist()}))
"""


@pytest.fixture(scope="module")
def pretrained(quickstart_data, tmp_path_factory):
    """A quickstart run of 8 batches (checkpoint + hf_export at the end) and its checkpoint."""
    out = tmp_path_factory.mktemp("pretrain")
    r = run(["train.py", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
             f"save_folder={out}/ckpt", f"loggers.jsonl.path={out}/metrics.jsonl",
             "max_duration=8ba", "save_interval=8ba", f"callbacks.hf_export.save_folder={out}/hf",
             *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_checkpoint_exports_as_llama_loadable_by_plain_transformers(pretrained, quickstart_data):
    from safetensors.torch import load_file

    from foundryx.checkpoint import load_model_weights
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    out = pretrained / "llama"
    r = run(["-m", "foundryx.cli", "export", str(pretrained / "ckpt"), str(out), "--config",
             "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}", *SMALL])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "export format: llama (a Llama-style MPT)" in r.stderr
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    r = run(["-c", PLAIN_LOAD, str(out), json.dumps(ids.tolist())])
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded["cls"] == "LlamaForCausalLM" and not loaded["foundryx"]

    model = ComposerMPTCausalLM(None, d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                                vocab_size=1024, attn_config={"rope": True}, norm_type="rmsnorm",
                                ffn_config={"ffn_type": "swiglu"}, no_bias=True)
    model.load_state_dict(load_model_weights(pretrained / "ckpt"))
    with torch.no_grad():
        want = model.model.eval()(ids).logits
    torch.testing.assert_close(torch.tensor(loaded["logits"]), want, atol=1e-5, rtol=0)
    # the hf_export callback wrote the same weights at the end of training
    callback = load_file(str(pretrained / "hf" / "ba8" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert callback.keys() == exported.keys()
    assert all(torch.equal(callback[k], exported[k]) for k in exported)


def test_checkpoint_of_a_training_run_exports_without_config(pretrained, capsys):
    """Checkpoints of ``foundryx train`` carry their model and tokenizer sections
    (``components.json``) and the model config and tokenizer (``hf/``), all hashed."""
    from safetensors.torch import load_file

    from foundryx.cli import main

    ckpt = pretrained / "ckpt"
    manifest = json.loads((ckpt / "latest" / "manifest.json").read_text())
    assert {"components.json", "hf/config.json", "hf/tokenizer.json"} <= set(manifest["files"])
    recorded = json.loads((ckpt / "latest" / "components.json").read_text())
    assert recorded["model"]["name"] == "mpt_causal_lm" and recorded["model"]["d_model"] == 64
    assert recorded["tokenizer"]["name"] == "hf"
    out = pretrained / "no-config"
    assert main(["export", str(ckpt), str(out), "--no-progress"]) == 0, capsys.readouterr().err
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    callback = load_file(str(pretrained / "hf" / "ba8" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert callback.keys() == exported.keys()
    assert all(torch.equal(callback[k], exported[k]) for k in exported)


def test_eval_reads_a_checkpoint_without_its_run_config(pretrained):
    from foundryx.checkpoint import load_model_weights
    from foundryx.eval.config import _model_problems
    from foundryx.eval.models import load_eval_model

    specs, problems = _model_problems([{"label": "run", "checkpoint": str(pretrained / "ckpt")}])
    assert problems == []
    model, tokenizer = load_eval_model(specs[0])
    assert type(model.model).__name__ == "MPTForCausalLM" and model.model.config.d_model == 64
    assert 1000 < len(tokenizer) <= model.model.config.vocab_size == 1024  # the quickstart BPE
    want = load_model_weights(pretrained / "ckpt")
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    _, problems = _model_problems([{"label": "x", "checkpoint": str(pretrained / "hf" / "ba8")}])
    assert len(problems) == 1 and "holds no record of its model" in problems[0]


def test_config_that_does_not_match_the_checkpoint(pretrained, quickstart_data, capsys):
    from foundryx.cli import main

    args = ["export", str(pretrained / "ckpt"), str(pretrained / "bad"), "--no-progress",
            "--config", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
            "model.n_layers=2"]  # d_model 128, but the checkpoint has 64
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "does not match the model config from model section of yamls/quickstart.yaml" in err
    assert re.search(r"model has shape \([^)]*128[^)]*\), checkpoint has \([^)]*64", err), err
    assert not (pretrained / "bad").exists()


def test_hf_finetune_of_the_export_under_fsdp2(pretrained, quickstart_data, tmp_path):
    from safetensors.torch import load_file

    from foundryx.checkpoint import load_model_weights

    export = pretrained / "hf" / "ba8"
    r = run(["train.py", "yamls/finetune/hf-causal-lm.yaml", f"variables.model_path={export}",
             f"variables.data_root={quickstart_data}", f"save_folder={tmp_path}/ckpt",
             f"loggers.jsonl.path={tmp_path}/metrics.jsonl", f"callbacks.hf_export.save_folder={tmp_path}/hf",
             "max_duration=8ba", "save_interval=8ba", "eval_interval=100ba", "global_train_batch_size=8",
             "optimizer.lr=1e-3"], nproc=2, out=tmp_path)
    logs = "".join(p.read_text() for p in tmp_path.glob("rank*.err"))
    assert r.returncode == 0, (r.stderr[-2000:], logs[-3000:])
    assert "FSDP2 FULL_SHARD over 2 ranks" in r.stderr and "peak host memory per rank" in r.stderr  # read shard by shard
    curve = losses(tmp_path / "metrics.jsonl")
    pretrain = losses(pretrained / "metrics.jsonl")
    assert len(curve) == 8, curve
    assert curve[0] < pretrain[0] - 0.5, (curve, pretrain)  # from the export, not from scratch
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3, curve
    # the FSDP2 run's own export holds the same weights as its sharded checkpoint
    exported = load_file(str(tmp_path / "hf" / "ba8" / "model.safetensors"))
    ckpt = load_model_weights(tmp_path / "ckpt")
    assert all(torch.equal(exported[k], ckpt["model." + k]) for k in exported)
    # the export's config ties lm_head to embed_tokens: trained as one tensor under FSDP2 and
    # init_device: meta, saved once, and plain transformers computes the run's own logits
    assert "lm_head.weight" not in exported
    assert torch.equal(ckpt["model.lm_head.weight"], ckpt["model.model.embed_tokens.weight"])
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    r = run(["-c", PLAIN_LOAD, str(tmp_path / "hf" / "ba8"), json.dumps(ids.tolist())])
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "hf" / "ba8"))
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt.items()})
    with torch.no_grad():
        want = model.eval()(ids).logits
    got = torch.tensor(json.loads(r.stdout.strip().splitlines()[-1])["logits"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # and `foundryx export` of that hf_causal_lm checkpoint needs no run config either
    r = run(["-m", "foundryx.cli", "export", str(tmp_path / "ckpt"), str(tmp_path / "out"),
             "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in again)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
