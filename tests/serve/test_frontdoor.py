"""The v2 REST front door on a real port: plain httpx JSON and tritonclient (binary extension)."""
import asyncio
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from reamer.serve.backends import open_backend
from reamer.serve.runtime.batcher import DynamicBatcher
from reamer.serve.doors.http_server import FrontDoor
from reamer.serve.doors.rest import V2App
from reamer.serve.protocol.v2wire import HEADER_LENGTH
from reamer.serve.models import build_model
from reamer.serve.spec import InstanceSpec
from reamer.serve.runtime.instances import InstanceWorker
from tests.conftest import wait_for

CPU = sorted(os.sched_getaffinity(0))[-1]


class Served:
    """A batcher + front door running on an event loop in a background thread."""

    def __init__(self, model_path, tmp_path, slo_ms=None, max_batch=4, limits=None):
        self.worker = InstanceWorker(0, InstanceSpec([CPU], 1, max_batch), model_path, run_dir=str(tmp_path))
        self.worker.start()
        self.batcher = DynamicBatcher(slo_ms=slo_ms, name="mio")
        self.door = FrontDoor(V2App("mio", self.batcher, limits=limits), "127.0.0.1", 0)
        self.url = f"127.0.0.1:{self.door.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()
        wait_for(lambda: self.door.started, what="front door to start")

    async def _main(self):
        self.batcher.add_instance(self.worker)
        await self.door.serve()
        await self.batcher.close()

    def close(self):
        if self.worker.alive:
            os.kill(self.worker.pid, signal.SIGCONT)
        self.loop.call_soon_threadsafe(self.door.request_stop)
        self.thread.join(30)
        self.worker.stop(grace_s=5)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("multi-io", tmp_path_factory.mktemp("m") / "mio.onnx").path


@pytest.fixture(scope="module")
def reference(model):
    ref = open_backend("onnxruntime", model, 1)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """One server for the module (starting one costs seconds); the crash test, last, checks recovery."""
    s = Served(model, tmp_path_factory.mktemp("run"))
    yield s
    s.close()


def _inputs(batch, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 8)).astype(np.float32), "ids": rng.integers(0, 10, (batch, 4))}


def test_health_and_metadata(served):
    with httpx.Client(base_url=f"http://{served.url}") as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").status_code == 200
        assert c.get("/v2").json()["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]
        meta = c.get("/v2/models/mio").json()
        assert meta["name"] == "mio" and meta["platform"] == "onnxruntime_onnx"
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8]},
                                  {"name": "ids", "datatype": "INT64", "shape": [-1, 4]}]
        assert [o["name"] for o in meta["outputs"]] == ["scores", "id_sum"]
        assert c.get("/v2/models/mio/ready").status_code == 200
        r = c.get("/v2/models/other")
        assert r.status_code == 404 and "unknown model 'other'" in r.json()["error"]
    client = triton.InferenceServerClient(served.url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mio")
    assert client.get_model_metadata("mio")["inputs"][1]["datatype"] == "INT64"


def test_json_infer_with_httpx_matches_the_model(served, reference):
    feeds = _inputs(3)
    body = {"id": "r1", "inputs": [
        {"name": "x", "shape": [3, 8], "datatype": "FP32", "data": feeds["x"].tolist()},  # nested
        {"name": "ids", "shape": [3, 4], "datatype": "INT64", "data": feeds["ids"].ravel().tolist()},  # flat
    ]}
    r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "r1" and out["model_name"] == "mio"
    by_name = {o["name"]: o for o in out["outputs"]}
    want = reference.run(feeds)
    assert by_name["scores"]["shape"] == [3, 4] and by_name["scores"]["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(by_name["scores"]["data"]).reshape(3, 4), want["scores"], rtol=1e-5)
    assert by_name["id_sum"]["data"] == want["id_sum"].ravel().tolist()


def test_binary_output_on_request_parameter(served, reference):
    feeds = _inputs(2, seed=4)
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32" if n == "x" else "INT64",
                        "data": a.ravel().tolist()} for n, a in feeds.items()],
            "outputs": [{"name": "scores"}, {"name": "id_sum", "parameters": {"binary_data": False}}],
            "parameters": {"binary_data_output": True}}
    r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    n = int(r.headers[HEADER_LENGTH])
    head = json.loads(r.content[:n])
    scores, id_sum = head["outputs"]
    assert scores["parameters"]["binary_data_size"] == 2 * 4 * 4 and "data" not in scores
    got = np.frombuffer(r.content[n:], dtype="<f4").reshape(2, 4)
    np.testing.assert_allclose(got, reference.run(feeds)["scores"], rtol=1e-5)
    assert id_sum["data"] == reference.run(feeds)["id_sum"].ravel().tolist()


