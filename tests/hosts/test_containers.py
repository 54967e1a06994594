"""Real container engines (podman; docker with containerd and runc) on cgroup v2 under systemd, with a
locally built image (the VM has no network): reamer resolves a container by id and pins it, detach
restores. Container-specific pinning checks (limits kept, pin in place) come with issue 11."""
from __future__ import annotations

import os

import pytest

from tests.hosts.helpers import all_threads, api, sh, wait_for

pytestmark = pytest.mark.profiles("v2-containers")
PRIORITY = 50
COMMAND = ["/bin/sh", "-c", "sleep 100000 & sleep 100000 & wait"]


def engine_ready(engine: str) -> None:
    if engine == "docker":
        wait_for(lambda: sh(["systemctl", "is-active", "docker"], check=False).strip() == "active", timeout=180,
                 what="docker.service active")
        if "local/bb" not in sh(["docker", "images", "--format", "{{.Repository}}"]):
            sh(["docker", "import", "/opt/ctr-rootfs.tar", "local/bb:1"], timeout=300)


def run_container(engine: str, name: str) -> tuple[str, int]:
    if engine == "podman":
        cid = sh(["podman", "run", "-d", "--network", "none", "--name", name, "--rootfs", "/opt/ctr-rootfs", *COMMAND],
                 timeout=300).strip()
    else:
        cid = sh(["docker", "run", "-d", "--network", "none", "--name", name, "local/bb:1", *COMMAND], timeout=300).strip()
    pid = int(sh([engine, "inspect", "-f", "{{.State.Pid}}", cid]).strip())
    return cid, pid


@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_attach_container_by_id_pins_it_and_detach_restores(service, engine):
    engine_ready(engine)
    name = f"lab-{engine}"
    cid, pid = run_container(engine, name)
    try:
        wait_for(lambda: len(all_threads(pid)) >= 3, timeout=60, what="the container's sleeps")
        before = {t.tid: t for t in all_threads(pid)}
        job = api("POST", "/v1/training-jobs", {"name": name, "container": cid, "cores": 1})
        cpus = set(job["cpus"])
        try:
            assert job["source"] == "container" and pid in job["pids"], job

            def pinned() -> bool:
                for t in all_threads(pid):
                    assert t.rr and t.priority == PRIORITY, f"{engine} thread {t.tid}: policy {t.policy}"
                    assert t.affinity <= cpus, f"{engine} thread {t.tid} on {sorted(t.affinity)}"
                return True
            wait_for(pinned, timeout=90, what=f"the {engine} container's threads SCHED_RR on {sorted(cpus)}")
        finally:
            api("DELETE", f"/v1/training-jobs/{name}")

        def restored() -> bool:  # systemd may apply a unit's AllowedCPUs= a moment after it answered
            for t in all_threads(pid):
                assert t.policy == os.SCHED_OTHER, f"{engine} thread {t.tid} still policy {t.policy}"
                assert t.affinity == before[pid].affinity, (
                    f"{engine} thread {t.tid} on {sorted(t.affinity)}, not back on {sorted(before[pid].affinity)}")
            return True
        wait_for(restored, timeout=30, what=f"the {engine} container's threads restored after detach")
        assert sh([engine, "inspect", "-f", "{{.State.Running}}", cid]).strip() == "true"
    finally:
        sh([engine, "rm", "-f", cid], timeout=120, check=False)
