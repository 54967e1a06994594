"""GPU sharing policies as pure functions (no I/O, no clocks: time is passed in).

- complement rule (MuxFlow §4.3, Mudi §4): offline SM share is the complement of the online job's
  predicted activity, minus headroom, with a floor for training and a margin for inference;
- health state machine (MuxFlow SysMonitor, §4.2): Init/Healthy/Unhealthy/Overlimit/Disabled;
- graceful eviction plan: SIGTERM, wait, terminate_client, wait, SIGKILL;
- latency model (Mudi §4.1): two-segment piecewise-linear p99-vs-GPU% fit by direct breakpoint
  search with least squares; smallest share that meets an SLO, plus a margin;
- fault signals: a fatal client fault (XID or a server in FAULT) that makes MPS refuse new clients.
"""
from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np

from reamer.gpu.config import HealthThresholds
from reamer.gpu.errors import LatencyModelError

# --------------------------------------------------------------------------- complement rule


@dataclass(frozen=True)
class SharePlan:
    """SM shares (active-thread percentages) for one GPU's online job and each offline job."""

    online_pct: int
    offline_pct_each: int
    n_offline: int
    feasible: bool
    reason: str = ""

    @property
    def total_pct(self) -> int:
        return self.online_pct + self.offline_pct_each * self.n_offline


def complement_share(predicted_online_pct: float, headroom_pct: int = 10, floor_pct: int = 10) -> int:
    """MuxFlow: offline share = 100 - predicted online activity - headroom, never below `floor_pct`."""
    raw = math.floor(100 - _clamp(predicted_online_pct, 0, 100) - headroom_pct)
    return int(_clamp(raw, floor_pct, 100))


def complement_plan(predicted_online_pct: float, n_offline: int, headroom_pct: int = 10,
                    margin_pct: int = 10, floor_pct: int = 10) -> SharePlan:
    """Shares for one online job plus `n_offline` training jobs on one GPU, never past 100 % when feasible.

    online  = predicted + margin (percentage points; Mudi's +10 %), at least the prediction itself;
    offline = what is left after max(online, predicted + headroom), split evenly (Mudi), each >= floor.
    If the floor cannot be kept without squeezing the online job below its prediction, the plan is
    marked infeasible (offline jobs keep the floor) and says why.
    """
    pred = math.ceil(_clamp(predicted_online_pct, 0, 100))
    online = int(_clamp(pred + margin_pct, max(pred, 1), 100))
    if n_offline <= 0:
        return SharePlan(online, 0, 0, True)
    left = 100 - max(online, pred + headroom_pct)
    each = left // n_offline
    if each >= floor_pct:
        return SharePlan(online, int(min(each, 100)), n_offline, True)
    # Keep the training floor by taking from the online margin, never from the prediction.
    squeezed = 100 - floor_pct * n_offline
    if squeezed >= max(pred, 1):
        return SharePlan(int(min(online, squeezed)), floor_pct, n_offline, True,
                         "online margin reduced to keep the training floor")
    return SharePlan(online, floor_pct, n_offline, False,
                     f"{n_offline} training job(s) at the {floor_pct}% floor plus the online job's predicted "
                     f"{pred}% exceed 100%: run fewer training jobs on this GPU")


def sm_budget_problem(others: Mapping[str, int], job: str, pct: int, gpu: str) -> str | None:
    """Why adding `job` at `pct` % would push `gpu` past 100 % (None if it fits)."""
    used = sum(v for k, v in others.items() if k != job)
    if used + pct <= 100:
        return None
    names = ", ".join(f"{k}={v}%" for k, v in sorted(others.items()) if k != job)
    return (f"SM shares on GPU {gpu} would add up to {used + pct}% (> 100%): {job}={pct}% plus {names}; "
            f"{max(0, 100 - used)}% is free")


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


# --------------------------------------------------------------------------- health state machine


class HealthState(str, Enum):
    INIT = "init"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    OVERLIMIT = "overlimit"
    DISABLED = "disabled"


@dataclass(frozen=True)
class HealthMetrics:
    """One GPU sample as the state machine sees it; None = not measured."""

    util_pct: float | None = None
    mem_pct: float | None = None
    sm_clock_pct: float | None = None  # percent of the maximum SM clock

    def measured(self) -> bool:
        return any(v is not None for v in (self.util_pct, self.mem_pct, self.sm_clock_pct))


Level = Literal["healthy", "between", "unhealthy", "overlimit"]
_RANK = {"healthy": 0, "between": 1, "unhealthy": 2, "overlimit": 3}


def metric_levels(m: HealthMetrics, th: HealthThresholds) -> dict[str, Level]:
    """Level of every measured metric: healthy / between (hysteresis band) / unhealthy / overlimit."""
    out: dict[str, Level] = {}
    for name, value, healthy, unhealthy, over in (
        ("util", m.util_pct, th.util_healthy_below, th.util_unhealthy_at, th.util_overlimit_at),
        ("mem", m.mem_pct, th.mem_healthy_below, th.mem_unhealthy_at, th.mem_overlimit_at),
    ):
        if value is None:
            continue
        out[name] = ("overlimit" if value >= over else "unhealthy" if value >= unhealthy
                     else "healthy" if value < healthy else "between")
    if m.sm_clock_pct is not None:
        v = m.sm_clock_pct
        out["sm_clock"] = ("overlimit" if v <= th.sm_clock_overlimit_at else "unhealthy"
                           if v <= th.sm_clock_unhealthy_at else "healthy" if v > th.sm_clock_healthy_above
                           else "between")
    return out


