"""What the co-location bench measures, and how it summarises it.

CPU accounting comes straight from the kernel: per-thread on-CPU time from
/proc/<pid>/task/<tid>/schedstat (nanoseconds; /proc/<pid>/task/<tid>/stat utime+stime as a
fallback), per-cpu idle time from /proc/stat.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from reamer.plan.statistics import percentile

CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- kernel readers --------------------------------------------------------


def cpu_idle_seconds(proc_root: str = "/proc") -> dict[int, float]:
    """Idle + iowait seconds per cpu since boot, from /proc/stat."""
    out: dict[int, float] = {}
    for line in Path(proc_root, "stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            fields = line.split()
            out[int(fields[0][3:])] = (int(fields[4]) + int(fields[5])) / CLK_TCK
    return out


def _thread_cpu_seconds(task_dir: Path) -> float:
    try:
        return int((task_dir / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        stat = (task_dir / "stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


def process_cpu_seconds(pid: int, proc_root: str = "/proc") -> float:
    """On-CPU seconds of every live thread of `pid` (0.0 once the process is gone)."""
    base = Path(proc_root, str(pid), "task")
    try:
        tids = os.listdir(base)
    except OSError:
        return 0.0
    return sum(_thread_cpu_seconds(base / tid) for tid in tids)


def thread_policies(pids: list[int], proc_root: str = "/proc") -> dict[str, int]:
    """How many threads of `pids` run under each scheduling policy."""
    names = {os.SCHED_OTHER: "other", os.SCHED_RR: "rr", os.SCHED_FIFO: "fifo",
             os.SCHED_IDLE: "idle", os.SCHED_BATCH: "batch"}
    counts: dict[str, int] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(Path(proc_root, str(pid), "task"))]
        except OSError:
            continue
        for tid in tids:
            try:
                name = names.get(os.sched_getscheduler(tid), "other")
            except OSError:
                continue
            counts[name] = counts.get(name, 0) + 1
    return counts


# --- summaries -------------------------------------------------------------


def _pct(values: list[float] | np.ndarray, p: float) -> float:
    return percentile(values, p)


@dataclass
class IterationSummary:
    n: int
    median_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, ms: list[float]) -> "IterationSummary":
        return cls(len(ms), _pct(ms, 50), _pct(ms, 99), float(np.mean(ms)) if ms else math.nan)


@dataclass
class LatencySummary:
    sent: int
    ok: int
    failed: int  # errors + shed
    mean_ms: float
    std_ms: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    slo_ms: float
    slo_attainment: float  # answered OK within the SLO / sent
    achieved_rps: float

    @classmethod
    def of(cls, ok_latencies_ms: list[float], sent: int, slo_ms: float, duration_s: float) -> "LatencySummary":
        lat = np.asarray(ok_latencies_ms, dtype=float)
        within = int((lat <= slo_ms).sum()) if len(lat) else 0
        return cls(
            sent=sent, ok=len(lat), failed=sent - len(lat),
            mean_ms=float(lat.mean()) if len(lat) else math.nan,
            std_ms=float(lat.std()) if len(lat) else math.nan,
            p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99), p999_ms=_pct(lat, 99.9),
            slo_ms=slo_ms, slo_attainment=within / sent if sent else math.nan,
            achieved_rps=len(lat) / duration_s if duration_s > 0 else 0.0,
        )


def change(value: float, baseline: float) -> float:
    """Relative change (0.05 = +5 %); NaN when either side is missing."""
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline == 0:
        return math.nan
    return value / baseline - 1.0


def harvest_ratio(offline_cpu_s: float, idle_s: float) -> float:
    """Offline CPU time on the training cores ÷ the idle time those cores had with training alone."""
    if idle_s <= 0 or not math.isfinite(offline_cpu_s):
        return math.nan
    return offline_cpu_s / idle_s


@dataclass
class Spread:
    """Median of per-trial values and their range."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(float(np.median(vals)), float(min(vals)), float(max(vals)), len(vals))

    def fmt(self, scale: float = 1.0, digits: int = 1, suffix: str = "", sign: bool = False) -> str:
        if self.n == 0:
            return "n/a"
        f = f"{{:{'+' if sign else ''}.{digits}f}}"
        mid = f.format(self.median * scale) + suffix
        if self.n == 1:
            return mid
        return f"{mid} ({f.format(self.lo * scale)}…{f.format(self.hi * scale)})"

    def to_dict(self) -> dict:
        return asdict(self)
