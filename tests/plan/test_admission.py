import pytest

from reamer.plan.admission import admit, batch_latency_target_ms
from reamer.plan.layout import parse_layout
from reamer.plan.partition import Candidate


def candidate(rps, p99, measured_rps=None, measured_p99=None):
    return Candidate(parse_layout("2x1:b4"), rps, p99, measured_rps, measured_p99)


def test_accepts_with_margin():
    decision = admit(candidate(100.0, 20.0), rate_rps=90.0, slo_ms=50.0, margin=0.10)
    assert decision.accepted
    assert decision.achievable_rps == pytest.approx(90.0)
    assert "2x1:b4" in decision.reason


def test_refuses_when_rate_exceeds_capacity_after_margin():
    decision = admit(candidate(100.0, 20.0), rate_rps=91.0, slo_ms=50.0, margin=0.10)
    assert not decision.accepted
    assert decision.achievable_rps == pytest.approx(90.0)
    assert "90.0 rps" in decision.reason
    for remedy in ("another node", "lower the rate", "free cores"):
        assert remedy in decision.reason


def test_refuses_when_p99_misses_slo():
    decision = admit(candidate(1000.0, 60.0), rate_rps=10.0, slo_ms=50.0)
    assert not decision.accepted
    assert "60.0 ms" in decision.reason and "50 ms" in decision.reason


def test_batch_latency_gets_half_the_slo():
    # a request may wait for the batch before its own: a batch p99 of 30 ms meets a 60 ms SLO, not a 50 ms one
    assert batch_latency_target_ms(60.0) == pytest.approx(30.0) and batch_latency_target_ms(None) is None
    assert admit(candidate(1000.0, 30.0), rate_rps=10.0, slo_ms=60.0).accepted
    decision = admit(candidate(1000.0, 30.0), rate_rps=10.0, slo_ms=50.0)
    assert not decision.accepted
    assert "batch p99 30.0 ms, over 25 ms (half the 50 ms SLO" in decision.reason


def test_measured_figures_win_over_predictions():
    optimistic = candidate(200.0, 20.0, measured_rps=100.0, measured_p99=30.0)
    assert not admit(optimistic, rate_rps=150.0, slo_ms=50.0).accepted
    assert admit(optimistic, rate_rps=80.0, slo_ms=60.0).accepted
    assert not admit(optimistic, rate_rps=80.0, slo_ms=50.0).accepted  # its measured 30 ms is over half of 50


def test_no_layout_is_a_refusal_with_zero_capacity():
    decision = admit(None, rate_rps=1.0, slo_ms=10.0)
    assert not decision.accepted and decision.achievable_rps == 0.0
    assert "free cores" in decision.reason


def test_bad_arguments():
    with pytest.raises(ValueError):
        admit(candidate(1, 1), 1, 10, margin=1.0)
    with pytest.raises(ValueError):
        admit(candidate(1, 1), 1, 0)


def test_a_layout_of_long_batches_is_judged_by_the_rate_it_sustains_open_loop():
    # batches of 8 take 400 ms (half a 1 s SLO, minus the spread): closed loop it carries 20 rps, but a request
    # may wait for a running batch, then for its own, so open-loop arrivals see far less within the SLO
    from reamer.plan.online_sim import with_sustained

    slow = with_sustained(Candidate(parse_layout("1x2:b8"), 20.0, 450.0, 20.0, 450.0), 1000.0, [])
    assert slow.sustained_rps is not None and slow.sustained_rps < 0.85 * 20.0
    old_rule = admit(Candidate(parse_layout("1x2:b8"), 20.0, 450.0, 20.0, 450.0), 17.0, 1000.0)
    assert old_rule.accepted  # the closed-loop throughput alone would take it
    decision = admit(slow, 17.0, 1000.0)
    assert not decision.accepted
    assert decision.achievable_rps == pytest.approx(slow.sustained_rps)
    assert f"can carry {slow.sustained_rps:.1f} rps" in decision.reason
    assert "sustains under the SLO, simulated from its 20.0 rps closed loop" in decision.reason
    # short batches: it sustains above its throughput less the margin, and that still decides
    quick = with_sustained(Candidate(parse_layout("2x1:b1"), 20.0, 110.0, 20.0, 110.0), 1000.0, [])
    assert quick.sustained_rps is not None and quick.sustained_rps > 0.9 * 20.0
    decision = admit(quick, 17.0, 1000.0)
    assert decision.accepted and decision.achievable_rps == pytest.approx(18.0) and "10% margin" in decision.reason