@dataclass(frozen=True)
class HealthStatus:
    state: HealthState = HealthState.INIT
    since: float = 0.0
    overlimit_entries: tuple[float, ...] = ()  # times of entering Overlimit (within the window)
    calm_since: float | None = None  # in Overlimit: since when every metric is below Overlimit
    reasons: tuple[str, ...] = ()

    def admits_offline(self) -> bool:
        """MuxFlow: new offline GPU work only on a Healthy GPU."""
        return self.state is HealthState.HEALTHY

    def must_evict_offline(self) -> bool:
        return self.state is HealthState.OVERLIMIT

    def to_dict(self) -> dict:
        return {"state": self.state.value, "since": self.since, "reasons": list(self.reasons),
                "overlimit_entries_recent": len(self.overlimit_entries)}


def overlimit_hold_s(recent_entries: int, th: HealthThresholds) -> float:
    """Hold before leaving Overlimit: base, doubled for each further recent entry, capped."""
    k = max(1, recent_entries)
    return float(min(th.overlimit_hold_max_s, th.overlimit_hold_s * 2 ** min(k - 1, 60)))


def step_health(status: HealthStatus, metrics: HealthMetrics | None, th: HealthThresholds, now: float,
                available: bool = True) -> HealthStatus:
    """Next SysMonitor state from the previous one and a new sample taken at `now`."""
    entries = tuple(t for t in status.overlimit_entries if now - t < th.overlimit_window_s)
    if not available:
        return HealthStatus(HealthState.DISABLED, status.since if status.state is HealthState.DISABLED else now,
                            entries, None, ("GPU or its MPS daemon unavailable",))
    if metrics is None or not metrics.measured():
        return HealthStatus(status.state, status.since, entries, status.calm_since, status.reasons)
    levels = metric_levels(metrics, th)
    worst = max((_RANK[v] for v in levels.values()), default=0)
    reasons = tuple(f"{k} {v}" for k, v in sorted(levels.items()) if v in ("unhealthy", "overlimit"))
    state = status.state
    if state is HealthState.DISABLED:
        state = HealthState.INIT  # available again: start over

    def moved(new: HealthState, ent: tuple[float, ...] = entries, calm: float | None = None) -> HealthStatus:
        since = status.since if new is status.state else now
        return HealthStatus(new, since, ent, calm, reasons)

    if worst == _RANK["overlimit"]:
        if state is HealthState.OVERLIMIT:
            return moved(HealthState.OVERLIMIT, entries, None)
        return moved(HealthState.OVERLIMIT, entries + (now,), None)
    if state is HealthState.OVERLIMIT:
        calm = status.calm_since if status.calm_since is not None else now
        if now - calm >= overlimit_hold_s(len(entries), th):
            return moved(HealthState.UNHEALTHY)
        return moved(HealthState.OVERLIMIT, entries, calm)
    if worst == _RANK["unhealthy"]:
        return moved(HealthState.UNHEALTHY)
    if state in (HealthState.INIT, HealthState.HEALTHY):
        return moved(HealthState.HEALTHY)
    # Unhealthy: back to Healthy only when every metric is below its Healthy threshold.
    return moved(HealthState.HEALTHY if worst == _RANK["healthy"] else HealthState.UNHEALTHY)


# --------------------------------------------------------------------------- graceful eviction


@dataclass(frozen=True)
class EvictionStep:
    action: Literal["signal", "wait", "terminate_client"]
    pid: int | None = None
    signal: int | None = None
    seconds: float = 0.0
    server_pid: int | None = None

    def describe(self) -> str:
        if self.action == "signal":
            return f"send {signal.Signals(self.signal).name} to {self.pid}"
        if self.action == "wait":
            return f"wait up to {self.seconds:g}s for exit"
        return f"terminate_client {self.server_pid} {self.pid}"


def eviction_plan(pids: Iterable[int], server_pid: int | None, grace_s: float,
                  kill_after_s: float, clients: Iterable[int] | None = None) -> list[EvictionStep]:
    """SIGTERM every pid, wait `grace_s`, terminate its MPS client work (when the server is known; only
    for pids in `clients`, the server's clients, when given), wait `kill_after_s`, SIGKILL. An executor
    skips steps for processes that are already gone."""
    pids = sorted(set(int(p) for p in pids))
    if not pids:
        return []
    steps = [EvictionStep("signal", p, int(signal.SIGTERM)) for p in pids]
    steps.append(EvictionStep("wait", seconds=grace_s))
    targets = pids if clients is None else [p for p in pids if p in set(int(c) for c in clients)]
    if server_pid is not None and targets:
        steps += [EvictionStep("terminate_client", p, server_pid=server_pid) for p in targets]
        steps.append(EvictionStep("wait", seconds=kill_after_s))
    steps += [EvictionStep("signal", p, int(signal.SIGKILL)) for p in pids]
    return steps


