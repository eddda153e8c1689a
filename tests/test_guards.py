"""The loss guard and preemption in one process and on 2 gloo ranks, with a tiny MPT trained by
a Composer Trainer: a skipped batch changes no weight, stop names the batch, a NaN on one rank
skips the batch on both, a signal stops every rank after the same batch. End-to-end runs (real
SIGTERM to a launched run, the hang watchdog, the loggers) are in test_guards_e2e.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from composer import Trainer
from composer.core import Callback
from distributed import run_distributed
from torch.utils.data import DataLoader

from foundryx.callbacks.loss_guard import GuardStop, LossGuard
from foundryx.callbacks.preemption import Preemption


def tiny_trainer(callbacks: list, batches: int = 6, lr: float = 0.05, loggers: list | None = None) -> Trainer:
    from composer.optim import DecoupledAdamW
    from composer.utils import dist

    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    torch.manual_seed(0)
    model = ComposerMPTCausalLM(None, d_model=16, n_heads=2, n_layers=1, max_seq_len=8,
                                vocab_size=32)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 32, (8,), generator=g)}
            for _ in range(4 * batches * dist.get_world_size())]
    loader = DataLoader(data, batch_size=4, sampler=dist.get_sampler(data, shuffle=False))
    return Trainer(model=model, train_dataloader=loader,
                   max_duration=f"{batches}ba", optimizers=DecoupledAdamW(model.parameters(), lr=lr),
                   callbacks=callbacks, loggers=loggers, device="cpu", progress_bar=False, log_to_console=False,
                   seed=1)


class Inject(Callback):
    """Multiply the loss by ``factor`` at ``batch`` (1-based) on ``rank``; record the weights
    before and after every batch."""

    def __init__(self, batch: int, factor: float, rank: int = 0):
        self.batch, self.factor, self.rank = batch, factor, rank
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def _weights(self, state):
        return [p.detach().clone() for p in state.model.parameters()]

    def batch_start(self, state, logger):
        self.before[int(state.timestamp.batch) + 1] = self._weights(state)

    def after_loss(self, state, logger):
        from composer.utils import dist

        if int(state.timestamp.batch) + 1 == self.batch and dist.get_global_rank() == self.rank:
            state.loss = state.loss * self.factor

    def batch_end(self, state, logger):
        self.after[int(state.timestamp.batch)] = self._weights(state)


def changed(inject: Inject, batch: int) -> bool:
    return any(not a.equal(b) for a, b in zip(inject.before[batch], inject.after[batch]))


def test_skip_leaves_the_weights_of_a_nan_batch_unchanged_and_stop_names_it(caplog):
    inject, guard = Inject(batch=3, factor=float("nan")), LossGuard(action="skip")
    trainer = tiny_trainer([inject, guard])
    with caplog.at_level("WARNING", logger="foundryx"):
        trainer.fit()
    assert guard.skipped == [3]
    assert not changed(inject, 3), "a skipped batch changed the weights"
    assert changed(inject, 2) and changed(inject, 4)
    assert all(torch.isfinite(p).all() for p in trainer.state.model.parameters())
    assert "loss_guard: skipped batch 3 (no optimizer step): the loss is not finite" in caplog.text
    trainer.close()

    inject = Inject(batch=3, factor=float("inf"))
    trainer = tiny_trainer([inject, LossGuard(action="stop")])
    with pytest.raises(GuardStop, match=r"stopped at batch 3: the loss is not finite") as e:
        trainer.fit()
    assert e.value.exit_code == 1 and "lower learning rate" in str(e.value)
    assert 3 not in inject.after  # batch 3 never finished
    trainer.close()


def test_spike_is_measured_against_the_running_mean_and_skips_stop_after_max_skips():
    inject = Inject(batch=5, factor=10.0)
    guard = LossGuard(action="skip", spike_factor=3.0, window=3)
    trainer = tiny_trainer([inject, guard])
    trainer.fit()
    assert guard.skipped == [5] and not changed(inject, 5)
    trainer.close()

    class AlwaysNaN(Inject):
        def after_loss(self, state, logger):
            if int(state.timestamp.batch) >= 1:
                state.loss = state.loss * float("nan")

    trainer = tiny_trainer([AlwaysNaN(0, 0), LossGuard(action="skip", max_skips=2)])
    with pytest.raises(GuardStop, match=r"batch 4: .*after skipping 2 batches in a row"):
        trainer.fit()
    trainer.close()


def _nan_on_rank1() -> tuple[list[int], bool, float]:
    inject, guard = Inject(batch=2, factor=float("nan"), rank=1), LossGuard(action="skip")
    trainer = tiny_trainer([inject, guard], batches=3)
    trainer.fit()
    first = next(iter(trainer.state.model.parameters())).detach().sum().item()
    return guard.skipped, changed(inject, 2), first


def _signal_on_rank1() -> tuple[int | None, int, list[str]]:
    from composer.utils import dist

    class SignalAt(Callback):
        def batch_start(self, state, logger):  # rank 1 alone is signalled, during batch 3
            if int(state.timestamp.batch) + 1 == 3 and dist.get_global_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)

    pre = Preemption()
    trainer = tiny_trainer([SignalAt(), pre], batches=8)
    trainer.fit()
    return pre.stopped_at, int(trainer.state.timestamp.batch), pre.options.signals


@pytest.mark.slow
def test_two_ranks_agree_a_nan_on_one_skips_on_both_and_a_signal_on_one_stops_both():
    """Rank 0's own loss is finite: it skips because rank 1's is not. The weights stay equal."""
    (s0, c0, w0), (s1, c1, w1) = run_distributed(_nan_on_rank1, timeout=600)
    assert s0 == s1 == [2] and not c0 and not c1 and w0 == w1
    (at0, end0, sig), (at1, end1, _) = run_distributed(_signal_on_rank1, timeout=600)
    assert sig == ["SIGTERM", "SIGUSR1"]
    assert at0 == at1 == 3 and end0 == end1 == 3, "both ranks stop after the batch of the signal"


def test_a_signal_after_a_preemption_stop_does_not_kill_the_process_and_a_plain_run_restores():
    """Slurm signals every task: a rank that stopped for a signal may get its own copy while it
    saves, closes or exits. It is not fatal; a run that was never signalled gives the
    previous handlers back at the end."""
    class SignalAt(Callback):
        def batch_start(self, state, logger):
            if int(state.timestamp.batch) + 1 == 2:
                os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.getsignal(signal.SIGTERM)
    pre = Preemption()
    trainer = tiny_trainer([SignalAt(), pre], batches=6)
    try:
        trainer.fit()
        trainer.close()
        assert pre.stopped_at == 2
        os.kill(os.getpid(), signal.SIGTERM)  # the late copy: with the default handler, death
        assert pre.received == signal.SIGUSR1
        # ignored, not a Python handler: Python puts the default action back for those when the
        # interpreter shuts down, and a copy arriving then would kill the process (exit -15)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)

    plain = Preemption()
    trainer = tiny_trainer([plain], batches=2)
    trainer.fit()
    trainer.close()
    assert plain.stopped_at is None and signal.getsignal(signal.SIGTERM) == before


def test_options_are_checked_with_their_yaml_path(quickstart_data):
    from foundryx.errors import ConfigError
    from foundryx.train import load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config("yamls/quickstart.yaml", [
            f"variables.data_root={quickstart_data}", "callbacks.loss_guard.acton=skip",
            "callbacks.hang_watchdog.timeout_s=0", "callbacks.preemption.signals=[SIGKILL]",
            "loggers.tensorboard.flush_secs=-1", "loggers.wandb.projct=x",
        ])
    text = str(e.value)
    assert "callbacks.loss_guard.acton: unknown option of the 'loss_guard' callback (did you mean 'action'?)" in text
    assert "callbacks.hang_watchdog.timeout_s: expected a number > 0, got 0" in text
    assert "callbacks.preemption.signals: expected names from SIGTERM, SIGUSR1" in text and "got ['SIGKILL']" in text
    assert "loggers.tensorboard.flush_secs: expected a number > 0, got -1" in text
    assert "loggers.wandb.projct: unknown option of the 'wandb' logger (did you mean 'project'?)" in text
