"""The setup of a Qwen3 LoRA user's first hour (issue 54), built locally: a tiny Qwen3 saved as
bf16 with a ChatML tokenizer in ``models/tiny-qwen3``, chat examples in ``data/chat.jsonl``
and ``my-qwen3-lora.yaml``, the repository's ``yamls/finetune/llama-lora.yaml`` adapted as the
user adapts it (the model path, a ``finetuning`` loader on the chat data, small sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from hf_families import save_family

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
            for i in range(n)]


def write_chats(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chatml_tokenizer(bpe: str, folder: Path) -> None:
    """The tokenizer of folder ``bpe`` (the tests' tiny BPE) with ChatML's special tokens and
    template, saved in ``folder``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bpe)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(folder))


def run_config(model_path: str = "./models/tiny-qwen3") -> dict:
    """llama-lora.yaml as the user adapts it for the Qwen3 and the chat data."""
    cfg = yaml.safe_load((ROOT / "yamls/finetune/llama-lora.yaml").read_text())
    cfg["variables"].update(model_path=model_path, run_name="qwen3-lora", max_seq_len=64)
    cfg["variables"].pop("data_root")
    loader = {"name": "finetuning", "drop_last": True, "num_workers": 0,
              "dataset": {"path": "data/chat.jsonl", "max_seq_len": "${variables.max_seq_len}"}}
    cfg["train_loader"] = loader
    cfg["eval_loader"] = {**loader, "drop_last": False,
                          "dataset": {**loader["dataset"], "shuffle": False}}
    cfg.update(max_duration="2ba", eval_interval="2ba", save_interval="2ba",
               global_train_batch_size=4, device_eval_batch_size=4, eval_subset_num_batches=1,
               console_log_interval="1ba")
    cfg["model"]["peft_config"].update(r=4, lora_alpha=8)
    return cfg


def user_folder(root: Path, bpe: str, n_chats: int = 24) -> Path:
    """The user's working folder: models/tiny-qwen3 (bf16, ChatML), data/chat.jsonl and
    my-qwen3-lora.yaml."""
    model = root / "models" / "tiny-qwen3"
    save_family("qwen3", model)
    chatml_tokenizer(bpe, model)
    (root / "data").mkdir()
    write_chats(root / "data" / "chat.jsonl", chats(n_chats))
    (root / "my-qwen3-lora.yaml").write_text(yaml.safe_dump(run_config(), sort_keys=False))
    return root


def foundryx(cwd: Path, *args: str, env: dict | None = None, timeout: int = 600
             ) -> subprocess.CompletedProcess:
    """``foundryx ARGS`` as the user types it, in ``cwd``, with this checkout's foundryx."""
    base = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "foundryx.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env={**base, **(env or {})})
