"""reamer's topology against what the kernel reports (lscpu and sysfs) on each host profile."""
from __future__ import annotations

from pathlib import Path

import pytest

from reamer.host.cpulist import parse_cpulist
from reamer.host.topology import read_topology
from tests.hosts.helpers import PROFILE, jsonout, sh

SYS_CPU = Path("/sys/devices/system/cpu")


def lscpu_rows() -> list[dict[str, int | None]]:
    rows = []
    for line in sh(["lscpu", "-p=CPU,CORE,SOCKET,NODE"]).splitlines():
        if line.startswith("#"):
            continue
        cpu, core, socket, node = line.split(",")
        rows.append({"cpu": int(cpu), "core": int(core), "socket": int(socket), "node": int(node) if node else 0})
    return rows


def groups(pairs) -> set[frozenset[int]]:
    by: dict = {}
    for key, cpu in pairs:
        by.setdefault(key, set()).add(cpu)
    return {frozenset(v) for v in by.values()}


@pytest.fixture(scope="module")
def topology():
    return read_topology()


def test_counts_match_the_profile(topology):
    assert len(topology.cpus) == PROFILE.cpus
    assert len(topology.packages()) == PROFILE.sockets
    assert len(topology.physical_cores()) == PROFILE.sockets * PROFILE.cores
    assert len(topology.numa_nodes()) == PROFILE.numa_nodes
    assert all(len(core) == PROFILE.threads for core in topology.physical_cores())


def test_cores_sockets_and_nodes_as_lscpu_reports(topology):
    rows = lscpu_rows()
    assert sorted(r["cpu"] for r in rows) == topology.cpu_ids()
    assert groups((r["core"], r["cpu"]) for r in rows) == {frozenset(c) for c in topology.physical_cores()}
    assert groups((r["socket"], r["cpu"]) for r in rows) == {frozenset(v) for v in topology.packages().values()}
    assert groups((r["node"], r["cpu"]) for r in rows) == {frozenset(v) for v in topology.numa_nodes().values()}


def test_smt_siblings_numa_nodes_and_l3_as_sysfs_reports(topology):
    for cpu in topology.cpu_ids():
        siblings = parse_cpulist((SYS_CPU / f"cpu{cpu}/topology/thread_siblings_list").read_text())
        assert list(topology.siblings(cpu)) == sorted(siblings), f"SMT siblings of cpu {cpu}"
    nodes = {frozenset(parse_cpulist((d / "cpulist").read_text()))
             for d in Path("/sys/devices/system/node").glob("node[0-9]*")}
    assert {frozenset(v) for v in topology.numa_nodes().values()} == {n for n in nodes if n}
    l3 = set()
    for cpu in topology.cpu_ids():
        for index in (SYS_CPU / f"cpu{cpu}/cache").glob("index*"):
            if (index / "level").read_text().strip() == "3":
                l3.add(frozenset(parse_cpulist((index / "shared_cpu_list").read_text())))
    assert l3, "the kernel reports no L3 cache in this VM"
    assert {frozenset(v) for v in topology.l3_groups().values()} == l3


def test_cli_topology_and_agent_node_agree(service, topology):
    shown = jsonout(["reamer", "-o", "json", "topology"])
    assert [c["id"] for c in shown["cpus"]] == topology.cpu_ids()
    assert {frozenset(c) for c in shown["physical_cores"]} == {frozenset(c) for c in topology.physical_cores()}
    assert {frozenset(v) for v in shown["numa_nodes"].values()} == {frozenset(v) for v in topology.numa_nodes().values()}
    assert {frozenset(v) for v in shown["l3_groups"].values()} == {frozenset(v) for v in topology.l3_groups().values()}
    node = jsonout(["reamer", "-o", "json", "status"])["node"]
    assert node["cpus"] == topology.cpu_ids()
    assert node["cgroup_version"] == (2 if PROFILE.cgroup_v2 else 1)
    assert node["reserved_cpus"] == [0]  # the shipped config's default
