"""The longest sequence a run fits (``foundryx plan RECIPE --search max_seq_len``): the plan's
own terms (memory.py, host.py) at each length, bisected, and which part runs out just past it.

Device memory grows with the sequence (activations, the block being recomputed, the loss's
input gradient; with ``tiling.mlp: auto`` the MLP tiles from its threshold on, decided at each
length as training decides it), and so does host memory where checkpoints are offloaded. The
answer is the longest multiple of ``STEP`` tokens whose plan fits both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from foundryx.plan.census import Census
from foundryx.plan.host import HostSetup, host_plan
from foundryx.plan.memory import Setup, terms

STEP = 1024  # lengths are searched in multiples of this many tokens
LONGEST = 2**27  # 128M tokens: the search's ceiling

# the plan's device terms by the part of the run they belong to (what "runs out")
PARTS = {"frozen_weights": "weights", "trainable_weights": "weights", "gradients": "weights",
         "optimizer_state": "weights", "activations": "activations",
         "backward_working_set": "activations", "logits_and_loss": "logits"}


@dataclass(frozen=True)
class Longest:
    seq_len: int  # the longest length that fits (0: none, not even STEP tokens)
    device_bytes: int  # its plan's per-device total
    host_bytes: int  # its plan's host memory per node
    next_len: int  # the first length that does not fit
    ran_out: str  # weights, activations, logits or host: what runs out at next_len
    capped: bool = False  # the search reached LONGEST without running out

    def to_json(self) -> dict:
        return {"max_seq_len": self.seq_len, "per_device_bytes": self.device_bytes,
                "host_per_node_bytes": self.host_bytes, "first_not_fitting": self.next_len,
                "runs_out": self.ran_out, "capped": self.capped}


def at_length(s: Setup, seq: int) -> Setup:
    return replace(s, seq_len=seq)


def _fits(c: Census, s: Setup, h: HostSetup | None, capacity: int,
          host_capacity: int | None) -> tuple[bool, bool, int, int]:
    """(device fits, host fits, device bytes, host bytes per node) of ``s``."""
    device = sum(terms(c, s).values())
    host = 0
    if h is not None:
        scaled = replace(h, batch_bytes=s.microbatch * s.seq_len * 16)  # ids and labels
        host = host_plan(c, s, scaled, host_capacity or 0, "", 1.0).per_node
    return device <= capacity, h is None or host_capacity is None or host <= host_capacity, \
        device, host


def longest(c: Census, s: Setup, capacity: int, h: HostSetup | None = None,
            host_capacity: int | None = None) -> Longest:
    """The longest multiple of STEP tokens at which ``s`` fits ``capacity`` per device (and,
    with ``h``, ``host_capacity`` per node), and what runs out at the next length."""

    def ok(seq: int) -> bool:
        dev, host, _, _ = _fits(c, at_length(s, seq), h, capacity, host_capacity)
        return dev and host

    # memory grows with the length, except where tiling.mlp: auto starts tiling the MLP (it
    # drops there): each side of that length is searched on its own, the longer side first
    start = -(-s.mlp_tile_from // (STEP * s.microbatch)) if s.mlp_tile and s.mlp_tile_from else 0
    pieces = [(start, LONGEST // STEP)] + ([(1, start - 1)] if start > 1 else [])
    pieces = [(a, b) for a, b in pieces if 1 <= a <= b and ok(a * STEP)]
    if not pieces:
        return Longest(0, *_fits(c, at_length(s, STEP), h, capacity, host_capacity)[2:], STEP,
                       ran_out(c, None, at_length(s, STEP), h, capacity, host_capacity))
    lo, hi = pieces[0]
    if ok(hi * STEP):
        _, _, dev, host = _fits(c, at_length(s, hi * STEP), h, capacity, host_capacity)
        if hi == LONGEST // STEP:
            return Longest(hi * STEP, dev, host, 0, "", capped=True)
        return Longest(hi * STEP, dev, host, (hi + 1) * STEP, ran_out(
            c, at_length(s, hi * STEP), at_length(s, (hi + 1) * STEP), h, capacity, host_capacity))
    while lo + 1 < hi:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * STEP) else (lo, mid)
    fit, past = at_length(s, lo * STEP), at_length(s, hi * STEP)
    _, _, dev, host = _fits(c, fit, h, capacity, host_capacity)
    return Longest(lo * STEP, dev, host, hi * STEP,
                   ran_out(c, fit, past, h, capacity, host_capacity))


def ran_out(c: Census, fit: Setup | None, past: Setup, h: HostSetup | None, capacity: int,
            host_capacity: int | None) -> str:
    """What runs out at ``past`` (``fit``: the longest length that fits, None when none
    does): host memory when the node cannot hold it, else the device part that grew the most
    from ``fit`` (weights when even the shortest length does not fit)."""
    dev_ok, host_ok, _, _ = _fits(c, past, h, capacity, host_capacity)
    if dev_ok and not host_ok:
        return "host"
    if fit is None:
        return "weights"
    before, after = terms(c, fit), terms(c, past)
    grown: dict[str, int] = {}
    for name, part in PARTS.items():
        grown[part] = grown.get(part, 0) + after.get(name, 0) - before.get(name, 0)
    return max(grown, key=lambda k: grown[k])


RAN_OUT_WORDS = {
    "weights": "the weights, adapters and optimizer state alone",
    "activations": "activations (the checkpoints on the device and the block being recomputed)",
    "logits": "the loss (its logits chunk and the input's gradient)",
    "host": "host memory (the offloaded checkpoints)",
}


def describe(answer: Longest, device: str, capacity_gib: float, seq_key: str) -> str:
    """The answer in one line (what ``--search max_seq_len`` prints)."""
    if answer.capped:
        return (f"longest sequence that fits on {device} ({capacity_gib:,.2f} GiB): at least "
                f"{answer.seq_len:,} tokens (the search stops there), "
                f"{answer.device_bytes / 2**30:,.2f} GiB on paper")
    if not answer.seq_len:
        return (f"no sequence fits on {device} ({capacity_gib:,.2f} GiB), not even "
                f"{answer.next_len:,} tokens: {RAN_OUT_WORDS[answer.ran_out]} run out")
    return (f"longest sequence that fits on {device} ({capacity_gib:,.2f} GiB): "
            f"{answer.seq_len:,} tokens ({seq_key}={answer.seq_len}), "
            f"{answer.device_bytes / 2**30:,.2f} GiB per device and "
            f"{answer.host_bytes / 2**30:,.2f} GiB of host memory per node on paper; at "
            f"{answer.next_len:,} {RAN_OUT_WORDS[answer.ran_out]} run out")
