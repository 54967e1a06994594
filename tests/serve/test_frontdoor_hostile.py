"""The REST front door of a real online job process (uvloop, `python -m reamer.serve.runtime.job`) under hostile
clients on loopback: slowloris, stalled bodies, clients that never read, oversized URLs, headers and bodies,
deep JSON, malformed fields, more connections than the cap. Every test keeps a normal tritonclient client
inferring meanwhile, and asserts what a client sees (status, a closed connection) and that the job's
memory stays bounded; never how fast. Loops are bounded; limits are small so the timeouts are short."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import psutil
import pytest
import tritonclient.http as triton

from reamer.serve.backends import open_backend
from reamer.serve.models import build_model
from reamer.serve.spec import JobSpec
from tests.conftest import wait_for
from tests.serve.jobs import RunningJob

MAX_BATCH = 1024
MAX_REQUEST_MB = 1
LIMITS = {"max_connections": 24, "header_timeout_s": 1.5, "body_timeout_s": 1.5, "idle_timeout_s": 3.0,
          "send_timeout_s": 3.0, "max_url_bytes": 1024, "max_header_bytes": 4096, "max_pipelined": 16,
          "max_buffered_mb": 3, "json_offload_kb": 4}
SLACK_S = 20.0  # how long past a timeout a test waits for its effect (a shared, slow machine)


class Job(RunningJob):
    """An online job process whose stderr is job.log, as the agent runs it."""

    def __init__(self, model: str, tmp_path) -> None:
        super().__init__(model, tmp_path, max_batch=MAX_BATCH, log_path=tmp_path / "job.log", host="127.0.0.1",
                         max_request_mb=MAX_REQUEST_MB, frontdoor=LIMITS)
        self.port = self.status.port
        self.url = self.rest
        self.process = psutil.Process(self.proc.pid)
        self.rss_at_start = self.rss()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def server_side(self, client: socket.socket) -> psutil._common.pconn | None:
        """The job's end of `client`'s connection, while it is open."""
        port = client.getsockname()[1]
        for c in self.process.net_connections("tcp"):
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED:
                return c
        return None

    def unread_bytes(self, client: socket.socket) -> int:
        """Bytes `client` sent that the job has not read yet (its socket's receive queue)."""
        port = client.getsockname()[1]
        with open("/proc/net/tcp") as fh:
            for line in fh.readlines()[1:]:
                parts = line.split()
                local, remote = parts[1], parts[2]
                if int(local.split(":")[1], 16) == self.port and int(remote.split(":")[1], 16) == port:
                    return int(parts[4].split(":")[1], 16)
        return 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("multi-io", tmp_path_factory.mktemp("m") / "mio.onnx").path


@pytest.fixture(scope="module")
def reference(model):
    ref = open_backend("onnxruntime", model, 1)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def job(model, tmp_path_factory):
    j = Job(model, tmp_path_factory.mktemp("job"))
    yield j
    j.stop()


def _inputs(batch, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 8)).astype(np.float32), "ids": rng.integers(0, 10, (batch, 4))}


@contextmanager
def normal_client(job, reference):
    """A tritonclient client inferring (JSON and binary tensors) on one keep-alive connection all along."""
    stop = threading.Event()
    done, errors = [], []

    def run():
        client = triton.InferenceServerClient(job.url, network_timeout=60.0)
        i = 0
        while not stop.is_set() and i < 2000:
            feeds = _inputs(1 + i % 3, seed=i)
            ins = []
            for name, dt in (("x", "FP32"), ("ids", "INT64")):
                inp = triton.InferInput(name, list(feeds[name].shape), dt)
                inp.set_data_from_numpy(feeds[name], binary_data=bool(i % 2))
                ins.append(inp)
            try:
                res = client.infer("mio", ins, outputs=[triton.InferRequestedOutput("scores", binary_data=bool(i % 2))])
                np.testing.assert_allclose(res.as_numpy("scores"), reference.run(feeds)["scores"], rtol=1e-5)
                done.append(i)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"{type(exc).__name__}: {exc}")
            i += 1
            stop.wait(0.05)
        client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
        wait_for(lambda: done or errors, timeout=60, what="the normal client's first answer")
    finally:
        stop.set()
        thread.join(90)
    assert not errors, errors[:3]
    assert done, "the normal client got no answer"


