"""Pure policy functions: complement rule, health state machine, eviction plan, latency model, faults."""
from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reamer.gpu.config import GpuConfig, HealthThresholds
from reamer.gpu.errors import GpuConfigError, LatencyModelError
from reamer.gpu.policies import (
    HealthMetrics,
    HealthState,
    HealthStatus,
    PiecewiseLinear,
    complement_plan,
    complement_share,
    detect_fault,
    eviction_plan,
    fit_piecewise_linear,
    overlimit_hold_s,
    sm_budget_problem,
    smallest_share,
    step_health,
)

TH = HealthThresholds(overlimit_hold_s=10, overlimit_hold_max_s=1000, overlimit_window_s=7200)
CALM = HealthMetrics(util_pct=10, mem_pct=10, sm_clock_pct=100)
BUSY = HealthMetrics(util_pct=92, mem_pct=10, sm_clock_pct=100)  # unhealthy
BAND = HealthMetrics(util_pct=85, mem_pct=10, sm_clock_pct=100)  # between healthy and unhealthy
HOT = HealthMetrics(util_pct=99, mem_pct=10, sm_clock_pct=100)  # overlimit
SLOW_CLOCK = HealthMetrics(util_pct=10, mem_pct=10, sm_clock_pct=50)  # clock dropped: overlimit

pct = st.floats(min_value=0, max_value=100, allow_nan=False)


# ------------------------------------------------------------------ complement rule


def test_complement_examples():
    assert complement_share(30, headroom_pct=10, floor_pct=10) == 60
    assert complement_share(95, headroom_pct=10, floor_pct=10) == 10  # Mudi floor for training
    plan = complement_plan(30, n_offline=2)
    assert (plan.online_pct, plan.offline_pct_each, plan.feasible) == (40, 30, True)
    squeezed = complement_plan(75, n_offline=2)
    assert squeezed.feasible and squeezed.offline_pct_each == 10 and squeezed.online_pct == 80
    bad = complement_plan(90, n_offline=3)
    assert not bad.feasible and "fewer training jobs" in bad.reason


@given(pred=pct, headroom=st.integers(0, 50), floor=st.integers(1, 50))
def test_complement_share_bounds(pred, headroom, floor):
    share = complement_share(pred, headroom, floor)
    assert floor <= share <= 100
    assert share == floor or share <= 100 - pred - headroom + 1e-9


@given(pred=pct, n=st.integers(1, 6), headroom=st.integers(0, 30), margin=st.integers(0, 30),
       floor=st.integers(1, 30))
def test_complement_plan_invariants(pred, n, headroom, margin, floor):
    plan = complement_plan(pred, n, headroom, margin, floor)
    assert plan.offline_pct_each >= floor  # training keeps its floor
    assert plan.online_pct >= min(100, max(1, int(pred)))  # never below the predicted online activity
    if plan.feasible:
        assert plan.total_pct <= 100
    else:
        assert plan.reason


def test_sm_budget_problem():
    assert sm_budget_problem({"a": 60}, "b", 40, "0") is None
    msg = sm_budget_problem({"a": 60, "c": 30}, "b", 20, "0")
    assert "110%" in msg and "10% is free" in msg
    assert sm_budget_problem({"a": 60, "b": 90}, "b", 40, "0") is None  # b's old share is replaced


# ------------------------------------------------------------------ health state machine


def run(metrics_at: list[tuple[float, HealthMetrics]], start: HealthStatus | None = None) -> list[HealthState]:
    s = start or HealthStatus()
    out = []
    for t, m in metrics_at:
        s = step_health(s, m, TH, t)
        out.append(s.state)
    return out


