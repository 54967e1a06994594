"""Layout search (Cloud Reamer §III-B, faster): measure a few single-instance points, solve the
partition exactly, verify the best few layouts with all instances running together.

`measure(cores, batch)` runs one instance alone and returns a ProfilePoint; `verify(layout)` runs a
whole layout and returns (throughput rps, p99 ms). Both are supplied by the caller (the profiler on
a real host, the simulator in tests), so this module stays pure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from reamer.plan.layout import BACKENDS, InstanceShape, Layout, count_layouts
from reamer.plan.partition import Candidate, NoFeasibleLayout, ProfilePoint, best_partitions, usable_points

MeasureFn = Callable[[int, int], ProfilePoint]
VerifyFn = Callable[[Layout], tuple[float, float]]
ProgressFn = Callable[[int, int, str], None]

DEFAULT_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


@dataclass
class SearchResult:
    best: Candidate | None  # None: nothing meets the SLO on these cores
    candidates: list[Candidate]  # best first; verified ones carry measured_rps / measured_p99_ms
    measured: int  # single-instance measurements + layout verifications run
    space: int  # count_layouts(n_cores, batches): what an exhaustive search would run
    measurements: list[ProfilePoint] = field(default_factory=list)
    note: str = ""


def _no_progress(done: int, total: int, label: str) -> None:
    return None


def _check(n_cores: int, batches: Sequence[int]) -> tuple[int, ...]:
    if n_cores < 1:
        raise ValueError(f"a search needs at least 1 core, got {n_cores}")
    ordered = tuple(sorted(set(batches)))
    if not ordered or ordered[0] < 1:
        raise ValueError(f"batch choices must be positive integers, got {list(batches)}")
    return ordered


def _meets(p99_ms: float, slo_ms: float | None) -> bool:
    return slo_ms is None or p99_ms <= slo_ms


class _Recorder:
    """Counts and reports measurements; remembers points so none is measured twice."""

    def __init__(self, measure: MeasureFn, progress: ProgressFn, total: int) -> None:
        self.measure_fn, self.progress, self.total = measure, progress, total
        self.points: dict[tuple[int, int], ProfilePoint] = {}
        self.done = 0
        self.rechecked: set[tuple[int, int]] = set()
        self.recheck_budget, self.margin = 0, 0.0

    def point(self, cores: int, batch: int) -> ProfilePoint:
        if (cores, batch) not in self.points:
            self.total = max(self.total, self.done + 1)
            self.points[(cores, batch)] = self.measure_fn(cores, batch)
            self.done += 1
            self.progress(self.done, self.total, f"measured 1 instance × {cores} cores, batch {batch}")
        return self.points[(cores, batch)]

    def meets(self, cores: int, batch: int, slo_ms: float | None, inflation: float = 1.0) -> bool:
        """Whether the point (p99 times `inflation`) meets the SLO. A point that misses by at most
        `margin` (a measurement's noise) is measured twice more, while `budget` lasts, and the mean
        of the three decides: one noisy reading just over the SLO would exclude the shape for good."""
        point = self.point(cores, batch)
        if _meets(point.p99_ms * inflation, slo_ms) or slo_ms is None:
            return True
        if (cores, batch) in self.rechecked or self.recheck_budget < 2 \
                or point.p99_ms * inflation > slo_ms * (1.0 + self.margin):
            return False
        self.rechecked.add((cores, batch))
        seen = [point]
        for _ in range(2):
            self.recheck_budget -= 1
            self.total = max(self.total, self.done + 1)
            seen.append(self.measure_fn(cores, batch))
            self.done += 1
            self.progress(self.done, self.total, f"re-measured 1 instance × {cores} cores, batch {batch}")
        self.points[(cores, batch)] = ProfilePoint(cores, batch, sum(p.throughput_rps for p in seen) / 3,
                                                   sum(p.p99_ms for p in seen) / 3)
        return _meets(self.points[(cores, batch)].p99_ms * inflation, slo_ms)


def _no_inflation(cores: int) -> float:
    return 1.0


def _smallest_cores_meeting(rec: _Recorder, n_cores: int, batch: int, slo_ms: float,
                            inflation: Callable[[int], float] = _no_inflation) -> int | None:
    """Fewest cores with which one instance at `batch` meets the SLO, its p99 times `inflation(cores)`
    (doubling, then bisection: latency falls as cores are added)."""
    cores, low = 1, 0  # `low`: most cores known to miss (0: none tried)
    while not rec.meets(cores, batch, slo_ms, inflation(cores)):
        if cores == n_cores:
            return None
        cores, low = min(2 * cores, n_cores), cores
    while cores - low > 1:
        middle = (low + cores) // 2
        if rec.meets(middle, batch, slo_ms, inflation(middle)):
            cores = middle
        else:
            low = middle
    return cores


def _profile_batches(rec: _Recorder, core_counts: Sequence[int], batches: Sequence[int], slo_ms: float | None,
                     min_gain: float, patience: int, inflation: Callable[[int], float] = _no_inflation) -> None:
    """For each core count, double the batch until p99 (times `inflation(cores)`) misses the SLO or
    `patience` doublings in a row gained less than `min_gain` over the best so far."""
    for cores in core_counts:
        best_rps, flat = 0.0, 0
        for batch in batches:
            if not rec.meets(cores, batch, slo_ms, inflation(cores)):
                break
            point = rec.point(cores, batch)
            if point.throughput_rps < best_rps * (1.0 + min_gain):
                flat += 1
                if flat >= patience:
                    break
                continue
            best_rps, flat = point.throughput_rps, 0


def guided_core_counts(n_cores: int, min_cores: int = 1) -> list[int]:
    """Core counts worth profiling: the minimum, powers of two, all cores, and the sizes of an even
    split into as many minimum-sized instances as fit (so the partition can fill every core)."""
    counts = {min_cores, n_cores}
    power = 1
    while power <= n_cores:
        if power >= min_cores:
            counts.add(power)
        power *= 2
    pieces = n_cores // min_cores
    counts.update({n_cores // pieces, min(n_cores, n_cores // pieces + 1), min(n_cores, min_cores + 1)})
    return sorted(counts)


def _uniform_fill(points: list[ProfilePoint], n_cores: int, slo_ms: float | None) -> list[Layout]:
    """For each measured core count: as many copies of its best point as fit — the single-large and
    many-small layouts that the independence assumption of the partition may misjudge."""
    layouts = []
    best_per_cores: dict[int, ProfilePoint] = {}
    for point in usable_points(points, n_cores, slo_ms):
        if point.cores not in best_per_cores or point.throughput_rps > best_per_cores[point.cores].throughput_rps:
            best_per_cores[point.cores] = point
    for cores, point in sorted(best_per_cores.items()):
        layouts.append(Layout.uniform(n_cores // cores, cores, point.batch))
    return layouts


def quick_search(
    measure: MeasureFn,
    n_cores: int,
    slo_ms: float | None = None,
    batches: Sequence[int] = DEFAULT_BATCHES,
    verify: VerifyFn | None = None,
    progress: ProgressFn | None = None,
    *,
    top_k: int = 5,
    verify_top: int = 3,
    contention: float = 0.0,
    min_gain: float = 0.02,
    max_rounds: int = 3,
    max_repairs: int = 4,
    patience: int = 2,
    max_sweep: int = 4,
    recheck_margin: float = 0.05,
    max_rechecks: int = 4,
    max_point_rechecks: int = 2,
    confirm_margin: float = 0.05,
    max_confirms: int = 4,
    tie_margin: float = 0.05,
    max_tie_runs: int = 6,
) -> SearchResult:
    """Guided profile + exact partition + verification of the best few layouts.

    1. Online (`slo_ms`): find the fewest cores for which one instance at the smallest batch meets
       the SLO. 2. For each guided core count, double the batch until p99 misses the SLO or
       `patience` doublings in a row gained less than `min_gain` over the best so far (one flat
       step is not enough: measured throughput-vs-batch curves have dips). 3. Partition exactly
       (`best_partitions`). 4. With `verify`: run the `verify_top` best layouts plus the uniform
       single-large / many-small layouts together and keep the measured best that meets the SLO.
       When running together pushed p99 past the SLO, learn per instance size how much running
       together slowed throughput and inflated p99, profile the sizes that then meet the SLO,
       partition the adjusted points and verify again (at most `max_rounds` rounds); then walk from
       the best layout that missed toward lighter neighbours (at most `max_repairs` runs).
       5. Walk the batch of the best verified core splits up and down while the measured throughput
       gains (at most `max_sweep` runs each): how much running instances slow each other depends on
       the batch, which no profile shows.
       A layout of one instance (a thread per core, one stream) is its single-instance point: the point
       measured alone counts as its first run, so it is not run again to be verified.
       Before 4's repair walk: the best layouts whose one run missed the SLO by at most
       `recheck_margin` (a measurement's noise) run twice more (at most `max_rechecks` runs); the
       mean of the three decides. One noisy run just over the SLO otherwise discards the best layout for good.
       The same holds for single-instance points: one whose p99 misses the SLO by at most
       `recheck_margin` is measured twice more (at most `max_point_rechecks` points) and the mean decides.
    6. Before accepting: the best layout and those within `tie_margin` of its throughput run twice
       more (at most `max_tie_runs` runs; means decide), and a best within `confirm_margin` under the
       SLO runs twice more (at most `max_confirms` runs). A best whose p99 is still within
       `confirm_margin` of the SLO yields to a layout within `tie_margin` of its throughput that clears it.
    """
    batches = _check(n_cores, batches)
    progress = progress or _no_progress
    space = count_layouts(n_cores, batches)
    rec = _Recorder(measure, progress, total=len(guided_core_counts(n_cores)) * 3 + (verify_top if verify else 0))
    rec.recheck_budget, rec.margin = 2 * max_point_rechecks, recheck_margin

    min_cores = 1
    if slo_ms is not None:
        found = _smallest_cores_meeting(rec, n_cores, batches[0], slo_ms)
        if found is None:
            fastest = min(rec.points.values(), key=lambda p: p.p99_ms)
            return SearchResult(
                best=None, candidates=[], measured=rec.done, space=space, measurements=list(rec.points.values()),
                note=f"one instance misses a batch p99 of {slo_ms:g} ms even on all {n_cores} cores at batch {batches[0]} "
                f"(best p99 {fastest.p99_ms:.1f} ms on {fastest.cores} cores)",
            )
        min_cores = found

    _profile_batches(rec, guided_core_counts(n_cores, min_cores), batches, slo_ms, min_gain, patience)

    points = list(rec.points.values())
    candidates = best_partitions(points, n_cores, slo_ms, top_k=top_k, contention=contention)
    if verify is None or not candidates:
        return SearchResult(candidates[0] if candidates else None, candidates, rec.done, space, points,
                            note="" if candidates else "no measured shape meets the SLO")

    verified: dict[Layout, Candidate] = {}
    runs: dict[Layout, list[tuple[float, float]]] = {}

    def run(layout: Layout, guess: Candidate | None) -> Candidate:
        alone = _alone_point(layout, rec.points)
        if alone is not None and layout not in runs:
            # one instance on every core running "together" is the point measured alone: its first run
            rps, p99 = alone.throughput_rps, alone.p99_ms
        else:
            rps, p99 = verify(layout)
            rec.done += 1
            rec.total = max(rec.total, rec.done)
            progress(rec.done, rec.total, f"verified {layout}")
        runs.setdefault(layout, []).append((rps, p99))
        known = verified.get(layout)
        guess = guess or known or _predict(layout, rec.points)
        seen = runs[layout]  # a re-run: the mean of the runs so far
        verified[layout] = Candidate(layout, guess.predicted_rps, guess.predicted_p99_ms,
                                     sum(r for r, _ in seen) / len(seen), sum(p for _, p in seen) / len(seen))
        return verified[layout]

    # Round 0 also runs the uniform single-large / many-small layouts, which the independence
    # assumption of the partition may misjudge (shared caches, memory bandwidth).
    round_layouts = [(c.layout, c) for c in candidates[:verify_top]]
    for layout in _uniform_fill(points, n_cores, slo_ms):
        if all(layout.canonical() != known for known, _ in round_layouts):
            round_layouts.append((layout.canonical(), None))
    for _ in range(max_rounds):
        rec.total = rec.done + len(round_layouts)
        missed = False
        for layout, guess in round_layouts:
            missed |= not _meets(run(layout, guess).p99_ms, slo_ms)
        best_so_far = max((c.rps for c in verified.values() if _meets(c.p99_ms, slo_ms)), default=0.0)
        if slo_ms is None or not missed:
            break
        # Running together inflated p99 past the SLO. Learn from the runs so far how much running
        # together slows throughput and inflates p99 per instance size, profile the sizes that then
        # meet the SLO (often wider than the SLO alone asked for), and partition the adjusted points.
        slower, inflated = _together_factors(verified, rec.points)
        inflation = lambda cores: _factor_for(inflated, cores)  # noqa: E731
        widest_needed = _smallest_cores_meeting(rec, n_cores, batches[0], slo_ms, inflation)
        if widest_needed is not None and widest_needed > min_cores:
            min_cores = widest_needed
            _profile_batches(rec, guided_core_counts(n_cores, min_cores), batches, slo_ms, min_gain, patience,
                             inflation)
        adjusted = [ProfilePoint(p.cores, p.batch, p.throughput_rps * _factor_for(slower, p.cores),
                                 p.p99_ms * inflation(p.cores)) for p in rec.points.values()]
        fresh = [c for c in best_partitions(adjusted, n_cores, slo_ms, top_k=top_k, contention=contention)
                 if c.layout not in verified]
        if not fresh or fresh[0].predicted_rps <= best_so_far:
            break
        round_layouts = [(c.layout, _predict(c.layout, rec.points)) for c in fresh[:verify_top]]

    if slo_ms is not None:
        _recheck(verified, slo_ms, run, recheck_margin, max_rechecks)
        _repair(verified, rec.points, slo_ms, run, max_repairs)
    _batch_sweep(verified, rec, batches, slo_ms, run, max_sweep)
    _settle_ties(verified, runs, slo_ms, run, tie_margin, max_tie_runs)
    if slo_ms is not None:
        _confirm(verified, runs, slo_ms, run, confirm_margin, max_confirms)

    results = list(verified.values())
    feasible = sorted((c for c in results if _meets(c.p99_ms, slo_ms)), key=lambda c: -c.rps)
    if slo_ms is not None and feasible:
        feasible = _prefer_headroom(feasible, slo_ms, confirm_margin, tie_margin)
    missed = [c for c in results if not _meets(c.p99_ms, slo_ms)]
    rest = [c for c in candidates if c.layout not in verified]
    note = "" if feasible else "no verified layout met the SLO with all instances running together"
    return SearchResult(feasible[0] if feasible else None, feasible + missed + rest, rec.done, space,
                        list(rec.points.values()), note)


def _neighbours(layout: Layout, points: dict[tuple[int, int], ProfilePoint]) -> list[Layout]:
    """Lighter layouts on the same cores: one instance at the next smaller measured batch, or two of
    the smallest instances merged into one twice as wide (fewer instances, less contention)."""
    shapes = list(layout.instances)
    found: list[Layout] = []
    for index, shape in enumerate(shapes):
        smaller = [b for (c, b) in points if c == shape.cores and b < shape.batch]
        if smaller:
            lighter = InstanceShape(shape.cores, shape.threads, max(smaller))
            found.append(Layout(tuple(shapes[:index] + [lighter] + shapes[index + 1 :])).canonical())
    smallest = min(shape.cores for shape in shapes)
    pair = [i for i, shape in enumerate(shapes) if shape.cores == smallest][:2]
    wide = [(b, p) for (c, b), p in points.items() if c == 2 * smallest]
    if len(pair) == 2 and wide:
        batch = max(wide, key=lambda item: item[1].throughput_rps)[0]
        merged = [s for i, s in enumerate(shapes) if i not in pair] + [InstanceShape(2 * smallest, 2 * smallest, batch)]
        found.append(Layout(tuple(merged)).canonical())
    return found


def _recheck(
    verified: dict[Layout, Candidate],
    slo_ms: float,
    run: Callable[[Layout, Candidate | None], Candidate],
    margin: float,
    budget: int,
) -> None:
    """Run again, best measured throughput first, the layouts that beat the best one meeting the
    SLO and missed it by at most `margin`: twice each, while the budget lasts and until one meets
    it. The mean of all three runs decides: the first, which missed, keeps the verdict cautious
    (stopping at the first lucky re-run would let layouts truly just over the SLO through)."""
    best_ok = max((c.rps for c in verified.values() if _meets(c.p99_ms, slo_ms)), default=0.0)
    near = sorted((c for c in verified.values()
                   if not _meets(c.p99_ms, slo_ms) and c.p99_ms <= slo_ms * (1.0 + margin) and c.rps > best_ok),
                  key=lambda c: -c.rps)
    for candidate in near:
        if budget < 2:
            return
        budget -= 2
        run(candidate.layout, None)
        if _meets(run(candidate.layout, None).p99_ms, slo_ms):
            return


def _confirm(
    verified: dict[Layout, Candidate],
    runs: dict[Layout, list[tuple[float, float]]],
    slo_ms: float,
    run: Callable[[Layout, Candidate | None], Candidate],
    margin: float,
    budget: int,
) -> None:
    """Before accepting it, run again twice the best layout meeting the SLO if its one run came
    within `margin` of the SLO; the mean of the three decides (the mirror of `_recheck`: one lucky
    low reading would otherwise accept a layout truly over the SLO). Repeats with the next best
    while the budget lasts."""
    while budget >= 2:
        feasible = sorted((c for c in verified.values() if _meets(c.p99_ms, slo_ms)), key=lambda c: -c.rps)
        if not feasible:
            return
        best = feasible[0]
        if len(runs[best.layout]) >= 3 or best.p99_ms < slo_ms * (1.0 - margin):
            return
        budget -= 2
        run(best.layout, None)
        run(best.layout, None)


def _settle_ties(
    verified: dict[Layout, Candidate],
    runs: dict[Layout, list[tuple[float, float]]],
    slo_ms: float | None,
    run: Callable[[Layout, Candidate | None], Candidate],
    tie: float,
    budget: int,
) -> None:
    """Run twice more the best layout meeting the SLO and those within `tie` of its throughput (a tie
    within noise), while the budget lasts; the means decide. One lucky reading otherwise picks a
    layout a few per cent slower than the one it beat."""
    while budget >= 2:
        feasible = sorted((c for c in verified.values() if _meets(c.p99_ms, slo_ms)), key=lambda c: -c.rps)
        if len(feasible) < 2:
            return
        top = feasible[0]
        close = [c for c in feasible[1:] if c.rps >= top.rps * (1.0 - tie)]
        pending = [c for c in [top] + close if len(runs[c.layout]) < 3]
        if not close or not pending:
            return
        budget -= 2
        run(pending[0].layout, None)
        run(pending[0].layout, None)
        seen = [rps for rps, _ in runs[pending[0].layout]]
        if max(seen) <= min(seen) * (1.0 + tie / 10.0):
            return  # the runs agree far more closely than the tie: the readings are not noise


def _prefer_headroom(feasible: list[Candidate], slo_ms: float, margin: float, tie: float) -> list[Candidate]:
    """`feasible` (best first) with the best moved behind the fastest layout within `tie` of its
    throughput (a tie within noise) whose p99 clears the SLO by more than `margin`, when the best's
    p99 does not: a p99 within noise of the SLO may truly be over it."""
    best = feasible[0]
    if best.p99_ms <= slo_ms * (1.0 - margin):
        return feasible
    safer = [c for c in feasible if c.rps >= best.rps * (1.0 - tie) and c.p99_ms <= slo_ms * (1.0 - margin)]
    if not safer:
        return feasible
    return [safer[0]] + [c for c in feasible if c is not safer[0]]


def _repair(
    verified: dict[Layout, Candidate],
    points: dict[tuple[int, int], ProfilePoint],
    slo_ms: float,
    run: Callable[[Layout, Candidate | None], Candidate],
    budget: int,
) -> None:
    """Greedy walk from the best layout that missed the SLO toward lighter neighbours, while it
    could still beat the best layout that met it."""
    best_ok = max((c.rps for c in verified.values() if _meets(c.p99_ms, slo_ms)), default=0.0)
    missed = [c for c in verified.values() if not _meets(c.p99_ms, slo_ms) and c.rps > best_ok]
    if not missed:
        return
    current = max(missed, key=lambda c: c.rps)
    for _ in range(budget):
        options = [
            _predict(layout, points) for layout in _neighbours(current.layout, points) if layout not in verified
        ]
        options = [c for c in options if _meets(c.predicted_p99_ms, slo_ms) and c.predicted_rps > best_ok]
        if not options:
            return
        current = run(max(options, key=lambda c: c.predicted_rps).layout, None)
        if _meets(current.p99_ms, slo_ms):
            return


def _batch_sweep(
    verified: dict[Layout, Candidate],
    rec: _Recorder,
    batches: Sequence[int],
    slo_ms: float | None,
    run: Callable[[Layout, Candidate | None], Candidate],
    budget: int,
    min_gain: float = 0.02,
) -> None:
    """Walk the batch of the two best verified core splits, and of the single instance on all cores (the
    other end of Cloud Reamer's scale-up/scale-out axis), every instance at one batch: from the split's
    best verified layout (first at each of its batches) one step up from its largest batch, then one step
    down from its smallest, running each step together and going on in that
    direction while the measured throughput gains at least `min_gain` (downward: on to the smallest
    batch); at most `budget` runs per split.
    How much running instances slow each other depends on the batch, which no profile shows; a walk
    finds the batch that pays without measuring every batch (large batches cost the most time: a
    point at batch 32 of a large model runs for a minute). Each step's (cores, batch) points must meet
    the SLO alone (measured first where missing)."""
    feasible = sorted((c for c in verified.values() if _meets(c.p99_ms, slo_ms)), key=lambda c: -c.rps)
    splits: list[Layout] = []
    for candidate in feasible:
        cores = sorted(s.cores for s in candidate.layout.instances)
        if all(sorted(s.cores for s in known.instances) != cores for known in splits):
            splits.append(candidate.layout)
    widest = max((len(s.instances) == 1 and s.total_cores for s in splits), default=0)
    chosen = splits[:2] + [s for s in splits[2:] if len(s.instances) == 1 and s.total_cores == widest][:1]
    ordered = sorted(set(batches))
    for best in chosen if budget > 0 else []:
        sizes = sorted({s.cores for s in best.instances})

        def at(batch: int, best: Layout = best) -> Layout:
            return Layout(tuple(InstanceShape(s.cores, s.threads, batch) for s in best.instances)).canonical()

        def fits(batch: int, sizes: list[int] = sizes) -> bool:
            return all(_meets(rec.point(cores, batch).p99_ms, slo_ms) for cores in sizes)

        own = sorted({s.batch for s in best.instances} & set(ordered))
        if not own:
            continue
        left = budget
        for batch in own:  # a mixed-batch best: its split at each of its batches first
            if at(batch) not in verified and left > 0 and fits(batch):
                run(at(batch), _predict(at(batch), rec.points))
                left -= 1
        top = max(c.rps for c in verified.values()
                  if (c.layout == best or c.layout in {at(b) for b in own}) and _meets(c.p99_ms, slo_ms))
        # up: one step that does not gain ends the walk (larger batches cost the most time); down: on to
        # the smallest batch while the budget lasts (small batches are cheap to run, and throughput
        # measured together dips and rises again as the batch shrinks)
        for step, start, patience in ((1, own[-1], 1), (-1, own[0], len(ordered))):
            index, flat = ordered.index(start), 0
            while left > 0:
                index += step
                if not 0 <= index < len(ordered) or not fits(ordered[index]):
                    break
                layout = at(ordered[index])
                if layout in verified:
                    found = verified[layout]
                else:
                    found = run(layout, _predict(layout, rec.points))
                    left -= 1
                if _meets(found.p99_ms, slo_ms) and found.rps >= top * (1.0 + min_gain):
                    top, flat = found.rps, 0
                    continue
                flat += 1
                if flat >= patience or not _meets(found.p99_ms, slo_ms):
                    break


def _together_factors(verified: dict[Layout, Candidate],
                      points: dict[tuple[int, int], ProfilePoint]) -> tuple[dict[int, float], dict[int, float]]:
    """Per instance size (cores), from the verified layouts of more than one instance: the mean
    measured/predicted throughput of those containing that size, and the worst measured/predicted
    p99 of those where that size had the highest p99 alone (the one that sets the layout's p99)."""
    rps_seen: dict[int, list[float]] = {}
    p99_seen: dict[int, list[float]] = {}
    for c in verified.values():
        if c.layout.instance_count < 2 or c.measured_rps is None or c.measured_p99_ms is None:
            continue
        for cores in {s.cores for s in c.layout.instances}:
            rps_seen.setdefault(cores, []).append(c.measured_rps / max(c.predicted_rps, 1e-9))
        alone: dict[int, float] = {}  # per size, its worst instance alone (sizes may repeat at other batches)
        for s in c.layout.instances:
            if (s.cores, s.batch) in points:
                alone[s.cores] = max(alone.get(s.cores, 0.0), points[(s.cores, s.batch)].p99_ms)
        if alone:
            worst = max(alone.values())
            for cores in (k for k, v in alone.items() if v == worst):
                p99_seen.setdefault(cores, []).append(c.measured_p99_ms / max(worst, 1e-9))
    return ({cores: sum(r) / len(r) for cores, r in rps_seen.items()},
            {cores: max(1.0, max(r)) for cores, r in p99_seen.items()})


def _factor_for(factors: dict[int, float], cores: int) -> float:
    """A factor for an instance size: linear between the observed sizes around it, the nearest
    end's beyond them; none observed: 1."""
    if not factors:
        return 1.0
    below = [c for c in factors if c <= cores]
    above = [c for c in factors if c >= cores]
    if not below or not above:
        return factors[max(below) if below else min(above)]
    low, high = max(below), min(above)
    if low == high:
        return factors[low]
    return factors[low] + (cores - low) / (high - low) * (factors[high] - factors[low])


def _alone_point(layout: Layout, points: dict[tuple[int, int], ProfilePoint]) -> ProfilePoint | None:
    """The single-instance point that `layout` is (one instance, a thread per core, one stream), if measured."""
    if len(layout.instances) != 1:
        return None
    shape = layout.instances[0]
    if shape.threads != shape.cores or shape.streams != 1:
        return None
    return points.get((shape.cores, shape.batch))


def _predict(layout: Layout, points: dict[tuple[int, int], ProfilePoint]) -> Candidate:
    chosen = [points[(shape.cores, shape.batch)] for shape in layout.instances]
    return Candidate(layout, sum(p.throughput_rps for p in chosen), max(p.p99_ms for p in chosen))


def _partitions(n: int, largest: int | None = None) -> Iterator[tuple[int, ...]]:
    """Integer partitions of n, parts non-increasing."""
    largest = n if largest is None else largest
    if n == 0:
        yield ()
        return
    for part in range(min(n, largest), 0, -1):
        for rest in _partitions(n - part, part):
            yield (part,) + rest


def _shape_multisets(n: int, shapes: list[tuple[int, int]], start: int = 0) -> Iterator[tuple[tuple[int, int], ...]]:
    """Multisets of (cores, batch) shapes whose cores sum to n, in non-decreasing shape order."""
    if n == 0:
        yield ()
        return
    for index in range(start, len(shapes)):
        cores = shapes[index][0]
        if cores > n:
            break
        for rest in _shape_multisets(n - cores, shapes, index):
            yield (shapes[index],) + rest


def all_layouts(n_cores: int, batches: Sequence[int], per_instance_batch: bool = False) -> Iterator[Layout]:
    """Every layout `count_layouts` counts (all cores used, threads = cores)."""
    batches = _check(n_cores, batches)
    if not per_instance_batch:
        for parts in _partitions(n_cores):
            for batch in batches:
                yield Layout(tuple(InstanceShape(c, c, batch) for c in parts))
        return
    shapes = [(c, b) for c in range(1, n_cores + 1) for b in batches]
    for multiset in _shape_multisets(n_cores, shapes):
        yield Layout(tuple(InstanceShape(c, c, b) for c, b in multiset)).canonical()


def exhaustive_search(
    verify: VerifyFn,
    n_cores: int,
    slo_ms: float | None = None,
    batches: Sequence[int] = DEFAULT_BATCHES,
    progress: ProgressFn | None = None,
    *,
    per_instance_batch: bool = False,
    top_k: int = 5,
    max_layouts: int | None = None,
) -> SearchResult:
    """Run every layout on exactly `n_cores` cores (the paper's space; `per_instance_batch` widens it)
    and keep the measured best that meets the SLO."""
    batches = _check(n_cores, batches)
    progress = progress or _no_progress
    space = count_layouts(n_cores, batches, per_instance_batch=per_instance_batch)
    if max_layouts is not None and space > max_layouts:
        raise NoFeasibleLayout(
            f"an exhaustive search on {n_cores} cores would run {space:,} layouts (limit {max_layouts:,})",
            "use the quick search, or fewer cores or batch sizes",
        )
    results: list[Candidate] = []
    for done, layout in enumerate(all_layouts(n_cores, batches, per_instance_batch), start=1):
        rps, p99 = verify(layout)
        progress(done, space, f"verified {layout}")
        results.append(Candidate(layout, rps, p99, rps, p99))
    feasible = sorted((c for c in results if _meets(c.p99_ms, slo_ms)), key=lambda c: -c.rps)
    return SearchResult(
        feasible[0] if feasible else None, feasible[:top_k], len(results), space,
        note="" if feasible else f"no layout on {n_cores} cores keeps its batch p99 within {slo_ms:g} ms",
    )


def plan_from_profile(
    points: Sequence[ProfilePoint], n_cores: int, slo_ms: float | None = None, contention: float = 0.0
) -> Candidate:
    """The predicted best layout from cached profile points (no measurement; for re-plans)."""
    candidates = best_partitions(points, n_cores, slo_ms, top_k=1, contention=contention)
    if candidates:
        return candidates[0]
    fitting = [p for p in points if p.cores <= n_cores]
    if not fitting:
        raise NoFeasibleLayout(
            f"the profile has no shape that fits in {n_cores} cores",
            "profile the model on this many cores (`reamer profile`), or give the job more cores",
        )
    fastest = min(fitting, key=lambda p: p.p99_ms)
    raise NoFeasibleLayout(
        f"no profiled shape on ≤ {n_cores} cores keeps its batch p99 within {slo_ms:g} ms (fastest p99 is "
        f"{fastest.p99_ms:.1f} ms with {fastest.cores} cores at batch {fastest.batch})",
        "raise the SLO, give the job more cores, or profile more shapes",
    )


# --- the backend as a search dimension -------------------------------------------------------------

BackendMeasureFn = Callable[[str, int, int], ProfilePoint]  # (backend, cores, batch) -> one instance alone


@dataclass
class BackendScreen:
    """What the first few points said about each backend: its throughput per screening point, and
    whether it was dropped as clearly behind (and why)."""

    backend: str
    throughput: dict[tuple[int, int], float]
    dropped: bool = False
    why: str = ""


def screening_points(n_cores: int, batches: Sequence[int]) -> list[tuple[int, int]]:
    """(cores, batch) points every backend is measured on before any is dropped: one core and all cores at
    the smallest batch, and all cores at a middle batch (a runtime's batching shows only there)."""
    batches = _check(n_cores, batches)
    middle = batches[min(len(batches) - 1, 2)]
    return list(dict.fromkeys([(1, batches[0]), (n_cores, batches[0]), (n_cores, middle)]))


def screen_backends(measure: BackendMeasureFn, backends: Sequence[str], n_cores: int, batches: Sequence[int],
                    drop_margin: float) -> list[BackendScreen]:
    """Measure every backend on `screening_points`; drop one that is more than `drop_margin` behind the
    best backend on every one of them (ahead anywhere: it stays, the layouts may use that shape)."""
    if len(backends) < 2:
        return [BackendScreen(b, {}) for b in backends]
    screens = [BackendScreen(b, {}) for b in backends]
    # point by point, the backends back to back (order alternating): a machine whose load drifts over the
    # screening then hits both sides of each comparison alike
    for index, point in enumerate(screening_points(n_cores, batches)):
        for screen in (screens if index % 2 == 0 else screens[::-1]):
            screen.throughput[point] = measure(screen.backend, *point).throughput_rps
    for screen in screens:
        behind = []
        for point, rps in screen.throughput.items():
            best = max(s.throughput[point] for s in screens)
            behind.append(rps < best * (1.0 - drop_margin))
        if all(behind):
            leader = max(screens, key=lambda s: sum(s.throughput.values()))
            screen.dropped = True
            screen.why = ", ".join(f"{c} core(s) b{b}: {screen.throughput[(c, b)]:.1f}/s vs "
                                   f"{leader.throughput[(c, b)]:.1f}/s" for c, b in screen.throughput)
    return screens


def screening_order(screens: list[BackendScreen]) -> list[BackendScreen]:
    """The backends, the one ahead at screening first (its mean share of the best throughput over the
    screening points; ties keep the given order): a search cut short by its time budget has then searched
    the likeliest winner."""
    def share(screen: BackendScreen) -> float:
        shares = [rps / max(max(s.throughput.get(point, 0.0) for s in screens), 1e-12)
                  for point, rps in screen.throughput.items()]
        return sum(shares) / len(shares) if shares else 0.0

    return sorted(screens, key=lambda s: -share(s))


def streams_variants(layout: Layout, max_streams_per_core: int = 1, max_batch: int | None = None) -> list[Layout]:
    """The layout with every instance of two or more cores running one OpenVINO stream per core (what the
    THROUGHPUT hint does on cores without hyper-threads), and the single instance over all its cores
    doing the same at the same samples in flight, at most `max_batch` (the largest batch searched: one
    batch beyond it lies outside the space and costs the most time to run); [] when the layout has
    nothing to split."""
    variants = []
    if any(s.cores > 1 for s in layout.instances):
        variants.append(Layout(tuple(InstanceShape(s.cores, s.threads, max(s.batch, s.cores), s.cores)
                                     for s in layout.instances), layout.backend).canonical())
    total = layout.total_cores
    if total > 1:
        in_flight = sum(s.batch for s in layout.instances)
        per_stream = max(1, in_flight // total)
        if max_batch is not None:
            per_stream = max(1, min(per_stream, max_batch // total))
        single = Layout((InstanceShape(total, total, per_stream * total, total),), layout.backend)
        if single not in variants:
            variants.append(single)
    return variants


def count_backend_layouts(n_cores: int, batches: Sequence[int], backends: Sequence[str],
                          streams_backends: Sequence[str] = ("openvino",)) -> int:
    """The space the backend dimension spans: every layout on every backend, and on a backend with
    streams every layout whose instances of two or more cores split their batch over one stream per core."""
    plain = count_layouts(n_cores, batches)
    all_single_core = len(set(batches)) if n_cores else 0  # layouts of 1-core instances only: nothing to split
    return sum(plain + (plain - all_single_core if b in streams_backends else 0) for b in backends)


def quick_search_backends(
    measure: BackendMeasureFn,
    n_cores: int,
    slo_ms: float | None = None,
    batches: Sequence[int] = DEFAULT_BATCHES,
    verify: VerifyFn | None = None,
    progress: ProgressFn | None = None,
    *,
    backends: Sequence[str] = BACKENDS,
    streams_backends: Sequence[str] = ("openvino",),
    drop_margin: float = 0.15,
    tie_margin: float = 0.05,
    **options: object,
) -> tuple[SearchResult, list[BackendScreen]]:
    """`quick_search` over the backend dimension: screen every backend on a few points, drop the ones
    clearly behind, search each remaining one, the one ahead at screening first (its points measured once:
    the screening's are reused),
    try OpenVINO streams on the best layouts of a backend that has them, and keep the measured best.
    Every returned layout names its backend; `verify(layout)` runs `layout.backend`."""
    batches = _check(n_cores, batches)
    progress = progress or _no_progress
    seen: dict[tuple[str, int, int], ProfilePoint] = {}
    counts = {"measured": 0, "verify": 0}

    def measured(backend: str, cores: int, batch: int) -> ProfilePoint:
        key = (backend, cores, batch)
        if key not in seen:
            seen[key] = measure(backend, cores, batch)
            counts["measured"] += 1
            progress(counts["measured"], counts["measured"] + 1, f"measured {backend} 1 × {cores} cores, batch {batch}")
        return seen[key]

    screens = screen_backends(measured, backends, n_cores, batches, drop_margin)
    kept = [s.backend for s in screening_order(screens) if not s.dropped]
    results: list[SearchResult] = []
    candidates: list[Candidate] = []
    measurements: list[ProfilePoint] = []
    for backend in kept:
        asked: dict[tuple[int, int], int] = {}

        def measure_one(cores: int, batch: int, backend: str = backend, asked: dict = asked) -> ProfilePoint:
            asked[(cores, batch)] = asked.get((cores, batch), 0) + 1
            if asked[(cores, batch)] > 1:  # the recorder asks again only to re-measure a point near the SLO
                counts["measured"] += 1
                return measure(backend, cores, batch)
            return measured(backend, cores, batch)

        verify_one = None if verify is None else (lambda layout, backend=backend: verify(layout.on(backend)))
        result = quick_search(measure_one, n_cores, slo_ms, batches, verify_one, progress, **options)  # type: ignore[arg-type]
        counts["verify"] += result.measured - sum(asked.values())
        results.append(result)
        candidates += [Candidate(c.layout.on(backend), c.predicted_rps, c.predicted_p99_ms, c.measured_rps,
                                 c.measured_p99_ms) for c in result.candidates]
        if verify is not None and backend in streams_backends and result.best is not None:
            for layout in streams_variants(result.best.layout.on(backend), max_batch=batches[-1]):
                rps, p99 = verify(layout)
                counts["verify"] += 1
                progress(counts["measured"] + counts["verify"], counts["measured"] + counts["verify"],
                         f"verified {layout}")
                candidates.append(Candidate(layout, math.nan, math.nan, rps, p99))
        measurements += result.measurements
    if verify is not None:
        candidates = _settle_backend_tie(candidates, slo_ms, verify, counts, tie_margin)
    feasible = sorted((c for c in candidates if c.measured_rps is not None and _meets(c.p99_ms, slo_ms)),
                      key=lambda c: -c.rps)
    if verify is None:
        feasible = sorted((c for c in candidates if _meets(c.p99_ms, slo_ms)), key=lambda c: -c.rps)
    rest = [c for c in candidates if c not in feasible]
    dropped = [s for s in screens if s.dropped]
    note = "; ".join([f"{s.backend} dropped after screening ({s.why})" for s in dropped]
                     + [r.note for r in results if r.note and not feasible])
    space = count_backend_layouts(n_cores, batches, backends, streams_backends)
    total = counts["measured"] + counts["verify"]
    return SearchResult(feasible[0] if feasible else None, feasible + rest, total, space, measurements, note), screens


def _settle_backend_tie(candidates: list[Candidate], slo_ms: float | None, verify: VerifyFn, counts: dict[str, int],
                        tie: float) -> list[Candidate]:
    """When the best layouts of two backends are within `tie` of each other (noise decides between them),
    run each twice more; the means of the three runs decide (each backend's search settled its own ties)."""
    best: dict[str | None, Candidate] = {}
    for c in candidates:
        if c.measured_rps is not None and _meets(c.p99_ms, slo_ms):
            if c.layout.backend not in best or c.rps > best[c.layout.backend].rps:
                best[c.layout.backend] = c
    top = sorted(best.values(), key=lambda c: -c.rps)[:2]
    if len(top) < 2 or top[1].rps < top[0].rps * (1.0 - tie):
        return candidates
    settled = {}
    for c in top:
        runs = [(c.rps, c.p99_ms)] + [verify(c.layout) for _ in range(2)]
        counts["verify"] += 2
        settled[id(c)] = Candidate(c.layout, c.predicted_rps, c.predicted_p99_ms,
                                   sum(r for r, _ in runs) / 3, sum(p for _, p in runs) / 3)
    return [settled.get(id(c), c) for c in candidates]
