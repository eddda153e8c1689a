"""benchmarks/train_throughput.py: the MFU table's cases are valid configs, and one step's
profile (top kernels) comes out of a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tp():
    from benchmarks import train_throughput  # imports Composer and foundryx's training

    return train_throughput


def test_the_mfu_table_cases_are_valid_run_configs(tp, monkeypatch, tmp_path):
    from foundryx.config import load_config

    monkeypatch.setattr(tp, "gpu_tokenizer", lambda: tmp_path)
    cases = tp.gpu_cases(["125m", "350m", "1b"], 30, attn="triton")
    assert len(cases) == 3 * 8
    labels = [c[0] for c in cases[16:]]
    assert labels == ["MPT-1B, no AC, eager", "MPT-1B, no AC, compile", "MPT-1B, AC every block, eager",
                      "MPT-1B, AC every block, compile", "MPT-1B, selective AC, eager",
                      "MPT-1B, selective AC, compile", "MPT-1B, no AC, compile, float8 rowwise",
                      "MPT-1B, no AC, compile, float8 tensorwise"]
    for label, config, overrides, _ in cases:
        loaded = load_config(config, [o for o in overrides if not o.startswith("train_loader.name")],
                             component_sections=[])
        cfg = loaded.cfg
        assert cfg.model["attn_config"]["attn_impl"] == "triton"
        assert cfg.compile.enabled is ("compile" in label)
        assert cfg.activation_checkpointing.enabled is ("AC every" in label or "selective" in label)
        assert (cfg.activation_checkpointing.mode == "selective") is ("selective" in label)
        assert cfg.float8.enabled is ("float8" in label)
        if cfg.float8.enabled:
            assert cfg.float8.recipe in label
    one = tp.gpu_cases(["1b"], 15, ["sel-compile"], micro_batch=12)
    assert [c[0] for c in one] == ["MPT-1B, selective AC, compile"]
    assert "device_train_microbatch_size=12" in one[0][2]
    assert tp.profile_name("MPT-1B, no AC, compile, float8 rowwise") == "mpt-1b-no-ac-compile-float8-rowwise"


def test_summarise_and_a_failed_case(tp):
    rows = [{"batch": b, "throughput/tokens_per_sec": 10.0 * b, "throughput/device/mfu": 0.1}
            for b in range(1, 7)]
    assert tp.summarise(rows, 5) == {"tokens_per_sec": 55.0, "mfu": 0.1}


@pytest.mark.slow
def test_one_step_is_profiled_in_a_real_run(tp, quickstart_data, tmp_path, monkeypatch):
    """The quickstart on the CPU, 7 batches, the last profiled: its top ops (CPU time here,
    GPU kernels on a GPU) as text and JSON, and the profiled batch left out of the average."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "profiles" / "quickstart"
    row = tp.run_case("yamls/quickstart.yaml",
                      [f"variables.data_root={quickstart_data}", "max_duration=7ba", "device=cpu"],
                      1, tmp_path, warmup=1, profile=f"{out}@6")
    assert "error" not in row and row["tokens_per_sec"] > 0, row
    top = json.loads(out.with_suffix(".json").read_text())
    assert top["total_gpu_ms"] > 0 and 5 <= len(top["top"]) <= tp.PROFILE_ROWS
    assert {"name", "calls", "self_gpu_ms", "share"} <= set(top["top"][0])
    text = out.with_suffix(".txt").read_text()
    assert text.startswith("one step: ") and len(text) < 10_000
    bad = tp.run_case("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}",
                                                "device=cpu", "float8.enabled=true"], 1, tmp_path, 1)
    assert bad["tokens_per_sec"] != bad["tokens_per_sec"]  # NaN: a row that says why
    assert "float8.enabled: true cannot run on the CPU" in bad["error"]
