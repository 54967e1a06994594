import pytest

from reamer.plan.layout import parse_layout
from bench.simulator import synthetic_model


def test_deterministic():
    a, b = synthetic_model("scale-out", noise=0.05), synthetic_model("scale-out", noise=0.05)
    assert a.profile(3, 8) == b.profile(3, 8)
    assert a.run_layout(parse_layout("2x2:b4")) == b.run_layout(parse_layout("2x2:b4"))


def test_noise_is_bounded_and_changes_points():
    clean, noisy = synthetic_model("scale-up"), synthetic_model("scale-up", noise=0.05)
    ratios = [noisy.profile(c, b).p99_ms / clean.profile(c, b).p99_ms for c in (1, 2, 4) for b in (1, 8)]
    assert all(0.95 <= r <= 1.05 for r in ratios)
    assert len(set(ratios)) > 1


@pytest.mark.parametrize("family", ["scale-up", "scale-out"])
def test_latency_falls_with_cores_and_rises_with_batch(family):
    model = synthetic_model(family)
    assert model.profile(4, 4).p99_ms < model.profile(1, 4).p99_ms
    assert model.profile(2, 16).p99_ms > model.profile(2, 1).p99_ms


def test_families_prefer_different_layouts():
    up, out = synthetic_model("scale-up"), synthetic_model("scale-out")
    one_big, many_small = parse_layout("1x8:b32"), parse_layout("8x1:b4")
    assert up.run_layout(one_big)[0] > up.run_layout(many_small)[0]
    assert out.run_layout(many_small)[0] > out.run_layout(one_big)[0]
    # scale-up: batching keeps paying; scale-out: throughput saturates early
    assert up.profile(1, 32).throughput_rps > 2 * up.profile(1, 4).throughput_rps
    assert out.profile(1, 32).throughput_rps < out.profile(1, 4).throughput_rps


def test_running_together_is_slower_than_the_sum_alone():
    model = synthetic_model("scale-out")
    layout = parse_layout("12x1:b4")
    alone = sum(model.profile(s.cores, s.batch).throughput_rps for s in layout.instances)
    together, p99 = model.run_layout(layout)
    assert together < alone
    assert p99 > model.profile(1, 4).p99_ms
    # one instance alone sees no contention
    single = parse_layout("1x1:b4")
    assert model.run_layout(single)[0] == pytest.approx(model.profile(1, 4).throughput_rps, rel=0.01)


def test_oversubscribed_threads_are_slower():
    model = synthetic_model("scale-out")
    assert model.batch_latency_ms(2, 4, threads=4) > model.batch_latency_ms(2, 4, threads=2)


def test_unknown_family():
    with pytest.raises(ValueError, match="scale-up"):
        synthetic_model("quantum")


# --- CalibratedModel ---------------------------------------------------------------------------------

from reamer.plan.layout import count_layouts  # noqa: E402
from reamer.plan.partition import ProfilePoint  # noqa: E402
from reamer.search.method import all_layouts  # noqa: E402
from bench.simulator import CalibratedModel, calibrated_models  # noqa: E402

BATCHES = (1, 2, 4, 8)


def _calibrated(gamma1=0.15, gamma8=0.05, noise=0.0):
    # 1 core: latency grows less than linearly with batch; 2 cores: 1.6x faster at batch 8, 1.2x at 1
    one = {1: 20.0, 2: 36.0, 4: 66.0, 8: 120.0}
    two = {1: 16.7, 2: 28.0, 4: 46.0, 8: 75.0}
    points = [ProfilePoint(1, b, 1000.0 * b / ms, 1.5 * ms) for b, ms in one.items()]
    points += [ProfilePoint(2, b, 1000.0 * b / ms, 1.5 * ms) for b, ms in two.items()]
    return CalibratedModel.from_profiles("m", points, {1: gamma1, 8: gamma8}, noise=noise)


def test_calibrated_model_reproduces_its_profiles():
    model = _calibrated()
    for cores, ms in ((1, 20.0), (2, 16.7)):
        rps, p99 = model.alone(cores, 1)
        assert rps == pytest.approx(1000.0 / ms, rel=1e-6)
        assert p99 == pytest.approx(1.5 * ms, rel=1e-6)
    # Amdahl: more cores never slower, but with diminishing returns
    lat = [model.batch_latency_ms(c, 8) for c in (1, 2, 4, 8, 16)]
    assert lat == sorted(lat, reverse=True)
    assert lat[0] / lat[4] < 16


