import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from reamer.host.errors import ReamerError
from reamer.serve.measure.loadgen import (LoadResult, RequestRecord, infer_url, poisson_schedule, run_load,
                                  v2_request_body)


class FakeV2Server:
    """A stdlib HTTP server that mimics the v2 infer endpoint: every `shed_every`-th request gets 503."""

    def __init__(self, delay_s: float = 0.0, shed_every: int = 0) -> None:
        self.delay_s, self.shed_every = delay_s, shed_every
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.statuses: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with outer.lock:
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                    outer.bodies.append(body)
                    n = len(outer.bodies)
                if outer.delay_s:
                    time.sleep(outer.delay_s)
                if not self.path.startswith("/v2/models/") or not self.path.endswith("/infer"):
                    code, payload = 404, {"error": "no such path"}
                elif self.path != "/v2/models/tiny/infer":
                    code, payload = 500, {"error": "model broken"}
                elif outer.shed_every and n % outer.shed_every == 0:
                    code, payload = 503, {"error": "over capacity"}
                else:
                    code, payload = 200, {"model_name": "tiny", "outputs": [
                        {"name": "output", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
                with outer.lock:
                    outer.in_flight -= 1
                    outer.statuses.append(code)
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


BODY = v2_request_body({"input": np.arange(16, dtype=np.float32).reshape(1, 16)})


def test_v2_request_body():
    body = v2_request_body({"x": np.ones((2, 3), np.float32), "ids": np.array([[1, 2]], np.int64)})
    assert body == {"inputs": [
        {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1.0] * 6},
        {"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}]}


def test_poisson_schedule_is_seeded_and_has_the_right_mean_rate():
    a = poisson_schedule(200.0, 50.0, np.random.default_rng(3))
    assert a == poisson_schedule(200.0, 50.0, np.random.default_rng(3))
    assert all(0 <= x < 50.0 for x in a) and a == sorted(a)
    assert 9_000 < len(a) < 11_000  # mean 10,000, sd 100
    gaps = np.diff(a)
    assert abs(gaps.mean() - 1 / 200) < 0.0005
    # exponential gaps: coefficient of variation ~1 (a fixed-interval schedule would give 0)
    assert 0.9 < gaps.std() / gaps.mean() < 1.1


def test_bad_rate_is_a_reamer_error():
    with pytest.raises(ReamerError):
        poisson_schedule(0, 1.0, np.random.default_rng(0))


def test_counts_ok_and_shed_like_the_server_saw_them():
    with FakeV2Server(shed_every=3) as server:
        result = run_load(infer_url("127.0.0.1", server.port, "tiny"), BODY, rate_rps=60, duration_s=1.0, seed=1)
    expected = len(poisson_schedule(60, 1.0, np.random.default_rng(1)))
    assert len(result.records) == expected == len(server.bodies)
    assert all(b == BODY for b in server.bodies)
    assert result.ok == server.statuses.count(200)
    assert result.shed == server.statuses.count(503) == expected // 3
    assert result.errors == 0
    assert len(result.latencies) == result.ok
    assert all(r.latency_ms > 0 for r in result.records)
    assert result.p50_ms <= result.p99_ms
    assert result.summary()["sent"] == expected


def test_arrivals_do_not_wait_for_responses():
    # each answer takes 0.4 s; a closed-loop client would have one request in flight at a time
    with FakeV2Server(delay_s=0.4) as server:
        result = run_load(infer_url("127.0.0.1", server.port, "tiny"), BODY, rate_rps=40, duration_s=1.0, seed=2)
    assert result.ok == len(result.records) > 10
    assert server.max_in_flight > 3
    assert min(result.latencies) >= 400


def test_server_errors_and_refused_connections_are_errors():
    with FakeV2Server() as server:
        result = run_load(infer_url("127.0.0.1", server.port, "broken"), BODY, rate_rps=20, duration_s=0.5, seed=0)
    assert result.errors == len(result.records) > 0
    assert {r.http_status for r in result.records} == {500}
    assert math.isnan(result.p99_ms)

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_load(infer_url("127.0.0.1", port, "tiny"), BODY, rate_rps=20, duration_s=0.3, seed=0, timeout_s=5)
    assert result.errors == len(result.records) > 0
    assert all(r.http_status is None and "Connect" in r.detail for r in result.records)


def test_load_result_statistics():
    records = [RequestRecord(0.0, float(ms), "ok", 200) for ms in range(1, 101)]
    records += [RequestRecord(0.0, 5.0, "shed", 503), RequestRecord(0.0, 5.0, "error", 500)]
    result = LoadResult("u", 10.0, 2.0, records)
    assert result.ok == 100 and result.shed == 1 and result.errors == 1
    assert result.percentile(50) == pytest.approx(50.5)
    assert result.p99_ms == pytest.approx(99.01)
    assert result.achieved_rps == 50.0
    assert result.slo_attainment(10.0) == pytest.approx(10 / 102)
