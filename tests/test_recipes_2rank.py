"""Every recipe in yamls/ runs, in its own configuration, on 2 CPU ranks: ``composer -n 2
train.py RECIPE`` (started as that launcher starts it: tests/launcher.py) with only the model
(a tiny model of the same family, saved in bf16 safetensors as the real one is), the data
paths, the sizes (with the learning rate and warmup of a 4-batch run) and the device
overridden, in the recipe's own precision (amp_bf16 on a CPU runs as bf16 autocast:
foundryx.train.composer_precision). Its init mode, LoRA, frozen base, offload, sharding,
activation checkpointing, compile setting, dataloader workers, callbacks and loggers are the
recipe's.

Each run works in a fresh folder (the recipe's relative ``runs/...`` paths land there) and must
exit 0 having trained 4 batches with a finite loss that falls, with a committed checkpoint where
the recipe saves one (adapters only for LoRA); a low-precision frozen base is checked per rank
(format, stored dtype, bytes, offloaded layers and their bytes).
``test_every_recipe_is_covered`` fails when a recipe is added to yamls/ without a way to run it
here (or a test elsewhere that runs it on 2 ranks).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import launcher
import pytest
import yaml

from benchmarks.instruments.recipe_sizes import (
    RECIPES,
    overrides,
    tiny_llama,
    tiny_mpt_export,
)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
# what a frozen base of each format stores its values as, and its bytes per weight (with the
# row scales, or NF4's block scalers) on all ranks together
STORED = {"fp8": "float8_e4m3fn", "int8": "int8", "nf4": "uint8", "bf16": "bfloat16"}
BYTES_PER_WEIGHT = {"fp8": (1.0, 1.1), "int8": (1.0, 1.1), "nf4": (0.5, 0.6), "bf16": (2.0, 2.1)}
HELD = re.compile(r"rank(\d+): INFO: foundryx: frozen_base on this rank: (\{.*\})")

# Recipes run on 2 ranks, in their own configuration, by another test.
ELSEWHERE = {"quickstart.yaml": "tests/test_concurrent_datasets.py (composer -n 2, 6 batches)",
             # a one-GPU recipe (no sharding to run on 2 ranks): trained as it ships on one
             # process there
             "finetune/llama-3.1-8b-lora-long.yaml": "tests/test_long_context.py (one process)"}


def recipe_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT / "yamls")) for p in (ROOT / "yamls").rglob("*.yaml")
                  if "shapes" not in p.parts)


def test_every_recipe_is_covered():
    missing = [r for r in recipe_files() if r not in RECIPES and r not in ELSEWHERE]
    assert not missing, f"recipes no test runs on 2 ranks: {missing}; add them to RECIPES"
    gone = [r for r in RECIPES if r not in recipe_files()]
    assert not gone, gone


@pytest.fixture(scope="module")
def models(quickstart_data, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("recipe_models")
    tok = quickstart_data / "tokenizer"
    out = {s: tiny_llama(s, tmp / s, tok) for s in ("llama-3.1-8b", "llama-3.1-70b",
                                                   "llama-3.1-405b")}
    out["mpt"] = tiny_mpt_export(tmp / "mpt", tok)
    return out


def launch(recipe: str, args: list[str], out: Path) -> tuple[int, str]:
    """``composer -n 2 train.py yamls/RECIPE ARGS`` in the folder ``out`` (started as the
    composer launcher starts it: tests/launcher.py); (exit code, logs)."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = launcher.launch([str(ROOT / "train.py"), str(ROOT / "yamls" / recipe), *args], 2,
                           out, out, env, timeout=900)
    return proc.returncode, "".join(f"\n--- {p.name}\n{p.read_text()[-6000:]}"
                                    for p in sorted(out.glob("rank*.*")))


def _leg(recipe: str):
    """The from-scratch MPT recipes run on the modern leg, the fine-tuning ones on the pinned
    leg (make test splits the slow set between the two torch legs: tests/conftest.py)."""
    marks = [pytest.mark.modern_leg] if RECIPES[recipe][0] == "scratch" else []
    return pytest.param(recipe, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [_leg(r) for r in sorted(RECIPES)])
