"""The request fast path: tensors through shared memory, the loop-driven worker call, no idle batching
wait at a low rate, and TCP_NODELAY on front-door connections (the 40 ms Nagle/delayed-ACK stall)."""
import asyncio
import os
import signal
import socket
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from reamer.serve.backends import open_backend
from reamer.serve.runtime.batcher import DynamicBatcher
from reamer.serve.doors.http_server import FrontDoor
from reamer.serve.doors.rest import V2App
from reamer.serve.models import build_model
from reamer.serve.spec import InstanceSpec
from reamer.serve.runtime.instance_channel import INLINE_MAX_BYTES
from reamer.serve.runtime.instance_channel import shareable as _shareable
from reamer.serve.runtime.instances import InstanceCrashed, InstanceWorker
from tests.conftest import wait_for

CPU = sorted(os.sched_getaffinity(0))[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("model") / "tiny.onnx").path


@pytest.fixture(scope="module")
def reference(tiny):
    with open_backend("onnxruntime", tiny, 1) as ref:
        yield ref


@pytest.fixture
def worker(tiny, tmp_path):
    w = InstanceWorker(0, InstanceSpec([CPU], 1, 4), tiny, run_dir=str(tmp_path))
    w.start()
    yield w
    if w.alive:
        os.kill(w.pid, signal.SIGCONT)
    w.stop(grace_s=5)


def test_batches_larger_than_the_shared_arena_grow_it_and_stay_exact(worker, reference):
    rng = np.random.default_rng(0)
    # 40000 x 16 float32 = 2.5 MB in (the arena starts at 1 MB), 640 KB out; then small again.
    for batch in (3, 40000, 5):
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        got = worker.run({"input": x})["output"]
        np.testing.assert_allclose(got, reference.run({"input": x})["output"], rtol=1e-5)
    # results are copies: the next batch does not overwrite what the caller holds, whether they came
    # inline in the pipe message (small) or through the arena (8000 x 4 float32 = 128 KB out)
    for batch in (2, 8000):
        first = worker.run({"input": np.ones((batch, 16), np.float32)})["output"]
        kept = first.copy()
        worker.run({"input": np.zeros((batch, 16), np.float32)})
        np.testing.assert_array_equal(first, kept)


def test_small_tensors_go_inline_and_large_ones_through_the_arena():
    assert not _shareable({"ids": np.zeros((1, 128), np.int64), "mask": np.ones((1, 128), np.int64)})
    assert _shareable({"image": np.zeros((1, 3, 224, 224), np.float32)})
    assert not _shareable({"text": np.array(["a"], dtype=object), "image": np.zeros((1, 3, 224, 224), np.float32)})
    assert _shareable({"x": np.zeros(INLINE_MAX_BYTES // 4 + 1, np.float32)})


def test_run_async_matches_and_survives_a_cancelled_call(worker, reference):
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)

    async def main():
        out = await worker.run_async({"input": x})
        os.kill(worker.pid, signal.SIGSTOP)  # the next call cannot finish before we cancel it
        call = asyncio.ensure_future(worker.run_async({"input": np.zeros((1, 16), np.float32)}))
        while not worker.busy:
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        os.kill(worker.pid, signal.SIGCONT)
        # the cancelled call's late answer must not be taken for this one
        again = await worker.run_async({"input": x})
        return out, again

    out, again = asyncio.run(main())
    want = reference.run({"input": x})["output"]
    np.testing.assert_allclose(out["output"], want, rtol=1e-5)
    np.testing.assert_allclose(again["output"], want, rtol=1e-5)


def test_run_async_reports_a_crash_clearly(worker):
    async def main():
        os.kill(worker.pid, signal.SIGKILL)
        await worker.run_async({"input": np.ones((1, 16), np.float32)})

    with pytest.raises(InstanceCrashed, match="crashed"):
        asyncio.run(main())


def test_idle_instance_waits_for_a_fuller_batch_only_when_requests_arrive_densely():
    b = DynamicBatcher(slo_ms=100.0)
    b.merging = lambda: True  # the instances found the model batchable
    w = SimpleNamespace(spec=SimpleNamespace(max_batch=8), latency_ewma_s=0.050)
    assert b._max_wait_s(w) == 0.0  # nothing known about arrivals: do not wait
    for t in (0.0, 1.0, 2.0, 3.0):  # one request a second: nobody comes within the window
        b._note_arrival(t)
    assert b._max_wait_s(w) == 0.0
    for i in range(40):  # one every 2 ms: waiting fills the batch
        b._note_arrival(4.0 + i * 0.002)
    assert b._max_wait_s(w) == pytest.approx(0.020)  # min(0.2 x SLO, batch latency)
    single = SimpleNamespace(spec=SimpleNamespace(max_batch=1), latency_ewma_s=0.050)
    assert b._max_wait_s(single) == 0.0
    b.merging = lambda: False  # a model that is not batchable: one request per run, nothing to wait for
    assert b._max_wait_s(w) == 0.0


def test_front_door_connections_have_nagle_off(worker):
    batcher = DynamicBatcher(slo_ms=None, name="tiny")
    door = FrontDoor(V2App("tiny", batcher), "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    seen = {}

    async def main():
        batcher.add_instance(worker)
        await door.serve()
        await batcher.close()

    def server_nodelay():
        socks = [c.transport.get_extra_info("socket") for c in list(door.connections) if c.transport]
        return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks if s is not None]

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        wait_for(lambda: door.started, what="front door to start")
        with httpx.Client(base_url=f"http://127.0.0.1:{door.port}", timeout=60) as client:
            r = client.post("/v2/models/tiny/infer", json={"inputs": [
                {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
            assert r.status_code == 200, r.text
            seen["nodelay"] = asyncio.run_coroutine_threadsafe(_call(server_nodelay), loop).result(30)
    finally:
        loop.call_soon_threadsafe(door.request_stop)
        thread.join(30)
    assert seen["nodelay"] and all(v != 0 for v in seen["nodelay"])


async def _call(fn):
    return fn()
