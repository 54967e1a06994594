"""The core table (Cloud Reamer §III-A): which CPUs each training job holds.

Training jobs get whole physical cores (all SMT siblings), packed into one L3 group, else one NUMA
node, where possible; reserved housekeeping CPUs are never handed out, and a physical core with a
reserved sibling is never handed out either (training would share it with the OS).
"""
from __future__ import annotations

from typing import Iterable

from reamer.errors import ErrorKind
from reamer.host.errors import ReamerError
from reamer.host.topology import Topology


class AllocationError(ReamerError):
    """A training job's CPUs cannot be allocated or restored as asked."""

    kind = ErrorKind.INSUFFICIENT_CORES


class CoreTable:
    def __init__(self, topology: Topology, reserved: Iterable[int] = ()) -> None:
        self._topology = topology
        self._cpu_info = {cpu.id: cpu for cpu in topology.cpus}
        self._reserved = frozenset(reserved)
        unknown = sorted(self._reserved - self._cpu_info.keys())
        if unknown:
            raise AllocationError(
                f"reserved CPUs {unknown} are not online CPUs of this machine (online: {sorted(self._cpu_info)})",
                "reserve only CPUs listed by `reamer topology`",
            )
        self._cores = topology.physical_cores()
        self._jobs: dict[str, tuple[int, ...]] = {}

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def reserved(self) -> frozenset[int]:
        return self._reserved

    # -- queries -----------------------------------------------------------------------------
    def cpus_of(self, job: str) -> tuple[int, ...]:
        """The CPUs `job` holds; () when it holds none."""
        return self._jobs.get(job, ())

    def jobs(self) -> dict[str, tuple[int, ...]]:
        return dict(self._jobs)

    def training_cpus(self) -> set[int]:
        return {cpu for cpus in self._jobs.values() for cpu in cpus}

    def idle_cpus(self) -> list[int]:
        """CPUs neither reserved nor held by training, in topology (allocation) order."""
        busy = self.training_cpus() | self._reserved
        return [cpu for core in self._cores for cpu in core if cpu not in busy]

    def free_cores(self) -> list[tuple[int, ...]]:
        """Physical cores a training job could still get: no sibling reserved or held."""
        busy = self.training_cpus() | self._reserved
        return [core for core in self._cores if not busy.intersection(core)]

    def free_core_count(self) -> int:
        return len(self.free_cores())

    # -- changes -----------------------------------------------------------------------------
    def allocate(self, job: str, n_cores: int, within: Iterable[int] | None = None) -> tuple[int, ...]:
        """Give `job` `n_cores` whole physical cores; all-or-nothing (a refusal changes nothing). `within`: only
        cores all of whose cpus are in it (a cluster scheduler's allocation)."""
        if job in self._jobs:
            raise AllocationError(
                f"training job {job!r} already holds CPUs {list(self._jobs[job])}",
                f"release {job!r} first, or use another name",
            )
        if not isinstance(n_cores, int) or isinstance(n_cores, bool) or n_cores < 1:
            raise AllocationError(
                f"training job {job!r} asks for {n_cores!r} cores", "ask for a whole number of cores ≥ 1"
            )
        free = self.free_cores()
        if within is not None:
            allowed = set(within)
            inside = [core for core in free if allowed.issuperset(core)]
            if n_cores > len(inside):
                raise AllocationError(
                    f"training job {job!r} asks for {n_cores} cores inside its allocation (cpus "
                    f"{sorted(allowed)}), but only {len(inside)} whole free cores of it are not reserved or held",
                    f"ask for at most {len(inside)} cores, or give the job a larger allocation",
                )
            free = inside
        if n_cores > len(free):
            held = sum(1 for core in self._cores if self.training_cpus().intersection(core))
            reserved = sum(1 for core in self._cores if self._reserved.intersection(core))
            raise AllocationError(
                f"training job {job!r} asks for {n_cores} cores but only {len(free)} physical cores are free "
                f"({len(self._cores)} in all, {held} held by training jobs, {reserved} reserved for housekeeping)",
                f"ask for at most {len(free)} cores, or detach a training job to free cores",
            )
        chosen = self._pick(free, n_cores)
        cpus = tuple(sorted(cpu for core in chosen for cpu in core))
        self._jobs[job] = cpus
        return cpus

    def restore(self, job: str, cpus: Iterable[int]) -> tuple[int, ...]:
        """Re-adopt the CPUs `job` already runs on (after an agent restart); validates, then records."""
        wanted = tuple(sorted(set(cpus)))
        if not wanted:
            raise AllocationError(f"cannot restore training job {job!r} with no CPUs", "give the CPUs it runs on")
        unknown = [cpu for cpu in wanted if cpu not in self._cpu_info]
        if unknown:
            raise AllocationError(
                f"training job {job!r} lists CPUs {unknown} that are not online",
                "re-attach the job so that it gets a fresh allocation",
            )
        reserved = sorted(self._reserved.intersection(wanted))
        if reserved:
            raise AllocationError(
                f"training job {job!r} would hold reserved housekeeping CPUs {reserved}",
                "re-attach the job so that it gets a fresh allocation, or change the reserved CPUs",
            )
        for other, held in self._jobs.items():
            overlap = sorted(set(held).intersection(wanted))
            if other != job and overlap:
                raise AllocationError(
                    f"training job {job!r} would share CPUs {overlap} with training job {other!r}",
                    f"detach one of {job!r} and {other!r}, then re-attach it",
                )
        self._jobs[job] = wanted
        return wanted

    def release(self, job: str) -> tuple[int, ...]:
        """Free `job`'s CPUs at once; returns them (() if it held none)."""
        return self._jobs.pop(job, ())

    # -- choice ------------------------------------------------------------------------------
    def _pick(self, free: list[tuple[int, ...]], n_cores: int) -> list[tuple[int, ...]]:
        """Best fit: the fullest L3 group that still fits, else NUMA node, else spill over nodes."""
        for key in (self._l3_key, self._numa_key):
            groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
            for core in free:
                groups.setdefault(key(core), []).append(core)
            fitting = [members for members in groups.values() if len(members) >= n_cores]
            if fitting:
                # fewest free cores first keeps big groups whole for later jobs; ties: topology order
                return min(fitting, key=len)[:n_cores]
        # Spans nodes: take from the nodes with most free cores first, so that few nodes are used.
        by_node: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for core in free:
            by_node.setdefault(self._numa_key(core), []).append(core)
        chosen: list[tuple[int, ...]] = []
        for members in sorted(by_node.values(), key=len, reverse=True):
            chosen.extend(members[: n_cores - len(chosen)])
            if len(chosen) == n_cores:
                break
        return chosen

    def _l3_key(self, core: tuple[int, ...]) -> tuple[int, ...]:
        cpu = self._cpu_info[core[0]]
        return (cpu.numa_node, cpu.package_id, cpu.l3_id)

    def _numa_key(self, core: tuple[int, ...]) -> tuple[int, ...]:
        return (self._cpu_info[core[0]].numa_node,)
