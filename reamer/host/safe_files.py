"""Reading a file someone else can write, as root, without being turned by it.

The agent runs as root and reads files a job's user can write or replace (a job's status, its events,
the tail of its log). A plain open() there follows a symlink to a root-only file, blocks forever on a
FIFO, wakes a device driver, and reads however much the user wrote. open_untrusted() instead:

- opens the name with O_PATH|O_NOFOLLOW relative to a directory fd (a symlink is refused, never followed;
  nothing but a lookup happens, so a FIFO or a device is never opened for reading);
- checks on that very inode (fstat) that it is a regular file owned by one of the expected uids;
- only then reopens the same inode through /proc/self/fd for reading, O_NONBLOCK, and reads at most
  max_bytes (the file may grow meanwhile: the cap is on the read, not on the fstat).

What it does not judge: the content (parse it with bounds of your own: depth, count, kinds).
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Collection, Literal

from .errors import ReamerError

ReadMode = Literal["whole", "head", "tail"]


class UntrustedFileError(ReamerError):
    """A file a job's user can write is not what the agent will read: a link, a FIFO, someone else's, too big."""

    def __init__(self, message: str, fix: str = "", reason: str = "") -> None:
        super().__init__(message, fix)
        self.reason = reason  # link | not_regular | wrong_owner | too_large | bad_name | unreadable | missing


class UntrustedFileMissing(UntrustedFileError):
    """Nothing by that name (yet): usually not an error for the caller."""


def open_untrusted(directory: str | os.PathLike | int, name: str, owner_uids: Collection[int], max_bytes: int,
                   *, offset: int = 0, mode: ReadMode = "whole") -> bytes:
    """The bytes of `directory`/`name`, read safely (see the module doc).

    directory: a path or an open directory fd (O_PATH is fine); a path is opened without following a
        symlink in its last component.
    name: one path component (no '/', not '.' or '..').
    owner_uids: the uids the file may belong to (e.g. {job_uid}); anything else is refused.
    max_bytes: the most bytes read.
    offset: where to start ("whole" and "head"); ignored for "tail".
    mode: "whole" — the file from `offset` to its end, refused (reason too_large) when that exceeds
        max_bytes; "head" — at most max_bytes from `offset` (for reading a growing file in chunks);
        "tail" — the last max_bytes of the file.

    Raises UntrustedFileMissing when nothing is there, UntrustedFileError (with .reason) otherwise.
    """
    if max_bytes < 0 or offset < 0:
        raise ValueError("max_bytes and offset must be >= 0")
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise UntrustedFileError(f"refusing to read {name!r}: not a plain file name",
                                 "pass a single path component", reason="bad_name")
    where = _describe(directory, name)
    dir_fd, close_dir = _directory_fd(directory, where)
    try:
        try:
            path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError as exc:
            raise UntrustedFileMissing(f"{where} does not exist", "", reason="missing") from exc
        except OSError as exc:
            raise UntrustedFileError(f"cannot look up {where}: {exc.strerror}",
                                     "check the directory's permissions", reason="unreadable") from exc
        try:
            return _read_checked(path_fd, where, owner_uids, max_bytes, offset, mode)
        finally:
            os.close(path_fd)
    finally:
        if close_dir:
            os.close(dir_fd)


def _describe(directory: str | os.PathLike | int, name: str) -> str:
    if isinstance(directory, int):
        return repr(name)
    return str(Path(directory) / name)


def _directory_fd(directory: str | os.PathLike | int, where: str) -> tuple[int, bool]:
    if isinstance(directory, int):
        return directory, False
    try:
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise UntrustedFileMissing(f"{where} does not exist (no directory {directory})", "",
                                   reason="missing") from exc
    except OSError as exc:
        # ENOTDIR or ELOOP: the directory itself was replaced by a file or a link.
        raise UntrustedFileError(f"cannot open the directory of {where}: {exc.strerror}",
                                 "the directory must be a real directory, not a link", reason="link") from exc
    return fd, True


def _read_checked(path_fd: int, where: str, owner_uids: Collection[int], max_bytes: int, offset: int,
                  mode: ReadMode) -> bytes:
    st = os.fstat(path_fd)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedFileError(f"refusing to read {where}: it is a symbolic link",
                                 "the job's files must be regular files; remove the link", reason="link")
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(f"refusing to read {where}: not a regular file ({_kind(st.st_mode)})",
                                 "the job's files must be regular files; remove it", reason="not_regular")
    if st.st_uid not in owner_uids:
        raise UntrustedFileError(
            f"refusing to read {where}: owned by uid {st.st_uid}, expected {sorted(owner_uids)}",
            "the file was replaced by someone else's; remove it", reason="wrong_owner")
    if mode == "whole" and st.st_size - offset > max_bytes:
        raise UntrustedFileError(f"refusing to read {where}: {st.st_size - offset} bytes, more than {max_bytes}",
                                 "the job wrote more than the agent reads; keep the file small",
                                 reason="too_large")
    try:
        # The same inode we just checked, now opened for reading; O_NONBLOCK in case of mandatory locks.
        fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise UntrustedFileError(f"cannot open {where}: {exc.strerror}", "check its permissions",
                                 reason="unreadable") from exc
    try:
        if mode == "tail":
            start = max(0, st.st_size - max_bytes)
        else:
            start = offset
        data = _pread_upto(fd, max_bytes + (1 if mode == "whole" else 0), start)
    except OSError as exc:
        raise UntrustedFileError(f"cannot read {where}: {exc.strerror}", "check the file",
                                 reason="unreadable") from exc
    finally:
        os.close(fd)
    if mode == "whole" and len(data) > max_bytes:  # it grew after the fstat
        raise UntrustedFileError(f"refusing to read {where}: more than {max_bytes} bytes",
                                 "the job wrote more than the agent reads; keep the file small",
                                 reason="too_large")
    return data


def _pread_upto(fd: int, limit: int, start: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < limit:
        try:
            chunk = os.pread(fd, min(limit - got, 1 << 20), start + got)
        except BlockingIOError:
            break
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            raise
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "an unknown kind of file"


# --- directories root makes for someone else, and removes again ---------------------------------

def make_dir(path: str | os.PathLike, mode: int, uid: int | None = None, gid: int | None = None) -> None:
    """Create the directory `path` anew (FileExistsError when anything is there: a planted dir or link is
    never reused), with exactly `mode` (umask aside) and, when given, handed to uid:gid."""
    os.mkdir(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1 if gid is None else gid)
    finally:
        os.close(fd)


def create_file(directory: str | os.PathLike, name: str, mode: int, uid: int | None = None,
                gid: int | None = None, *, append: bool = False) -> int:
    """A new file `directory`/`name`, opened for writing: O_CREAT|O_EXCL|O_NOFOLLOW, so nothing already
    there (a file, a link, a FIFO) is written through or reused. Handed to uid:gid when given (fchown, on
    the open file). Returns the fd."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, -1 if gid is None else gid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_tree(path: str | os.PathLike) -> str:
    """Remove the directory `path` and everything in it without following a link anywhere; "" when done
    (or nothing was there), else why not.

    Subdirectories another user owns are first taken back (this process's uid, mode 0700, on each open
    directory fd, top-down): from then on that user can add nothing, so the removal is not a race against
    them. A symlink at `path` itself is removed, not followed."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            return f"cannot open {path}: {exc.strerror}"
        try:
            os.unlink(path)  # a link or a file where the directory was: remove the entry itself
        except FileNotFoundError:
            pass
        except OSError as exc2:
            return f"cannot remove {path}: {exc2.strerror}"
        return ""
    try:
        for _ in range(2):  # the second pass takes back what was made between a listing and its lock-down
            _take_back(top)
    except (OSError, RecursionError) as exc:
        log_reason = f"cannot take back {path} before removing it: {exc}"
    else:
        log_reason = ""
    finally:
        os.close(top)
    problems: list[str] = []

    def _note(_fn, failed, exc_info) -> None:
        problems.append(f"{failed}: {exc_info[1]}")

    try:
        shutil.rmtree(path, onerror=_note)  # fd-based on Linux: never follows a link inside
    except RecursionError:
        problems.append("nested too deep")
    if problems:
        return "; ".join(filter(None, [log_reason, *problems[:3]]))
    return ""


def _take_back(top: int) -> None:
    me, my_group = os.geteuid(), os.getegid()
    os.fchown(top, me, my_group)
    os.fchmod(top, 0o700)
    for _root, _dirs, _files, dir_fd in os.fwalk(dir_fd=top, follow_symlinks=False, top="."):
        os.fchown(dir_fd, me, my_group)
        os.fchmod(dir_fd, 0o700)
