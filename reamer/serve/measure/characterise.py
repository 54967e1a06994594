"""Characterise a model as "scale-up" (start the layout search from one large instance) or "scale-out"
(start from many small instances), Cloud Reamer §III-B.

With hardware counters: IPC and cache-miss rate of one wide instance per batch size.
  - cache-miss rate stable (rises by at most MISS_RISE_LIMIT, relative, from the smallest to the largest
    batch) and IPC rising (by at least IPC_RISE_MIN, relative)            -> scale-up
  - cache-miss rate rising and IPC flat or falling                       -> scale-out
  - mixed: both rising -> scale-up if IPC rose by more than misses did, else scale-out;
           both flat   -> scale-out (width buys nothing; small instances avoid straggler threads)
Without counters (VMs, containers without perf access): say so once, with the errno, and classify from
measured throughput scaling per batch size:
  efficiency = (throughput on N cores / throughput on 1 core) / N
  median efficiency over batch sizes >= SCALE_UP_EFFICIENCY -> scale-up, else scale-out.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from reamer.host import perf
from reamer.host.errors import ReamerError
from reamer.host.perf import CounterSample, PerfSupport, PerfUnsupported
from reamer.plan.partition import ProfilePoint
from reamer.serve.measure import profiler
from reamer.serve.samples import SampleSpec
from reamer.serve.spec import static_batch_for

Classification = Literal["scale-up", "scale-out"]

IPC_RISE_MIN = 0.05  # relative IPC change (largest vs smallest batch) that counts as "rising"
MISS_RISE_LIMIT = 0.10  # relative cache-miss-rate change above which misses count as "rising"
SCALE_UP_EFFICIENCY = 0.80  # parallel efficiency of the wide instance that counts as scaling up

log = logging.getLogger(__name__)
_warned_no_counters = False


@dataclass(frozen=True)
class BatchCounters:
    batch: int
    ipc: float
    cache_miss_rate: float
    scaled: bool = False


@dataclass
class Characterisation:
    model: str
    classification: Classification
    evidence: list[str]
    points: list[ProfilePoint]
    counters_available: bool
    counters_reason: str
    counters: list[BatchCounters] = field(default_factory=list)


class CharacterisationError(ReamerError):
    """The measurements cannot support a classification."""


def _relative_change(first: float, last: float) -> float:
    if first == 0:
        return 0.0 if last == 0 else math.inf
    return last / first - 1.0


def classify_from_counters(counters: Sequence[BatchCounters]) -> tuple[Classification, list[str]]:
    """Pure rule over per-batch IPC and cache-miss rate (see module doc)."""
    rows = sorted(counters, key=lambda c: c.batch)
    if len({c.batch for c in rows}) < 2:
        raise CharacterisationError("counter-based characterisation needs at least two batch sizes",
                                    "measure counters at two or more batch sizes (e.g. 1, 4, 16)")
    evidence = [f"batch {c.batch}: IPC {c.ipc:.2f}, cache-miss rate {c.cache_miss_rate:.1%}"
                + (" (multiplexed, scaled)" if c.scaled else "") for c in rows]
    ipc_change = _relative_change(rows[0].ipc, rows[-1].ipc)
    miss_change = _relative_change(rows[0].cache_miss_rate, rows[-1].cache_miss_rate)
    ipc_rising = ipc_change >= IPC_RISE_MIN
    misses_rising = miss_change > MISS_RISE_LIMIT
    trend = (f"from batch {rows[0].batch} to {rows[-1].batch}: IPC {ipc_change:+.0%}, "
             f"cache-miss rate {miss_change:+.0%}")
    result: Classification
    if ipc_rising and not misses_rising:
        result, why = "scale-up", "stable cache misses with rising IPC: a large instance uses its cores well"
    elif misses_rising and not ipc_rising:
        result, why = "scale-out", "rising cache misses with flat or falling IPC: many small instances do better"
    elif ipc_rising and misses_rising:
        result = "scale-up" if ipc_change > miss_change else "scale-out"
        why = f"IPC and cache misses both rise; {'IPC' if result == 'scale-up' else 'misses'} rise faster"
    else:
        result, why = "scale-out", "neither IPC nor cache misses change: width buys nothing, small instances avoid stragglers"
    return result, evidence + [trend, f"{result}: {why}"]


def classify_from_scaling(points: Sequence[ProfilePoint]) -> tuple[Classification, list[str]]:
    """Pure rule over measured throughput: 1-core vs widest instance at the same batch (see module doc)."""
    by_batch: dict[int, dict[int, ProfilePoint]] = {}
    for p in points:
        by_batch.setdefault(p.batch, {})[p.cores] = p
    evidence: list[str] = []
    efficiencies: list[float] = []
    for batch in sorted(by_batch):
        table = by_batch[batch]
        wide = max(table)
        if 1 not in table or wide == 1 or table[1].throughput_rps <= 0:
            continue
        speedup = table[wide].throughput_rps / table[1].throughput_rps
        eff = speedup / wide
        efficiencies.append(eff)
        evidence.append(f"batch {batch}: 1 core {table[1].throughput_rps:.1f}/s, {wide} cores "
                        f"{table[wide].throughput_rps:.1f}/s -> speed-up {speedup:.2f}x of {wide}x ideal "
                        f"(efficiency {eff:.0%})")
    if not efficiencies:
        raise CharacterisationError(
            "throughput scaling needs a 1-core point and a wider point at the same batch size",
            "measure each batch size on 1 core and on 2 or more cores")
    median = statistics.median(efficiencies)
    result: Classification = "scale-up" if median >= SCALE_UP_EFFICIENCY else "scale-out"
    rel = ">=" if result == "scale-up" else "<"
    evidence.append(f"{result}: median parallel efficiency {median:.0%} {rel} {SCALE_UP_EFFICIENCY:.0%}")
    return result, evidence


def _counters_unavailable_once(errno: int | None, reason: str) -> str:
    global _warned_no_counters
    line = (f"hardware counters unavailable (errno {errno}: {reason}); "
            "classifying from measured throughput scaling instead")
    if not _warned_no_counters:
        log.warning(line)
        _warned_no_counters = True
    return line


def characterise(model_path: str | os.PathLike, backend: str = "onnxruntime", cpus: Sequence[int] | None = None,
                 batches: Sequence[int] = (1, 4, 16), *, warmup_s: float = 1.0, window_s: float = 0.5,
                 max_windows: int = 10, counter_window_s: float = 1.0, timeout_s: float = 600.0,
                 probe: Callable[[], PerfSupport] | None = None,
                 measure_counters: Callable[[int, float], CounterSample] | None = None,
                 samples: SampleSpec | None = None, precision: str = "f32") -> Characterisation:
    """Classify `model_path` on `cpus` (default: all this process may use), fed by `samples` (the
    traffic's shapes and data; default: reamer.serve.samples' rule), computing at `precision`.

    `probe` / `measure_counters` default to reamer.host.perf's; pass others to test the counter path.
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    if not cpus:
        raise CharacterisationError("no cpus to characterise on", "pass at least one cpu")
    support = (probe or perf.probe_perf)()
    model = os.fspath(model_path)
    wide = len(cpus)
    errno, reason = support.errno, support.reason
    if support.supported:
        try:
            return _characterise_with_counters(model, backend, cpus, batches, warmup_s, window_s,
                                               counter_window_s, timeout_s,
                                               measure_counters or perf.measure_counters, reason, samples,
                                               precision)
        except PerfUnsupported as exc:  # the probe passed but the worker's counters could not be opened
            errno, reason = exc.errno, exc.message

    reason_line = _counters_unavailable_once(errno, reason)
    points = []
    for cores in ([1, wide] if wide > 1 else [1]):  # one loaded worker walks the batches of each width
        with profiler.PointSession(model, backend, cores, cpus, warmup_s=warmup_s, window_s=window_s,
                                   max_windows=max_windows, samples=samples, precision=precision) as session:
            points += [session.measure(batch, timeout_s) for batch in batches]
    if wide == 1:
        evidence = [reason_line, "only one cpu: scaling cannot be measured; scale-out (single-core instances) "
                                 "is the only layout anyway"]
        return Characterisation(model, "scale-out", evidence, points, False, reason)
    classification, evidence = classify_from_scaling(points)
    return Characterisation(model, classification, [reason_line] + evidence, points, False, reason)


