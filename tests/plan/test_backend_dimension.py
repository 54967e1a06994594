"""The backend and OpenVINO streams as search dimensions (issue 14): the layout syntax, the screening that
drops a backend clearly behind, the search over the rest, and the simulator's exact best over every backend."""
import itertools

import pytest

from reamer.plan.layout import InstanceShape, Layout, format_layout, parse_layout
from reamer.plan.partition import ProfilePoint
from reamer.search.method import (all_layouts, count_backend_layouts, quick_search_backends, screen_backends,
                                screening_points, streams_variants)
from bench.simulator import CalibratedBackends, CalibratedModel, synthetic_model

# --- syntax ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["2x1:b4@openvino", "1x4s4:b8@openvino", "2x1:b4+1x4t2s2:b8@openvino",
                                  "3x1:b1@onnxruntime", "1x8t4s2:b16"])
def test_backend_and_streams_round_trip(text):
    layout = parse_layout(text)
    assert format_layout(layout) == text
    assert parse_layout(format_layout(layout)) == layout


def test_backend_is_part_of_the_layout():
    ov, ort, bare = parse_layout("2x1:b4@openvino"), parse_layout("2x1:b4@onnxruntime"), parse_layout("2x1:b4")
    assert ov.backend == "openvino" and bare.backend is None
    assert ov != ort != bare and ov.on(None) == bare and bare.on("openvino") == ov
    assert ov.canonical().backend == "openvino"
    assert parse_layout("2x1:b4 @ OpenVINO").backend == "openvino"


def test_streams_parse_into_the_shape():
    (shape,) = parse_layout("1x4s2:b8@openvino").instances
    assert (shape.cores, shape.threads, shape.streams, shape.batch) == (4, 4, 2, 8)
    assert parse_layout("2x2:b1").instances[0].streams == 1


@pytest.mark.parametrize("text, why", [
    ("2x1:b4@tensorrt", "unknown"),
    ("2x1:b4@openvino@onnxruntime", "unknown"),
    ("2x1:b4+1x1:b2@openvino+1x1:b1", "unknown"),  # one backend per layout: '@' ends it
    ("@openvino", "no instances"),
    ("1x2s4:b4@openvino", "more streams than threads"),
    ("1x2s2:b4@onnxruntime", "streams are OpenVINO's"),
    ("1x2s0:b4", "zero"),
])
def test_bad_backend_or_streams_name_the_problem(text, why):
    with pytest.raises(ValueError) as info:
        parse_layout(text)
    assert why in str(info.value)


def test_parsing_stays_bounded_with_a_backend():
    with pytest.raises(ValueError, match="cores"):
        parse_layout("999999999x999999999:b1@openvino")
    with pytest.raises(ValueError, match="unknown"):
        parse_layout("1x1:b1@" + "o" * 100_000)


def test_shape_refuses_streams_beyond_threads():
    with pytest.raises(ValueError):
        InstanceShape(2, 2, 4, 3)
    with pytest.raises(ValueError):
        Layout((InstanceShape(2, 2, 4, 2),), "onnxruntime")


# --- the space -------------------------------------------------------------------------------------------


def test_space_counts_every_backend_and_the_streams_layouts():
    batches = (1, 2, 4)
    plain = sum(1 for _ in all_layouts(4, batches))
    with_streams = {format_layout(layout) for layout in all_layouts(4, batches)
                    if any(s.cores > 1 for s in layout.instances)}
    assert count_backend_layouts(4, batches, ["onnxruntime"]) == plain
    assert count_backend_layouts(4, batches, ["onnxruntime", "openvino"]) == 2 * plain + len(with_streams)


def test_streams_variants_split_the_wide_instances():
    variants = streams_variants(parse_layout("1x2:b2+2x1:b1@openvino"))
    assert parse_layout("1x2s2:b2+2x1:b1@openvino") in variants
    assert parse_layout("1x4s4:b4@openvino") in variants  # THROUGHPUT-hint-like: one process, a stream per core
    assert streams_variants(parse_layout("1x1:b1@openvino")) == []


# --- screening and search on a two-backend model -----------------------------------------------------------


def _two_backends(faster: str, by: float, noise: float = 0.0) -> CalibratedBackends:
    """The same calibrated model on both backends, `faster` `by` times the other's throughput."""
    base = synthetic_model("scale-out")
    points = [base.profile(c, b) for c in (1, 2) for b in (1, 2, 4, 8, 16, 32)]
    models = {}
    for backend in ("onnxruntime", "openvino"):
        scale = by if backend == faster else 1.0
        scaled = [ProfilePoint(p.cores, p.batch, p.throughput_rps * scale, p.p99_ms / scale) for p in points]
        models[backend] = CalibratedModel.from_profiles(f"m@{backend}", scaled, {1: 0.1, 8: 0.2}, noise=noise)
    return CalibratedBackends("m", models, {"openvino": {1: 1.05, 8: 1.0}})


