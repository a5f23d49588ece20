"""The percentile every benchmark prints: nearest rank (a value that was measured), NaN for none."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: q=1.0 is the maximum."""
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
