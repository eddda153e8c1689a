"""A plugin's model round-trips like a built-in one: trained with checkpoints, rebuilt by its
registry name from the checkpoint's components.json (rebuild_model, foundryx eval), exported
(foundryx export) with no run config; the logits stay the same all the way."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hf_tiny import VOCAB, hf_folder, token_batch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from foundryx import registry
from foundryx.checkpoint import load_model_weights, rebuild_model
from foundryx.checkpoint.callback import Checkpointer
from foundryx.checkpoint.layout import complete_checkpoints
from foundryx.config.components import build_component
from foundryx.eval.config import EvalModelSpec
from foundryx.eval.models import load_eval_model
from foundryx.export import export_checkpoint

ROOT = Path(__file__).parents[1]
PLUGIN = ROOT / "plugins" / "foundryx-example-plugin"
NAME = "tiny_gpt_in_process"  # not tiny_gpt: the installed plugin may hold that name


@pytest.fixture
def tiny_gpt(monkeypatch):
    """The example plugin's model, registered in this process under NAME."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    from foundryx_example_plugin.models import TinyGPT

    registry.models.register(NAME, TinyGPT)
    yield TinyGPT
    registry.models.unregister(NAME)


def fit(model, folder: Path, sections: dict, batches: int = 2):
    """Train ``model`` a few batches on random tokens, checkpointing into ``folder``."""
    from composer import Trainer
    from torch.utils.data import DataLoader

    batch = token_batch(batch=8, seq=16)
    samples = [{k: v[i] for k, v in batch.items()} for i in range(8)]
    ckpt = Checkpointer(str(folder), save_interval=f"{batches}ba", run_name="plugin",
                        model_section=sections["model"], tokenizer_section=sections["tokenizer"])
    trainer = Trainer(model=model, train_dataloader=DataLoader(samples, batch_size=4),
                      max_duration=f"{batches}ba", callbacks=[ckpt], device="cpu",
                      optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
                      progress_bar=False, log_to_console=False, seed=1)
    trainer.fit()
    trainer.close()
    return model.eval()


def logits(hf_model, ids):
    with torch.no_grad():
        return hf_model.eval()(input_ids=ids).logits


def test_plugin_model_round_trips_through_checkpoint_export_and_eval(tiny_gpt, tiny_tokenizer,
                                                                     tmp_path):
    sections = {"model": {"name": NAME, "width": 32, "depth": 2, "heads": 2, "context": 32,
                          "vocab": VOCAB},
                "tokenizer": {"name": "hf", "path": tiny_tokenizer.name_or_path}}
    model = build_component("models", sections["model"], tokenizer=tiny_tokenizer)
    trained = fit(model, tmp_path / "save", sections)
    ids = token_batch(2, 16, seed=5)["input_ids"]
    want = logits(trained.model, ids)

    (ckpt, _), = complete_checkpoints(tmp_path / "save")
    assert json.loads((ckpt / "components.json").read_text())["model"] == sections["model"]
    rebuilt = rebuild_model(tmp_path / "save")
    assert type(rebuilt.model) is tiny_gpt and rebuilt.origin == str(ckpt / "components.json")
    assert len(rebuilt.tokenizer) == len(tiny_tokenizer)
    torch.testing.assert_close(logits(rebuilt.model.model, ids), want, atol=0, rtol=0)

    out = export_checkpoint(tmp_path / "save", tmp_path / "hf", progress=False)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert type(exported) is GPT2LMHeadModel
    torch.testing.assert_close(logits(exported, ids), want, atol=0, rtol=0)

    evaluated, tokenizer = load_eval_model(EvalModelSpec(label="p", checkpoint=str(ckpt)))
    assert type(evaluated) is tiny_gpt and len(tokenizer) == len(tiny_tokenizer)
    torch.testing.assert_close(logits(evaluated.model, ids), want, atol=0, rtol=0)


