"""The layout search on real cores, as `reamer search` and the agent's deploy path both run it.

Single-instance points come from the profile cache (key `model_key(model, backend)`) when it has
them; only the missing ones are measured, and those are stored back. Layouts are verified with all
instances running together (reamer.search.method), and the baseline — one instance on every core at the
largest batch — is run too, so the result can say what the search gained over it.

Every measurement runs on `cpus` only: the profiler pins each worker process to its slice of them
before the runtime starts any thread.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from reamer.host.errors import ReamerError
from reamer.plan.admission import batch_latency_target_ms
from reamer.plan.layout import InstanceShape, Layout, count_layouts, format_layout, parse_layout
from reamer.plan.online_sim import rank_by_sustained
from reamer.plan.partition import NEAR_TIE, Candidate, NoFeasibleLayout, ProfilePoint, near_ties
from reamer.search.backends import AUTO, installed_backends
from reamer.search.method import (BackendScreen, SearchResult, count_backend_layouts, exhaustive_search,
                                plan_from_profile, quick_search_backends)
from reamer.serve.runtime.batchability import check_batchability
from reamer.serve.samples import SampleSpec

if TYPE_CHECKING:
    from reamer.serve.measure.profiler import LayoutSession, PointSession

log = logging.getLogger("reamer.layout_search")

ProgressFn = Callable[[int, int, str], None]
# The quick search's wall-clock budget unless the caller gives one (issue 14: ≤ 2 min per model), with
# room for the last run's overrun: a run is started when its expected time fits, and runs take longer
# than expected on a loaded machine (a 2-instance layout at batch 32 ran 24 s against 13 s expected here).
QUICK_BUDGET_S = 100.0
TOGETHER_SLOWDOWN = 1.5  # a layout's instances slow each other: its expected time assumes at least this much


class ProfileCacheUnwritable(ReamerError):
    """New profile points could not be stored (the search result itself is still valid)."""


@dataclass(frozen=True)
class MeasureSettings:
    """How long each measurement runs (see reamer.serve.measure.profiler)."""

    warmup_s: float = 1.0
    window_s: float = 0.5
    max_windows: int = 10  # per single-instance point, before giving up on stability
    verify_windows: int = 4  # per layout verification (all instances together)


@dataclass(frozen=True)
class FinalsSettings:
    """The search's finals: the leading measured layouts, within `margin` of the fastest (closed-loop
    figures that close are a tie within the search's noise), loaded together and run in turn, `rounds`
    times, with longer windows; the mean of their runs replaces their search figures. They get what is
    left of the budget, at least `budget_share` of it (the search stops earlier to leave it)."""

    finalists: int = 3
    rounds: int = 2
    margin: float = NEAR_TIE
    window_s: float = 0.5
    windows: int = 4
    rewarm_s: float = 0.25  # before each run: the other finalists' runs evicted its caches
    budget_share: float = 0.25


@dataclass
class MeasurementRow:
    kind: str  # "point" (one instance alone), "layout" (all instances together) or "final" (a finals run)
    layout: str
    cores: int
    instances: int
    batch: str
    throughput_rps: float
    p99_ms: float
    seconds: float
    cached: bool = False
    backend: str = ""


@dataclass
class LayoutSearchOutcome:
    result: SearchResult  # what reamer.search.method returned (or a plan from the points, when the budget ran out)
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
    backend: str = ""  # the backend of `best` (of the first searched when none)
    backends: list[str] = field(default_factory=list)  # the backends searched
    screens: list[BackendScreen] = field(default_factory=list)  # "auto": what screening said per backend
    points_by_backend: dict[str, list[ProfilePoint]] = field(default_factory=dict)
    batch_target_ms: float | None = None  # online: the batch p99 every layout was judged on (half the SLO)
    # whether the model may be batched (batchability.py); not batchable: only batch 1 was measured
    batchable: bool | None = None
    batchable_reason: str = ""

    @property
    def layouts_measured(self) -> int:
        """Distinct layouts run: together, or one instance on every core (its point is that layout's run)."""
        return len({r.layout for r in self.rows if r.kind == "layout" or r.cores == len(self.cpus)})

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
                  samples: SampleSpec | None = None, precision: str = "f32") -> list[ProfilePoint]:
    """The single-instance points cached for (model, backend, this CPU model, traffic); [] when none."""
    if not cache_dir:
        return []
    from reamer.serve.measure.profile_cache import ProfileCache, model_key

    return ProfileCache(cache_dir).get(model_key(model_path, backend, samples=samples, precision=precision)) or []


