"""Exact partition of cores into instances from single-instance profile points.

Instances on disjoint cores are (nearly) independent, so a layout's throughput is the sum of its
instances' throughputs, optionally scaled by a contention factor ``(1 - contention) ** (m - 1)`` for
``m`` instances running together. The best layouts on at most ``n_cores`` cores are found exactly:
a knapsack table over (cores, instance count) built with numpy, then a best-first walk that uses the
table as an exact bound, so the k best distinct layouts come out in order without enumerating.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from reamer.host.errors import ReamerError
from reamer.plan.layout import InstanceShape, Layout


@dataclass(frozen=True)
class ProfilePoint:
    """One instance alone on `cores` cores (threads = cores) with max batch `batch`."""

    cores: int
    batch: int
    throughput_rps: float
    p99_ms: float


@dataclass(frozen=True)
class Candidate:
    """A layout with its predicted (DP) and, once verified, measured performance."""

    layout: Layout
    predicted_rps: float
    predicted_p99_ms: float
    measured_rps: float | None = None
    measured_p99_ms: float | None = None
    # online finalists: the open-loop rate it sustains under the SLO, simulated (reamer.plan.online_sim)
    sustained_rps: float | None = None

    @property
    def rps(self) -> float:
        """Measured throughput when verified, else predicted."""
        return self.measured_rps if self.measured_rps is not None else self.predicted_rps

    @property
    def p99_ms(self) -> float:
        return self.measured_p99_ms if self.measured_p99_ms is not None else self.predicted_p99_ms


# closed-loop throughputs this close are a tie within a search's noise (2 cpus, 0.25 s windows: up to 9 %)
NEAR_TIE = 0.10


def near_ties(candidates: Iterable[Candidate], batch_target_ms: float | None,
              margin: float = NEAR_TIE) -> list[Candidate]:
    """The measured candidates meeting `batch_target_ms` (None: any) within `margin` of the fastest of them,
    in the order given."""
    measured = [c for c in candidates if c.measured_rps is not None
                and (batch_target_ms is None or c.p99_ms <= batch_target_ms)]
    fastest = max((c.rps for c in measured), default=0.0)
    return [c for c in measured if c.rps >= fastest * (1.0 - margin)]


class NoFeasibleLayout(ReamerError):
    """No instance shape in the profile fits the cores and the latency SLO."""


def usable_points(points: Iterable[ProfilePoint], n_cores: int, slo_ms: float | None) -> list[ProfilePoint]:
    """Points that fit in `n_cores` and meet the SLO alone; the best per (cores, batch)."""
    best: dict[tuple[int, int], ProfilePoint] = {}
    for point in points:
        if point.cores < 1 or point.cores > n_cores or not point.throughput_rps > 0:
            continue
        if slo_ms is not None and not point.p99_ms <= slo_ms:
            continue
        key = (point.cores, point.batch)
        if key not in best or point.throughput_rps > best[key].throughput_rps:
            best[key] = point
    return sorted(best.values(), key=lambda p: (p.cores, p.batch))


def _contention_factors(length: int, contention: float) -> np.ndarray:
    instances = np.arange(length, dtype=float)
    return (1.0 - contention) ** np.maximum(instances - 1.0, 0.0)


def best_partitions(
    points: Iterable[ProfilePoint],
    n_cores: int,
    slo_ms: float | None = None,
    top_k: int = 5,
    contention: float = 0.0,
) -> list[Candidate]:
    """The `top_k` distinct layouts on at most `n_cores` cores with the highest predicted throughput,
    best first. Only points whose p99 meets `slo_ms` alone are used (None: offline, no SLO).
    [] when no point is usable."""
    if n_cores < 0:
        raise ValueError(f"core count must be ≥ 0, got {n_cores}")
    if not 0.0 <= contention < 1.0:
        raise ValueError(f"contention must be in [0, 1), got {contention}")
    if top_k < 1 or n_cores == 0:
        return []
    usable = usable_points(points, n_cores, slo_ms)
    # A layout using the (top_k+1)-th best batch at some core count is beaten by top_k layouts that
    # swap it for a better one, so only the top_k batches per core count can matter.
    items: list[ProfilePoint] = []
    for _, group in itertools.groupby(usable, key=lambda p: p.cores):
        ranked = sorted(group, key=lambda p: -p.throughput_rps)[:top_k]
        items.extend(sorted(ranked, key=lambda p: p.batch))
    if not items:
        return []

    n = n_cores
    # tables[i][j, m]: best summed throughput with items[0..i], ≤ j cores, exactly m instances.
    # Without contention the instance count does not matter: one column, "any count".
    counted = contention > 0.0
    size = n + 1 if counted else 1
    base = np.full((n + 1, size), -np.inf)
    base[:, 0] = 0.0
    tables: list[np.ndarray] = []
    previous = base
    for item in items:
        table = previous.copy()
        c, t = item.cores, item.throughput_rps
        for q in range(1, n // c + 1):
            shift = q if counted else 0
            target = table[q * c :, shift:]
            np.maximum(target, previous[: n + 1 - q * c, : size - shift] + q * t, out=target)
        tables.append(table)
        previous = table
    factors = _contention_factors(2 * (n + 1) + 1, contention)
    cores_of = [item.cores for item in items]

    def last_fitting(index: int, free: int) -> int:
        # items are sorted by cores, so those that fit in `free` are a prefix
        while index >= 0 and cores_of[index] > free:
            index -= 1
        return index

    def bound(free: int, index: int, instances: int, total: float) -> float:
        if index < 0:
            return total * factors[instances]
        row = tables[index][free]
        if not counted:
            return total + float(row[0])
        return float(np.max((total + row) * factors[instances : instances + size]))

    counter = itertools.count()
    start_index = last_fitting(len(items) - 1, n)
    heap = [(-bound(n, start_index, 0, 0.0), next(counter), n, start_index, 0, 0.0, ())]
    results: list[Candidate] = []
    while heap and len(results) < top_k:
        neg, _, free, index, instances, total, chosen = heapq.heappop(heap)
        if index < 0:
            if instances:
                results.append(_candidate([items[i] for i in chosen], float(-neg), float(factors[instances])))
            continue
        item = items[index]
        if item.cores <= free:
            used = (free - item.cores, index, instances + 1, total + item.throughput_rps)
            heapq.heappush(heap, (-bound(*used), next(counter), *used, chosen + (index,)))
        skip_index = last_fitting(index - 1, free)
        heapq.heappush(heap, (-bound(free, skip_index, instances, total), next(counter), free, skip_index,
                              instances, total, chosen))
    return results


def _candidate(chosen: Sequence[ProfilePoint], rps: float, factor: float) -> Candidate:
    shapes = tuple(InstanceShape(p.cores, p.cores, p.batch) for p in chosen)
    p99 = max(p.p99_ms for p in chosen) / factor  # contention slows every instance alike
    return Candidate(Layout(shapes).canonical(), predicted_rps=rps, predicted_p99_ms=p99)
