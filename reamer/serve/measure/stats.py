"""Sliding-window request statistics of an online job, and overload detection.

Time is passed in (`now`, monotonic seconds) so the logic is testable without sleeping.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from reamer.plan.statistics import percentile, slo_attainment


@dataclass(frozen=True)
class StatsSnapshot:
    requests: int  # served since start (not shed)
    shed: int  # shed since start
    rate_rps: float  # arrivals (served + shed) per second over the window
    p50_ms: float | None
    p99_ms: float | None
    slo_attainment: float | None  # fraction of window arrivals served within the SLO; None without SLO/traffic


class RequestStats:
    """Counts and latencies of requests over the last `window_s` seconds."""

    def __init__(self, slo_ms: float | None, window_s: float = 10.0) -> None:
        self.slo_ms = slo_ms
        self.window_s = window_s
        self._served: deque[tuple[float, float]] = deque()  # (finish time, latency ms)
        self._shed: deque[float] = deque()
        self._failed: deque[float] = deque()
        self._served_total = 0
        self._shed_total = 0
        self._failed_total = 0
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def record(self, latency_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._served.append((now, latency_s * 1000.0))
            self._served_total += 1
            self._trim(now)

    def record_shed(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._shed.append(now)
            self._shed_total += 1
            self._trim(now)

    def record_failed(self, now: float | None = None) -> None:
        """A request that reached a worker but got no result (crash, backend error): misses the SLO."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._failed.append(now)
            self._failed_total += 1
            self._trim(now)

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._served and self._served[0][0] < cutoff:
            self._served.popleft()
        for q in (self._shed, self._failed):
            while q and q[0] < cutoff:
                q.popleft()

    def arrival_rate(self, now: float | None = None, span_s: float | None = None) -> float:
        """Requests (served + shed + failed) per second over the last `span_s` (default: the window)."""
        now = time.monotonic() if now is None else now
        span = min(span_s or self.window_s, self.window_s)
        cutoff = now - span
        with self._lock:
            self._trim(now)
            n = sum(1 for t, _ in self._served if t >= cutoff)
            n += sum(1 for t in self._shed if t >= cutoff) + sum(1 for t in self._failed if t >= cutoff)
        # Early on, divide by the time we have been running, not by the whole window.
        elapsed = max(min(span, now - self._started), 1e-3)
        return n / elapsed

    def snapshot(self, now: float | None = None) -> StatsSnapshot:
        now = time.monotonic() if now is None else now
        rate = self.arrival_rate(now)
        with self._lock:
            self._trim(now)
            lat = np.fromiter((ms for _, ms in self._served), dtype=float, count=len(self._served))
            shed, failed = len(self._shed), len(self._failed)
            served_total, shed_total = self._served_total, self._shed_total
        p50 = p99 = attainment = None
        if lat.size:
            p50, p99 = percentile(lat, 50), percentile(lat, 99)
        arrivals = lat.size + shed + failed
        if self.slo_ms is not None and arrivals:
            attainment = slo_attainment(lat, self.slo_ms, arrivals)
        return StatsSnapshot(requests=served_total, shed=shed_total, rate_rps=rate,
                             p50_ms=p50, p99_ms=p99, slo_attainment=attainment)


class OverloadDetector:
    """Says once when the offered rate stays above the admitted rate for `sustain_s` seconds.

    After firing it re-arms only when the rate has dropped back under the admitted rate and
    at least `min_interval_s` has passed, so a long overload gives one event, not a stream.
    """

    def __init__(self, admitted_rps: float | None, sustain_s: float = 3.0, min_interval_s: float = 30.0,
                 tolerance: float = 0.05) -> None:
        self.admitted_rps = admitted_rps
        self.sustain_s = sustain_s
        self.min_interval_s = min_interval_s
        self.tolerance = tolerance
        self._over_since: float | None = None
        self._armed = True
        self._dropped_since_fired = True
        self._last_fired: float | None = None

    def observe(self, rate_rps: float, now: float | None = None) -> bool:
        """Feed the current offered rate; True exactly when an `overload` event should be emitted."""
        if self.admitted_rps is None:
            return False
        now = time.monotonic() if now is None else now
        over = rate_rps > self.admitted_rps * (1.0 + self.tolerance)
        if not over:
            self._over_since = None
            self._dropped_since_fired = True
            return False
        if self._over_since is None:
            self._over_since = now
        if not self._armed and self._dropped_since_fired and now - (self._last_fired or 0.0) >= self.min_interval_s:
            self._armed = True
        if self._armed and now - self._over_since >= self.sustain_s:
            self._armed = False
            self._dropped_since_fired = False
            self._last_fired = now
            return True
        return False


@dataclass(frozen=True)
class DoorLoad:
    busy: float | None  # cpu seconds per second the front door process used over the window (1.0 = one cpu)
    cpu_ms: float | None  # its cpu per request over the window; None without requests


class FrontDoorLoad:
    """The cpu of the job's own process (the front doors: HTTP, gRPC, JSON; the instances are other processes)
    over the last `window_s` seconds, in all and per request. One process holds one interpreter lock, so near
    1.0 of a cpu the front door, not the instances, limits the job's rate."""

    SATURATED = 0.8  # busy from here on: the front door is this job's bottleneck
    CLEARED = 0.5  # the saturation event fires again only after busy fell below this

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float, int]] = deque()  # (monotonic s, process cpu s, requests)
        self._armed = True

    def update(self, now: float, cpu_s: float, requests: int) -> DoorLoad:
        self._samples.append((now, cpu_s, requests))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, c0, r0 = self._samples[0]
        if now - t0 <= 0:
            return DoorLoad(None, None)
        cpu = max(cpu_s - c0, 0.0)
        return DoorLoad(round(cpu / (now - t0), 3), round(cpu / (requests - r0) * 1e3, 2) if requests > r0 else None)

    def newly_saturated(self, load: DoorLoad) -> bool:
        """True once when busy reaches SATURATED while serving; again only after it fell below CLEARED."""
        if load.busy is None or load.cpu_ms is None:  # no request in the window: busy with something else
            return False
        if self._armed and load.busy >= self.SATURATED:
            self._armed = False
            return True
        if load.busy < self.CLEARED:
            self._armed = True
        return False