def _connect(job, timeout=SLACK_S) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", job.port), timeout=timeout)
    return s


def _read_all(s: socket.socket, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `limit_s` passes (False)."""
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = s.recv(1 << 16)
        except socket.timeout:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _status_of(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _body_of(data: bytes) -> dict:
    return json.loads(data.partition(b"\r\n\r\n")[2] or b"{}")


def _json_body(batch=1, seed=0) -> dict:
    feeds = _inputs(batch, seed)
    return {"inputs": [{"name": "x", "shape": [batch, 8], "datatype": "FP32", "data": feeds["x"].ravel().tolist()},
                       {"name": "ids", "shape": [batch, 4], "datatype": "INT64", "data": feeds["ids"].ravel().tolist()}]}


def _post(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_slowloris_headers_get_408_and_a_closed_connection(job, reference):
    with normal_client(job, reference), _connect(job) as s:
        s.sendall(b"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\n")
        started, answer, closed = time.monotonic(), b"", False
        for i in range(200):  # a header line every 0.1 s, never the blank line that ends them
            try:
                s.sendall(f"X-Drip-{i}: {i}\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(0.1)
            try:
                chunk = s.recv(1 << 16)
                answer += chunk
                if not chunk:
                    closed = True
                    break
            except socket.timeout:
                pass
            if time.monotonic() - started > LIMITS["header_timeout_s"] + SLACK_S:
                break
        if not closed:
            rest, closed = _read_all(s, SLACK_S)
            answer += rest
    assert _status_of(answer) == 408 and b"header_timeout_s" in answer
    assert closed


def test_a_body_that_never_completes_gets_408_and_a_closed_connection(job, reference):
    with normal_client(job, reference), _connect(job) as s:
        s.sendall(b"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
                  b'{"inputs": [' + b" " * 200)
        answer, closed = _read_all(s, LIMITS["body_timeout_s"] + SLACK_S)
    assert _status_of(answer) == 408 and b"body_timeout_s" in answer
    assert closed


def test_an_idle_keep_alive_connection_is_closed(job):
    with _connect(job) as s, _connect(job) as silent:  # one after an answer, one that never sends a byte
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, closed = _read_all(s, LIMITS["idle_timeout_s"] + SLACK_S)
        nothing, silent_closed = _read_all(silent, SLACK_S)
    assert _status_of(answer) == 200 and closed
    assert nothing == b"" and silent_closed


def test_a_client_that_never_reads_is_paused_then_cut_off_and_memory_stays_bounded(job, reference):
    """Pipelined requests with large JSON answers, never read: the job stops taking the client's requests
    (its unread bytes pile up in the kernel, not in the job), then drops the connection."""
    feeds = _inputs(1000, seed=1)  # binary in, JSON out (about 60 KB): the job writes every answer itself
    head = json.dumps({"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32" if n == "x" else "INT64",
                                   "parameters": {"binary_data_size": a.nbytes}} for n, a in feeds.items()],
                       "outputs": [{"name": "scores"}, {"name": "id_sum"}]}).encode()
    body = head + feeds["x"].tobytes() + feeds["ids"].tobytes()
    request = (f"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: {len(head)}\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    rss_before = job.rss()
    with normal_client(job, reference):
        s = _connect(job)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(0.5)
        sent = 0
        try:
            for _ in range(4000):  # 4000 answers of 60 KB: far more than any buffer here
                s.sendall(request)
                sent += 1
        except (socket.timeout, BlockingIOError):
            pass  # the job stopped reading: back-pressure reached the client
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 4000, "the job read every request of a client that reads nothing"
        wait_for(lambda: job.server_side(s) is None, timeout=LIMITS["send_timeout_s"] + SLACK_S,
                 what="the job to drop a client that reads nothing")
        s.close()
    assert job.rss() - rss_before < 64 << 20
    assert "took none of its answer" in job.log()


def test_pipelining_is_bounded_by_bytes_not_just_count(job, reference):
    """With the instance stopped, pipelined bodies of 0.4 MiB queue up: the job stops reading once they hold
    more than max_request_mb (1 MiB), long before the 16-request limit; all are answered after."""
    worker = job.process.children()[0]
    body = json.dumps(_json_body(batch=1, seed=2)).encode()
    padded = body[:-1] + b" " * (400_000 - len(body)) + b"}"
    count = 8
    with _connect(job, timeout=60) as s:
        worker.suspend()
        try:
            s.sendall(b"".join(_post(padded) for _ in range(count)))
        except socket.timeout:
            pass
        try:
            wait_for(lambda: job.unread_bytes(s) > 0, timeout=SLACK_S,
                     what="the job to leave pipelined bytes unread")
            time.sleep(0.5)
            assert job.unread_bytes(s) > 0  # still paused, not just slow
        finally:
            worker.resume()
        answers = b""
        deadline = time.monotonic() + 60
        while answers.count(b"HTTP/1.1 200") < count and time.monotonic() < deadline:
            s.settimeout(5)
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            answers += chunk
    assert answers.count(b"HTTP/1.1 200") == count


def test_oversized_url_headers_and_bodies(job, reference):
    with normal_client(job, reference):
        with _connect(job) as s:
            s.sendall(b"GET /v2/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, closed = _read_all(s, SLACK_S)
        assert _status_of(answer) == 414 and "max_url_bytes" in _body_of(answer)["error"] and closed
        with _connect(job) as s:
            s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Big-%d: %s\r\n" % (i, b"v" * 500)
                                                                    for i in range(20)) + b"\r\n")
            answer, closed = _read_all(s, SLACK_S)
        assert _status_of(answer) == 431 and "max_header_bytes" in _body_of(answer)["error"] and closed
        with _connect(job) as s:
            s.sendall(b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Long: " + b"v" * 20000 + b"\r\n\r\n")
            answer, closed = _read_all(s, SLACK_S)
        assert _status_of(answer) == 431 and closed
        # a chunked body over max_request_mb: read and dropped, 413, the connection still serves
        chunk = b"x" * 65536
        with _connect(job) as s:
            s.sendall(b"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(20):  # 1.25 MiB
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            s.sendall(b"0\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer, closed = _read_all(s, SLACK_S)
        assert _status_of(answer) == 413 and b"max_request_mb" in answer
        assert answer.count(b"HTTP/1.1 200") == 1 and closed


def test_deeply_nested_json_is_a_400(job):
    nested: object = 1.0
    for _ in range(70):  # within JSON's depth limit, past numpy's 64 dimensions
        nested = [nested]
    for body in (b"[" * 200_000 + b"]" * 200_000,
                 b'{"inputs": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                 json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": nested}]}).encode()):
        with _connect(job) as s:
            s.sendall(_post(body, "Connection: close\r\n"))
            answer, closed = _read_all(s, SLACK_S)
        assert _status_of(answer) == 400, answer[:300]


def _with(mutate):
    body = _json_body(batch=2)
    mutate(body)
    return json.dumps(body).encode()


MALFORMED = [
    ("name-object", lambda b: b["inputs"][0].update(name={}), "inputs[0].name"),
    ("top-parameters-list", lambda b: b.update(parameters=[1, 2]), "parameters is a list"),
    ("input-parameters-list", lambda b: b["inputs"][1].update(parameters=["binary_data_size"]), "input 'ids'.parameters"),
    ("int64-10e30", lambda b: b["inputs"][1].update(data=[10 ** 30] + [1] * 7), "outside the range of INT64"),
    ("int64-fraction", lambda b: b["inputs"][1].update(data=[1.5] + [1] * 7), "not a whole number"),
    ("fp32-strings", lambda b: b["inputs"][0].update(data=["a"] * 16), "input 'x'.data"),
    ("fp32-objects", lambda b: b["inputs"][0].update(data=[{}] * 16), "input 'x'.data"),
    ("ragged", lambda b: b["inputs"][0].update(data=[[1.0] * 8, [1.0] * 7]), "input 'x'.data"),
    ("fp32-overflow", lambda b: b["inputs"][0].update(data=[1e300] * 16), "too large for FP32"),
    ("datatype-wrong", lambda b: b["inputs"][0].update(datatype="INT8"), "input 'x' has datatype 'INT8'"),
    ("datatype-object", lambda b: b["inputs"][0].update(datatype={"a": 1}), "input 'x' has datatype an object"),
    ("shape-wrong", lambda b: b["inputs"][0].update(shape=[2, 9]), "input 'x' has shape [2, 9]"),
    ("shape-string", lambda b: b["inputs"][0].update(shape="2,8"), "input 'x' has shape a string"),
    ("shape-huge", lambda b: b["inputs"][0].update(shape=[10 ** 12, 8]), "input 'x' has shape [1000000000000, 8]"),
    ("data-short", lambda b: b["inputs"][0].update(data=[1.0] * 15), "input 'x': 15 values do not fill"),
    ("binary-size-bool", lambda b: b["inputs"][0].update(parameters={"binary_data_size": True}), "binary_data_size"),
    ("id-object", lambda b: b.update(id={"a": 1}), "id is an object"),
    ("outputs-object", lambda b: b.update(outputs={"name": "scores"}), "outputs is an object"),
    ("output-name-list", lambda b: b.update(outputs=[{"name": ["scores"]}]), "outputs[0].name"),
    ("binary-output-string", lambda b: b.update(parameters={"binary_data_output": "yes"}), "parameters.binary_data_output"),
    ("inputs-not-objects", lambda b: b.update(inputs=[1, 2]), "inputs[0] is a number"),
]


@pytest.mark.parametrize("case, mutate, words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_field_is_a_400_naming_it_logged_once_without_a_traceback(job, case, mutate, words):
    marker = f"case-{case}-{os.getpid()}"
    with _connect(job) as s:
        s.sendall(_post(_with(mutate), "Connection: close\r\n").replace(
            b"/v2/models/mio/infer", f"/v2/models/mio/infer?{marker}".encode(), 1))
        answer, closed = _read_all(s, SLACK_S)
    assert _status_of(answer) == 400, answer[:400]
    message = _body_of(answer)["error"]
    assert words in message and "fix:" in message
    lines = wait_for(lambda: [ln for ln in job.log().splitlines() if marker in ln], timeout=10,
                     what="the refusal in job.log")
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("reamer job: 400 POST")
    assert "Traceback" not in job.log()


def test_more_connections_than_the_cap_are_refused_with_503_and_the_job_keeps_serving(job, reference):
    cap = LIMITS["max_connections"]
    with normal_client(job, reference):
        time.sleep(0.5)  # the normal client holds its connection before the flood
        held, refused = [], 0
        try:
            for _ in range(cap + 10):
                s = _connect(job)
                held.append(s)
            time.sleep(0.5)
            for s in held:
                s.setblocking(False)
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                if _status_of(data) == 503:
                    assert "max_connections" in _body_of(data)["error"]
                    refused += 1
        finally:
            for s in held:
                s.close()
        assert refused >= 10  # the cap counts the normal client's connection too
    # once they are gone, new connections are served
    wait_for(lambda: len([c for c in job.process.net_connections("tcp")
                          if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == job.port]) < cap,
             timeout=SLACK_S, what="the flood's connections to close")
    with _connect(job) as s:
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer, _ = _read_all(s, SLACK_S)
    assert _status_of(answer) == 200


def test_a_large_json_request_is_decoded_off_the_loop_and_the_job_stays_live(job, reference):
    """A JSON body over json_offload_kb (4 KiB here) gets the same answer; health stays answerable."""
    feeds = _inputs(3000, seed=7)
    client = triton.InferenceServerClient(job.url, network_timeout=120.0)
    ins = []
    for name, dt in (("x", "FP32"), ("ids", "INT64")):
        inp = triton.InferInput(name, list(feeds[name].shape), dt)
        inp.set_data_from_numpy(feeds[name], binary_data=False)
        ins.append(inp)
    res = client.infer("mio", ins, outputs=[triton.InferRequestedOutput("scores", binary_data=False),
                                            triton.InferRequestedOutput("id_sum", binary_data=False)])
    want = reference.run(feeds)
    np.testing.assert_allclose(res.as_numpy("scores"), want["scores"], rtol=1e-5)
    np.testing.assert_array_equal(res.as_numpy("id_sum"), want["id_sum"])
    assert client.is_server_live()
    client.close()


def _binary_request(feeds: dict, extra: str = "") -> tuple[bytes, bytes]:
    """(head of the HTTP request, its body): binary tensors in, JSON outputs back."""
    head = json.dumps({"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32" if n == "x" else "INT64",
                                   "parameters": {"binary_data_size": a.nbytes}} for n, a in feeds.items()],
                       "outputs": [{"name": "scores"}, {"name": "id_sum"}]}).encode()
    body = head + feeds["x"].tobytes() + feeds["ids"].tobytes()
    return (f"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: {len(head)}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode(), body


def test_a_large_body_arriving_in_pieces_is_answered_and_the_pipelined_request_after_it_too(job, reference):
    """Headers first, then a 66 KB body in pieces (read straight into its buffer: more than a read is left
    after the headers), then a pipelined request: both answered, the first with the model's numbers."""
    feeds = _inputs(1024, seed=11)
    head, body = _binary_request(feeds)
    with _connect(job) as s:
        s.sendall(head)
        time.sleep(0.2)
        for at in range(0, len(body), 20_000):
            s.sendall(body[at:at + 20_000])
            time.sleep(0.05)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer, closed = _read_all(s, SLACK_S)
    first, _, rest = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in first.split(b"\r\n") if line.lower().startswith(
        b"content-length")))
    outputs = {o["name"]: o for o in json.loads(rest[:length])["outputs"]}
    want = reference.run(feeds)
    np.testing.assert_allclose(np.array(outputs["scores"]["data"]).reshape(want["scores"].shape), want["scores"],
                               rtol=1e-5)
    assert _status_of(answer) == 200 and _status_of(rest[length:]) == 200 and b'"live":true' in rest[length:]
    assert closed


