"""The layout search on real cores, as `reamer search` and the agent's deploy path both run it.

Single-instance points come from the profile cache (key `model_key(model, backend)`) when it has
them; only the missing ones are measured, and those are stored back. Layouts are verified with all
instances running together (plan.search), and the baseline — one instance on every core at the
largest batch — is run too, so the result can say what the search gained over it.

Every measurement runs on `cpus` only: the profiler pins each worker process to its slice of them
before the runtime starts any thread.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from reamer.host.errors import ReamerError
from reamer.plan.layout import InstanceShape, Layout, count_layouts, format_layout, parse_layout
from reamer.plan.partition import Candidate, NoFeasibleLayout, ProfilePoint
from reamer.plan.search import SearchResult, exhaustive_search, plan_from_profile, quick_search
from reamer.serve.samples import SampleSpec

log = logging.getLogger("reamer.layout_search")

ProgressFn = Callable[[int, int, str], None]


class ProfileCacheUnwritable(ReamerError):
    """New profile points could not be stored (the search result itself is still valid)."""


@dataclass(frozen=True)
class MeasureSettings:
    """How long each measurement runs (see reamer.serve.profiler)."""

    warmup_s: float = 1.0
    window_s: float = 0.5
    max_windows: int = 10  # per single-instance point, before giving up on stability
    verify_windows: int = 4  # per layout verification (all instances together)


@dataclass
class MeasurementRow:
    kind: str  # "point" (one instance alone) or "layout" (all instances together)
    layout: str
    cores: int
    instances: int
    batch: str
    throughput_rps: float
    p99_ms: float
    seconds: float
    cached: bool = False


@dataclass
class LayoutSearchOutcome:
    result: SearchResult  # what plan.search returned (or a plan from the points, when the budget ran out)
    best: Candidate | None  # the fastest layout meeting the SLO, measured where possible; None: none does
    candidates: list[Candidate]  # feasible first, measured before predicted, fastest first (baseline included)
    rows: list[MeasurementRow]  # every point and layout run, in order (cached points too, marked)
    baseline: MeasurementRow | None  # one instance on every core at the largest batch (None: not run)
    gain: float | None  # best throughput / baseline throughput
    points: list[ProfilePoint]  # every single-instance point known now (cached + new)
    new_points: list[ProfilePoint]  # points measured by this call (and stored in the cache)
    from_cache: bool  # no single-instance point had to be measured
    complete: bool = True  # False: the time budget ran out; `best` is planned from the points so far
    cpus: list[int] = field(default_factory=list)

    @property
    def layouts_measured(self) -> int:
        return len({r.layout for r in self.rows if r.kind == "layout"})

    @property
    def cached_point_count(self) -> int:
        return sum(r.cached for r in self.rows)

    @property
    def note(self) -> str:
        return self.result.note


class _BudgetSpent(Exception):
    pass


def batch_choices(max_batch: int) -> list[int]:
    """Powers of two up to `max_batch`, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max batch must be >= 1, got {max_batch}")
    batches, b = [], 1
    while b <= max_batch:
        batches.append(b)
        b *= 2
    if batches[-1] != max_batch:
        batches.append(max_batch)
    return batches


def cached_points(cache_dir: str | os.PathLike | None, model_path: str, backend: str,
                  samples: SampleSpec | None = None) -> list[ProfilePoint]:
    """The single-instance points cached for (model, backend, this CPU model, traffic); [] when none."""
    if not cache_dir:
        return []
    from reamer.serve.profile_cache import ProfileCache, model_key

    return ProfileCache(cache_dir).get(model_key(model_path, backend, samples=samples)) or []


