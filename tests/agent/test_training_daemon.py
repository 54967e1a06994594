"""Training pinning through a real agent daemon: real cgroups, real SCHED_RR, real processes."""
from __future__ import annotations

import os
import time

import pytest

from reamer.api.client import ApiError
from tests.agent.conftest import all_rr, cgroup_path, needs_rt_host, none_rt, wait_event, wait_for

pytestmark = [needs_rt_host, pytest.mark.root]


def test_attach_pins_catches_new_threads_and_children_then_detach_restores(daemon, trainer_factory):
    trainer = trainer_factory(threads=2)
    before_cpu, before_cpuset = cgroup_path(trainer.pid, "cpu"), cgroup_path(trainer.pid, "cpuset")
    job = daemon.client.attach_training({"name": "t1", "pids": [trainer.pid], "cores": 1, "priority": 7})

    assert job.state == "running" and job.priority == 7 and len(job.cpus) == 1
    assert job.threads_rr == job.threads >= 3
    assert all_rr(trainer.pid, 7)
    assert cgroup_path(trainer.pid, "cpuset") == f"/{daemon.cgroup_name}/train-t1"
    assert cgroup_path(trainer.pid, "cpu") == before_cpu == "/", "the root cpu cgroup needs no RT budget: it stays"
    assert sorted(os.sched_getaffinity(trainer.pid)) == job.cpus
    node = daemon.client.node()
    assert node.training_cpus == job.cpus and job.cpus[0] not in node.idle_cpus

    # A thread born after the attach: inherits RR here, so demote it to see the reconcile repair it.
    trainer.add_thread()
    newest = max(int(t) for t in os.listdir(f"/proc/{trainer.pid}/task"))
    os.sched_setscheduler(newest, os.SCHED_OTHER, os.sched_param(0))
    wait_for(lambda: all_rr(trainer.pid, 7), timeout=10, what="the reconcile loop to make the new thread RR again")
    wait_event(daemon, "training_threads_fixed", job="t1")

    child = trainer.fork()
    wait_for(lambda: child in daemon.client.get_training_job("t1").pids, timeout=10, what="the child to be listed")
    assert all_rr(child, 7)

    detached = daemon.client.detach_training("t1")
    assert detached.state == "ended"
    assert none_rt(trainer.pid) and none_rt(child)
    assert cgroup_path(trainer.pid, "cpu") == before_cpu
    assert cgroup_path(trainer.pid, "cpuset") == before_cpuset
    assert not os.path.exists(f"/sys/fs/cgroup/cpuset/{daemon.cgroup_name}/train-t1")
    assert daemon.client.node().training_cpus == []
    with pytest.raises(ApiError) as info:
        daemon.client.get_training_job("t1")
    assert info.value.status == 404 and info.value.code == "not_found"


def test_process_exit_ends_the_job_and_frees_its_cores(daemon, trainer_factory):
    trainer = trainer_factory(threads=1)
    job = daemon.client.attach_training({"name": "short", "pids": [trainer.pid], "cores": 1})
    assert daemon.client.node().training_cpus == job.cpus
    trainer.stop()
    event = wait_event(daemon, "training_ended", job="short")
    assert event.data["cpus"] == job.cpus
    assert daemon.client.list_training_jobs() == []
    assert daemon.client.node().training_cpus == []


def test_restart_reattaches_and_keeps_pinning(daemon_factory, trainer_factory):
    daemon = daemon_factory()
    trainer = trainer_factory(threads=2)
    job = daemon.client.attach_training({"name": "keep", "pids": [trainer.pid], "cores": 1})
    assert daemon.stop() == 0  # clean shutdown
    assert all_rr(trainer.pid), "agent shutdown must leave training SCHED_RR"
    assert cgroup_path(trainer.pid, "cpuset") == f"/{daemon.cgroup_name}/train-keep"

    daemon.start()
    jobs = daemon.client.list_training_jobs()
    assert [j.name for j in jobs] == ["keep"] and jobs[0].cpus == job.cpus
    # The restarted agent reconciles the restored job: a thread demoted while it was down is RR again.
    trainer.add_thread()
    newest = max(int(t) for t in os.listdir(f"/proc/{trainer.pid}/task"))
    os.sched_setscheduler(newest, os.SCHED_OTHER, os.sched_param(0))
    wait_for(lambda: all_rr(trainer.pid), timeout=10, what="the restarted agent to repair the thread")


