"""Scheduling policy, priority and CPU affinity of single threads (by tid), and RT throttling."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from reamer.host.cpulist import format_cpulist
from reamer.host.errors import HostError, PermissionProblem

RT_PRIORITY_MIN = 1
RT_PRIORITY_MAX = 99

_POLICY_NAMES = {
    os.SCHED_OTHER: "other",
    os.SCHED_RR: "rr",
    os.SCHED_FIFO: "fifo",
    os.SCHED_IDLE: "idle",
    os.SCHED_BATCH: "batch",
}


class ThreadGone(HostError):
    """The thread (or process) exited between listing it and acting on it."""

    def __init__(self, tid: int) -> None:
        super().__init__(f"thread {tid} no longer exists", "nothing to do: it exited; list the threads again")
        self.tid = tid


def threads_of(pid: int, proc_root: str | Path = "/proc") -> list[int]:
    """Thread ids of process `pid`, from <proc_root>/<pid>/task."""
    try:
        return sorted(int(entry.name) for entry in Path(proc_root, str(pid), "task").iterdir() if entry.name.isdigit())
    except FileNotFoundError:
        raise ThreadGone(pid) from None


def _cpu_cgroup_of(tid: int) -> str:
    try:
        for line in Path(f"/proc/{tid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                return path
    except (OSError, ValueError):
        pass
    return "?"


def _set_policy(tid: int, policy: int, priority: int) -> None:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(priority))
    except ProcessLookupError:
        raise ThreadGone(tid) from None
    except PermissionError:
        name = _POLICY_NAMES[policy]
        if os.geteuid() != 0:
            raise PermissionProblem(
                f"not allowed to set thread {tid} to SCHED_{name.upper()}: this process is not root",
                "run reamer as root (or give it CAP_SYS_NICE)",
            ) from None
        if policy not in (os.SCHED_RR, os.SCHED_FIFO):
            raise PermissionProblem(f"the kernel refused SCHED_{name.upper()} for thread {tid} (EPERM)",
                                    "check the thread's owner and reamer's capabilities (CAP_SYS_NICE)") from None
        cgroup = _cpu_cgroup_of(tid)
        raise PermissionProblem(
            f"the kernel refused SCHED_{name.upper()} for thread {tid} (EPERM): it sits in cpu cgroup {cgroup!r}, "
            "which has no real-time budget (cpu.rt_runtime_us is 0) under RT group scheduling",
            f"set cpu.rt_runtime_us of cpu cgroup {cgroup!r} (and of its parents) above 0 first, "
            "or move the thread to a cgroup that has one",
        ) from None


def set_rr(tid: int, priority: int) -> None:
    """Make `tid` SCHED_RR at `priority` (1..99)."""
    if not RT_PRIORITY_MIN <= priority <= RT_PRIORITY_MAX:
        raise HostError(
            f"real-time priority {priority} is out of range",
            f"use a priority from {RT_PRIORITY_MIN} to {RT_PRIORITY_MAX}",
        )
    _set_policy(tid, os.SCHED_RR, priority)


def set_other(tid: int) -> None:
    """Return `tid` to the normal time-sharing policy (SCHED_OTHER)."""
    _set_policy(tid, os.SCHED_OTHER, 0)


def set_idle_policy(tid: int) -> None:
    """Make `tid` SCHED_IDLE: it runs only when nothing else wants the CPU."""
    _set_policy(tid, os.SCHED_IDLE, 0)


def set_nice(tid: int, nice: int) -> None:
    """Set the nice value of one thread (Linux keeps it per thread). Raising it needs no privilege."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except ProcessLookupError:
        raise ThreadGone(tid) from None


def policy_of(tid: int) -> tuple[str, int]:
    """("other"|"rr"|"fifo"|"idle"|"batch", real-time priority) of `tid`."""
    try:
        policy = os.sched_getscheduler(tid)
        priority = os.sched_getparam(tid).sched_priority
    except ProcessLookupError:
        raise ThreadGone(tid) from None
    # SCHED_RESET_ON_FORK may be or-ed into the policy.
    policy &= ~getattr(os, "SCHED_RESET_ON_FORK", 0x40000000)
    return _POLICY_NAMES.get(policy, f"policy-{policy}"), priority


def set_affinity(tid: int, cpus: Iterable[int]) -> None:
    """Pin `tid` to `cpus`."""
    wanted = sorted(set(cpus))
    if not wanted:
        raise HostError(f"cannot pin thread {tid} to no CPUs", "give at least one CPU")
    try:
        os.sched_setaffinity(tid, wanted)
    except ProcessLookupError:
        raise ThreadGone(tid) from None
    except PermissionError:
        raise PermissionProblem(
            f"not allowed to change the CPU affinity of thread {tid}", "run reamer as root (or with CAP_SYS_NICE)"
        ) from None
    except OSError as error:
        raise HostError(
            f"cannot pin thread {tid} to CPUs {format_cpulist(wanted)}: {error.strerror}",
            "use CPUs that are online and inside the thread's cpuset (see /proc/<tid>/status Cpus_allowed_list)",
        ) from None


def affinity_of(tid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(tid))
    except ProcessLookupError:
        raise ThreadGone(tid) from None


def rt_throttling(proc_root: str | Path = "/proc") -> tuple[int, int]:
    """(sched_rt_runtime_us, sched_rt_period_us); runtime -1 means RT throttling is disabled."""
    base = Path(proc_root, "sys/kernel")
    try:
        runtime = int((base / "sched_rt_runtime_us").read_text())
        period = int((base / "sched_rt_period_us").read_text())
    except (OSError, ValueError) as error:
        raise HostError(
            f"cannot read RT throttling settings under {base}: {error}",
            "mount procfs at /proc (or pass the right proc_root)",
        ) from None
    return runtime, period


def pin_self(cpus: Iterable[int]) -> None:
    """Pin the calling process to `cpus`: for a child's preexec_fn (its first code after fork), before it
    sizes its thread pools for the CPUs it sees. Raises what os.sched_setaffinity raises."""
    os.sched_setaffinity(0, set(cpus))
