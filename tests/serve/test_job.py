"""`python -m reamer.serve.runtime.job` as a real process: online serving, SIGHUP reconfiguration, SIGTERM."""
import signal

import httpx
import numpy as np
import psutil
import pytest

from reamer.serve.runtime.job import main as job_main
from reamer.serve.models import build_model
from reamer.serve.spec import InstanceSpec, JobSpec, read_events
from tests.conftest import wait_for
from tests.serve.jobs import CPUS, RunningJob, job_workers, read_status


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("m") / "tiny.onnx").path


@pytest.fixture
def online_job(tiny, tmp_path):
    job = RunningJob(tiny, tmp_path, "tiny", slo_ms=500.0, rate_rps=2.0)
    try:
        yield job.proc, job.spec, tmp_path, job.status
    finally:
        job.stop()


def _infer(port, batch=1):
    x = np.ones((batch, 16), np.float32)
    return httpx.post(f"http://127.0.0.1:{port}/v2/models/tiny/infer", timeout=60,
                      json={"inputs": [{"name": "input", "shape": [batch, 16], "datatype": "FP32",
                                        "data": x.ravel().tolist()}]})


def test_online_job_serves_reports_and_stops_cleanly_on_sigterm(online_job):
    job, spec, tmp_path, st = online_job
    assert st.port and st.pid == job.pid and st.instances_ready == st.instances_total == 1
    assert psutil.Process(job.pid).cpu_affinity() == [CPUS[0]]
    workers = job_workers(job)
    assert [w.cpu_affinity() for w in workers] == [[CPUS[-1]]]
    for _ in range(5):
        r = _infer(st.port, batch=2)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2, 4]
    wait_for(lambda: (s := read_status(tmp_path / "run")) and s.requests >= 5 and s.p99_ms is not None,
             what="status to count the requests")
    s = read_status(tmp_path / "run")  # the front door's own cpu: it parsed and answered those requests
    assert s.frontdoor_busy is not None and 0 < s.frontdoor_busy < 2.5
    assert s.frontdoor_cpu_ms is not None and s.frontdoor_cpu_ms > 0

    def overloaded():  # keep sending above the admitted 2 req/s until the job says so
        _infer(st.port)
        return [e for e in read_events(tmp_path / "run")[0] if e["kind"] == "overload"]

    (event,) = wait_for(overloaded, timeout=60, interval=0.02, what="an overload event")
    assert event["admitted_rps"] == 2.0 and event["rate_rps"] > 2.0 and "above its admitted" in event["message"]
    job.send_signal(signal.SIGTERM)
    assert job.wait(60) == 0
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive
    assert read_status(tmp_path / "run").message == "stopped by SIGTERM"


def test_sighup_changes_instance_count_without_restarting_kept_ones(online_job):
    job, spec, tmp_path, st = online_job
    (first,) = job_workers(job)
    spec.instances = [InstanceSpec([CPUS[-1]], 1, 4), InstanceSpec([CPUS[0]], 1, 2)]
    spec.save(tmp_path / "spec.json")
    job.send_signal(signal.SIGHUP)
    wait_for(lambda: (s := read_status(tmp_path / "run")) and s.instances_total == 2 and s.instances_ready == 2,
             timeout=90, what="two ready instances")
    workers = job_workers(job)
    assert len(workers) == 2 and first.pid in [w.pid for w in workers]  # the unchanged one kept running
    assert _infer(st.port).status_code == 200
    # Back to one instance, with a changed max_batch: the old ones go, a new one comes.
    spec.instances = [InstanceSpec([CPUS[-1]], 1, 8)]
    spec.save(tmp_path / "spec.json")
    job.send_signal(signal.SIGHUP)
    wait_for(lambda: len(job_workers(job)) == 1 and (s := read_status(tmp_path / "run")).instances_total == 1
             and s.instances_ready == 1, timeout=90, what="one instance again")
    assert job_workers(job)[0].pid != first.pid
    assert _infer(st.port).status_code == 200
    events = [e for e in read_events(tmp_path / "run")[0] if e["kind"] == "reconfigured"]
    assert [(e["kept"], e["started"], e["stopped"]) for e in events] == [(1, 1, 0), (0, 1, 2)]
    # A broken spec on SIGHUP is reported; the job keeps serving as it was.
    (tmp_path / "spec.json").write_text("{broken")
    job.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e["kind"] == "reload_failed" and "not valid JSON" in e["message"]
                         for e in read_events(tmp_path / "run")[0]), what="reload_failed event")
    assert _infer(st.port).status_code == 200 and job.poll() is None


def test_missing_model_or_spec_fails_with_a_clearread_status(tmp_path, capsys):
    spec = JobSpec(name="x", kind="online", model=str(tmp_path / "none.onnx"), port=0, run_dir=str(tmp_path / "run"),
                   instances=[InstanceSpec([CPUS[-1]], 1, 1)])
    spec.save(tmp_path / "spec.json")
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:  # in-process: the job fails before it starts anything
        assert job_main(["--spec", str(tmp_path / "spec.json")]) == 1
        assert job_main(["--spec", str(tmp_path / "nope.json")]) == 2
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert "none.onnx does not exist" in err and "cannot read job spec" in err
    st = read_status(tmp_path / "run")
    assert st.state == "failed" and "reamer models build" in st.message
    assert [e["kind"] for e in read_events(tmp_path / "run")[0]] == ["failed"]
