"""An MPT model gives the same loss and gradients with `torch` and `triton` attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from foundryx.models.mpt.configuration import MPTConfig  # noqa: E402
from foundryx.models.mpt.modeling import MPTForCausalLM, causal_lm_loss  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in padded tile rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 32, "vocab_size": 64}
BATCH, SEQ = 2, 32
VARIANTS = {
    "rope_gqa_packed": {"rope": True, "kv_n_heads": 2, "attn_uses_sequence_id": True},
    "alibi_window_padding": {"alibi": True, "sliding_window_size": 5, "kv_n_heads": 1},
}


def loss_and_grads(impl: str, attn_config: dict, state=None):
    model = MPTForCausalLM(MPTConfig(**TINY, attn_config={**attn_config, "attn_impl": impl}))
    if state is not None:
        model.load_state_dict(state)
    model.to(DEVICE)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=g).to(DEVICE)
    kwargs = {}
    labels = input_ids
    if attn_config.get("attn_uses_sequence_id"):
        kwargs["sequence_id"] = torch.tensor(
            [[0] * 5 + [1] * 20 + [2] * 7, [0] * 12 + [1] * 20], device=DEVICE
        )
    else:
        mask = torch.ones(BATCH, SEQ, dtype=torch.long, device=DEVICE)
        mask[0, :6] = 0  # left padding
        mask[1, -9:] = 0  # right padding
        kwargs["attention_mask"] = mask
        labels = input_ids.masked_fill(mask == 0, -100)
    logits = model(input_ids, **kwargs).logits
    loss = causal_lm_loss(logits, labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model.state_dict(), loss.detach(), grads


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_same_loss_and_gradients_as_torch(variant):
    torch.manual_seed(0)
    state, want_loss, want = loss_and_grads("torch", VARIANTS[variant])
    _, loss, got = loss_and_grads("triton", VARIANTS[variant], state)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert want.keys() == got.keys()
    for name in want:
        scale = max(1e-3, want[name].abs().max().item())
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert any(g.abs().max() > 0 for n, g in got.items() if "Wqkv" in n)
