"""TrainingPinner and the agent's RT safety rules, in-process (real cgroups and SCHED_RR)."""
from __future__ import annotations

import os

import pytest

from reamer.agent.config import config_from_dict
from reamer.agent.demote import demote_local
from reamer.agent.training import RtThrottlingDisabled, TrainingPinner
from reamer.host.cgroups import detect_driver
from tests.agent.conftest import TEST_RT_RUNTIME_US, all_rr, cgroup_path, cleanup_cgroups, needs_rt_host, none_rt

pytestmark = [needs_rt_host, pytest.mark.root]


@pytest.fixture
def pinner(cgroup_name):
    p = TrainingPinner(detect_driver(), cgroup_name, TEST_RT_RUNTIME_US)
    p.setup()
    yield p
    cleanup_cgroups(cgroup_name)


def test_setup_refuses_when_rt_throttling_is_disabled(tmp_path, cgroup_name):
    kernel = tmp_path / "sys" / "kernel"
    kernel.mkdir(parents=True)
    (kernel / "sched_rt_runtime_us").write_text("-1\n")
    (kernel / "sched_rt_period_us").write_text("1000000\n")
    pinner = TrainingPinner(detect_driver(), cgroup_name, TEST_RT_RUNTIME_US, proc_root=str(tmp_path))
    with pytest.raises(RtThrottlingDisabled) as info:
        pinner.setup()
    assert "sched_rt_runtime_us" in info.value.fix
    assert not detect_driver().exists(cgroup_name)


def test_attach_reconcile_detach(pinner, trainer_factory):
    trainer = trainer_factory(threads=2)
    home = {c: cgroup_path(trainer.pid, c).strip("/") for c in ("cpu", "cpuset")}
    original, state = pinner.attach("a", [trainer.pid], [1], 9)
    assert state.threads_rr == state.threads >= 3 and state.pids == [trainer.pid]
    assert all_rr(trainer.pid, 9)
    assert original == {str(trainer.pid): home}
    # the kernel budget the pinner set
    assert pinner.driver.get_rt_runtime(pinner.cpu_path) == TEST_RT_RUNTIME_US
    # drift: someone widens the cpuset; reconcile puts it back
    pinner.driver.set_cpus(pinner.cpuset_path("a"), [0, 1])
    pinner.reconcile("a", [1], 9)
    assert pinner.driver.get_cpus(pinner.cpuset_path("a")) == [1]
    demoted = pinner.detach("a", original)
    assert demoted >= 3 and none_rt(trainer.pid)
    assert {c: cgroup_path(trainer.pid, c).strip("/") for c in ("cpu", "cpuset")} == home
    assert not pinner.driver.exists(pinner.cpuset_path("a"))


def test_demote_local_works_without_the_agent(pinner, trainer_factory):
    trainer = trainer_factory(threads=3)
    pinner.attach("b", [trainer.pid], [1], 5)
    assert all_rr(trainer.pid)
    result = demote_local(name=pinner.name)
    assert result["threads_demoted"] >= 4 and result["jobs"] == ["b"]
    assert none_rt(trainer.pid)


def test_agent_demotes_everything_when_rt_throttling_is_turned_off(tmp_path, cgroup_name, trainer_factory,
                                                                    monkeypatch):
    from reamer.agent import service

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: cpu 0 reserved, one for training")
    config = config_from_dict({"socket": str(tmp_path / "s"), "state_dir": str(tmp_path / "state"),
                               "run_dir": str(tmp_path / "run"), "cgroup_name": cgroup_name, "reserved_cpus": [0],
                               "training": {"rt_runtime_us": TEST_RT_RUNTIME_US}})
    agent = service.Agent(config)
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
