"""One profile worker measures batch after batch on the same loaded model (PointSession, the RUN command),
and the layout search keeps one such worker per core count, never alive while a layout runs."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from reamer.plan.layout import parse_layout
from reamer.serve.measure import profiler
from reamer.search.on_cores import MeasureSettings, _Runs, search_layout
from reamer.serve.models import build_model
from reamer.serve.measure.profiler import PointSession, ProfileError, ProfileWorker, WorkerConfig
from tests.acceptance.exported_models import BuildUnavailable, ensure_models

FAST = {"warmup_s": 0.1, "window_s": 0.1, "max_windows": 4}
CPUS = sorted(os.sched_getaffinity(0))
CPU = CPUS[-1:]  # one cpu, away from cpu 0 where it can be


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_model("tiny", tmp_path_factory.mktemp("session") / "tiny.onnx").path


@pytest.fixture(scope="module")
def resnet() -> str:
    """The ResNet exported by torch.onnx (tests/acceptance/exported_models.py)."""
    try:
        return str(ensure_models() / "resnet.onnx")
    except BuildUnavailable as why:
        pytest.skip(str(why))


@pytest.fixture
def started(monkeypatch) -> list[ProfileWorker]:
    """Every profile worker process started while the test runs."""
    workers: list[ProfileWorker] = []
    init = ProfileWorker.__init__

    def recording_init(self: ProfileWorker, config: WorkerConfig) -> None:
        init(self, config)
        workers.append(self)

    monkeypatch.setattr(ProfileWorker, "__init__", recording_init)
    return workers


def _alive(workers: list[ProfileWorker]) -> list[int]:
    return [w.pid for w in workers if w.proc.poll() is None]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_one_worker_measures_batches_one_two_and_four_on_the_loaded_model(resnet, backend):
    cfg = WorkerConfig(resnet, backend, cpus=CPU, threads=1, batch=1, **FAST)
    with ProfileWorker(cfg) as worker:
        worker.wait_ready(timeout_s=120)
        results = [worker.run_batch(b, timeout_s=120) for b in (1, 2, 4)]
        assert worker.proc.poll() is None  # still up, waiting for the next command
    for batch, res in zip((1, 2, 4), results):
        assert (res.batch, res.fed_batch) == (batch, batch)  # the feeds were re-planned for the new batch
        assert res.samples == batch * len(res.latencies_ms)
        assert 3 <= len(res.window_rps) <= 4 and res.throughput_rps > 0
        assert res.cpus == CPU


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_session_keeps_one_process_for_a_batch_walk_and_close_kills_it(tiny, backend, started):
    session = PointSession(tiny, backend, 1, CPU, **FAST)
    points = [session.measure(b, timeout_s=120) for b in (1, 2, 4)]
    assert [(p.cores, p.batch) for p in points] == [(1, 1), (1, 2), (1, 4)]
    assert all(p.throughput_rps > 0 and p.p99_ms > 0 for p in points)
    assert len(session.pids) == 1 and [w.pid for w in started] == session.pids
    assert session.alive
    session.close()
    assert not session.alive and _alive(started) == []
    session.close()  # idempotent


def test_go_still_measures_once_and_exits(tiny):
    with ProfileWorker(WorkerConfig(tiny, "onnxruntime", cpus=CPU, threads=1, batch=2, **FAST)) as worker:
        worker.wait_ready(timeout_s=120)
        worker.go()
        res = worker.result(timeout_s=120)
        assert worker.proc.returncode == 0
    assert (res.batch, res.fed_batch) == (2, 2)


def test_a_worker_killed_mid_measurement_is_an_error_and_the_next_measurement_starts_afresh(tiny):
    with PointSession(tiny, "onnxruntime", 1, CPU, warmup_s=1.0, window_s=0.3, max_windows=10) as session:
        session.measure(1, timeout_s=120)
        first = session.pids[0]
        killer = threading.Timer(0.3, os.kill, (first, signal.SIGKILL))  # during batch 2's warm-up
        killer.start()
        with pytest.raises(ProfileError) as exc:
            session.measure(2, timeout_s=120)
        killer.join()
        assert f"worker {first}" in exc.value.message and "killed by signal 9" in exc.value.message
        assert not session.alive
        point = session.measure(2, timeout_s=120)
        assert point.batch == 2 and point.throughput_rps > 0
        assert len(session.pids) == 2 and session.pids[1] != first


def test_a_hung_worker_times_out_is_killed_and_replaced(tiny, started):
    with PointSession(tiny, "onnxruntime", 1, CPU, **FAST) as session:
        session.measure(1, timeout_s=120)
        hung = started[0]
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ProfileError, match="in time"):
                session.measure(2, timeout_s=1.0)
            assert hung.proc.poll() is not None  # killed, not left stopped
        finally:
            if hung.proc.poll() is None:
                os.kill(hung.pid, signal.SIGKILL)
        assert session.measure(2, timeout_s=120).batch == 2
        assert len(set(session.pids)) == 2


def test_a_refused_batch_is_an_error_naming_the_input(tmp_path):
    """A model that declares a dynamic batch but reshapes to a batch of 1 runs batch 1; the runtime refuses 2."""
    import onnx
    from onnx import TensorProto, helper

    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1, 4])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "batch1",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [shape])
    path = tmp_path / "fixed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with PointSession(path, "onnxruntime", 1, CPU, **FAST) as session:
        assert session.measure(1, timeout_s=120).throughput_rps > 0
        with pytest.raises(ProfileError) as exc:
            session.measure(2, timeout_s=120)
        assert "x" in exc.value.message and exc.value.fix
        assert not session.alive


SETTINGS = MeasureSettings(warmup_s=0.1, window_s=0.1, max_windows=4, verify_windows=2)


def test_runs_reuse_one_worker_per_core_count_and_close_it_before_a_layout_runs(tiny, started, monkeypatch):
    runs = _Runs(tiny, "onnxruntime", CPUS, SETTINGS, [], None)
    checked = []
    real = profiler.measure_layout

    def measure_layout(*args, **kwargs):  # type: ignore[no-untyped-def]
        checked.append(_alive(started))
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "measure_layout", measure_layout)
    try:
        for batch in (1, 2, 4):
            assert runs.measure(1, batch).batch == batch
        assert len(started) == 1  # measure_point ran one process per point: 3
        assert len(runs.overheads) == 1  # only the fresh start counts as start-up overhead
        runs.verify(parse_layout("1x1:b2"))
        assert checked == [[]]  # no point worker alive while the layout ran
        if len(CPUS) >= 2:
            runs.measure(1, 8)
            runs.measure(2, 1)  # another core count: the 1-core worker goes, a 2-core one comes
            runs.measure(2, 2)
            point_workers = [w for w in started if w.config.fixed_windows is None]
            assert [len(w.config.cpus) for w in point_workers] == [1, 1, 2]
            assert _alive(started) == [point_workers[-1].pid]
    finally:
        runs.close()
    assert _alive(started) == []


def test_a_search_over_both_backends_keeps_at_most_one_point_worker_and_leaves_none(tiny, started, monkeypatch):
    most = []
    init = ProfileWorker.__init__

    def counting_init(self: ProfileWorker, config: WorkerConfig) -> None:
        alive = _alive(started)
        most.append(len(alive))
        init(self, config)

    monkeypatch.setattr(ProfileWorker, "__init__", counting_init)
    outcome = search_layout(tiny, "auto", CPU, None, batches=(1, 2, 4), settings=SETTINGS, budget_s=None)
    assert outcome.best is not None
    points = sum(1 for r in outcome.rows if r.kind == "point" and not r.cached)
    assert len(started) < points + sum(r.kind == "layout" for r in outcome.rows)  # workers were reused
    assert max(most) == 0  # every worker started with no other alive: no idle point worker beside a run
    assert _alive(started) == []


def test_a_run_on_a_loaded_worker_is_expected_and_charged_without_start_up():
    runs = _Runs("model.onnx", "onnxruntime", [0], MeasureSettings(warmup_s=1.0, window_s=0.5), [], None)
    runs._ran(5.0, 100.0, 3)  # a fresh start: 0.1 + 1.0 + 3 × 0.5 = 2.6 s expected, 2.4 s of start-up
    assert runs.overhead_s() == pytest.approx(2.4)
    runs._ran(2.0, 100.0, 3, fresh=False)  # a reused worker's run says nothing about start-up
    assert runs.overhead_s() == pytest.approx(2.4) and len(runs.overheads) == 1
    assert runs.expected_s(100.0, 3) == pytest.approx(2.4 + 2.6)
    # no start-up; the re-warm-up may end after half the warm-up, or three batches of 0.1 s (first one included)
    assert runs.expected_s(100.0, 3, fresh=False) == pytest.approx(0.1 + 0.5 + 1.5)
    assert runs.expected_s(4000.0, 3, fresh=False) == pytest.approx(4.0 + 8.0 + 12.0)