def test_tritonclient_binary_in_and_out(served, reference):
    client = triton.InferenceServerClient(served.url)
    feeds = _inputs(5, seed=2)
    ins = []
    for name, dt in (("x", "FP32"), ("ids", "INT64")):
        i = triton.InferInput(name, list(feeds[name].shape), dt)
        i.set_data_from_numpy(feeds[name])  # binary by default
        ins.append(i)
    res = client.infer("mio", ins)  # no outputs named: all come back binary
    want = reference.run(feeds)
    np.testing.assert_allclose(res.as_numpy("scores"), want["scores"], rtol=1e-5)
    np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])
    # Mixed: JSON input, one output asked for as JSON.
    ins[0].set_data_from_numpy(feeds["x"], binary_data=False)
    res = client.infer("mio", ins, outputs=[triton.InferRequestedOutput("id_sum", binary_data=False)])
    np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])
    assert res.as_numpy("scores") is None


@pytest.mark.parametrize("mutate, words", [
    (lambda b: b["inputs"][0].update(name="nope"), "unknown input 'nope'"),
    (lambda b: b["inputs"][0].update(shape=[2, 7]), "shape [2, 7]"),
    (lambda b: b["inputs"][1].update(datatype="FP32"), "expects INT64"),
    (lambda b: b["inputs"].pop(), "missing input"),
    (lambda b: b["inputs"][0].update(data=[1.0, 2.0]), "do not fill"),
    (lambda b: b.update(outputs=[{"name": "nah"}]), "unknown output 'nah'"),
])
def test_bad_requests_get_400_with_a_message(served, mutate, words):
    feeds = _inputs(2)
    body = {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32", "data": feeds["x"].ravel().tolist()},
                       {"name": "ids", "shape": [2, 4], "datatype": "INT64", "data": feeds["ids"].ravel().tolist()}]}
    mutate(body)
    r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_malformed_bodies_and_tritonclient_errors(served):
    url = f"http://{served.url}/v2/models/mio/infer"
    r = httpx.post(url, content=b"{nope", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = httpx.post(url, content=b"{}", headers={HEADER_LENGTH: "99"}, timeout=30)
    assert r.status_code == 400 and HEADER_LENGTH in r.json()["error"]
    r = httpx.post(f"http://{served.url}/v2/models/zzz/infer", json={"inputs": []}, timeout=30)
    assert r.status_code == 404 and "zzz" in r.json()["error"]
    client = triton.InferenceServerClient(served.url)
    x = triton.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("mio", [x])


def test_over_capacity_is_a_503_with_the_reason(served):
    url = f"http://{served.url}/v2/models/mio/infer"
    feeds = _inputs(1)
    body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": feeds["x"].ravel().tolist()},
                       {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": feeds["ids"].ravel().tolist()}]}
    w, b = served.worker, served.batcher
    os.kill(w.pid, signal.SIGSTOP)
    b.slo_ms, w.latency_ewma_s = 1000.0, 2.0  # as if a batch had measured 2 s: nothing new can meet 1 s
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, url, json=body, timeout=60)
            wait_for(lambda: w.busy, what="request in flight")
            r = httpx.post(url, json=body, timeout=60)
            os.kill(w.pid, signal.SIGCONT)
            assert held.result().status_code == 200
    finally:
        os.kill(w.pid, signal.SIGCONT)
        b.slo_ms = None
    assert r.status_code == 503 and "over capacity" in r.json()["error"] and "SLO" in r.json()["error"]


def test_worker_killed_mid_request_gives_clear_503_then_recovers(served):
    url = f"http://{served.url}/v2/models/mio/infer"
    feeds = _inputs(1)
    body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": feeds["x"].ravel().tolist()},
                       {"name": "ids", "shape": [1, 4], "datatype": "INT64", "data": feeds["ids"].ravel().tolist()}]}
    w = served.worker
    old = w.pid
    os.kill(old, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, url, json=body, timeout=60)
        wait_for(lambda: w.busy, what="request in flight")
        os.kill(old, signal.SIGKILL)
        r = fut.result()
    assert r.status_code == 503
    assert "instance 0 crashed" in r.json()["error"] and "retry" in r.json()["error"]
    wait_for(lambda: w.ready and w.pid != old, timeout=60, what="worker restart")
    assert httpx.get(f"http://{served.url}/v2/health/ready").status_code == 200
    assert httpx.post(url, json=body, timeout=60).status_code == 200