def test_attach_errors_are_clear(daemon, trainer_factory):
    from reamer.host.identity import pid_max

    ghost = next(p for p in range(pid_max() - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    with pytest.raises(ApiError) as info:
        daemon.client.attach_training({"name": "ghost", "pids": [ghost]})
    assert info.value.status == 400 and "does not exist" in info.value.message
    with pytest.raises(ApiError) as info:  # past any pid_max: refused by the request schema
        daemon.client.attach_training({"name": "ghost", "pids": [2**22 + 7]})
    assert info.value.status == 422 and "pids" in info.value.message
    trainer = trainer_factory(threads=1)
    with pytest.raises(ApiError) as info:
        daemon.client.attach_training({"name": "big", "pids": [trainer.pid], "cores": 64})
    assert info.value.status == 409 and info.value.code == "insufficient_cores"
    daemon.client.attach_training({"name": "one", "pids": [trainer.pid]})
    with pytest.raises(ApiError) as info:
        daemon.client.attach_training({"name": "one", "pids": [trainer.pid]})
    assert info.value.status == 409
    assert daemon.client.list_training_jobs()[0].name == "one"


def test_demote_all_stops_rr_until_reattached(daemon, trainer_factory):
    trainer = trainer_factory(threads=2)
    daemon.client.attach_training({"name": "d", "pids": [trainer.pid]})
    assert all_rr(trainer.pid)
    result = daemon.client.demote_all()
    assert result.threads_demoted >= 3 and "d" in result.jobs
    assert none_rt(trainer.pid)
    wait_event(daemon, "demoted_all")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert none_rt(trainer.pid), "the reconcile loop must not re-promote after demote-all"
        time.sleep(0.1)
    assert "demote" in daemon.client.get_training_job("d").message


def test_demo_runs_beside_an_idle_agent_with_the_shipped_budget(daemon_factory):
    """An idle agent holds no RT budget and no cgroup, so `reamer demo` (its own agent) runs beside it."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    shipped = yaml.safe_load(Path("configs/reamer.yaml").read_text())["training"]["rt_runtime_us"]
    daemon = daemon_factory(training={"rt_runtime_us": shipped})
    assert not Path(f"/sys/fs/cgroup/cpu/{daemon.cgroup_name}").exists(), "an idle agent creates no cgroup"
    proc = subprocess.run([sys.executable, "-m", "reamer.cli.main", "demo", "--duration", "5"],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "=== reamer demo summary ===" in out, out[-3000:]
    assert daemon.client.health()


def test_conflicting_cpuset_manager_shows_in_events_status_and_doctor(daemon, trainer_factory):
    from pathlib import Path

    from click.testing import CliRunner

    from reamer.cli.main import cli

    home = f"{daemon.cgroup_name}-home"
    cg = Path("/sys/fs/cgroup")
    for level in (home, f"{home}/job"):
        (cg / "cpuset" / level).mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            (cg / "cpuset" / level / name).write_text((cg / "cpuset" / name).read_text())
    trainer = trainer_factory(threads=1)
    (cg / "cpuset" / home / "job" / "cgroup.procs").write_text(str(trainer.pid))
    try:
        job = daemon.client.attach_training({"name": "cm", "cgroup": f"{home}/job", "cores": 1})
        assert cgroup_path(trainer.pid, "cpuset") == f"/{home}/job", "pinned in place"
        full = (cg / "cpuset" / "cpuset.cpus").read_text().strip()
        (cg / "cpuset" / home / "job" / "cpuset.cpus").write_text(full)  # another manager widens it
        wait_event(daemon, "training_cpuset_conflict", job="cm")
        time.sleep(1.0)  # several passes: reamer must not write it back, nor report it again
        assert (cg / "cpuset" / home / "job" / "cpuset.cpus").read_text().strip() == full
        assert [e.kind for e in daemon.client.events(0).events].count("training_cpuset_conflict") == 1
        status = CliRunner().invoke(cli, ["--socket", daemon.socket, "status"])
        assert "cm: conflict: cpuset of" in status.output, status.output
        doctor = CliRunner().invoke(cli, ["--socket", daemon.socket, "doctor"])
        assert "training-cpusets" in doctor.output and "another manager" in doctor.output, doctor.output
        daemon.client.detach_training("cm")
        assert (cg / "cpuset" / home / "job" / "cpuset.cpus").read_text().strip() == full
        assert job.cpus
    finally:
        trainer.stop()
        for level in (f"{home}/job", home):
            try:
                (cg / "cpuset" / level).rmdir()
            except OSError:
                pass
