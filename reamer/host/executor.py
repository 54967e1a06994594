"""The one executor of every change reamer makes to the host.

Every write to a cgroup (of any controller), every scheduling change (policy, priority, nice, affinity),
every OOM score and every systemd unit change goes through a `HostExecutor`; nothing outside reamer/host/
writes to /sys or /proc or calls the scheduler. Changes that must be undone (a job's cpuset, its RT
budget, a scope it was given) are made through a `ChangeLog` (reamer/host/changes.py), which journals each
one before it asks the executor to make it.

cpuset writes are levelled, as koordinator's resourceexecutor does: a parent is widened before its
children, and children are narrowed before their parent, so the kernel's rule (a child's cpus lie inside
its parent's) holds after every single write.

`reamer.host.fake.FakeHost` is the same interface over a temporary cgroup tree, with the scheduler, the OOM
scores and systemd recorded instead of called: the agent's decisions are tested with it without root.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from reamer.host import cgroup_kill, cgroups, oom, sched
from reamer.host.cgroups import CgroupDriver
from reamer.host.cpulist import format_cpulist, parse_cpulist
from reamer.host.errors import HostError
from reamer.host.systemd import Systemd, UnitState


@dataclass(frozen=True)
class CpusetWrite:
    """One cpuset.cpus to write: `path` relative to the hierarchy root, `text` the file's new content."""

    path: str
    text: str

    @property
    def depth(self) -> int:
        return len([part for part in self.path.strip("/").split("/") if part])


def levelled_order(writes: Sequence[CpusetWrite], current: dict[str, str]) -> list[CpusetWrite]:
    """The writes to make, in an order the kernel accepts at every step: first, top-down, every cgroup that
    grows gets the union of what it has and what it will have; then, bottom-up, every cgroup gets its final
    value (children narrowed before their parents). Writes that change nothing are left out."""
    grow = []
    for write in sorted(writes, key=lambda w: w.depth):
        old, new = set(parse_cpulist(current.get(write.path, ""))), set(parse_cpulist(write.text))
        if new - old and old:  # an empty file (v2: "the parent's") needs no widening step
            grow.append(CpusetWrite(write.path, format_cpulist(sorted(old | new))))
    final = [w for w in sorted(writes, key=lambda w: -w.depth) if current.get(w.path, "").strip() != w.text.strip()
             or any(g.path == w.path for g in grow)]
    return grow + final


