"""Context parallelism (``parallelism.cp``, Ulysses: foundryx/parallel/cp.py) on gloo ranks
equals one process: the losses of 8 AdamW steps, the first step's gradients and the eval
logits, within 1e-5 (fp32), for MPT with packed documents that cross the shard boundaries
(RoPE; ALiBi with right padding) and a Hugging Face Llama (GQA); and the bad inputs say which
setting to change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed

from foundryx.config.schema import ParallelismConfig
from foundryx.errors import ConfigError

STEPS = 8  # issue 52: cp 2 and 4 equal one process for 8 steps
SEQ = 16
LR = 5e-3
MPT = dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=SEQ, vocab_size=64, no_bias=True,
           attn_config={"rope": True, "kv_n_heads": 2, "attn_uses_sequence_id": True},
           ffn_config={"ffn_type": "swiglu"}, norm_type="rmsnorm")
ALIBI = dict(MPT, attn_config={"alibi": True, "kv_n_heads": 4, "attn_uses_sequence_id": True})
LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
             max_position_embeddings=SEQ, tie_word_embeddings=False)
KINDS = {"mpt": MPT, "mpt-alibi": ALIBI, "llama": LLAMA}


def _model(kind: str):
    torch.manual_seed(0)
    if kind.startswith("mpt"):
        from foundryx.models.mpt.composer import ComposerMPTCausalLM

        return ComposerMPTCausalLM(None, **KINDS[kind])
    from foundryx.models.hf import ComposerHFCausalLM

    return ComposerHFCausalLM(None, config=LLAMA, pretrained=False, attn_implementation="sdpa")


def _batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """Two sequences of SEQ per step; documents of 5, 7 and 4 tokens (the second crosses the
    middle: the shard boundary of cp 2; cp 4 cuts at 4, 8, 12); under ALiBi the second row
    right-padded by 3 (attention_mask 0, labels ignored)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, SEQ), generator=g)
        b = {"input_ids": ids, "labels": ids.clone()}
        if kind.startswith("mpt"):
            doc = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
            b["sequence_id"] = torch.stack([doc, torch.zeros(SEQ, dtype=torch.long)])
        if kind == "mpt-alibi":
            mask = torch.ones(2, SEQ, dtype=torch.long)
            mask[1, -3:] = 0
            b["attention_mask"] = mask
            b["labels"][1, -3:] = -100
        out.append(b)
    return out


