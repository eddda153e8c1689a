"""What ``foundryx report`` reads from a run folder: the metrics the ``jsonl`` logger wrote, the
hyperparameters beside them (``run.json``: the resolved config and the environment), and the
results of ``foundryx eval`` runs kept in the folder (``results.json``), with their reference
models and comparisons."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundryx.errors import ReportError
from foundryx.loggers.files import RUN_FILE, read_hyperparameters

METRICS_FILE = "metrics.jsonl"
# Composer logs an evaluator's metrics as metrics/<label>/<Metric>; ICL labels are task/N-shot.
ICL_KEY = re.compile(r"^metrics/(?P<task>.+/\d+-shot)/(?P<metric>[^/]+)$")
GAUNTLET_PREFIX = "icl/gauntlet/"


@dataclass
class Series:
    """One metric over training: batch numbers and values, in logged order."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    restarts: int = 0  # times the batch number went back (a restarted or resumed run appends)

    def add(self, step: int, value: float) -> None:
        """Append; a step at or before the last one replaces the values from it on (what a
        resumed run logs again, or a restarted run logs anew, supersedes what was there)."""
        if self.steps and step <= self.steps[-1]:
            self.restarts += step < self.steps[-1]
            keep = next((i for i, s in enumerate(self.steps) if s >= step), len(self.steps))
            del self.steps[keep:], self.values[keep:]
        self.steps.append(step)
        self.values.append(value)

    @property
    def last(self) -> float:
        return self.values[-1]


@dataclass
class EvalRun:
    """One ``foundryx eval`` results folder: every model's score per result key."""

    path: Path
    scores: dict[str, dict[str, float]]
    baselines: dict[str, float]
    comparisons: dict[str, str]  # file name -> markdown table


@dataclass
class RunFolder:
    path: Path
    metrics_file: Path
    series: dict[str, Series]
    hyperparameters: dict[str, Any]
    evals: list[EvalRun]

    @property
    def config(self) -> dict[str, Any] | None:
        return self.hyperparameters.get("foundryx/config")

    @property
    def environment(self) -> dict[str, Any] | None:
        return self.hyperparameters.get("foundryx/environment")

    @property
    def name(self) -> str:
        cfg = self.config or {}
        return str(cfg.get("run_name") or self.hyperparameters.get("run_name") or self.path.name)

    def find(self, *keys: str) -> tuple[str, Series] | None:
        """The first of ``keys`` the run logged (a key ending in ``*`` matches a prefix)."""
        for key in keys:
            if key.endswith("*"):
                hits = sorted(k for k in self.series if k.startswith(key[:-1]))
                if hits:
                    return hits[0], self.series[hits[0]]
            elif key in self.series:
                return key, self.series[key]
        return None

    def matching(self, pattern: str) -> dict[str, Series]:
        return {k: s for k, s in sorted(self.series.items()) if re.search(pattern, k)}

    def icl_scores(self) -> dict[str, float]:
        """Last logged ICL scores under the eval results' keys (``task/N-shot``,
        ``gauntlet/name``)."""
        out = {}
        for key, s in sorted(self.series.items()):
            if m := ICL_KEY.match(key):
                out[m["task"]] = s.last
            elif key.startswith(GAUNTLET_PREFIX):
                out["gauntlet/" + key[len(GAUNTLET_PREFIX):]] = s.last
        return out


def _metrics_file(folder: Path) -> Path:
    fix = ("give the folder the run's jsonl logger writes to (loggers.jsonl.path; "
           "yamls/quickstart.yaml writes runs/quickstart/metrics.jsonl)")
    if not folder.exists():
        raise ReportError(f"{folder}: no such run folder; {fix}")
    if folder.is_file() and folder.suffix == ".jsonl":
        return folder
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder; {fix}")
    if (folder / METRICS_FILE).is_file():
        return folder / METRICS_FILE
    found = sorted(folder.glob("*.jsonl"))
    if len(found) == 1:
        return found[0]
    what = f"{len(found)} .jsonl files and no {METRICS_FILE}" if found else f"no {METRICS_FILE}"
    raise ReportError(f"{folder} holds {what}; {fix}")


def _read_series(path: Path) -> dict[str, Series]:
    series: dict[str, Series] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue  # the last line of a run killed while writing it
            raise ReportError(f"{path}:{n} is not a JSON line; the metrics "
                              "file is damaged (only its last line may be cut short)") from None
        step = row.get("batch")
        for k, v in row.items():
            if k != "batch" and isinstance(v, (int, float)) and step is not None:
                series.setdefault(k, Series()).add(int(step), float(v))
    return series


def _read_evals(folder: Path, extra: list[Path]) -> list[EvalRun]:
    runs = []
    candidates = sorted(folder.rglob("results.json")) + [
        p / "results.json" if p.is_dir() else p for p in extra]
    for path in candidates:
        if not path.is_file():
            raise ReportError(f"--eval {path}: no results.json there; give a "
                              "foundryx eval output_dir")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "scores" not in data:
            continue  # some other results.json
        comparisons = {p.name: p.read_text() for p in sorted(path.parent.glob("comparison_*.md"))}
        runs.append(EvalRun(path, data["scores"], data.get("random_baselines", {}), comparisons))
    return runs


def read_run_folder(folder: str | Path, evals: list[str | Path] | None = None) -> RunFolder:
    """The run in ``folder``; ReportError (exit 2) when it is missing or logged nothing."""
    folder = Path(folder)
    metrics = _metrics_file(folder)
    series = _read_series(metrics)
    if not any(k.startswith(("loss/", "metrics/")) for k in series):
        raise ReportError(f"{metrics} holds no losses or metrics: the run logged "
                          "nothing to report (it stopped before its first batch?); train first")
    home = metrics.parent
    hparams = read_hyperparameters(home) if (home / RUN_FILE).is_file() else {}
    return RunFolder(home, metrics, series, hparams, _read_evals(home, [Path(p) for p in evals or []]))
