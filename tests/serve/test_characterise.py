import logging
import os

import pytest

from reamer.host.errors import ReamerError
from reamer.host.perf import CounterSample, PerfSupport, probe_perf
from reamer.plan.partition import ProfilePoint
from reamer.serve.measure import characterise as ch
from reamer.serve.measure.characterise import (BatchCounters, characterise, classify_from_counters,
                                       classify_from_scaling)
from reamer.serve.models import build_model

CPUS = sorted(os.sched_getaffinity(0))
FAST = {"warmup_s": 0.1, "window_s": 0.15, "max_windows": 4}


def counters(rows):
    return [BatchCounters(b, ipc, miss) for b, ipc, miss in rows]


def test_stable_misses_and_rising_ipc_is_scale_up():
    result, evidence = classify_from_counters(counters([(1, 1.0, 0.05), (4, 1.4, 0.051), (16, 1.9, 0.052)]))
    assert result == "scale-up"
    assert any("IPC +90%" in e for e in evidence)
    assert evidence[-1].startswith("scale-up")


def test_rising_misses_and_flat_or_falling_ipc_is_scale_out():
    assert classify_from_counters(counters([(1, 1.5, 0.05), (8, 1.52, 0.09)]))[0] == "scale-out"
    assert classify_from_counters(counters([(1, 1.5, 0.05), (8, 1.1, 0.20)]))[0] == "scale-out"


def test_mixed_counter_cases():
    # both rise: whichever rises faster decides
    assert classify_from_counters(counters([(1, 1.0, 0.10), (8, 2.0, 0.12 * 1.1)]))[0] == "scale-up"
    assert classify_from_counters(counters([(1, 1.0, 0.10), (8, 1.1, 0.30)]))[0] == "scale-out"
    # nothing changes: scale-out
    assert classify_from_counters(counters([(1, 1.0, 0.10), (8, 1.0, 0.10)]))[0] == "scale-out"
    # order of input does not matter
    assert classify_from_counters(counters([(16, 1.9, 0.05), (1, 1.0, 0.05)]))[0] == "scale-up"


def test_counter_rule_needs_two_batches():
    with pytest.raises(ReamerError, match="two batch sizes"):
        classify_from_counters(counters([(4, 1.0, 0.1), (4, 2.0, 0.1)]))


def test_scaling_rule_thresholds():
    good = [ProfilePoint(1, 1, 100, 1), ProfilePoint(4, 1, 360, 1), ProfilePoint(1, 8, 200, 1), ProfilePoint(4, 8, 700, 1)]
    result, evidence = classify_from_scaling(good)  # efficiencies 0.90 and 0.875
    assert result == "scale-up"
    assert "efficiency 90%" in evidence[0]
    poor = [ProfilePoint(1, 1, 100, 1), ProfilePoint(4, 1, 200, 1), ProfilePoint(1, 8, 200, 1), ProfilePoint(4, 8, 600, 1)]
    assert classify_from_scaling(poor)[0] == "scale-out"  # efficiencies 0.5 and 0.75
    # exactly at the threshold counts as scale-up
    assert classify_from_scaling([ProfilePoint(1, 2, 100, 1), ProfilePoint(2, 2, 160, 1)])[0] == "scale-up"
    assert classify_from_scaling([ProfilePoint(1, 2, 100, 1), ProfilePoint(2, 2, 159, 1)])[0] == "scale-out"


def test_scaling_rule_uses_the_widest_point_and_skips_unpaired_batches():
    pts = [ProfilePoint(1, 1, 100, 1), ProfilePoint(2, 1, 195, 1), ProfilePoint(8, 1, 300, 1), ProfilePoint(8, 4, 900, 1)]
    result, evidence = classify_from_scaling(pts)
    assert result == "scale-out"  # 300/100/8 = 37.5 %
    assert len([e for e in evidence if e.startswith("batch")]) == 1


def test_scaling_rule_needs_pairs():
    with pytest.raises(ReamerError, match="1-core point"):
        classify_from_scaling([ProfilePoint(2, 1, 100, 1)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("char") / "tiny.onnx").path


def test_without_counters_falls_back_to_scaling_and_says_so_once(tiny, caplog, monkeypatch):
    if len(CPUS) < 2:
        pytest.skip("needs 2 cpus to measure scaling")
    support = probe_perf()
    if support.supported:
        support = PerfSupport(False, 2, "forced off for this test")
    monkeypatch.setattr(ch, "_warned_no_counters", False)
    kw = dict(cpus=CPUS[:2], batches=(2,), probe=lambda: support, **FAST)
    with caplog.at_level(logging.WARNING, logger="reamer.serve.measure.characterise"):
        first = characterise(tiny, "onnxruntime", **kw)
        second = characterise(tiny, "onnxruntime", **kw)
    assert first.counters_available is False and first.counters == []
    assert first.counters_reason == support.reason
    assert f"errno {support.errno}" in first.evidence[0]
    assert first.classification in ("scale-up", "scale-out")
    assert sorted((p.cores, p.batch) for p in first.points) == [(1, 2), (2, 2)]
    expected, _ = classify_from_scaling(first.points)
    assert first.classification == expected
    assert second.points and len([r for r in caplog.records if "counters unavailable" in r.message]) == 1


def test_with_counters_measures_a_wide_instance_per_batch(tiny):
    seen = []
    script = {2: CounterSample(1.0, 0.05, 1000, 1000, False), 8: CounterSample(1.6, 0.05, 1600, 1000, True)}

    def fake_counters(pid, window_s):
        assert os.path.exists(f"/proc/{pid}")  # the worker is running while counters are read
        seen.append(pid)
        return script[[2, 8][len(seen) - 1]]

    result = characterise(tiny, "onnxruntime", cpus=CPUS, batches=(2, 8), counter_window_s=0.2,
                          probe=lambda: PerfSupport(True, None, "ok"), measure_counters=fake_counters, **FAST)
    assert result.counters_available is True
    assert result.classification == "scale-up"
    assert [c.batch for c in result.counters] == [2, 8] and result.counters[1].scaled
    assert [(p.cores, p.batch) for p in result.points] == [(len(CPUS), 2), (len(CPUS), 8)]
    assert all(p.throughput_rps > 0 for p in result.points)
    assert len(set(seen)) == 2


def test_counters_failing_after_a_good_probe_fall_back_to_scaling(tiny):
    from reamer.host.perf import PerfUnsupported

    if len(CPUS) < 2:
        pytest.skip("needs 2 cpus to measure scaling")

    def refuse(pid, window_s):
        raise PerfUnsupported(13, "perf_event_paranoid forbids it")

    result = characterise(tiny, "onnxruntime", cpus=CPUS[:2], batches=(4,), counter_window_s=0.2,
                          probe=lambda: PerfSupport(True, None, "ok"), measure_counters=refuse, **FAST)
    assert result.counters_available is False
    assert "errno 13" in result.evidence[0] and "paranoid" in result.counters_reason
    assert sorted(p.cores for p in result.points) == [1, 2]
