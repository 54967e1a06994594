"""A real Slurm drives reamer: a private single-node cluster (munge, slurmctld, slurmd) whose Prolog and Epilog are
the project's contrib/slurm scripts, beside a private agent, on this host's cgroup v1.

What a Slurm user would see: a job that asks for reamer has its steps' tasks SCHED_RR on cores reamer chose inside
the job's allocation, every step on the same cores, slurmstepd never real-time, the job's own cgroup never written;
the end of the job (normal or scancel) gives everything back; jobs that do not ask are untouched; the node is
never drained.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from reamer.api.client import ApiError
from tests.agent.conftest import _new_daemon, all_rr, needs_rt_host, none_rt
from tests.conftest import wait_for
from tests.slurm.cluster import CONTRIB, SlurmCluster, missing_binaries

pytestmark = [
    pytest.mark.root, pytest.mark.slow, needs_rt_host,
    pytest.mark.skipif(bool(missing_binaries()), reason=f"Slurm is not installed ({', '.join(missing_binaries())} "
                       "missing): apt-get install slurmctld slurmd slurm-client munge"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cpus: one reserved, one for the job"),
]

# A training task: two threads with a small duty cycle, reporting its cpus and policy once it runs.
TASK = ("import os,threading,time\n"
        "def work():\n"
        "    end = time.time() + {seconds}\n"
        "    while time.time() < end:\n"
        "        sum(range(3000)); time.sleep(0.02)\n"
        "t = threading.Thread(target=work); t.start(); work(); t.join()\n")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    made = SlurmCluster.create(gres_count=2)
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture(scope="module")
def agent(cluster) -> Iterator:
    daemon = _new_daemon(reserved_cpus=[0])
    try:  # the agent asks this cluster's slurmd (scontrol listpids), as a node's agent asks its own
        daemon.start(env=dict(os.environ, SLURM_CONF=str(cluster.conf)))
        yield daemon
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def slurm(cluster, agent) -> SlurmCluster:
    cluster.agent_socket = agent.socket
    return cluster.start()


def batch_script(tmp_path: Path, seconds: float, steps: int = 1) -> str:
    task = tmp_path / "task.py"
    task.write_text(TASK.format(seconds=seconds))
    os.chmod(tmp_path, 0o755)
    lines = ["#!/bin/sh"] + [f"srun /usr/bin/python3 {task}" for _ in range(steps)]
    script = tmp_path / "job.sh"
    script.write_text("\n".join(lines) + "\n")
    return str(script)


def job_view(agent, name: str):
    try:
        return agent.client.get_training_job(name)
    except ApiError:
        return None


def task_pids(step_dir: Path) -> list[int]:
    """Processes of a step cgroup that are not Slurm's own (slurmstepd)."""
    pids = [int(p) for p in (step_dir / "cgroup.procs").read_text().split()]
    return [p for p in pids if _comm(p) not in ("slurmstepd", "")]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def step_dirs(job_id: int) -> dict[str, Path]:
    found = {}
    for job_dir in Path("/sys/fs/cgroup/cpuset").glob(f"slurm*/uid_*/job_{job_id}"):
        for step in job_dir.glob("step_*"):
            found[step.name[len("step_"):]] = step
    return found


def slurmstepd_rt() -> list[int]:
    """Threads of any slurmstepd that are real-time (there must be none)."""
    found = []
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "slurmstepd":
            found += [t.id for t in proc.threads() if os.sched_getscheduler(t.id) in (os.SCHED_RR, os.SCHED_FIFO)]
    return found


