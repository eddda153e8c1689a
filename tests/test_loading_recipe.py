"""The large-model LoRA recipe (yamls/finetune/llama-8b-lora-fp8.yaml: init_device meta, FP8
frozen base with a quarter offloaded, FSDP2, activation checkpointing) runs as shipped on 2
CPU processes through the composer launcher, with only the model (a tiny Llama saved in bf16
in several files with an index, as the real one is), data paths, sizes, device and precision
swapped; a folder with a file missing stops both ranks with one message and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundryx.loggers.jsonl import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
COMPOSER = Path(sys.executable).parent / "composer"


def tiny_bf16_llama(out: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, vocab_size=1024, torch_dtype="bfloat16")
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out, max_shard_size="60KB")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def run(folder: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    args = [f"variables.model_path={folder}", f"variables.data_root={data}",
            "variables.max_seq_len=64", "device=cpu", "precision=fp32", "compile=false",
            "global_train_batch_size=4", "device_train_microbatch_size=2",
            "device_eval_batch_size=2", "max_duration=4ba", "eval_interval=4ba",
            "eval_subset_num_batches=1", "console_log_interval=1ba", "save_folder=null",
            "train_loader.num_workers=0", "eval_loader.num_workers=0",
            "scheduler.t_warmup=0ba",
            f"loggers.jsonl.path={out}/metrics.jsonl", "progress_bar=false"]
    cmd = [str(COMPOSER), "-n", "2", "--stderr", str(out / "rank{rank}.err"),
           "--stdout", str(out / "rank{rank}.out"), "train.py",
           "yamls/finetune/llama-8b-lora-fp8.yaml", *args]
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def logs(out: Path, r: subprocess.CompletedProcess) -> str:
    return r.stdout + r.stderr + "".join(p.read_text() for p in sorted(out.glob("rank*.*")))


def test_large_model_recipe_loads_shard_by_shard_on_two_ranks(quickstart_data, tmp_path):
    folder = tiny_bf16_llama(tmp_path / "llama", quickstart_data / "tokenizer")
    assert (folder / "model.safetensors.index.json").is_file()
    r = run(folder, quickstart_data, tmp_path / "good")
    text = logs(tmp_path / "good", r)
    assert r.returncode == 0, text[-4000:]
    assert "loaded " in text and "peak host memory per rank" in text
    assert "bfloat16 -> fp8" in text and "offloaded to host memory" in text
    losses = [row["loss/train/total"] for row in read_metrics(tmp_path / "good" / "metrics.jsonl")
              if "loss/train/total" in row]
    assert len(losses) == 4 and all(x == x for x in losses), losses

    gone = sorted(folder.glob("model-*.safetensors"))[1]
    gone.unlink()
    r = run(folder, quickstart_data, tmp_path / "bad")
    text = logs(tmp_path / "bad", r)
    assert r.returncode != 0 and gone.name in text and "incomplete" in text, text[-4000:]
    assert "exited with code 2" in text and "Traceback" not in text, text[-4000:]
