"""Training pinning on the real kernel of each profile (cgroup v1 and v2), through the running service:
every thread SCHED_RR on the job's cores, late threads and children caught, detach restores."""
from __future__ import annotations

import os

import pytest

from tests.hosts.helpers import Workload, all_threads, api, cgroup_text, wait_for

PRIORITY = 50  # the shipped config's training.priority


def pinned(workload: Workload, cpus: set[int]) -> bool:
    threads = all_threads(workload.pid)
    assert threads, "the workload has no threads"
    for t in threads:
        assert t.rr and t.priority == PRIORITY, f"thread {t.tid} is policy {t.policy} priority {t.priority}"
        assert t.affinity <= cpus, f"thread {t.tid} may run on {sorted(t.affinity)}, job has {sorted(cpus)}"
    return True


@pytest.fixture
def workload():
    w = Workload(threads=3)
    yield w
    w.stop()


def test_attach_pins_every_thread_catches_late_ones_and_detach_restores(service, workload):
    before_cgroup = cgroup_text(workload.pid)
    before = {t.tid: t for t in all_threads(workload.pid)}
    assert all(not t.rr for t in before.values())
    job = api("POST", "/v1/training-jobs", {"name": "pin", "pids": [workload.pid], "cores": 1})
    try:
        cpus = set(job["cpus"])
        assert job["state"] == "running" and len(cpus) >= 1
        wait_for(lambda: pinned(workload, cpus), timeout=60, what="every thread SCHED_RR on the job's cpus")
        assert api("GET", "/v1/training-jobs/pin")["threads_rr"] == workload.thread_count()

        workload.add_thread()  # born after the attach: the reconcile loop must catch it
        wait_for(lambda: pinned(workload, cpus), timeout=90, what="the late thread made SCHED_RR")
        child = workload.add_child()  # a child forked after the attach, with a thread of its own
        wait_for(lambda: pinned(workload, cpus), timeout=90, what="the child's threads made SCHED_RR")
        wait_for(lambda: child in api("GET", "/v1/training-jobs/pin")["pids"], timeout=60,
                 what="the child listed among the job's pids")
    finally:
        api("DELETE", "/v1/training-jobs/pin")

    def restored() -> bool:  # systemd may apply a unit's AllowedCPUs= a moment after it answered
        for t in all_threads(workload.pid):
            assert t.policy == os.SCHED_OTHER, f"thread {t.tid} still policy {t.policy} after detach"
            assert t.affinity == before[workload.pid].affinity, (
                f"thread {t.tid} may run on {sorted(t.affinity)} after detach, not on the cpus it had "
                f"{sorted(before[workload.pid].affinity)}")
        assert cgroup_text(workload.pid) == before_cgroup, "detach must leave the process in the cgroup it came from"
        return True
    wait_for(restored, timeout=30, what="the workload restored after detach")
