"""Empty a memory cgroup by killing what is in it: what is left of an inference job once it was removed.

cgroup v2 has `cgroup.kill` (Linux 5.14+), which kills every process of the cgroup at once. Elsewhere each
listed process is signalled through a pidfd, after checking that the process the pidfd names is still in
the cgroup: a pid that ended and was reused by someone else's process is never signalled.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from reamer.host.cgroups import CgroupDriver
from reamer.host.errors import HostError
from reamer.host.sched import ThreadGone

MEMORY = "memory"


def kill_members(driver: CgroupDriver, path: str) -> int:
    """SIGKILL every process in the memory cgroup `path`; how many were signalled."""
    directory = _directory(driver, path)
    if directory is None:
        return 0
    try:
        pids = driver.processes(path, MEMORY)
    except (HostError, OSError):
        return 0
    if not pids:
        return 0
    kill_file = directory / "cgroup.kill"
    if driver.version == 2 and kill_file.exists():
        try:
            kill_file.write_text("1")
            return len(pids)
        except OSError:
            pass  # an older kernel's file, or not allowed: one by one below
    wanted = path.strip("/")
    signalled = 0
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            continue
        try:
            where = driver.cgroup_of(pid)
            if wanted not in (where.get(MEMORY, "").strip("/"), where.get("unified", "").strip("/")):
                continue  # not the process that was listed: it ended and the pid was used again
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            signalled += 1
        except (ThreadGone, ProcessLookupError, HostError, OSError):
            continue
        finally:
            os.close(pidfd)
    return signalled


def empty_cgroup(driver: CgroupDriver, path: str, timeout: float) -> bool:
    """Kill the memory cgroup's processes until none is left or `timeout` passed (at least one round of
    kills); True when it is empty (or gone)."""
    deadline = time.monotonic() + timeout
    while True:
        if _directory(driver, path) is None:
            return True
        try:
            if not driver.processes(path, MEMORY):
                return True
        except (HostError, OSError):
            return True  # removed meanwhile
        kill_members(driver, path)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _directory(driver: CgroupDriver, path: str) -> Path | None:
    try:
        directory = driver.memory_dir(path)
    except HostError:
        return None
    if not directory.is_dir():
        return None
    return directory
