"""Mid-epoch resume: a run resumed from a checkpoint sees exactly the batches (and losses) an
uninterrupted run sees at the same steps, with no replay from batch 0."""

from __future__ import annotations

import pytest
import torch
from composer import Callback, Event, Trainer
from test_text_loader import SEQ, loader_cfg, mds_root  # noqa: F401 (fixture)

from foundryx.data.text import build_text_dataloader
from foundryx.models.mpt.composer import ComposerMPTCausalLM


class Record(Callback):
    """Keeps each training batch's input_ids and loss."""

    def __init__(self):
        self.batches, self.losses = [], []

    def run_event(self, event, state, logger):
        if event == Event.AFTER_DATALOADER:
            self.batches.append(state.batch["input_ids"].tolist())
        elif event == Event.BATCH_END:
            self.losses.append(float(state.loss))


def run(tokenizer, root, steps: str, **kw) -> Record:
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tokenizer, d_model=32, n_heads=2, n_layers=2, max_seq_len=SEQ,
                                vocab_size=448, attn_config={"attn_impl": "torch", "rope": True})
    spec = build_text_dataloader(loader_cfg(root, shuffle=True, shuffle_seed=7), tokenizer, 4)
    record = Record()
    Trainer(model=model, train_dataloader=spec, max_duration=steps, callbacks=[record],
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
            progress_bar=False, log_to_console=False, seed=3, **kw).fit()
    return record


@pytest.mark.slow
def test_resume_continues_mid_epoch(mds_root, tiny_tokenizer, tmp_path):  # noqa: F811
    full = run(tiny_tokenizer, mds_root, "10ba")
    ckpt = tmp_path / "ckpt"
    first = run(tiny_tokenizer, mds_root, "4ba", save_folder=str(ckpt), save_interval="4ba")
    assert first.batches == full.batches[:4]
    resumed = run(tiny_tokenizer, mds_root, "10ba", load_path=str(ckpt / "ep0-ba4-rank0.pt"))
    assert len(resumed.batches) == 6  # no replay of batches 1-4
    assert resumed.batches == full.batches[4:]
    assert resumed.losses == pytest.approx(full.losses[4:], rel=1e-5)