def test_recipe_trains_on_two_ranks(recipe, models, quickstart_data, tmp_path):
    from foundryx.checkpoint.layout import complete_checkpoints
    from foundryx.loggers.jsonl import read_metrics

    metrics = tmp_path / "metrics-test.jsonl"
    code, logs = launch(recipe, [*overrides(recipe, models, quickstart_data),
                                 f"loggers.jsonl.path={metrics}"], tmp_path)
    assert code == 0, f"{recipe} failed on 2 ranks:\n{logs[-12000:]}"
    section = yaml.safe_load((ROOT / "yamls" / recipe).read_text())
    whole = "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.*")))  # every rank, all of it
    precision = section.get("precision", "fp32")
    if precision == "amp_bf16":  # run as shipped: bf16 autocast on the CPU (foundryx.train)
        assert "runs the forward and loss under torch's CPU autocast to bf16" in whole, logs[-4000:]
    if (section.get("parallelism") or {}).get("cp"):  # run as 2 context-parallel ranks
        assert "context parallel (Ulysses: all-to-all over heads) over 2 ranks" \
            in whole, logs[-4000:]
    losses = [r["loss/train/total"] for r in read_metrics(metrics) if "loss/train/total" in r]
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    assert sum(losses[-2:]) / 2 < losses[0], f"{recipe}: the loss did not fall: {losses}"
    frozen = (section.get("model") or {}).get("frozen_base")
    if frozen:
        check_frozen_base(frozen, whole)
    folder = str(section.get("save_folder", "")).replace("${variables.run_name}",
                                                         str(section.get("variables", {})
                                                             .get("run_name", "")))
    if folder:
        saved = complete_checkpoints(tmp_path / folder)
        assert saved and saved[0][1] is not None, f"{recipe}: no checkpoint in {folder}\n{logs[-4000:]}"
        assert saved[0][1].batch == STEPS, saved[0][1]
        if (section.get("model") or {}).get("peft_config"):
            check_adapter_only(saved[0][0])


def check_frozen_base(frozen: dict, logs: str) -> None:
    """What each rank logged it holds of the frozen base: the recipe's format, stored as that
    format's values; half the bytes each (sharded), at the format's bytes per weight; the
    recipe's share of layers offloaded, each rank half of their bytes in host memory."""
    held = {int(rank): json.loads(text) for rank, text in HELD.findall(logs)}
    assert sorted(held) == [0, 1], logs[-4000:]
    fmt, fraction = frozen["dtype"], frozen.get("offload_fraction", 0.0)
    for rank, h in held.items():
        assert (h["format"], h["stored_dtype"]) == (fmt, STORED[fmt]), (rank, h)
        assert h["offloaded"] == round(fraction * h["layers"]), (rank, h)
    total = sum(h["device_bytes"] + h["host_bytes"] for h in held.values())
    low, high = BYTES_PER_WEIGHT[fmt]
    assert low <= total / held[0]["weights"] <= high, (fmt, total, held)
    for key in ("device_bytes", "host_bytes"):
        a, b = held[0][key], held[1][key]
        assert abs(a - b) <= 0.1 * max(a, b), (key, held)  # each rank its half
    assert (held[0]["host_bytes"] > 0) == (fraction > 0), held


def check_adapter_only(checkpoint: Path) -> None:
    """A LoRA run's checkpoint holds the adapters and their optimizer state, not the base."""
    from torch.distributed.checkpoint import FileSystemReader

    assert json.loads((checkpoint / "lora_base.json").read_text())["adapter_only"] is True
    keys = FileSystemReader(str(checkpoint / "dcp")).read_metadata().state_dict_metadata
    model = [k for k in keys if k.startswith("model.")]
    assert model and all(".lora_" in k for k in model), [k for k in model if ".lora_" not in k][:5]
