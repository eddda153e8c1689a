"""attn_impl auto's table: the benchmark's rows in, the table module out, and the choice from it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from foundryx.models.layers import attention_select as sel
from foundryx.models.layers import attention_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    from benchmarks import attention  # imports torch and the attention kernels' modules

    return attention


def measured(mask, gqa, triton, torch):
    """One row as kernel_rows returns it: (fwd, fwd+bwd) TFLOP/s per implementation."""
    return {"head_dim": 64, "causal": True, "packed": "docs" in mask, "mask": mask, "gqa": gqa,
            "seq": 2048, "batch": 8, "triton": triton, "torch": torch}


def test_measured_rows_become_the_tables_and_drive_the_choice(bench, tmp_path):
    rows = [measured("none", False, (300.0, 200.0), (500.0, 400.0)),
            measured("alibi", False, (250.0, 180.0), (90.0, 60.0)),
            measured("docs", True, (200.0, 150.0), "OutOfMemoryError"),
            measured("docs+alibi", False, "wrong (max error 0.5)", "OutOfMemoryError")]
    new = bench.table_rows(rows, ["triton", "torch"], "NVIDIA B200", "sm100", "a test run")
    assert len(new) == 3  # the row with no figure is dropped
    assert new[1] == {"device": "NVIDIA B200", "arch": "sm100", "head_dim": 64, "mask": "alibi",
                      "causal": True, "gqa": False, "seq": 2048,
                      "train": {"triton": 180.0, "torch": 60.0},
                      "fwd": {"triton": 250.0, "torch": 90.0}, "source": "a test run"}
    assert new[2]["train"] == {"triton": 150.0}  # the cell that ran out of memory is left out

    text = bench.apply_table(bench.TABLE_MODULE.read_text(), json.loads(json.dumps(new)))
    module = tmp_path / "table.py"
    module.write_text(text)
    spec = importlib.util.spec_from_file_location("table_under_test", module)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.ROWS == attention_table.ROWS + new  # the H100 rows kept, the B200's added
    assert text.count("\n    {") == len(table.ROWS)  # one row a line
    # applied again with other figures: the device's rows are replaced, not added
    again = bench.apply_table(text, [{**new[0], "train": {"triton": 1.0, "torch": 2.0}}])
    namespace: dict = {}
    exec(again, namespace)
    assert [r for r in namespace["ROWS"] if r["device"] == "NVIDIA B200"] == [
        {**new[0], "train": {"triton": 1.0, "torch": 2.0}}]

    runs = lambda name: None  # noqa: E731 - every implementation runs
    alibi = sel.Case(head_dim=64, mask="alibi", causal=True, gqa=False, train=True)
    assert sel.table_choice(alibi, "NVIDIA B200", table.ROWS, runs)[0] == "triton"
    one = sel.Case(head_dim=64, mask="none", causal=True, gqa=False, train=True)
    assert sel.table_choice(one, "NVIDIA B200", table.ROWS, runs)[0] == "torch"


def test_apply_table_from_the_command_line(bench, tmp_path, monkeypatch):
    module = tmp_path / "attention_table.py"
    module.write_text(bench.TABLE_MODULE.read_text())
    monkeypatch.setattr(bench, "TABLE_MODULE", module)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    rows = tmp_path / "rows.json"
    h100 = [dict(r, train={"triton": 500.0, "torch": 480.0}) for r in attention_table.ROWS[:1]]
    rows.write_text(json.dumps(h100))
    assert bench.main(["--apply-table", str(rows)]) == 0
    namespace: dict = {}
    exec(module.read_text(), namespace)
    assert namespace["ROWS"] == h100  # every H100 row replaced by the one measured


def test_both_triton_backwards_side_by_side(bench):
    """--bwd split atomic (issue 47): a column and a ratio to the best other per backward; the
    Triton kernel runs in the mode named, whatever tuning.BWD says; --table refuses --bwd."""
    from foundryx.kernels import tuning

    row = {**measured("none", False, None, (400.0, 500.0)), "triton-split": (300.0, 150.0),
           "triton-atomic": (300.0, 250.0)}
    text = bench.markdown([row], [], ["triton-split", "triton-atomic", "torch"], 4)
    assert "| triton-split ÷ best other (fwd+bwd) | triton-atomic ÷ best other (fwd+bwd) |" in text
    assert text.rstrip().endswith("| 0.30 | 0.50 |")
    seen = []
    real = bench.triton_attention
    try:
        bench.triton_attention = lambda *a, **k: seen.append(tuning.bwd_mode(64, None))
        bench.IMPLS["triton-atomic"](None, None, None)
        bench.IMPLS["triton-split"](None, None, None)
    finally:
        bench.triton_attention = real
    assert seen == ["atomic", "split"]
    assert bench.main(["--bwd", "split", "atomic", "--table", "rows.json"]) == 2
