"""Numbers derived from the config and the world size, computed in one place."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from foundryx.config.schema import TrainConfig


def world_size_from_env() -> int:
    """The number of processes the launcher started (composer, torchrun, Slurm)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Derived:
    world_size: int
    tensor_parallel: int
    data_parallel_ranks: int
    device_train_batch_size: int
    device_train_microbatch_size: int
    grad_accum: int
    device_eval_batch_size: int
    max_seq_len: int | None
    tokens_per_step: int | None

    def table(self) -> str:
        rows = asdict(self)
        width = max(map(len, rows))
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows.items())


def derive(cfg: TrainConfig, world_size: int) -> tuple[Derived | None, list[str]]:
    """Per-device batch, microbatch, grad accumulation and tokens per step, or the problems.
    With ``parallelism.tp`` the ranks of a tensor-parallel group share a batch: the batch is
    split over the world size / tp data-parallel ranks."""
    gbs = cfg.global_train_batch_size
    if gbs <= 0:
        return None, [f"global_train_batch_size: must be positive, got {gbs}"]
    tp = cfg.parallelism.tp if cfg.parallelism is not None else 1
    if tp < 1 or world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return None, [
            f"parallelism.tp: {tp} does not divide the world size {world_size}; use one of "
            f"{', '.join(map(str, divisors))}, or start a multiple of {tp} processes"
        ]
    cp = cfg.parallelism.cp if cfg.parallelism is not None else 1
    if cp < 1 or (world_size // tp) % cp:
        return None, [
            f"parallelism.cp: {cp} does not divide the {world_size // tp} ranks left by "
            f"tp {tp} (world size {world_size}); start a multiple of {tp * cp} processes, or "
            "choose a cp that divides them"
        ]
    dp = world_size // tp // cp  # the ranks of one TP group (and one CP group) read the same batch
    if gbs % dp:
        up = -(-gbs // dp) * dp
        across = (f"the {dp} data-parallel ranks (world size {world_size} / tp {tp}"
                  f"{f' / cp {cp}' if cp > 1 else ''})" if tp * cp > 1
                  else f"the world size {world_size}")
        fits = [d * tp * cp for d in range(1, gbs + 1) if gbs % d == 0][:8]
        return None, [
            f"global_train_batch_size: {gbs} does not divide by {across}; "
            f"use a multiple of {dp} (e.g. {up}), or start a number of processes that keeps "
            f"it: {', '.join(map(str, fits))} (a resume must keep the saved global batch)"
        ]
    device_bs = gbs // dp
    micro = device_bs if cfg.device_train_microbatch_size is None else cfg.device_train_microbatch_size
    if micro <= 0 or device_bs % micro:
        return None, [
            f"device_train_microbatch_size: {micro} must be positive and divide the per-device "
            f"batch {device_bs} (= global_train_batch_size {gbs} / "
            f"{f'{dp} data-parallel ranks' if tp * cp > 1 else f'world size {world_size}'})"
        ]
    seq = cfg.max_seq_len
    return Derived(
        world_size=world_size,
        tensor_parallel=tp,
        data_parallel_ranks=dp,
        device_train_batch_size=device_bs,
        device_train_microbatch_size=micro,
        grad_accum=device_bs // micro,
        device_eval_batch_size=cfg.device_eval_batch_size or micro,
        max_seq_len=seq,
        tokens_per_step=gbs * seq if seq else None,
    ), []
