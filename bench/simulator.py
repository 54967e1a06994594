"""A deterministic synthetic throughput/latency model of CPU inference, to test layout search.

One instance on ``c`` cores running ``k = min(threads, c)`` threads with max batch ``b``:

    one-core batch time  T1(b) = overhead_ms + b * sample_ms * (1 + cache_penalty * max(0, b/cache_batch - 1))
    batch latency        L(c, b) = T1(b) * (serial + (1 - serial) / k) + sync_ms * (k - 1)   (Amdahl + sync)
    alone                rps = 1000 * b / L,  p99 = 2 * L   (a request waits for the batch ahead, then its own)

Instances running together contend in two ways the single-instance profile cannot see:
- L3: each instance keeps its own copy of the weights; when the copies exceed ``l3_mb`` every
  instance slows by ``1 + l3_penalty * min(1, copies / l3_mb - 1)``;
- memory bandwidth: with total demand ``D`` (rps × MB per sample) against ``bandwidth_mb_s`` every
  instance slows by the smooth max ``(1 + (D / bandwidth)^4)^(1/4)``.
Two families mirror Cloud Reamer Fig. 5: *scale-up* (batching keeps paying, threads scale: one big
instance wins) and *scale-out* (cache misses grow with batch, threads sync: many small instances win).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from reamer.plan.layout import InstanceShape, Layout, format_layout
from reamer.plan.partition import ProfilePoint

FAMILIES = ("scale-up", "scale-out")


@dataclass(frozen=True)
class SyntheticModel:
    name: str
    overhead_ms: float  # per batch on one core: dispatch, weight loads
    sample_ms: float  # per sample on one core, in cache
    serial_fraction: float  # Amdahl
    sync_ms: float  # per batch per extra thread
    cache_batch: int  # batch beyond which activations spill out of cache
    cache_penalty: float
    mem_mb_per_sample: float
    weights_mb: float
    l3_penalty: float
    l3_mb: float = 32.0
    bandwidth_mb_s: float = 60_000.0
    noise: float = 0.0  # deterministic ± relative error per measured shape, as real profiles have

    def batch_latency_ms(self, cores: int, batch: int, threads: int | None = None) -> float:
        threads = cores if threads is None else threads
        k = min(threads, cores)
        spill = max(0.0, batch / self.cache_batch - 1.0)
        one_core = self.overhead_ms + batch * self.sample_ms * (1.0 + self.cache_penalty * spill)
        latency = one_core * (self.serial_fraction + (1.0 - self.serial_fraction) / k) + self.sync_ms * (k - 1)
        if threads > cores:  # oversubscribed threads time-share the cores
            latency *= threads / cores
        return latency * self._jitter(cores, batch, threads)

    def instance_alone(self, shape: InstanceShape) -> tuple[float, float]:
        """(throughput rps, p99 ms) of one instance alone."""
        latency = self.batch_latency_ms(shape.cores, shape.batch, shape.threads)
        return 1000.0 * shape.batch / latency, 2.0 * latency

    def profile(self, cores: int, batch: int) -> ProfilePoint:
        """A single-instance measurement, as the profiler would return it (threads = cores): the layout
        of that one instance (a wide instance alone can saturate memory bandwidth too)."""
        rps, p99 = self.run_layout(Layout((InstanceShape(cores, cores, batch),)))
        return ProfilePoint(cores=cores, batch=batch, throughput_rps=rps, p99_ms=p99)

    def run_layout(self, layout: Layout) -> tuple[float, float]:
        """(total throughput rps, worst p99 ms) with all instances of `layout` running together."""
        if not layout.instances:
            return 0.0, 0.0
        alone = [self.instance_alone(shape) for shape in layout.instances]
        copies = self.weights_mb * len(alone)
        slowdown = 1.0 + self.l3_penalty * min(1.0, max(0.0, copies / self.l3_mb - 1.0))
        demand = sum(rps for rps, _ in alone) / slowdown * self.mem_mb_per_sample
        slowdown *= (1.0 + (demand / self.bandwidth_mb_s) ** 4) ** 0.25
        return sum(rps for rps, _ in alone) / slowdown, max(p99 for _, p99 in alone) * slowdown

    def _jitter(self, cores: int, batch: int, threads: int) -> float:
        if not self.noise:
            return 1.0
        unit = zlib.crc32(f"{self.name}/{cores}/{batch}/{threads}".encode()) / 0xFFFFFFFF
        return 1.0 + self.noise * (2.0 * unit - 1.0)


def synthetic_model(family: str, noise: float = 0.0) -> SyntheticModel:
    """A model of one family: "scale-up" (DeepSpeech-like) or "scale-out" (ResNet-like)."""
    if family == "scale-up":
        return SyntheticModel(
            name="scale-up", overhead_ms=30.0, sample_ms=2.0, serial_fraction=0.02, sync_ms=0.05,
            cache_batch=64, cache_penalty=0.0, mem_mb_per_sample=4.0, weights_mb=24.0, l3_penalty=1.5,
            noise=noise,
        )
    if family == "scale-out":
        return SyntheticModel(
            name="scale-out", overhead_ms=3.0, sample_ms=6.0, serial_fraction=0.12, sync_ms=0.6,
            cache_batch=4, cache_penalty=0.12, mem_mb_per_sample=40.0, weights_mb=2.0, l3_penalty=0.3,
            noise=noise,
        )
    raise ValueError(f"unknown synthetic model family {family!r}; choose one of {', '.join(FAMILIES)}")


# --- a model calibrated from real single-instance profiles -------------------------------------------

def _interpolate_log2(table: dict[int, float], batch: int, hold_ends: bool = False) -> float:
    """Piece-wise linear in log2(batch) between measured batches; beyond the ends the last slope
    continues, or (`hold_ends`) the end value holds."""
    keys = sorted(table)
    if batch in table:
        return table[batch]
    if len(keys) == 1:
        return table[keys[0]]
    if hold_ends and (batch < keys[0] or batch > keys[-1]):
        return table[keys[0]] if batch < keys[0] else table[keys[-1]]
    x = math.log2(batch)
    if batch < keys[0]:
        lo, hi = keys[0], keys[1]
    elif batch > keys[-1]:
        lo, hi = keys[-2], keys[-1]
    else:
        lo = max(k for k in keys if k < batch)
        hi = min(k for k in keys if k > batch)
    x0, x1 = math.log2(lo), math.log2(hi)
    return table[lo] + (table[hi] - table[lo]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CalibratedModel:
    """Throughput/latency of one model on any core count, from real profiles on 1 and 2 cores.

    alone         L(c, b) = L1(b) * (f_b + (1 - f_b) / c)    Amdahl; f_b = 2 * L2(b) / L1(b) - 1 from the
                                                            measured 1- and 2-core batch latencies, in [0, 1]
                  rps = 1000 b / L,  p99 = r_b * L          r_b: measured p99 / mean batch latency
    together      instance i of a layout on C cores runs slower by s_i = 1 + 2 γ_b (C - c_i) / C, where
                  γ_b = alone/together - 1 (in [0, 1]) is the measured per-instance slowdown of two 1-core
                  instances on 2 cores (s = 1 + γ there). The share of the layout's cores held by
                  other instances stands in for the pressure they put on shared cache and memory; it
                  saturates at 1 + 2 γ (bandwidth-bound), and one instance alone sees none.
    Profiles from a shared machine carry other tenants' load, so `from_profiles` bounds them: the
    serial and parallel parts of the work (f_b L1, (1 - f_b) L1) and p99/latency never shrink as the
    batch grows, f_b ∈ [0, 1], γ ∈ [0, 1] (held constant beyond the measured batches).
    The profile (`profile`) sees only `alone`; `run_layout` sees `together`: the gap the quick search's
    verification step exists for. Extrapolating from 2 cores to 64 is an assumption, not a measurement.
    `noise` adds a deterministic ± relative error (keyed by `seed`) to every measurement, as real ones have
    (the n-th run of one layout gets the n-th error: running it again is a fresh measurement);
    `expected_layout` is the noise-free truth used to judge a search's pick.
    """

    name: str
    one_core_ms: dict[int, float]  # batch -> mean batch latency on 1 core
    serial: dict[int, float]  # batch -> Amdahl serial fraction
    p99_ratio: dict[int, float]  # batch -> p99 / mean batch latency
    contention: dict[int, float]  # batch -> γ
    noise: float = 0.0
    seed: int = 0
    # Runs of each layout so far: a re-run is a fresh measurement with its own (deterministic) error.
    _runs: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def from_profiles(cls, name: str, points: Iterable[ProfilePoint], contention: dict[int, float],
                      noise: float = 0.0, seed: int = 0) -> "CalibratedModel":
        """From measured single-instance points on 1 and 2 cores (2-core points optional: f_b = 1 then)
        and the measured γ per batch (together slowdown − 1; batches missing are interpolated)."""
        by_shape = {(p.cores, p.batch): p for p in points}
        one = {b: p for (c, b), p in by_shape.items() if c == 1}
        if not one:
            raise ValueError(f"{name}: the calibration needs 1-core profile points")
        mean_ms = {key: 1000.0 * p.batch / p.throughput_rps for key, p in by_shape.items()}
        # Sanity bounds, because profiles taken on a shared machine carry other people's load: a bigger
        # batch never finishes sooner than a smaller one, 2 cores are never slower than 1 (f_b ≤ 1),
        # and one co-runner at most serialises the pair (γ ≤ 1).
        # p99 likewise never falls as the batch grows.
        for cores in (1, 2):
            running = 0.0
            for b in sorted(b for c, b in mean_ms if c == cores):
                running = max(running, mean_ms[(cores, b)])
                mean_ms[(cores, b)] = running
        # Neither the serial nor the parallel part of the work shrinks as the batch grows, so the
        # latency on any core count rises with the batch.
        serial, ratio, running = {}, {}, 1.0
        one_core, serial_ms, parallel_ms = {}, 0.0, 0.0
        for b in sorted(one):
            two = mean_ms.get((2, b))
            f = min(1.0, max(0.0, 2.0 * two / mean_ms[(1, b)] - 1.0)) if two else 1.0
            serial_ms = max(serial_ms, f * mean_ms[(1, b)])
            parallel_ms = max(parallel_ms, (1.0 - f) * mean_ms[(1, b)])
            one_core[b] = serial_ms + parallel_ms
            serial[b] = serial_ms / one_core[b]
            ratios = [by_shape[(c, b)].p99_ms / mean_ms[(c, b)] for c in (1, 2) if (c, b) in by_shape]
            running = max(running, sum(ratios) / len(ratios))
            ratio[b] = running
        gammas = {b: min(1.0, max(0.0, g)) for b, g in contention.items()} or {1: 0.0}
        return cls(name, one_core, serial, ratio, gammas, noise, seed)

    def with_noise(self, noise: float, seed: int = 0) -> "CalibratedModel":
        return replace(self, noise=noise, seed=seed)

    def batch_latency_ms(self, cores: int, batch: int) -> float:
        f = min(1.0, max(0.0, _interpolate_log2(self.serial, batch)))
        one = max(1e-6, _interpolate_log2(self.one_core_ms, batch))
        return one * (f + (1.0 - f) / cores)

    def alone(self, cores: int, batch: int) -> tuple[float, float]:
        """Noise-free (throughput rps, p99 ms) of one instance alone."""
        latency = self.batch_latency_ms(cores, batch)
        return 1000.0 * batch / latency, max(1.0, _interpolate_log2(self.p99_ratio, batch)) * latency

    def slowdown(self, cores: int, batch: int, layout_cores: int) -> float:
        if layout_cores <= cores:
            return 1.0
        gamma = max(0.0, _interpolate_log2(self.contention, batch, hold_ends=True))
        return 1.0 + 2.0 * gamma * (layout_cores - cores) / layout_cores

    def profile(self, cores: int, batch: int) -> ProfilePoint:
        """A single-instance measurement (with noise), as the profiler would return it."""
        rps, p99 = self.alone(cores, batch)
        key = f"point/{cores}/{batch}"
        repeat = self._runs.get(key, 0)  # a re-measurement draws fresh noise, as a real one would
        self._runs[key] = repeat + 1
        jitter = self._jitter(key if repeat == 0 else f"{key}/{repeat}")
        return ProfilePoint(cores=cores, batch=batch, throughput_rps=rps / jitter, p99_ms=p99 * jitter)

    def expected_layout(self, layout: Layout) -> tuple[float, float]:
        """Noise-free (total rps, worst p99 ms) of `layout` with all instances running together."""
        if not layout.instances:
            return 0.0, 0.0
        total, worst, cores = 0.0, 0.0, layout.total_cores
        for shape in layout.instances:
            rps, p99 = self.alone(shape.cores, shape.batch)
            s = self.slowdown(shape.cores, shape.batch, cores)
            total, worst = total + rps / s, max(worst, p99 * s)
        return total, worst

    def run_layout(self, layout: Layout) -> tuple[float, float]:
        """A measurement of `layout` running together (with noise)."""
        rps, p99 = self.expected_layout(layout)
        key = "layout/" + format_layout(layout.canonical())
        repeat = self._runs.get(key, 0)
        self._runs[key] = repeat + 1
        jitter = self._jitter(key if repeat == 0 else f"{key}/{repeat}")
        return rps / jitter, p99 * jitter

    def best_layout(self, n_cores: int, slo_ms: float | None, batches: Sequence[int],
                    per_instance_batch: bool = False) -> tuple[Layout, float, float] | None:
        """The exhaustive search's answer, computed exactly: the noise-free best layout on exactly
        `n_cores` cores (every core used, as `count_layouts` counts them) whose p99 meets the SLO.

        `expected_layout` is separable when every core is used (s_i depends only on c_i, b_i and
        C = n_cores), so a knapsack over core counts is exact and replaces enumerating millions of
        layouts (64 cores: 10.4 M); tests check it against enumeration."""
        groups = [[b] for b in sorted(set(batches))] if not per_instance_batch else [sorted(set(batches))]
        best: tuple[Layout, float, float] | None = None
        for group in groups:
            items = []
            for c in range(1, n_cores + 1):
                for b in group:
                    rps, p99 = self.alone(c, b)
                    s = self.slowdown(c, b, n_cores)
                    if slo_ms is None or p99 * s <= slo_ms:
                        items.append((c, b, rps / s))
            value = [0.0] + [-math.inf] * n_cores
            choice: list[tuple[int, int] | None] = [None] * (n_cores + 1)
            for total in range(1, n_cores + 1):
                for c, b, v in items:
                    if c <= total and value[total - c] + v > value[total]:
                        value[total], choice[total] = value[total - c] + v, (c, b)
            if value[n_cores] == -math.inf:
                continue
            shapes, left = [], n_cores
            while left:
                c, b = choice[left]  # type: ignore[misc]
                shapes.append(InstanceShape(c, c, b))
                left -= c
            layout = Layout(tuple(shapes)).canonical()
            rps, p99 = self.expected_layout(layout)
            if best is None or rps > best[1]:
                best = (layout, rps, p99)
        return best

    def _jitter(self, key: str) -> float:
        if not self.noise:
            return 1.0
        unit = zlib.crc32(f"{self.name}/{self.seed}/{key}".encode()) / 0xFFFFFFFF
        return 1.0 + self.noise * (2.0 * unit - 1.0)


def calibrated_models(calibration: dict, noise: float = 0.0, seed: int = 0) -> dict[str, CalibratedModel]:
    """CalibratedModel per model of a bench/search_calibration.json document."""
    models = {}
    for name, entry in calibration.get("models", {}).items():
        points = [ProfilePoint(int(p["cores"]), int(p["batch"]), float(p["throughput_rps"]), float(p["p99_ms"]))
                  for p in entry.get("points", []) if p.get("throughput_rps", 0) > 0]
        gammas = {int(c["batch"]): 1.0 / c["factor"] - 1.0 for c in entry.get("contention", [])
                  if c.get("factor", 0) and c["factor"] > 0}
        if points:
            models[name] = CalibratedModel.from_profiles(name, points, gammas, noise, seed)
    return models


# --- one model on several backends (the backend as a search dimension) ------------------------------

@dataclass(frozen=True)
class CalibratedBackends:
    """One model on several backends, each a CalibratedModel from its own real profiles.

    A layout runs on `layout.backend`. An OpenVINO instance of c cores with s streams and batch b runs
    as s sub-instances of c/s cores at batch ⌈b/s⌉ inside one process, times the measured factor of one
    2-stream instance against two 1-core instances on the same 2 cores (`streams_factor`, per
    sub-instance batch; 1 where not measured): throughput × factor, p99 / factor. Each sub-instance
    contends with the rest of the layout as a c/s-core instance would."""

    name: str
    models: dict[str, CalibratedModel]
    streams_factor: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def backends(self) -> list[str]:
        return list(self.models)

    @property
    def noise(self) -> float:
        return next(iter(self.models.values())).noise

    def with_noise(self, noise: float, seed: int = 0) -> "CalibratedBackends":
        return replace(self, models={b: m.with_noise(noise, seed) for b, m in self.models.items()})

    def profile(self, backend: str, cores: int, batch: int) -> ProfilePoint:
        return self.models[backend].profile(cores, batch)

    def _factor(self, backend: str, batch: int) -> float:
        table = self.streams_factor.get(backend)
        return _interpolate_log2(table, batch, hold_ends=True) if table else 1.0

    def _shape(self, backend: str, shape: InstanceShape, layout_cores: int) -> tuple[float, float]:
        """(rps, p99) of one instance running with the rest of a layout on `layout_cores` cores."""
        model = self.models[backend]
        if shape.streams == 1:
            rps, p99 = model.alone(shape.cores, shape.batch)
            s = model.slowdown(shape.cores, shape.batch, layout_cores)
            return rps / s, p99 * s
        sub_cores = max(1, shape.cores // shape.streams)
        sub_batch = max(1, -(-shape.batch // shape.streams))
        rps, p99 = model.alone(sub_cores, sub_batch)
        s = model.slowdown(sub_cores, sub_batch, layout_cores)
        factor = self._factor(backend, sub_batch)
        return shape.streams * rps * factor / s, p99 * s / factor

    def expected_layout(self, layout: Layout) -> tuple[float, float]:
        backend = layout.backend or self.backends[0]
        total, worst = 0.0, 0.0
        for shape in layout.instances:
            rps, p99 = self._shape(backend, shape, layout.total_cores)
            total, worst = total + rps, max(worst, p99)
        return total, worst

    def run_layout(self, layout: Layout) -> tuple[float, float]:
        """A measurement of `layout` together, with the noise of its backend's model."""
        model = self.models[layout.backend or self.backends[0]]
        rps, p99 = self.expected_layout(layout)
        key = "layout/" + format_layout(layout.canonical())
        repeat = model._runs.get(key, 0)
        model._runs[key] = repeat + 1
        jitter = model._jitter(key if repeat == 0 else f"{key}/{repeat}")
        return rps / jitter, p99 * jitter

    def best_layout(self, n_cores: int, slo_ms: float | None, batches: Sequence[int],
                    streams_backends: Sequence[str] = ("openvino",)) -> tuple[Layout, float, float] | None:
        """The exhaustive answer over every backend: each backend's plain layouts (one batch for all
        instances), and on a backend with streams the layouts whose instances of 2+ cores run one stream
        per core; noise-free and exact (a knapsack over core counts, as CalibratedModel.best_layout)."""
        best: tuple[Layout, float, float] | None = None
        for backend in self.backends:
            for streams in ([False, True] if backend in streams_backends else [False]):
                for batch in sorted(set(batches)):
                    items = []
                    for c in range(1, n_cores + 1):
                        shape = InstanceShape(c, c, batch, c if streams and c > 1 else 1)
                        rps, p99 = self._shape(backend, shape, n_cores)
                        if slo_ms is None or p99 <= slo_ms:
                            items.append((shape, rps))
                    value = [0.0] + [-math.inf] * n_cores
                    choice: list[InstanceShape | None] = [None] * (n_cores + 1)
                    for total in range(1, n_cores + 1):
                        for shape, v in items:
                            if shape.cores <= total and value[total - shape.cores] + v > value[total]:
                                value[total], choice[total] = value[total - shape.cores] + v, shape
                    if value[n_cores] == -math.inf:
                        continue
                    shapes, left = [], n_cores
                    while left:
                        shape = choice[left]
                        assert shape is not None
                        shapes.append(shape)
                        left -= shape.cores
                    layout = Layout(tuple(shapes), backend).canonical()
                    rps, p99 = self.expected_layout(layout)
                    if best is None or rps > best[1]:
                        best = (layout, rps, p99)
        return best


def calibrated_backends(calibration: dict, noise: float = 0.0, seed: int = 0) -> dict[str, CalibratedBackends]:
    """CalibratedBackends per model that a bench/search_calibration.json document has on every backend
    (the top-level models are onnxruntime's; `backends.NAME.models` the others')."""
    per_backend = {"onnxruntime": calibrated_models(calibration, noise, seed)}
    factors: dict[str, dict[str, dict[int, float]]] = {}
    for backend, doc in calibration.get("backends", {}).items():
        per_backend[backend] = calibrated_models(doc, noise, seed)
        for name, entry in doc.get("models", {}).items():
            table = {int(s["batch"]): float(s["factor"]) for s in entry.get("streams", [])
                     if s.get("factor", 0) and s["factor"] > 0}
            factors.setdefault(name, {})[backend] = table
    names = set.intersection(*(set(m) for m in per_backend.values())) if per_backend else set()
    # each backend's noise its own: the same shape measured on two runtimes is two measurements
    return {name: CalibratedBackends(name, {b: replace(models[name], name=f"{name}@{b}")
                                            for b, models in per_backend.items()},
                                     factors.get(name, {})) for name in sorted(names)}