# --------------------------------------------------------------------------- latency model (Mudi)


@dataclass(frozen=True)
class PiecewiseLinear:
    """Continuous two-segment line: y = y0 + slope_left*(x-x0) for x<x0, y0 + slope_right*(x-x0) after."""

    x0: float
    y0: float
    slope_left: float
    slope_right: float
    sse: float = 0.0

    def predict(self, x: float) -> float:
        d = x - self.x0
        return self.y0 + (self.slope_left if d < 0 else self.slope_right) * d

    def to_dict(self) -> dict:
        return {"x0": self.x0, "y0": self.y0, "slope_left": self.slope_left,
                "slope_right": self.slope_right, "sse": self.sse}


def fit_piecewise_linear(xs: Sequence[float], ys: Sequence[float], grid_step: float = 0.5) -> PiecewiseLinear:
    """Fit p99 latency vs GPU% with two linear segments joined at a breakpoint.

    Direct search: every candidate breakpoint (each sample x and a grid between the extremes) gets a
    linear least-squares fit of (y0, slope_left, slope_right); the candidate with the least squared
    error wins (ties: the smaller breakpoint). Needs at least 3 distinct x values."""
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise LatencyModelError("latency samples need one p99 value per GPU share",
                                "pass equally long lists of GPU percentages and p99 latencies")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise LatencyModelError("latency samples contain NaN or infinite values", "drop the broken samples")
    distinct = np.unique(x)
    if distinct.size < 3:
        raise LatencyModelError(f"need samples at 3 or more distinct GPU shares to fit the model, got {distinct.size}",
                                "profile the job at more GPU percentages (Mudi uses 6, e.g. 10,20,...,60)")
    lo, hi = float(distinct[0]), float(distinct[-1])
    grid = np.arange(lo, hi + 1e-9, grid_step) if grid_step > 0 else np.empty(0)
    candidates = np.unique(np.concatenate([distinct, grid]))
    # All candidates at once: design matrices (C, n, 3) solved with a batched pseudo-inverse
    # (a candidate at an end of the range has a zero column; the pseudo-inverse copes).
    d = x[None, :] - candidates[:, None]
    a = np.stack([np.ones_like(d), np.minimum(d, 0.0), np.maximum(d, 0.0)], axis=2)
    coef = np.linalg.pinv(a) @ y
    sse = np.sum((np.einsum("cnk,ck->cn", a, coef) - y[None, :]) ** 2, axis=1)
    i = int(np.argmin(sse + 1e-12 * np.arange(sse.size)))  # ties: the smaller breakpoint
    best = PiecewiseLinear(float(candidates[i]), float(coef[i, 0]), float(coef[i, 1]), float(coef[i, 2]),
                           float(sse[i]))
    return best


@dataclass(frozen=True)
class ShareChoice:
    share_pct: int  # what to give the job (base + margin, capped at 100)
    base_pct: int  # smallest share the model says meets the SLO
    predicted_p99_ms: float  # at base_pct


def smallest_share(model: PiecewiseLinear, slo_ms: float, margin_pct: int = 10, lo: int = 1,
                   hi: int = 100) -> ShareChoice:
    """Smallest whole GPU% in [lo, hi] whose predicted p99 meets `slo_ms`, plus `margin_pct` points."""
    if slo_ms <= 0:
        raise LatencyModelError(f"SLO must be positive, got {slo_ms} ms", "pass the p99 latency target in ms")
    for pct in range(max(1, lo), min(100, hi) + 1):
        p = model.predict(pct)
        if p <= slo_ms:
            return ShareChoice(min(100, pct + margin_pct), pct, p)
    best = min(model.predict(p) for p in range(max(1, lo), min(100, hi) + 1))
    raise LatencyModelError(f"no GPU share up to {hi}% meets the {slo_ms:g} ms SLO (best predicted p99 "
                            f"{best:.1f} ms)", "relax the SLO, lower the batch size, or give the job its own GPU")


# --------------------------------------------------------------------------- fault signals

# XIDs after which a client's CUDA context is dead (MPS then refuses new clients until its clients
# exit): 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
# 45 preemptive cleanup; and hardware faults: 48 DBE, 63/64 row remap, 74 NVLink, 79 fallen off
# the bus, 92/94/95 ECC, 119/120 GSP.
FATAL_XIDS = frozenset({13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass(frozen=True)
class FaultReport:
    faulted: bool
    reasons: tuple[str, ...] = field(default=())


def detect_fault(server_status: Mapping[int, str], xids: Iterable[int]) -> FaultReport:
    """A GPU needs fault handling if an MPS server reports FAULT or a fatal XID arrived. Only an
    explicit FAULT counts: an unexpected status text must not evict work."""
    reasons = [f"MPS server {pid} is FAULT" for pid, st in sorted(server_status.items()) if "FAULT" in st.upper()]
    reasons += [f"XID {x}" for x in xids if x in FATAL_XIDS]
    return FaultReport(bool(reasons), tuple(reasons))
