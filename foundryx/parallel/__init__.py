"""Parallelism applied from outside the model: FSDP2, activation checkpointing and offload,
per-block torch.compile, meta-device materialisation (see docs/distributed.md)."""

from foundryx.parallel.parallelize import parallelize

__all__ = ["parallelize"]
