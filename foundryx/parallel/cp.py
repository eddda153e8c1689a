"""Context parallelism (``parallelism.cp``): each sequence split over the ``cp`` ranks of the
mesh, with Ulysses' all-to-all over heads around the model's own attention (DeepSpeed
Ulysses; ALST), applied from outside the model.

Each rank of a context-parallel group holds ``1/cp`` of every sequence (a contiguous shard)
through the whole model: embeddings, norms, MLPs, the loss. Only attention needs the whole
sequence; around it, two all-to-alls (:mod:`foundryx.parallel.ulysses`) swap the split:
before, every rank trades its shard of all heads for the whole sequence of ``1/cp`` of the
heads; the model's attention implementation runs unchanged on that (any mask stays exact: packed documents, ALiBi, sliding windows, key
padding, since each rank sees every position of its heads); after, the inverse all-to-all gives
each rank its shard of all heads back. Each rank needs whole key-value heads, so ``cp`` divides
the model's key-value heads (8 for Llama 3.1 8B/70B/405B: up to 8 ranks, one node).

Why not torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``,
torchtitan's): it replaces SDPA's CUDA flash/efficient/cuDNN operators only, so it cannot run on
CPU ranks (torch 2.7 and 2.15 both: ``aten._scaled_dot_product_flash_attention_for_cpu`` has no
sharding strategy), and it refuses an attention mask or bias (``attn_bias is not supported
yet``): no packed documents, no ALiBi. The all-to-all here is ``all_to_all_single``, which gloo
and NCCL both run.

The model declares what may be split, as data (as for tensor parallelism): the ComposerModel or
one of its direct children offers ``foundryx_cp_plan()``::

    {"heads": 32, "kv_heads": 8,                 # cp must divide both
     "attention": {"<module-name pattern>": "<attribute>"},   # attributes holding an
                                                 # attention_implementations function
                                                 # (q (b, s, h, d) ...): wrapped in place
     "hf_attention": "<module-name pattern>",    # or: Hugging Face attention modules, run
                                                 # through transformers' attention interface
     "positions": "<attribute>",                 # optional: fn(input_ids, attention_mask,
                                                 # sequence_id) -> (b, s) positions of the
                                                 # whole sequence (default: position_ids of
                                                 # the batch, else 0..s-1)
     "unsupported": None or "why not"}

The batch is split at the model's entry (``_forward`` of a foundryx causal LM, the one training
and evaluation go through): each rank gets its shard of ``input_ids``, ``attention_mask``,
``sequence_id``, the positions of the whole sequence (``position_ids``: RoPE and learned
positions see the true positions) and the next-token targets already shifted
(``shift_labels``: a shard's last token predicts the next shard's first, which no rank could do
after the split). A loss taken from the rank's targets is rescaled so that the mean of the
ranks' losses (Composer's logged loss) is the token mean of the whole sequence and the
data-parallel mean of gradients (FSDP2's, over ``shard x cp``) is its gradient. Evaluation of
a model that fuses its loss takes that loss too (its cross-entropy and perplexity metrics read
it); logits (an unfused model) are gathered whole. A length the degree does not divide is padded on the right
(padding keys are never seen by a causal query).
"""

from __future__ import annotations

import fnmatch
import logging
import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundryx.errors import ConfigError
from foundryx.parallel import tp_plan
from foundryx.parallel.fsdp import mesh_shape
from foundryx.parallel.ulysses import gather_seq, heads_to_seq, seq_to_heads

log = logging.getLogger(__name__)

PLAN_HOOK = "foundryx_cp_plan"
MODELS_WITH_PLANS = ("mpt_causal_lm (MPT)",
                     "hf_causal_lm with a Llama, Mistral, Qwen2 or Qwen3 model")
IGNORE_INDEX = -100  # foundryx.models.layers.loss's: labels no loss is taken for
HF_KEY = "foundryx_ulysses"  # the key of transformers' attention interface the wrapper has
SHARDED = ("input_ids", "attention_mask", "sequence_id", "position_ids", "shift_labels")


# ---------------------------------------------------------------- attention wrappers