def test_a_large_body_that_stalls_gets_408_and_its_reservation_is_released(job, reference):
    with normal_client(job, reference), _connect(job) as s:
        s.sendall(b"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 500000\r\n\r\n"
                  b'{"inputs": [' + b" " * 200)
        answer, closed = _read_all(s, LIMITS["body_timeout_s"] + SLACK_S)
    assert _status_of(answer) == 408 and b"body_timeout_s" in answer
    assert closed


def test_bodies_announced_but_not_sent_cannot_take_the_budget_from_one_that_is_sent(job, reference):
    """Four connections announce 0.9 MiB bodies and trickle a byte now and then (their stall clocks never run
    out); a 0.5 MiB request on a fifth is still answered: buffers reserved ahead of their bytes may hold at
    most half of max_buffered_mb (3 MiB), so at most one of the four holds one."""
    announced = [_connect(job, timeout=60) for _ in range(4)]
    body = json.dumps(_json_body(batch=1, seed=5)).encode()
    padded = body[:-1] + b" " * (500_000 - len(body)) + b"}"
    try:
        for s in announced:
            s.sendall(b"POST /v2/models/mio/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 900000\r\n\r\n"
                      b'{"inputs": [')
        time.sleep(0.3)
        for s in announced:
            s.sendall(b" ")
        with _connect(job, timeout=60) as s:
            s.sendall(_post(padded, "Connection: close\r\n"))
            answer, _ = _read_all(s, SLACK_S)
            for other in announced:
                other.sendall(b" ")
    finally:
        for s in announced:
            s.close()
    assert _status_of(answer) == 200, answer[:300]