def test_a_repeated_binary_header_is_decoded_from_the_plan_cache_with_the_same_result():
    from reamer.serve.protocol.rest_codec import decode_request
    from reamer.serve.protocol.tensors import TensorInfo

    ins = [TensorInfo("x", "FP32", [-1, 8]), TensorInfo("ids", "INT64", [-1, 4])]
    outs = [TensorInfo("scores", "FP32", [-1, 3])]
    feeds = _inputs(2)
    head = json.dumps({"inputs": [
        {"name": "x", "shape": [2, 8], "datatype": "FP32", "parameters": {"binary_data_size": 64}},
        {"name": "ids", "shape": [2, 4], "datatype": "INT64", "parameters": {"binary_data_size": 64}}],
        "outputs": [{"name": "scores", "parameters": {"binary_data": True}}]}).encode()
    plans = {}
    first = decode_request(head + feeds["x"].tobytes() + feeds["ids"].tobytes(), len(head), ins, outs, plans)
    assert list(plans) == [head]
    other = _inputs(2, seed=5)
    again = decode_request(head + other["x"].tobytes() + other["ids"].tobytes(), len(head), ins, outs, plans)
    for name in feeds:
        np.testing.assert_array_equal(first.inputs[name], feeds[name])
        np.testing.assert_array_equal(again.inputs[name], other[name])
        assert again.inputs[name].dtype == feeds[name].dtype and again.inputs[name].shape == feeds[name].shape
    assert again.outputs == first.outputs == [("scores", True)]
    # a body of the wrong length behind a cached header still gets the precise error
    with pytest.raises(Exception, match="binary bytes that no input claims"):
        decode_request(head + other["x"].tobytes() + other["ids"].tobytes() + b"xx", len(head), ins, outs, plans)
    # requests with an id, or JSON data, are never cached
    with_id = json.dumps({"id": "7", "inputs": json.loads(head)["inputs"]}).encode()
    decode_request(with_id + feeds["x"].tobytes() + feeds["ids"].tobytes(), len(with_id), ins, outs, plans)
    assert list(plans) == [head]


