"""foundryx plan with tensor parallelism: each TP term checked against numbers computed by hand
for a tiny Llama (d_model 64, 4 heads, 2 kv heads, FFN 128, 2 layers, vocabulary 256), the
step's TP and FSDP communication, the degrees searched, the proposal when a run does not fit,
and the 405B table of docs/distributed.md against the command that makes it."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from foundryx.cli import main
from foundryx.plan.census import NotPlannable, build_meta, take_census
from foundryx.plan.memory import Setup, terms
from foundryx.plan.planner import make_plan
from foundryx.plan.render import render
from foundryx.plan.settings import tp_settings
from foundryx.plan.tp import at_tp, communication, tp_collectives, tp_degrees
from foundryx.plan.tp_shares import kv_divisor, kv_weight_divisor, tp_params
from foundryx.runtime.hf_compat import TRANSFORMERS_5

ROOT = Path(__file__).parents[1]

LLAMA = {"name": "hf_causal_lm", "pretrained": False, "config": {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 4096}}
# by hand: per layer q 64x64, k and v 32x64 each, o 64x64, gate, up 128x64, down 64x128
LINEAR = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)  # 73,728
KV = 2 * 2 * 2048  # k and v of both layers
VOCAB = 2 * 256 * 64  # embedding and lm_head (not tied)
NORMS = 2 * 2 * 64 + 64  # two per layer and the final one


@pytest.fixture(scope="module")
def census():
    """The Llama's census with the model's own loss: what a tensor-parallel head takes (the
    planner plans an HF model under TP so, models/hf.py)."""
    model, shape, _ = build_meta(LLAMA)
    return take_census(model, replace(shape, fused_loss=False))


def _setup(**kw) -> Setup:
    base = dict(world_size=4, shard_degree=4, zero_stage=3, microbatch=1, seq_len=64,
                precision="fp32", device_kind="cpu", node_size=4)
    return Setup(**{**base, **kw})


def test_census_splits_what_tp_splits(census):
    assert census.block_linear == LINEAR
    assert census.vocab_params == VOCAB
    assert census.total == LINEAR + VOCAB + NORMS
    assert tp_params(census, 1) == census.total
    # q, o, gate, up, down and k, v (2 kv heads over 2) by 2; the vocabulary by 2; norms whole
    assert tp_params(census, 2) == LINEAR / 2 + VOCAB / 2 + NORMS
    # at TP 4 the 2 kv heads cannot split 4 ways: k and v are replicated (each rank holds
    # their whole weights and uses one kv head: 1/2 of their activations)
    assert kv_divisor(census.shape, 4) == 2 and kv_divisor(census.shape, 3) == 1
    assert kv_weight_divisor(census.shape, 4) == 1 and kv_weight_divisor(census.shape, 2) == 2
    assert tp_params(census, 4) == (LINEAR - KV) / 4 + KV + VOCAB / 4 + NORMS
    # as foundryx's plans split the vocabulary today: Llama's lm_head column-wise (the
    # embedding whole), MPT's tied pair whole
    assert tp_params(census, 2, "head") == LINEAR / 2 + VOCAB / 2 + VOCAB / 4 + NORMS
    assert tp_params(census, 2, "replicated") == LINEAR / 2 + VOCAB + NORMS


@pytest.mark.parametrize("tp,shard", [(1, 4), (2, 2), (4, 1), (2, 1)])
def test_weights_gradients_optimizer_per_rank_are_total_over_tp_times_shard(census, tp, shard):
    t = terms(census, _setup(tp=tp, shard_degree=shard, world_size=tp * shard))
    split = (LINEAR - KV + VOCAB) / (tp * shard) + KV / (kv_weight_divisor(census.shape, tp) * shard)
    expected = (split + NORMS / shard) * 4  # fp32 master weights
    assert t["trainable_weights"] == pytest.approx(expected, abs=1)
    assert t["gradients"] == pytest.approx(expected, abs=1)
    assert t["optimizer_state"] == pytest.approx(2 * expected, abs=1)  # AdamW's two moments


def test_activations_with_and_without_sequence_parallel(census):
    """Per token and layer (d 64, kv 32, FFN 128, gated, RoPE), in fp32: the norms' tensors
    6 d (the residual part), q, k, v d + 2 kv, rotated q, k d + kv, attention output d, FFN
    4 x 128; plus 4 bytes of log-sum-exp per head; and on a CPU the attention's probabilities
    (a Llama with grouped kv heads: Hugging Face's SDPA call takes PyTorch's math path there),
    heads x s x s, which a GPU's kernels do not keep."""
    def acts(**kw):
        return terms(census, _setup(**kw))["activations"]

    b, q, layers = 1, 64, 2
    # the rotated q and k (d + kv) on either transformers: 5 names RoPE's base in
    # rope_parameters, which the census once missed (it counted a Llama without RoPE there)
    rotated, rotated2 = 96, 32 + 16
    tp1 = 384 + 128 + rotated + 64 + 512  # 1184
    inner2 = (32 + 2 * 16) + rotated2 + 32 + 256  # 400: k, v are 16 wide per rank
    no_sp2 = 384 + inner2  # residual whole
    sp2 = 384 / 2 + 2 * 64 + inner2  # residual halved, the gathered norm outputs kept whole
    outside = 4 * 64 * 4  # embedding output and the final norm's three tensors

    def total(per_token, heads, sp):
        scores = b * heads * q * q * 4
        return layers * (b * q * per_token * 4 + b * heads * q * 4 + scores) + b * q * outside / sp

    assert acts(tp=1) == total(tp1, 4, 1)
    assert acts(tp=2, shard_degree=2, sequence_parallel=False) == total(no_sp2, 2, 1)
    assert acts(tp=2, shard_degree=2, sequence_parallel=True) == total(sp2, 2, 2)
    assert acts(tp=1) - acts(tp=1, device_kind="cuda") == layers * b * 4 * q * q * 4
    # the residual part at TP 2 with sequence parallel is half of TP 1's; the inner half either way
    assert (sp2 - 2 * 64 - inner2) * 2 == 384 and inner2 * 2 == tp1 - 384