def ulysses(attn_fn: Callable[..., torch.Tensor], group: Any) -> Callable[..., torch.Tensor]:
    """An ``attention_implementations`` function run on a context-parallel shard: q
    (b, s/n, h, d), k/v (b, s/n, kv_h, d) in, the shard's output out; ``attn_fn`` sees the whole
    sequence of this rank's heads, with the whole ``sequence_id`` and ``key_padding_mask`` and
    this rank's ALiBi slopes."""

    def attention(q, k, v, *, sequence_id=None, alibi_slopes=None, key_padding_mask=None,
                  **kwargs):
        n, r = tdist.get_world_size(group), tdist.get_rank(group)
        if alibi_slopes is not None:
            per = alibi_slopes.shape[0] // n
            alibi_slopes = alibi_slopes[r * per:(r + 1) * per]
        # a shard without padding may come without a mask while another has one: every rank
        # gathers one (all true where none), and the whole decides
        keep = (torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
                if key_padding_mask is None else key_padding_mask.bool())
        keep = gather_seq(keep, group)
        out = attn_fn(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group),
                      sequence_id=gather_seq(sequence_id, group), alibi_slopes=alibi_slopes,
                      key_padding_mask=None if bool(keep.all()) else keep, **kwargs)
        return heads_to_seq(out, group)

    attention.foundryx_cp_inner = attn_fn
    return attention


def hf_ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any):
    """The function transformers' attention interface holds under ``HF_KEY``: the module's
    own implementation (``module.foundryx_cp = (function, group)``) on the whole sequence of
    this rank's heads. q/k/v come as (b, h, s/n, d). The whole sequence's ``position_ids``
    go on to it; where they restart (packed documents) the mask keeps each document to itself
    (flash-attn's varlen finds them from the positions itself)."""
    inner, group, uses_positions = module.foundryx_cp
    q, k, v = (seq_to_heads(t.transpose(1, 2), group).transpose(1, 2) for t in (query, key, value))
    positions = gather_seq(kwargs.pop("position_ids", None), group)
    mask = None
    if positions is not None:
        if uses_positions:
            kwargs["position_ids"] = positions
        else:
            mask = document_mask(positions)
    out, weights = inner(module, q, k, v, mask, **kwargs)  # out: (b, s, h/n, d)
    return heads_to_seq(out, group), weights