def test_a_repeated_binary_response_reuses_its_encoded_head_byte_for_byte():
    from reamer.serve.protocol.rest_codec import DecodedRequest, encode_response
    from reamer.serve.protocol.tensors import TensorInfo

    outs = [TensorInfo("scores", "FP32", [-1, 3]), TensorInfo("ids", "INT64", [-1])]
    rng = np.random.default_rng(3)
    heads = {}
    binary = DecodedRequest(id=None, inputs={}, outputs=None, binary_default=True)
    for batch in (2, 2, 5, 2):
        result = {"scores": rng.standard_normal((batch, 3)).astype(np.float32),
                  "ids": rng.integers(0, 9, batch).astype(np.int64)}
        assert encode_response("m", binary, result, outs, heads) == encode_response("m", binary, result, outs)
    assert len(heads) == 2  # one head per shape
    # JSON outputs, mixed ones and requests with an id are encoded afresh and not cached
    for decoded in (DecodedRequest(id=None, inputs={}, outputs=None, binary_default=False),
                    DecodedRequest(id=None, inputs={}, outputs=[("scores", True), ("ids", False)], binary_default=False),
                    DecodedRequest(id="7", inputs={}, outputs=None, binary_default=True)):
        assert encode_response("m", decoded, result, outs, heads) == encode_response("m", decoded, result, outs)
    assert len(heads) == 2


def _json_body(batch=1):
    feeds = _inputs(batch)
    return {"inputs": [{"name": "x", "shape": [batch, 8], "datatype": "FP32", "data": feeds["x"].ravel().tolist()},
                       {"name": "ids", "shape": [batch, 4], "datatype": "INT64", "data": feeds["ids"].ravel().tolist()}]}


def _read_response(s, buf: bytes = b""):
    """One HTTP response from socket `s` (after the bytes already in `buf`), read by its Content-Length:
    (status line, headers, body, the bytes after it); None when the connection closes first."""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(1 << 16)
        if not chunk:
            return None
        buf += chunk
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    need = int(headers.get("content-length", "0"))
    while len(buf) < need:
        buf += s.recv(1 << 20)
    return lines[0], headers, buf[:need], buf[need:]


def _raw_exchange(url, payload: bytes, responses: int, timeout=30.0) -> list[tuple[int, dict, bytes]]:
    """Send raw bytes on one connection; read `responses` HTTP responses (by Content-Length)."""
    import socket

    host, port = url.split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(payload)
        buf = b""
        while len(out) < responses:
            answer = _read_response(s, buf)
            if answer is None:
                return out
            status_line, headers, body, buf = answer
            out.append((int(status_line.split()[1]), headers, body))
    return out


def test_infer_reports_server_timing(served):
    r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=_json_body(), timeout=30)
    assert r.status_code == 200
    parts = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
    assert set(parts) == {"queue", "compute", "total"}
    assert 0 < float(parts["compute"]) <= float(parts["total"])


def test_wrong_method_and_unknown_path_get_405_and_404(served):
    r = httpx.get(f"http://{served.url}/v2/models/mio/infer", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "takes POST" in r.json()["error"]
    r = httpx.get(f"http://{served.url}/metrics", timeout=30)
    assert r.status_code == 404 and "/v2" in r.json()["error"]


def test_oversized_request_gets_413_and_the_job_keeps_serving(served):
    served.door.max_request_bytes = 2000
    try:
        r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=_json_body(batch=20), timeout=30)
        assert r.status_code == 413
        assert "limit of 2000 bytes" in r.json()["error"] and "max_request_mb" in r.json()["error"]
        # a client that waits for 100-continue is refused before it sends the body, and the connection closes
        head = ("POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 5000\r\nExpect: 100-continue\r\n\r\n").encode()
        [(status, headers, body)] = _raw_exchange(served.url, head, 1)
        assert status == 413 and headers.get("connection") == "close"
        assert httpx.post(f"http://{served.url}/v2/models/mio/infer", json=_json_body(), timeout=30).status_code == 200
    finally:
        served.door.max_request_bytes = 64 << 20


def test_pipelined_requests_are_answered_in_order_and_chunked_bodies_are_read(served):
    body = json.dumps(_json_body()).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 100]), body[i:i + 100]) for i in range(0, len(body), 100))
    payload = (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
               b"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n"
               b"GET /v2/models/nope HTTP/1.1\r\nHost: x\r\n\r\n")
    answers = _raw_exchange(served.url, payload, 3)
    assert [a[0] for a in answers] == [200, 200, 404]
    assert json.loads(answers[0][2]) == {"live": True}
    assert {o["name"] for o in json.loads(answers[1][2])["outputs"]} == {"scores", "id_sum"}


