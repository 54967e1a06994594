"""The HTTP API on the Unix socket: routes, error shape, long-poll, metrics, admission, permissions."""
from __future__ import annotations

import os
import stat
import threading

import httpx
import pytest

from reamer.api.client import AgentUnreachable, ApiClient, ApiError
from tests.agent.conftest import needs_rt_host

pytestmark = [needs_rt_host, pytest.mark.root]


def raw(daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=daemon.socket), base_url="http://reamer", timeout=30)


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code and body["error"]["message"]
    assert "Traceback" not in response.text
    return body["error"]


def test_routes_health_openapi_and_socket_mode(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    with raw(daemon) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        paths = http.get("/openapi.json").json()["paths"]
        for route in ("/v1/node", "/v1/training-jobs", "/v1/training-jobs/{name}", "/v1/inference-jobs",
                      "/v1/inference-jobs/{name}", "/v1/events", "/v1/gpus", "/v1/demote-all", "/healthz",
                      "/metrics"):
            assert route in paths
        node = http.get("/v1/node").json()
        assert node["reserved_cpus"] == [] and node["idle_cpus"] == node["cpus"]
        assert node["rt_throttling"]["runtime_us"] > 0
        assert http.get("/v1/gpus").json()["enabled"] in (True, False)


def test_errors_are_json_with_code_and_message(daemon):
    with raw(daemon) as http:
        assert_error(http.get("/v1/nothing-here"), 404, "not_found")
        assert_error(http.get("/v1/training-jobs/ghost"), 404, "not_found")
        assert_error(http.delete("/v1/inference-jobs/ghost"), 404, "not_found")
        err = assert_error(http.post("/v1/training-jobs", json={"name": "x", "pids": [1], "cgroup": "a"}),
                           422, "invalid_request")
        assert "exactly one of pids, cgroup, container" in err["message"]
        err = assert_error(http.post("/v1/training-jobs", content=b"not json",
                                     headers={"content-type": "application/json"}), 422, "invalid_request")
        err = assert_error(http.post("/v1/inference-jobs", json={"name": "bad name!", "model": "/m.onnx",
                                                                 "kind": "online", "slo_ms": 5}),
                           422, "invalid_request")
        assert "name" in err["message"]
        err = assert_error(http.post("/v1/training-jobs", json={"name": "init", "pids": [1]}), 403, "forbidden")
        assert "pid_1" in err["message"] and err["data"]["rule"] == "pid_1"
        for pids in ([-1], [0], [2**40]):  # out of range: refused before anything is applied
            assert_error(http.post("/v1/training-jobs", json={"name": "bad", "pids": pids}), 422, "invalid_request")
        assert_error(http.get("/v1/events", params={"since": 2**63}), 422, "invalid_request")
        assert http.get("/v1/events", params={"since": 2**63 - 1}).json()["events"] == []
        response = http.put("/v1/node")
        assert response.status_code == 405 and response.headers["allow"] == "GET"
        # no GPU on this machine: registering a GPU job is refused cleanly, not a 500
        response = http.post("/v1/gpu-jobs", json={"name": "g", "gpu": "0", "sm_percent": 50})
        assert 400 <= response.status_code < 500 and response.json()["error"]["message"], response.text


def test_events_long_poll_wakes_on_a_new_event(daemon):
    client = daemon.client
    last = client.events(since=0).last_id
    assert last >= 1  # agent_started
    answer: dict = {}

    def poll() -> None:
        with ApiClient(daemon.socket) as other:
            answer["events"] = other.events(since=last, wait=30).events

    thread = threading.Thread(target=poll)
    thread.start()
    client.demote_all()  # emits demoted_all
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert [e.kind for e in answer["events"]] == ["demoted_all"]
    assert all(e.id > last for e in answer["events"])


def test_metrics_expose_agent_state(daemon):
    text = daemon.client.metrics()
    assert "reamer_training_jobs 0.0" in text
    assert "reamer_reconcile_duration_seconds_count" in text
    assert 'reamer_cpus{use="idle"}' in text


def test_admission_refused_says_what_is_achievable(daemon_factory, tmp_path):
    from reamer.serve import models
    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    daemon = daemon_factory(inference={"layout_chooser": "tests.api.conftest:refuse_all"})
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": "web", "model": model, "kind": "online", "slo_ms": 10,
                                        "rate_rps": 100})
    assert info.value.status == 409 and info.value.code == "admission_refused"
    assert info.value.data["achievable_rps"] == 12.5 and "12.5 rps" in info.value.message
    assert daemon.client.list_inference_jobs() == []


def test_client_on_a_missing_socket_says_how_to_start_the_agent(tmp_path):
    with pytest.raises(AgentUnreachable) as info:
        ApiClient(str(tmp_path / "none.sock")).node()
    assert "not reachable" in info.value.message and "reamer daemon" in info.value.fix


def test_second_daemon_on_the_same_socket_is_refused(daemon):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "reamer.node", "--config", str(daemon.config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "already listens" in result.stderr and "Traceback" not in result.stderr
    assert daemon.client.health()["status"] == "ok"


def test_systemd_notify_ready_and_clean_stop(daemon_factory):
    import socket as socketlib

    daemon = daemon_factory(start=False)
    notify_path = str(daemon.base / "notify")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(60)
    try:
        daemon.start(env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "5000000"})
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        while not any("WATCHDOG=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        assert daemon.stop() == 0
        assert not os.path.exists(daemon.socket)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
    finally:
        listener.close()
