"""One definition of each latency statistic (reamer.plan.statistics): the job's /stats, the load generator, the
profiler, the online simulation and the demo give the same p50 and p99, and the job and the load generator the
same SLO attainment, on the same latencies."""
from __future__ import annotations

import math
import statistics as stdlib_statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reamer.plan.statistics import p50, p99, percentile, slo_attainment

LATENCIES_MS = [float(v) for v in range(1, 151)]  # 150 values: the 99th percentile falls between two of them


def test_a_percentile_interpolates_between_the_two_nearest_values():
    # position 0.99 × 149 = 147.51 in the sorted list (0-based): 148 + 0.51 × (149 − 148)
    assert p99(LATENCIES_MS) == pytest.approx(148.51)
    assert p50([1.0, 2.0, 3.0, 10.0]) == 2.5  # the mean of the middle two
    assert percentile([5.0], 99) == 5.0
    assert percentile(np.array([3.0, 1.0, 2.0]), 0) == 1.0 and percentile((3.0, 1.0, 2.0), 100) == 3.0


def test_no_values_have_no_percentile():
    assert math.isnan(p99([])) and math.isnan(p50(np.array([]))) and math.isnan(percentile(iter(()), 90))


@settings(deadline=None)  # a loaded machine must not fail it
@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=300))
def test_the_median_is_the_standard_librarys_and_the_p99_lies_within_the_values(values):
    assert p50(values) == pytest.approx(stdlib_statistics.median(values), abs=1e-6)
    assert min(values) <= p99(values) <= max(values)
    assert p99(values) >= p50(values) - 1e-9


def test_the_jobs_stats_the_load_generator_the_profiler_and_the_demo_agree():
    from reamer.cli.demo_cmd import percentile as demo_percentile
    from reamer.serve.measure.loadgen import LoadResult, RequestRecord
    from reamer.serve.measure.profiler import p99 as profiler_p99
    from reamer.serve.measure.stats import RequestStats

    job = RequestStats(slo_ms=None, window_s=1e9)
    for ms in LATENCIES_MS:
        job.record(ms / 1000.0, now=1.0)
    snap = job.snapshot(now=1.0)
    assert snap.p99_ms == pytest.approx(p99(LATENCIES_MS)) and snap.p50_ms == pytest.approx(p50(LATENCIES_MS))
    load = LoadResult("http://job", 150.0, 1.0, [RequestRecord(0.0, ms, "ok") for ms in LATENCIES_MS])
    assert load.p99_ms == pytest.approx(p99(LATENCIES_MS))
    assert profiler_p99(LATENCIES_MS) == p99(LATENCIES_MS)
    assert demo_percentile(LATENCIES_MS, 99) == p99(LATENCIES_MS)


def test_the_online_simulation_judges_its_latencies_by_the_same_p99(monkeypatch):
    from reamer.plan import online_sim

    seen = []

    def recording_p99(values):
        seen.append(list(values))
        return p99(values)

    monkeypatch.setattr(online_sim, "p99", recording_p99)
    inst = online_sim.SimInstance(max_batch=1, latency_s=(0.01,), sigma=0.3)
    got = online_sim.simulate_p99_s([inst], 50.0, 1.0, requests=500)
    assert len(seen) == 1 and len(seen[0]) == 450 and got == p99(seen[0])


def test_slo_attainment_counts_every_unanswered_arrival_as_a_miss_in_the_job_and_the_load_generator():
    from reamer.serve.measure.loadgen import LoadResult, RequestRecord
    from reamer.serve.measure.stats import RequestStats

    answered = [10.0, 20.0, 30.0, 40.0]  # ms; SLO 25 ms: two within
    assert slo_attainment(answered, 25.0, arrivals=5) == pytest.approx(2 / 5)  # one more arrival was refused
    assert slo_attainment(np.array(answered), 40.0, arrivals=4) == 1.0  # within means at most the SLO
    assert math.isnan(slo_attainment([], 25.0, arrivals=0))
    job = RequestStats(slo_ms=25.0, window_s=1e9)
    for ms in answered:
        job.record(ms / 1000.0, now=1.0)
    job.record_shed(now=1.0)
    assert job.snapshot(now=1.0).slo_attainment == pytest.approx(2 / 5)
    load = LoadResult("http://job", 5.0, 1.0, [RequestRecord(0.0, ms, "ok") for ms in answered]
                      + [RequestRecord(0.0, 1.0, "shed")])
    assert load.slo_attainment(25.0) == pytest.approx(2 / 5)