def test_two_steps_run_real_time_on_the_cores_reamer_chose_inside_the_allocation(slurm, agent, tmp_path):
    since = agent.client.events(since=0).last_id
    job_id = slurm.sbatch("-c", "2", "--comment=reamer:cores=1", "-o", str(tmp_path / "out"),
                          batch_script(tmp_path, seconds=4, steps=2))
    name = f"slurm-{job_id}"
    view = wait_for(lambda: (v := job_view(agent, name)) and v.state == "running" and v.threads_rr and v,
                    timeout=60, what=f"{name} running with RR threads ({slurm.log_text()[-2000:]})")
    assert view.source == "slurm" and view.cpus == [1], view  # cpu 0 is reserved: one core inside {0, 1}
    seen_steps: set[str] = set()

    def check_step() -> bool:
        for step, directory in step_dirs(job_id).items():
            if step in ("extern", "batch"):
                continue
            tasks = task_pids(directory)
            if tasks and all(all_rr(p) for p in tasks):
                assert (directory / "cpuset.cpus").read_text().strip() == "1"
                for pid in tasks:
                    assert os.sched_getaffinity(pid) == {1}
                seen_steps.add(step)
        assert not slurmstepd_rt(), "a slurmstepd thread was made real-time"
        return len(seen_steps) == 2

    wait_for(check_step, timeout=60, interval=0.2, what=f"both srun steps RR on cpu 1 (saw {seen_steps})")
    job_dir = next(Path("/sys/fs/cgroup/cpuset").glob(f"slurm*/uid_*/job_{job_id}"))
    assert (job_dir / "cpuset.cpus").read_text().strip() == "0-1"  # the job's own cgroup: Slurm's, never written

    wait_for(lambda: job_view(agent, name) is None, timeout=60, what=f"{name} to end with its Slurm job")
    assert 1 in agent.client.node().idle_cpus
    kinds = [e.kind for e in agent.client.events(since=since).events if e.job == name]
    assert "training_pending" in kinds and "training_attached" in kinds, kinds
    assert "training_cpuset_conflict" not in kinds, kinds  # Slurm re-widening its job cgroup is no conflict
    assert {"training_ended", "training_detached"} & set(kinds), kinds
    wait_for(lambda: slurm.node_state() == "idle", timeout=60, what="the node idle again (never drained)")


def test_scancel_gives_everything_back(slurm, agent, tmp_path):
    job_id = slurm.sbatch("-c", "2", "--comment=reamer:cores=1", "-o", str(tmp_path / "out"),
                          batch_script(tmp_path, seconds=60))
    name = f"slurm-{job_id}"
    wait_for(lambda: (v := job_view(agent, name)) and v.threads_rr, timeout=60, what=f"{name} pinned")
    slurm.run("scancel", str(job_id))
    wait_for(lambda: job_view(agent, name) is None, timeout=60, what=f"{name} to go after scancel")
    assert 1 in agent.client.node().idle_cpus
    wait_for(lambda: slurm.node_state() == "idle", timeout=60, what="the node idle (not drained)")


def test_a_job_that_does_not_ask_is_left_alone(slurm, agent, tmp_path):
    job_id = slurm.sbatch("-c", "2", "-o", str(tmp_path / "out"), batch_script(tmp_path, seconds=3))
    wait_for(lambda: any(task_pids(d) for s, d in step_dirs(job_id).items() if s not in ("extern", "batch")),
             timeout=60, what="the job's step to run")
    for step, directory in step_dirs(job_id).items():
        for pid in task_pids(directory):
            assert none_rt(pid)
    assert job_view(agent, f"slurm-{job_id}") is None
    wait_for(lambda: slurm.job_state(job_id) in ("COMPLETED", ""), timeout=60, what="the job to complete")
    wait_for(lambda: slurm.node_state() == "idle", timeout=60, what="the node idle again (never drained)")


