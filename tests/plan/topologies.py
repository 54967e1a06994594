"""Synthetic topologies for plan tests (Linux numbering: SMT sibling of cpu i is i + physical cores)."""
from __future__ import annotations

from hypothesis import strategies as st

from reamer.host.topology import Cpu, Topology


def make_topology(packages: int = 1, nodes_per_package: int = 1, l3_per_node: int = 1,
                  cores_per_l3: int = 2, smt: int = 1) -> Topology:
    physical = []
    core_index = 0
    for package in range(packages):
        for node_in_package in range(nodes_per_package):
            node = package * nodes_per_package + node_in_package
            for l3_in_node in range(l3_per_node):
                l3 = node * l3_per_node + l3_in_node
                for _ in range(cores_per_l3):
                    physical.append((core_index, package, node, l3))
                    core_index += 1
    total = len(physical)
    cpus = [
        Cpu(id=thread * total + core_id, core_id=core_id, package_id=package, numa_node=node, l3_id=l3)
        for thread in range(smt)
        for core_id, package, node, l3 in physical
    ]
    return Topology(cpus=tuple(sorted(cpus, key=lambda c: c.id)), model_name="synthetic", isa_flags=())


topologies = st.builds(
    make_topology,
    packages=st.integers(1, 2),
    nodes_per_package=st.integers(1, 2),
    l3_per_node=st.integers(1, 2),
    cores_per_l3=st.integers(1, 4),
    smt=st.integers(1, 2),
)
