"""Exports as someone else uses them (issue 39, items 3 and 4): in a process of its own with
plain transformers + peft, the call a Hugging Face user types first,
``model.generate(**tok(text, return_tensors="pt"))``, works on every exported folder (hf
export, hf_export callback, PEFT adapter, merged); and under umask 022 every file of an export
and of a checkpoint is 0o644 and every folder 0o755, as any file the user makes, so a serving
container or a teammate running as another user can read them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.slow

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "max_duration=4ba",
        "eval_interval=4ba", "save_interval=4ba", "global_train_batch_size=4",
        "device_eval_batch_size=4", "eval_subset_num_batches=1", "compile.enabled=false"]
LORA_TINY = [o for o in TINY if not o.startswith("model.")]

# never imports foundryx: what a user with transformers and peft alone does with the folders
GENERATE = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
kind, folder, base = sys.argv[1], sys.argv[2], sys.argv[3:]
tok = AutoTokenizer.from_pretrained(folder)
if kind == "adapter":
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base[0]), folder)
else:
    model = AutoModelForCausalLM.from_pretrained(folder)
inputs = tok("hello", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
assert not any(name.startswith("foundryx") for name in sys.modules), "imported foundryx"
print(json.dumps({"inputs": sorted(inputs), "shape": list(out.shape)}))
"""


def run(cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FOUNDRYX_COMPILE": "0"}
    r = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600, umask=0o022)
    shown = ["<the script>" if arg == GENERATE else arg for arg in argv]
    assert r.returncode == 0, f"{shown}: exit {r.returncode}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def exported(quickstart_data, tmp_path_factory) -> Path:
    """The quickstart (with the hf_export callback), its export, a LoRA run on that export, and
    the LoRA run's adapter and merged exports, all under umask 022."""
    cwd = tmp_path_factory.mktemp("exports")
    data = f"variables.data_root={quickstart_data}"
    cli = ["-m", "foundryx.cli"]
    run(cwd, [*cli, "train", str(ROOT / "yamls/quickstart.yaml"), data, *TINY,
              "callbacks.hf_export.save_folder=runs/quickstart/hf_export"])
    run(cwd, [*cli, "export", "runs/quickstart/checkpoints", "runs/quickstart/export/hf"])
    run(cwd, [*cli, "train", str(ROOT / "yamls/finetune/llama-lora.yaml"), data, *LORA_TINY])
    run(cwd, [*cli, "export", "runs/llama-lora/checkpoints", "runs/llama-lora/export/adapter"])
    run(cwd, [*cli, "export", "runs/llama-lora/checkpoints", "--merged"])
    return cwd


@pytest.mark.parametrize("kind, folder", [
    ("hf", "runs/quickstart/export/hf"),
    ("hf", "runs/quickstart/hf_export/ba4"),
    ("adapter", "runs/llama-lora/export/adapter"),
    ("merged", "runs/llama-lora/export/merged"),
])
def test_generate_on_the_tokenizers_output(exported, kind, folder):
    base = ["runs/quickstart/export/hf"] if kind == "adapter" else []
    r = run(exported, ["-c", GENERATE, kind, folder, *base])
    said = json.loads(r.stdout.strip().splitlines()[-1])
    assert said["inputs"] == ["attention_mask", "input_ids"]  # no token_type_ids
    assert said["shape"][1] >= 2
    config = json.loads((exported / folder / "tokenizer_config.json").read_text())
    assert config["model_input_names"] == ["input_ids", "attention_mask"]


@pytest.mark.parametrize("folder", [
    "runs/quickstart/export/hf", "runs/quickstart/hf_export", "runs/llama-lora/export/adapter",
    "runs/llama-lora/export/merged", "runs/quickstart/checkpoints", "runs/llama-lora/checkpoints",
])
def test_exports_and_checkpoints_have_the_umasks_modes(exported, folder):
    root = exported / folder
    assert root.is_dir()
    wrong = []
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():  # checkpoints/latest
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        want = 0o755 if path.is_dir() else 0o644
        if mode != want:
            wrong.append(f"{path.relative_to(exported)}: {oct(mode)}, expected {oct(want)}")
    assert not wrong, "\n".join(wrong)