def store_points(cache_dir: str | os.PathLike, model_path: str, backend: str, new_points: Sequence[ProfilePoint],
                 source: str = "layout search", samples: SampleSpec | None = None, precision: str = "f32") -> None:
    """Merge `new_points` into the cache entry (a newer measurement of a shape replaces the old)."""
    if not new_points:
        return
    from reamer.serve.backends import compute_precision
    from reamer.serve.measure.profile_cache import ProfileCache, model_key

    cache, key = ProfileCache(cache_dir), model_key(model_path, backend, samples=samples, precision=precision)
    merged = {(p.cores, p.batch): p for p in cache.get(key) or []}  # re-read: another search may have added
    merged.update({(p.cores, p.batch): p for p in new_points})
    try:
        cache.put(key, sorted(merged.values(), key=lambda p: (p.cores, p.batch)),
                  meta={"model": os.path.basename(model_path), "backend": backend, "source": source,
                        "precision": compute_precision(backend, precision),
                        "samples": samples.describe() if samples is not None else "default sample inputs"})
    except OSError as error:
        raise ProfileCacheUnwritable(f"cannot write the profile cache {cache_dir}: {error.strerror}",
                                     "make the directory writable, or point the cache elsewhere") from None


class _PointWorker:
    """The one point worker a search keeps loaded, shared by the _Runs of its backends: an idle worker of one
    backend may not hold a cpu or memory while another run measures."""

    def __init__(self) -> None:
        self.session: "PointSession | None" = None

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


