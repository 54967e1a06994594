"""Instance workers: real spawned processes running a tiny ONNX model."""
import os
import signal
import threading

import numpy as np
import pytest

from reamer.serve.backends import open_backend
from reamer.serve.models import build_model
from reamer.serve.spec import InstanceSpec, read_events
from reamer.serve.runtime.instances import InstanceCrashed, InstanceWorker, WorkerStartError
from tests.conftest import wait_for

CPU = sorted(os.sched_getaffinity(0))[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("model") / "tiny.onnx").path


@pytest.fixture
def worker(tiny, tmp_path):
    w = InstanceWorker(0, InstanceSpec(cpus=[CPU], threads=1, max_batch=4, sched="idle"), tiny, run_dir=str(tmp_path))
    yield w
    w.stop(grace_s=5)
    assert not w.alive


def _thread_ids(pid):
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_worker_is_pinned_idle_and_computes_like_onnxruntime(worker, tiny):
    worker.start()
    assert worker.ready and worker.alive
    assert [t.name for t in worker.inputs] == ["input"] and worker.inputs[0].datatype == "FP32"
    # Every thread of the worker, runtime threads included, carries the pinning and the policy.
    for tid in _thread_ids(worker.pid):
        assert os.sched_getaffinity(tid) == {CPU}
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    got = worker.run({"input": x})["output"]
    ref = open_backend("onnxruntime", tiny, 1)
    np.testing.assert_allclose(got, ref.run({"input": x})["output"], rtol=1e-5)
    ref.close()
    assert worker.service_rate() > 0


def test_killed_mid_request_fails_clearly_then_restarts(worker, tmp_path):
    worker.start()
    old_pid = worker.pid
    os.kill(old_pid, signal.SIGSTOP)  # hold the batch in flight
    result = {}

    def call():
        try:
            result["out"] = worker.run({"input": np.zeros((1, 16), np.float32)})
        except Exception as exc:  # noqa: BLE001
            result["err"] = exc

    t = threading.Thread(target=call)
    t.start()
    wait_for(lambda: worker.busy, what="the batch to be in flight")
    os.kill(old_pid, signal.SIGKILL)
    t.join(30)
    err = result.get("err")
    assert isinstance(err, InstanceCrashed), result
    assert "instance 0 crashed" in str(err) and "SIGKILL" in str(err) and "retry" in str(err)
    assert not worker.ready
    assert worker.ensure_running()
    assert worker.pid != old_pid and worker.restarts == 1
    assert worker.run({"input": np.ones((2, 16), np.float32)})["output"].shape == (2, 4)
    kinds = [e["kind"] for e in read_events(tmp_path)[0]]
    assert kinds == ["worker_crashed", "worker_restarted"]


def test_death_while_idle_is_noticed_and_repaired(worker, tmp_path):
    worker.start()
    old = worker.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not worker.alive, what="the worker to die")
    assert worker.ensure_running() and worker.pid != old
    events = read_events(tmp_path)[0]
    assert [e["kind"] for e in events] == ["worker_crashed", "worker_restarted"]
    assert events[0]["exit_code"] == -signal.SIGKILL


def test_bad_model_fails_start_with_the_reason(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    w = InstanceWorker(3, InstanceSpec(cpus=[CPU], threads=1, max_batch=1), str(bad))
    with pytest.raises(WorkerStartError) as err:
        w.start()
    assert "instance 3" in err.value.message and "bad.onnx" in err.value.message
    w.stop()


def test_crash_loop_backoff_grows_and_is_capped(worker):
    assert worker.backoff_s() == 0.0
    for _ in range(3):
        worker._crashes.append(__import__("time").monotonic())
    assert 0 < worker.backoff_s() <= worker.MAX_BACKOFF_S
    first = worker.backoff_s()
    for _ in range(20):
        worker._crashes.append(__import__("time").monotonic())
    assert first < worker.backoff_s() == worker.MAX_BACKOFF_S


def test_cpus_that_do_not_exist_fail_start_naming_them(tiny):
    w = InstanceWorker(1, InstanceSpec(cpus=[4095], threads=1, max_batch=1), tiny)
    with pytest.raises(WorkerStartError, match="cannot place the worker \\(cpus \\[4095\\]"):
        w.start()
    w.stop()


def test_one_stalled_batch_does_not_swing_the_shed_estimate_but_a_lasting_slowdown_does(tiny, tmp_path):
    w = InstanceWorker(0, InstanceSpec(cpus=[CPU], threads=1, max_batch=4, sched="idle"), tiny, run_dir=str(tmp_path))
    for _ in range(10):
        w.note_batch(0.010, 1)
    w.note_batch(2.0, 1)  # one batch stalled by a noisy neighbour
    assert w.latency_ewma_s < 0.020
    for _ in range(10):  # the instance really became slower
        w.note_batch(0.200, 1)
    assert w.latency_ewma_s > 0.150


def test_a_max_batch_1_openvino_instance_answers_a_multi_row_request(tiny, tmp_path):
    """Its OpenVINO is compiled for one row; a client's 3-row request runs through the dynamic form instead."""
    w = InstanceWorker(0, InstanceSpec(cpus=[CPU], threads=1, max_batch=1), tiny, backend="openvino",
                       run_dir=str(tmp_path))
    try:
        w.start()
        ref = open_backend("onnxruntime", tiny, 1)
        for rows in (1, 3, 1):
            x = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
            x.flags.writeable = False  # as a binary request's tensor is: it reaches the worker read-only
            np.testing.assert_allclose(w.run({"input": x})["output"], ref.run({"input": x})["output"],
                                       rtol=1e-4, atol=1e-5)
        ref.close()
    finally:
        w.stop(grace_s=5)
