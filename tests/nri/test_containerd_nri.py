"""reamer's NRI plugin against a real containerd 1.7 with NRI enabled, driven through CRI as a kubelet would.

Host network pods (no CNI), images built here, the cgroupfs driver (cgroup v1 on the CI host). What is
checked is what the runtime and the kernel did: the container's cgroup cpuset, its tasks' affinity and
scheduling policy, its memory and pids limits, and the agent's records.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reamer.api.client import ApiError
from reamer.host.cpulist import parse_cpulist
from tests.conftest import wait_for
from tests.agent.conftest import needs_rt_host
from tests.nri.conftest import needs_containerd17
from tests.nri.runtime import CGROUP_PARENT

pytestmark = [needs_containerd17, needs_rt_host, pytest.mark.timeout(600)]

TRAINING = {"reamer.io/role": "training", "reamer.io/cores": "1", "reamer.io/priority": "30"}
TASK = ["/bin/sh", "-c", "sleep 100000 & exec sleep 100000"]  # two processes: the shell's child and itself
MEMORY = 96 << 20


def container_cgroup(container_id: str, controller: str) -> Path:
    found = list(Path("/sys/fs/cgroup", controller, CGROUP_PARENT).glob(f"*/{container_id}"))
    assert len(found) == 1, f"the {controller} cgroup of {container_id[:12]}: {found}"
    return found[0]


def cgroup_cpus(container_id: str) -> list[int]:
    return parse_cpulist((container_cgroup(container_id, "cpuset") / "cpuset.cpus").read_text())


def host_cpus() -> list[int]:
    return parse_cpulist(Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus").read_text())


def tasks(container_id: str) -> list[int]:
    return [int(t) for t in (container_cgroup(container_id, "cpuset") / "tasks").read_text().split()]


def spec_cpus(cri, container_id: str) -> str:
    """The cpuset in the OCI spec the runtime created the container with (before it ran)."""
    info = cri.runtime.ContainerStatus(cri.cri.ContainerStatusRequest(container_id=container_id, verbose=True),
                                       timeout=60).info
    spec = json.loads(info["info"])["runtimeSpec"]
    return ((spec.get("linux") or {}).get("resources") or {}).get("cpu", {}).get("cpus", "")


def rr(tid: int) -> bool:
    try:
        return os.sched_getscheduler(tid) == os.SCHED_RR
    except ProcessLookupError:
        return True  # gone meanwhile


def job(agent, container_id: str) -> dict:
    return agent.client.request("GET", f"/v1/training-jobs/k8s-{container_id[:12]}")


def gone(agent, container_id: str) -> bool:
    try:
        job(agent, container_id)
    except ApiError as error:
        return error.status == 404
    return False


@pytest.fixture
def pods(cri):
    """run(name, annotations) -> (pod id, config); everything is stopped and removed afterwards."""
    made: list[str] = []

    def run(name: str, annotations: dict[str, str] | None = None):
        pod_id, config = cri.run_pod(name, annotations)
        made.append(pod_id)
        return pod_id, config

    yield run
    for pod_id in made:
        for container in cri.runtime.ListContainers(cri.cri.ListContainersRequest(
                filter=cri.cri.ContainerFilter(pod_sandbox_id=pod_id)), timeout=60).containers:
            try:
                cri.stop(container.id)
                cri.remove(container.id)
            except Exception:  # noqa: BLE001 - removed by the test already
                pass
        cri.remove_pod(pod_id)


def test_training_container_starts_on_its_cores_rr_with_its_limits_and_gives_them_back(agent, plugin, cri, pods):
    pod_id, config = pods("train-a", TRAINING)
    cid = cri.create_container(pod_id, config, "trainer", TASK, memory_bytes=MEMORY)
    pending = job(agent, cid)
    assert pending["state"] == "pending" and pending["source"] == "k8s" and len(pending["cpus"]) == 1
    assert pending["scheduler"] == {"kind": "kubernetes", "container_id": cid, "pod": "default/train-a"}
    cpus = pending["cpus"]
    assert parse_cpulist(spec_cpus(cri, cid)) == cpus  # in the container's spec before it ever ran

    cri.start(cid)
    wait_for(lambda: job(agent, cid)["state"] == "running" and len(tasks(cid)) >= 2
             and all(rr(t) for t in tasks(cid)), timeout=60, what="the container's tasks to run SCHED_RR")
    assert cgroup_cpus(cid) == cpus
    for tid in tasks(cid):
        assert sorted(os.sched_getaffinity(tid)) == cpus
        assert os.sched_getparam(tid).sched_priority == 30
    # the runtime's limits are the container's still: reamer pinned it in place
    assert int((container_cgroup(cid, "memory") / "memory.limit_in_bytes").read_text()) == MEMORY
    assert (container_cgroup(cid, "pids") / "pids.max").read_text().strip() == "max"  # as CRI asked: none
    assert all(f"/{cid}" in Path(f"/proc/{t}/cgroup").read_text() for t in tasks(cid))
    capacity = agent.client.capacity()
    assert capacity["kubernetes"]["reamer.io/spare-cores"] == str(capacity["spare_cores"])
    assert not set(capacity["spare_cpus"]) & set(cpus)

    cri.stop(cid)
    cri.remove(cid)
    wait_for(lambda: gone(agent, cid), timeout=60, what="the job to end when its container is removed")
    wait_for(lambda: set(cpus) <= set(agent.client.capacity()["spare_cpus"]), timeout=60,
             what="the container's cores to be spare again")


def test_pod_without_annotation_is_left_as_the_runtime_made_it(agent, plugin, cri, pods):
    pod_id, config = pods("plain")
    cid = cri.create_container(pod_id, config, "app", TASK, memory_bytes=MEMORY)
    assert spec_cpus(cri, cid) == ""  # no adjustment at all
    cri.start(cid)
    wait_for(lambda: len(tasks(cid)) >= 2, timeout=60, what="the plain container's processes")
    assert gone(agent, cid)
    assert cgroup_cpus(cid) == host_cpus()
    assert not any(os.sched_getscheduler(t) in (os.SCHED_RR, os.SCHED_FIFO) for t in tasks(cid))


def test_bad_annotation_refuses_the_container_with_the_fix(agent, plugin, cri, pods):
    pod_id, config = pods("bad", {"reamer.io/role": "training", "reamer.io/cores": "lots"})
    with pytest.raises(Exception) as failed:
        cri.create_container(pod_id, config, "trainer", TASK)
    assert "reamer.io/cores" in str(failed.value) and "fix:" in str(failed.value)


def test_inference_pod_gets_only_cores_no_training_holds_and_follows_the_pool(agent, plugin, cri, pods):
    pod_id, config = pods("infer", {"reamer.io/role": "inference"})
    server = cri.create_container(pod_id, config, "server", TASK)
    cri.start(server)
    assert gone(agent, server)  # inference pods hold no reservation
    wait_for(lambda: len(tasks(server)) >= 2, timeout=60, what="the inference container's processes")
    before = cgroup_cpus(server)
    assert before == parse_cpulist(spec_cpus(cri, server)) == sorted(agent.client.capacity()["spare_cpus"])

    train_id, train_config = pods("train-b", TRAINING)
    trainer = cri.create_container(train_id, train_config, "trainer", TASK)
    training_cpus = job(agent, trainer)["cpus"]
    wait_for(lambda: not set(cgroup_cpus(server)) & set(training_cpus), timeout=60,
             what="the inference container to leave the training container's cores")
    assert cgroup_cpus(server) and not any(os.sched_getscheduler(t) == os.SCHED_RR for t in tasks(server))

    cri.remove(trainer)
    wait_for(lambda: cgroup_cpus(server) == before, timeout=60,
             what="the inference container to get the cores back once training is gone")


def test_plugin_killed_mid_way_loses_nothing_and_adopts_what_started_meanwhile(agent, plugin, cri, pods):
    pod_a, config_a = pods("train-c", TRAINING)
    first = cri.create_container(pod_a, config_a, "trainer", TASK)
    cri.start(first)
    wait_for(lambda: job(agent, first)["state"] == "running", timeout=60, what="the first container pinned")
    cpus_first = job(agent, first)["cpus"]

    plugin.kill()
    pod_b, config_b = pods("train-d", TRAINING)
    second = cri.create_container(pod_b, config_b, "trainer", TASK)  # the runtime goes on without the plugin
    cri.start(second)
    assert gone(agent, second) and spec_cpus(cri, second) == ""
    assert job(agent, first)["cpus"] == cpus_first

    plugin.start()  # Synchronize: the first keeps its cores, the second is adopted and moved onto its own
    wait_for(lambda: not gone(agent, second) and job(agent, second)["state"] == "running"
             and all(rr(t) for t in tasks(second)), timeout=90, what="the second container adopted and pinned")
    cpus_second = job(agent, second)["cpus"]
    assert cgroup_cpus(second) == cpus_second and not set(cpus_second) & set(cpus_first)
    assert job(agent, first)["cpus"] == cpus_first and cgroup_cpus(first) == cpus_first
    jobs = [j["name"] for j in agent.client.request("GET", "/v1/training-jobs")["jobs"]]
    assert sorted(jobs) == sorted([f"k8s-{first[:12]}", f"k8s-{second[:12]}"])


def test_agent_restart_keeps_the_reservation(agent, plugin, cri, pods):
    pod_id, config = pods("train-e", TRAINING)
    cid = cri.create_container(pod_id, config, "trainer", TASK)
    cpus = job(agent, cid)["cpus"]
    agent.kill()
    agent.start()
    assert job(agent, cid)["cpus"] == cpus and job(agent, cid)["state"] == "pending"
    cri.start(cid)
    wait_for(lambda: job(agent, cid)["state"] == "running" and all(rr(t) for t in tasks(cid)), timeout=60,
             what="the container pinned after the agent restarted")
    assert cgroup_cpus(cid) == cpus


def test_a_record_without_a_container_gives_its_cores_back(agent, plugin):
    """A CreateContainer the runtime gave up on (the answer came too late) leaves a record and no container."""
    orphan = "ef" * 32
    held = agent.client.request("POST", "/v1/training-jobs",
                                json={"name": f"k8s-{orphan[:12]}", "k8s_container": orphan, "cores": 1})["cpus"]
    wait_for(lambda: gone(agent, orphan), timeout=90, what="the plugin to give back a record with no container")
    wait_for(lambda: set(held) <= set(agent.client.capacity()["spare_cpus"]), timeout=60, what="the cores back")