class _Runs:
    """The search's measure/verify callbacks: cached points first, every run recorded, a time budget.

    Points are measured by one worker kept loaded while the search walks the batches of one core count
    (reamer.serve.measure.profiler.PointSession); it is closed before a layout runs, before another core count or
    backend is measured, and by close() when the search ends."""

    def __init__(self, model_path: str, backend: str, cpus: list[int], settings: MeasureSettings,
                 cached: Sequence[ProfilePoint], deadline: float | None, samples: SampleSpec | None = None,
                 rows: list[MeasurementRow] | None = None, tag: bool = False, precision: str = "f32",
                 worker: _PointWorker | None = None) -> None:
        self.model_path, self.backend, self.cpus, self.settings = model_path, backend, cpus, settings
        self.precision = precision
        self.samples = samples
        self.cached = {(p.cores, p.batch): p for p in cached}
        self.deadline = deadline
        self.rows: list[MeasurementRow] = [] if rows is None else rows  # shared by the backends of one search
        self.suffix = f"@{backend}" if tag else ""
        self.new_points: list[ProfilePoint] = []
        self.overheads: list[float] = []  # per fresh worker start here: its seconds beyond warm-up and windows
        self.worker = worker or _PointWorker()  # shared by the backends of one search, like `rows`

    def _timeout_s(self, expected_s: float = 0.0) -> float:
        """Seconds a run may take; _BudgetSpent when the budget is spent, or would be before a run
        expected to take `expected_s` ends (a batch-32 point of a large model runs for a minute: starting
        it just before the deadline would overrun the budget by that much)."""
        if self.deadline is None:
            return 600.0
        left = self.deadline - time.monotonic()
        if left <= 0 or expected_s > left:
            raise _BudgetSpent()
        return left + 30.0  # a run that started in time may finish; a hung worker may not hold us forever

    def batch_ms(self, cores: int, batch: int) -> float | None:
        """One batch's latency on `cores` cores alone, from the nearest measured batch on those cores
        (scaled by the batch ratio: latency grows about linearly with the batch); None: nothing known."""
        known = [p for p in self.points() if p.cores == cores and p.throughput_rps > 0]
        if not known:
            return None
        near = min(known, key=lambda p: abs(math.log2(p.batch / batch)))
        return 1000.0 * near.batch / near.throughput_rps * batch / near.batch

    def expected_s(self, latency_ms: float | None, windows: int, fresh: bool = True) -> float:
        """A run's expected seconds: this search's start-up overhead so far (process, model load) plus
        warm-up (the first batch, then `warmup_s`) and `windows` windows of at least one batch each. A
        run on a loaded worker (`fresh` False) has no start-up, and its re-warm-up may end after half
        of `warmup_s` (three batches at least, the first one counted)."""
        if latency_ms is None:
            return 0.0
        lat, s = latency_ms / 1000.0, self.settings
        windows_s = windows * max(s.window_s, lat)
        if not fresh:
            return lat + max(s.warmup_s / 2, 2 * lat) + windows_s
        return self.overhead_s() + lat + max(s.warmup_s, lat) + windows_s

    def overhead_s(self) -> float:
        """The least start-up overhead (process, imports, model load) a fresh worker of this backend has
        had: a lower bound, so a run is refused only when it would overrun the budget even at its fastest."""
        return max(0.0, min(self.overheads)) if self.overheads else 0.0

    def _ran(self, seconds: float, latency_ms: float, windows: int, fresh: bool = True) -> None:
        if fresh:  # a loaded worker's run has no start-up: it says nothing about a fresh one's
            self.overheads.append(seconds - (self.expected_s(latency_ms, windows) - self.overhead_s()))

    def _point_session(self, cores: int) -> "PointSession":
        """The worker for points on `cores` cores: the loaded one when it is this backend's on as many cores,
        else a new one (the search's other point worker closed first)."""
        from reamer.serve.measure.profiler import PointSession

        live = self.worker.session
        if live is not None and (live.cores != cores or live.config.backend != self.backend):
            self.worker.close()
        if self.worker.session is None:
            s = self.settings
            self.worker.session = PointSession(self.model_path, self.backend, cores, self.cpus, warmup_s=s.warmup_s,
                                               window_s=s.window_s, max_windows=s.max_windows,
                                               samples=self.samples, precision=self.precision)
        return self.worker.session

    def close(self) -> None:
        """Kill the search's loaded point worker, this backend's or another's (idempotent)."""
        self.worker.close()

    def measure(self, cores: int, batch: int) -> ProfilePoint:
        started = time.monotonic()
        point = self.cached.get((cores, batch))
        if point is None:
            session = self._point_session(cores)
            fresh = not session.alive
            timeout_s = self._timeout_s(self.expected_s(self.batch_ms(cores, batch), 3, fresh))
            point = session.measure(batch, timeout_s)
            self.new_points.append(point)
            self._ran(time.monotonic() - started, 1000.0 * batch / max(point.throughput_rps, 1e-9), 3, fresh)
        self.rows.append(MeasurementRow("point", f"1x{cores}:b{batch}{self.suffix}", cores, 1, str(batch),
                                        point.throughput_rps, point.p99_ms, time.monotonic() - started,
                                        (cores, batch) in self.cached, self.backend))
        return point

    def slowest_batch_ms(self, layout: Layout) -> float | None:
        """The expected latency of the layout's slowest batch with all its instances running (None: unknown)."""
        latencies = [self.batch_ms(shape.cores, shape.batch) for shape in layout.instances]
        slowest = None if any(lat is None for lat in latencies) else max(latencies)  # type: ignore[type-var]
        if slowest is not None and len(layout.instances) > 1:
            slowest *= TOGETHER_SLOWDOWN
        return slowest

    def verify(self, layout: Layout) -> tuple[float, float]:
        from reamer.serve.measure.profiler import measure_layout

        self.close()  # the layout's instances run alone on the cpus: no idle point worker beside them
        timeout_s = self._timeout_s(self.expected_s(self.slowest_batch_ms(layout), self.settings.verify_windows))
        started = time.monotonic()
        s = self.settings
        rps, p99 = measure_layout(self.model_path, self.backend, layout, self.cpus, warmup_s=s.warmup_s,
                                  window_s=s.window_s, windows=s.verify_windows, timeout_s=timeout_s,
                                  samples=self.samples, precision=self.precision)
        label = format_layout(layout.on(self.backend if self.suffix else None))
        self.rows.append(MeasurementRow("layout", label, layout.total_cores, len(layout.instances),
                                        _batches(layout), rps, p99, time.monotonic() - started,
                                        backend=self.backend))
        return rps, p99

    def finals_session(self, layout: Layout, finals: FinalsSettings) -> "LayoutSession":
        from reamer.serve.measure.profiler import LayoutSession

        return LayoutSession(self.model_path, self.backend, layout, self.cpus, warmup_s=self.settings.warmup_s,
                             window_s=finals.window_s, windows=finals.windows, samples=self.samples,
                             precision=self.precision)

    def finals_run_s(self, layout: Layout, finals: FinalsSettings) -> float:
        """A finals run's expected seconds: its re-warm-up and windows of at least one batch each."""
        batch_s = (self.slowest_batch_ms(layout) or 0.0) / 1000.0
        return finals.rewarm_s + batch_s + finals.windows * max(finals.window_s, batch_s)

    def points(self) -> list[ProfilePoint]:
        known = dict(self.cached)
        known.update({(p.cores, p.batch): p for p in self.new_points})
        return sorted(known.values(), key=lambda p: (p.cores, p.batch))


