"""Give a freed pid to a new process on purpose, as an attacker racing pid reuse would (root only).

The kernel hands out pids in order from /proc/sys/kernel/ns_last_pid: writing pid-1 there and forking
gives the next process that pid, unless another process on the machine forks first (then it is tried
again)."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def can_reuse_pids() -> bool:
    try:
        with NS_LAST_PID.open("r+") as f:
            f.write(f.read().strip())
        return True
    except OSError:
        return False


def _exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def spawn_at_pid(pid: int, args: list[str], tries: int = 50, **popen: Any) -> subprocess.Popen | None:
    """A new process (subprocess.Popen(args, **popen)) whose pid is `pid`, once `pid` is free; None when
    other forks took it every time or it never became free."""
    for _ in range(tries):
        if _exists(pid):  # not reaped yet (a zombie holds its pid)
            import time

            time.sleep(0.02)
            continue
        NS_LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(args, **popen)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None