def test_health_transitions():
    assert run([(0, CALM)]) == [HealthState.HEALTHY]
    assert run([(0, CALM), (1, BUSY), (2, BAND), (3, CALM)]) == [
        HealthState.HEALTHY, HealthState.UNHEALTHY, HealthState.UNHEALTHY, HealthState.HEALTHY]
    assert run([(0, CALM), (1, BAND)]) == [HealthState.HEALTHY, HealthState.HEALTHY]  # hysteresis band
    assert run([(0, SLOW_CLOCK)]) == [HealthState.OVERLIMIT]
    # Overlimit holds for 10 s below the Overlimit thresholds, then Unhealthy, then Healthy.
    states = run([(0, HOT), (1, CALM), (10, CALM), (11, CALM), (12, CALM)])
    assert states == [HealthState.OVERLIMIT, HealthState.OVERLIMIT, HealthState.OVERLIMIT,
                      HealthState.UNHEALTHY, HealthState.HEALTHY]
    # A hot sample during the hold restarts it.
    states = run([(0, HOT), (1, CALM), (5, HOT), (12, CALM), (21, CALM), (22, CALM)])
    assert states[-3:] == [HealthState.OVERLIMIT, HealthState.OVERLIMIT, HealthState.UNHEALTHY]


def test_overlimit_hold_doubles_with_recent_entries():
    assert [overlimit_hold_s(k, TH) for k in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert overlimit_hold_s(50, TH) == 1000  # capped
    s = HealthStatus()
    t = 0.0
    holds = []
    for _ in range(3):
        s = step_health(s, HOT, TH, t)
        entered = t
        t += 1
        s = step_health(s, CALM, TH, t)
        while s.state is HealthState.OVERLIMIT:
            t += 1
            s = step_health(s, CALM, TH, t)
        holds.append(t - entered - 1)  # from the first calm sample to leaving
        t += 1
    assert holds == [10, 20, 40]
    # Entries older than the window no longer count.
    s = step_health(s, HOT, TH, t + 10_000)
    assert len(s.overlimit_entries) == 1


def test_unavailable_gpu_is_disabled_then_starts_over():
    s = step_health(HealthStatus(HealthState.HEALTHY), CALM, TH, 0, available=False)
    assert s.state is HealthState.DISABLED and not s.admits_offline()
    assert step_health(s, CALM, TH, 1).state is HealthState.HEALTHY
    assert step_health(HealthStatus(), None, TH, 0).state is HealthState.INIT  # no sample: no change


metrics = st.builds(HealthMetrics, util_pct=st.none() | pct, mem_pct=st.none() | pct, sm_clock_pct=st.none() | pct)


@settings(max_examples=100, deadline=None)
@given(seq=st.lists(st.tuples(st.floats(0, 100, allow_nan=False), metrics), max_size=30))
def test_health_invariants(seq):
    s = HealthStatus()
    t = 0.0
    for dt, m in seq:
        t += dt
        prev = s
        s = step_health(s, m, TH, t)
        levels = {"over": (m.util_pct is not None and m.util_pct >= TH.util_overlimit_at)
                  or (m.mem_pct is not None and m.mem_pct >= TH.mem_overlimit_at)
                  or (m.sm_clock_pct is not None and m.sm_clock_pct <= TH.sm_clock_overlimit_at)}
        if levels["over"]:
            assert s.state is HealthState.OVERLIMIT  # any overlimit metric -> Overlimit at once
        assert s.admits_offline() == (s.state is HealthState.HEALTHY)
        assert s.must_evict_offline() == (s.state is HealthState.OVERLIMIT)
        # Overlimit is never left straight for Healthy.
        if prev.state is HealthState.OVERLIMIT:
            assert s.state in (HealthState.OVERLIMIT, HealthState.UNHEALTHY)


def test_threshold_order_is_validated():
    with pytest.raises(GpuConfigError, match="sm_clock thresholds"):
        GpuConfig.from_dict({"policies": {"health_thresholds": {"sm_clock_unhealthy_at": 90}}})


# ------------------------------------------------------------------ eviction plan


def test_eviction_plan_order():
    steps = eviction_plan([7, 3, 7], server_pid=100, grace_s=5, kill_after_s=2)
    assert [s.describe() for s in steps] == [
        "send SIGTERM to 3", "send SIGTERM to 7", "wait up to 5s for exit",
        "terminate_client 100 3", "terminate_client 100 7", "wait up to 2s for exit",
        "send SIGKILL to 3", "send SIGKILL to 7"]
    no_server = eviction_plan([3], None, 5, 2)
    assert [s.action for s in no_server] == ["signal", "wait", "signal"]
    assert no_server[-1].signal == signal.SIGKILL
    assert eviction_plan([], 1, 1, 1) == []
    # terminate_client only for the server's clients (a job may list a non-CUDA launcher too)
    only = eviction_plan([3, 7], 100, 5, 2, clients=[7, 9])
    assert [s.describe() for s in only if s.action == "terminate_client"] == ["terminate_client 100 7"]
    assert [s.action for s in eviction_plan([3], 100, 5, 2, clients=[])] == ["signal", "wait", "signal"]


# ------------------------------------------------------------------ latency model (Mudi)


def test_fit_recovers_a_knee_from_six_samples():
    truth = PiecewiseLinear(x0=40, y0=20, slope_left=-2.0, slope_right=-0.1)
    xs = [10, 20, 30, 40, 50, 60]
    model = fit_piecewise_linear(xs, [truth.predict(x) for x in xs])
    assert model.x0 == pytest.approx(40) and model.slope_left == pytest.approx(-2.0)
    assert model.slope_right == pytest.approx(-0.1, abs=1e-6) and model.sse < 1e-9
    choice = smallest_share(model, slo_ms=30.5, margin_pct=10)
    assert (choice.base_pct, choice.share_pct) == (35, 45)
    assert choice.predicted_p99_ms <= 30.5


@settings(max_examples=60, deadline=None)
@given(x0=st.integers(15, 75), y0=st.floats(5, 100), k1=st.floats(-5, -0.5), k2=st.floats(-0.4, 0.4))
def test_fit_recovers_exact_piecewise_data(x0, y0, k1, k2):
    truth = PiecewiseLinear(x0, y0, k1, k2)
    xs = list(range(10, 91, 10))
    model = fit_piecewise_linear(xs, [truth.predict(x) for x in xs])
    for x in xs:
        assert model.predict(x) == pytest.approx(truth.predict(x), abs=1e-6)


@given(noise=st.lists(st.floats(-1, 1), min_size=9, max_size=9))
def test_fit_is_never_worse_than_the_true_breakpoint(noise):
    truth = PiecewiseLinear(40, 20, -2.0, -0.1)
    xs = list(range(10, 91, 10))
    ys = [truth.predict(x) + e for x, e in zip(xs, noise)]
    model = fit_piecewise_linear(xs, ys)
    sse_truth = sum((truth.predict(x) - y) ** 2 for x, y in zip(xs, ys))
    assert model.sse <= sse_truth + 1e-9  # least squares over a search that includes x0=40


@given(slo_a=st.floats(1, 200), slo_b=st.floats(1, 200))
def test_smallest_share_is_monotone_in_slo(slo_a, slo_b):
    model = PiecewiseLinear(40, 20, -2.0, -0.1)
    lo, hi = sorted((slo_a, slo_b))

    def share(slo):
        try:
            return smallest_share(model, slo, margin_pct=10).share_pct
        except LatencyModelError:
            return 101

    assert share(hi) <= share(lo)  # a looser SLO never needs more GPU


def test_latency_model_bad_input():
    with pytest.raises(LatencyModelError, match="3 or more distinct"):
        fit_piecewise_linear([10, 10, 20], [1, 2, 3])
    with pytest.raises(LatencyModelError, match="one p99 value"):
        fit_piecewise_linear([10, 20, 30], [1, 2])
    with pytest.raises(LatencyModelError, match="NaN"):
        fit_piecewise_linear([10, 20, 30], [1, float("nan"), 3])
    with pytest.raises(LatencyModelError, match="no GPU share") as exc:
        smallest_share(PiecewiseLinear(40, 20, -2, -0.1), slo_ms=5)
    assert exc.value.fix


# ------------------------------------------------------------------ faults


def test_detect_fault():
    assert not detect_fault({10: "ACTIVE"}, []).faulted
    r = detect_fault({10: "ACTIVE", 11: "FAULT"}, [31, 999])
    assert r.faulted and r.reasons == ("MPS server 11 is FAULT", "XID 31")
    assert not detect_fault({}, [999]).faulted  # unknown/non-fatal XIDs alone do not trigger
    assert not detect_fault({12: "UNKNOWN", 13: "Server 13 ACTIVE"}, []).faulted
