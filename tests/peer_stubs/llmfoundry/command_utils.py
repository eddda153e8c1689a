"""The three entry points of LLM Foundry 0.22's ``llmfoundry.command_utils`` the benchmarks
call, with its parameter names; each checks its input and answers in the peer's form."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace


def _read(yaml_path: str) -> dict:
    import yaml

    return yaml.safe_load(Path(yaml_path).read_text())


def train_from_yaml(yaml_path: str, args_list: list[str] | None = None):
    """Checks the run config (LLM Foundry's keys) and trains a tiny Composer model for its
    ``max_duration``, so the benchmark's ``Trainer.fit`` wrapper times a real fit."""
    import torch
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    cfg = _read(yaml_path)
    for key in ("model", "tokenizer", "train_loader", "optimizer", "max_duration",
                "global_train_batch_size", "max_seq_len"):
        assert key in cfg, f"LLM Foundry's train config needs {key}"
    assert cfg["model"]["name"] == "mpt_causal_lm", cfg["model"]
    assert Path(cfg["tokenizer"]["name"], "tokenizer.json").is_file(), cfg["tokenizer"]
    assert Path(cfg["train_loader"]["dataset"]["local"], "train", "index.json").is_file()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 2))
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    trainer = Trainer(model=ComposerClassifier(net, num_classes=2),
                      train_dataloader=DataLoader(data, batch_size=4),
                      max_duration=cfg["max_duration"], device="cpu", progress_bar=False,
                      loggers=[], save_folder=None)
    trainer.fit()
    return trainer


def eval_from_yaml(yaml_path: str, args_list: list[str] | None = None):
    """Checks the eval config and each task's file; answers ``(trainers, gauntlet)`` with one
    trainer whose ``state.eval_metrics`` has a metric per task and shot count."""
    cfg = _read(yaml_path)
    (model,) = cfg["models"]
    assert Path(model["model"]["pretrained_model_name_or_path"], "config.json").is_file()
    metrics = {}
    for task in cfg["icl_tasks"]:
        assert Path(task["dataset_uri"]).is_file(), task["dataset_uri"]
        for shots in task["num_fewshot"]:  # LLM Foundry reads a list
            metric = SimpleNamespace(compute=lambda: 0.0)
            metrics[f"{task['label']}/{shots}-shot"] = {"InContextLearningMetric": metric}
    trainer = SimpleNamespace(state=SimpleNamespace(eval_metrics=metrics))
    return [trainer], None


def convert_text_to_mds(tokenizer_name: str, output_folder: str, input_folder: str,
                        concat_tokens: int, eos_text: str, bos_text: str, no_wrap: bool,
                        compression: str | None, processes: int, args_str: str, reprocess: bool,
                        trust_remote_code: bool) -> None:
    """Checks the folder of text files and the tokenizer; writes a stand-in index."""
    assert Path(tokenizer_name, "tokenizer.json").is_file(), tokenizer_name
    files = sorted(Path(input_folder).glob("*.txt"))
    assert files, f"no text files in {input_folder}"
    assert not os.path.exists(output_folder), "LLM Foundry refuses a folder that exists"
    Path(output_folder).mkdir(parents=True)
    Path(output_folder, "index.json").write_text('{"shards": [], "version": 2}')
