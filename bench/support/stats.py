"""Percentiles of latencies, the one definition the tests and bench/ share (numpy only,
so an engine-only script on a bare machine can use it)."""

from __future__ import annotations

import numpy as np


def pct_ms(lat_s, q: float, digits: int | None = 2) -> float:
    """The q-th percentile (0-100) of latencies in seconds, in milliseconds; NaN if none."""
    a = np.asarray(lat_s, dtype=np.float64)
    if not a.size:
        return float("nan")
    v = float(np.percentile(a * 1000, q))
    return v if digits is None else round(v, digits)