def test_the_epilog_exits_0_for_unknown_jobs_and_a_missing_agent(agent):
    epilog = str(CONTRIB / "reamer-epilog")
    for socket_path in (agent.socket, "/nonexistent/reamer.sock"):
        done = subprocess.run([epilog], env={"SLURM_JOB_ID": "987654", "REAMER_SOCKET": socket_path,
                                             "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr


def test_the_prolog_lets_a_job_run_when_the_agent_is_down_and_refuses_a_bad_comment(agent):
    prolog = str(CONTRIB / "reamer-prolog")
    env = {"SLURM_JOB_ID": "987655", "SLURM_JOB_COMMENT": "reamer:cores=1", "PATH": "/usr/bin:/bin",
           "REAMER_SOCKET": "/nonexistent/reamer.sock"}
    done = subprocess.run([prolog], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "cannot be reached" in done.stderr, done.stderr
    env.update(SLURM_JOB_COMMENT="reamer:cors=1", REAMER_SOCKET=agent.socket)
    done = subprocess.run([prolog], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "reamer:cores=N" in done.stderr, done.stderr
    env.update(SLURM_JOB_COMMENT="", SLURM_JOB_CONSTRAINTS="gpu")
    assert subprocess.run([prolog], env=env, timeout=30).returncode == 0  # not asking: nothing to do


def test_a_slurm_job_is_pending_until_it_runs_and_holds_nothing_meanwhile(agent):
    view = agent.client.attach_training({"name": "slurm-pending", "slurm_job": 424242})
    assert view.state == "pending" and view.cpus == [] and view.scheduler["job_id"] == 424242, view
    time.sleep(2.5)  # passes go by: a job that never starts here stays pending and holds no core
    view = agent.client.get_training_job("slurm-pending")
    assert view.state == "pending" and view.cpus == [], view
    agent.client.detach_training("slurm-pending")
    assert job_view(agent, "slurm-pending") is None


def reamer_cli(slurm: SlurmCluster, agent, *args: str) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "reamer.cli.main", "--socket", agent.socket, *args],
                          env=slurm.env, capture_output=True, text=True, timeout=120)


def test_spare_cores_are_published_to_slurm_and_enforced_at_submit(slurm, agent, tmp_path):
    capacity = agent.client.capacity()
    assert capacity["spare_cores"] == 1 and capacity["spare_cpus"] == [1], capacity  # cpu 0 is reserved
    done = reamer_cli(slurm, agent, "slurm", "report", "--once", "--node", slurm.node_name)
    assert done.returncode == 0, done.stderr
    assert slurm.node_gres() == "reamer_spare:1", slurm.node_gres()
    refused = slurm.run("sbatch", "--gres=reamer_spare:2", "--wrap", "true", check=False)
    assert refused.returncode != 0 and "not available" in refused.stderr, refused.stderr
    job_id = slurm.sbatch("--gres=reamer_spare:1", "-o", str(tmp_path / "out"), "--wrap", "true")
    wait_for(lambda: slurm.job_state(job_id) in ("COMPLETED", ""), timeout=60, what="a job within the GRES to run")


def test_the_report_reasserts_the_gres_after_slurm_reads_its_config_again(slurm, agent):
    import sys
    import threading

    reporter = subprocess.Popen([sys.executable, "-m", "reamer.cli.main", "--socket", agent.socket, "slurm", "report",
                                 "--node", slurm.node_name, "--every", "3"], env=slurm.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(reporter.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: slurm.node_gres() == "reamer_spare:1" and lines, timeout=60, what="the first report")
        slurm.run("scontrol", "reconfigure")  # puts back slurm.conf's count (a slurmd restart does not, measured)
        wait_for(lambda: slurm.node_gres() == "reamer_spare:2", timeout=60,
                 what="the reconfigure to put back the configured count")
        reported = len(lines)
        wait_for(lambda: len(lines) > reported and slurm.node_gres() == "reamer_spare:1", timeout=60,
                 what=f"the reporter to assert the count again (said: {lines})")
    finally:
        reporter.terminate()
        reporter.wait(timeout=30)
    assert all("gres reamer_spare:1" in line for line in lines), lines


def test_capacity_follows_training_and_says_so_in_an_event(slurm, agent, tmp_path):
    since = agent.client.events(since=0).last_id
    before = agent.client.capacity()
    job_id = slurm.sbatch("-c", "2", "--comment=reamer:cores=1", "-o", str(tmp_path / "out"),
                          batch_script(tmp_path, seconds=60))
    name = f"slurm-{job_id}"
    try:
        wait_for(lambda: (v := job_view(agent, name)) and v.threads_rr, timeout=60, what=f"{name} pinned")
        during = wait_for(lambda: (c := agent.client.capacity())["spare_cores"] == 0 and c, timeout=30,
                          what="no spare core while training holds it")
        assert during["training_cores"] == 1 and during["generation"] > before["generation"], during
        changed = [e for e in agent.client.events(since=since).events if e.kind == "capacity_changed"]
        assert changed and changed[-1].data["spare_cores"] == 0, changed
        dry = agent.client.request("POST", "/v1/admission/training", json={"cores": 1})
        assert dry["admit"] is False and "free" in dry["reason"], dry
    finally:
        slurm.run("scancel", str(job_id))
    wait_for(lambda: agent.client.capacity()["spare_cores"] == 1, timeout=60, what="the core spare again")


def test_dry_run_admission_changes_nothing(agent):
    before = agent.client.node()
    yes = agent.client.request("POST", "/v1/admission/training", json={"cores": 1})
    assert yes["admit"] is True and yes["cpus"] == [1], yes
    inside = agent.client.request("POST", "/v1/admission/training", json={"cores": 1, "allocated_cpus": [0]})
    assert inside["admit"] is False and "allocation" in inside["reason"], inside  # cpu 0 is reserved
    too_many = agent.client.request("POST", "/v1/admission/training", json={"cores": 2})
    assert too_many["admit"] is False, too_many
    unknown = agent.client.request("POST", "/v1/admission/inference",
                                   json={"model": "/nonexistent/model.onnx", "slo_ms": 100, "rate_rps": 10})
    assert unknown["admit"] is None and "reamer search" in unknown["reason"], unknown
    after = agent.client.node()
    assert (after.training_cpus, after.idle_cpus, after.allocations) == \
        (before.training_cpus, before.idle_cpus, before.allocations)


def test_an_inference_job_slurm_placed_runs_on_its_cpus_and_ends_with_it(slurm, agent, tmp_path):
    import sys

    from reamer.serve import models

    model = models.build_model("tiny", tmp_path / "tiny.onnx").path
    script = tmp_path / "serve.sh"
    script.write_text("#!/bin/sh\n"
                      f"{sys.executable} -m reamer.cli.main --socket {agent.socket} infer deploy scoped-$SLURM_JOB_ID "
                      f"--model {model} --online --slo-ms 500 --layout 1x1:b1 --slurm-job $SLURM_JOB_ID\n"
                      "sleep 120\n")
    since = agent.client.events(since=0).last_id
    job_id = slurm.sbatch("-c", "2", "--gres=reamer_spare:1", "-o", str(tmp_path / "out"), "-D", str(tmp_path),
                          str(script))
    name = f"scoped-{job_id}"

    def running():
        try:
            job = agent.client.get_inference_job(name)
        except ApiError:
            return None
        return job if job.state == "running" and job.instances else None

    job = wait_for(running, timeout=120, what=f"{name} deployed from inside Slurm job {job_id} "
                                              f"({(tmp_path / 'out').read_text() if (tmp_path / 'out').exists() else ''})")
    assert job.slurm_job == job_id and job.allowed_cpus == [1], job
    assert [list(i.cpus) for i in job.instances] == [[1]], job.instances  # inside the Slurm job's cpus (0 is reserved)
    slurm.run("scancel", str(job_id))
    wait_for(lambda: name not in [j.name for j in agent.client.list_inference_jobs()], timeout=60,
             what=f"{name} removed with its Slurm job")
    kinds = [e.kind for e in agent.client.events(since=since).events if e.job == name]
    assert "inference_slurm_job_ended" in kinds, kinds
