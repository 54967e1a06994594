"""Who is who on this host: a Unix socket peer's credentials, a process's owners and identity (pid and start
time, pidfd), kernel threads, pid_max.

The agent's policy (reamer.agent.policy) decides from these facts; this module only reads them.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import socket
import struct
import time
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
class ProcessIdentity:
    """One process (or thread) for its whole life: a pid is reused once its process has exited and been
    reaped, a (pid, start time) pair never is."""

    pid: int
    start_time: int  # field 22 of /proc/PID/stat: clock ticks after boot (a pid freed and taken again within
    # one tick, 10 ms, keeps it: where that matters, a pidfd held from the check on tells them apart)

    def __str__(self) -> str:
        return f"{self.pid} (started at tick {self.start_time})"


@dataclass(frozen=True)
class ProcessFacts:
    """What the policy needs to know about one process or thread (None owner: it is gone).

    The four uids are those of /proc/PID/status "Uid:" (real, effective, saved, filesystem): a setuid
    program keeps its caller's real uid and runs with another effective and saved uid."""

    pid: int
    uid: int | None  # real uid; None when the process no longer exists
    kernel_thread: bool = False
    euid: int | None = None
    suid: int | None = None
    fsuid: int | None = None
    start_time: int | None = None
    tgid: int | None = None  # the process a thread belongs to (== pid for a process)
    state: str | None = None  # field 3 of stat: R, S, D, Z (zombie: exited, not reaped), ...

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")

    @property
    def gone(self) -> bool:
        return self.uid is None

    @property
    def identity(self) -> ProcessIdentity | None:
        return None if self.start_time is None else ProcessIdentity(self.pid, self.start_time)

    @property
    def uids(self) -> tuple[int, ...]:
        """The uids it has (real, effective, saved, filesystem), those known."""
        return tuple(u for u in (self.uid, self.euid, self.suid, self.fsuid) if u is not None)


def _read_at(directory: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=directory)
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


def _stat_fields(stat: str) -> list[str]:
    # The comm field may hold spaces and parentheses: the fields after the last ')' are fixed.
    return stat.rsplit(")", 1)[-1].split()


def process_facts(pid: int, proc_root: str | Path = "/proc") -> ProcessFacts:
    """Owner (the four uids of /proc/PID/status), start time, and whether PID is a kernel thread
    (PF_KTHREAD). PID may be a thread id. Both files are read through one open /proc/PID directory, so
    they describe the same process even if PID is reused meanwhile (the kernel then answers ESRCH)."""
    try:
        directory = os.open(Path(proc_root) / str(pid), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
        return ProcessFacts(pid, None)
    try:
        status = _read_at(directory, "status")
        stat = _read_at(directory, "stat")
    except (FileNotFoundError, ProcessLookupError):
        return ProcessFacts(pid, None)
    finally:
        os.close(directory)
    uids: list[int | None] = [None, None, None, None]
    tgid = None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            found = [int(v) for v in line.split()[1:5]]
            uids[:len(found)] = found
        elif line.startswith("Tgid:"):
            tgid = int(line.split()[1])
    fields = _stat_fields(stat)
    flags = int(fields[6]) if len(fields) > 6 else 0  # field 9 of stat; index 6 after state
    ppid = int(fields[1]) if len(fields) > 1 else -1
    start = int(fields[19]) if len(fields) > 19 else None  # field 22 of stat
    kernel = bool(flags & PF_KTHREAD) or pid == 2 or ppid == 2
    return ProcessFacts(pid, uids[0], kernel, euid=uids[1], suid=uids[2], fsuid=uids[3], start_time=start,
                        tgid=tgid, state=fields[0] if fields else None)


def start_time(pid: int, proc_root: str | Path = "/proc") -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), None when PID does not exist."""
    try:
        fields = _stat_fields((Path(proc_root) / str(pid) / "stat").read_text())
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    return int(fields[19]) if len(fields) > 19 else None


def is_running(identity: ProcessIdentity, proc_root: str | Path = "/proc") -> bool:
    """True while that very process exists (a zombie, exited but not reaped, still does)."""
    return start_time(identity.pid, proc_root) == identity.start_time


def identity_of(pid: int, proc_root: str | Path = "/proc") -> ProcessIdentity | None:
    """PID's identity now, None when it does not exist."""
    start = start_time(pid, proc_root)
    return None if start is None else ProcessIdentity(pid, start)


def open_pidfd(identity: ProcessIdentity) -> int | None:
    """A pidfd of that very process, or None when it is gone (its pid free or someone else's now).

    The pidfd is opened first and the start time checked after: if they agree, the pidfd refers to the
    process that was checked, and stays so even if the pid is reused later."""
    try:
        fd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return None
    if start_time(identity.pid) != identity.start_time:
        os.close(fd)
        return None
    return fd


def has_exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd turns readable then, zombie or reaped). While it
    has not, its pid is still its own: no other process can have it."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def send_signal(identity: ProcessIdentity, sig: int) -> bool:
    """Signal that very process through a pidfd (never a later process that reuses its pid). False when it is
    gone. Kernels without pidfds (before 5.3): the start time is checked right before kill()."""
    try:
        fd = open_pidfd(identity)
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL):
            raise
        if not is_running(identity):
            return False
        try:
            os.kill(identity.pid, sig)
            return True
        except ProcessLookupError:
            return False
    if fd is None:
        return False
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def pid_max(proc_root: str | Path = "/proc") -> int:
    """/proc/sys/kernel/pid_max (the largest pid this kernel hands out, plus one)."""
    try:
        return int((Path(proc_root) / "sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return DEFAULT_PID_MAX


def boot_id(proc_root: str | Path = "/proc") -> str:
    """/proc/sys/kernel/random/boot_id: the same string until the host reboots ("" when unreadable)."""
    try:
        return (Path(proc_root) / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def boot_clock() -> float:
    """Seconds since boot (CLOCK_BOOTTIME: it counts suspended time too), the clock of start_seconds."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def start_seconds(pid: int, proc_root: str | Path = "/proc") -> float | None:
    """When PID started, in seconds since boot (start_time over the clock tick), None when it does not exist."""
    ticks = start_time(pid, proc_root)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def pid_exists(pid: int) -> bool:
    """Some process has `pid` now (another user's too: kill(pid, 0) refused is still a process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