def store_points(cache_dir: str | os.PathLike, model_path: str, backend: str, new_points: Sequence[ProfilePoint],
                 source: str = "layout search", samples: SampleSpec | None = None) -> None:
    """Merge `new_points` into the cache entry (a newer measurement of a shape replaces the old)."""
    if not new_points:
        return
    from reamer.serve.profile_cache import ProfileCache, model_key

    cache, key = ProfileCache(cache_dir), model_key(model_path, backend, samples=samples)
    merged = {(p.cores, p.batch): p for p in cache.get(key) or []}  # re-read: another search may have added
    merged.update({(p.cores, p.batch): p for p in new_points})
    try:
        cache.put(key, sorted(merged.values(), key=lambda p: (p.cores, p.batch)),
                  meta={"model": os.path.basename(model_path), "backend": backend, "source": source,
                        "samples": samples.describe() if samples is not None else "default sample inputs"})
    except OSError as error:
        raise ProfileCacheUnwritable(f"cannot write the profile cache {cache_dir}: {error.strerror}",
                                     "make the directory writable, or point the cache elsewhere") from None


class _Runs:
    """The search's measure/verify callbacks: cached points first, every run recorded, a time budget."""

    def __init__(self, model_path: str, backend: str, cpus: list[int], settings: MeasureSettings,
                 cached: Sequence[ProfilePoint], deadline: float | None, samples: SampleSpec | None = None) -> None:
        self.model_path, self.backend, self.cpus, self.settings = model_path, backend, cpus, settings
        self.samples = samples
        self.cached = {(p.cores, p.batch): p for p in cached}
        self.deadline = deadline
        self.rows: list[MeasurementRow] = []
        self.new_points: list[ProfilePoint] = []

    def _timeout_s(self) -> float:
        if self.deadline is None:
            return 600.0
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _BudgetSpent()
        return left + 30.0  # a run that started in time may finish; a hung worker may not hold us forever

    def measure(self, cores: int, batch: int) -> ProfilePoint:
        from reamer.serve.profiler import measure_point

        started = time.monotonic()
        point = self.cached.get((cores, batch))
        if point is None:
            s = self.settings
            point = measure_point(self.model_path, self.backend, cores, batch, self.cpus, warmup_s=s.warmup_s,
                                  window_s=s.window_s, max_windows=s.max_windows, timeout_s=self._timeout_s(),
                                  samples=self.samples)
            self.new_points.append(point)
        self.rows.append(MeasurementRow("point", f"1x{cores}:b{batch}", cores, 1, str(batch), point.throughput_rps,
                                        point.p99_ms, time.monotonic() - started, (cores, batch) in self.cached))
        return point

    def verify(self, layout: Layout) -> tuple[float, float]:
        from reamer.serve.profiler import measure_layout

        timeout_s = self._timeout_s()
        started = time.monotonic()
        s = self.settings
        rps, p99 = measure_layout(self.model_path, self.backend, layout, self.cpus, warmup_s=s.warmup_s,
                                  window_s=s.window_s, windows=s.verify_windows, timeout_s=timeout_s,
                                  samples=self.samples)
        batches = sorted({shape.batch for shape in layout.instances})
        self.rows.append(MeasurementRow("layout", format_layout(layout), layout.total_cores, len(layout.instances),
                                        "/".join(map(str, batches)), rps, p99, time.monotonic() - started))
        return rps, p99

    def points(self) -> list[ProfilePoint]:
        known = dict(self.cached)
        known.update({(p.cores, p.batch): p for p in self.new_points})
        return sorted(known.values(), key=lambda p: (p.cores, p.batch))


def _meets(p99_ms: float, slo_ms: float | None) -> bool:
    return slo_ms is None or p99_ms <= slo_ms


def _rank(candidates: list[Candidate], slo_ms: float | None) -> list[Candidate]:
    # measured results first (predictions only overestimate), feasible before infeasible, fastest first
    return sorted(candidates, key=lambda c: (not _meets(c.p99_ms, slo_ms), c.measured_rps is None, -c.rps))


def _plan_from_points(points: list[ProfilePoint], n_cores: int, slo_ms: float | None, space: int,
                      runs: int, why: str) -> SearchResult:
    try:
        best = plan_from_profile(points, n_cores, slo_ms) if points else None
        note = why + ("; the layout is planned from the single-instance points measured so far" if best else "")
    except NoFeasibleLayout as exc:
        best, note = None, f"{why}; {exc.message}"
    return SearchResult(best, [best] if best else [], runs, space, points, note=note)


