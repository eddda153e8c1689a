"""Measured attention speed per device kind: the data ``attn_impl: auto`` chooses from.

One row per case measured on one kind of device: the device's name as
``torch.cuda.get_device_name()`` gives it (the key ``auto`` matches, exactly, case aside), its
architecture (``sm90``, ``gfx942``: for people), the case (head dim; ``mask``: what the call
carries besides causality: ``none`` (one document, SDPA's fused kernels), ``docs`` (packed
documents, ``sequence_id``), ``alibi``, ``docs+alibi``; causal; GQA), the sequence length it was
measured at, and TFLOP/s of each implementation, forward + backward (``train``) and forward
alone (``fwd``), counted as benchmarks/attention.py counts them (attended pairs only). ``source``
says where the figures came from.

``python -m benchmarks.attention --table rows.json`` measures the rows of the GPU at hand;
``python -m benchmarks.attention --apply-table rows.json`` replaces that device's rows below
(between the BEGIN/END lines, which the script rewrites; no GPU needed for that).
"""

from __future__ import annotations

from typing import Any

H100_SOURCE = (
    "benchmarks/RESULTS.md, GPU section: run book 2026-11-27, `python benchmarks/attention.py "
    "--seqs 4096 --head-dims 128 --no-mpt`, torch 2.11.0+cu130, Triton 3.6.0, no flash-attn"
)

# BEGIN ROWS (rewritten by benchmarks/attention.py --apply-table)
ROWS: list[dict[str, Any]] = [
    {"device": "NVIDIA H100 80GB HBM3", "arch": "sm90", "head_dim": 128, "mask": "none", "causal": True, "gqa": False, "seq": 4096, "train": {"triton": 146.0, "torch": 479.0}, "fwd": {"triton": 395.0, "torch": 554.0}, "source": H100_SOURCE},
    {"device": "NVIDIA H100 80GB HBM3", "arch": "sm90", "head_dim": 128, "mask": "docs", "causal": True, "gqa": False, "seq": 4096, "train": {"triton": 88.0, "torch": 22.0}, "fwd": {"triton": 116.0, "torch": 19.0}, "source": H100_SOURCE},
    {"device": "NVIDIA H100 80GB HBM3", "arch": "sm90", "head_dim": 128, "mask": "none", "causal": False, "gqa": False, "seq": 4096, "train": {"triton": 152.0, "torch": 548.0}, "fwd": {"triton": 455.0, "torch": 615.0}, "source": H100_SOURCE},
    {"device": "NVIDIA H100 80GB HBM3", "arch": "sm90", "head_dim": 128, "mask": "docs", "causal": False, "gqa": False, "seq": 4096, "train": {"triton": 111.0, "torch": 45.0}, "fwd": {"triton": 202.0, "torch": 39.0}, "source": H100_SOURCE},
]
# END ROWS
