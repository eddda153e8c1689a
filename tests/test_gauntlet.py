"""Gauntlet arithmetic: baseline subtraction and rescaling, weighting, averages, missing results."""

from __future__ import annotations

import logging
import math

import pytest

from foundryx.errors import ConfigError
from foundryx.eval.gauntlet import gauntlet_scores, load_gauntlet

KEYS = {"a/0-shot", "b/3-shot", "c/0-shot"}


def gauntlet(**options):
    return load_gauntlet({
        "categories": [
            {"name": "knowledge", "benchmarks": [
                {"name": "a", "num_fewshot": 0, "random_baseline": 0.25},
                {"name": "b", "num_fewshot": 3, "random_baseline": 0.0}]},
            {"name": "reasoning", "benchmarks": [{"name": "c", "num_fewshot": 0, "random_baseline": 0.5}]},
        ],
        "averages": {"core": ["reasoning"]},
        **options,
    }, KEYS)


SCORES = {"a/0-shot": 0.625, "b/3-shot": 0.2, "c/0-shot": 0.4}
SIZES = {"a/0-shot": 1024, "b/3-shot": 16, "c/0-shot": 100}


def test_rescaled_equal_weights_and_averages():
    out = gauntlet_scores(gauntlet(), SCORES, SIZES)
    a = (0.625 - 0.25) / 0.75  # 0.5
    assert out["knowledge"] == pytest.approx((a + 0.2) / 2)
    assert out["reasoning"] == pytest.approx((0.4 - 0.5) / 0.5)  # below chance: negative
    assert out["average"] == pytest.approx((out["knowledge"] + out["reasoning"]) / 2)
    assert out["core"] == pytest.approx(out["reasoning"])


def test_subtract_only_and_raw():
    sub = gauntlet_scores(gauntlet(rescale_accuracy=False), SCORES, SIZES)
    assert sub["knowledge"] == pytest.approx((0.375 + 0.2) / 2)
    raw = gauntlet_scores(gauntlet(subtract_random_baseline=False), SCORES, SIZES)
    assert raw["knowledge"] == pytest.approx((0.625 + 0.2) / 2)  # rescaling needs subtraction


@pytest.mark.parametrize("weighting, wa, wb", [
    ("SAMPLE_SZ", 1024, 16), ("LOG_SAMPLE_SZ", 10.0, 4.0),
])
def test_weighting_by_sample_size(weighting, wa, wb):
    out = gauntlet_scores(gauntlet(weighting=weighting), SCORES, SIZES)
    assert out["knowledge"] == pytest.approx((wa * 0.5 + wb * 0.2) / (wa + wb))


def test_log_weight_is_at_least_one():
    out = gauntlet_scores(gauntlet(weighting="LOG_SAMPLE_SZ"), SCORES, {**SIZES, "b/3-shot": 1})
    assert out["knowledge"] == pytest.approx((10 * 0.5 + 1 * 0.2) / 11)


def test_a_category_missing_a_result_is_left_out(caplog):
    logger = logging.getLogger("foundryx.eval.gauntlet")
    logger.addHandler(caplog.handler)  # the foundryx logger may not propagate to the root
    caplog.set_level(logging.INFO, logger=logger.name)
    try:
        out = gauntlet_scores(gauntlet(), {"c/0-shot": 0.75}, SIZES)
    finally:
        logger.removeHandler(caplog.handler)
    assert "knowledge" not in out and out["average"] == pytest.approx(0.5)
    assert "category knowledge left out: no result for a/0-shot, b/3-shot" in caplog.text
    assert not math.isnan(out["core"])


def test_bad_gauntlet_configs():
    with pytest.raises(ConfigError) as e:
        load_gauntlet({"categories": [{"name": "x", "benchmarks": [
            {"name": "a", "num_fewshot": 1, "random_baseline": 1.0}]}],
            "weighting": "EQUALS", "averages": {"core": ["y"]}}, KEYS)
    assert "eval_gauntlet.weighting: expected one of 'EQUAL'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_gauntlet({"categories": [{"name": "x", "benchmarks": [
            {"name": "a", "num_fewshot": 1, "random_baseline": 1.0}]}], "averages": {"core": ["y"]}}, KEYS)
    text = str(e.value)
    assert "benchmarks[0].random_baseline: must be in [0, 1), got 1.0" in text
    assert "benchmarks[0]: the gauntlet scores a/1-shot, which is not among the ICL tasks" in text
    assert "task 'a' is evaluated at 0 shots: add 1 to its num_fewshot" in text
    with pytest.raises(ConfigError, match="averages.core: unknown category 'y'"):
        load_gauntlet({"categories": [], "averages": {"core": ["y"]}}, KEYS)


def test_many_missing_benchmarks_are_one_line_with_the_fixes():
    """A task list cut to one task under a big gauntlet: one line naming every missing
    benchmark and the fixes, not one line per benchmark."""
    with pytest.raises(ConfigError) as e:
        load_gauntlet({"categories": [{"name": "x", "benchmarks": [
            {"name": n, "num_fewshot": 0} for n in ("a", "d", "e", "f", "g")]}]}, KEYS)
    assert e.value.problems == [
        "eval_gauntlet: 4 benchmarks are not among the ICL tasks evaluated (a/0-shot, b/3-shot, "
        "c/0-shot): d/0-shot, e/0-shot, f/0-shot, g/0-shot; add those tasks to icl_tasks, remove "
        "them from the gauntlet's categories, or evaluate without the gauntlet: eval_gauntlet=null"]
