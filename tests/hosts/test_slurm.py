"""Slurm on cgroup v2 under systemd (lab VM): the node's agent (the systemd service) follows a Slurm job that the
project's Prolog hands it. slurmd asks systemd for slurmstepd.scope; the tasks live in
system.slice/slurmstepd.scope/job_N/step_M/user/task_K. What must hold: the task threads are SCHED_RR on the
cores reamer chose inside the job's allocation, slurmstepd's never are, systemd's AllowedCPUs= of slurmstepd.scope
is never set (that would narrow every Slurm job), the job's own cgroup is never written, and the end of the job
gives the cores back."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.hosts.helpers import api_get, sh, wait_for
from tests.slurm.cluster import SlurmCluster, missing_binaries

pytestmark = [
    pytest.mark.profiles("v2-numa"),
    pytest.mark.skipif(bool(missing_binaries()), reason="Slurm is not in this lab image (lab/image.py PACKAGES)"),
]

TASK = ("import threading,time\n"
        "def work():\n"
        "    end = time.time() + {seconds}\n"
        "    while time.time() < end:\n"
        "        sum(range(300)); time.sleep(0.05)\n"
        "t = threading.Thread(target=work); t.start(); work(); t.join()\n")


@pytest.fixture(scope="module")
def slurm(service):
    # The node's own configuration (/etc/slurm): the agent's `scontrol listpids` finds it, as on a real node.
    # The Prolog and Epilog find the agent at its default socket.
    # Slurm resolves even 127.0.0.1 with AI_ADDRCONFIG, which finds nothing on a host whose only interface is
    # loopback (the lab VM has no network): a dummy interface with a documentation address satisfies it.
    # Slurm's own traffic stays on 127.0.0.1.
    sh("ip link set lo up && (ip link show rmr-slurm0 || ip link add rmr-slurm0 type dummy) && "
       "ip addr replace 192.0.2.1/32 dev rmr-slurm0 && ip link set rmr-slurm0 up")
    cluster = SlurmCluster.create(conf_dir=Path("/etc/slurm"))
    try:
        cluster.start(timeout=180)
        yield cluster
    finally:
        cluster.stop()


def training(name: str):
    jobs = api_get("/v1/training-jobs", quiet=True) or {"jobs": []}
    return next((j for j in jobs["jobs"] if j["name"] == name), None)


def is_rr(tid: int) -> bool:
    try:
        return os.sched_getscheduler(tid) == os.SCHED_RR
    except ProcessLookupError:
        return False


def threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _cpus(text: str) -> set[int]:
    from reamer.host.cpulist import parse_cpulist

    return set(parse_cpulist(text))


def test_a_slurm_jobs_steps_run_real_time_on_cores_inside_its_allocation(slurm):
    work = Path(tempfile.mkdtemp(prefix="slurm-job-", dir="/tmp"))
    os.chmod(work, 0o755)
    (work / "task.py").write_text(TASK.format(seconds=40))
    (work / "job.sh").write_text(f"#!/bin/sh\nsrun /usr/bin/python3 {work}/task.py\nsrun /usr/bin/python3 {work}/task.py\n")
    job_id = slurm.sbatch("-c", "4", "--comment=reamer:cores=1", "-o", str(work / "out"), str(work / "job.sh"))
    name = f"slurm-{job_id}"
    try:
        job = wait_for(lambda: (j := training(name)) and j["state"] == "running" and j["threads_rr"] and j,
                       timeout=240, what=f"{name} running with RR threads")
        allocation = set(job["scheduler"]["allocated_cpus"])
        reserved = set(api_get("/v1/node")["reserved_cpus"])
        assert set(job["cpus"]) <= allocation - reserved and job["cpus"], (job, allocation, reserved)
        seen: dict[str, str] = {}
        cgroup_root = Path("/sys/fs/cgroup")

        def steps_pinned() -> bool:
            view = training(name) or {}
            for step in view.get("steps") or []:
                directory = cgroup_root / step["cgroup"]
                if step["id"].isdigit() and step["id"] not in seen and directory.is_dir():  # the step runs now
                    assert "slurmstepd.scope/" in step["cgroup"], f"step {step} is not under systemd's slurmstepd.scope"
                    assert _cpus((directory / "cpuset.cpus.effective").read_text()) == set(job["cpus"]), step
                    job_cgroup = cgroup_root / step["cgroup"].split("/step_")[0]
                    assert _cpus((job_cgroup / "cpuset.cpus.effective").read_text()) == allocation  # never narrowed
                    seen[step["id"]] = step["cgroup"]
            tasks = view.get("pids") or []
            for pid in tasks:  # the steps' task processes, as Slurm lists them
                try:
                    affinity = os.sched_getaffinity(pid)
                except ProcessLookupError:
                    continue  # the step ended since the agent listed it
                assert all(is_rr(t) for t in threads(pid)), f"task {pid} is not SCHED_RR"
                assert set(affinity) <= set(job["cpus"]), f"task {pid} runs outside {job['cpus']}"
            return len(seen) == 2 and bool(tasks)

        wait_for(steps_pinned, timeout=300, what=f"both srun steps pinned on cpus {job['cpus']} (saw {seen})")
        for pid in sh(["pgrep", "-x", "slurmstepd"]).split():
            assert not any(is_rr(t) for t in threads(int(pid))), f"slurmstepd {pid} has a real-time thread"
        assert sh(["systemctl", "show", "slurmstepd.scope", "-p", "AllowedCPUs", "--value"]).strip() == ""
        wait_for(lambda: training(name) is None, timeout=300, what=f"{name} to end with its Slurm job")
        assert set(job["cpus"]) <= set(api_get("/v1/node")["idle_cpus"])
    finally:
        slurm.run("scancel", str(job_id), check=False)
        shutil.rmtree(work, ignore_errors=True)