def _meets(p99_ms: float, slo_ms: float | None) -> bool:
    return slo_ms is None or p99_ms <= slo_ms


def _rank(candidates: list[Candidate], slo_ms: float | None) -> list[Candidate]:
    # measured results first (predictions only overestimate), feasible before infeasible, fastest first
    return sorted(candidates, key=lambda c: (not _meets(c.p99_ms, slo_ms), c.measured_rps is None, -c.rps))


def distinct_layouts(candidates: list[Candidate]) -> list[Candidate]:
    """The first candidate of each layout (backend included): a layout can be both predicted and verified,
    or verified again as the baseline; ranked first, its best-known figures stay."""
    seen: set[str] = set()
    kept = []
    for candidate in candidates:
        label = format_layout(candidate.layout.canonical())
        if label not in seen:
            seen.add(label)
            kept.append(candidate)
    return kept


def _plan_from_points(points: list[ProfilePoint], n_cores: int, slo_ms: float | None, space: int,
                      runs: int, why: str) -> SearchResult:
    try:
        best = plan_from_profile(points, n_cores, slo_ms) if points else None
        note = why + ("; the layout is planned from the single-instance points measured so far" if best else "")
    except NoFeasibleLayout as exc:
        best, note = None, f"{why}; {exc.message}"
    return SearchResult(best, [best] if best else [], runs, space, points, note=note)


