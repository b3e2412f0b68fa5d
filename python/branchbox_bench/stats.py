"""Sample statistics shared by the benchmark suites."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["diff", "percentile", "ratio", "stats_row", "stats_rows", "summary_tail_lines"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError("percentile must be within 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * (q / 100.0)
    lo = int(math.floor(pos))
    hi = int(math.ceil(pos))
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b`` to 3 decimals; None when either is missing (or ``b`` is 0)."""
    return None if a is None or not b else round(a / b, 3)


def diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a - b`` to 3 decimals; None when either is missing."""
    return None if a is None or b is None else round(a - b, 3)


def stats_row(label: str, xs: Sequence[float], digits: int = 2) -> List[str]:
    """A table row for the samples ``xs`` (not empty): label, samples, p50, p99, min, max."""
    return [label, str(len(xs))] + ["%.*f" % (digits, v) for v in (percentile(xs, 50), percentile(xs, 99), min(xs), max(xs))]


def stats_rows(samples: Dict[str, List[float]], metrics: Sequence[str], digits: int = 2) -> List[List[str]]:
    """:func:`stats_row` of each metric in ``metrics`` that has samples, in that order."""
    return [stats_row(m, samples[m], digits) for m in metrics if samples.get(m)]


def summary_tail_lines(summary: Dict[str, Any]) -> List[str]:
    """The last lines of a suite's report: which targets were met, then the notes."""
    lines = []
    met = summary.get("targets_met") or {}
    if met:
        lines.append("targets: " + ", ".join("%s=%s" % (k, {True: "yes", False: "NO", None: "-"}[v]) for k, v in met.items()))
    for note in summary.get("notes") or []:
        lines.append("note: " + note)
    return lines
