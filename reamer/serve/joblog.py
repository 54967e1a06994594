"""Keep a job's log (job.log: its stderr and its workers', a file the agent opened for append) bounded.

The job, its instance workers and native libraries all write to the same open file (fd 2, O_APPEND),
so the file cannot be renamed away from under them; it is copied to `job.log.1` and truncated in place
(logrotate's copytruncate). Every writer appends at the new end. Lines written between the copy and the
truncation are lost, which is the price of not coordinating with native writers.
"""
from __future__ import annotations

import os
import stat


def bound_log(fd: int, max_bytes: int) -> bool:
    """When `fd` is a regular file larger than `max_bytes`, move its content to `<file>.1` (replacing an
    older one) and truncate it; True when it did. A terminal, pipe or closed fd is left alone."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
        return False
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    if path.endswith(" (deleted)"):
        os.ftruncate(fd, 0)
        return True
    try:
        src = os.open(path, os.O_RDONLY)
        try:
            tmp = f"{path}.1.tmp-{os.getpid()}"
            try:
                os.unlink(tmp)  # a leftover of a crash; O_EXCL below never writes through a planted link
            except FileNotFoundError:
                pass
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, st.st_mode & 0o777)
            try:
                left = st.st_size
                while left > 0:
                    sent = os.sendfile(dst, src, None, min(left, 1 << 24))
                    if sent == 0:
                        break
                    left -= sent
            finally:
                os.close(dst)
            os.replace(tmp, f"{path}.1")
        finally:
            os.close(src)
        os.ftruncate(fd, 0)
    except OSError:
        return False  # a full disk must not stop the job: it tries again next time
    return True
