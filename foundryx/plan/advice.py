"""What to change when a run does not fit: single changes ranked by what they cost, each with its
new per-device total, and the largest microbatch that fits."""

from __future__ import annotations

from dataclasses import dataclass, replace

from foundryx.plan.census import Census
from foundryx.plan.memory import Setup, full_checkpointing, terms
from foundryx.plan.tp import at_tp, tp_degrees

SUGGESTED_LORA_RANK = 16


@dataclass
class Suggestion:
    change: str  # what to do, in words
    overrides: str  # the change as key=value overrides (or a flag) of `foundryx plan` / train.py
    cost: str  # what it costs
    per_device_bytes: int


def total(c: Census, s: Setup) -> int:
    return sum(terms(c, s).values())


def with_microbatch(s: Setup, mb: int) -> Setup:
    """``s`` at microbatch ``mb``, the per-device batch kept (more or fewer microbatches per step;
    a microbatch above the per-device batch is one microbatch)."""
    batch = s.microbatch * s.grad_accum
    return replace(s, microbatch=mb, grad_accum=max(1, -(-batch // mb)))


def largest_microbatch(c: Census, s: Setup, capacity: int, upper: int = 4096) -> int:
    """The largest microbatch (1..upper) whose total fits ``capacity``, at the run's per-device
    batch; 0 when none does. Memory grows with the microbatch, so a bisection finds it."""
    if total(c, with_microbatch(s, 1)) > capacity:
        return 0
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(c, with_microbatch(s, mid)) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


Candidate = tuple[str, str, str, Setup | None]


def _candidates(c: Census, s: Setup, capacity: int) -> list[Candidate]:
    """(change, overrides, cost, new setup or None when it does not apply), cheapest first."""
    world = s.world_size
    dp = world // max(s.tp, 1)  # under TP, FSDP2 shards over the data-parallel ranks only
    all_linear = SUGGESTED_LORA_RANK * sum(o + i for o, i in c.linears.values())
    out: list[Candidate] = [
        (f"shard weights, gradients and optimizer state over all {world} devices (FSDP2)"
         if s.tp <= 1 else f"shard weights, gradients and optimizer state over all {dp} "
         f"data-parallel ranks (FSDP2, x TP {s.tp})",
         "parallelism.sharding_strategy=FULL_SHARD", "more communication, no more compute",
         replace(s, zero_stage=3, shard_degree=dp)
         if dp > 1 and (s.zero_stage < 3 or s.shard_degree < dp) else None),
    ]
    # the largest smaller microbatch that fits and divides the per-device batch (as the
    # config requires)
    batch = s.microbatch * s.grad_accum
    mb = next((m for m in range(s.microbatch - 1, 0, -1)
               if batch % m == 0 and total(c, with_microbatch(s, m)) <= capacity), 0)
    out.append((f"microbatch {mb} instead of {s.microbatch}, more gradient accumulation",
                f"device_train_microbatch_size={mb}", "lower device utilisation per step",
                with_microbatch(s, mb) if mb else None))
    out.append(("full activation checkpointing instead of selective (only each block's input "
                "kept)", "activation_checkpointing.mode=full",
                "more recompute: the kept matmuls and attention run again in backward",
                full_checkpointing(s)
                if s.activation_checkpointing and s.ac_selective else None))
    out.append(("activation checkpointing of every block", "activation_checkpointing=true",
                "about a third more compute (the forward runs twice)",
                replace(s, activation_checkpointing=True, ac_every=1)
                if not s.activation_checkpointing or s.ac_every > 1 else None))
    tp = next((t for t in tp_degrees(c, s.node_size or world) if t > s.tp
               and (new := at_tp(s, t)) is not None and total(c, new) <= capacity), 0)
    tp_setup = at_tp(s, tp) if tp else None
    out.append((f"tensor parallelism over {tp} devices of a node (sequence parallel), FSDP2 over "
                f"{tp_setup.shard_degree if tp_setup else 0}", f"parallelism.tp={tp}",
                "TP collectives every layer on the node's links (`foundryx plan --search tp`)",
                tp_setup))
    for dtype, cost in (("fp8", "FP8 e4m3 base weights (per-row scales): a small quality cost"),
                        ("int8", "int8 base weights (per-row scales): a small quality cost"),
                        ("nf4", "4-bit NF4 base weights (QLoRA): a larger quality cost")):
        out.append((f"store the frozen base in {dtype}", f"model.frozen_base.dtype={dtype}",
                    cost, replace(s, frozen_dtype=dtype)
                    if s.lora and s.frozen_dtype in (None, "bf16") else None))
    out.append(("offload half of the frozen base weights to CPU memory",
                "model.frozen_base.offload_fraction=0.5", "host-to-device copies each step",
                replace(s, offload_fraction=0.5) if s.lora and s.offload_fraction < 0.5 else None))
    out.append((f"LoRA (r={SUGGESTED_LORA_RANK}) instead of full fine-tuning",
                f"model.peft_config.target_modules=all-linear model.peft_config.r={SUGGESTED_LORA_RANK}",
                "trains adapters only: a different method, not the same model",
                replace(s, lora_params=all_linear,
                        lora_params_per_block=all_linear // c.shape.n_layers)
                if not s.lora else None))
    out.append((f"twice the devices ({2 * world})", f"--gpus/--nodes giving {2 * world} devices",
                "twice the hardware",
                replace(s, world_size=2 * world, shard_degree=2 * s.shard_degree)
                if s.zero_stage >= 1 else None))
    return out


def suggestions(c: Census, s: Setup, capacity: int) -> list[Suggestion]:
    """The single changes that make the run fit, cheapest first; when none does alone, the
    cheapest ones combined in that order until it fits (one combined suggestion)."""
    singles, combined = [], s
    for change, overrides, cost, new in _candidates(c, s, capacity):
        if new is None:
            continue
        t = total(c, new)
        if t <= capacity:
            singles.append(Suggestion(change, overrides, cost, t))
    if singles:
        return singles
    steps: list[tuple[str, str, str]] = []
    for i in range(len(_candidates(c, s, capacity))):
        change, overrides, cost, new = _candidates(c, combined, capacity)[i]
        if new is None:
            continue
        combined, steps = new, steps + [(change, overrides, cost)]
        if total(c, combined) <= capacity:
            return [Suggestion(" + ".join(x[0] for x in steps), " ".join(x[1] for x in steps),
                               "; ".join(x[2] for x in steps), total(c, combined))]
    return []
