"""After the first LoRA run (issue 54): a Qwen3 LoRA user adapts yamls/finetune/llama-lora.yaml
to a tiny Qwen3 and 45 chat examples, trains, then continues from that run (load_path to its
checkpoint, weights only; or its exported adapter with the recipe's own init_device: meta),
resumes an interrupted run from the end of an epoch, and stops a run with Ctrl-C. Each step is
the user's command (``foundryx train`` / ``foundryx export``, in this process where a signal is
not involved, else a real process) in a folder of its own (the runs/ paths of the recipe)."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hf_families import save_family

from foundryx.checkpoint.layout import complete_checkpoints
from foundryx.cli import main
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
LOSS = "loss/train/total"
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def user(tmp_path_factory, tiny_tokenizer) -> Path:
    """The user's folder: a tiny Qwen3 with a ChatML tokenizer, 45 chat examples and
    my-qwen3-lora.yaml (the LoRA recipe with the model, the data and small sizes swapped)."""
    from foundryx.data.finetuning.examples import CHATML

    home = tmp_path_factory.mktemp("qwen3-user")
    tokenizer = copy.deepcopy(tiny_tokenizer)  # the session's, kept as it is
    tokenizer.chat_template = CHATML
    for name, sizes in (("tiny-qwen3", {}), ("other-qwen3", {"intermediate_size": 48})):
        save_family("qwen3", home / name, dtype="float32", **sizes)
        tokenizer.save_pretrained(home / name)
    chats = [{"messages": [{"role": "user", "content": f"Double {i}."},
                           {"role": "assistant", "content": f"{2 * i}"}]} for i in range(45)]
    (home / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    cfg = yaml.safe_load((ROOT / "yamls/finetune/llama-lora.yaml").read_text())
    cfg["variables"].update(model_path=str(home / "tiny-qwen3"), run_name="qwen3-lora", max_seq_len=64)
    cfg["train_loader"] = {"name": "finetuning", "drop_last": True, "dataset": {
        "path": str(home / "chat.jsonl"), "max_seq_len": "${variables.max_seq_len}", "shuffle_seed": 3}}
    cfg["eval_loader"] = None
    cfg["model"]["peft_config"].update(r=4, lora_alpha=8)
    cfg["scheduler"]["t_warmup"] = "2ba"
    cfg.update(global_train_batch_size=8, max_duration="10ba", save_interval="5ba",
               save_num_checkpoints_to_keep=-1, console_log_interval="1ba")
    assert cfg["model"]["init_device"] == "meta"  # the recipe's own
    (home / "my-qwen3-lora.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return home


def train(home: Path, *overrides: str) -> int:
    """``foundryx train my-qwen3-lora.yaml OVERRIDES`` in the user's folder."""
    return command(home, "train", "my-qwen3-lora.yaml", *overrides)


def command(home: Path, *argv: str) -> int:
    here = Path.cwd()
    os.chdir(home)
    try:
        return main(list(argv))
    finally:
        os.chdir(here)


def doc_commands() -> list[list[str]]:
    """The commands docs/finetuning.md gives for continuing my-qwen3-lora.yaml's run."""
    text = (ROOT / "docs/finetuning.md").read_text()
    return [shlex.split(line)[1:] for line in text.splitlines()
            if line.startswith(("foundryx train my-qwen3-lora.yaml", "foundryx export runs/qwen3-lora"))]


def losses(home: Path, run: str) -> dict[int, float]:
    return {r["batch"]: r[LOSS] for r in read_metrics(home / "runs" / run / "metrics.jsonl") if LOSS in r}


@pytest.fixture(scope="module")
def first_run(user) -> Path:
    """The first run: 10 batches, 5 to an epoch (45 examples, batch 8, drop_last)."""
    assert train(user) == 0
    return user / "runs/qwen3-lora/checkpoints"


def test_continue_from_a_lora_run_by_load_path_or_by_its_exported_adapter(user, first_run, capsys):
    """Item 1: load_path to the first run's checkpoint (same base, weights only) continues its
    adapters; so does its exported adapter as pretrained_lora_id_or_path on the recipe's
    init_device: meta, to the same loss; a different base is refused with facts that hold and a
    fix that applies."""
    (last, _), *_ = complete_checkpoints(first_run)
    assert last.name == "ep2-ba10"
    cont_cmd, export_cmd, adapter_cmd = doc_commands()
    assert cont_cmd[:2] == ["train", "my-qwen3-lora.yaml"] and f"load_path={last.relative_to(user)}" in cont_cmd
    assert command(user, *cont_cmd, "max_duration=2ba") == 0, capsys.readouterr().err
    cont = losses(user, "qwen3-cont")
    fresh = losses(user, "qwen3-lora")
    # the same first batch (same seed and shuffle): the trained adapters give a lower loss
    assert cont[1] < fresh[1] - 0.02, (cont, fresh)
    record = json.loads((user / "runs/qwen3-cont/checkpoints/ep0-ba2/lora_base.json").read_text())
    assert record["source_field"] == "model.pretrained_model_name_or_path", record
    assert record["source"] == str(user / "tiny-qwen3") and record["adapter_only"], record

    # the documented alternative: export the adapter, start from it (init_device: meta)
    assert command(user, *export_cmd) == 0
    assert command(user, *adapter_cmd, "max_duration=2ba") == 0, capsys.readouterr().err
    assert losses(user, "qwen3-from-adapter") == cont  # the same adapters, the same run

    # another base: refused, both bases named as they are, and a fix that applies
    capsys.readouterr()
    code = train(user, "variables.run_name=qwen3-other", f"variables.model_path={user}/other-qwen3",
                 f"load_path={last}", "load_weights_only=true", "max_duration=2ba")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("foundryx: error:") == 1, err
    assert (f"load_path {last} holds LoRA adapters trained on model.pretrained_model_name_or_path: "
            f"{user / 'tiny-qwen3'} (config sha256 ") in err, err
    assert f"this run's base is model.pretrained_model_name_or_path: {user / 'other-qwen3'}" in err
    assert (f"set model.pretrained_model_name_or_path: {user / 'tiny-qwen3'} (the base they were "
            "trained on), or drop load_path to train new adapters on this base") in err, err
    assert not (user / "runs/qwen3-other/checkpoints").exists() or \
        not complete_checkpoints(user / "runs/qwen3-other/checkpoints")


