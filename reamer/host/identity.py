"""Who is who on this host: a Unix socket peer's credentials, a process's owner, kernel threads, pid_max.

The agent's policy (reamer.agent.policy) decides from these facts; this module only reads them.
"""
from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from pathlib import Path

PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread
DEFAULT_PID_MAX = 4194304  # the kernel's upper bound on 64-bit (PID_MAX_LIMIT)


@dataclass(frozen=True)
class PeerCredentials:
    """The process at the other end of a Unix socket, as the kernel recorded it at connect()."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials | None:
    """SO_PEERCRED of a connected AF_UNIX socket; None for any other kind of socket."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


@dataclass(frozen=True)
class ProcessFacts:
    """What the policy needs to know about one process (None owner: it is gone)."""

    pid: int
    uid: int | None  # real uid; None when the process no longer exists
    kernel_thread: bool = False


def process_facts(pid: int, proc_root: str | Path = "/proc") -> ProcessFacts:
    """Owner (real uid, from /proc/PID/status) and whether PID is a kernel thread (PF_KTHREAD)."""
    base = Path(proc_root) / str(pid)
    try:
        status = (base / "status").read_text()
        stat = (base / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return ProcessFacts(pid, None)
    uid = None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
            break
    # The comm field may hold spaces and parentheses: the fields after the last ')' are fixed.
    fields = stat.rsplit(")", 1)[-1].split()
    flags = int(fields[6]) if len(fields) > 6 else 0  # field 9 of stat; index 6 after state
    ppid = int(fields[1]) if len(fields) > 1 else -1
    kernel = bool(flags & PF_KTHREAD) or pid == 2 or ppid == 2
    return ProcessFacts(pid, uid, kernel)


def pid_max(proc_root: str | Path = "/proc") -> int:
    """/proc/sys/kernel/pid_max (the largest pid this kernel hands out, plus one)."""
    try:
        return int((Path(proc_root) / "sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return DEFAULT_PID_MAX
