"""The open-loop rate a layout sustains under its SLO, simulated from its measured batch latencies.

A layout's closed-loop throughput (every instance always busy with full batches) does not rank layouts by
what they sustain online. Under Poisson arrivals a request waits for a free instance and for its batch to
run, so at equal throughput a layout of shorter batches (smaller ones, or more cores per instance) leaves
more of the SLO for waiting. `sustained_rps` replays the online job's batching (reamer.serve.runtime.batcher) on
simulated arrivals: one queue; an idle instance takes the oldest requests up to its max batch, waiting for a
fuller batch at most min(0.2 × SLO, its batch latency) after the oldest arrived, and only while requests
arrive densely enough for waiting to fill it. It finds the highest rate whose p99 (reamer.plan.statistics,
as the job's /stats computes it) stays within the SLO. The figures come from the search's own measurements; the front door's cpu and other
processes are left out for every layout alike (on a node the front door has cpus of its own).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from reamer.plan.layout import Layout
from reamer.plan.partition import NEAR_TIE, Candidate, ProfilePoint, near_ties
from reamer.plan.statistics import p99

MAX_WAIT_SHARE_OF_SLO = 0.2  # an idle instance waits for a fuller batch at most this share of the SLO (batcher)
UNKNOWN_FIXED_SHARE = 0.2  # a batch's fixed cost, as a share of a full batch's latency, where no point says


@dataclass(frozen=True)
class SimInstance:
    """One instance as the simulation sees it: its max batch, the mean latency (s) of a batch of b samples
    (b = 1..max_batch), and the spread of batch latencies (the sigma of a lognormal factor, mean 1)."""

    max_batch: int
    latency_s: tuple[float, ...]  # index b - 1
    sigma: float = 0.0

    @property
    def capacity_rps(self) -> float:
        return self.max_batch / self.latency_s[-1]


def simulate_p99_s(instances: Sequence[SimInstance], rate_rps: float, slo_s: float, *, requests: int = 3000,
                   seed: int = 0) -> float:
    """The p99 latency (s) of `requests` Poisson arrivals at `rate_rps` served by `instances` (the first 10 %
    discarded as warm-up). Draws depend on the seed only, so p99 rises with the rate for one seed."""
    rng = np.random.default_rng(seed)
    arrivals = (np.cumsum(rng.exponential(1.0, size=requests)) / rate_rps).tolist()
    factors = [np.exp(inst.sigma * rng.standard_normal(requests) - inst.sigma ** 2 / 2).tolist()
               for inst in instances]
    windows = [min(MAX_WAIT_SHARE_OF_SLO * slo_s, inst.latency_s[-1]) for inst in instances]
    # an instance waits only when it batches and another request is expected within its window
    max_wait = [w if inst.max_batch > 1 and 1.0 / rate_rps <= w else 0.0 for inst, w in zip(instances, windows)]
    runs = [0] * len(instances)
    done = [0.0] * requests
    head = 0  # the oldest request not yet taken (requests are taken in arrival order)
    # Each step: the instance that can start soonest takes the oldest requests. It starts when it is free
    # and the oldest has arrived, and (batching) once its batch is full or the wait is over.
    heap = [(0.0, i) for i in range(len(instances))]
    heapq.heapify(heap)
    while head < requests:
        free, i = heapq.heappop(heap)
        inst = instances[i]
        oldest = arrivals[head]
        start = max(free, oldest)
        full_at = arrivals[head + inst.max_batch - 1] if head + inst.max_batch - 1 < requests else math.inf
        if full_at > start:  # not full when it could start: wait for more, but not past the oldest's deadline
            start = max(start, min(full_at, oldest + max_wait[i]))
        # every request that has arrived by then, up to the max batch
        end = head + 1
        while end < requests and end - head < inst.max_batch and arrivals[end] <= start:
            end += 1
        batch = end - head
        finish = start + inst.latency_s[batch - 1] * factors[i][runs[i] % requests]
        runs[i] += 1
        done[head:end] = [finish] * batch
        head = end
        heapq.heappush(heap, (finish, i))
    skip = requests // 10
    latencies = [d - a for d, a in zip(done[skip:], arrivals[skip:])]
    return p99(latencies) if latencies else math.inf


def sustained_rps(instances: Sequence[SimInstance], slo_ms: float, *, requests: int = 3000, seed: int = 0,
                  precision: float = 0.01) -> float:
    """The highest Poisson rate (requests/s of one sample each) whose simulated p99 is within `slo_ms`, found
    by bisection to within `precision` (a fraction) below the layout's capacity; 0.0 when not even a
    trickle meets the SLO (a batch alone takes longer)."""
    slo_s = slo_ms / 1000.0
    capacity = sum(inst.capacity_rps for inst in instances)
    if not instances or capacity <= 0:
        return 0.0

    def meets(rate: float) -> bool:
        return simulate_p99_s(instances, rate, slo_s, requests=requests, seed=seed) <= slo_s

    high = capacity
    if meets(high):
        return high
    if not meets(capacity * precision):
        return 0.0
    low = capacity * precision
    while high - low > precision * capacity:
        mid = (low + high) / 2
        if meets(mid):
            low = mid
        else:
            high = mid
    return low


def layout_instances(layout: Layout, measured_rps: float, measured_p99_ms: float,
                     points: Sequence[ProfilePoint]) -> list[SimInstance]:
    """The instances of a verified `layout` for the simulation: each instance's full batch takes what the
    layout's measured throughput gives it (its share in proportion to its alone throughput where points say,
    else to its cores); smaller batches scale by the alone points of its core count (linear between measured
    batches), else by a fixed share plus a per-sample part. The spread comes from the measured batch p99."""
    known = {(p.cores, p.batch): p for p in points if p.throughput_rps > 0}
    # the alone points are of one thread per core and one stream: they say nothing of other shapes
    plain = [s.threads == s.cores and s.streams == 1 for s in layout.instances]
    alone = [known.get((s.cores, s.batch)) if ok else None for s, ok in zip(layout.instances, plain)]
    weights = ([p.throughput_rps for p in alone] if all(alone)  # type: ignore[union-attr]
               else [float(s.cores) for s in layout.instances])
    total = sum(weights)
    out = []
    for shape, weight, ok in zip(layout.instances, weights, plain):
        full_s = shape.batch / (measured_rps * weight / total)
        shape_of = _batch_shape(shape.cores, shape.batch, known) if ok else None
        latency = tuple(full_s * (shape_of(b) if shape_of else _fixed_plus_linear(b, shape.batch))
                        for b in range(1, shape.batch + 1))
        out.append(SimInstance(shape.batch, latency, _sigma(measured_p99_ms / 1000.0, full_s)))
    return out


def _fixed_plus_linear(b: int, full: int) -> float:
    return UNKNOWN_FIXED_SHARE + (1.0 - UNKNOWN_FIXED_SHARE) * b / full


def _batch_shape(cores: int, full: int, known: dict[tuple[int, int], ProfilePoint]) -> Callable[[int], float] | None:
    """Latency of a batch of b relative to one of `full`, from the alone points on `cores` cores (None: no
    point at `full` or no other batch measured)."""
    lat = {b: b / p.throughput_rps for (c, b), p in known.items() if c == cores}
    if full not in lat or len(lat) < 2:
        return None
    xs = [0] + sorted(lat)
    ys = [UNKNOWN_FIXED_SHARE * lat[xs[1]] / lat[full]] + [lat[b] / lat[full] for b in xs[1:]]
    return lambda b: float(np.interp(b, xs, ys))


def _sigma(p99_s: float, mean_s: float) -> float:
    """The lognormal sigma whose p99 / mean is the measured one (capped: a p99 far above the mean is a
    stall the simulation should not replay on every batch)."""
    if not (p99_s > mean_s > 0):
        return 0.0
    ratio = min(p99_s / mean_s, 2.0)
    # p99 / mean of a mean-1 lognormal is exp(2.326 sigma - sigma^2 / 2): solve the quadratic
    z, target = 2.326, math.log(ratio)
    return z - math.sqrt(max(z * z - 2 * target, 0.0))


def rank_by_sustained(candidates: Sequence[Candidate], slo_ms: float, batch_target_ms: float,
                      points_of: Callable[[Layout], Sequence[ProfilePoint]],
                      margin: float = NEAR_TIE) -> list[Candidate]:
    """`candidates` (ranked: measured layouts meeting `batch_target_ms` first, fastest first) with the
    measured ones meeting it within `margin` of the fastest one's throughput (closed-loop figures that
    close are a tie within the search's noise) re-ranked by the rate each sustains under `slo_ms`,
    simulated, and carrying it. `points_of(layout)`: the alone points of the layout's backend."""
    finalists = near_ties(candidates, batch_target_ms, margin)
    judged = [with_sustained(c, slo_ms, points_of(c.layout)) for c in finalists]
    judged.sort(key=lambda c: (-(c.sustained_rps or 0.0), -c.rps))
    chosen = {id(c) for c in finalists}
    return judged + [c for c in candidates if id(c) not in chosen]


def with_sustained(candidate: Candidate, slo_ms: float, points: Sequence[ProfilePoint]) -> Candidate:
    """`candidate` carrying the rate its layout sustains under `slo_ms`, simulated from its figures and the
    alone `points` of its backend."""
    instances = layout_instances(candidate.layout, candidate.rps, candidate.p99_ms, points)
    return replace(candidate, sustained_rps=sustained_rps(instances, slo_ms))
