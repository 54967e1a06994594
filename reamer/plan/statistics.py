"""The one definition of each latency statistic reamer reports or decides on: percentiles and SLO attainment.

A percentile is numpy's default, linear interpolation between the two nearest order statistics (Hyndman
and Fan's type 7; the median of an even count is the mean of the middle two, as `statistics.median` says).
The online job's /stats and its metrics were computed this way first, so that is the reference: the search
(measured and simulated p99), the load generator, the demo and the benchmarks call these functions, and a
p99 means the same on the same latencies wherever it is read.

It differs from the nearest-rank p99 (the smallest value with at least 99 % of the values at or below it) by
less than one order statistic: up to 0.01 of one above it, or up to 0.99 of one below it, depending on the
count (for the 2,700 latencies the online simulation judges, 0.01 of the gap above it).
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np


def percentile(values: Iterable[float] | np.ndarray, q: float) -> float:
    """The `q`-th percentile (0..100) of `values`; NaN when there are none."""
    data = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=float)
    if not data.size:
        return math.nan
    return float(np.percentile(data, q))


def nearest_rank_percentile(values: Iterable[float] | np.ndarray, q: float) -> float:
    """The smallest of `values` with at least `q` % of them at or below it (nearest rank); NaN when there are none.
    The pass/fail reading of an SLO: "p99 <= SLO" exactly when at least 99 % were within it, however late the rest.
    Used where a rate is judged pass or fail (bench/online_peers); everything reported uses `percentile`."""
    data = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=float)
    if not data.size:
        return math.nan
    return float(np.percentile(data, q, method="inverted_cdf"))


def p50(values: Iterable[float] | np.ndarray) -> float:
    """The median (see `percentile`); NaN when there are no values."""
    return percentile(values, 50)


def p99(values: Iterable[float] | np.ndarray) -> float:
    """The 99th percentile (see `percentile`); NaN when there are no values."""
    return percentile(values, 99)


def slo_attainment(latencies_ms: Iterable[float] | np.ndarray, slo_ms: float, arrivals: int) -> float:
    """The fraction of `arrivals` answered within `slo_ms`: `latencies_ms` are those answered, and every other
    arrival (refused, failed) missed the SLO; NaN when nothing arrived."""
    if arrivals <= 0:
        return math.nan
    data = latencies_ms if isinstance(latencies_ms, np.ndarray) else np.fromiter(latencies_ms, dtype=float)
    return float(np.count_nonzero(data <= slo_ms)) / arrivals
