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

import zlib
from dataclasses import dataclass

from reamer.plan.layout import InstanceShape, Layout
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
        """A single-instance measurement, as the profiler would return it (threads = cores)."""
        rps, p99 = self.instance_alone(InstanceShape(cores, cores, batch))
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
