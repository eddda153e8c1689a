"""Warnings that used to leak (issue 39, item 10), seen where the user sees them: in the output
of a LoRA fine-tune of a Hugging Face Llama and of its dry run (transformers' "`torch_dtype`
is deprecated", said twice per run when foundryx passed and read `torch_dtype`), and the log
filter for streaming's `replication` reminder (a 2-process tp run's output:
tests/test_tp_docs.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundryx.runtime import known_warnings

ROOT = Path(__file__).parents[1]
DEPRECATED = "`torch_dtype` is deprecated"


def test_streaming_replication_reminder_is_dropped_and_other_streaming_lines_are_not(caplog):
    known_warnings.install_import_filters()
    logger = logging.getLogger("streaming.base.dataset")
    with caplog.at_level(logging.WARNING, logger="streaming.base.dataset"):
        logger.warning("The `replication` arg has been set to 2 and training is resuming from "
                       "sample 0. Make sure you are accounting for sample replication when "
                       "using StreamingDataset's `state_dict` method for deterministic "
                       "resumption. Otherwise, you will resume training from the wrong sample.")
        logger.warning("The `replication` arg is something else")
        logging.getLogger("streaming.base.other").warning(
            "The `replication` arg has been set to 2 and training is resuming from sample 0. "
            "Make sure you are accounting for sample replication")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["The `replication` arg is something else",
                    "The `replication` arg has been set to 2 and training is resuming from "
                    "sample 0. Make sure you are accounting for sample replication"]
    assert all(k.reason for _, k in known_warnings.KNOWN_LOGS)


@pytest.fixture(scope="module")
def bf16_llama(quickstart_data, tmp_path_factory) -> Path:
    """A tiny Llama stored in bfloat16 (as released checkpoints are) with the quickstart
    tokenizer: the run reads its stored dtype and says it trains float32 parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16_llama")
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128,
                                  vocab_size=1024)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(quickstart_data / "tokenizer").save_pretrained(out)
    return out


def _foundryx(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "foundryx.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_lora_run_and_its_dry_run_say_nothing_about_torch_dtype(bf16_llama, quickstart_data,
                                                                 tmp_path):
    recipe = ["yamls/finetune/llama-lora.yaml", f"variables.model_path={bf16_llama}",
              f"variables.data_root={quickstart_data}"]
    dry = _foundryx("train", "--dry-run", *recipe)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert DEPRECATED not in dry.stdout + dry.stderr
    run = _foundryx("train", *recipe, "max_duration=1ba", "eval_interval=1ba",
                    "eval_subset_num_batches=1", "save_folder=null",
                    f"loggers.jsonl.path={tmp_path}/metrics.jsonl")
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert DEPRECATED not in said, said[-3000:]
    # the stored dtype is still read (from the config's own attribute, which does not warn)
    assert "hf_causal_lm: the weights are stored as bfloat16" in said, said[-3000:]