def test_checkpointed_run_keeps_each_block_input_split_by_sequence_parallel(census):
    s = _setup(activation_checkpointing=True, seq_len=1024)
    one, sp = terms(census, s), terms(census, at_tp(s, 2))
    no_sp = terms(census, replace(at_tp(s, 2), sequence_parallel=False))
    # kept: 2 block inputs + the embedding output and final norm (4) of 1024 x 64 fp32 each
    kept = (2 + 4) * 1024 * 64 * 4
    block = lambda t: t["backward_working_set"]  # noqa: E731 (the recomputed block)
    assert one["activations"] - block(one) == kept
    assert sp["activations"] - block(sp) == kept / 2
    assert no_sp["activations"] - block(no_sp) == kept


def test_tp_and_fsdp_communication_by_hand(census):
    s1 = _setup(precision="amp_bf16")  # bf16 compute, FSDP over 4
    s2 = at_tp(s1, 2)
    assert (s2.tp, s2.shard_degree, s2.microbatch, s2.grad_accum) == (2, 2, 1, 2)
    c1 = communication(census, s1, 1.0, None, 0.4, None)
    c2 = communication(census, s2, 1.0, None, 0.4, None)
    assert c1.tp_payload == 0
    # 2 collectives forward and 2 backward per layer, 2 layers; outside them the first block's
    # sequence split (backward), the final norm's gather and scatter and the vocabulary-parallel
    # embedding's all-reduce; 64 tokens x 64 x 2 bytes each, twice (two microbatches: a TP
    # group takes the batch of 2 data-parallel ranks)
    assert tp_collectives(s2, 2) == 8 + 4
    assert tp_collectives(replace(s2, tp_vocab="replicated"), 2) == 8 + 3  # a tied HF head
    assert tp_collectives(s2, 2, vocab_size=255) == 8 + 3  # a vocabulary tp does not divide
    assert c2.tp_payload == 12 * 64 * 64 * 2 * 2
    assert c2.tp_sent == c2.tp_payload  # ring all-reduce over 2: 2 (n-1)/n = 1
    # FSDP: forward and backward all-gather of the rank's weights (bf16), receiving (s-1)/s
    assert c1.fsdp_gather == pytest.approx(2 * census.total * 2 * 3 / 4)
    assert c2.fsdp_gather == pytest.approx(2 * tp_params(census, 2) * 2 * 1 / 2 * 2)
    ac = replace(s2, activation_checkpointing=True)
    assert tp_collectives(ac, 2) == 12 + 4  # the recomputed forward's 2 per layer