def test_memory_of_the_job_stays_bounded_after_all_of_it(job):
    # after the hostile tests above, the job holds no more than a few of its request limits (1 MiB) more
    grown = job.rss() - job.rss_at_start
    assert grown < 128 << 20, f"the job grew by {grown >> 20} MiB"
    assert job.proc.poll() is None


def test_job_log_is_copied_aside_and_truncated_past_its_limit(tmp_path):
    from reamer.serve.runtime.joblog import bound_log

    path = tmp_path / "job.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # as the agent opens it
    try:
        os.write(fd, b"old line\n" * 200)
        assert not bound_log(fd, 4096)
        os.write(fd, b"old line\n" * 400)
        assert bound_log(fd, 4096)
        assert (tmp_path / "job.log.1").read_bytes() == b"old line\n" * 600
        os.write(fd, b"new line\n")  # an O_APPEND writer goes on at the new end
        assert path.read_bytes() == b"new line\n"
        assert not bound_log(fd, 4096)
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert not bound_log(w, 0)  # a pipe or terminal is left alone
    finally:
        os.close(r)
        os.close(w)


def test_unknown_frontdoor_settings_are_refused_by_name():
    from reamer.host.errors import ReamerError
    from reamer.serve.doors.limits import DoorLimits

    assert DoorLimits.from_settings(2, {"max_buffered_mb": 8, "json_offload_kb": 1}).max_buffered_bytes == 8 << 20
    with pytest.raises(ReamerError, match="max_conections"):
        DoorLimits.from_settings(2, {"max_conections": 3})