def test_calibrated_contention_matches_the_two_core_measurement():
    model = _calibrated(gamma1=0.15)
    alone = model.alone(1, 1)[0]
    together, _ = model.expected_layout(parse_layout("2x1:b1"))
    assert together / 2 == pytest.approx(alone / 1.15, rel=1e-9)  # what was measured on 2 cores
    single, _ = model.expected_layout(parse_layout("1x4:b1"))
    assert single == pytest.approx(model.alone(4, 1)[0])  # one instance alone: no contention
    # saturating: 16 single-core instances slow each other by less than 1 + 2γ
    many, _ = model.expected_layout(parse_layout("16x1:b1"))
    assert alone * 16 / 1.3 < many < alone * 16 / 1.15


def test_noise_changes_measurements_not_the_truth():
    clean, noisy = _calibrated(), _calibrated(noise=0.05)
    layout = parse_layout("2x2:b4")
    assert noisy.expected_layout(layout) == clean.expected_layout(layout)
    assert noisy.run_layout(layout) != clean.run_layout(layout)
    assert 0.95 <= noisy.run_layout(layout)[0] / clean.run_layout(layout)[0] <= 1.06
    assert noisy.with_noise(0.05, seed=1).profile(1, 4) != noisy.profile(1, 4)


@pytest.mark.parametrize("slo", [None, 100.0, 40.0])
@pytest.mark.parametrize("per_instance", [False, True])
def test_exact_best_layout_equals_enumeration(slo, per_instance):
    model = _calibrated()
    n = 6
    exact = model.best_layout(n, slo, BATCHES, per_instance_batch=per_instance)
    layouts = list(all_layouts(n, BATCHES, per_instance_batch=per_instance))
    assert len(layouts) == count_layouts(n, BATCHES, per_instance_batch=per_instance)
    ok = [(model.expected_layout(x), x) for x in layouts]
    ok = [(rps, x) for (rps, p99), x in ok if slo is None or p99 <= slo]
    if not ok:
        assert exact is None
        return
    best_rps = max(rps for rps, _ in ok)
    assert exact is not None and exact[1] == pytest.approx(best_rps, rel=1e-9)
    assert exact[0].total_cores == n


def test_impossible_slo_has_no_best_layout():
    assert _calibrated().best_layout(4, 1.0, BATCHES) is None


def test_calibrated_models_from_calibration_document():
    doc = {"models": {"x": {
        "points": [{"cores": 1, "batch": 1, "throughput_rps": 50.0, "p99_ms": 30.0},
                   {"cores": 2, "batch": 1, "throughput_rps": 80.0, "p99_ms": 19.0}],
        "contention": [{"batch": 1, "factor": 0.8}]}}}
    model = calibrated_models(doc)["x"]
    assert model.contention[1] == pytest.approx(0.25)
    assert model.serial[1] == pytest.approx(2 * 12.5 / 20.0 - 1.0)
    with pytest.raises(ValueError, match="1-core"):
        CalibratedModel.from_profiles("y", [ProfilePoint(2, 1, 10.0, 100.0)], {})


def test_a_layout_run_again_is_a_fresh_measurement():
    layout = parse_layout("2x1:b4")
    first, again = _calibrated(noise=0.05), _calibrated(noise=0.05)
    runs = [first.run_layout(layout) for _ in range(3)]
    assert again.run_layout(layout) == runs[0]  # deterministic: the n-th run of a layout is always the same
    assert len(set(runs)) == 3  # each run its own error ...
    truth = first.expected_layout(layout)
    assert all(0.95 <= truth[0] / rps <= 1.05 + 1e-9 for rps, _ in runs)  # ... within the noise
    clean = _calibrated()
    assert clean.run_layout(layout) == clean.run_layout(layout) == clean.expected_layout(layout)


def test_a_point_measured_again_is_a_fresh_measurement():
    first, again = _calibrated(noise=0.05), _calibrated(noise=0.05)
    readings = [first.profile(2, 4) for _ in range(3)]
    assert again.profile(2, 4) == readings[0]  # the n-th measurement of a point is always the same
    assert len({p.p99_ms for p in readings}) == 3
    truth = first.alone(2, 4)[1]
    assert all(0.95 <= p.p99_ms / truth <= 1.05 + 1e-9 for p in readings)
    clean = _calibrated()
    assert clean.profile(2, 4) == clean.profile(2, 4)
