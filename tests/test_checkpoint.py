"""Checkpoints in one process: layout, atomic commit, keep-K, exact resume, fallback, errors."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from composer.core import Callback

from foundryx.checkpoint import load_model_weights
from foundryx.checkpoint import save as saving
from foundryx.checkpoint.callback import Checkpointer
from foundryx.checkpoint.layout import MANIFEST, complete_checkpoints
from foundryx.errors import CheckpointError

VOCAB, SEQ = 64, 16


class LossRecorder(Callback):
    """Keeps each batch's loss and learning rate."""

    def __init__(self):
        self.losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}

    def batch_start(self, state, logger):
        self.lrs[int(state.timestamp.batch) + 1] = state.optimizers[0].param_groups[0]["lr"]

    def batch_end(self, state, logger):
        self.losses[int(state.timestamp.batch)] = float(state.loss)


def make_trainer(folder: Path | None, max_duration: str = "3ba", d_model: int = 32,
                 lr: float = 3e-3, optimizer=None, **ckpt_kw):
    """A tiny MPT Trainer on fixed random tokens with a Checkpointer saving every batch;
    ``optimizer(params, lr=...)`` (default Composer's DecoupledAdamW)."""
    from composer import Trainer
    from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW
    from composer.utils import reproducibility
    from torch.utils.data import DataLoader

    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    reproducibility.seed_all(3)
    model = ComposerMPTCausalLM(None, d_model=d_model, n_heads=2, n_layers=2, max_seq_len=SEQ,
                                vocab_size=VOCAB)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g)} for _ in range(64)]
    ckpt_kw.setdefault("run_name", "test")
    ckpt = Checkpointer(str(folder) if folder else None, save_interval="1ba", **ckpt_kw)
    rec = LossRecorder()
    trainer = Trainer(
        model=model, train_dataloader=DataLoader(data, batch_size=4), max_duration=max_duration,
        optimizers=(optimizer or DecoupledAdamW)(model.parameters(), lr=lr),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="2ba"),
        callbacks=[ckpt, rec], device="cpu", seed=3, progress_bar=False, log_to_console=False,
    )
    return trainer, ckpt, rec


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` with its bytes and mtime (to prove nothing was touched)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict[int, float]]:
    """A save_folder after 3 batches saved every batch, keeping 2; and the final weights."""
    folder = tmp_path_factory.mktemp("ckpt") / "save"
    trainer, _, rec = make_trainer(folder, keep=2)
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.state.model.state_dict().items()}
    trainer.close()
    return folder, weights, rec.losses


@pytest.fixture
def copy_of(saved, tmp_path) -> Path:
    dst = tmp_path / "save"
    shutil.copytree(saved[0], dst, symlinks=True)
    return dst


def test_layout_keep_last_k_and_latest(saved):
    folder, _, _ = saved
    assert sorted(p.name for p, _ in complete_checkpoints(folder)) == ["ep0-ba2", "ep0-ba3"]
    assert os.readlink(folder / "latest") == "ep0-ba3"
    manifest = json.loads((folder / "ep0-ba3" / MANIFEST).read_text())
    assert manifest["batch"] == 3 and manifest["world_size"] == 1 and manifest["run_name"] == "test"
    assert {"dcp/.metadata", "trainer_state.json", "rng/rank0.json"} <= set(manifest["files"])
    assert not list(folder.glob(".tmp-*"))


def test_load_model_weights_is_the_full_state_dict(saved):
    folder, weights, _ = saved
    for path in (folder, folder / "ep0-ba3", folder / "ep0-ba3" / MANIFEST):
        loaded = load_model_weights(path)
        assert loaded.keys() == weights.keys()
        assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_resume_continues_exactly(saved, copy_of, tmp_path):
    """3 batches, then autoresume to 5 == 5 batches straight: same losses and weights."""
    folder, first = copy_of, saved[2]
    straight, _, rec_straight = make_trainer(tmp_path / "straight", max_duration="5ba")
    straight.fit()
    assert [rec_straight.losses[b] for b in (1, 2, 3)] == [first[b] for b in (1, 2, 3)]
    resumed, ckpt, rec = make_trainer(folder, max_duration="5ba", autoresume=True, keep=2)
    resumed.fit()
    assert ckpt.loaded == folder / "ep0-ba3"
    assert sorted(rec.losses) == [4, 5]
    assert [rec.losses[b] for b in (4, 5)] == [rec_straight.losses[b] for b in (4, 5)]
    a, b = straight.state.model.state_dict(), resumed.state.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert int(resumed.state.timestamp.batch) == 5
    assert [rec.lrs[b] for b in (4, 5)] == [rec_straight.lrs[b] for b in (4, 5)]


@pytest.mark.parametrize("implementation", ["auto", "foreach"])
def test_composers_optimizer_state_resumes_in_foundryxs(saved, copy_of, tmp_path, implementation):
    """A checkpoint written with Composer's DecoupledAdamW resumes with foundryx's
    ``decoupled_adamw``: auto (Composer's loop on a CPU) gives the uninterrupted run's numbers
    exactly, to batch 5; foreach (torch's multi-tensor ops) its weights after batch 4 to float32
    rounding (one step: Adam turns a 1-ulp change of a near-zero gradient into a whole step)."""
    from functools import partial

    from foundryx.optim.decoupled_adamw import DecoupledAdamW

    last = 5 if implementation == "auto" else 4
    straight, _, rec_straight = make_trainer(tmp_path / "straight", max_duration=f"{last}ba")
    straight.fit()
    resumed, ckpt, rec = make_trainer(
        copy_of, max_duration=f"{last}ba", autoresume=True, keep=2,
        optimizer=partial(DecoupledAdamW, implementation=implementation))
    resumed.fit()
    assert ckpt.loaded == copy_of / "ep0-ba3"
    assert float(resumed.state.optimizers[0].state_dict()["state"][0]["step"]) == last
    assert rec.losses[4] == rec_straight.losses[4]  # the loaded weights: Composer's, exactly
    a, b = straight.state.model.state_dict(), resumed.state.model.state_dict()
    if implementation == "auto":
        assert rec.losses[5] == rec_straight.losses[5]
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


def test_unfinished_save_is_never_loaded_and_is_cleaned(copy_of):
    # a save killed before its commit: files written, renamed never (the manifest may exist)
    shutil.copytree(copy_of / "ep0-ba3", copy_of / ".tmp-ep0-ba4")
    # a final-named folder without manifest (not written by foundryx, but must not count)
    shutil.copytree(copy_of / "ep0-ba3", copy_of / "ep0-ba9")
    (copy_of / "ep0-ba9" / MANIFEST).unlink()
    assert [p.name for p, _ in complete_checkpoints(copy_of)] == ["ep0-ba3", "ep0-ba2"]
    trainer, ckpt, _ = make_trainer(copy_of, max_duration="3ba", autoresume=True)
    assert ckpt.loaded == copy_of / "ep0-ba3"
    assert not (copy_of / ".tmp-ep0-ba4").exists()


def test_corrupt_latest_falls_back_to_previous(copy_of):
    shard = next((copy_of / "ep0-ba3" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, wrong hash
    shard.write_bytes(bytes(data))
    trainer, ckpt, rec = make_trainer(copy_of, max_duration="4ba", autoresume=True, keep=5)
    assert ckpt.loaded == copy_of / "ep0-ba2"
    assert (copy_of / "ep0-ba3.corrupt").is_dir()  # kept for inspection, never overwritten
    trainer.fit()
    assert sorted(rec.losses) == [3, 4]
    assert (copy_of / "ep0-ba3" / MANIFEST).is_file()  # saved again by the resumed run


def _break(folder: Path, how: str, other: Path) -> Path:
    ck = folder / "ep0-ba3"
    shard = next((ck / "dcp").glob("*.distcp"))
    if how == "deleted":
        shard.unlink()
        return shard
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
        return shard
    shutil.copy(other / MANIFEST, ck / MANIFEST)  # the manifest of another model
    return ck / "dcp" / ".metadata"


@pytest.fixture(scope="module")
def other_model_ckpt(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("other") / "save"
    trainer, _, _ = make_trainer(folder, max_duration="1ba", d_model=64)
    trainer.fit()
    trainer.close()
    return folder / "ep0-ba1"


@pytest.mark.parametrize("how", ["deleted", "truncated", "foreign_manifest"])
def test_broken_checkpoint_error_names_the_file_and_touches_nothing(copy_of, other_model_ckpt, how):
    bad = _break(copy_of, how, other_model_ckpt)
    before = snapshot(copy_of)
    with pytest.raises(CheckpointError) as e:
        make_trainer(None, max_duration="5ba", load_path=str(copy_of / "ep0-ba3"))
    assert str(bad) in str(e.value)
    with pytest.raises(CheckpointError) as e:
        load_model_weights(copy_of / "ep0-ba3")
    assert str(bad) in str(e.value)
    assert snapshot(copy_of) == before


def test_checkpoint_of_another_model_is_refused_with_the_differences(other_model_ckpt):
    with pytest.raises(CheckpointError) as e:
        make_trainer(None, load_path=str(other_model_ckpt))
    msg = str(e.value)
    assert "different model" in msg and str(other_model_ckpt) in msg
    assert "model has shape (32,), checkpoint has (64,)" in msg and "more" in msg


def test_existing_checkpoints_need_autoresume_or_overwrite(copy_of):
    with pytest.raises(CheckpointError, match="autoresume: true.*save_overwrite: true"):
        make_trainer(copy_of, autoresume=False)
    trainer, _, _ = make_trainer(copy_of, max_duration="1ba", overwrite=True, keep=-1)
    trainer.fit()  # the earlier run's checkpoints go when this run commits its first one
    assert [p.name for p, _ in complete_checkpoints(copy_of)] == ["ep0-ba1"]


def test_load_weights_only_keeps_the_clock(saved):
    folder, weights, _ = saved
    trainer, ckpt, _ = make_trainer(None, load_path=str(folder), load_weights_only=True)
    assert int(trainer.state.timestamp.batch) == 0
    sd = trainer.state.model.state_dict()
    assert all(torch.equal(sd[k], weights[k]) for k in weights)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/foundryx-pwned",))


def test_pickled_code_is_never_executed(copy_of, tmp_path):
    marker = Path("/tmp/foundryx-pwned")
    marker.unlink(missing_ok=True)
    meta = copy_of / "ep0-ba3" / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"\.metadata: not valid checkpoint metadata.*refusing"):
        load_model_weights(copy_of / "ep0-ba3", verify=False)
    evil = tmp_path / "weights.pt"
    evil.write_bytes(pickle.dumps({"w": _Boom()}))
    with pytest.raises(CheckpointError, match="weights_only"):
        load_model_weights(evil)
    assert not marker.exists()


def test_load_path_weights_file(saved, tmp_path):
    from safetensors.torch import save_file

    _, weights, _ = saved
    hf_keys = tmp_path / "model.safetensors"  # keys of the inner Hugging Face model
    save_file({k.removeprefix("model."): v.contiguous() for k, v in weights.items()}, hf_keys)
    trainer, ckpt, _ = make_trainer(None, load_path=str(hf_keys))
    sd = trainer.state.model.state_dict()
    assert ckpt.loaded == hf_keys and all(torch.equal(sd[k], weights[k]) for k in weights)
    other = tmp_path / "other.pt"
    torch.save({"x": torch.zeros(1)}, other)
    with pytest.raises(CheckpointError, match=f"{other}: its tensors do not match the model"):
        make_trainer(None, load_path=str(other))


def test_autoresume_with_no_intact_checkpoint_stops_and_touches_nothing(copy_of):
    shards = [next((copy_of / name / "dcp").glob("*.distcp")) for name in ("ep0-ba2", "ep0-ba3")]
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[:-10])
    before = snapshot(copy_of)
    with pytest.raises(CheckpointError, match="no usable checkpoint") as e:
        make_trainer(copy_of, autoresume=True)
    assert all(str(s) in str(e.value) for s in shards)
    assert snapshot(copy_of) == before


def test_recorded_sections_must_be_json(tmp_path):
    """The model and tokenizer sections go into every checkpoint as components.json; one that
    is not JSON fails when the Checkpointer is made, not at the first save."""
    with pytest.raises(CheckpointError, match="model: the section cannot be recorded in checkpoints"):
        Checkpointer(str(tmp_path), model_section={"name": "m", "x": object()})
    ckpt = Checkpointer(str(tmp_path), model_section={"name": "m", "pair": (1, 2)},
                        tokenizer_section={"name": "hf", "path": "tok"})
    assert ckpt.components == {"version": 1, "model": {"name": "m", "pair": [1, 2]},
                               "tokenizer": {"name": "hf", "path": "tok"}}


def _rehash(ck: Path, rel: str) -> None:
    """Make the manifest agree with a file changed after the save (damage the hash cannot see)."""
    from foundryx.checkpoint.verify import file_digest

    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"][rel] = file_digest(ck / rel)
    (ck / MANIFEST).write_text(json.dumps(manifest))


def test_damaged_shard_that_passes_the_hash_check_is_one_clear_error(copy_of):
    ck = copy_of / "ep0-ba3"
    shard = next((ck / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:64])  # the model's tensors lie past the first bytes
    _rehash(ck, str(shard.relative_to(ck)))
    for load in (lambda: load_model_weights(ck),
                 lambda: make_trainer(None, max_duration="5ba", load_path=str(ck))):
        with pytest.raises(CheckpointError) as e:  # torch raises a BaseException here (2.7)
            load()
        assert f"{shard} (written by rank 0)" in str(e.value) and "damaged" in str(e.value)


def test_unreadable_trainer_state_names_the_file(copy_of):
    ck = copy_of / "ep0-ba3"
    state = next(p for p in ck.glob("*.json") if p.name != MANIFEST and "trainer" in p.name)
    state.write_text("{not json")
    _rehash(ck, state.name)
    with pytest.raises(CheckpointError) as e:
        make_trainer(None, max_duration="5ba", load_path=str(ck))
    assert f"{state}: not valid JSON" in str(e.value)


@pytest.mark.parametrize("rel", ["../../outside.bin", "/etc/hostname", "dcp/../../ep0-ba2/manifest.json"])
def test_manifest_entries_outside_the_checkpoint_are_refused(copy_of, rel):
    ck = copy_of / "ep0-ba3"
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"][rel] = {"size": 1, "sha256": "0" * 64}
    (ck / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as e:
        load_model_weights(ck)
    assert f"lists {rel!r}, outside the checkpoint folder" in str(e.value)


# -- the commit replacing a checkpoint of the same name, and a kill inside it -------------------
def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory) -> tuple[Path, Path]:
    """Two runs' ep0-ba1 (other run names, other learning rates: other bytes throughout)."""
    made = []
    for name, lr in (("old", 3e-3), ("new", 3e-2)):
        folder = tmp_path_factory.mktemp(name) / "save"
        trainer, _, _ = make_trainer(folder, max_duration="1ba", lr=lr, run_name=name)
        trainer.fit()
        trainer.close()
        made.append(folder / "ep0-ba1")
    return made[0], made[1]


def test_a_save_replaces_a_checkpoint_of_the_same_name_whole(old_and_new, tmp_path):
    old, new = old_and_new
    root = tmp_path / "save"
    root.mkdir()
    shutil.copytree(old, root / "ep0-ba1")
    trainer, _, _ = make_trainer(root, max_duration="1ba", lr=3e-2, run_name="new",
                                 overwrite=True)
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.state.model.state_dict().items()}
    trainer.close()
    assert sorted(p.name for p in root.iterdir()) == ["ep0-ba1", "latest"]
    assert json.loads((root / "ep0-ba1" / MANIFEST).read_text())["run_name"] == "new"
    loaded = load_model_weights(root / "ep0-ba1")  # verified against its manifest
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert files(root / "ep0-ba1").keys() == files(new).keys()


class Killed(BaseException):
    """The process ends here: nothing after it runs (no except or finally of foundryx's)."""


# the commit's file-system steps when a checkpoint of the same name exists (save._commit)
COMMIT_STEPS = ["replace", "replace", "fsync_dir", "rmtree"]


@pytest.mark.parametrize(("kill_at", "lose_new"), [(i, False) for i in range(len(COMMIT_STEPS) + 1)]
                         + [(1, True)],
                         ids=[f"before-{i}-{s}" for i, s in enumerate(COMMIT_STEPS)]
                         + ["none", "before-1-replace-new-save-gone"])
def test_a_kill_inside_the_commit_leaves_the_old_or_the_new_checkpoint_whole(
        old_and_new, tmp_path, monkeypatch, caplog, kill_at, lose_new):
    """The save is written and hashed (``.tmp-ep0-ba1`` holds its manifest); the process dies
    before the commit's step ``kill_at`` (an rmtree dies half-way through). The next run in
    the folder resumes from ep0-ba1, byte for byte the old checkpoint or the new one; killed
    between the two renames, the new one (or the old one, when the new save is gone since)."""
    import logging
    import types

    old, new = old_and_new
    root = tmp_path / "save"
    root.mkdir()
    shutil.copytree(old, root / "ep0-ba1")
    shutil.copytree(new, root / ".tmp-ep0-ba1")
    steps: list[str] = []

    def step(fn):
        def run(path, *args, **kwargs):
            steps.append(fn.__name__)
            if len(steps) > kill_at:
                if fn.__name__ == "rmtree":  # half of the tree is gone already
                    for p in sorted(Path(path).rglob("*"))[::2]:
                        if p.is_file():
                            p.unlink()
                raise Killed
            return fn(path, *args, **kwargs)
        return run

    monkeypatch.setattr(saving, "os", types.SimpleNamespace(replace=step(os.replace)))
    monkeypatch.setattr(saving, "shutil", types.SimpleNamespace(rmtree=step(shutil.rmtree)))
    monkeypatch.setattr(saving, "fsync_dir", step(saving.fsync_dir))
    try:
        saving._commit(root, root / ".tmp-ep0-ba1", root / "ep0-ba1")
    except Killed:
        pass
    monkeypatch.undo()
    assert steps == COMMIT_STEPS[:kill_at + 1]
    if lose_new:
        shutil.rmtree(root / ".tmp-ep0-ba1")

    with caplog.at_level(logging.INFO, logger="foundryx"):
        trainer, ckpt, _ = make_trainer(root, max_duration="1ba", autoresume=True, run_name="new")
    assert ckpt.loaded == root / "ep0-ba1"
    got = files(root / "ep0-ba1")
    assert got in (files(old), files(new)), "a mix of the two checkpoints"
    if kill_at >= 1:  # from the moment the old one is set aside, the new one wins
        assert got == (files(old) if lose_new else files(new))
    said = [r.getMessage() for r in caplog.records if "commit interrupted" in r.getMessage()]
    assert said == ([] if kill_at != 1 else [
        "checkpoint commit interrupted by the end of the last run: ep0-ba1: " + (
            "the previous ep0-ba1 is back in place" if lose_new else
            "its save was complete; now in place of the previous ep0-ba1")])
    assert not list(root.glob(".tmp-*")), list(root.iterdir())
    trainer.close()
