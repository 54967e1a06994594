"""The gRPC front door holds at most the job's max_buffered_mb of request messages (shared with the REST door):
beyond it a call is refused with RESOURCE_EXHAUSTED before its message is read, the job's memory stays
bounded, and small requests are answered once room frees. A real job process and real grpc clients."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import numpy as np
import psutil
import pytest

from reamer.serve.backends import open_backend
from reamer.serve.doors.grpc_v2 import messages as pb
from reamer.serve.models import build_model
from tests.conftest import wait_for
from tests.serve.jobs import RunningJob

MAX_REQUEST_MB = 8
MAX_BUFFERED_MB = 32  # room for 4 messages of max_request_mb
LARGE_ROWS = 65536  # 65536 rows x (8 x 4 + 4 x 8) bytes: 4 MiB, the most rows a request may carry
INFER = f"/{pb.SERVICE}/ModelInfer"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("multi-io", tmp_path_factory.mktemp("m") / "mio.onnx").path


@pytest.fixture(scope="module")
def reference(model):
    ref = open_backend("onnxruntime", model, 1)
    yield ref
    ref.close()


def budget_job(model: str, tmp_path, **frontdoor: Any) -> RunningJob:
    return RunningJob(model, tmp_path, "mio", max_batch=LARGE_ROWS, grpc_port=0, host="127.0.0.1",
                      max_request_mb=MAX_REQUEST_MB, frontdoor={"max_buffered_mb": MAX_BUFFERED_MB, **frontdoor})


@pytest.fixture(scope="module")
def job(model, tmp_path_factory) -> Iterator[RunningJob]:
    j = budget_job(model, tmp_path_factory.mktemp("job"))
    yield j
    assert j.stop() == 0


def request(rows: int, seed: int = 0) -> tuple[dict[str, np.ndarray], Any]:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((rows, 8)).astype(np.float32), "ids": rng.integers(0, 10, (rows, 4))}
    req = pb.ModelInferRequest(model_name="mio", id=str(seed))
    for name, datatype in (("x", "FP32"), ("ids", "INT64")):
        req.inputs.add(name=name, datatype=datatype, shape=feeds[name].shape)
        req.raw_input_contents.append(feeds[name].tobytes())
    return feeds, req


def unary(target: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)])
    return channel, channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)


def call(target: str, req: Any) -> Any:
    """The answer, or the grpc.RpcError."""
    channel, infer = unary(target)
    try:
        return infer(req, timeout=120)
    except grpc.RpcError as exc:
        return exc
    finally:
        channel.close()


def scores(answer: Any) -> np.ndarray:
    index = [o.name for o in answer.outputs].index("scores")
    return np.frombuffer(answer.raw_output_contents[index], dtype=np.float32).reshape(answer.outputs[index].shape)


class Holder:
    """A call whose message is sent only when release() is called: it holds a reservation of max_request_mb."""

    def __init__(self, target: str, req: Any) -> None:
        self.channel = grpc.insecure_channel(target)
        self.gate = threading.Event()
        method = self.channel.stream_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                           response_deserializer=pb.ModelInferResponse.FromString)

        def message() -> Iterator[Any]:
            self.gate.wait(120)
            yield req

        self.future = method.future(message(), timeout=120)

    def release(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.gate.set()
        self.channel.close()


def refused_for_the_budget(answer: Any) -> bool:
    if not isinstance(answer, grpc.RpcError) or answer.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    details = answer.details()
    assert "max_buffered_mb" in details and "retry" in details and "raise" in details, details
    return True


class PeakRss:
    """The highest RSS of a process while the block runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.before = self.proc.memory_info().rss
        self.peak = self.before
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._done.wait(0.005)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / 2**20


def test_calls_past_the_budget_are_refused_unread_and_small_ones_are_answered_once_room_frees(job, reference):
    feeds, small = request(2)
    assert np.array_equal(scores(call(job.grpc, small)), reference.run(feeds)["scores"])  # warm
    holders = [Holder(job.grpc, request(1, seed=i)[1]) for i in range(MAX_BUFFERED_MB // MAX_REQUEST_MB)]
    try:
        # the holders' reservations take the whole budget: a small call is refused too (its size is unknown
        # until read, so it needs room for max_request_mb)
        wait_for(lambda: refused_for_the_budget(call(job.grpc, small)), timeout=60,
                 what="the holders to take the whole budget")
        large = [request(LARGE_ROWS, seed=100 + i)[1] for i in range(24)]
        with PeakRss(job.proc.pid) as rss, ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda req: call(job.grpc, req), large))  # 24 x 4 MiB, each on its own channel
        assert all(refused_for_the_budget(a) for a in answers), [a for a in answers if not refused_for_the_budget(a)]
        # none of the 96 MiB was taken in: what grpc's flow-control windows hold is all it cost
        assert rss.growth_mb < 16, (rss.before, rss.peak)
        for holder in holders:
            holder.release()
        for i, holder in enumerate(holders):  # the held calls are answered once their messages come
            assert np.array_equal(scores(holder.future.result(timeout=120)),
                                  reference.run(request(1, seed=i)[0])["scores"])
    finally:
        for holder in holders:
            holder.close()
    # the budget is whole again: small and large calls are answered
    assert np.array_equal(scores(call(job.grpc, small)), reference.run(feeds)["scores"])
    feeds_large, large_req = request(LARGE_ROWS, seed=7)
    assert np.array_equal(scores(call(job.grpc, large_req)), reference.run(feeds_large)["scores"])


def test_a_flood_of_large_calls_keeps_the_job_bounded_and_every_answer_right(job, reference):
    """24 large calls and small ones at once: each is answered correctly or refused for the budget, and the
    job grows by far less than the flood's 96 MiB times the copies each taken message costs."""
    large = [request(LARGE_ROWS, seed=200 + i) for i in range(24)]
    small = [request(2, seed=300 + i) for i in range(24)]
    flood = [x for pair in zip(large, small) for x in pair]
    with PeakRss(job.proc.pid) as rss, ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(lambda item: call(job.grpc, item[1]), flood))
    refused = 0
    for (feeds, _), answer in zip(flood, answers):
        if refused_for_the_budget(answer):
            refused += 1
            continue
        assert not isinstance(answer, grpc.RpcError), answer
        assert np.array_equal(scores(answer), reference.run(feeds)["scores"])
    assert refused < len(flood)
    # at most 4 messages of 4 MiB are held at once, each copied a few times while decoded and batched
    assert rss.growth_mb < 6 * MAX_BUFFERED_MB, (rss.before, rss.peak, refused)
    for feeds, req in small[:4]:  # and after it, every small call is answered
        assert np.array_equal(scores(call(job.grpc, req)), reference.run(feeds)["scores"])


def test_a_message_that_never_comes_is_cut_off_after_body_timeout_s_and_frees_its_room(model, reference, tmp_path):
    j = budget_job(model, tmp_path, body_timeout_s=2)
    try:
        holders = [Holder(j.grpc, request(1)[1]) for _ in range(MAX_BUFFERED_MB // MAX_REQUEST_MB)]
        try:
            for holder in holders:
                with pytest.raises(grpc.RpcError) as err:
                    holder.future.result(timeout=120)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
                assert "body_timeout_s" in err.value.details()
        finally:
            for holder in holders:
                holder.close()
        feeds, small = request(3)
        assert np.array_equal(scores(call(j.grpc, small)), reference.run(feeds)["scores"])
    finally:
        assert j.stop() == 0