def resolve_backends(backend: str) -> list[str]:
    """`backend` as the list the search runs: "auto" is every installed backend."""
    if backend != AUTO:
        return [backend]
    found = installed_backends()
    if not found:
        raise ReamerError("no inference backend is installed",
                          "install onnxruntime or openvino into reamer's environment")
    return found


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
    budget_s: float | None | Literal["default"] = "default",
    top_k: int = 5,
    progress: ProgressFn | None = None,
    cache_source: str = "layout search",
    strict_cache: bool = True,
    samples: SampleSpec | None = None,
    drop_margin: float = 0.15,
    precision: str = "f32",
    finals: FinalsSettings | None = FinalsSettings(),
    frontdoor_cpu_ms: float | None = None,
) -> LayoutSearchOutcome:
    """Find the best layout for the model on all of `cpus` (one core per cpu), measured on them. With `slo_ms`
    (an online job's SLO) every layout is judged on its batch p99 against half of it (batch_latency_target_ms).

    `backend`: "onnxruntime", "openvino", or "auto" (every installed backend: screened on a few points,
    the ones more than `drop_margin` behind dropped, the rest searched; the best layout names its
    backend). `cache_dir` None: neither read nor write cached points. `budget_s`: stop measuring once this much
    time has passed, or before a run that would certainly end after it (the run under way finishes), and
    plan from the points measured by then (`complete=False`); "default": QUICK_BUDGET_S for the quick search,
    none for the exhaustive one; None: no budget. `precision`: "f32" or "bf16" (OpenVINO computes in bfloat16 where the CPU supports it;
    part of the cache key). `samples`: the traffic's shapes and data (they are part of the cache key). `finals`: how
    the quick search's leading layouts are run off against each other (FinalsSettings; None: not at all); with an
    SLO, the finalists are then ranked by the rate each sustains under it, simulated (plan.online_sim).
    `frontdoor_cpu_ms` (online, no cpu reserved for the front door): the front door's cpu per request; a layout
    on every one of `cpus` carries it (plan.frontdoor.charge_candidates) and the best layout leaving it one cpu
    competes, verified if the budget allows. Raises reamer.serve.measure.profiler.ProfileError when a measurement fails (points
    measured before it are still cached) and, with `strict_cache`, ProfileCacheUnwritable when the
    cache cannot be written (else that is logged and the outcome returned).
    """
    cpus = list(cpus)
    target_ms = batch_latency_target_ms(slo_ms)  # layouts are judged on their batch p99 against this
    if not cpus:
        raise ValueError("a layout search needs at least one cpu")
    backends = resolve_backends(backend)
    batches = sorted(set(batches))
    # a model that is not batchable is served one request per run: only instances and threads vary
    verdict = check_batchability(backends[0], model_path, samples.to_doc() if samples is not None else None)
    if verdict is not None and not verdict.batchable:
        log.info("model %s is not batchable (%s): measuring batch 1 only", model_path, verdict.reason)
        batches = [1]
    n_cores = len(cpus)
    if budget_s == "default":
        budget_s = None if exhaustive else QUICK_BUDGET_S
    if exhaustive:
        finals = None
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    # the search stops early enough to leave the finals their share
    search_deadline = (deadline - budget_s * finals.budget_share if deadline is not None and budget_s is not None
                       and finals is not None else deadline)
    rows: list[MeasurementRow] = []
    worker = _PointWorker()
    runs = {b: _Runs(model_path, b, cpus, settings, cached_points(cache_dir, model_path, b, samples, precision),
                     search_deadline, samples, rows, tag=len(backends) > 1, precision=precision, worker=worker)
            for b in backends}
    space = count_backend_layouts(n_cores, batches, backends) if not exhaustive else \
        count_layouts(n_cores, batches) * len(backends)
    complete, base, screens = True, None, []

    def verify(layout: Layout) -> tuple[float, float]:
        return runs[layout.backend or backends[0]].verify(layout)

    try:
        try:
            if exhaustive:
                per_backend = []
                for b in backends:
                    found = exhaustive_search(lambda layout, b=b: verify(layout.on(b)), n_cores, target_ms, batches,
                                              progress, top_k=top_k)
                    per_backend.append((b, found))
                result = _merge_exhaustive(per_backend, space)
            else:
                result, screens = quick_search_backends(_screened(runs, backends),
                                                        n_cores, target_ms, batches, verify, progress,
                                                        backends=backends, drop_margin=drop_margin,
                                                        top_k=max(top_k, 5))
        except _BudgetSpent:
            complete = False
            why = f"the search's time budget of {budget_s:g} s ran out after {len(rows)} run(s)"
            log.info("%s for %s", why, os.path.basename(model_path))
            result = _plan_from_backends({b: r.points() for b, r in runs.items()}, n_cores, target_ms, space,
                                         len(rows), why)
            # layouts verified before the budget ran out are measured facts: they compete with the plan
            planned = {format_layout(c.layout) for c in result.candidates}
            # and so is a point of one instance on every core: that layout alone (the quick search verifies it so)
            result.candidates += [Candidate(_tagged(parse_layout(r.layout), r.backend), math.nan, math.nan,
                                            r.throughput_rps, r.p99_ms)
                                  for r in rows if (r.kind == "layout" or r.cores == n_cores)
                                  and r.layout not in planned]
        else:
            leader = result.best.layout.backend if result.best is not None else None
            base_backend = leader or backends[0]
            base_layout = Layout((InstanceShape(n_cores, n_cores, batches[-1]),), base_backend)
            base = next((r for r in rows if r.kind == "layout" and r.layout == _label(base_layout, len(backends) > 1)
                         and r.backend == base_backend), None)
            point = next((p for p in runs[base_backend].points() if (p.cores, p.batch) == (n_cores, batches[-1])),
                         None)
            if base is None and point is not None:  # measured alone already: that is the baseline's run
                base = MeasurementRow("layout", _label(base_layout, len(backends) > 1), n_cores, 1,
                                      str(batches[-1]), point.throughput_rps, point.p99_ms, 0.0, True, base_backend)
            if base is None:
                if progress is not None:
                    progress(len(rows) + 1, len(rows) + 1, f"baseline {format_layout(base_layout)}")
                try:
                    verify(base_layout)
                    base = rows[-1]
                except _BudgetSpent:  # the search itself finished: only the comparison is missing
                    pass
    finally:
        worker.close()
        if cache_dir:  # what was measured stays useful, even when the search failed half-way
            for b, r in runs.items():
                try:
                    store_points(cache_dir, model_path, b, r.new_points, cache_source, samples, precision)
                except ProfileCacheUnwritable as exc:
                    if strict_cache:
                        raise
                    log.warning("%s", exc)

    candidates = list(result.candidates)
    if base is not None and all(_label(c.layout, True) != _label(parse_layout(base.layout), True)
                                or (c.layout.backend or backends[0]) != base.backend for c in candidates):
        # the baseline ran with all instances together too: it competes like any verified layout
        base_runs = runs[base.backend]
        point = base_runs.cached.get((n_cores, batches[-1])) or next(
            (p for p in base_runs.new_points if (p.cores, p.batch) == (n_cores, batches[-1])), None)
        predicted = (point.throughput_rps, point.p99_ms) if point else (math.nan, math.nan)
        base_layout = Layout((InstanceShape(n_cores, n_cores, batches[-1]),), base.backend)
        candidates.append(Candidate(base_layout, *predicted, base.throughput_rps, base.p99_ms))
    if len(backends) == 1:  # a fixed backend: the layouts say nothing the job does not already say
        candidates = [Candidate(c.layout.on(None), c.predicted_rps, c.predicted_p99_ms, c.measured_rps,
                                c.measured_p99_ms) for c in candidates]
    candidates = distinct_layouts(_rank(candidates, target_ms))
    online = slo_ms is not None and target_ms is not None

    def by_sustained(ranked: list[Candidate]) -> list[Candidate]:
        """Online: of the near-equal throughputs, the one that holds the SLO best first."""
        assert slo_ms is not None and target_ms is not None
        return rank_by_sustained(ranked, slo_ms, target_ms, lambda layout: runs[layout.backend or backends[0]].points(),
                                 finals.margin if finals is not None else NEAR_TIE)

    if online:  # the finalists are the ones that sustain most, on the search's figures
        candidates = by_sustained(candidates)
    if finals is not None:
        candidates, finalists = _run_finals(candidates, target_ms, lambda layout: runs[layout.backend or backends[0]],
                                            finals, deadline, rows, len(backends) > 1, progress)
        if online and finalists:  # and the finals' figures decide among them
            candidates = by_sustained(candidates[:finalists]) + candidates[finalists:]
    if frontdoor_cpu_ms:
        candidates = _with_frontdoor(candidates, frontdoor_cpu_ms, n_cores, target_ms, runs, verify, rows)
        if online:
            candidates = by_sustained(candidates)
    best = candidates[0] if candidates and _meets(candidates[0].p99_ms, target_ms) else None
    gain = best.rps / base.throughput_rps if best is not None and base is not None and base.throughput_rps > 0 else None
    chosen = (best.layout.backend if best is not None else None) or backends[0]
    return LayoutSearchOutcome(result=result, best=best, candidates=candidates, rows=rows, baseline=base,
                               gain=gain, points=runs[chosen].points(), new_points=list(runs[chosen].new_points),
                               from_cache=not any(r.new_points for r in runs.values()), complete=complete, cpus=cpus,
                               batch_target_ms=target_ms,
                               batchable=verdict.batchable if verdict is not None else None,
                               batchable_reason=verdict.reason if verdict is not None else "",
                               backend=chosen, backends=backends, screens=screens,
                               points_by_backend={b: r.points() for b, r in runs.items()})