@pytest.mark.parametrize("drop_last, per_epoch", [(True, 5), (False, 6)])
def test_a_resume_at_the_end_of_an_epoch_is_exact(user, drop_last, per_epoch, recwarn):
    """Item 3: the checkpoint at the last batch of epoch 0 (without drop_last, a partial batch)
    resumes to the uninterrupted run's losses, bit for bit, and Composer runs no empty epoch."""
    sizes = [f"max_duration={per_epoch + 2}ba", f"save_interval={per_epoch}ba",
             f"train_loader.drop_last={str(drop_last).lower()}"]
    whole, cut = f"whole-{drop_last}", f"cut-{drop_last}"
    assert train(user, f"variables.run_name={whole}", *sizes) == 0
    saved = user / "runs" / whole / "checkpoints" / f"ep1-ba{per_epoch}"  # as epoch 1 starts
    assert saved.is_dir(), sorted(p.name for p in saved.parent.iterdir())
    shutil.copytree(saved, user / "runs" / cut / "checkpoints" / saved.name)  # interrupted there
    assert train(user, f"variables.run_name={cut}", *sizes) == 0
    expected = losses(user, whole)
    assert losses(user, cut) == {b: expected[b] for b in (per_epoch + 1, per_epoch + 2)}
    assert not [w for w in recwarn if "No batches were trained" in str(w.message)]


def start(user: Path, run: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """``foundryx train`` in a real process, a checkpoint every batch."""
    cmd = [sys.executable, "-m", "foundryx.cli", "train", "my-qwen3-lora.yaml",
           f"variables.run_name={run}", "max_duration=1000ba", "save_interval=1ba", *overrides]
    log = user / f"{run}.log"
    with log.open("w") as f:
        p = subprocess.Popen(cmd, cwd=user, stdout=f, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
                                 [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    return p, log


def after_batch_1(user: Path, run: str, p: subprocess.Popen, log: Path) -> None:
    metrics, deadline = user / "runs" / run / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and any(LOSS in r for r in read_metrics(metrics))):
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no batch 1 in 600 s"
        time.sleep(0.02)


def since_saved(folder: Path, done: int) -> str:
    """What stopping at once after ``done`` batches loses, from the checkpoints on disk."""
    found = complete_checkpoints(folder) if folder.is_dir() else []
    saved = found[0][1].batch if found else 0
    lost = ("nothing" if done == saved else f"batch {done}" if done == saved + 1
            else f"batches {saved + 1}-{done}")
    return f"{lost} ({f'the last checkpoint is batch {saved}' if found else 'no checkpoint yet'})"


def test_ctrl_c_saves_after_the_batch_and_twice_stops_at_once(user):
    """Item 4: one Ctrl-C: a checkpoint after the current batch, one line, exit 130; two: stop at
    once, one line naming the batches lost since the last checkpoint, exit 130; the same command
    then continues from the last checkpoint. (Both processes start together: half the wait.)"""
    once, once_log = start(user, "ctrl-c")
    # batches of 4 microbatches: the second Ctrl-C comes while the first waits for the batch
    twice, twice_log = start(user, "ctrl-c-twice", "device_train_microbatch_size=2")
    after_batch_1(user, "ctrl-c", once, once_log)
    once.send_signal(signal.SIGINT)
    after_batch_1(user, "ctrl-c-twice", twice, twice_log)
    twice.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 600
    while "foundryx: Ctrl-C: stopping" not in twice_log.read_text():  # the first is handled
        assert twice.poll() is None and time.monotonic() < deadline, twice_log.read_text()[-3000:]
        time.sleep(0.005)
    twice.send_signal(signal.SIGINT)

    assert once.wait(timeout=600) == 130, once_log.read_text()[-3000:]
    said = once_log.read_text()
    assert "Traceback" not in said, said[-3000:]
    stop = int(re.search(r"foundryx: Ctrl-C: stopping after batch (\d+) with a checkpoint, then "
                         r"exit 130; Ctrl-C again stops at once, losing ", said)[1])
    (ckpt, manifest), *_ = complete_checkpoints(user / "runs/ctrl-c/checkpoints")
    assert manifest.batch == stop == max(losses(user, "ctrl-c")), said[-3000:]

    assert twice.wait(timeout=600) == 130, twice_log.read_text()[-3000:]
    said = twice_log.read_text()
    assert "Traceback" not in said, said[-3000:]
    done, folder = max(losses(user, "ctrl-c-twice")), user / "runs/ctrl-c-twice/checkpoints"
    assert (f"foundryx: Ctrl-C again: stopped at once in batch {done + 1}; lost: "
            f"{since_saved(folder, done)}; exit 130") in said, said[-3000:]
    # the same command continues from the last checkpoint (the save folder's lock was released)
    assert train(user, "variables.run_name=ctrl-c-twice", f"max_duration={done + 1}ba") == 0
    assert complete_checkpoints(folder)[0][1].batch == done + 1
