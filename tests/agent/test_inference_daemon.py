"""Inference through a real agent: the tiny ONNX model served offline and online by real job processes,
and the re-plan when training comes and goes."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from reamer.api.client import ApiError
from tests.agent.conftest import all_rr, needs_rt_host, wait_event, wait_for

pytestmark = [needs_rt_host, pytest.mark.root]

from reamer.serve import models


@pytest.fixture
def tiny_model(tmp_path) -> str:
    return models.build_model("tiny", tmp_path / "tiny.onnx").path


def job_cpus(job) -> set[int]:
    return {c for i in job.instances for c in i.cpus}


def affinity_tree(pid: int) -> set[int]:
    root = psutil.Process(pid)
    cpus: set[int] = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            cpus |= set(proc.cpu_affinity())
        except psutil.Error:
            pass
    return cpus


def test_offline_job_runs_to_done_on_all_cores(daemon, tiny_model, tmp_path):
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        np.save(inputs / f"x{i}.npy", rng.standard_normal((2, 16)).astype(np.float32))
    job = daemon.client.deploy_inference({"name": "off", "model": tiny_model, "kind": "offline",
                                          "input_dir": str(inputs), "output_dir": str(outputs), "max_batch": 2})
    assert job.kind == "offline" and job.state == "running"
    # offline: single-thread instances on every idle cpu
    assert sorted(job_cpus(job)) == daemon.client.node().idle_cpus
    assert all(i.threads == 1 and len(i.cpus) == 1 for i in job.instances)
    done = wait_for(lambda: (j := daemon.client.get_inference_job("off")).state in ("done", "failed") and j,
                    timeout=90, what="the offline job to finish")
    assert done.state == "done", done.message
    assert sorted(p.name for p in outputs.iterdir()) == [f"x{i}.npz" for i in range(6)]
    wait_event(daemon, "inference_done", job="off")


def test_online_job_serves_and_replans_when_training_comes_and_goes(daemon, tiny_model, trainer_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: one for training, one for the online job")
    job = daemon.client.deploy_inference({"name": "web", "model": tiny_model, "kind": "online", "slo_ms": 200,
                                          "layout": "1x1:b4"})
    assert job.port and job.layout == "1x1:b4" and len(job_cpus(job)) == 1
    base = f"http://127.0.0.1:{job.port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout=90, what="the online job to be ready")
    body = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
    answer = httpx.post(f"{base}/v2/models/web/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    first_cpus = job_cpus(job)

    # Training arrives on the online job's core: the online job moves to the other core before training is pinned.
    trainer = trainer_factory(threads=1)
    node = daemon.client.node()
    train = daemon.client.attach_training({"name": "tr", "pids": [trainer.pid], "cores": 1})
    moved = daemon.client.get_inference_job("web")
    assert job_cpus(moved).isdisjoint(train.cpus)
    assert affinity_tree(moved.pid).isdisjoint(train.cpus), "inference must have left the training core"
    assert all_rr(trainer.pid)
    if first_cpus & set(train.cpus):
        wait_event(daemon, "replanned", job="web")
    wait_for(ready, timeout=60, what="the online job to be ready after the move")
    assert httpx.post(f"{base}/v2/models/web/infer", json=body, timeout=30).status_code == 200

    # A second training job takes the last core: the online job has nowhere to go -> pending, stopped.
    trainer2 = trainer_factory(threads=1)
    pid_before = moved.pid
    daemon.client.attach_training({"name": "tr2", "pids": [trainer2.pid], "cores": 1})
    pending = daemon.client.get_inference_job("web")
    assert pending.state == "pending" and pending.instances == [] and "waiting" in pending.message
    wait_for(lambda: not psutil.pid_exists(pid_before) or psutil.Process(pid_before).status() == "zombie",
             timeout=20, what="the online job process to stop")
    assert node.idle_cpus  # sanity: there were idle cpus before

    # Training ends: its core goes back to inference within the reconcile interval.
    trainer2.stop()
    wait_event(daemon, "training_ended", job="tr2")
    back = wait_for(lambda: (j := daemon.client.get_inference_job("web")).state == "running" and j,
                    timeout=20, what="the online job to run again")
    assert job_cpus(back).isdisjoint(train.cpus)
    wait_for(ready, timeout=90, what="the online job to be ready again")

    daemon.client.remove_inference("web")
    wait_for(lambda: not psutil.pid_exists(back.pid) or psutil.Process(back.pid).status() == "zombie",
             timeout=20, what="the removed job's process to exit")
    assert daemon.client.list_inference_jobs() == []


def test_agent_restart_keeps_inference_running_and_reattaches(daemon_factory, tiny_model):
    daemon = daemon_factory()
    job = daemon.client.deploy_inference({"name": "keep", "model": tiny_model, "kind": "online", "slo_ms": 200,
                                          "layout": "1x1:b1"})
    wait_for(lambda: daemon.client.get_inference_job("keep").status.rate_rps is not None
             and any(Path(daemon.run_dir, "jobs").glob("keep@*/io/status.json")), timeout=60, what="job status")
    assert daemon.stop() == 0
    assert psutil.pid_exists(job.pid) and psutil.Process(job.pid).status() != "zombie", \
        "an agent shutdown must not stop inference"
    daemon.start()
    again = daemon.client.get_inference_job("keep")
    assert again.pid == job.pid and again.state == "running" and again.port == job.port


def test_deploy_errors(daemon, tiny_model, tmp_path):
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": "x", "model": str(tmp_path / "missing.onnx"), "kind": "online",
                                        "slo_ms": 50})
    assert info.value.status == 400 and "does not exist" in info.value.message
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": "x", "model": tiny_model, "kind": "online", "slo_ms": 50,
                                        "layout": "two by one"})
    assert info.value.status == 400 and "layout" in info.value.message
    with pytest.raises(ApiError) as info:
        daemon.client.deploy_inference({"name": "x", "model": tiny_model, "kind": "online"})
    assert info.value.status == 422 and "slo_ms" in info.value.message
    (tmp_path / "in").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ApiError) as info:  # an output directory that cannot be made: a 400, not a 500
        daemon.client.deploy_inference({"name": "x", "model": tiny_model, "kind": "offline",
                                        "input_dir": str(tmp_path / "in"), "output_dir": str(tmp_path / "a-file" / "out")})
    assert info.value.status == 400 and "output_dir" in info.value.message and info.value.fix
    assert "x" not in {j.name for j in daemon.client.list_inference_jobs()}


def test_crashing_job_is_restarted_then_failed_by_the_crash_loop_guard(daemon_factory, tiny_model):
    daemon = daemon_factory(inference={"restart_limit": 1, "restart_window_s": 300})
    job = daemon.client.deploy_inference({"name": "crashy", "model": tiny_model, "kind": "online", "slo_ms": 200,
                                          "layout": "1x1:b1"})
    # A worker dies: the job notices on the next request, and the agent forwards the job's event.
    base = f"http://127.0.0.1:{job.port}"
    body = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}

    def infer_and_look() -> object:
        try:
            httpx.post(f"{base}/v2/models/crashy/infer", json=body, timeout=10)
        except httpx.HTTPError:
            pass
        return next((e for e in daemon.events("worker_crashed") if e.job == "crashy"), None)

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout=90, what="the job to be ready")
    worker = psutil.Process(job.pid).children()[0]
    worker.kill()
    crashed = wait_for(infer_and_look, timeout=60, interval=0.5, what="the forwarded worker_crashed event")
    assert "crashy" in crashed.message
    os.killpg(job.pid, 9)
    restarted = wait_for(lambda: (j := daemon.client.get_inference_job("crashy")).pid not in (None, job.pid) and j,
                         timeout=30, what="the agent to restart the killed job")
    assert restarted.state == "running"
    wait_event(daemon, "inference_crashed", job="crashy")
    os.killpg(restarted.pid, 9)
    failed = wait_for(lambda: (j := daemon.client.get_inference_job("crashy")).state == "failed" and j,
                      timeout=30, what="the crash-loop guard to fail the job")
    assert "crashed" in failed.message and failed.instances == []
    wait_event(daemon, "inference_failed", job="crashy")


def test_offline_on_training_cores_is_single_thread_and_idle_when_configured(daemon_factory, tiny_model, tmp_path,
                                                                             trainer_factory):
    import json

    daemon = daemon_factory(inference={"offline_sched": "idle"})
    trainer = trainer_factory(threads=1)
    train = daemon.client.attach_training({"name": "tr", "pids": [trainer.pid], "cores": 1})
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    np.save(inputs / "a.npy", np.zeros((1, 16), np.float32))
    job = daemon.client.deploy_inference({"name": "bulk", "model": tiny_model, "kind": "offline",
                                          "input_dir": str(inputs), "output_dir": str(outputs)})
    on_training = [i for i in job.instances if i.on_training]
    assert [i.cpus for i in on_training] == [train.cpus] and on_training[0].threads == 1
    spec = json.loads(next((daemon.run_dir / "jobs").glob("bulk@*/spec.json")).read_text())
    scheds = {tuple(i["cpus"]): i["sched"] for i in spec["instances"]}
    assert scheds[tuple(train.cpus)] == "idle"
    assert all(s == "other" for cpus, s in scheds.items() if cpus != tuple(train.cpus))
    done = wait_for(lambda: (j := daemon.client.get_inference_job("bulk")).state in ("done", "failed") and j,
                    timeout=90, what="the offline job to finish")
    assert done.state == "done", done.message
    assert all_rr(trainer.pid)