def _with_frontdoor(candidates: list[Candidate], cpu_ms: float, n_cores: int, target_ms: float | None,
                    runs: dict[str, "_Runs"], verify: Callable[[Layout], tuple[float, float]],
                    rows: list[MeasurementRow]) -> list[Candidate]:
    """The front door's cpu counted: layouts on all `n_cores` charged; the best one on n_cores − 1 (the last
    cpu left to the front door) added, measured when the budget allows."""
    from reamer.plan.frontdoor import charge_candidates

    extra: list[Candidate] = []
    if n_cores > 1:
        plan = _plan_from_backends({b: r.points() for b, r in runs.items()}, n_cores - 1, target_ms, 0, len(rows), "")
        if plan.best is not None and all(format_layout(c.layout.canonical()) != format_layout(
                plan.best.layout.canonical()) for c in candidates):
            alt = plan.best if len(runs) > 1 else Candidate(plan.best.layout.on(None), plan.best.predicted_rps,
                                                              plan.best.predicted_p99_ms)
            try:
                rps, p99 = verify(alt.layout)
                alt = Candidate(alt.layout, alt.predicted_rps, alt.predicted_p99_ms, rps, p99)
            except _BudgetSpent:
                pass
            except ReamerError as exc:  # an extra candidate: its prediction stays, the search's result stands
                log.warning("layout %s (a core left to the front door) not measured: %s", format_layout(alt.layout),
                            exc)
            extra.append(alt)
    return distinct_layouts(_rank(charge_candidates(candidates, n_cores, cpu_ms) + extra, target_ms))


