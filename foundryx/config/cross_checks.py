"""Checks that span sections (each section's own entry sees only itself)."""

from __future__ import annotations

from typing import Any

LOADER_SECTIONS = ("train_loader", "eval_loader")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cross_section_problems(data: dict[str, Any]) -> list[str]:
    """Data settings the model cannot take: longer sequences, or no sequence_id when the
    model's attention needs it."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    model_len = _int(model.get("max_seq_len"))
    attn = model.get("attn_config") if isinstance(model.get("attn_config"), dict) else {}
    needs_ids = attn.get("attn_uses_sequence_id") is True
    problems = []
    for section in LOADER_SECTIONS:
        loader = data.get(section)
        ds = loader.get("dataset") if isinstance(loader, dict) else None
        if not isinstance(ds, dict):
            continue
        seq = _int(ds.get("max_seq_len"))
        if seq is not None and model_len is not None and seq > model_len:
            problems.append(
                f"{section}.dataset.max_seq_len: {seq} is longer than model.max_seq_len "
                f"{model_len}; lower it to {model_len} or less, or raise model.max_seq_len"
            )
        if needs_ids and loader.get("name") == "text" and ds.get("emit_sequence_id") is not True:
            problems.append(
                f"{section}.dataset.emit_sequence_id: model.attn_config.attn_uses_sequence_id is "
                f"true, so the batches need sequence_id; set emit_sequence_id: true"
            )
        if needs_ids and loader.get("name") == "finetuning" and ds.get("packing_ratio") is None:
            problems.append(
                f"{section}.dataset.packing_ratio: model.attn_config.attn_uses_sequence_id is "
                f"true, but unpacked fine-tuning batches have no sequence_id; set packing_ratio "
                f"(e.g. auto) or attn_uses_sequence_id: false"
            )
    return problems