def _binary_request(feeds, close=False) -> bytes:
    head = json.dumps({"inputs": [
        {"name": k, "shape": list(a.shape), "datatype": {"float32": "FP32", "int64": "INT64"}[a.dtype.name],
         "parameters": {"binary_data_size": a.nbytes}} for k, a in feeds.items()],
        "parameters": {"binary_data_output": True}}).encode()
    body = head + b"".join(a.tobytes() for a in feeds.values())
    return (f"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"{HEADER_LENGTH}: {len(head)}\r\nContent-Length: {len(body)}\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n").encode() + body


def _binary_outputs(headers, body) -> dict:
    head_len = int(headers[HEADER_LENGTH.lower()])
    out, offset = {}, head_len
    for o in json.loads(body[:head_len])["outputs"]:
        size = o["parameters"]["binary_data_size"]
        dtype = {"FP32": np.float32, "INT64": np.int64}[o["datatype"]]
        out[o["name"]] = np.frombuffer(body[offset:offset + size], dtype).reshape(o["shape"])
        offset += size
    assert offset == len(body)
    return out


def test_all_binary_answers_come_from_the_instance_in_order_with_pipelining(served, reference):
    before = served.worker.answered_directly
    first, second = _inputs(2, seed=11), _inputs(3, seed=12)
    payload = (_binary_request(first) + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
               + _binary_request(second))
    answers = _raw_exchange(served.url, payload, 3)
    assert [a[0] for a in answers] == [200, 200, 200]
    assert json.loads(answers[1][2]) == {"live": True}
    for (status, headers, body), feeds in ((answers[0], first), (answers[2], second)):
        got = _binary_outputs(headers, body)
        want = reference.run(feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
        timing = dict(part.strip().split(";dur=") for part in headers["server-timing"].split(","))
        assert 0 <= float(timing["compute"]) <= float(timing["total"])
    # the instance's answer can reach the client before the job has read the instance's note that it answered
    wait_for(lambda: served.worker.answered_directly == before + 2, timeout=10, what="the instance's two answers counted")
    # JSON outputs are encoded by the job
    r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=_json_body(), timeout=30)
    assert r.status_code == 200 and served.worker.answered_directly == before + 2


def test_an_instance_answer_keeps_connection_close_and_leaves_a_slow_readers_rest_to_the_job(
        served, model, reference, tmp_path):
    import socket
    import time

    [(status, headers, body)] = _raw_exchange(served.url, _binary_request(_inputs(1), close=True), 1)
    assert status == 200 and headers.get("connection") == "close"
    # an answer larger than the socket buffers, in one batch, to a client that starts reading late
    feeds = _inputs(150_000, seed=3)
    big = Served(model, tmp_path, max_batch=150_000)
    try:
        before = big.worker.answered_directly
        host, port = big.url.split(":")
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(_binary_request(feeds))
            time.sleep(1.0)
            _, headers, buf, _ = _read_response(s)
        wait_for(lambda: big.worker.answered_directly == before + 1, timeout=10, what="the instance's answer counted")
    finally:
        big.close()
    got = _binary_outputs(headers, buf)
    want = reference.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5)


def test_a_batch_over_max_batch_is_split_and_answered_as_one(served, reference):
    """max_batch is 4: a request of 11 samples runs as 4 + 4 + 3 and comes back whole, by the job."""
    before = served.worker.answered_directly
    feeds = _inputs(11, seed=9)
    [(status, headers, body)] = _raw_exchange(served.url, _binary_request(feeds), 1)
    assert status == 200
    got, want = _binary_outputs(headers, body), reference.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
    assert served.worker.answered_directly == before  # a split answer is assembled by the job