def _screened(runs: dict, backends: list[str]) -> Callable[[str, int, int], ProfilePoint]:
    """The search's measure, where a backend that cannot run the model at all (OpenVINO and a string or
    custom-op model) measures nothing (0/s) while another backend still can: screening drops it, with the
    runtime's reason logged, instead of failing the whole "auto" search. Only the last backend's failure raises."""
    from reamer.serve.measure.profiler import ProfileError

    failed: dict[str, str] = {}

    def measure(backend: str, cores: int, batch: int) -> ProfilePoint:
        if backend not in failed:
            try:
                return runs[backend].measure(cores, batch)
            except ProfileError as exc:
                if len(failed) + 1 >= len(backends):
                    raise
                failed[backend] = exc.message
                log.warning("backend %s cannot run the model; the search goes on without it: %s", backend, exc.message)
        return ProfilePoint(cores, batch, 0.0, math.inf)

    return measure


def _run_finals(candidates: list[Candidate], target_ms: float | None, runs_of: Callable[[Layout], _Runs],
                finals: FinalsSettings, deadline: float | None, rows: list[MeasurementRow], tag: bool,
                progress: ProgressFn | None) -> tuple[list[Candidate], int]:
    """The measured layouts meeting `target_ms` within `finals.margin` of the fastest (the first
    `finals.finalists` of them in the order given), loaded together and run in turn for `finals.rounds`
    rounds, the order rotating: their means replace their search figures, and those still meeting
    `target_ms` rank first. As many finalists (two at least), then rounds, as fit before `deadline`. Returns
    the candidates and how many of the first are finalists meeting `target_ms` (0: no finals ran,
    `candidates` unchanged)."""
    from reamer.serve.measure.profiler import ProfileError

    finalists = near_ties(candidates, target_ms, finals.margin)[:finals.finalists]
    left = math.inf if deadline is None else deadline - time.monotonic()

    def needed_s(group: list[Candidate], n_rounds: int) -> float:
        return sum(runs_of(c.layout).overhead_s() + runs_of(c.layout).settings.warmup_s
                   + n_rounds * runs_of(c.layout).finals_run_s(c.layout, finals) for c in group)

    # as many finalists as fit, then as many rounds of them
    fitting = next(((n, r) for n in range(len(finalists), 1, -1) for r in range(finals.rounds, 0, -1)
                    if needed_s(finalists[:n], r) <= left), None)
    if fitting is None:
        return candidates, 0
    finalists, rounds = finalists[:fitting[0]], fitting[1]

    def timeout_s() -> float:  # as the search's runs: one started in time may finish, a hung one may not hold us
        return 600.0 if deadline is None else max(1.0, deadline - time.monotonic() + 30.0)

    results: list[list[tuple[float, float]]] = [[] for _ in finalists]
    sessions = []
    try:
        for c in finalists:
            sessions.append(runs_of(c.layout).finals_session(c.layout, finals))
            sessions[-1].start(timeout_s())
        for r in range(rounds):
            for i in range(len(finalists)):
                k = (i + r) % len(finalists)
                c, session = finalists[k], sessions[k]
                started = time.monotonic()
                m = session.run(finals.rewarm_s, timeout_s())
                results[k].append((m.throughput_rps, m.p99_ms))
                label = _label(c.layout, tag)
                rows.append(MeasurementRow("final", label, c.layout.total_cores, len(c.layout.instances),
                                           _batches(c.layout), m.throughput_rps, m.p99_ms,
                                           time.monotonic() - started, backend=runs_of(c.layout).backend))
                if progress is not None:
                    progress(len(rows), len(rows), f"final {label}")
    except ProfileError as exc:  # the search's own figures still stand
        log.warning("the search's finals were cut short: %s", exc.message)
        return candidates, 0
    finally:
        for session in sessions:
            session.close()
    ran = [replace(c, measured_rps=statistics.fmean(rps for rps, _ in runs),
                   measured_p99_ms=statistics.fmean(p99 for _, p99 in runs)) for c, runs in zip(finalists, results)]
    kept = sorted((c for c in ran if _meets(c.p99_ms, target_ms)), key=lambda c: -c.rps)
    rest = [c for c in candidates if all(c is not f for f in finalists)]
    return kept + _rank([c for c in ran if c not in kept] + rest, target_ms), len(kept)


