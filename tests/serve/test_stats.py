import pytest

from reamer.serve.measure.stats import DoorLoad, FrontDoorLoad, OverloadDetector, RequestStats


def test_percentiles_rate_and_attainment_over_window():
    s = RequestStats(slo_ms=50.0, window_s=10.0)
    s._started = 0.0
    for i in range(90):
        s.record(0.010, now=1.0 + i * 0.01)
    for i in range(10):
        s.record(0.100, now=2.0 + i * 0.01)
    s.record_shed(now=2.5)
    snap = s.snapshot(now=3.0)
    assert snap.requests == 100 and snap.shed == 1
    assert snap.p50_ms == pytest.approx(10.0)
    assert snap.p99_ms == pytest.approx(100.0)
    assert snap.slo_attainment == pytest.approx(90 / 101)
    assert snap.rate_rps == pytest.approx(101 / 3.0)


def test_old_requests_leave_the_window():
    s = RequestStats(slo_ms=None, window_s=5.0)
    s._started = 0.0
    s.record(0.5, now=1.0)
    s.record(0.001, now=20.0)
    snap = s.snapshot(now=20.0)
    assert snap.p99_ms == pytest.approx(1.0)
    assert snap.requests == 2  # totals keep counting
    assert snap.slo_attainment is None
    assert s.snapshot(now=100.0).p50_ms is None


def test_overload_fires_once_after_sustained_excess_and_rearms():
    d = OverloadDetector(admitted_rps=10.0, sustain_s=3.0, min_interval_s=30.0)
    assert not d.observe(50.0, now=0.0)
    assert not d.observe(50.0, now=2.0)
    assert d.observe(50.0, now=3.5)
    fired = [d.observe(50.0, now=4.0 + t) for t in range(60)]
    assert not any(fired)  # one event for one long overload
    assert not d.observe(5.0, now=70.0)
    assert not d.observe(50.0, now=71.0)
    assert d.observe(50.0, now=74.5)


def test_brief_spikes_and_no_admitted_rate_do_not_fire():
    d = OverloadDetector(admitted_rps=10.0, sustain_s=3.0)
    for t in range(10):
        assert not d.observe(50.0 if t % 2 else 1.0, now=float(t))
    assert not OverloadDetector(None).observe(1e9, now=100.0)


def test_front_door_load_is_cpu_over_the_window_in_all_and_per_request():
    load = FrontDoorLoad(window_s=10.0)
    assert load.update(0.0, 5.0, 100) == DoorLoad(None, None)
    first = load.update(2.0, 6.0, 150)  # 1 cpu s in 2 s over 50 requests
    assert first == DoorLoad(0.5, 20.0)
    assert load.update(4.0, 6.0, 150) == DoorLoad(0.25, 20.0)  # idle since: the window still holds the work
    later = load.update(20.0, 6.1, 150)  # the old samples left the window; no request in it
    assert later.busy is not None and later.busy < 0.1 and later.cpu_ms is None


def test_front_door_saturation_is_reported_once_until_it_clears():
    load = FrontDoorLoad()
    busy = [0.3, 0.85, 0.9, 0.7, 0.6, 0.4, 0.95]
    fired = [load.newly_saturated(DoorLoad(b, 10.0)) for b in busy]
    assert fired == [False, True, False, False, False, False, True]
    assert not load.newly_saturated(DoorLoad(None, None))
    assert not FrontDoorLoad().newly_saturated(DoorLoad(0.95, None))  # busy without requests: starting up
