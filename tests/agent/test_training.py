"""TrainingPinner and the agent's RT rules, in-process, on this host's real cgroup v1 with RT group
scheduling: pinning in place, reamer's own cgroup for loose pids, the RT budget held only while a job
is attached (shared among jobs under the cap, given back on detach and clean stop), undo from the record
after a failed or interrupted attach, conflicts reported, not fought."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from reamer.agent.config import config_from_dict
from reamer.agent.demote import demote_local
from reamer.agent.training import OWN, IN_PLACE, RtThrottlingDisabled, TrainingPinner
from reamer.host.cgroups import detect_driver
from reamer.host.changes import ChangeLog
from reamer.host.errors import HostError
from reamer.node import build_agent
from tests.agent.conftest import TEST_RT_RUNTIME_US, all_rr, cgroup_path, cleanup_cgroups, needs_rt_host, none_rt

pytestmark = [needs_rt_host, pytest.mark.root]
CG = Path("/sys/fs/cgroup")
# Root's jobs share the privileged pool: the cap less training.user_rt_percent (25 by default) for users' jobs.
PRIVILEGED_POOL = TEST_RT_RUNTIME_US - TEST_RT_RUNTIME_US * 25 // 100


def rt(path: str) -> int:
    return int((CG / "cpu" / path / "cpu.rt_runtime_us").read_text())


def cpus_text(path: str) -> str:
    return (CG / "cpuset" / path / "cpuset.cpus").read_text().strip()


def homes(pid: int) -> dict[str, str]:
    return {c: cgroup_path(pid, c) for c in ("cpu", "cpuset", "memory")}


@pytest.fixture
def pinner(cgroup_name):
    p = TrainingPinner(detect_driver(), cgroup_name, TEST_RT_RUNTIME_US)
    p.setup()
    yield p
    cleanup_cgroups(cgroup_name)


@pytest.fixture
def job_cgroup(cgroup_name):
    """A training job's own cgroup made by someone else (a runtime, an operator): <test>/job in the cpu,
    cpuset and memory trees, with a memory limit reamer must leave alone."""
    path = f"{cgroup_name}-home/job"
    for controller in ("cpu", "cpuset", "memory"):
        for level in (f"{cgroup_name}-home", path):
            (CG / controller / level).mkdir(exist_ok=True)
            if controller == "cpuset":
                for name in ("cpuset.cpus", "cpuset.mems"):
                    (CG / controller / level / name).write_text((CG / "cpuset" / name).read_text())
    (CG / "memory" / path / "memory.limit_in_bytes").write_text(str(512 << 20))
    yield path
    cleanup_cgroups(f"{cgroup_name}-home")


def move_into(path: str, pid: int) -> None:
    for controller in ("cpu", "cpuset", "memory"):
        (CG / controller / path / "cgroup.procs").write_text(str(pid))


def new_log(pinner: TrainingPinner, job: str, saved: list) -> ChangeLog:
    return pinner.new_log(job, lambda changes: saved.append(list(changes)))


def test_setup_refuses_when_rt_throttling_is_disabled_and_holds_nothing(tmp_path, cgroup_name):
    kernel = tmp_path / "sys" / "kernel"
    kernel.mkdir(parents=True)
    (kernel / "sched_rt_runtime_us").write_text("-1\n")
    (kernel / "sched_rt_period_us").write_text("1000000\n")
    pinner = TrainingPinner(detect_driver(), cgroup_name, TEST_RT_RUNTIME_US, proc_root=str(tmp_path))
    with pytest.raises(RtThrottlingDisabled) as info:
        pinner.setup()
    assert "sched_rt_runtime_us" in info.value.fix
    TrainingPinner(detect_driver(), cgroup_name, TEST_RT_RUNTIME_US).setup()
    assert not detect_driver().exists(cgroup_name), "an idle pinner creates no cgroup and holds no RT budget"


def test_loose_pid_goes_into_reamers_own_cpuset_and_comes_back(pinner, trainer_factory):
    trainer = trainer_factory(threads=2)
    before = homes(trainer.pid)
    placement = pinner.place("a", "pids", [trainer.pid])
    assert placement.mode == OWN and placement.cpuset_path == pinner.own_path("a")
    assert placement.cpu_path == "", "a process in the root cpu cgroup needs no RT budget"
    saved: list = []
    state = pinner.attach("a", placement, [trainer.pid], [1], 9, new_log(pinner, "a", saved))
    assert state.threads_rr == state.threads >= 3 and state.pids == [trainer.pid]
    assert all_rr(trainer.pid, 9) and os.sched_getaffinity(trainer.pid) == {1}
    assert saved and saved[0][0]["kind"] == "mkdir", "the record is saved before the first change"
    assert cgroup_path(trainer.pid, "memory") == before["memory"], "only the cpuset tree changes on v1"
    demoted = pinner.detach("a")
    assert demoted >= 3 and none_rt(trainer.pid)
    assert homes(trainer.pid) == before
    assert not pinner.driver.exists(pinner.own_path("a"))


def test_cgroup_job_is_pinned_in_place_with_a_budget_only_while_attached(pinner, job_cgroup, trainer_factory):
    trainer = trainer_factory(threads=2)
    move_into(job_cgroup, trainer.pid)
    before, cpus_before = homes(trainer.pid), cpus_text(job_cgroup)
    parent = job_cgroup.split("/")[0]
    assert rt(job_cgroup) == 0 and rt(parent) == 0
    placement = pinner.place("c", "cgroup", [trainer.pid], job_cgroup)
    assert placement.mode == IN_PLACE and placement.cpuset_path == job_cgroup and placement.cpu_path == job_cgroup
    pinner.attach("c", placement, [trainer.pid], [1], 9, new_log(pinner, "c", []))
    assert homes(trainer.pid) == before, "no process changes cgroup"
    assert cpus_text(job_cgroup) == "1" and os.sched_getaffinity(trainer.pid) == {1}
    assert rt(job_cgroup) == PRIVILEGED_POOL and rt(parent) >= PRIVILEGED_POOL
    assert all_rr(trainer.pid, 9)
    assert (CG / "memory" / job_cgroup / "memory.limit_in_bytes").read_text().strip() == str(512 << 20)
    trainer.add_thread()  # a late thread (it inherits SCHED_RR; the pass counts it)
    state = pinner.reconcile("c", [1], 9)
    assert state.threads == state.threads_rr == 4 and all_rr(trainer.pid, 9)
    pinner.detach("c")
    assert none_rt(trainer.pid) and homes(trainer.pid) == before
    assert cpus_text(job_cgroup) == cpus_before, "detach restores the cpuset that was there"
    assert rt(job_cgroup) == 0 and rt(parent) == 0, "the RT budget is given back"


def test_budget_is_shared_among_jobs_under_the_cap_and_given_back(cgroup_name, job_cgroup, trainer_factory):
    pinner = TrainingPinner(detect_driver(), cgroup_name, 2 * TEST_RT_RUNTIME_US, user_rt_percent=0)
    other = f"{cgroup_name}-home/job2"
    for controller in ("cpu", "cpuset"):
        (CG / controller / other).mkdir()
    (CG / "cpuset" / other / "cpuset.mems").write_text((CG / "cpuset/cpuset.mems").read_text())
    (CG / "cpuset" / other / "cpuset.cpus").write_text((CG / "cpuset/cpuset.cpus").read_text())
    a, b = trainer_factory(threads=1), trainer_factory(threads=1)
    move_into(job_cgroup, a.pid)
    for controller in ("cpu", "cpuset"):
        (CG / controller / other / "cgroup.procs").write_text(str(b.pid))
    parent = job_cgroup.split("/")[0]
    try:
        pinner.attach("a", pinner.place("a", "cgroup", [a.pid], job_cgroup), [a.pid], [1], 9, new_log(pinner, "a", []))
        assert rt(job_cgroup) == 2 * TEST_RT_RUNTIME_US, "one job: the whole cap"
        pinner.attach("b", pinner.place("b", "cgroup", [b.pid], other), [b.pid], [1], 9, new_log(pinner, "b", []))
        assert rt(job_cgroup) == rt(other) == TEST_RT_RUNTIME_US, "two jobs: half the cap each"
        assert rt(parent) == 2 * TEST_RT_RUNTIME_US, "never more than the cap in all"
        assert all_rr(a.pid) and all_rr(b.pid)
        pinner.detach("b")
        assert rt(other) == 0 and rt(job_cgroup) == 2 * TEST_RT_RUNTIME_US
        pinner.detach("a")
        assert rt(job_cgroup) == rt(parent) == 0
    finally:
        for job in list(pinner.placements):
            pinner.detach(job)


def test_refused_budget_names_the_holders_and_undoes_the_cpuset(cgroup_name, job_cgroup, trainer_factory):
    holder = f"{cgroup_name}-holder"
    (CG / "cpu" / holder).mkdir()
    try:
        (CG / "cpu" / holder / "cpu.rt_runtime_us").write_text("20000")
        top = [d for d in (CG / "cpu").iterdir() if d.is_dir()]
        free = int((CG / "cpu/cpu.rt_runtime_us").read_text()) - sum(int((d / "cpu.rt_runtime_us").read_text())
                                                                      for d in top)
        pinner = TrainingPinner(detect_driver(), cgroup_name, free + 10000, user_rt_percent=0)
        trainer = trainer_factory(threads=1)
        move_into(job_cgroup, trainer.pid)
        cpus_before = cpus_text(job_cgroup)
        saved: list = []
        with pytest.raises(HostError) as info:
            pinner.attach("r", pinner.place("r", "cgroup", [trainer.pid], job_cgroup), [trainer.pid], [1], 9,
                          new_log(pinner, "r", saved))
        assert f"{holder} (20000 us)" in info.value.message and "rt_runtime_us" in info.value.fix
        assert cpus_text(job_cgroup) == cpus_before and rt(job_cgroup) == 0 and none_rt(trainer.pid)
        assert saved[-1] == [], "every change recorded was undone, and the record says so"
    finally:
        (CG / "cpu" / holder / "cpu.rt_runtime_us").write_text("0")
        (CG / "cpu" / holder).rmdir()


def agent_config(tmp_path, cgroup_name, **extra):
    return config_from_dict({"socket": str(tmp_path / "s"), "state_dir": str(tmp_path / "state"),
                             "run_dir": str(tmp_path / "run"), "cgroup_name": cgroup_name, "reserved_cpus": [0],
                             "training": {"rt_runtime_us": TEST_RT_RUNTIME_US}, **extra})


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: cpu 0 reserved")


@needs_two_cpus
def test_agent_gives_the_budget_back_on_clean_stop_and_takes_it_again(tmp_path, cgroup_name, job_cgroup,
                                                                      trainer_factory):
    trainer = trainer_factory(threads=2)
    move_into(job_cgroup, trainer.pid)
    agent = build_agent(agent_config(tmp_path, cgroup_name))
    agent.start(run_loop=False)
    try:
        agent.attach_training({"name": "t", "cgroup": job_cgroup, "cores": 1})
        assert all_rr(trainer.pid) and rt(job_cgroup) == PRIVILEGED_POOL
    finally:
        agent.stop()
    assert none_rt(trainer.pid) and rt(job_cgroup) == 0, "a stopped agent holds no RT budget"
    assert cpus_text(job_cgroup) == "1", "the pinning itself stays"
    agent = build_agent(agent_config(tmp_path, cgroup_name))
    agent.start(run_loop=False)
    try:
        assert all_rr(trainer.pid) and rt(job_cgroup) == PRIVILEGED_POOL
        agent.detach_training("t")
        assert rt(job_cgroup) == 0 and cpus_text(job_cgroup) != "1"
    finally:
        agent.stop()


@needs_two_cpus
def test_attach_interrupted_by_a_crash_is_undone_by_the_next_agent(tmp_path, cgroup_name, job_cgroup,
                                                                   trainer_factory, monkeypatch):
    from reamer.agent import service, training

    trainer = trainer_factory(threads=1)
    move_into(job_cgroup, trainer.pid)
    cpus_before = cpus_text(job_cgroup)
    agent = build_agent(agent_config(tmp_path, cgroup_name))
    agent.start(run_loop=False)

    class Crash(BaseException):
        pass

    def crash(*_args, **_kwargs):
        raise Crash()
    # the agent "dies" after narrowing the cpuset and reserving the budget: nothing of it runs any more
    monkeypatch.setattr(training.TrainingPinner, "reconcile", crash)
    monkeypatch.setattr(ChangeLog, "undo", lambda self: [])
    monkeypatch.setattr(service.Agent, "_rollback_attach", lambda self, name: None)
    with pytest.raises(Crash):
        agent.attach_training({"name": "x", "cgroup": job_cgroup, "cores": 1})
    agent.store.close()
    assert cpus_text(job_cgroup) == "1" and rt(job_cgroup) == PRIVILEGED_POOL
    monkeypatch.undo()
    agent = build_agent(agent_config(tmp_path, cgroup_name))
    agent.start(run_loop=False)
    try:
        assert cpus_text(job_cgroup) == cpus_before and rt(job_cgroup) == 0
        assert rt(job_cgroup.split("/")[0]) == 0
        assert agent.list_training() == [] and "training_attach_undone" in [e.kind for e in agent.events.since(0)]
    finally:
        agent.stop()


@needs_two_cpus
def test_another_manager_changing_the_cpuset_is_reported_not_fought(tmp_path, cgroup_name, job_cgroup,
                                                                    trainer_factory):
    trainer = trainer_factory(threads=1)
    move_into(job_cgroup, trainer.pid)
    agent = build_agent(agent_config(tmp_path, cgroup_name))
    agent.start(run_loop=False)
    try:
        agent.attach_training({"name": "k", "cgroup": job_cgroup, "cores": 1})
        (CG / "cpuset" / job_cgroup / "cpuset.cpus").write_text("0-1")  # kubelet's CPU manager, say
        for _ in range(3):
            agent.reconcile()
        assert cpus_text(job_cgroup) == "0-1", "reamer does not write it back"
        events = [e for e in agent.events.since(0) if e.kind == "training_cpuset_conflict"]
        assert len(events) == 1 and "another manager" in events[0].message
        assert "conflict" in agent.get_training("k")["message"]
    finally:
        agent.stop()
        cleanup_cgroups(cgroup_name)


def test_demote_local_works_without_the_agent(pinner, trainer_factory):
    trainer = trainer_factory(threads=3)
    pinner.attach("b", pinner.place("b", "pids", [trainer.pid]), [trainer.pid], [1], 5, new_log(pinner, "b", []))
    assert all_rr(trainer.pid)
    result = demote_local(name=pinner.name)
    assert result["threads_demoted"] >= 4 and result["jobs"] == ["b"]
    assert none_rt(trainer.pid)
    pinner.detach("b")


@needs_two_cpus
def test_agent_demotes_everything_when_rt_throttling_is_turned_off(tmp_path, cgroup_name, trainer_factory,
                                                                    monkeypatch):
    from reamer.agent import service

    agent = build_agent(agent_config(tmp_path, cgroup_name))
    try:
        agent.start(run_loop=False)
        trainer = trainer_factory(threads=2)
        job = agent.attach_training({"name": "t", "pids": [trainer.pid], "cores": 1})
        assert job["cpus"] == [1] and os.sched_getaffinity(trainer.pid) == {1}, "never RT on reserved cpu 0"
        assert all_rr(trainer.pid)
        monkeypatch.setattr(service, "rt_throttling", lambda *_: (-1, 1000000))
        agent.reconcile()
        assert none_rt(trainer.pid)
        agent.reconcile()  # and it stays demoted while throttling is off
        assert none_rt(trainer.pid)
        assert "RT throttling is off" in agent.get_training("t")["message"]
        with pytest.raises(RtThrottlingDisabled):
            agent.attach_training({"name": "u", "pids": [trainer.pid]})
        monkeypatch.undo()
        agent.reconcile()
        assert all_rr(trainer.pid)
        kinds = [e.kind for e in agent.events.since(0)]
        assert "rt_throttling_disabled" in kinds and "rt_throttling_enabled" in kinds
    finally:
        agent.stop()
        cleanup_cgroups(cgroup_name)