def test_request_bodies_held_by_all_connections_are_capped_with_503(job, reference):
    """With the instance stopped, bodies of 0.9 MiB from separate connections wait in the job; the one that
    would take the job past max_buffered_mb (3 MiB) gets 503 naming it, the others are answered after."""
    worker = job.process.children()[0]
    body = json.dumps(_json_body(batch=1, seed=3)).encode()
    padded = body[:-1] + b" " * (900_000 - len(body)) + b"}"
    conns = [_connect(job, timeout=60) for _ in range(5)]
    statuses = []
    try:
        worker.suspend()
        try:
            for s in conns:
                s.sendall(_post(padded, "Connection: close\r\n"))
            early = {}
            for i, s in enumerate(conns):
                s.settimeout(0.5)
                try:
                    early[i] = s.recv(1 << 16)
                except socket.timeout:
                    continue
            assert early and all(_status_of(d) == 503 and b"max_buffered_mb" in d for d in early.values())
        finally:
            worker.resume()
        for i, s in enumerate(conns):
            answer, _ = _read_all(s, 60)
            statuses.append(_status_of(early.get(i, b"") + answer))
    finally:
        for s in conns:
            s.close()
    assert statuses.count(200) >= 3 and set(statuses) <= {200, 503}


def test_refusals_are_logged_at_most_burst_lines_per_window(capsys):
    from reamer.serve.doors.http_server import ClientErrorLog

    log = ClientErrorLog(burst=3, window_s=3600)
    for i in range(10):
        log(f"400 bad request {i}")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"reamer job: 400 bad request {i}" for i in range(3)]
    log.window_s = 0  # the next line opens a new window and reports what was left out
    log("400 again")
    err = capsys.readouterr().err.splitlines()
    assert "7 more refused requests not logged" in err[0] and err[1] == "reamer job: 400 again"


