"""The wandb and tensorboard loggers in one process with a tiny Composer run: TensorBoard
event files read back; W&B offline run files written under the run folder with the id kept
there. Resuming the same W&B run after autoresume is tested end to end in
test_guards_e2e.py."""

from __future__ import annotations

import pytest
from test_guards import tiny_trainer

from foundryx.loggers.tensorboard import TensorBoardLogger
from foundryx.loggers.wandb import ID_FILE, WandBLogger

LOSS = "loss/train/total"


def test_tensorboard_event_files_hold_every_batch_loss(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(log_dir=str(tmp_path / "{run_name}"))
    trainer = tiny_trainer([], batches=4, loggers=[tb])
    trainer.fit()
    trainer.close()
    assert tb.log_dir == tmp_path / trainer.state.run_name
    acc = EventAccumulator(str(tb.log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    losses = [e.value for e in acc.Scalars(LOSS)]
    assert [e.step for e in acc.Scalars(LOSS)] == [1, 2, 3, 4]  # the batches, as the console numbers them
    assert losses[-1] < losses[0]


def test_wandb_offline_writes_its_run_under_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wb = WandBLogger(project="test", dir=str(tmp_path))
    trainer = tiny_trainer([], batches=3, loggers=[wb])
    trainer.fit()
    trainer.close()
    run_id = (tmp_path / ID_FILE).read_text().strip()
    assert run_id == wb.run_id and not wb.resumed
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0


@pytest.mark.parametrize("cls", [WandBLogger, TensorBoardLogger])
def test_only_rank_zero_logs_unless_asked(cls, monkeypatch):
    class State:
        run_name = "r"

    monkeypatch.setattr("composer.utils.dist.get_global_rank", lambda: 1)
    quiet, loud = cls(), cls(rank_zero_only=False)
    quiet.init(State(), None)
    loud.init(State(), None)
    quiet.log_metrics({"x": 1.0}, step=0)
    loud.log_metrics({"x": 1.0}, step=0)
    assert quiet._pending == [] and loud._pending == [("metrics", {"x": 1.0}, 0)]