def _train(model, batches) -> tuple[list[float], dict, tuple]:
    """Composer's step: forward, loss, backward, AdamW; the losses, the first step's gradients
    (whole), and after training the eval loss (what Composer's eval_forward gives under cp;
    the fused loss in one process) and the logits of the first batch."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], {}
    for i, b in enumerate(batches):
        model.train()
        loss = model.loss(model(b), b)
        loss.backward()
        if i == 0:
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # eval: the loss shard by shard, and the logits gathered whole
        split = hasattr(model, "foundryx_context_parallel")
        out = model.eval_forward(dict(batches[0])) if split else model._forward(dict(batches[0]), True)
        logits = model._forward(dict(batches[0]), fused=False).logits
    return losses, grads, (out.loss.item(), logits)


def _cp_run(kind: str, cp: int) -> tuple[list[float], dict, Any]:
    from foundryx.parallel import parallelize

    model = _model(kind)
    parallelize(model, ParallelismConfig(cp=cp), device=torch.device("cpu"))
    return _train(model, _batches(kind))


def _compare(kind: str, world: int):
    ref_losses, ref_grads, ref_logits = _train(_model(kind), _batches(kind))
    results = run_distributed(_cp_run, world_size=world, args=(kind, world), timeout=90)
    # a rank's loss is its share (Composer logs the mean over the ranks): that mean
    mean = [sum(r[0][i] for r in results) / world for i in range(STEPS)]
    assert mean == pytest.approx(ref_losses, abs=1e-5, rel=1e-5), (mean, ref_losses)
    ref_eval, ref_logits = ref_logits
    eval_mean = sum(r[2][0] for r in results) / world
    assert eval_mean == pytest.approx(ref_eval, abs=1e-5, rel=1e-5)
    for _, grads, (_, logits) in results:  # every rank: the same numbers as one process
        assert sorted(grads) == sorted(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert ref_eval < ref_losses[0]  # trained: the first batch's loss fell (each step's batch differs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mpt", "mpt-alibi", "llama"])
def test_cp2_equals_one_process(kind):
    _compare(kind, 2)


@pytest.mark.slow
def test_cp4_equals_one_process():
    _compare("mpt-alibi", 4)  # 4 kv heads: one per rank; shards of 4 cut every document


def test_shard_keeps_every_target():
    """The targets of a split batch: each position's next token, the last shard's last none;
    padding to a multiple of cp carries on the positions and is ignored."""
    from foundryx.parallel.cp import ContextParallel

    ids = torch.arange(10).view(1, 10)
    shards = []
    for rank in range(4):
        cp = ContextParallel.__new__(ContextParallel)
        cp.n, cp.rank, cp.positions = 4, rank, None
        shards.append(cp.shard({"input_ids": ids, "labels": ids + 100})[0])
    cat = {k: torch.cat([s[k] for s in shards], 1) for k in shards[0]}
    assert cat["input_ids"].tolist() == [list(range(10)) + [0, 0]]
    assert cat["shift_labels"].tolist() == [list(range(101, 110)) + [-100] * 3]
    assert cat["position_ids"].tolist() == [list(range(12))]
    assert cat["attention_mask"].tolist() == [[1] * 10 + [0, 0]]
    assert "labels" not in shards[0]


def test_bad_inputs_say_what_to_change():
    from foundryx.builders import cp_run_problems
    from foundryx.parallel.cp import plan_problems

    problems = cp_run_problems({"parallelism": {"cp": 4}, "max_seq_len": 4098})
    assert problems == ["max_seq_len: 4098 does not divide by parallelism.cp: 4 (each rank "
                        "takes an equal shard of every sequence); use a multiple of 4, e.g. "
                        "4096 or 4100"]
    assert "does not combine with tensor parallelism" in cp_run_problems(
        {"parallelism": {"cp": 2, "tp": 2}, "max_seq_len": 16})[0]
    # more ranks than key-value heads: Ulysses gives each rank whole kv heads
    (msg,) = plan_problems(_model("mpt"), 4)
    assert msg.startswith("parallelism.cp: 4 does not divide the model's 2 key-value heads")
    assert msg.endswith("use one of 1, 2")
    # a family whose attention foundryx cannot split from outside
    from foundryx.models.hf import ComposerHFCausalLM

    gpt2 = ComposerHFCausalLM(None, config=dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=4,
                                               vocab_size=64, n_positions=SEQ), pretrained=False)
    (msg,) = plan_problems(gpt2, 2)
    assert msg.startswith("parallelism.cp: 2, but the model declares no context-parallel plan")
    assert "(or set cp: 1)" in msg


def test_one_process_asks_for_ranks():
    from foundryx.parallel import parallelize

    with pytest.raises(ConfigError, match=r"parallelism.cp: 2, but this is one process; start 2"):
        parallelize(_model("mpt"), ParallelismConfig(cp=2), device=torch.device("cpu"))


@pytest.mark.slow
def test_a_length_cp_does_not_divide_is_one_message_exit_2(quickstart_data):
    """``foundryx train`` as a user runs it: one message naming the setting and the fix."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    r = subprocess.run(
        [sys.executable, "-m", "foundryx.cli", "train", "--dry-run", "yamls/quickstart.yaml",
         f"variables.data_root={quickstart_data}",
         "parallelism.cp=2", "max_seq_len=127"],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "WORLD_SIZE": "2", "PYTHONPATH": str(root)})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    problems = [ln for ln in r.stderr.splitlines() if ln.startswith("  - ")]
    assert problems == ["  - max_seq_len: 127 does not divide by parallelism.cp: 2 (each rank "
                        "takes an equal shard of every sequence); use a multiple of 2, e.g. "
                        "126 or 128"], r.stderr[-3000:]


def test_the_planner_plans_a_rank_of_the_long_recipe_at_its_share():
    """``foundryx plan`` of the shipped recipe: each of the 8 devices at 4,194,304 / 8 tokens,
    said in a note; the same run at cp 1 is planned at the whole sequence."""
    from pathlib import Path

    from foundryx.plan.planner import make_plan

    root = Path(__file__).parents[1]
    recipe = root / "yamls/finetune/llama-3.1-8b-lora-long-cp.yaml"
    shape = [f"variables.model_path={root / 'yamls/shapes/llama-3.1-8b'}"]
    plan = make_plan(recipe, shape, gpus=8, gpu="h100")
    assert plan.setup.seq_len == 524_288
    assert any("context parallel over 8 devices (Ulysses): each holds 524,288 of every "
               "sequence's 4,194,304 tokens" in n for n in plan.notes), plan.notes
    whole = make_plan(recipe, [*shape, "parallelism.cp=1", "global_train_batch_size=8"],
                      gpus=8, gpu="h100")
    assert whole.setup.seq_len == 4_194_304