def test_recorded_model_that_cannot_be_built_here_falls_back_to_hf(tmp_path, tiny_tokenizer,
                                                                   caplog, monkeypatch):
    """hf_causal_lm fine-tuned from a folder that is gone: rebuilt from hf/config.json instead,
    with one warning saying so."""
    import shutil

    base = hf_folder("llama", tmp_path / "base", tiny_tokenizer)
    sections = {"model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(base)},
                "tokenizer": {"name": "hf", "path": str(base)}}
    model = build_component("models", sections["model"], tokenizer=tiny_tokenizer)
    trained = fit(model, tmp_path / "save", sections)
    ids = token_batch(2, 16, seed=5)["input_ids"]
    shutil.rmtree(base)
    monkeypatch.setattr(logging.getLogger("foundryx"), "propagate", True)  # see log_setup.setup_logging
    with caplog.at_level(logging.WARNING, logger="foundryx"):
        rebuilt = rebuild_model(tmp_path / "save")
    assert "cannot build the recorded model here" in caplog.text and "hf/config.json" in caplog.text
    assert rebuilt.origin.endswith("hf/config.json")
    torch.testing.assert_close(logits(rebuilt.model.model, ids), logits(trained.model, ids),
                               atol=0, rtol=0)


# -- the installed plugin, end to end --------------------------------------------------------

REBUILD = """
import json, sys, torch
from foundryx.checkpoint import rebuild_model
rebuilt = rebuild_model(sys.argv[1])
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    out = rebuilt.model.model(input_ids=ids).logits
print(json.dumps({"cls": type(rebuilt.model).__name__, "logits": out.tolist()}))
"""


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.fixture
def installed_plugin():
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", str(PLUGIN)],
                   check=True, capture_output=True, timeout=300)
    yield
    subprocess.run([*pip, "uninstall", "-q", "-y", "foundryx-example-plugin"], check=True,
                   capture_output=True, timeout=300)


@pytest.mark.slow
def test_installed_plugin_model_trains_exports_and_evals(installed_plugin, quickstart_data,
                                                         tmp_path):
    run_cfg = yaml.safe_load((ROOT / "yamls" / "quickstart.yaml").read_text())
    run_cfg["model"] = {"name": "tiny_gpt", "width": 32, "depth": 2, "heads": 2,
                        "context": "${variables.max_seq_len}"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_cfg))
    r = run("train.py", str(tmp_path / "run.yaml"), f"variables.data_root={quickstart_data}",
            f"save_folder={tmp_path}/ckpt", f"loggers.jsonl.path={tmp_path}/metrics.jsonl",
            "max_duration=4ba", "save_interval=4ba", "eval_interval=100ba")
    assert r.returncode == 0, r.stderr[-3000:]
    recorded = json.loads((tmp_path / "ckpt" / "latest" / "components.json").read_text())
    assert recorded["model"] == {"name": "tiny_gpt", "width": 32, "depth": 2, "heads": 2,
                                 "context": 128}

    r = run("-m", "foundryx.cli", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"),
            "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # plain GPT-2, no plugin
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    want = logits(exported, ids)
    r = run("-c", REBUILD, str(tmp_path / "ckpt"), json.dumps(ids.tolist()))
    assert r.returncode == 0, r.stderr[-3000:]
    rebuilt = json.loads(r.stdout.strip().splitlines()[-1])
    assert rebuilt["cls"] == "TinyGPT"
    torch.testing.assert_close(torch.tensor(rebuilt["logits"]), want, atol=1e-6, rtol=0)
    weights = load_model_weights(tmp_path / "ckpt")
    exported_sd = exported.state_dict()
    assert all(torch.equal(weights["model." + k], v) for k, v in exported_sd.items()
               if "model." + k in weights)

    eval_cfg = yaml.safe_load((ROOT / "eval" / "yamls" / "quickstart.yaml").read_text())
    eval_cfg["models"] = [{"label": "plugin", "checkpoint": str(tmp_path / "ckpt")}]
    eval_cfg.pop("eval_gauntlet")
    eval_cfg["icl_tasks"] = eval_cfg["icl_tasks"][1:]  # facts_mc, 0-shot
    (tmp_path / "eval.yaml").write_text(yaml.safe_dump(eval_cfg))
    r = run("-m", "foundryx.cli", "eval", str(tmp_path / "eval.yaml"),
            f"variables.data_root={quickstart_data}", "icl_max_examples=8",
            f"output_dir={tmp_path}/results", "progress_bar=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "facts_mc" in r.stdout and "plugin" in r.stdout
