"""Issue 54: a Qwen3 LoRA user's first hour on the commands they type (``foundryx train``,
``--dry-run``, the summary's next commands), in their own folder (tests/qwen3_first_hour.py):
a mistyped model path answers in seconds, config mistakes arrive in one round, a dry run
reads the data, and the summary's commands all work as printed."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from qwen3_first_hour import ROOT, chats, foundryx, user_folder, write_chats

CONFIG = "my-qwen3-lora.yaml"


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, tmp_path_factory) -> Path:
    """The user's folder, built once: copy it (``fresh``) before a command writes in it."""
    return user_folder(tmp_path_factory.mktemp("qwen3-user"), tiny_tokenizer.name_or_path)


@pytest.fixture
def fresh(setup, tmp_path) -> Path:
    return Path(shutil.copytree(setup, tmp_path / "user"))


def closed_port() -> int:
    """A local port nothing listens on (a hub endpoint that refuses at once, as a machine
    without network does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error(r) -> str:
    """Exit 2, one ``foundryx: error:`` message, no traceback: the message."""
    assert r.returncode == 2, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert r.stderr.count("foundryx: error:") == 1, r.stderr[-3000:]
    return r.stderr[r.stderr.index("foundryx: error:"):]


def test_a_model_path_without_dot_slash_answers_in_seconds(setup, tmp_path):
    """``variables.model_path=models/tiny-qwen`` (no ./, one letter short) online without a
    network: no minute of hub retries, no blame on the tokenizer; one line naming the
    nearest folder, and nothing written."""
    online = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
              "HF_HOME": str(tmp_path / "hf")}  # the tests' default is offline
    before = sorted(p.name for p in setup.iterdir())
    start = time.monotonic()
    r = foundryx(setup, "train", CONFIG, "variables.model_path=models/tiny-qwen",
                 env=online)
    took = time.monotonic() - start
    said = one_error(r)
    assert ("tokenizer.path and model.pretrained_model_name_or_path: 'models/tiny-qwen' is "
            "neither a local folder nor reachable on the Hugging Face hub (the Hugging Face hub "
            "is unreachable") in said, said
    assert "Did you mean ./models/tiny-qwen3?" in said, said
    assert "Retrying" not in r.stderr and "could not load tokenizer" not in said
    assert said.count("\n  - ") == 1, said  # one problem: the model and tokenizer's name
    assert took < 15, f"{took:.1f} s"  # the probe is refused at once; the rest is Python
    assert sorted(p.name for p in setup.iterdir()) == before


@pytest.mark.slow
def test_config_mistakes_arrive_in_one_round(fresh):
    """A typo at the top level and one in the LoRA section: both in the first message, each
    with its YAML path and did-you-mean (the second used to wait for the first's fix)."""
    text = (fresh / CONFIG).read_text()
    bad = text.replace("global_train_batch_size:", "global_train_batchsize:")
    (fresh / CONFIG).write_text(bad.replace("lora_alpha:", "lora_alpah:"))
    said = one_error(foundryx(fresh, "train", CONFIG))
    assert "global_train_batchsize: unknown key (did you mean 'global_train_batch_size'" in said
    assert "model.peft_config.lora_alpah: unknown option of the 'hf_causal_lm' model (did you " \
           "mean 'lora_alpha'?)" in said, said


@pytest.mark.slow
def test_a_dry_run_reads_the_data_as_the_run_does(fresh):
    """A chat line the run refuses (line 7 ends on the user) stops the dry run too, with the
    run's own message naming file:line; nothing is written."""
    rows = chats(12)
    rows[6]["messages"][-1]["role"] = "user"
    write_chats(fresh / "data" / "chat.jsonl", rows)
    said = one_error(foundryx(fresh, "train", CONFIG, "--dry-run"))
    line = ("data/chat.jsonl:7: the last message must be from the assistant (the response to "
            "learn), got role 'user' (or set skip_bad_examples: true to skip bad examples)")
    assert f"train_loader.dataset.path: {line}" in said, said
    assert not (fresh / "runs").exists()
    run = one_error(foundryx(fresh, "train", CONFIG))  # the run: the same line
    assert line in run, run


# In a process of its own, as a user's script: the merged export in plain transformers against
# the base with the adapter in plain peft, merged there and rounded to the base's dtype.
PLAIN = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, adapter, merged = sys.argv[1:]
ids = torch.arange(3, 19).reshape(2, 8)
ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                adapter).merge_and_unload().to(torch.bfloat16).float().eval()
ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
with torch.no_grad():
    a, b = ours(ids).logits, ref(ids).logits
print(json.dumps({"diff": (a - b).abs().max().item(), "scale": b.abs().max().item()}))
"""


@pytest.mark.slow
@pytest.mark.modern_leg
def test_a_lora_runs_next_commands_work_and_the_merge_keeps_bf16(fresh):
    """The summary of a Qwen3 LoRA run on chat data, run from the repository's root (where the
    quickstart's eval config is): no quickstart eval (its tasks are the quickstart world's
    facts), one line on how to add an eval, the adapter and merged exports and the report,
    each working as printed. The merged model is bf16 as the base is, and plain transformers
    gives the logits plain peft gives."""
    shutil.copytree(ROOT / "eval", fresh / "eval")
    r = foundryx(fresh, "train", CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    said = r.stdout + r.stderr
    block = said.split("\nnext:\n", 1)[1].splitlines()
    assert block == [
        "  foundryx export runs/qwen3-lora/checkpoints runs/qwen3-lora/export/adapter",
        "  foundryx export runs/qwen3-lora/checkpoints runs/qwen3-lora/export/merged --merged",
        "  foundryx report runs/qwen3-lora   # writes runs/qwen3-lora/report/report.md",
        "  (no eval command: this run names no eval config; write one as "
        "eval/yamls/my-qwen3-lora.yaml (docs/eval.md) and the summary prints its command)",
    ], said[-3000:]
    for line in block[:3]:
        command = shlex.split(line, comments=True)
        done = foundryx(fresh, *command[1:])
        assert done.returncode == 0, (line, done.stderr[-3000:])
    assert (fresh / "runs/qwen3-lora/report/report.md").is_file()

    merged, base = fresh / "runs/qwen3-lora/export/merged", fresh / "models/tiny-qwen3"
    assert dtypes(merged) == dtypes(base) == {"BF16"}
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
    said = subprocess.run([sys.executable, "-c", PLAIN, str(base),
                           str(fresh / "runs/qwen3-lora/export/adapter"), str(merged)],
                          capture_output=True, text=True, timeout=300, cwd=fresh)
    assert said.returncode == 0, said.stderr[-3000:]
    logits = json.loads(said.stdout.strip().splitlines()[-1])
    assert logits["diff"] <= 1e-3 * logits["scale"], logits


def dtypes(folder: Path) -> set[str]:
    """The dtypes of the tensors in a folder's safetensors files (read from their headers)."""
    found = set()
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        found |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return found
