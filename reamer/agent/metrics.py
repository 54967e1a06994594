"""Prometheus metrics of the agent: one registry, values read from the agent at scrape time."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from reamer.agent.service import Agent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _number(value: object) -> float | None:
    """A finite float of a job's reported value, else None (a job's status is its user's to write; the agent
    checks it on reading, this keeps a scrape from failing whatever got through)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) else None


class AgentCollector:
    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        snap = self.agent.snapshot()
        jobs = GaugeMetricFamily("reamer_training_jobs", "Training jobs pinned by the agent")
        jobs.add_metric([], len(snap["training"]))
        yield jobs
        rr = GaugeMetricFamily("reamer_training_rt_threads", "Threads of a training job running SCHED_RR", labels=["job"])
        threads = GaugeMetricFamily("reamer_training_threads", "Threads of a training job", labels=["job"])
        for name, state in snap["training"].items():
            rr.add_metric([name], state.threads_rr)
            threads.add_metric([name], state.threads)
        yield rr
        yield threads
        cpus = GaugeMetricFamily("reamer_cpus", "CPUs by use", labels=["use"])
        cpus.add_metric(["idle"], snap["idle_cpus"])
        cpus.add_metric(["training"], snap["training_cpus"])
        yield cpus
        states = GaugeMetricFamily("reamer_inference_job_up", "1 per inference job, labelled with its state",
                                   labels=["job", "state"])
        rate = GaugeMetricFamily("reamer_inference_rate_rps", "Request rate of an online job", labels=["job"])
        p99 = GaugeMetricFamily("reamer_inference_p99_ms", "p99 latency of an online job", labels=["job"])
        attain = GaugeMetricFamily("reamer_inference_slo_attainment", "Fraction of requests within the SLO",
                                   labels=["job"])
        done = GaugeMetricFamily("reamer_inference_done", "Inputs finished by an offline job", labels=["job"])
        door = GaugeMetricFamily("reamer_inference_frontdoor_busy", "CPUs used by an online job's front door "
                                 "process over the last 10 s (near 1 it limits the job's rate)", labels=["job"])
        for name, (state, status) in snap["inference"].items():
            states.add_metric([name, state], 1)
            if status is None:
                continue
            rate.add_metric([name], _number(status.rate_rps) or 0.0)
            for family, value in ((p99, status.p99_ms), (attain, status.slo_attainment),
                                  (door, status.frontdoor_busy)):
                if _number(value) is not None:
                    family.add_metric([name], _number(value))
            done.add_metric([name], _number(status.done) or 0)
        yield from (states, rate, p99, attain, done, door)
        count, size = self.agent.store.event_totals()
        kept = GaugeMetricFamily("reamer_event_log_events", "Events kept in the agent's event log (events.max_count)")
        kept.add_metric([], count)
        held = GaugeMetricFamily("reamer_event_log_bytes", "Bytes of the kept events (events.max_mb)")
        held.add_metric([], size)
        yield from (kept, held)


class AgentMetrics:
    """The registry plus the reconcile-duration histogram the agent feeds."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
        self.registry = CollectorRegistry()
        self.registry.register(AgentCollector(agent))
        self.reconcile_seconds = Histogram("reamer_reconcile_duration_seconds", "Duration of one reconcile pass",
                                           registry=self.registry,
                                           buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        agent.on_reconcile.append(self.reconcile_seconds.observe)
        self._gpu_collector = None
        gpu = agent.gpu  # the GPU side's metrics are the agent's: one registry, one scrape
        if gpu is not None and hasattr(gpu, "collector"):
            self._gpu_collector = gpu.collector()
            self.registry.register(self._gpu_collector)

    def render(self) -> bytes:
        try:
            return generate_latest(self.registry)
        except Exception:  # noqa: BLE001 - a failing GPU collector must not take the agent's metrics down
            if self._gpu_collector is None:
                raise
            self.registry.unregister(self._gpu_collector)
            return generate_latest(self.registry)
