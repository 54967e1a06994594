"""Training pinned where it lives (issue 11), through the running service on real kernels:

v2-containers: a podman and a docker container started with memory and pids limits are attached by id
prefix; every process stays in the container's cgroup, memory.max/pids.max still hold (allocating past the
limit OOM-kills inside the container), device access is still denied, the engine's stats still count the
processes, the threads are SCHED_RR on the job's cores, systemd's AllowedCPUs= of the container's unit says
so too; the agent is killed with SIGKILL and restarted; detach restores the original cpuset and unit.
v2-numa: a process given by pid goes into a transient scope of its own under reamer.slice and comes back.
v1: a process given by pid (reamer's own cpuset cgroup) and a cgroup job pinned in place, same sequence."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from reamer.host.container import container_cgroup
from reamer.host.cpulist import format_cpulist
from tests.hosts.helpers import Workload, all_threads, api, cgroup_text, main_pid, sh, wait_active, wait_for

PRIORITY = 50
CG = Path("/sys/fs/cgroup")
COMMAND = ["/bin/sh", "-c", "sleep 100000 & sleep 100000 & wait"]


def pinned(pid: int, cpus: set[int]) -> bool:
    threads = all_threads(pid)
    assert threads, f"process {pid} has no threads"
    for t in threads:
        assert t.rr and t.priority == PRIORITY, f"thread {t.tid}: policy {t.policy} priority {t.priority}"
        assert t.affinity <= cpus, f"thread {t.tid} may run on {sorted(t.affinity)}, the job has {sorted(cpus)}"
    return True


def restart_agent_with_sigkill() -> None:
    old = main_pid()
    os.kill(old, signal.SIGKILL)
    wait_active(previous_pid=old)


def unified_path(pid: int) -> str:
    return next(line.split(":", 2)[2] for line in cgroup_text(pid).splitlines() if line.startswith("0::")).strip("/")


# --- v2-containers ---------------------------------------------------------------------------------

def engine_ready(engine: str) -> None:
    if engine == "docker":
        wait_for(lambda: sh(["systemctl", "is-active", "docker"], check=False).strip() == "active", timeout=180,
                 what="docker.service active")
        if "local/bb" not in sh(["docker", "images", "--format", "{{.Repository}}"]):
            sh(["docker", "import", "/opt/ctr-rootfs.tar", "local/bb:1"], timeout=300)


def run_limited(engine: str, name: str) -> str:
    limits = ["--memory", "64m", "--memory-swap", "64m", "--pids-limit", "40", "--network", "none", "--name", name]
    image = ["--rootfs", "/opt/ctr-rootfs"] if engine == "podman" else ["local/bb:1"]
    return sh([engine, "run", "-d", *limits, *image, *COMMAND], timeout=300).strip()


def container_pids(engine: str, cid: str) -> list[int]:
    pid = int(sh([engine, "inspect", "-f", "{{.State.Pid}}", cid]).strip())
    import psutil
    return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]


@pytest.mark.profiles("v2-containers")
@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_container_is_pinned_in_place_with_its_limits_and_restored_after_an_agent_kill(service, engine):
    engine_ready(engine)
    name = f"inplace-{engine}"
    sh([engine, "rm", "-f", name], check=False, timeout=120)
    cid = run_limited(engine, name)
    try:
        wait_for(lambda: len(container_pids(engine, cid)) >= 3, timeout=90, what="the container's sleeps")
        pids = container_pids(engine, cid)
        pid = pids[0]
        homes = {pid: cgroup_text(pid) for pid in pids}
        ccg = container_cgroup(unified_path(pid)) or ""  # the cgroup reamer pins: the container's own
        ccg_dir = CG / ccg
        assert ccg and cid in ccg, f"container {cid} lives in {unified_path(pid)!r}"
        cpus_before = (ccg_dir / "cpuset.cpus").read_text().strip() if (ccg_dir / "cpuset.cpus").exists() else None
        effective_before = (ccg_dir / "cpuset.cpus.effective").read_text().strip()
        # the runtime puts its limits on the container's cgroup or on the one it nests inside (crun: .../container)
        limit_dir = next(d for d in (CG / unified_path(pid), ccg_dir) if (d / "memory.max").read_text().strip() != "max")
        memory_max, pids_max = (limit_dir / "memory.max").read_text().strip(), (limit_dir / "pids.max").read_text().strip()
        assert memory_max == str(64 << 20) and pids_max == "40", (memory_max, pids_max)

        job = api("POST", "/v1/training-jobs", {"name": name, "container": cid[:12], "cores": 1})
        cpus = set(job["cpus"])
        assert job["source"] == "container" and set(pids) <= set(job["pids"]), job
        wait_for(lambda: all(pinned(p, cpus) for p in pids), timeout=120, what=f"{engine} threads SCHED_RR")
        for pid in pids:
            assert cgroup_text(pid) == homes[pid], f"process {pid} left its container's cgroup"
        assert (ccg_dir / "cpuset.cpus.effective").read_text().strip() == format_cpulist(cpus)
        unit = ccg.rsplit("/", 1)[-1]
        if unit.endswith(".scope"):  # the systemd cgroup driver: systemd's view agrees with the kernel's
            shown = sh(["systemctl", "show", unit, "-p", "AllowedCPUs", "--value"]).strip()
            assert shown == format_cpulist(cpus), f"systemd says AllowedCPUs={shown!r}"
        assert (limit_dir / "memory.max").read_text().strip() == memory_max
        assert (limit_dir / "pids.max").read_text().strip() == pids_max
        stats = sh([engine, "stats", "--no-stream", "--format", "{{.PIDs}}", cid], timeout=180).strip()
        assert stats.isdigit() and int(stats) >= 3, f"{engine} stats counts {stats!r} processes"
        device = sh([engine, "exec", cid, "/bin/busybox", "sh", "-c",
                     "/bin/busybox mknod /tmp/mem c 1 1 2>&1; /bin/busybox head -c 1 /tmp/mem 2>&1; echo rc=$?"],
                    timeout=180, check=False)
        assert "rc=0" not in device, f"a host device was readable from the attached container: {device!r}"
        oom_before = sum(int(line.split()[1]) for line in (limit_dir / "memory.events").read_text().splitlines()
                         if line.startswith("oom_kill "))
        hog = sh([engine, "exec", cid, "/bin/busybox", "sort", "/dev/zero"], timeout=300, check=False)
        oom_after = sum(int(line.split()[1]) for line in (limit_dir / "memory.events").read_text().splitlines()
                        if line.startswith("oom_kill "))
        assert oom_after > oom_before, f"allocating past memory.max was not OOM-killed in the container: {hog!r}"
        assert sh([engine, "inspect", "-f", "{{.State.Running}}", cid]).strip() == "true"

        restart_agent_with_sigkill()  # the new agent adopts the job from its record
        wait_for(lambda: all(pinned(p, cpus) for p in pids), timeout=120, what="still pinned after the restart")
        api("DELETE", f"/v1/training-jobs/{name}")
        for pid in pids:
            assert all(t.policy == os.SCHED_OTHER for t in all_threads(pid))
            assert cgroup_text(pid) == homes[pid]
        after = (ccg_dir / "cpuset.cpus").read_text().strip() if (ccg_dir / "cpuset.cpus").exists() else None
        # Kernels before 6.2 refuse an empty cpuset.cpus while the cgroup has tasks (systemd too): an empty
        # file ("the parent's cpus") comes back as the parent's cpus written out, the same cpus.
        assert after == cpus_before or (not cpus_before and after == effective_before), (
            f"cpuset.cpus {after!r} after detach, {cpus_before!r} before")
        assert (ccg_dir / "cpuset.cpus.effective").read_text().strip() == effective_before
        if unit.endswith(".scope"):
            assert sh(["systemctl", "show", unit, "-p", "AllowedCPUs", "--value"]).strip() == ""
    finally:
        try:
            api("DELETE", f"/v1/training-jobs/{name}")
        except Exception:  # noqa: BLE001 - detached already
            pass
        sh([engine, "rm", "-f", cid], timeout=120, check=False)


# --- a process given by pid (v2-numa: a scope of its own; v1: reamer's own cpuset cgroup) -------------

@pytest.mark.profiles("v2-numa", "v1")
def test_pid_job_is_pinned_without_dragging_its_cgroup_and_restored_after_an_agent_kill(service):
    workload = Workload(threads=3)
    try:
        home = cgroup_text(workload.pid)
        job = api("POST", "/v1/training-jobs", {"name": "bypid", "pids": [workload.pid], "cores": 1})
        cpus = set(job["cpus"])
        wait_for(lambda: pinned(workload.pid, cpus), timeout=120, what="the workload SCHED_RR")
        now = cgroup_text(workload.pid)
        if (CG / "cgroup.controllers").exists():
            assert unified_path(workload.pid) == "reamer.slice/reamer-train-bypid.scope", now
            shown = sh(["systemctl", "show", "reamer-train-bypid.scope", "-p", "AllowedCPUs", "--value"]).strip()
            assert shown == format_cpulist(cpus)
        else:
            lines = {line.split(":")[1]: line.split(":", 2)[2] for line in now.splitlines()}
            before = {line.split(":")[1]: line.split(":", 2)[2] for line in home.splitlines()}
            assert lines["cpuset"].endswith("/train-bypid"), now
            assert lines["memory"] == before["memory"] and lines["name=systemd"] == before["name=systemd"], now
        restart_agent_with_sigkill()
        wait_for(lambda: pinned(workload.pid, cpus), timeout=120, what="still pinned after the restart")
        api("DELETE", "/v1/training-jobs/bypid")
        assert all(t.policy == os.SCHED_OTHER for t in all_threads(workload.pid))
        assert cgroup_text(workload.pid) == home, "detach puts the process back where it was"
        if (CG / "cgroup.controllers").exists():
            wait_for(lambda: sh(["systemctl", "is-active", "reamer-train-bypid.scope"], check=False).strip()
                     != "active", timeout=60, what="the emptied scope to go away")
    finally:
        workload.stop()


@pytest.mark.profiles("v1")
def test_cgroup_job_is_pinned_in_place_on_v1(service):
    path = "lab-inplace"
    for controller in ("cpuset", "memory", "pids"):
        (CG / controller / path).mkdir(exist_ok=True)
    for name in ("cpuset.cpus", "cpuset.mems"):
        (CG / "cpuset" / path / name).write_text((CG / "cpuset" / name).read_text())
    (CG / "memory" / path / "memory.limit_in_bytes").write_text(str(256 << 20))
    (CG / "pids" / path / "pids.max").write_text("50")
    cpus_before = (CG / "cpuset" / path / "cpuset.cpus").read_text().strip()
    workload = Workload(threads=2)
    try:
        for controller in ("cpuset", "memory", "pids"):
            (CG / controller / path / "cgroup.procs").write_text(str(workload.pid))
        home = cgroup_text(workload.pid)
        job = api("POST", "/v1/training-jobs", {"name": "bycg", "cgroup": path, "cores": 1})
        cpus = set(job["cpus"])
        wait_for(lambda: pinned(workload.pid, cpus), timeout=120, what="the cgroup job SCHED_RR")
        assert cgroup_text(workload.pid) == home, "no process changes cgroup"
        assert (CG / "cpuset" / path / "cpuset.cpus").read_text().strip() == format_cpulist(cpus)
        assert (CG / "memory" / path / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
        restart_agent_with_sigkill()
        wait_for(lambda: pinned(workload.pid, cpus), timeout=120, what="still pinned after the restart")
        api("DELETE", "/v1/training-jobs/bycg")
        assert all(t.policy == os.SCHED_OTHER for t in all_threads(workload.pid))
        assert cgroup_text(workload.pid) == home
        assert (CG / "cpuset" / path / "cpuset.cpus").read_text().strip() == cpus_before
    finally:
        workload.stop()
        time.sleep(1)
        for controller in ("cpuset", "memory", "pids"):
            try:
                (CG / controller / path).rmdir()
            except OSError:
                pass
