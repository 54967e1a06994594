"""Pin training jobs: a cpuset cgroup per job, one shared cpu cgroup with an RT budget, SCHED_RR threads.

Layout (cgroup v1 paths, relative to each controller's root):
  cpu:    <name>/training        cpu.rt_runtime_us = budget (the parent <name> gets at least as much)
  cpuset: <name>/train-<job>     cpuset.cpus = the job's cores
Children and new threads inherit both cgroups, so the job's cpuset cgroup is the list of its tasks;
the reconcile pass makes any task found there that is not SCHED_RR at the job's priority RR again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import psutil

from reamer.host.cgroups import CgroupDriver
from reamer.host.errors import HostError
from reamer.host.sched import ThreadGone, policy_of, rt_throttling, set_other, set_rr

log = logging.getLogger("reamer.training")

CPU = "cpu"
CPUSET = "cpuset"


class RtThrottlingDisabled(HostError):
    def __init__(self) -> None:
        super().__init__(
            "RT throttling is disabled (/proc/sys/kernel/sched_rt_runtime_us is -1): a runaway SCHED_RR "
            "training thread could starve the whole machine, so reamer will not make threads real-time",
            "turn throttling back on: sysctl -w kernel.sched_rt_runtime_us=950000")


@dataclass
class PinState:
    """What the pinner found (and fixed) for one job."""

    pids: list[int] = field(default_factory=list)
    threads: int = 0
    threads_rr: int = 0
    fixed: int = 0  # threads made SCHED_RR in this pass

    @property
    def alive(self) -> bool:
        return bool(self.pids)


def job_processes(pids: Iterable[int]) -> list[int]:
    """The given pids and all their descendants that exist now."""
    found: set[int] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found.add(pid)
            found.update(child.pid for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return sorted(found)


class TrainingPinner:
    def __init__(self, driver: CgroupDriver, name: str, rt_runtime_us: int, proc_root: str = "/proc") -> None:
        self.driver = driver
        self.name = name
        self.rt_runtime_us = rt_runtime_us
        self.proc_root = proc_root

    # --- paths ---

    @property
    def cpu_path(self) -> str:
        return f"{self.name}/training"

    def cpuset_path(self, job: str) -> str:
        return f"{self.name}/train-{job}"

    @property
    def uses_cpu_cgroup(self) -> bool:
        # cgroup v2 has no per-cgroup RT budget; RT tasks stay in their cpu cgroup there.
        return self.driver.version == 1 and self.driver.rt_group_sched

    def _controllers(self) -> tuple[str, ...]:
        return (CPUSET, CPU) if self.uses_cpu_cgroup else (CPUSET,)

    # --- lifecycle ---

    def rt_allowed(self) -> bool:
        return rt_throttling(self.proc_root)[0] != -1

    def check_rt_throttling(self) -> None:
        if not self.rt_allowed():
            raise RtThrottlingDisabled()

    def setup(self) -> None:
        """Create the shared cgroups and the RT budget; refuses when RT throttling is off."""
        self.check_rt_throttling()
        existed = self.driver.exists(self.name)
        self.driver.create(self.name, controllers=(CPUSET,) if not self.uses_cpu_cgroup else (CPU, CPUSET))
        if self.uses_cpu_cgroup:
            self.driver.create(self.cpu_path, controllers=(CPU,))
            if (self.driver.get_rt_runtime(self.cpu_path) or 0) != self.rt_runtime_us:
                try:
                    self.driver.set_rt_runtime(self.cpu_path, self.rt_runtime_us)
                except HostError as exc:
                    if not existed:  # leave no empty cgroups behind
                        try:
                            self.driver.remove(self.name, recursive=True)
                        except HostError:
                            pass
                    raise HostError(f"cannot give the training cgroup its real-time budget: {exc.message}",
                                    f"lower training.rt_runtime_us in the config (now {self.rt_runtime_us}); "
                                    f"or: {exc.fix}") from None

    def teardown(self) -> None:
        """Remove the shared cgroups (only when no job cgroup is left); used by tests and `reamer` uninstall."""
        if self.uses_cpu_cgroup and self.driver.exists(self.cpu_path):
            if self.driver.tasks(self.cpu_path, CPU):
                raise HostError(f"cpu cgroup {self.cpu_path} still holds tasks", "detach every training job first")
            self.driver.set_rt_runtime(self.name, 0)
        if self.driver.exists(self.name):
            self.driver.remove(self.name, recursive=True)

    # --- jobs ---

    def attach(self, job: str, pids: list[int], cpus: list[int], priority: int) -> tuple[dict[str, dict[str, str]], PinState]:
        """Move the job's processes into its cgroups, then make every thread SCHED_RR.

        Returns the original cgroups of each process (pid as str -> controller -> path) for detach."""
        self.check_rt_throttling()
        procs = job_processes(pids)
        if not procs:
            raise HostError(f"none of the processes {pids} of training job {job!r} exist",
                            "give the pids of running training processes (see `ps -ef`)")
        path = self.cpuset_path(job)
        self.driver.create(path, controllers=(CPUSET,))
        self.driver.set_cpus(path, cpus)
        original: dict[str, dict[str, str]] = {}
        for pid in procs:
            try:
                groups = self.driver.cgroup_of(pid)
                original[str(pid)] = {c: groups.get(c, "") for c in (CPU, CPUSET)}
                self._move_in(job, pid)
            except ThreadGone:
                continue
        return original, self.reconcile(job, cpus, priority)

    def _move_in(self, job: str, pid: int) -> None:
        self.driver.add_process(self.cpuset_path(job), pid, controllers=(CPUSET,))
        if self.uses_cpu_cgroup:
            self.driver.add_process(self.cpu_path, pid, controllers=(CPU,))

    def reconcile(self, job: str, cpus: list[int], priority: int, make_rr: bool = True) -> PinState:
        """Repair drift for one job: cpuset changed, processes outside the cpu cgroup, threads not RR."""
        path = self.cpuset_path(job)
        state = PinState()
        if not self.driver.exists(path):
            return state
        if sorted(self.driver.get_cpus(path)) != sorted(cpus):
            log.warning("cpuset of %s drifted; restoring %s", path, cpus)
            self.driver.set_cpus(path, cpus)
        state.pids = self.driver.processes(path, CPUSET)
        if self.uses_cpu_cgroup:
            in_cpu = set(self.driver.processes(self.cpu_path, CPU))
            for pid in state.pids:
                if pid not in in_cpu:
                    try:
                        self.driver.add_process(self.cpu_path, pid, controllers=(CPU,))
                    except ThreadGone:
                        pass
        for tid in self.driver.tasks(path, CPUSET):
            try:
                policy, prio = policy_of(tid)
                if make_rr and (policy != "rr" or prio != priority):
                    set_rr(tid, priority)
                    state.fixed += 1
                    policy = "rr"
                state.threads += 1
                state.threads_rr += policy == "rr"
            except ThreadGone:
                continue
        state.pids = self.driver.processes(path, CPUSET)
        return state

    def demote(self, job: str) -> int:
        """Make every thread of the job SCHED_OTHER; repeats until none is RT (threads may be born meanwhile)."""
        path = self.cpuset_path(job)
        demoted = 0
        for _ in range(5):
            if not self.driver.exists(path):
                return demoted
            left = 0
            for tid in self.driver.tasks(path, CPUSET):
                try:
                    if policy_of(tid)[0] in ("rr", "fifo"):
                        set_other(tid)
                        demoted += 1
                        left += 1
                except ThreadGone:
                    continue
            if not left:
                break
        return demoted

    def detach(self, job: str, original: dict[str, dict[str, str]]) -> int:
        """Demote first (never move an RT thread), then move processes back to where they came from."""
        demoted = self.demote(job)
        path = self.cpuset_path(job)
        if not self.driver.exists(path):
            return demoted
        for _ in range(5):
            procs = self.driver.processes(path, CPUSET)
            if not procs:
                break
            for pid in procs:
                home = original.get(str(pid)) or self._home_of_parent(pid, original)
                try:
                    self.driver.add_process(home.get(CPUSET, ""), pid, controllers=(CPUSET,))
                    if self.uses_cpu_cgroup:
                        self.driver.add_process(home.get(CPU, ""), pid, controllers=(CPU,))
                except ThreadGone:
                    continue
                except HostError as exc:  # the original cgroup is gone: the root always takes it
                    log.warning("cannot move %d back to %s (%s); moving it to the root cgroup", pid, home, exc)
                    self.driver.add_process("", pid, controllers=(CPUSET,))
                    if self.uses_cpu_cgroup:
                        self.driver.add_process("", pid, controllers=(CPU,))
        self.remove_job_cgroup(job)
        return demoted

    def _home_of_parent(self, pid: int, original: dict[str, dict[str, str]]) -> dict[str, str]:
        try:
            for parent in psutil.Process(pid).parents():
                if str(parent.pid) in original:
                    return original[str(parent.pid)]
        except psutil.Error:
            pass
        return {CPU: "", CPUSET: ""}

    def remove_job_cgroup(self, job: str) -> None:
        path = self.cpuset_path(job)
        if self.driver.exists(path):
            try:
                self.driver.remove(path)
            except HostError as exc:
                log.warning("could not remove %s: %s", path, exc)

    def job_cgroups(self) -> list[str]:
        """Job names that have a cpuset cgroup under <name> (also ones the store forgot)."""
        return [job for job in _children_named(self.driver, self.name, "train-")]

    def demote_all(self) -> int:
        """Demote every thread in every training cgroup of this pinner (the big red button)."""
        total = 0
        for job in self.job_cgroups():
            total += self.demote(job)
        if self.uses_cpu_cgroup and self.driver.exists(self.cpu_path):
            for tid in self.driver.tasks(self.cpu_path, CPU):
                try:
                    if policy_of(tid)[0] in ("rr", "fifo"):
                        set_other(tid)
                        total += 1
                except ThreadGone:
                    continue
        return total


def _children_named(driver: CgroupDriver, parent: str, prefix: str) -> list[str]:
    base = driver.root / CPUSET / parent if driver.version == 1 else driver.root / parent
    try:
        return sorted(entry.name[len(prefix):] for entry in base.iterdir()
                      if entry.is_dir() and entry.name.startswith(prefix))
    except FileNotFoundError:
        return []
