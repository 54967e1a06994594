import pytest

from reamer.plan.layout import parse_layout
from reamer.plan.simulator import synthetic_model


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
