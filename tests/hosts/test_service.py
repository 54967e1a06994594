"""The service for real: reamer.service under systemd as PID 1 (Type=notify, watchdog, KillMode=process).

One training job and one online inference job live through the whole module; after every way the agent
can go away (kill -9, a hang caught by the watchdog, systemctl stop/start, systemctl restart) the
training threads must still be SCHED_RR on their cores, the inference job process must still serve,
and the new agent must re-adopt both (it catches a thread born after it started; it lists the same
inference process)."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import pytest

from tests.hosts.helpers import (Workload, alive, api, deploy_online, journal, main_pid, serving, sh, tiny_model,
                                 unit_props, wait_active, wait_for)
from tests.hosts.test_pinning import pinned

# The agent's life under systemd is the same on every cgroup version; re-adoption is not: v2 and v1.
pytestmark = pytest.mark.profiles("v2-numa", "v1")


@dataclass
class Jobs:
    workload: Workload
    cpus: set[int]
    inference_pid: int
    inference_cpus: set[int]


@pytest.fixture(scope="module")
def jobs(service):
    workload = Workload(threads=2)
    job = api("POST", "/v1/training-jobs", {"name": "keep", "pids": [workload.pid], "cores": 1})
    try:
        cpus = set(job["cpus"])
        wait_for(lambda: pinned(workload, cpus), timeout=60, what="training pinned")
        online = deploy_online("online", tiny_model())
        yield Jobs(workload, cpus, online["pid"], {c for i in online["instances"] for c in i["cpus"]})
    finally:
        for path in ("/v1/inference-jobs/online", "/v1/training-jobs/keep"):
            try:
                api("DELETE", path)
            except Exception:  # noqa: BLE001 - cleanup of a VM that is discarded anyway
                pass
        workload.stop()


def still_running_without_agent(jobs: Jobs) -> None:
    assert pinned(jobs.workload, jobs.cpus)
    assert alive(jobs.inference_pid), "the inference job process died with the agent"


def assert_adopted(jobs: Jobs) -> None:
    job = api("GET", "/v1/training-jobs/keep")
    assert job["state"] == "running" and set(job["cpus"]) == jobs.cpus, job
    jobs.workload.add_thread()  # born after the new agent started: only a reconciling agent makes it RR
    wait_for(lambda: pinned(jobs.workload, jobs.cpus), timeout=90, what="the new agent pinning a new thread")
    online = wait_for(lambda: serving("online"), timeout=120, interval=2, what="the online job serving")
    assert online["pid"] == jobs.inference_pid, "the new agent restarted the inference job instead of adopting it"
    assert {c for i in online["instances"] for c in i["cpus"]} == jobs.inference_cpus


def test_start_is_active_through_ready(service):
    props = unit_props("reamer", "Type", "ActiveState", "SubState", "NotifyAccess", "WatchdogUSec", "StatusText")
    assert props["Type"] == "notify" and props["ActiveState"] == "active" and props["SubState"] == "running", props
    assert props["StatusText"].startswith("serving on /run/reamer/reamer.sock"), props  # sent with READY=1
    assert props["WatchdogUSec"] == "30s", props
    assert "reamer agent ready on /run/reamer/reamer.sock" in journal()
    assert api("GET", "/healthz")["status"] == "ok"


def ensure_active() -> None:
    """Each test starts from a running agent, also when the one before it failed midway. The start-rate
    counter is reset: the module starts the agent about as often as StartLimitBurst allows in its interval."""
    sh(["systemctl", "reset-failed", "reamer"], check=False)
    if unit_props("reamer", "ActiveState")["ActiveState"] != "active":
        sh(["systemctl", "start", "reamer"], timeout=600)
    wait_active()


def test_kill_9_keeps_pinning_and_systemd_restarts_an_agent_that_adopts(jobs):
    ensure_active()
    pid = main_pid()
    restarts = int(unit_props("reamer", "NRestarts")["NRestarts"])
    os.kill(pid, signal.SIGKILL)
    still_running_without_agent(jobs)
    wait_active(previous_pid=pid)
    assert int(unit_props("reamer", "NRestarts")["NRestarts"]) == restarts + 1
    assert_adopted(jobs)


@pytest.mark.profiles("v2-numa")  # a minute of waiting for the watchdog: once is enough
def test_hung_agent_is_killed_by_the_watchdog_and_the_next_one_adopts(jobs):
    ensure_active()
    pid = main_pid()
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        time.sleep(5)
        still_running_without_agent(jobs)
        wait_active(previous_pid=pid, timeout=300)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    took = time.monotonic() - stopped
    assert took >= 25, f"replaced after {took:.0f} s: before the 30 s watchdog could fire"
    assert not alive(pid), "the hung agent is still there beside the new one"
    assert "Watchdog timeout" in sh(["journalctl", "-b", "--no-pager", "-u", "reamer"])
    assert_adopted(jobs)


def test_stop_leaves_jobs_running_and_start_adopts_them(jobs):
    ensure_active()
    pid = main_pid()
    sh(["systemctl", "stop", "reamer"], timeout=120)
    assert unit_props("reamer", "ActiveState")["ActiveState"] == "inactive"
    assert not alive(pid)
    assert "training stays pinned and inference keeps running" in journal()
    still_running_without_agent(jobs)
    sh(["systemctl", "start", "reamer"], timeout=600)
    wait_active(previous_pid=pid)
    assert_adopted(jobs)


def test_restart_replaces_the_agent_and_keeps_jobs(jobs):
    ensure_active()
    pid = main_pid()
    sh(["systemctl", "restart", "reamer"], timeout=600)
    new = wait_active(previous_pid=pid)
    assert new != pid and not alive(pid)
    assert_adopted(jobs)


def test_journal_has_the_agent_logs(jobs):
    text = journal()
    for expected in ("reamer agent ready on", "agent started", "reamer agent stopped"):
        assert expected in text, f"{expected!r} not in journalctl -u reamer"
