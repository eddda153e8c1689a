"""Training on packed fine-tuning data: the loss on the learned tokens falls."""

from __future__ import annotations

import json

import pytest
import torch
from composer import Callback, Event, Trainer

from foundryx.data.finetuning.loader import build_finetuning_dataloader
from foundryx.models.mpt.composer import ComposerMPTCausalLM


class Losses(Callback):
    def __init__(self):
        self.values = []

    def run_event(self, event, state, logger):
        if event == Event.BATCH_END:
            self.values.append(float(state.loss))


@pytest.mark.slow
def test_packed_chat_training_loss_falls(tmp_path, tiny_tokenizer):
    chats = [{"messages": [{"role": "user", "content": f"Double {i}."},
                           {"role": "assistant", "content": f"{2 * i}"}]} for i in range(40)]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in chats))
    cfg = {"dataset": {"path": str(src), "max_seq_len": 128,
                                             "packing_ratio": "auto", "shuffle_seed": 1}}
    spec = build_finetuning_dataloader(cfg, tiny_tokenizer, 4)
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tiny_tokenizer, d_model=32, n_heads=2, n_layers=2,
                                max_seq_len=128, vocab_size=448,
                                attn_config={"attn_impl": "torch", "rope": True,
                                             "attn_uses_sequence_id": True})
    losses = Losses()
    Trainer(model=model, train_dataloader=spec, max_duration="20ba", callbacks=[losses],
            optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu",
            progress_bar=False, log_to_console=False, seed=1).fit()
    first, last = sum(losses.values[:5]) / 5, sum(losses.values[-5:]) / 5
    assert last < 0.6 * first, (first, last)