def search_layout(
    model_path: str,
    backend: str,
    cpus: Sequence[int],
    slo_ms: float | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    exhaustive: bool = False,
    batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    settings: MeasureSettings = MeasureSettings(),
    budget_s: float | None = None,
    top_k: int = 5,
    progress: ProgressFn | None = None,
    cache_source: str = "layout search",
    strict_cache: bool = True,
    samples: SampleSpec | None = None,
) -> LayoutSearchOutcome:
    """Find the best layout for the model on all of `cpus` (one core per cpu), measured on them.

    `cache_dir` None: neither read nor write cached points. `budget_s`: stop measuring once this much
    time has passed (the run under way finishes) and plan from the points measured by then
    (`complete=False`). `samples`: the traffic's shapes and data (they are part of the cache key). Raises reamer.serve.profiler.ProfileError when a measurement fails (points
    measured before it are still cached) and, with `strict_cache`, ProfileCacheUnwritable when the
    cache cannot be written (else that is logged and the outcome returned).
    """
    cpus = list(cpus)
    if not cpus:
        raise ValueError("a layout search needs at least one cpu")
    batches = sorted(set(batches))
    n_cores = len(cpus)
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    runs = _Runs(model_path, backend, cpus, settings, cached_points(cache_dir, model_path, backend, samples),
                 deadline, samples)
    space = count_layouts(n_cores, batches)
    base_layout = Layout((InstanceShape(n_cores, n_cores, batches[-1]),))
    complete, base = True, None
    try:
        try:
            if exhaustive:
                result = exhaustive_search(runs.verify, n_cores, slo_ms, batches, progress, top_k=top_k)
            else:
                result = quick_search(runs.measure, n_cores, slo_ms, batches, runs.verify, progress,
                                      top_k=max(top_k, 5))
        except _BudgetSpent:
            complete = False
            why = f"the search's time budget of {budget_s:g} s ran out after {len(runs.rows)} run(s)"
            log.info("%s for %s", why, os.path.basename(model_path))
            result = _plan_from_points(runs.points(), n_cores, slo_ms, space, len(runs.rows), why)
            # layouts verified before the budget ran out are measured facts: they compete with the plan
            planned = {format_layout(c.layout) for c in result.candidates}
            result.candidates += [Candidate(parse_layout(r.layout), math.nan, math.nan, r.throughput_rps, r.p99_ms)
                                  for r in runs.rows if r.kind == "layout" and r.layout not in planned]
        else:
            base = next((r for r in runs.rows if r.kind == "layout" and r.layout == format_layout(base_layout)),
                        None)
            if base is None:
                if progress is not None:
                    progress(len(runs.rows) + 1, len(runs.rows) + 1, f"baseline {format_layout(base_layout)}")
                try:
                    runs.verify(base_layout)
                    base = runs.rows[-1]
                except _BudgetSpent:  # the search itself finished: only the comparison is missing
                    pass
    finally:
        if cache_dir:  # what was measured stays useful, even when the search failed half-way
            try:
                store_points(cache_dir, model_path, backend, runs.new_points, cache_source, samples)
            except ProfileCacheUnwritable as exc:
                if strict_cache:
                    raise
                log.warning("%s", exc)

    candidates = list(result.candidates)
    if base is not None and all(format_layout(c.layout) != base.layout for c in candidates):
        # the baseline ran with all instances together too: it competes like any verified layout
        point = runs.cached.get((n_cores, batches[-1])) or next(
            (p for p in runs.new_points if (p.cores, p.batch) == (n_cores, batches[-1])), None)
        predicted = (point.throughput_rps, point.p99_ms) if point else (math.nan, math.nan)
        candidates.append(Candidate(base_layout, *predicted, base.throughput_rps, base.p99_ms))
    candidates = _rank(candidates, slo_ms)
    best = candidates[0] if candidates and _meets(candidates[0].p99_ms, slo_ms) else None
    gain = best.rps / base.throughput_rps if best is not None and base is not None and base.throughput_rps > 0 else None
    return LayoutSearchOutcome(result=result, best=best, candidates=candidates, rows=runs.rows, baseline=base,
                               gain=gain, points=runs.points(), new_points=list(runs.new_points),
                               from_cache=not runs.new_points, complete=complete, cpus=cpus)