def _characterise_with_counters(model: str, backend: str, cpus: list[int], batches: Sequence[int], warmup_s: float,
                                window_s: float, counter_window_s: float, timeout_s: float,
                                measure_counters: Callable[[int, float], CounterSample], reason: str,
                                samples: SampleSpec | None = None, precision: str = "f32") -> Characterisation:
    """One instance on all `cpus` per batch size; counters read from its process while it runs."""
    wide = len(cpus)
    points, counters = [], []
    windows = max(2, math.ceil(counter_window_s / window_s) + 1)  # outlasts the counter window
    for batch in batches:
        cfg = profiler.WorkerConfig(model, backend, cpus, wide, batch, warmup_s, window_s, windows,
                                    fixed_windows=windows, samples=profiler._doc(samples), precision=precision,
                                    static_batch=static_batch_for(batch))
        with profiler.ProfileWorker(cfg) as worker:
            worker.wait_ready(timeout_s)
            worker.go()
            sample = measure_counters(worker.pid, counter_window_s)
            res = worker.result(timeout_s)
        counters.append(BatchCounters(batch, sample.ipc, sample.cache_miss_rate, sample.scaled))
        points.append(ProfilePoint(wide, batch, res.overall_rps, profiler.p99(res.latencies_ms)))
    classification, evidence = classify_from_counters(counters)
    return Characterisation(model, classification, evidence, points, True, reason, counters)