def test_concurrent_binary_and_json_clients_each_get_their_own_answers(served, reference):
    """Batched requests are answered by the job, lone ones by the instance: under concurrency on keep-alive
    connections, every client still gets exactly its own answers, in order."""
    import socket

    def client(seed: int) -> int:
        host, port = served.url.split(":")
        checked = 0
        with socket.create_connection((host, int(port)), timeout=60) as s:
            for i in range(15):
                feeds = _inputs(1 + (seed + i) % 3, seed=seed * 100 + i)
                s.sendall(_binary_request(feeds))
                answer = _read_response(s)
                assert answer is not None, "connection closed"
                status_line, headers, buf, _ = answer
                assert status_line.startswith("HTTP/1.1 200") and len(buf) == int(headers["content-length"])
                got, want = _binary_outputs(headers, buf), reference.run(feeds)
                for name in want:
                    np.testing.assert_allclose(got[name], want[name], rtol=1e-5)
                checked += 1
        return checked

    def json_client(seed: int) -> int:
        with httpx.Client(base_url=f"http://{served.url}", timeout=60) as c:
            for i in range(10):
                batch = 1 + i % 2
                r = c.post("/v2/models/mio/infer", json=_json_body(batch))
                assert r.status_code == 200
                out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
                want = reference.run(_inputs(batch))
                for name in want:
                    np.testing.assert_allclose(out[name], want[name], rtol=1e-5)
        return 10

    before = served.worker.answered_directly
    with ThreadPoolExecutor(6) as pool:
        done = [f.result() for f in [pool.submit(client, k) for k in range(4)] + [pool.submit(json_client, k) for k in range(2)]]
    assert done == [15] * 4 + [10] * 2
    assert served.worker.answered_directly > before  # some lone binary requests went through the instance


def test_a_pipelined_100_continue_comes_after_the_answer_before_it(served):
    import socket

    first = _binary_request(_inputs(1, seed=4))
    body = json.dumps(_json_body()).encode()
    second_head = (f"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n").encode()
    host, port = served.url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(first + second_head)
        status_line, _, _, rest = _read_response(s)
        assert status_line == "HTTP/1.1 200 OK"  # the first answer, not the 100 for the second
        continue_line = b"HTTP/1.1 100 Continue\r\n\r\n"
        while len(rest) < len(continue_line):
            rest += s.recv(1 << 16)
        assert rest.startswith(continue_line)
        s.sendall(body)
        status_line, _, _, _ = _read_response(s, rest[len(continue_line):])
        assert status_line == "HTTP/1.1 200 OK"


def test_worker_killed_during_an_instance_answered_request_gives_503(served):
    w = served.worker
    old = w.pid
    os.kill(old, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_raw_exchange, served.url, _binary_request(_inputs(1)), 1, 60)
        wait_for(lambda: w.busy, what="request in flight")
        os.kill(old, signal.SIGKILL)
        [(status, headers, body)] = fut.result()
    assert status == 503 and b"crashed" in body
    wait_for(lambda: w.ready and w.pid != old, timeout=60, what="worker restart")
    [(status, _, _)] = _raw_exchange(served.url, _binary_request(_inputs(1)), 1)
    assert status == 200


def test_malformed_http_gets_400_and_a_closed_connection(served):
    [(status, headers, body)] = _raw_exchange(served.url, b"NOT HTTP AT ALL\r\n\r\n", 1)
    assert status == 400 and headers.get("connection") == "close" and b"malformed" in body


def test_a_large_json_body_is_decoded_and_encoded_on_a_helper_thread(served, reference):
    from dataclasses import replace

    app = served.door.app
    limits = app.limits
    app.limits = replace(limits, offload_bytes=1024)
    try:
        threads_before = {t.name for t in threading.enumerate()}
        r = httpx.post(f"http://{served.url}/v2/models/mio/infer", json=_json_body(batch=30), timeout=30)
        assert r.status_code == 200
        out = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
        np.testing.assert_allclose(out["scores"], reference.run(_inputs(30))["scores"], rtol=1e-5)
        assert any(t.name.startswith("json") for t in threading.enumerate()) or any(
            n.startswith("json") for n in threads_before)
    finally:
        app.limits = limits


