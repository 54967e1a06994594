import math
import os
from pathlib import Path

import pytest

from reamer.host.errors import ReamerError
from reamer.plan.layout import parse_layout
from reamer.plan.partition import ProfilePoint
from reamer.serve.models import build_model
from reamer.serve.measure.profiler import (LayoutSession, ProfileError, ProfileWorker, WorkerConfig, layout_verifier,
                                   measure_layout, measure_layout_detail, measure_point, point_measurer,
                                   window_is_stable)

FAST = {"warmup_s": 0.1, "window_s": 0.15}
CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("prof") / "tiny.onnx").path


def test_window_stability_rule():
    assert not window_is_stable([100, 100])
    assert window_is_stable([10, 100, 105, 95])  # only the last three count
    assert not window_is_stable([100, 100, 125])
    assert window_is_stable([100, 100, 120], stability=0.2)
    assert not window_is_stable([0, 0, 0])


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_measure_point(tiny, backend):
    point = measure_point(tiny, backend, cores=1, batch=4, cpus=CPUS[-1:], max_windows=5, **FAST)
    assert isinstance(point, ProfilePoint)
    assert (point.cores, point.batch) == (1, 4)
    assert point.throughput_rps > 0 and math.isfinite(point.throughput_rps)
    assert point.p99_ms > 0


def test_worker_pins_every_thread_before_the_runtime_starts(tiny):
    if len(CPUS) < 2:
        pytest.skip("needs 2 cpus to tell a pinned worker from an unpinned one")
    cfg = WorkerConfig(tiny, "openvino", cpus=[CPUS[-1]], threads=1, batch=2, warmup_s=0.1, window_s=0.1,
                       max_windows=3)
    with ProfileWorker(cfg) as worker:
        info = worker.wait_ready(timeout_s=120)
        assert info["cpus"] == [CPUS[-1]]
        tasks = list(Path(f"/proc/{worker.pid}/task").iterdir())
        for task in tasks:
            status = (task / "status").read_text()
            allowed = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list"))
            assert allowed.split()[-1] == str(CPUS[-1]), (task.name, allowed)
        worker.go()
        result = worker.result(timeout_s=120)
    assert len(result.window_rps) == 3
    assert len(result.latencies_ms) * 2 == result.samples
    assert result.cpus == [CPUS[-1]]


def test_measure_layout_runs_instances_together_on_disjoint_cpus(tiny):
    if len(CPUS) < 2:
        pytest.skip("needs 2 cpus")
    layout = parse_layout("2x1:b2")
    detail = measure_layout_detail(tiny, "onnxruntime", layout, CPUS[:2], windows=2, **FAST)
    assert [r.cpus for r in detail.instances] == [[CPUS[0]], [CPUS[1]]]
    assert all(len(r.window_rps) == 2 for r in detail.instances)
    assert detail.throughput_rps == pytest.approx(sum(r.overall_rps for r in detail.instances))
    assert detail.p99_ms > 0
    rps, p99 = measure_layout(tiny, "onnxruntime", parse_layout("1x1:b4"), CPUS[:1], windows=2, **FAST)
    assert rps > 0 and p99 > 0


def test_layout_sessions_stay_loaded_and_run_in_turn_until_closed(tiny):
    """A search's finals: two layouts loaded at once, each run twice in turn by the same worker processes;
    closing kills them. A worker that dies between runs fails the next run with a ProfileError."""
    import signal

    two = LayoutSession(tiny, "onnxruntime", parse_layout("1x1:b2"), CPUS[:1], windows=3, **FAST)
    four = LayoutSession(tiny, "onnxruntime", parse_layout("1x1:b4"), CPUS[:1], windows=2, **FAST)
    with two, four:
        two.start(60)
        four.start(60)
        pids = [w.pid for w in two.workers + four.workers]
        runs = [s.run(rewarm_s=0.05, timeout_s=60) for s in (two, four, two, four)]
        assert [w.pid for w in two.workers + four.workers] == pids  # no process started between runs
        assert all(w.proc.poll() is None for w in two.workers + four.workers)
        assert [len(m.instances[0].window_rps) for m in runs] == [3, 2, 3, 2]  # the re-warm-up is not measured
        assert [m.instances[0].batch for m in runs] == [2, 4, 2, 4]
        assert all(m.throughput_rps > 0 and m.p99_ms > 0 for m in runs)
        os.kill(four.workers[0].pid, signal.SIGKILL)
        with pytest.raises(ProfileError, match="killed by signal 9"):
            four.run(timeout_s=60)
        assert four.workers == []  # closed: nothing left running
        procs = [w.proc for w in two.workers]
    assert all(p.poll() is not None for p in procs)


def test_measurer_factories_fit_the_search_interface(tiny):
    measure = point_measurer(tiny, "onnxruntime", CPUS, max_windows=3, **FAST)
    point = measure(1, 1)
    assert (point.cores, point.batch) == (1, 1)
    verify = layout_verifier(tiny, "onnxruntime", CPUS, windows=1, **FAST)
    rps, p99 = verify(parse_layout("1x1:b1"))
    assert rps > 0 and p99 > 0


def test_too_many_cores_is_refused_before_starting(tiny):
    with pytest.raises(ReamerError, match="needs 3 cores"):
        measure_layout(tiny, "onnxruntime", parse_layout("3x1:b1"), CPUS[:2])
    with pytest.raises(ReamerError, match="not available"):
        measure_point(tiny, "onnxruntime", 1, 1, cpus=[max(CPUS) + 100])


def test_worker_errors_come_back_as_reamer_errors(tiny, tmp_path):
    with pytest.raises(ReamerError) as exc:
        measure_point(tiny, "tensorrt", 1, 1, CPUS[:1], **FAST)
    assert "tensorrt" in exc.value.message and "onnxruntime" in exc.value.fix
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"junk")
    with pytest.raises(ReamerError, match="cannot load"):
        measure_point(broken, "onnxruntime", 1, 1, CPUS[:1], **FAST)