def test_tp_degrees_divide_the_node_and_the_heads(census):
    assert tp_degrees(census, 4) == [1, 2, 4]  # 4 heads, 2 kv heads (at 4: replicated)
    assert tp_degrees(census, 8) == [1, 2, 4]
    model, shape, _ = build_meta({**LLAMA, "config": {**LLAMA["config"],
                                                     "num_key_value_heads": 4}})
    assert tp_degrees(take_census(model, shape), 8) == [1, 2, 4]
    s = _setup(world_size=8, shard_degree=8, grad_accum=4)
    assert (at_tp(s, 4).shard_degree, at_tp(s, 4).grad_accum) == (2, 16)  # same global batch
    assert at_tp(s, 3) is None


def test_config_reads_parallelism_tp():
    assert tp_settings({"parallelism": {"tp": 2}}) == (2, True)
    assert tp_settings({"parallelism": {"tp": 4, "sequence_parallel": False}}) == (4, False)
    assert tp_settings({"parallelism": None}) == (1, True)
    with pytest.raises(NotPlannable, match="parallelism.tp: expected a positive integer"):
        tp_settings({"parallelism": {"tp": 0}})


def _write(tmp_path: Path, seq: int) -> Path:
    import yaml

    cfg = {"max_seq_len": seq, "model": LLAMA, "tokenizer": {"name": "hf", "path": "unused"},
           "train_loader": {"name": "text", "dataset": {"local": "x", "split": "train",
                                                        "max_seq_len": seq}},
           "max_duration": "10ba", "global_train_batch_size": 4,
           "device_train_microbatch_size": 1, "optimizer": {"name": "decoupled_adamw",
                                                            "lr": 1e-3},
           "precision": "amp_bf16", "device": "gpu", "parallelism": {}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_run_that_does_not_fit_gets_a_tp_degree_with_its_numbers(tmp_path, capsys):
    cfg = _write(tmp_path, 4096)
    one = make_plan(cfg, gpus=4, gpu="h100")
    two = make_plan(cfg, gpus=4, gpu="h100", tp=2)
    assert two.setup.tp == 2 and two.setup.shard_degree == 2 and two.setup.grad_accum == 2
    assert two.setup.tp_vocab == "parallel"  # Llama's untied head: embedding, head and loss split
    assert "FSDP2 over 2 x TP 2 (sequence parallel)" in render(two)
    memory = (one.per_device_bytes + two.per_device_bytes) // 2
    plan = make_plan(cfg, gpus=4, gpu="h100", gpu_memory=f"{memory}B")
    assert not plan.device_fits
    assert plan.tp_proposal is not None and plan.tp_proposal.tp == 2
    assert plan.tp_proposal.per_device_bytes == two.per_device_bytes
    assert any(s.overrides == "parallelism.tp=2" for s in plan.suggestions)
    text = render(plan)
    assert "tensor parallelism: TP 2 x FSDP2 over 2 makes it fit" in text
    assert "[parallelism.tp=2]" in text
    # the same from the command line, and --search tp lists both degrees
    assert main(["plan", str(cfg), "--gpus", "4", "--gpu", "h100", "--gpu-memory",
                 f"{memory}B", "--search", "tp"]) == 0
    out = capsys.readouterr().out
    # every degree of the node (at 4 the 2 kv heads are replicated)
    assert {int(r.split()[0]) for r in out.splitlines() if re.match(r"\s+\d ", r)} == {1, 2, 4}
    assert "verdict: TP 2" in out
    assert main(["plan", str(cfg), "--gpus", "4", "--tp", "0"]) == 2


def _doc_section() -> str:
    text = (ROOT / "docs/distributed.md").read_text()
    return text.split("## Tensor parallelism: when to use it", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
@pytest.mark.skipif(TRANSFORMERS_5, reason="docs/distributed.md quotes the planner on the pinned "
                    "stack (transformers 4.57); 5.x's Llama keeps no separate rotated q and k, so "
                    "its measured activation term, and the table, are smaller")
def test_405b_table_in_the_docs_is_what_the_planner_prints(capsys):
    """The command in docs/distributed.md, run as written; its table is the doc's; at 16k
    tokens the 405B recipe does not fit on 8 H100s without TP and --search proposes it."""
    section = _doc_section()
    command, table = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)[:2]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "foundryx"
    code = main(argv[1:])
    out = capsys.readouterr().out
    assert out.strip() == table.strip()
    assert code == 0
    rows = {int(r.split()[0]): r for r in out.splitlines() if re.match(r"\s+\d+ ", r)}
    assert sorted(rows) == [1, 2, 4, 8]
    assert " NO " in rows[1] and " yes " in rows[4]
    proposed = int(re.search(r"verdict: TP (\d+)", out).group(1))
    assert proposed > 1


def test_an_all_gather_bound_run_gets_the_tp_degree_that_ends_it(census):
    """FSDP over 4 on slow links: its collectives outlast the compute; at TP 2 each rank
    gathers and reduces half the weights from fewer peers, and the step is no longer bound."""
    from foundryx.plan.planner import flops_per_token
    from foundryx.plan.tp import Links, propose_tp, tp_options

    s = _setup(precision="amp_bf16")
    fpt = flops_per_token(census, 64)
    links = Links(1e6, 1e6)
    # FSDP per step, by hand: TP 1 gathers 2 x 106,816 x 2 B x 3/4 and reduces 106,816 x 4 B x
    # 3/4 (641 kB); TP 2, 2 microbatches: 2 x 2 x 53,568 x 2 B x 1/2 + 2 x 53,568 x 4 B x 1/2
    peak = fpt * 64 / (0.4 * 0.65)  # compute: 0.65 s per step at 40% MFU, at either degree
    options = {o.tp: o for o in tp_options(census, s, fpt, peak, 0.4, links)}
    assert options[1].comm.fsdp_s == pytest.approx((2 * 106_816 * 2 + 106_816 * 4) * 3 / 4 / 0.8e6)
    assert options[2].comm.fsdp_s == pytest.approx((2 * 53_568 * 2 + 53_568 * 4) / 2 * 2 / 0.8e6)
    assert options[1].comm.all_gather_bound and not options[2].comm.all_gather_bound
    proposal = propose_tp(list(options.values()), 1, 2**40, all_gather_bound=True)
    assert proposal is not None and proposal.tp == 2


def test_the_planner_splits_the_vocabulary_as_the_models_plan_does(tmp_path):
    """An untied Hugging Face head: embedding, head and loss vocabulary-parallel; a tied one
    whole on every TP rank (MPT's, tied or not, vocabulary-parallel)."""
    import yaml

    untied = make_plan(_write(tmp_path, 256), gpus=4, gpu="h100", tp=2)
    cfg = yaml.safe_load((tmp_path / "run.yaml").read_text())
    cfg["model"]["config"]["tie_word_embeddings"] = True
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    tied = make_plan(tmp_path / "run.yaml", gpus=4, gpu="h100", tp=2)
    assert (untied.setup.tp_vocab, tied.setup.tp_vocab) == ("parallel", "replicated")


def test_loss_parallel_counts_its_logits_split_and_its_own_graph(census):
    """The loss's buffers per rank, by hand (fp32, 1 x 64 tokens, vocabulary 256): plain, the
    logits, log-probabilities and gradient (4 + 4 + 4 bytes a logit); vocabulary-parallel at
    TP 2, the same on half of the vocabulary plus two copies for the loss's own graph."""
    def loss(**kw):
        return terms(census, _setup(**kw))["logits_and_loss"]

    assert loss(tp=1) == 64 * 256 * 12
    assert loss(tp=2, shard_degree=2, tp_vocab="parallel") == 64 * 128 * (12 + 8)
    assert loss(tp=2, shard_degree=2, tp_vocab="replicated") == 64 * 256 * 12
    # a vocabulary TP does not divide stays whole (the plans keep it so)
    odd = replace(census, shape=replace(census.shape, vocab_size=255))
    assert terms(odd, _setup(tp=2, shard_degree=2))["logits_and_loss"] == 64 * 255 * 12


def test_mpt_with_fewer_kv_heads_than_tp_holds_its_fused_qkv_whole():
    """MPT's fused Wqkv (d 64: q 64 rows, k and v 32 each at 2 kv heads) is replicated over
    TP 4 (q with k and v); out_proj and the MLP are split as ever."""
    from foundryx.plan.tp_shares import tp_linear_fraction

    model, shape, _ = build_meta({"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4,
                                  "n_layers": 2, "max_seq_len": 64, "vocab_size": 256,
                                  "attn_config": {"kv_n_heads": 2}})
    c = take_census(model, shape)
    qkv = 2 * (64 + 2 * 32) * 64  # both layers' Wqkv
    assert tp_linear_fraction(c, 2) == pytest.approx(1 / 2)  # 2 kv heads split over 2
    assert tp_linear_fraction(c, 4) * c.block_linear == pytest.approx((c.block_linear - qkv) / 4 + qkv)
    assert tp_degrees(c, 4) == [1, 2, 4]