class HostExecutor:
    """The host as reamer changes it: one cgroup driver, systemd where it owns cgroups, the scheduler."""

    def __init__(self, driver: CgroupDriver, systemd: Systemd | None = None, proc_root: str = "/proc") -> None:
        self.driver = driver
        self.systemd = systemd
        self.proc_root = proc_root

    @property
    def version(self) -> int:
        return self.driver.version

    # --- cgroups ------------------------------------------------------------------------------------

    def create_cgroup(self, path: str, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        self.driver.create(path, controllers=controllers)

    def remove_cgroup(self, path: str, *, recursive: bool = False) -> None:
        self.driver.remove(path, recursive=recursive)

    def remove_controller_cgroup(self, controller: str, path: str) -> None:
        """v1: rmdir `path` in one controller's tree only (the other trees keep theirs)."""
        directory = self.driver.root / controller / path if self.driver.version == 1 else self.driver.root / path
        if directory.is_dir():
            self.driver.remove_dir(directory)

    def add_process(self, path: str, pid: int, controllers: Sequence[str] = cgroups.DEFAULT_CONTROLLERS) -> None:
        self.driver.add_process(path, pid, controllers=controllers)

    def set_cpus(self, path: str, cpus: Iterable[int]) -> None:
        """cpuset.cpus of one cgroup (v1: cpuset.mems copied from the parent when empty)."""
        self.driver.set_cpus(path, cpus)

    def write_cpuset(self, path: str, text: str) -> None:
        """cpuset.cpus exactly `text` ("" on v2: back to the parent's cpus)."""
        cgroups.write_cpuset_raw(self.driver, path, text)

    def write_cpusets(self, writes: Sequence[CpusetWrite]) -> None:
        """Several cgroups' cpuset.cpus at once, levelled (parents widened first, children narrowed first)."""
        current = {w.path: cgroups.read_cpuset_raw(self.driver, w.path) for w in writes}
        for write in levelled_order(writes, current):
            self.write_cpuset(write.path, write.text)

    def enable_controller(self, parent: str, controller: str, on: bool) -> None:
        """v2: +controller / -controller in `parent`'s cgroup.subtree_control."""
        cgroups.enable_controller(self.driver, parent, controller, on)  # type: ignore[arg-type]

    def set_rt_runtime(self, path: str, us: int) -> None:
        """Exactly cpu.rt_runtime_us = us on one cgroup (the ChangeLog orders ancestors and children)."""
        cgroups.write_rt_runtime(self.driver, path, us)  # type: ignore[arg-type]

    def set_memory_limit(self, path: str, limit_bytes: int | None) -> None:
        self.driver.set_memory_limit(path, limit_bytes)

    def set_idle(self, path: str, idle: bool) -> None:
        self.driver.set_idle(path, idle)

    def freeze(self, path: str) -> None:
        self.driver.freeze(path)

    def thaw(self, path: str) -> None:
        self.driver.thaw(path)

    def empty_cgroup(self, path: str, timeout: float) -> bool:
        """Kill what is in a memory cgroup until it is empty or `timeout` passed; True once empty."""
        return cgroup_kill.empty_cgroup(self.driver, path, timeout)

    def remove_named_everywhere(self, name: str) -> list[str]:
        """rmdir the top-level cgroup `name` and everything below it in every mounted hierarchy (v1: one per
        controller; v2 and hybrid: the unified one); returns the problems (it goes on past each)."""
        problems = []
        for top in cgroups.cgroup_dirs_named(self.driver.root, name):
            for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                try:
                    self.driver.remove_dir(directory)
                except HostError as error:
                    problems.append(error.message)
        return problems

    # --- scheduling -----------------------------------------------------------------------------------

    def policy_of(self, tid: int) -> tuple[str, int]:
        return sched.policy_of(tid)

    def threads_of(self, pid: int) -> list[int]:
        return sched.threads_of(pid, self.proc_root)

    def set_rr(self, tid: int, priority: int) -> None:
        sched.set_rr(tid, priority)

    def set_other(self, tid: int) -> None:
        sched.set_other(tid)

    def set_idle_policy(self, tid: int) -> None:
        sched.set_idle_policy(tid)

    def set_nice(self, tid: int, nice: int) -> None:
        sched.set_nice(tid, nice)

    def set_affinity(self, tid: int, cpus: Iterable[int]) -> None:
        sched.set_affinity(tid, cpus)

    def rt_throttling(self) -> tuple[int, int]:
        return sched.rt_throttling(self.proc_root)

    # --- OOM scores -----------------------------------------------------------------------------------

    def oom_score_adj(self, pid: int) -> int:
        return oom.oom_score_adj(pid, self.proc_root)

    def set_oom_score_adj(self, pid: int, value: int) -> None:
        oom.set_oom_score_adj(pid, value, self.proc_root)

    # --- systemd units --------------------------------------------------------------------------------

    def need_systemd(self) -> Systemd:
        if self.systemd is None:
            raise HostError("this change needs systemd, and reamer found none", "run on a host managed by systemd")
        return self.systemd

    def unit_state(self, unit: str) -> UnitState | None:
        return self.need_systemd().unit_state(unit)

    def set_unit_cpus(self, unit: str, cpus: Iterable[int]) -> None:
        """AllowedCPUs= of a unit at runtime ([] = no restriction)."""
        self.need_systemd().set_allowed_cpus(unit, cpus)

    def start_scope(self, unit: str, pids: list[int], cpus: Iterable[int], description: str) -> None:
        self.need_systemd().start_scope(unit, pids, cpus, description)

    def attach_to_unit(self, unit: str, pids: list[int], subcgroup: str = "") -> None:
        self.need_systemd().attach_processes(unit, pids, subcgroup)


def executor_for(host: Any, systemd: Systemd | None = None, proc_root: str = "/proc") -> HostExecutor:
    """`host` itself when it is an executor, else an executor over the cgroup driver `host`."""
    if isinstance(host, HostExecutor):
        return host
    if not isinstance(host, CgroupDriver):
        raise TypeError(f"expected a HostExecutor or a CgroupDriver, got {type(host).__name__}")
    return HostExecutor(host, systemd, proc_root)