def _batches(layout: Layout) -> str:
    """The layout's batch sizes for a measurement row, e.g. "4/8"."""
    return "/".join(map(str, sorted({shape.batch for shape in layout.instances})))


def _tagged(layout: Layout, backend: str) -> Layout:
    return layout if layout.backend else layout.on(backend)


def _label(layout: Layout, tag: bool) -> str:
    return format_layout(layout if tag else layout.on(None))


def _merge_exhaustive(per_backend: list[tuple[str, SearchResult]], space: int) -> SearchResult:
    candidates = [Candidate(c.layout.on(b), c.predicted_rps, c.predicted_p99_ms, c.measured_rps, c.measured_p99_ms)
                  for b, r in per_backend for c in r.candidates]
    candidates.sort(key=lambda c: -c.rps)
    best = candidates[0] if candidates else None
    notes = "; ".join(r.note for _, r in per_backend if r.note and best is None)
    return SearchResult(best, candidates, sum(r.measured for _, r in per_backend), space, note=notes)


def _plan_from_backends(points: dict[str, list[ProfilePoint]], n_cores: int, slo_ms: float | None, space: int,
                        runs: int, why: str) -> SearchResult:
    """The best planned layout over the backends' points (each tagged with its backend)."""
    plans = [(b, _plan_from_points(p, n_cores, slo_ms, space, runs, why)) for b, p in points.items()]
    found = [(b, r) for b, r in plans if r.best is not None]
    if not found:
        return plans[0][1] if plans else SearchResult(None, [], runs, space, note=why)
    backend, result = max(found, key=lambda item: item[1].best.rps)  # type: ignore[union-attr]
    best = result.best
    assert best is not None
    tagged = Candidate(best.layout.on(backend) if len(points) > 1 else best.layout, best.predicted_rps,
                       best.predicted_p99_ms)
    return SearchResult(tagged, [tagged], runs, space, result.measurements, note=result.note)
