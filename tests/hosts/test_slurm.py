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
    cluster = SlurmCluster.create(conf_dir=Path("/etc/slurm"))
    try:
        cluster.start(timeout=180)
        yield cluster
    finally:
        cluster.stop()


def training(name: str):
    jobs = api_get("/v1/training-jobs", quiet=True) or {"jobs": []}
    return next((j for j in jobs["jobs"] if j["name"] == name), None)


def tasks_of(step_dir: Path) -> list[int]:
    return [int(p) for f in step_dir.rglob("cgroup.procs") if "/user/" in str(f) for p in f.read_text().split()]


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
        scope = Path("/sys/fs/cgroup/system.slice/slurmstepd.scope")
        job_dir = scope / f"job_{job_id}"
        seen_steps: set[str] = set()

        def steps_pinned() -> bool:
            for step in job_dir.glob("step_[0-9]*"):
                tasks = tasks_of(step)
                if tasks and all(is_rr(t) for p in tasks for t in threads(p)):
                    for pid in tasks:
                        assert set(os.sched_getaffinity(pid)) <= set(job["cpus"])
                    seen_steps.add(step.name)
            return len(seen_steps) == 2

        wait_for(steps_pinned, timeout=300, what=f"both srun steps RR on cpus {job['cpus']} (saw {seen_steps})")
        for pid in sh(["pgrep", "-x", "slurmstepd"]).split():
            assert not any(is_rr(t) for t in threads(int(pid))), f"slurmstepd {pid} has a real-time thread"
        assert sh(["systemctl", "show", "slurmstepd.scope", "-p", "AllowedCPUs", "--value"]).strip() == ""
        assert set(sh(["cat", str(job_dir / "cpuset.cpus.effective")]).strip()) and \
            "reamer" not in (job_dir / "cpuset.cpus").read_text()
        wait_for(lambda: training(name) is None, timeout=300, what=f"{name} to end with its Slurm job")
        assert set(job["cpus"]) <= set(api_get("/v1/node")["idle_cpus"])
    finally:
        slurm.run("scancel", str(job_id), check=False)
        shutil.rmtree(work, ignore_errors=True)