def test_the_agent_config_reaches_the_job_spec_and_its_limits(tmp_path):
    from reamer.agent.config import load_config
    from reamer.agent.inference import InferenceRecord, InferenceSupervisor
    from reamer.serve.doors.limits import DoorLimits

    config = load_config(None, {"inference.frontdoor.max_connections": 7, "inference.frontdoor.max_buffered_mb": 32,
                                "inference.job_log_mb": 2, "inference.max_request_mb": 4})
    supervisor = InferenceSupervisor(tmp_path, [0], max_request_mb=config.inference.max_request_mb)
    supervisor.frontdoor = config.inference.frontdoor.model_dump()  # as the Agent wires it
    supervisor.job_log_mb = config.inference.job_log_mb
    rec = InferenceRecord(name="j", model="/m.onnx", kind="online", backend="onnxruntime", port=0,
                          instances=[{"cpus": [1], "threads": 1, "max_batch": 2, "on_training": False}])
    spec = JobSpec.from_json(supervisor.build_spec(rec).to_json())  # through the file the job reads
    limits = DoorLimits.from_settings(spec.max_request_mb, spec.frontdoor)
    assert limits.max_connections == 7 and limits.max_buffered_bytes == 32 << 20
    assert limits.max_request_bytes == limits.max_pipelined_bytes == 4 << 20
    assert limits.header_timeout_s == 60.0 and spec.log_max_mb == 2
