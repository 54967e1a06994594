"""Host profiles: the kinds of production host the lab boots, one VM each."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    cgroup_v2: bool
    sockets: int
    cores: int  # per socket
    threads: int  # per core
    numa_nodes: int
    memory_mb: int
    kernel_args: tuple[str, ...] = ()
    image: str = "bookworm"  # a recipe of lab/image.py RECIPES
    # False: only the tests marked for this profile run here (a profile for one subsystem, not a host kind)
    runs_unmarked_tests: bool = True

    @property
    def cpus(self) -> int:
        return self.sockets * self.cores * self.threads

    def qemu_topology_args(self) -> list[str]:
        args = ["-m", f"{self.memory_mb}M",
                "-smp", f"{self.cpus},sockets={self.sockets},cores={self.cores},threads={self.threads}"]
        if self.numa_nodes > 1:
            per_node_mb = self.memory_mb // self.numa_nodes
            per_node_cpus = self.cpus // self.numa_nodes
            for node in range(self.numa_nodes):
                first = node * per_node_cpus
                args += ["-object", f"memory-backend-ram,id=m{node},size={per_node_mb}M",
                         "-numa", f"node,nodeid={node},cpus={first}-{first + per_node_cpus - 1},memdev=m{node}"]
        return args

    def kernel_cmdline(self) -> list[str]:
        return [f"systemd.unified_cgroup_hierarchy={1 if self.cgroup_v2 else 0}", *self.kernel_args]


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("v2-numa", "cgroup v2 under systemd; 2 sockets x 2 cores x 2 threads, two NUMA nodes",
            cgroup_v2=True, sockets=2, cores=2, threads=2, numa_nodes=2, memory_mb=4096),
    Profile("v1", "cgroup v1 (hybrid) under systemd; 1 socket x 2 cores x 2 threads",
            cgroup_v2=False, sockets=1, cores=2, threads=2, numa_nodes=1, memory_mb=3072),
    Profile("v2-containers", "cgroup v2 under systemd with containerd, docker and podman running; "
            "1 socket x 2 cores x 2 threads",
            cgroup_v2=True, sockets=1, cores=2, threads=2, numa_nodes=1, memory_mb=4096,
            kernel_args=("systemd.wants=docker.service",)),
    Profile("v2-k8s", "Debian 13 (trixie): cgroup v2 under systemd, containerd 1.7 with NRI and its CRI plugin "
            "driven by the tests in the kubelet's place; 1 socket x 2 cores x 2 threads",
            cgroup_v2=True, sockets=1, cores=2, threads=2, numa_nodes=1, memory_mb=3072,
            image="trixie-k8s", runs_unmarked_tests=False),
)}
