"""The quick search's rules that keep its wall time down (issue 14): the batch walk, one-instance layouts
verified by their point, the streams batch cap, the screening order."""
from reamer.plan.layout import InstanceShape, Layout
from reamer.plan.partition import ProfilePoint
from reamer.search.method import BackendScreen, quick_search, screening_order, streams_variants
from bench.simulator import CalibratedModel

BATCHES = (1, 2, 4, 8, 16, 32)


def _flat_model() -> CalibratedModel:
    """Throughput flat in the batch from 4 on, alone and together (a large CNN on few cores)."""
    one_core = {1: 100.0, 2: 190.0, 4: 360.0, 8: 720.0, 16: 1440.0, 32: 2880.0}
    points = [ProfilePoint(c, b, 1000.0 * b / (ms * (0.55 if c == 2 else 1.0)), 1.2 * ms * (0.55 if c == 2 else 1.0))
              for b, ms in one_core.items() for c in (1, 2)]
    return CalibratedModel.from_profiles("flat", points, {1: 0.1, 32: 0.1})


def test_the_batch_walk_steps_up_only_on_the_best_splits_cores():
    model = _flat_model()
    asked: list[tuple[int, int]] = []

    def measure(cores, batch):
        asked.append((cores, batch))
        return model.profile(cores, batch)

    result = quick_search(measure, 8, None, batches=BATCHES, verify=model.run_layout)
    exact = model.best_layout(8, None, BATCHES)
    assert result.best is not None and model.expected_layout(result.best.layout)[0] >= 0.97 * exact[1]
    # the sweep measured every batch up to 32 on the cores of the best three splits before (1, 2 and 8 cores
    # here); the walk steps up only from the best split's batch, on its cores
    assert {c for c, b in asked if b == 32} <= {s.cores for s in result.best.layout.instances}


def test_the_batch_walk_goes_down_past_a_dip():
    # together, batch 1 is best, 2 dips below 4, and the profile alone is flat: the walk down from the
    # profile's pick must not stop at the dip
    model = _flat_model()
    dipped = CalibratedModel("dip", model.one_core_ms, model.serial, model.p99_ratio, {1: 0.0, 2: 0.6, 4: 0.3, 32: 0.3})
    result = quick_search(dipped.profile, 8, None, batches=BATCHES, verify=dipped.run_layout)
    exact = dipped.best_layout(8, None, BATCHES)
    assert result.best is not None
    assert dipped.expected_layout(result.best.layout)[0] >= 0.97 * exact[1], (str(result.best.layout), str(exact[0]))


def test_a_one_instance_layout_is_verified_by_its_point():
    model = _flat_model()
    verified: list[Layout] = []

    def verify(layout):
        verified.append(layout)
        return model.run_layout(layout)

    result = quick_search(model.profile, 1, None, batches=(1, 2, 4), verify=verify)
    assert verified == []  # on one core every layout is one instance: its point is its run
    assert result.best is not None and result.best.measured_rps is not None
    assert result.best.measured_rps == model.profile(1, result.best.layout.instances[0].batch).throughput_rps

    quick_search(model.profile, 2, None, batches=(1, 2, 4), verify=verify)
    assert verified and all(len(layout.instances) > 1 for layout in verified)


def test_the_streams_single_instance_stays_within_the_largest_batch():
    layout = Layout((InstanceShape(1, 1, 32), InstanceShape(1, 1, 32)), "openvino")
    unbounded = streams_variants(layout)
    assert unbounded[-1].instances[0].batch == 64
    (single,) = streams_variants(layout, max_batch=32)
    assert single.instances[0] == InstanceShape(2, 2, 32, 2)


def test_the_backend_ahead_at_screening_is_searched_first():
    behind = BackendScreen("onnxruntime", {(1, 1): 10.0, (2, 1): 18.0, (2, 4): 20.0})
    ahead = BackendScreen("openvino", {(1, 1): 12.0, (2, 1): 17.0, (2, 4): 30.0})
    assert [s.backend for s in screening_order([behind, ahead])] == ["openvino", "onnxruntime"]
    assert [s.backend for s in screening_order([ahead, behind])] == ["openvino", "onnxruntime"]
