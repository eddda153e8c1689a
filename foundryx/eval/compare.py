"""Convergence check: a model's scores against a reference's, with a tolerance per result.

The reference is another model of the same eval run, or a YAML mapping result keys to scores
(``arc_easy/0-shot: 0.61``) or to ``{score: 0.61, tolerance: 0.03}``; ``results/scores/<model>.yaml``
of an earlier run is such a file. A result passes when ``score >= reference - tolerance``
(the tolerance: the file's, else the config's ``tolerances[key]``, else ``tolerance``). A result
of the reference that the model lacks fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from foundryx.errors import ConfigError

Reference = dict[str, tuple[float, float | None]]  # key -> (score, tolerance or None)


@dataclass(frozen=True)
class Check:
    key: str
    reference: float
    score: float | None
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.score is not None and self.score >= self.reference - self.tolerance - 1e-12


def load_reference(path: str | Path) -> Reference:
    """A reference YAML (see module doc); raises ConfigError naming the file and the key."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError([f"cannot read reference scores: {str(e).splitlines()[0]}"], source=str(path)) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(["expected a mapping of result keys (e.g. arc_easy/0-shot) to scores"],
                          source=str(path))
    ref, problems = {}, []
    for key, value in data.items():
        if isinstance(value, dict) and set(value) <= {"score", "tolerance"} and "score" in value:
            score, tol = value["score"], value.get("tolerance")
        else:
            score, tol = value, None
        if not isinstance(score, (int, float)) or not (tol is None or isinstance(tol, (int, float))):
            problems.append(f"{key}: expected a number or {{score: x, tolerance: y}}, got {value!r}")
            continue
        ref[str(key)] = (float(score), None if tol is None else float(tol))
    if problems:
        raise ConfigError(problems, source=str(path))
    return ref


def compare_scores(scores: dict[str, float], reference: Reference, tolerance: float,
                   tolerances: dict[str, float] | None = None) -> list[Check]:
    """One check per reference result, in the reference's order."""
    tolerances = tolerances or {}
    return [
        Check(key, ref, scores.get(key), tol if tol is not None else tolerances.get(key, tolerance))
        for key, (ref, tol) in reference.items()
    ]


def comparison_table(checks: list[Check], model: str, reference: str) -> str:
    """Side-by-side markdown table with the difference and PASS/FAIL per result."""
    lines = [f"| result | {reference} (reference) | {model} | difference | tolerance | check |",
             "|---|---:|---:|---:|---:|---|"]
    for c in checks:
        got = "-" if c.score is None else f"{c.score:.4f}"
        diff = "-" if c.score is None else f"{c.score - c.reference:+.4f}"
        verdict = "PASS" if c.passed else ("FAIL (not evaluated)" if c.score is None else "FAIL")
        lines.append(f"| {c.key} | {c.reference:.4f} | {got} | {diff} | {c.tolerance:.4f} | {verdict} |")
    failed = sum(not c.passed for c in checks)
    lines.append("")
    lines.append(f"{model} vs {reference}: " + (f"{failed} of {len(checks)} results fall short"
                                                if failed else f"all {len(checks)} results pass"))
    return "\n".join(lines)
