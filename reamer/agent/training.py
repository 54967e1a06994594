"""Pin training jobs where they live: the job's own cgroup narrowed to its cores, its threads SCHED_RR.

Where a job is pinned (its Placement):
  in-place  a container or a cgroup: the cpuset of its own cgroup is narrowed (through systemd's
            AllowedCPUs= where systemd owns that cgroup); no process changes cgroup.
  scope     processes given by pid on a systemd host with cgroup v2: a transient scope of their own,
            reamer.slice/reamer-train-<job>.scope, with AllowedCPUs= (the shell they came from stays as it was).
  own       processes given by pid elsewhere (cgroup v1 trees, no systemd): reamer's own cgroup
            <name>/train-<job> in the cpuset (and, for the RT budget, cpu) hierarchy.
Every change goes through one ChangeLog per job (reamer/host/changes.py), saved in the job's record before
it is made; detach, a failed attach and a restarted agent undo it from there.

Which processes (reamer.agent.policy decides, ProcessGate carries it out): the processes an attach checked
are recorded by identity (pid and start time); when they are pinned each is read again and refused if its
pid now belongs to another process; a process or thread found later (a new child, a new thread) is checked
before it is touched; in a job attached by a user other than root, a thread whose uids are not all that
user's (a setuid program) is never made SCHED_RR, and demoted if it is, on every pass.

The RT budget (cgroup v1 with RT group scheduling only): a job whose cpu cgroup is not the root needs
cpu.rt_runtime_us there for SCHED_RR. It is reserved when the job attaches, from one of two pools of the
config's rt_runtime_us (policy.RtPools: users' jobs share training.user_rt_percent of it, root's and admins'
jobs the rest, so a user's attach never shrinks theirs), and it is given back when the job detaches and when
the agent stops cleanly (its threads then run SCHED_OTHER until the agent is back).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import psutil

from reamer.agent.policy import (BudgetHolder, Caller, RtPools, check_rt_budget, check_same_process,
                                 process_refusal, rt_budgets)
from reamer.host import cgroups
from reamer.host.cgroups import CgroupDriver
from reamer.host.changes import ChangeLog
from reamer.host.container import container_cgroup
from reamer.host.cpulist import format_cpulist
from reamer.errors import ErrorKind
from reamer.host.errors import HostError
from reamer.host.executor import HostExecutor
from reamer.host.identity import ProcessFacts, has_exited, open_pidfd, process_facts
from reamer.host.probe import kernel_config_option
from reamer.host.sched import ThreadGone, rt_throttling
from reamer.host.systemd import SLICE, Systemd, systemd_booted, unit_of_cgroup

log = logging.getLogger("reamer.training")

CPU = "cpu"
CPUSET = "cpuset"
IN_PLACE, SCOPE, OWN = "in-place", "scope", "own"
EFFECTIVE_WAIT_S = 5.0
DEFAULT_USER_RT_PERCENT = 25  # training.user_rt_percent's default


class RtThrottlingDisabled(HostError):
    kind = ErrorKind.RT_THROTTLING_DISABLED

    def __init__(self) -> None:
        super().__init__(
            "RT throttling is disabled (/proc/sys/kernel/sched_rt_runtime_us is -1): a runaway SCHED_RR "
            "training thread could starve the whole machine, so reamer will not make threads real-time",
            "turn throttling back on: sysctl -w kernel.sched_rt_runtime_us=950000")


class RtGroupSchedOnV2(HostError):
    def __init__(self) -> None:
        super().__init__(
            "this kernel has RT group scheduling (CONFIG_RT_GROUP_SCHED=y) with cgroup v2: there is no "
            "cpu.rt_runtime_us to give a job's cgroup, so its threads cannot be SCHED_RR outside the root cpu "
            "cgroup, and reamer will not move them out of their cgroup",
            "boot a kernel built without CONFIG_RT_GROUP_SCHED (the distributions' default), or boot with "
            "systemd.unified_cgroup_hierarchy=0 (cgroup v1), where reamer gives each job an RT budget")


@dataclass
class Placement:
    mode: str  # IN_PLACE, SCOPE or OWN
    cpuset_path: str  # the cgroup (cpuset tree on v1) whose threads are the job's
    cpu_path: str = ""  # v1 with RT group scheduling: the cpu cgroup that needs the budget ("": none needed)
    unit: str | None = None  # the systemd unit that owns cpuset_path (v2)
    own_cpu: bool = False  # v1: cpu_path is reamer's own and the processes move there
    owner_uid: int = 0  # who attached the job: in its threads only this uid's are made SCHED_RR (root: all)
    privileged: bool = True  # attached by root or an admin: its RT budget comes from the privileged pool

    @property
    def owner(self) -> Caller:
        return Caller(uid=self.owner_uid, gid=-1, pid=0, admin=self.privileged)

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Placement":
        return cls(**doc)


@dataclass
class PinState:
    """What the pinner found (and fixed) for one job."""

    pids: list[int] = field(default_factory=list)
    threads: int = 0
    threads_rr: int = 0
    fixed: int = 0  # threads made SCHED_RR in this pass
    conflict: str = ""  # another manager changed the job's cpuset: what reamer found
    refused: list[str] = field(default_factory=list)  # threads first refused RT in this pass: why
    demoted: int = 0  # refused threads that were RT (inherited from the job) and were demoted in this pass

    @property
    def alive(self) -> bool:
        return bool(self.pids)


def job_processes(pids: Iterable[int]) -> list[int]:
    """The given pids and all their descendants that exist now."""
    return job_process_trees({"": list(pids)})[""]


def job_process_trees(roots: dict[str, list[int]]) -> dict[str, list[int]]:
    """For each key, its root pids that exist now and all their descendants, from one scan of the process
    table (psutil's children() scans it once per call: once per job per pass for the memory guard)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    trees = {}
    for key, pids in roots.items():
        found = {pid for pid in pids if psutil.pid_exists(pid)}
        todo = list(found)
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        trees[key] = sorted(found)
    return trees


def _common(paths: Iterable[str]) -> str:
    split = [p.strip("/").split("/") if p.strip("/") else [] for p in paths]
    if not split:
        return ""
    prefix = split[0]
    for parts in split[1:]:
        n = 0
        while n < min(len(prefix), len(parts)) and prefix[n] == parts[n]:
            n += 1
        prefix = prefix[:n]
    return "/".join(prefix)


class ProcessGate:
    """The processes of one attach, from the policy check to their pinning. What was checked is recorded by
    identity (pid and start time) and held by a pidfd (a live process keeps its pid: while its pidfd says it
    runs, the pid is still that process); `admit` reads every process again right before it is used.
    Close it (or use it as a context manager) when the attach is over."""

    def __init__(self, owner: Caller, checked: Iterable[ProcessFacts], agent_pid: int,
                 proc_root: str = "/proc") -> None:
        self.owner = owner
        self.checked = {f.pid: f for f in checked if not f.gone}
        self.agent_pid = agent_pid
        self.proc_root = proc_root
        self._pidfds: dict[int, int] = {}
        for facts in self.checked.values():
            if facts.identity is not None and proc_root == "/proc":
                try:
                    fd = open_pidfd(facts.identity)
                except OSError:  # no pidfds on this kernel: start times alone decide
                    break
                if fd is not None:
                    self._pidfds[facts.pid] = fd

    def close(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def __enter__(self) -> "ProcessGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def checking_now(cls, owner: Caller, pids: Iterable[int], proc_root: str = "/proc") -> "ProcessGate":
        """For a caller that checked nothing itself (tests, embedding): the processes as they are now."""
        gate = cls(owner, [], os.getpid(), proc_root)
        gate.admit([], job_processes(pids))
        return gate

    def _still_running(self, pid: int) -> bool | None:
        fd = self._pidfds.get(pid)
        return None if fd is None else not has_exited(fd)

    def admit(self, named: Iterable[int], found: Iterable[int]) -> list[int]:
        """The live processes among `named` (the request's) and `found` (their descendants, a cgroup's
        members), re-checked now: a named one must be the very process checked before; any other one
        (new, or a pid reused since) must pass the policy. Raises Forbidden, touching nothing."""
        named = set(named)
        admitted = []
        for pid in sorted(named | set(found)):
            now = process_facts(pid, self.proc_root)
            if now.gone or now.zombie:
                continue
            before = self.checked.get(pid)
            if pid in named and before is not None:
                check_same_process(before, now, self._still_running(pid))
            refusal = process_refusal(self.owner, now, self.agent_pid)
            if refusal is not None:
                raise refusal
            self.checked.setdefault(pid, now)
            admitted.append(pid)
        return admitted


class TrainingPinner:
    def __init__(self, driver: CgroupDriver | HostExecutor, name: str, rt_runtime_us: int, proc_root: str = "/proc",
                 systemd: Systemd | None = None, run_root: str = "/run",
                 user_rt_percent: int = DEFAULT_USER_RT_PERCENT) -> None:
        """`driver`: the host executor every change goes through, or a bare cgroup driver (one is made)."""
        given = driver if isinstance(driver, HostExecutor) else None
        if given is not None:
            driver, systemd = given.driver, systemd or given.systemd
        self.driver: CgroupDriver = driver
        self.name = name
        self.rt_runtime_us = rt_runtime_us  # the cap: all jobs' budgets together
        self.pools = RtPools(rt_runtime_us, user_rt_percent)
        self._refused: dict[str, set[tuple[int, int | None]]] = {}  # job -> threads refused RT (tid, start)
        self.proc_root = proc_root
        if systemd is None and driver.version == 2 and systemd_booted(run_root):
            systemd = Systemd()
        self.systemd = systemd  # only where systemd manages cgroup v2 (AllowedCPUs= needs v2)
        self.host = given or HostExecutor(driver, systemd, proc_root)
        self.host.systemd = systemd
        self.logs: dict[str, ChangeLog] = {}
        self.placements: dict[str, Placement] = {}
        self._rewrites: dict[str, int] = {}  # job -> times reamer put its cpuset back after a change

    # --- paths ---

    def own_path(self, job: str) -> str:
        return f"{self.name}/train-{job}"

    @staticmethod
    def scope_unit(job: str) -> str:
        return f"reamer-train-{job}.scope"

    @property
    def rt_budgets(self) -> bool:
        return self.driver.version == 1 and self.driver.rt_group_sched

    # --- checks ---

    def rt_allowed(self) -> bool:
        return rt_throttling(self.proc_root)[0] != -1

    def check_rt_throttling(self) -> None:
        if not self.rt_allowed():
            raise RtThrottlingDisabled()

    def check_rt_possible(self) -> None:
        self.check_rt_throttling()
        if self.driver.version == 2 and kernel_config_option("CONFIG_RT_GROUP_SCHED", self.proc_root):
            raise RtGroupSchedOnV2()

    def setup(self) -> None:
        """An idle agent holds nothing: no cgroups, no RT budget. Refuses when RT throttling is off."""
        self.check_rt_throttling()

    # --- where a job is pinned ---

    def place(self, job: str, source: str, pids: list[int], ref: str = "") -> Placement:
        procs = job_processes(pids)
        if not procs:
            raise HostError(f"none of the processes {pids} of training job {job!r} exist",
                            "give the pids of running training processes (see `ps -ef`)")
        homes = []
        for pid in procs:
            try:
                homes.append(self.driver.cgroup_of(pid))
            except ThreadGone:
                continue

        def lives_in(controller: str) -> str:
            paths = [h.get(controller, "") for h in homes]
            if source == "container":
                paths = [container_cgroup(p) or p for p in paths]
            if source == "cgroup" and self.driver.version == 2:
                return ref
            return _common(paths)

        in_place = source in ("container", "cgroup")
        if self.driver.version == 2:
            if in_place:
                path = lives_in("unified")
                if not path:
                    raise HostError(f"training job {job!r} lives in the root cgroup", "give its own cgroup or its pids")
                unit = unit_of_cgroup(path) if self.systemd is not None else None
                return Placement(IN_PLACE, path, unit=unit)
            if self.systemd is not None:
                return Placement(SCOPE, f"{SLICE}/{self.scope_unit(job)}", unit=self.scope_unit(job))
            return Placement(OWN, self.own_path(job))
        cpuset_home = lives_in(CPUSET) if in_place else ""
        placement = Placement(IN_PLACE if cpuset_home else OWN, cpuset_home or self.own_path(job))
        if self.rt_budgets:
            cpu_home = lives_in(CPU)
            if in_place and cpu_home:
                placement.cpu_path = cpu_home
            elif any(h.get(CPU, "") for h in homes):
                placement.cpu_path, placement.own_cpu = self.own_path(job), True
        return placement

    # --- jobs ---

    def new_log(self, job: str, save: Callable[[list[dict[str, Any]]], None],
                changes: list[dict[str, Any]] | None = None) -> ChangeLog:
        change_log = ChangeLog(self.host, save, changes=changes,
                               ancestor_original=lambda path, job=job: self._ancestor_original(path, job))
        self.logs[job] = change_log
        return change_log

    def _ancestor_original(self, path: str, asking: str) -> int | None:
        for job, change_log in self.logs.items():
            for change in change_log.changes:
                if change.kind == "rt-ancestor" and change.target == path and job != asking:
                    return int(change.before or 0)
        return None

    def budget_holders(self, exclude: str | None = None) -> list[BudgetHolder]:
        return [BudgetHolder(job, p.owner_uid, p.privileged) for job, p in self.placements.items()
                if job != exclude and self.needs_budget(job)]

    def budgets(self) -> dict[str, int]:
        """Every job's RT budget under the pool rule (jobs that need one)."""
        return rt_budgets(self.pools, self.budget_holders())

    def check_budget(self, job: str, placement: Placement) -> None:
        """Refuses (policy rule rt_pool) a job whose pool has nothing worth giving it; changes nothing."""
        if self.rt_budgets and placement.cpu_path:
            check_rt_budget(self.pools, BudgetHolder(job, placement.owner_uid, placement.privileged),
                            self.budget_holders(exclude=job))

    def needs_budget(self, job: str) -> bool:
        placement = self.placements.get(job)
        return bool(self.rt_budgets and placement is not None and placement.cpu_path)

    def attach(self, job: str, placement: Placement, pids: list[int], cpus: list[int], priority: int,
               change_log: ChangeLog, gate: ProcessGate | None = None) -> PinState:
        """Pin the job; on any failure every change made so far is undone and the error raised. `gate`
        holds the processes the caller checked (None: they are checked now, for the placement's owner)."""
        self.check_rt_possible()
        self.check_budget(job, placement)
        own_gate = gate is None
        if gate is None:
            gate = ProcessGate.checking_now(placement.owner, pids, self.proc_root)
        self.placements[job] = placement
        try:
            if self.needs_budget(job):
                self._share_budget(extra=job)
            try:
                self._pin(job, placement, pids, cpus, change_log, gate)
            finally:
                if own_gate:
                    gate.close()
            return self.reconcile(job, cpus, priority)
        except BaseException:
            self.demote(job)
            problems = change_log.undo()
            if problems:
                log.error("undo of the failed attach of %s left: %s", job, "; ".join(problems))
            self.placements.pop(job, None)
            self.logs.pop(job, None)
            if self.rt_budgets and self._budget_jobs():
                self._share_budget()  # the others shrank to make room: they get it back
            raise

    def _pin(self, job: str, placement: Placement, pids: list[int], cpus: list[int], change_log: ChangeLog,
             gate: ProcessGate) -> None:
        procs = gate.admit(pids, job_processes(pids))
        if not procs:
            raise HostError(f"none of the processes {pids} of training job {job!r} exist any more",
                            "give the pids of running training processes (see `ps -ef`)")
        if placement.mode == IN_PLACE:
            if placement.unit is not None:
                change_log.set_unit_cpus(placement.unit, placement.cpuset_path, cpus)
            else:
                if self.driver.version == 2:
                    change_log.enable_cpuset_controller(placement.cpuset_path)
                change_log.set_cpuset(placement.cpuset_path, cpus)
            effective = self._wait_effective(placement.cpuset_path, cpus)
            if sorted(effective) != sorted(cpus):
                raise HostError(
                    f"cgroup {placement.cpuset_path!r} runs on cpus {format_cpulist(effective)}, not the job's "
                    f"{format_cpulist(cpus)}: an ancestor's cpuset leaves out some of them",
                    "widen that ancestor's cpuset (or the container's --cpuset-cpus), or reserve those cpus for "
                    "something else in reamer's config")
        elif placement.mode == SCOPE:
            change_log.start_scope(placement.unit or self.scope_unit(job), placement.cpuset_path, procs, cpus,
                                   f"reamer training job {job}")
        else:
            change_log.make_cgroup(placement.cpuset_path, CPUSET)
            self.host.set_cpus(placement.cpuset_path, cpus)
            change_log.move(placement.cpuset_path, CPUSET, procs)
        if placement.own_cpu:
            change_log.make_cgroup(placement.cpu_path, CPU)
        if self.needs_budget(job):
            self._reserve(job, change_log, self.budgets()[job])
        if placement.own_cpu:
            change_log.move(placement.cpu_path, CPU, procs)

    def _wait_effective(self, path: str, cpus: list[int], timeout: float = EFFECTIVE_WAIT_S) -> list[int]:
        """The cgroup's effective cpus once they are the job's (systemd applies AllowedCPUs= from its event
        loop, after it answered), or what they are when `timeout` runs out."""
        deadline = time.monotonic() + timeout
        while True:
            effective = cgroups.read_cpuset_effective(self.driver, path)
            if sorted(effective) == sorted(cpus) or time.monotonic() > deadline:
                return effective
            time.sleep(0.05)

    # --- RT budget ---

    def _budget_jobs(self) -> int:
        return sum(1 for job in self.placements if self.needs_budget(job))

    def _reserve(self, job: str, change_log: ChangeLog, us: int) -> None:
        path = self.placements[job].cpu_path
        try:
            change_log.set_rt(path, us)
        except HostError as error:
            holders = cgroups.rt_holders(self.driver, path)
            named = ", ".join(f"{p} ({b} us)" for p, b in holders) or "none found"
            raise HostError(
                f"cannot give training job {job!r} (cpu cgroup {path!r}) a real-time budget of {us} us: "
                f"{error.message}. Cgroups holding the machine's RT budget: {named}",
                f"lower training.rt_runtime_us in the config (now {self.rt_runtime_us}), or free budget held by "
                "those cgroups (echo 0 > /sys/fs/cgroup/cpu/<cgroup>/cpu.rt_runtime_us once they run no RT threads)"
            ) from None

    def _share_budget(self, extra: str | None = None) -> None:
        """Resize every job's budget to its share of its pool (shrinking first, so the new shares fit). Only
        jobs of the pool that changed get a new share: the others' stays what it was."""
        shares = self.budgets()
        for job, change_log in self.logs.items():
            if job == extra or job not in shares:
                continue
            current = self.driver.get_rt_runtime(self.placements[job].cpu_path) or 0
            if current > shares[job]:
                change_log.set_rt(self.placements[job].cpu_path, shares[job])
        if extra is None:
            for job, change_log in self.logs.items():
                if job in shares:
                    current = self.driver.get_rt_runtime(self.placements[job].cpu_path) or 0
                    if current == shares[job]:
                        continue
                    try:
                        change_log.set_rt(self.placements[job].cpu_path, shares[job])
                    except HostError as error:  # someone took the budget meanwhile: keep the smaller share
                        log.warning("cannot grow the RT budget of %s to %d us: %s", job, shares[job], error.message)

    def release_budgets(self) -> int:
        """Agent stopping cleanly: every job's threads to SCHED_OTHER and its RT budget given back."""
        released = 0
        for job, change_log in self.logs.items():
            if not self.needs_budget(job):
                continue
            self.demote(job)
            released += 1
            change_log.set_rt(self.placements[job].cpu_path, 0)
        return released

    # --- reconcile ---

    def job_tasks(self, job: str) -> list[int]:
        placement = self.placements.get(job)
        if placement is None:
            return []
        return cgroups.subtree_tasks(self.driver, placement.cpuset_path)

    def job_pids(self, job: str) -> list[int]:
        placement = self.placements.get(job)
        if placement is None:
            return []
        return cgroups.subtree_processes(self.driver, placement.cpuset_path)

    def reconcile(self, job: str, cpus: list[int], priority: int, make_rr: bool = True) -> PinState:
        """Make every thread of the job SCHED_RR; report (not fight) another manager's cpuset.
        A job attached by a user other than root only promotes threads whose uids are all that user's, and
        demotes any other one (a setuid program the job ran inherits SCHED_RR)."""
        placement = self.placements.get(job)
        state = PinState()
        if placement is None or not self.driver.exists(placement.cpuset_path):
            return state
        state.conflict = self._check_cpuset(job, placement, cpus)
        if self.needs_budget(job) and make_rr and (self.driver.get_rt_runtime(placement.cpu_path) or 0) == 0:
            self._reserve(job, self.logs[job], self.budgets()[job])  # after a clean stop
        owner = placement.owner
        if placement.own_cpu:
            in_cpu = set(self.driver.processes(placement.cpu_path, CPU))
            for pid in self.driver.processes(placement.cpuset_path, CPUSET):
                if pid not in in_cpu:
                    if not owner.is_root and process_refusal(owner, process_facts(pid, self.proc_root),
                                                             os.getpid()) is not None:
                        continue  # not the owner's to give the job's RT budget (its threads are refused below)
                    try:
                        self.host.add_process(placement.cpu_path, pid, controllers=(CPU,))
                    except ThreadGone:
                        pass
        refused = self._refused.setdefault(job, set())
        for tid in self.job_tasks(job):
            try:
                policy, prio = self.host.policy_of(tid)
                facts = None
                if not owner.is_root:  # every pass: a thread may have run a setuid program since the last one
                    facts = process_facts(tid, self.proc_root)
                    if facts.gone:
                        continue
                    if self._refuse_rt(tid, facts, policy, owner, refused, state):
                        state.threads += 1  # in the job, never RT: "rr threads" shows it as n-1/n
                        continue
                if make_rr and (policy != "rr" or prio != priority):
                    if self._set_rr_checked(tid, priority, facts, owner):
                        state.fixed += 1
                        policy = "rr"
                    else:
                        policy = self.host.policy_of(tid)[0]
                state.threads += 1
                state.threads_rr += policy == "rr"
            except ThreadGone:
                continue
        state.pids = self.job_pids(job)
        return state

    def _refuse_rt(self, tid: int, facts: ProcessFacts, policy: str, owner: Caller,
                   refused: set[tuple[int, int | None]], state: PinState) -> bool:
        """True (and the thread demoted when RT) when the policy refuses `owner` this thread."""
        refusal = process_refusal(owner, facts, os.getpid())
        if refusal is None:
            return False
        if policy in ("rr", "fifo"):
            self.host.set_other(tid)
            state.demoted += 1
        if (tid, facts.start_time) not in refused:
            refused.add((tid, facts.start_time))
            state.refused.append(f"thread {tid} not made SCHED_RR: {refusal.message}")
        return True

    def _set_rr_checked(self, tid: int, priority: int, facts: ProcessFacts | None, owner: Caller) -> bool:
        """SCHED_RR for `tid` if it is still the thread that was checked, and still passes the policy after
        the change (else it is demoted again: it changed in between). False when it did not stay RR."""
        before = facts if facts is not None else process_facts(tid, self.proc_root)
        if before.gone:
            raise ThreadGone(tid)
        self.host.set_rr(tid, priority)
        after = process_facts(tid, self.proc_root)
        if after.start_time == before.start_time and (owner.is_root or
                                                      process_refusal(owner, after, os.getpid()) is None):
            return True
        try:  # its tid was reused, or it ran a setuid program, between the check and the change
            self.host.set_other(tid)
        except ThreadGone:
            pass
        return False

    def _check_cpuset(self, job: str, placement: Placement, cpus: list[int]) -> str:
        found = cgroups.parse_cpulist(cgroups.read_cpuset_raw(self.driver, placement.cpuset_path))
        if sorted(found) == sorted(cpus):
            return ""
        if placement.mode == OWN and self._rewrites.get(job, 0) == 0:
            # reamer's own cgroup: put it back once; a second change means someone manages it too
            self._rewrites[job] = 1
            log.warning("cpuset of %s changed to %s; restoring %s", placement.cpuset_path, found, cpus)
            self.host.set_cpus(placement.cpuset_path, cpus)
            return ""
        return (f"cpuset of {placement.cpuset_path!r} is {format_cpulist(found) or '(all)'}, not the job's "
                f"{format_cpulist(cpus)}: another manager (kubelet's CPU manager, a runtime update, "
                f"systemctl set-property) changed it; reamer leaves it alone")

    # --- demote, detach ---

    def demote(self, job: str) -> int:
        """Make every thread of the job SCHED_OTHER; repeats until none is RT (threads may be born meanwhile)."""
        demoted = 0
        for _ in range(5):
            left = 0
            for tid in self.job_tasks(job):
                try:
                    if self.host.policy_of(tid)[0] in ("rr", "fifo"):
                        self.host.set_other(tid)
                        demoted += 1
                        left += 1
                except ThreadGone:
                    continue
            if not left:
                break
        return demoted

    def detach(self, job: str) -> int:
        """Demote first (never move an RT thread or drop its budget), then undo every change of the job."""
        demoted = self.demote(job)
        change_log = self.logs.pop(job, None)
        if change_log is not None:
            problems = change_log.undo()
            if problems:
                log.warning("detach of %s: %s", job, "; ".join(problems))
        self.placements.pop(job, None)
        self._rewrites.pop(job, None)
        self._refused.pop(job, None)
        if self.rt_budgets and self._budget_jobs():
            self._share_budget()
        return demoted

    def forget(self, job: str) -> None:
        """The job's processes all exited: undo what is left (cpusets, budgets, reamer's own cgroups)."""
        self.detach(job)

    def job_cgroups(self) -> list[str]:
        """Job names that have one of reamer's own cgroups (also ones the store forgot)."""
        base = self.driver.root / CPUSET / self.name if self.driver.version == 1 else self.driver.root / self.name
        try:
            own = {e.name[len("train-"):] for e in base.iterdir() if e.is_dir() and e.name.startswith("train-")}
        except FileNotFoundError:
            own = set()
        return sorted(own | set(self.placements))

    def demote_all(self) -> int:
        """Demote every thread of every job this pinner knows, and of any cgroup of its own."""
        total = 0
        for job in self.job_cgroups():
            if job not in self.placements:
                self.placements[job] = Placement(OWN, self.own_path(job))
                total += self.demote(job)
                del self.placements[job]
            else:
                total += self.demote(job)
        return total

