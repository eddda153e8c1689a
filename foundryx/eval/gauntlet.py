"""The eval gauntlet: benchmarks grouped in categories, rescaled, weighted and averaged.

A benchmark's score ``acc`` becomes ``acc - random_baseline`` (``subtract_random_baseline``)
and then ``(acc - baseline) / (1 - baseline)`` (``rescale_accuracy``), so 0 is chance and 1 is
perfect. A category is the weighted mean of its benchmarks (``EQUAL``: 1 each; ``SAMPLE_SZ``:
the number of examples; ``LOG_SAMPLE_SZ``: ``max(log2(examples), 1)``); ``average`` is the
mean of the categories, and each named entry of ``averages`` the mean of its categories. A
category missing a benchmark result (or an average missing a category) is left out, and a line
says so. The YAML keys are LLM Foundry's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from foundryx.config.load import read_yaml, resolve
from foundryx.config.schema import doc
from foundryx.config.types import dataclass_problems, join
from foundryx.errors import ConfigError

log = logging.getLogger(__name__)
AVERAGE = "average"


@dataclass
class Benchmark:
    name: str = doc("an ICL task label")
    num_fewshot: int = doc("which of the task's few-shot counts")
    random_baseline: float = doc("the accuracy of guessing, e.g. 0.25 for 4 choices", default=0.0)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.num_fewshot}-shot"


@dataclass
class Category:
    name: str = doc("the category's name, e.g. world_knowledge")
    benchmarks: list[dict[str, Any]] = doc("[{name, num_fewshot, random_baseline}, ...]")


@dataclass
class GauntletConfig:
    categories: list[dict[str, Any]] = doc("[{name, benchmarks}, ...]")
    weighting: Literal["EQUAL", "SAMPLE_SZ", "LOG_SAMPLE_SZ"] = doc(
        "benchmark weights in a category", default="EQUAL")
    subtract_random_baseline: bool = doc("score - random_baseline", default=True)
    rescale_accuracy: bool = doc("then divide by 1 - random_baseline", default=True)
    averages: dict[str, list[str]] = doc("named means of categories", default_factory=dict)


@dataclass
class Gauntlet:
    cfg: GauntletConfig
    categories: dict[str, list[Benchmark]]

    @property
    def baselines(self) -> dict[str, float]:
        return {b.key: b.random_baseline for bs in self.categories.values() for b in bs}


def _read(source: str | dict[str, Any]) -> tuple[Any, str | None]:
    if isinstance(source, dict):
        return source, None
    problems: list[str] = []
    data = resolve(read_yaml(Path(source)), "", problems)
    if problems or set(data) != {"eval_gauntlet"}:
        raise ConfigError(problems or ["a gauntlet file holds one key, eval_gauntlet"], source=source)
    return data["eval_gauntlet"], source


def _valid_items(cls: type, items: list[Any], path: str, problems: list[str]) -> list[tuple[str, dict]]:
    """(path, item) of each mapping of ``items`` that fits ``cls``; the others' problems."""
    out = []
    for i, item in enumerate(items):
        where = join(path, i)
        found = dataclass_problems(cls, item, where) if isinstance(item, dict) else [
            f"{where}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}"]
        problems += found
        if not found:
            out.append((where, item))
    return out


