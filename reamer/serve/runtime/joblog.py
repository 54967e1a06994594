"""Keep a job's log (job.log: its stderr and its workers', a file the agent opened for append) bounded.

The job, its instance workers and native libraries all write to the same open file (fd 2, O_APPEND),
so the file cannot be renamed away from under them; it is copied to `job.log.1` and truncated in place
(logrotate's copytruncate). Under the agent, job.log sits in a directory only root can write, so the copy
goes to the job's own directory (`keep_dir`, its io/). Every writer appends at the new end. Lines written
between the copy and the truncation are lost, which is the price of not coordinating with native writers.
"""
from __future__ import annotations

import os
import stat


def bound_log(fd: int, max_bytes: int, keep_dir: str | os.PathLike | None = None) -> bool:
    """When `fd` is a regular file larger than `max_bytes`, move its content to `<file>.1` (in `keep_dir`
    when given, else beside the file; replacing an older one) and truncate it; True when it did. A terminal,
    pipe or closed fd is left alone."""
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
    kept = os.path.join(os.fspath(keep_dir), os.path.basename(path)) if keep_dir is not None else path
    try:
        src = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)  # the very file of fd, not whatever is at its path now
        try:
            tmp = f"{kept}.1.tmp-{os.getpid()}"
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
            os.replace(tmp, f"{kept}.1")
        finally:
            os.close(src)
        os.ftruncate(fd, 0)
    except OSError:
        return False  # a full disk must not stop the job: it tries again next time
    return True