class _RecordingApp:
    """Answers every request with 200 and keeps what it was given."""

    def __init__(self):
        self.seen = []

    async def handle(self, method, path, headers, body, client=None):
        from reamer.serve.doors.http_framing import Reply

        self.seen.append((method, path, bytes(body)))
        return Reply(200, b"{}")


class _Transport:
    def __init__(self):
        self.written, self.paused = b"", False

    def write(self, data):
        self.written += data

    def writelines(self, parts):
        self.written += b"".join(parts)

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def get_write_buffer_size(self):
        return 0

    def can_write_eof(self):
        return False

    def close(self):
        pass


def _door_with(app, **limits):
    from reamer.serve.doors.http_server import _DoorLog
    from reamer.serve.doors.limits import DoorLimits

    door = FrontDoor.__new__(FrontDoor)
    door.app, door.limits = app, DoorLimits(**limits)
    door.max_request_bytes, door.buffered, door.connections = door.limits.max_request_bytes, 0, set()
    door.log, door.stopping = _DoorLog(), False
    return door


def _receive(conn, data: bytes) -> None:
    """What the event loop does with `data` arriving: into the protocol's buffers, as much as each takes."""
    while data:
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def test_a_large_body_is_read_straight_into_one_buffer_reserved_against_the_budget():
    from reamer.serve.doors.http_server import READ_BYTES, _Connection

    async def main():
        app = _RecordingApp()
        door = _door_with(app, max_buffered_bytes=8 << 20, max_request_bytes=4 << 20)
        conn = _Connection(door)
        conn.transport = _Transport()
        body = os.urandom(3 * READ_BYTES + 123)
        _receive(conn, b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body[:1000])
        # more than a read is left: the rest goes straight into a buffer of the body's size, reserved at once
        assert conn._direct is not None and len(conn._direct) == len(body)
        assert door.buffered == len(body)
        assert len(conn.get_buffer(-1)) == len(body) - 1000  # a read never takes bytes past the body
        _receive(conn, body[1000:] + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(20):
            await asyncio.sleep(0)
        assert [(m, len(b)) for m, _, b in app.seen] == [("POST", len(body)), ("GET", 0)]
        assert app.seen[0][2] == body  # byte for byte, and the parser after it read the next request
        assert conn.transport.written.count(b"HTTP/1.1 200") == 2
        assert door.buffered == 0 and conn.held == 0

        # a small body, or one that would take reservations past half the budget, streams as before
        small = _Connection(door)
        small.transport = _Transport()
        _receive(small, b"POST /x HTTP/1.1\r\nContent-Length: 2000\r\n\r\n" + b"a" * 100)
        assert small._direct is None
        door.buffered = 4 << 20  # half of max_buffered_bytes already held
        held = _Connection(door)
        held.transport = _Transport()
        _receive(held, b"POST /x HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10])
        assert held._direct is None and door.buffered == (4 << 20) + 10

    asyncio.run(main())


def test_a_refused_connection_releases_its_reserved_body():
    from reamer.serve.doors.http_server import READ_BYTES, _Connection

    async def main():
        door = _door_with(_RecordingApp(), max_buffered_bytes=8 << 20, max_request_bytes=4 << 20,
                          body_timeout_s=1.0)
        conn = _Connection(door)
        conn.transport = _Transport()
        _receive(conn, b"POST /x HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (4 * READ_BYTES) + b"z" * 50)
        assert conn._direct is not None and door.buffered == 4 * READ_BYTES
        conn.expired(conn._since + 5.0)  # the body stalled past body_timeout_s: 408
        for _ in range(20):
            await asyncio.sleep(0)
        assert b"HTTP/1.1 408" in conn.transport.written and b"body_timeout_s" in conn.transport.written
        assert door.buffered == 0 and conn._direct is None
        _receive(conn, b"z" * 100)  # what still comes is dropped, into the small read buffer
        assert door.buffered == 0

    asyncio.run(main())