def test_screening_drops_a_backend_clearly_behind():
    model = _two_backends("openvino", 1.5)
    screens = screen_backends(lambda b, c, bt: model.profile(b, c, bt), model.backends, 16, (1, 2, 4, 8), 0.15)
    dropped = {s.backend: s.dropped for s in screens}
    assert dropped == {"onnxruntime": True, "openvino": False}
    assert "vs" in next(s.why for s in screens if s.dropped)
    assert set(next(s for s in screens if not s.dropped).throughput) == set(screening_points(16, (1, 2, 4, 8)))


def test_screening_keeps_both_when_close():
    model = _two_backends("openvino", 1.05)
    screens = screen_backends(lambda b, c, bt: model.profile(b, c, bt), model.backends, 16, (1, 2, 4, 8), 0.15)
    assert not any(s.dropped for s in screens)


@pytest.mark.parametrize("faster, by", [("openvino", 1.5), ("onnxruntime", 1.3), ("openvino", 1.04)])
@pytest.mark.parametrize("slo", [None, 500.0])
def test_auto_search_finds_the_best_over_both_backends(faster, by, slo):
    model = _two_backends(faster, by)
    result, screens = quick_search_backends(lambda b, c, bt: model.profile(b, c, bt), 16, slo, (1, 2, 4, 8, 16, 32),
                                            model.run_layout, backends=model.backends)
    exact = model.best_layout(16, slo, (1, 2, 4, 8, 16, 32))
    assert result.best is not None and exact is not None
    assert result.best.layout.backend in ("onnxruntime", "openvino")
    rps, p99 = model.expected_layout(result.best.layout)
    assert slo is None or p99 <= slo
    assert rps >= 0.97 * exact[1]
    assert result.measured <= 0.05 * count_backend_layouts(16, (1, 2, 4, 8, 16, 32), model.backends)
    if by >= 1.3:  # clearly behind: its layouts were never searched
        assert result.best.layout.backend == faster
        assert all(c.layout.backend == faster for c in result.candidates)


def test_every_measurement_is_counted_once():
    model = _two_backends("openvino", 1.05)
    calls = {"points": 0, "layouts": 0}

    def measure(b, c, bt):
        calls["points"] += 1
        return model.profile(b, c, bt)

    def verify(layout):
        calls["layouts"] += 1
        return model.run_layout(layout)

    result, _ = quick_search_backends(measure, 8, None, (1, 2, 4, 8), verify, backends=model.backends)
    assert result.measured == calls["points"] + calls["layouts"]


def test_a_single_backend_is_not_screened():
    model = _two_backends("openvino", 1.5)
    result, screens = quick_search_backends(lambda b, c, bt: model.profile(b, c, bt), 8, None, (1, 2, 4),
                                            model.run_layout, backends=["onnxruntime"])
    assert [s.throughput for s in screens] == [{}]
    assert result.best.layout.backend == "onnxruntime"


# --- the simulator's exact answer over backends and streams --------------------------------------------------


def _streams_layouts(n, batches, backend):
    for layout in all_layouts(n, batches):
        yield layout.on(backend)
        if any(s.cores > 1 for s in layout.instances) and backend == "openvino":
            yield Layout(tuple(InstanceShape(s.cores, s.cores, s.batch, s.cores if s.cores > 1 else 1)
                               for s in layout.instances), backend)


@pytest.mark.parametrize("slo", [None, 300.0, 1000.0])
def test_simulator_best_equals_enumeration(slo):
    model = _two_backends("openvino", 1.1)
    batches = (1, 2, 4, 8)
    best = model.best_layout(6, slo, batches)
    every = itertools.chain.from_iterable(_streams_layouts(6, batches, b) for b in model.backends)
    found = [(layout, *model.expected_layout(layout)) for layout in every]
    feasible = [f for f in found if slo is None or f[2] <= slo]
    top = max(feasible, key=lambda f: f[1])
    assert best is not None and best[1] == pytest.approx(top[1])


def test_streams_instance_follows_its_sub_instances():
    model = _two_backends("openvino", 1.0)
    one, two = parse_layout("1x2s2:b2@openvino"), parse_layout("2x1:b1@openvino")
    assert model.expected_layout(one)[0] == pytest.approx(1.05 * model.expected_layout(two)[0])
