"""``foundryx plan``'s text: the device-memory table, the host-memory table and load time, the
communication and throughput lines, the tensor-parallel comparison, and the notes.

    print(render(make_plan("yamls/finetune/llama-lora.yaml", gpus=8, gpu="h100")))
"""

from __future__ import annotations

from foundryx.plan.gpus import GiB
from foundryx.plan.host import HOST_DOCS, LOAD_MODES
from foundryx.plan.memory import TERM_DOCS, loss_is_fused
from foundryx.plan.planner import Plan, data_parallel
from foundryx.plan.tp import ACTIVATION_TERMS


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def count(n: float) -> str:
    """A parameter count in the unit that shows it: 8.03B, 41.9M, 1.57M, 12.3k."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def term_doc(name: str, p: Plan) -> str:
    if name != "logits_and_loss":
        return TERM_DOCS[name]
    how = ("the fused loss: one chunk, in place" if loss_is_fused(p.census.shape, p.setup)
           else "whole: the model's own loss")
    return f"{TERM_DOCS[name]} ({how})"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:,.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def render_host(p: Plan) -> list[str]:
    """The host-memory table: per-rank terms, the two phases, per node, and the load time."""
    h = p.host
    if h is None:
        return []
    lines = ["", f"  {'host, per rank':<22} {'':>14}"]
    for name, value in h.terms.items():
        if value:
            lines.append(f"  {name:<22} {_gib(value):>14}   {HOST_DOCS[name]}")
    lines += [f"  {'loading peak':<22} {_gib(h.load_per_rank):>14}   "
              "baseline + runtime + loader transient (the rank that reads the most)",
              f"  {'training peak':<22} {_gib(h.train_per_rank):>14}   "
              "baseline + runtime + what stays in host memory",
              f"  {'per node':<22} {_gib(h.per_node):>14}   {h.ranks_per_node} rank(s), the "
              "larger of their loading and training sums",
              f"  {'host memory':<22} {_gib(h.capacity):>14}   per node: {h.node}", ""]
    verdict = "fits" if h.fits else "DOES NOT FIT"
    lines.append(f"host memory {verdict}: headroom {_gib(h.capacity - h.per_node)} per node")
    if h.read_per_node:
        lines.append(f"loading: {LOAD_MODES[h.load]}; {h.read_per_rank / 1e9:,.1f} GB per rank, "
                     f"{h.read_per_node / 1e9:,.1f} GB per node at {h.read_rate / 1e9:,.1f} GB/s "
                     f"(--read-rate): about {_duration(h.load_seconds)}")
    else:
        lines.append(f"loading: {LOAD_MODES['none']}")
    return lines


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f} s"


def _amount(n: float) -> str:
    """Bytes in GB, or in MB when under 0.1 GB (a small model's TP traffic is not 0.0 GB)."""
    return _gb(n) if n >= 1e8 else f"{n / 1e6:,.1f} MB"




def render_comm(p: Plan) -> list[str]:
    """A step's communication per device, and the TP verdict: all-gather bound, or a TP
    degree that makes the run fit."""
    c, s = p.comm, p.setup
    if c is None or (not c.tp_payload and not c.fsdp_gather):
        return []
    lines = ["", f"communication per step, per device ({s.grad_accum} microbatch(es)):"]
    if c.tp_payload:
        when = (f"{_secs(c.tp_s)} within the node (exposed)" if c.tp_s is not None else
                f"no time estimate (no link rate for {p.device} devices)")
        lines.append(f"  {'tensor parallel':<22} {_amount(c.tp_payload):>14}   TP {s.tp}: "
                     f"{'all-gather + reduce-scatter' if s.sequence_parallel else 'all-reduce'}"
                     f" of tokens x d_model, 4 per layer (+2 recomputed); "
                     f"{_amount(c.tp_sent)} sent, {when}")
    if c.fsdp_gather:
        lines.append(f"  {'FSDP all-gather':<22} {_amount(c.fsdp_gather):>14}   weights received "
                     f"(forward{' and backward' if s.reshard_after_forward else ''}), "
                     f"{c.fsdp_link}")
        lines.append(f"  {'FSDP reduce-scatter':<22} {_amount(c.fsdp_reduce):>14}   gradients sent; "
                     f"with the all-gathers {_secs(c.fsdp_s)} (overlapped with compute)")
    if c.compute_s is not None:
        lines.append(f"  {'compute':<22} {_secs(c.compute_s):>14}   at {p.mfu:.0%} MFU")
    if c.all_gather_bound:
        lines += ["", f"ALL-GATHER BOUND: FSDP's collectives take {_secs(c.fsdp_s)} per step and "
                  f"compute {_secs(c.compute_s)}; the GPUs wait on the network"]
    o = p.tp_proposal
    if o is not None:
        why = "makes it fit" if not p.device_fits else "is not all-gather bound"
        lines += ["", f"tensor parallelism: TP {o.tp} x FSDP2 over {o.setup.shard_degree} {why}: "
                  f"{_gib(o.per_device_bytes)} per device (activations {_gib(o.activation_bytes)}"
                  f" instead of {_gib(sum(p.terms[k] for k in ACTIVATION_TERMS))}), FSDP "
                  f"{_gb(o.comm.fsdp_gather)} all-gathered per step instead of "
                  f"{_gb(c.fsdp_gather)}, TP {_gb(o.comm.tp_payload)} per step within the node; "
                  f"step {_secs(o.comm.step_s)} instead of {_secs(c.step_s)}  "
                  f"[parallelism.tp={o.tp}]  (`--search tp` compares every degree)"]
    return lines


def render_tp_table(p: Plan) -> str:
    """``--search tp``: the run at each TP degree worth trying, same devices and global batch."""
    s = p.setup
    head = (f"{'TP':>3} {'FSDP':>5} {'mb x acc':>9} {'weights+optim':>14} {'activations':>12} "
            f"{'FSDP buffers':>13} {'per device':>11} {'fits':>5} {'TP comm':>12} "
            f"{'FSDP gather':>12} {'step':>9}")
    lines = [f"foundryx plan --search tp: {count(p.census.total)} parameters on "
             f"{s.world_size} x {p.device} ({_gib(p.capacity)} each), microbatch "
             f"{s.microbatch} x {s.seq_len} tokens per TP group, the same global batch; "
             f"sequence parallel {'on' if s.sequence_parallel else 'off'}", "", head]
    for o in p.tp_options:
        c = o.comm
        lines.append(
            f"{o.tp:>3} {o.setup.shard_degree:>5} {f'{o.setup.microbatch} x {o.setup.grad_accum}':>9} "
            f"{_gib(o.state_bytes):>14} {_gib(o.activation_bytes):>12} "
            f"{_gib(o.terms['fsdp_buffers']):>13} {_gib(o.per_device_bytes):>11} "
            f"{'yes' if o.per_device_bytes <= p.capacity else 'NO':>5} "
            f"{_gb(c.tp_payload):>12} {_gb(c.fsdp_gather):>12} {_secs(c.step_s):>9}")
    lines += ["", "memory: GiB (2^30 B) per device; activations: kept activations, backward "
              "working set and loss buffers; per device: every term",
              "comm: GB (10^9 B) per device per step; step: compute at "
              f"{p.mfu:.0%} MFU plus the exposed TP collectives, or FSDP's when they take longer"]
    fitting = [o for o in p.tp_options if o.per_device_bytes <= p.capacity]
    if not fitting:
        lines.append("verdict: no TP degree fits; see `foundryx plan` without --search for "
                     "other changes")
    else:
        best = min(fitting, key=lambda o: (o.comm.step_s or 0.0, o.tp))
        lines.append(f"verdict: TP {best.tp} (smallest step time that fits"
                     f"{'; the config' if best.tp == s.tp else f'; the config has TP {s.tp}'})"
                     f"  [parallelism.tp={best.tp}]")
    return "\n".join(lines)


def render(p: Plan) -> str:
    """The plan as a table people read."""
    s, c = p.setup, p.census
    sharding = (f"FSDP2 over {s.shard_degree}" if s.zero_stage >= 3 and s.shard_degree > 1
                else "replicated" if s.world_size > s.tp else "one device")
    if s.tp > 1:
        sp = "(sequence parallel)" if s.sequence_parallel else "(no sequence parallel)"
        sharding = (f"{sharding} x TP {s.tp} {sp}" if s.world_size > s.tp else
                    f"tensor parallel over {s.tp} devices {sp}, no sharding")
    trainable = s.lora_params or c.total
    lines = [
        f"foundryx plan: {count(c.total)} parameters ({count(trainable)} trainable), "
        f"{s.world_size} x {p.device}, {sharding}, microbatch {s.microbatch} x {s.seq_len} tokens, "
        f"{s.precision}{', ' if s.activation_checkpointing else ''}"
        f"{'selective ' if s.activation_checkpointing and s.ac_selective else ''}"
        f"{'activation checkpointing' if s.activation_checkpointing else ''}"
        f"{' (inputs offloaded)' if s.act_offload and s.activation_checkpointing else ''}"
        f"{', activations offloaded' if s.act_offload and not s.activation_checkpointing else ''}"
        f"{tiled_words(s)}"
        f"{f', base {s.frozen_dtype}' if s.frozen_dtype else ''}"
        f"{f', offload {s.offload_fraction:g}' if s.offload_fraction else ''}",
        "",
        f"  {'per device':<22} {'':>14}",
    ]
    for name, value in p.terms.items():
        if value:
            lines.append(f"  {name:<22} {_gib(value):>14}   {term_doc(name, p)}")
    lines += [f"  {'total':<22} {_gib(p.per_device_bytes):>14}",
              f"  {'device memory':<22} {_gib(p.capacity):>14}", ""]
    verdict = "device memory fits" if p.device_fits else "device memory DOES NOT FIT"
    lines.append(f"{verdict}: headroom {_gib(p.capacity - p.per_device_bytes)}; largest "
                 f"microbatch that fits: {p.largest_microbatch or 'none'}")
    lines += render_host(p)
    lines += ["", ("FITS" if p.fits else "DOES NOT FIT") + ": " +
              ", ".join(f"{what} {'fits' if ok else 'does not'}" for what, ok in
                        (("device memory", p.device_fits), ("host memory", p.host_fits)))]
    dp = data_parallel(s)
    if s.tp > 1 and dp == 1:  # one TP group: one copy of the weights, split, none to shard
        lines += ["", f"  by sharding: nothing to shard over (TP {s.tp} splits the layers over "
                  f"all {s.world_size} devices; FSDP2 shards over world size / tp = 1 rank)"]
    else:
        lines += ["", f"  by sharding over {dp}{' data-parallel ranks' if s.tp > 1 else ''} "
                  "(ZeRO stage): " + ", ".join(f"{k} {_gib(v)}" for k, v in p.by_sharding.items())]
    if p.suggestions:
        lines += ["", "To make it fit on the device (cheapest first):"]
        for i, sug in enumerate(p.suggestions, 1):
            lines.append(f"  {i}. {sug.change}: {_gib(sug.per_device_bytes)}  [{sug.overrides}]  "
                         f"({sug.cost})")
    elif not p.device_fits:
        lines += ["", "No change the planner knows makes it fit: more devices with sharding, "
                  "a smaller model or a shorter sequence."]
    if p.host_fixes:
        lines += ["", "To make it fit in host memory:"]
        for i, fix in enumerate(p.host_fixes, 1):
            lines.append(f"  {i}. {fix.change}: {_gib(fix.per_node_bytes)} per node  "
                         f"[{fix.overrides}]")
    elif not p.host_fits:
        lines += ["", "No change the planner knows brings host memory under the node's: a node "
                  "with more memory (--host-memory), or more nodes with fewer ranks each."]
    lines += render_comm(p)
    tps = p.tokens_per_s
    lines += ["", f"throughput: {p.flops_per_token / 1e9:,.2f} GFLOP per token"]
    if tps:
        lines[-1] += (f"; at {p.mfu:.0%} MFU of {p.peak_flops / 1e12:,.0f} TFLOP/s x "
                      f"{s.world_size}: {tps:,.0f} tokens/s, {1e9 / tps / 3600:,.1f} h per 1B tokens")
    if tps and p.speed is not None:  # where the MFU came from: the measured row, or why none
        lines.append(f"  MFU {p.mfu:.1%}, {p.speed.line}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def tiled_words(s) -> str:  # noqa: ANN001
    """``, MLP and norms tiled by N`` (what tiling does at this microbatch), or nothing."""
    parts = [w for w, on in (("MLP", s.mlp_tiled), ("norms", s.norm_tiled)) if on]
    return f", {' and '.join(parts)} tiled by {s.mlp_tile or s.norm_tile}" if parts else ""