def document_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """A causal keep-mask (b, 1, s, s) keeping each document to itself where ``positions``
    restart (packing with position ids); None when they never do (plain causal attention)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    doc = starts.cumsum(dim=1)
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def hf_inner_attention(module: nn.Module, name: str) -> Callable[..., Any]:
    """The Hugging Face attention function ``name`` (the model's attn_implementation)."""
    if name in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # heavy: only for HF models

    return ALL_ATTENTION_FUNCTIONS[name]


def register_hf_attention() -> None:
    """``HF_KEY`` in transformers' attention interface (a registry entry, like a plugin's: what
    runs is decided by each model's config and its modules' ``foundryx_cp``)."""
    from transformers import AttentionInterface  # heavy: only for HF models

    AttentionInterface.register(HF_KEY, hf_ulysses_attention)


# ---------------------------------------------------------------- the plan and its checks

def find_plan(model: nn.Module) -> tuple[str, nn.Module, dict[str, Any]] | None:
    """``(prefix, owner, plan)`` of the first owner (the model, then its direct children) that
    declares a context-parallel plan; None when none does."""
    return tp_plan.find_plan(model, hook=PLAN_HOOK)


def plan_problems(model: nn.Module, cp: int, tp: int = 1) -> list[str]:
    """What stops ``model`` from running at context-parallel degree ``cp`` (empty: nothing)."""
    if cp == 1:
        return []
    if tp > 1:
        return [f"parallelism.cp: {cp} with parallelism.tp: {tp}: context parallelism does not "
                "combine with tensor parallelism yet; use one of them (cp up to the model's "
                "key-value heads, within a node)"]
    found = find_plan(model)
    if found is None:
        return [f"parallelism.cp: {cp}, but the model declares no context-parallel plan (its "
                "attention cannot be split by sequence from outside); models with one: "
                f"{', '.join(MODELS_WITH_PLANS)} (or set cp: 1)"]
    plan = found[2]
    if plan.get("unsupported"):
        return [f"parallelism.cp: {cp}: {plan['unsupported']} (or set cp: 1)"]
    kv, heads = int(plan["kv_heads"]), int(plan["heads"])
    if kv % cp or heads % cp:
        fits = [d for d in range(1, kv + 1) if kv % d == 0 and heads % d == 0]
        return [f"parallelism.cp: {cp} does not divide the model's {kv} key-value heads ({heads} "
                "query heads): Ulysses context parallelism gives each rank whole key-value "
                f"heads; use one of {', '.join(map(str, fits))}"]
    if not callable(getattr(model, "_forward", None)):
        return [f"parallelism.cp: {cp}: {type(model).__name__} has no _forward(batch, fused) "
                "entry (foundryx's causal LMs have one) for the batch to be split at"]
    return []


def length_problem(seq: int | None, cp: int, what: str = "max_seq_len") -> str | None:
    """The message for a sequence length the context-parallel degree does not divide."""
    if cp <= 1 or not seq or seq % cp == 0:
        return None
    down, up = seq // cp * cp, -(-seq // cp) * cp
    return (f"{what}: {seq} does not divide by parallelism.cp: {cp} (each rank takes an equal "
            f"shard of every sequence); use a multiple of {cp}, e.g. {down or up} or {up}")


# ---------------------------------------------------------------- the batch at the entry

def shift_targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """The target of every position: the next token's label (``labels``, else input_ids with
    padding ignored, as foundryx's models take them), -100 at the last position."""
    ids = batch["input_ids"]
    labels = batch.get("labels")
    if labels is None:
        mask = batch.get("attention_mask")
        labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def _pad(t: torch.Tensor, pad: int, value: Any) -> torch.Tensor:
    return torch.cat([t, t.new_full((t.shape[0], pad, *t.shape[2:]), value)], dim=1)


class ContextParallel:
    """The split of one model's batches over a context-parallel group (see the module)."""

    def __init__(self, group: Any, positions: Callable[..., torch.Tensor] | None):
        self.group = group
        self.n = tdist.get_world_size(group)
        self.rank = tdist.get_rank(group)
        self.positions = positions

    def whole_positions(self, batch: Mapping[str, Any]) -> torch.Tensor:
        if batch.get("position_ids") is not None:
            return batch["position_ids"]
        ids = batch["input_ids"]
        if self.positions is not None:
            return self.positions(ids, batch.get("attention_mask"), batch.get("sequence_id"))
        return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)

    def shard(self, batch: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """This rank's batch, and the padding added on the right of the whole sequence."""
        ids = batch["input_ids"]
        s = ids.shape[1]
        pad = -s % self.n
        whole = {"input_ids": ids, "shift_labels": shift_targets(batch),
                 "position_ids": self.whole_positions(batch)}
        if batch.get("attention_mask") is not None or pad:
            mask = batch.get("attention_mask")
            whole["attention_mask"] = torch.ones_like(ids) if mask is None else mask
        if batch.get("sequence_id") is not None:
            whole["sequence_id"] = batch["sequence_id"]
        if pad:
            fill = {"input_ids": 0, "shift_labels": IGNORE_INDEX, "attention_mask": 0,
                    "sequence_id": -1}
            for k, t in whole.items():
                if k == "position_ids":  # counting on past the end
                    more = t[:, -1:] + torch.arange(1, pad + 1, device=t.device)
                    whole[k] = torch.cat([t, more], dim=1)
                else:
                    whole[k] = _pad(t, pad, fill[k])
        per = (s + pad) // self.n
        mine = {k: t[:, self.rank * per:(self.rank + 1) * per] for k, t in whole.items()}
        rest = {k: v for k, v in batch.items() if k not in (*SHARDED, "labels")}
        return {**rest, **mine}, pad

    def loss(self, loss: torch.Tensor, local: Mapping[str, Any]) -> torch.Tensor:
        """A rank's token-mean loss over its targets, rescaled: ``n x sum / N`` (N: the whole
        sequence's targets), so that the mean over the ranks is the token mean of the whole
        and so is the mean of their gradients; zero where the rank has no target."""
        mine = (local["shift_labels"] != IGNORE_INDEX).sum()
        total = mine.clone()
        tdist.all_reduce(total, group=self.group)
        factor = mine.to(loss.dtype) * self.n / total.clamp(min=1).to(loss.dtype)
        return torch.where(mine > 0, loss * factor, torch.zeros_like(loss))

    def forward(self, inner: Callable[..., Any], batch: Mapping[str, Any], fused: bool):
        """The model's ``_forward(batch, fused)`` on this rank's shard."""
        local, pad = self.shard(batch)
        out = inner(local, fused)
        if getattr(out, "logits", None) is None:
            out.loss = self.loss(out.loss, local)
            return out
        logits = gather_seq(out.logits, self.group, grad=torch.is_grad_enabled())
        out.logits = logits[:, :logits.shape[1] - pad] if pad else logits
        out.loss = None  # taken from the whole logits by the model's loss
        return out


def fused_eval_forward(model: nn.Module, inner: Callable[..., Any], batch: Mapping[str, Any],
                       outputs: Any = None) -> Any:
    """A fusing model's ``eval_forward`` under context parallelism: the loss taken from each
    rank's shard (what its cross-entropy and perplexity metrics read: ``update_metric``) in
    place of the whole sequence's logits (tokens x vocabulary on every rank)."""
    if outputs is None:
        outputs = model._forward(batch, fused=True)
    return inner(batch, outputs)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> int:
    """Wrap ``model``'s attention (from its plan) in the all-to-alls over ``mesh``'s group and
    split its batches at its entry; returns how many attention modules were wrapped."""
    group = mesh.get_group()
    prefix, owner, plan = find_plan(model)
    touched = 0
    for pattern, attr in (plan.get("attention") or {}).items():
        for name, m in owner.named_modules():
            if fnmatch.fnmatchcase(name, pattern):
                setattr(m, attr, ulysses(getattr(m, attr), group))
                touched += 1
    if plan.get("hf_attention"):
        register_hf_attention()
        config = owner.config
        impl = config._attn_implementation
        for name, m in owner.named_modules():
            if fnmatch.fnmatchcase(name, plan["hf_attention"]):
                m.foundryx_cp = (hf_inner_attention(m, impl), group,
                                 str(impl).startswith("flash_attention"))
                touched += 1
        config._attn_implementation = HF_KEY
    if not touched:
        raise ConfigError([f"parallelism.cp: the model's context-parallel plan names no module "
                           f"of {type(owner).__name__} ({prefix or 'the model'}): nothing to split"])
    positions = getattr(owner, plan["positions"]) if plan.get("positions") else None
    cp = ContextParallel(group, positions)
    model._forward = partial(cp.forward, model._forward)
    if getattr(model, "fuses_loss", False):  # eval: the loss shard by shard, no logits whole
        model.eval_forward = partial(fused_eval_forward, model, model.eval_forward)
    model.foundryx_context_parallel = cp
    flops = getattr(model, "flops_per_batch", None)
    if callable(flops):  # each rank does 1/n of the batch's work
        model.flops_per_batch = lambda batch: flops(batch) // cp.n
    return touched


def build_cp_mesh(replicate: int, shard: int, cp: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The mesh (replicate, shard, cp), the context-parallel ranks innermost (neighbours: one
    node), and the mesh FSDP2 shards over: shard x cp flattened (the ranks of a context-parallel
    group hold the same weights: their gradients are averaged and their weights sharded like
    data-parallel ranks', as torchtitan's dp_shard_cp), with replicate beside it (hybrid)."""
    from torch.distributed.device_mesh import init_device_mesh

    log.info("device mesh: %d replicas x %d shards x %d context-parallel ranks", replicate, shard, cp)
    mesh = init_device_mesh(device_type, (replicate, shard, cp),
                            mesh_dim_names=("replicate", "shard", "cp"))
    mesh["shard", "cp"]._flatten("dp_shard_cp")  # torchtitan's way (a private DeviceMesh API)
    dp = mesh["dp_shard_cp"] if replicate == 1 else mesh["replicate", "dp_shard_cp"]
    return mesh, dp


def cp_mesh_shape(parallelism: Any, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicate, shard) of the data-parallel ranks beside ``parallelism.cp`` (ConfigError
    for a degree the world size, or the node, cannot hold)."""
    cp = parallelism.cp
    if world_size % cp:
        raise ConfigError([f"parallelism.cp: {cp} does not divide the world size {world_size}; "
                           f"start a multiple of {cp} processes"])
    if local_world_size % cp:
        raise ConfigError([f"parallelism.cp: {cp} does not divide the {local_world_size} "
                           "processes of a node; a context-parallel group runs two all-to-alls "
                           "per layer and stays within a node"])
    if parallelism.tp > 1:
        raise ConfigError(plan_problems(nn.Module(), cp, parallelism.tp))
    return mesh_shape(parallelism, world_size // cp, max(local_world_size // cp, 1))