def load_gauntlet(source: str | dict[str, Any], task_keys: set[str], where: str = "eval_gauntlet") -> Gauntlet:
    """A validated gauntlet from a file (with an ``eval_gauntlet:`` key) or a mapping; every
    benchmark must be one of ``task_keys`` (``label/N-shot``). Raises ConfigError."""
    data, origin = _read(source)
    if not isinstance(data, dict):
        raise ConfigError([f"{where}: expected a mapping with categories, got {data!r}"], source=origin)
    problems = dataclass_problems(GauntletConfig, data, where)
    categories: dict[str, list[Benchmark]] = {}
    missing: list[tuple[str, str, Benchmark]] = []
    cats = [] if problems else data["categories"]
    for path, cat in _valid_items(Category, cats, join(where, "categories"), problems):
        if cat["name"] in categories or cat["name"] == AVERAGE:
            problems.append(f"{path}.name: {cat['name']!r} is used twice or is reserved")
        benches = []
        for bpath, b in _valid_items(Benchmark, cat["benchmarks"], join(path, "benchmarks"), problems):
            bench = Benchmark(**b)
            if not 0 <= bench.random_baseline < 1:
                problems.append(f"{bpath}.random_baseline: must be in [0, 1), got {bench.random_baseline}")
            if bench.key not in task_keys:
                missing.append((bpath, cat["name"], bench))
            benches.append(bench)
        categories[cat["name"]] = benches
    problems += _missing_problems(missing, task_keys, where)
    for name, members in (data.get("averages") or {}).items() if not problems else ():
        problems += [f"{where}.averages.{name}: unknown category {c!r}" for c in members
                     if c not in categories]
    if problems:
        raise ConfigError(problems, source=origin)
    return Gauntlet(GauntletConfig(**data), categories)


def _missing_problems(missing: list[tuple[str, str, Benchmark]], task_keys: set[str],
                      where: str) -> list[str]:
    """One problem per benchmark that is no task of icl_tasks (one for them all past 3),
    naming the task and the three fixes: add the task (or the shot count), drop the benchmark,
    or evaluate without the gauntlet."""
    evaluated = ", ".join(sorted(task_keys)) or "none"
    without = f"or evaluate without the gauntlet: {where}=null"
    if len(missing) > 3:
        names = ", ".join(b.key for _, _, b in missing)
        return [f"{where}: {len(missing)} benchmarks are not among the ICL tasks evaluated "
                f"({evaluated}): {names}; add those tasks to icl_tasks, remove them from the "
                f"gauntlet's categories, {without}"]
    out = []
    for path, category, b in missing:
        shots = sorted(int(k.rsplit("/", 1)[1].split("-")[0]) for k in task_keys
                       if k.rsplit("/", 1)[0] == b.name)
        if shots:
            add = (f"task {b.name!r} is evaluated at {', '.join(map(str, shots))} shots: add "
                   f"{b.num_fewshot} to its num_fewshot")
        else:
            add = f"add task {b.name!r} (num_fewshot {b.num_fewshot}) to icl_tasks"
        out.append(f"{path}: the gauntlet scores {b.key}, which is not among the ICL tasks "
                   f"evaluated ({evaluated}); {add}, remove this benchmark from category "
                   f"{category!r}, {without}")
    return out


def _weight(mode: str, n: int) -> float:
    return {"EQUAL": 1.0, "SAMPLE_SZ": float(n), "LOG_SAMPLE_SZ": max(math.log2(max(n, 1)), 1.0)}[mode]


def gauntlet_scores(g: Gauntlet, scores: dict[str, float], sizes: dict[str, int]) -> dict[str, float]:
    """Category scores, ``average`` and the named averages from task scores (see module doc)."""
    cfg, out = g.cfg, {}
    for name, benches in g.categories.items():
        missing = [b.key for b in benches if b.key not in scores]
        if missing:
            log.info("gauntlet: category %s left out: no result for %s", name, ", ".join(missing))
            continue
        total = weights = 0.0
        for b in benches:
            s = scores[b.key]
            if cfg.subtract_random_baseline:
                s -= b.random_baseline
                if cfg.rescale_accuracy:
                    s /= 1.0 - b.random_baseline
            w = _weight(cfg.weighting, sizes.get(b.key, 1))
            total, weights = total + w * s, weights + w
        out[name] = total / weights if weights else 0.0
    present = [c for c in g.categories if c in out]
    if present:
        out[AVERAGE] = sum(out[c] for c in present) / len(present)
    for name, members in cfg.averages.items():
        if all(c in out for c in members):
            out[name] = sum(out[c] for c in members) / len(members)
        else:
            log.info("gauntlet: average %s left out: a category is missing", name)
    return out

