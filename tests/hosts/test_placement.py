"""Placement on a 2-socket SMT host with two NUMA nodes, through the running agent (no model benchmark:
the tiny model answers one request): training gets whole physical cores inside one NUMA node, reserved
CPUs are never handed out, online inference never shares a physical core with training."""
from __future__ import annotations

import pytest

from reamer.host.topology import read_topology
from tests.hosts.helpers import (Workload, all_threads, api, api_error, deploy_online, descendants, sched_of,
                                 tiny_model)

pytestmark = pytest.mark.profiles("v2-numa")


def test_training_whole_cores_one_node_and_online_apart(service):
    topo = read_topology()
    node = api("GET", "/v1/node")
    reserved = set(node["reserved_cpus"])
    assert reserved == {0}
    reserved_cores = {s for r in reserved for s in topo.siblings(r)}
    workload = Workload(threads=2)
    try:
        job = api("POST", "/v1/training-jobs", {"name": "placed", "pids": [workload.pid], "cores": 2})
        cpus = set(job["cpus"])
        assert len(cpus) == 4, job
        for cpu in cpus:
            assert set(topo.siblings(cpu)) <= cpus, f"cpu {cpu}'s SMT sibling is not the job's: {sorted(cpus)}"
        assert len({topo.cpu(c).numa_node for c in cpus}) == 1, f"{sorted(cpus)} spans NUMA nodes"
        assert not cpus & reserved_cores, f"{sorted(cpus)} uses the reserved core {sorted(reserved_cores)}"
        # Node 0 keeps only one whole core beside the reserved one, so two cores must come from node 1.
        assert cpus == set(topo.numa_nodes()[1]), sorted(cpus)
        for t in all_threads(workload.pid):
            assert t.affinity <= cpus

        free = api("GET", "/v1/node")["free_cores"]
        greedy = Workload(threads=1)
        try:
            error = api_error("POST", "/v1/training-jobs", {"name": "greedy", "pids": [greedy.pid], "cores": free + 1})
        finally:
            greedy.stop()
        assert error.status == 409 and error.code == "insufficient_cores", (error.status, error.code, error.message)
        assert api("GET", "/v1/node")["allocations"] == {"placed": sorted(cpus)}

        online = deploy_online("placed-online", tiny_model())
        instance_cpus = {c for i in online["instances"] for c in i["cpus"]}
        assert instance_cpus and not instance_cpus & reserved
        shared = {s for c in instance_cpus for s in topo.siblings(c)} & cpus
        assert not shared, f"online instances on {sorted(instance_cpus)} share physical cores with training"
        for pid in descendants(online["pid"]):
            for tid in [int(t) for t in __import__("os").listdir(f"/proc/{pid}/task")]:
                sched = sched_of(tid)
                if sched is not None:
                    assert not sched.affinity & cpus, (
                        f"online job thread {tid} (process {pid}) may run on training cpus {sorted(sched.affinity & cpus)}")
    finally:
        for path in ("/v1/inference-jobs/placed-online", "/v1/training-jobs/placed"):
            try:
                api("DELETE", path)
            except Exception:  # noqa: BLE001
                pass
        workload.stop()
