"""kill -9 of the agent mid-request and mid-offline-job: inference goes on, nothing is lost or done twice."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import psutil
import pytest

from reamer.serve import models
from tests.agent.conftest import needs_rt_host
from tests.conftest import wait_for

pytestmark = [needs_rt_host, pytest.mark.root]


@pytest.fixture
def tiny_model(tmp_path) -> str:
    return models.build_model("tiny", tmp_path / "tiny.onnx").path


def test_kill_9_of_the_agent_drops_no_online_request(daemon_factory, tiny_model):
    daemon = daemon_factory()
    job = daemon.client.deploy_inference({"name": "web", "model": tiny_model, "kind": "online", "slo_ms": 500,
                                          "layout": "1x1:b2"})
    url = f"http://127.0.0.1:{job.port}/v2/models/web/infer"
    body = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.25] * 16}]}
    wait_for(lambda: _ok(url, body), timeout=60, what="the online job to serve")
    statuses: list[int] = []
    stop = threading.Event()

    def drive() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                statuses.append(client.post(url, json=body).status_code)
                time.sleep(0.02)

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        wait_for(lambda: len(statuses) >= 10, timeout=30, what="requests before the kill")
        daemon.kill()
        served_before_restart = len(statuses)
        wait_for(lambda: len(statuses) >= served_before_restart + 20, timeout=30,
                 what="requests served while the agent is dead")
        daemon.start()
        again = daemon.client.get_inference_job("web")
        assert again.pid == job.pid and again.state == "running"  # re-adopted, not restarted
        count = len(statuses)
        wait_for(lambda: len(statuses) >= count + 10, timeout=30, what="requests after the restart")
    finally:
        stop.set()
        driver.join(timeout=30)
    assert statuses and all(code == 200 for code in statuses), sorted(set(statuses))


def test_kill_9_of_the_agent_mid_offline_job_loses_and_repeats_nothing(daemon_factory, tiny_model, tmp_path):
    daemon = daemon_factory()
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    rng = np.random.default_rng(1)
    expected = {}
    for i in range(300):
        sample = rng.standard_normal((1, 16)).astype(np.float32)
        np.save(inputs / f"x{i:03d}.npy", sample)
        expected[f"x{i:03d}.npz"] = sample
    job = daemon.client.deploy_inference({"name": "bulk", "model": tiny_model, "kind": "offline",
                                          "input_dir": str(inputs), "output_dir": str(outputs), "max_batch": 1})
    wait_for(lambda: len(list(outputs.glob("*.npz"))) >= 5, timeout=60, what="the offline job to start writing")
    daemon.kill()
    assert psutil.pid_exists(job.pid), "the offline job must outlive the agent"
    daemon.start()
    done = wait_for(lambda: (j := daemon.client.get_inference_job("bulk")).state in ("done", "failed") and j,
                    timeout=180, what="the offline job to finish")
    assert done.state == "done", done.message
    assert sorted(p.name for p in outputs.iterdir()) == sorted(expected)  # every output, no temp file left
    first = {name: (outputs / name).stat().st_mtime_ns for name in expected}
    time.sleep(1)
    assert {name: (outputs / name).stat().st_mtime_ns for name in expected} == first  # nothing rewritten


def _ok(url: str, body: dict) -> bool:
    try:
        return httpx.post(url, json=body, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False
