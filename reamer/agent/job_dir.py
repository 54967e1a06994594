"""The directory one deploy of an inference job runs in, and the environment it starts with.

`<run_dir>/jobs/<name>@<deploy id>/` is made by root for one deploy (a fresh random id each time, so a
name that was used before never leads to a directory someone could have prepared) and removed with it:

    <name>@<id>/        root:root 0755   the job's cwd: nothing its user can add to or replace
      spec.json         root 0644        what the agent asks of the job
      job.log           the job's user   its stdout and stderr; made by root (O_EXCL), handed over by fchown,
                                         so the user writes it but cannot swap it for a link
      io/               the job's user   what the job writes for the agent: status.json, events.jsonl,
                                         job.log.1 (the rotated log); the agent reads these with
                                         reamer.host.safe_files, never by plain open()

A record from before per-deploy directories (no deploy id) keeps `<run_dir>/jobs/<name>/` until it is
started again, which gives it a fresh directory.
"""
from __future__ import annotations

import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from reamer.host.errors import ReamerError
from reamer.host.safe_files import create_file, make_dir, remove_tree

SPEC_FILE = "spec.json"  # the JobSpec; its run_dir is io/
LOG_FILE = "job.log"
IO_DIR = "io"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What a job gets of the agent's environment. Thread-pool and locale settings shape how the job computes
# and prints; nothing else of root's environment (credentials, proxies, LD_*, PYTHON*, NOTIFY_SOCKET) is
# the job's business.
ENV_NAMES = ("PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR")
ENV_PREFIXES = ("LC_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "REAMER_")


def new_deploy_id() -> str:
    return secrets.token_hex(8)


def deploy_dir(jobs_dir: Path, name: str, deploy_id: str) -> Path:
    """A deploy's directory; an old record (no deploy id) keeps the per-name one it was started in."""
    return jobs_dir / f"{name}@{deploy_id}" if deploy_id else jobs_dir / name


def io_dir(jobs_dir: Path, name: str, deploy_id: str) -> Path:
    """Where the job writes what the agent reads (the whole directory for an old record)."""
    base = deploy_dir(jobs_dir, name, deploy_id)
    return base / IO_DIR if deploy_id else base


@dataclass(frozen=True)
class JobUser:
    """Whom the job's processes run as: uid/gid, and whether the agent switches to them at all."""

    uid: int
    gid: int
    switch: bool  # False: the job runs as the agent (the agent is not root, or the job is root's)


def ensure_jobs_root(jobs_dir: Path) -> None:
    """<run_dir>/jobs: the agent's, writable by no one else (a deploy's directory is made in it), and not
    listable (0711: a job's user reaches its own directory, but does not learn others' names and ids)."""
    jobs_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        make_dir(jobs_dir, 0o711)
    except FileExistsError:
        st = os.lstat(jobs_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ReamerError(f"{jobs_dir} is not a directory of the agent's user (uid {st.st_uid})",
                              f"remove {jobs_dir}; the agent makes it again") from None
        if st.st_mode & 0o066:
            os.chmod(jobs_dir, stat.S_IMODE(st.st_mode) & ~0o066)


def prepare(jobs_dir: Path, name: str, deploy_id: str, user: JobUser) -> tuple[Path, bool]:
    """Make the deploy's directory, its io/ and job.log when they are not there yet; (directory, made now).

    An existing directory is reused only when it is the agent's own, a real directory not writable by
    others (the agent restarted the job after a crash or a placement change)."""
    ensure_jobs_root(jobs_dir)
    base = deploy_dir(jobs_dir, name, deploy_id)
    try:
        make_dir(base, 0o755)
        made = True
    except FileExistsError:
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ReamerError(f"{base} is not the agent's own directory", "remove the job and deploy it again") \
                from None
        made = False
    owner = (user.uid, user.gid) if user.switch else (None, None)
    try:
        make_dir(base / IO_DIR, 0o755, *owner)
    except FileExistsError:
        pass  # base is root's: only the agent could have made io/ there
    try:
        os.close(create_file(base, LOG_FILE, 0o640, *owner, append=True))
    except FileExistsError:
        pass
    return base, made


def open_log(base: Path, user: JobUser) -> int:
    """job.log of a prepared directory, for appending (the job's stdout and stderr). Anything but a regular
    file there (only root could have put it in root's directory) is replaced by a new, empty log."""
    owner = (user.uid, user.gid) if user.switch else (None, None)
    try:
        fd = os.open(base / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return create_file(base, LOG_FILE, 0o640, *owner, append=True)
    except OSError:  # ELOOP: a link; ENXIO: a FIFO without a reader
        fd = -1
    if fd >= 0 and stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
        return fd
    if fd >= 0:
        os.close(fd)
    why = remove_tree(base / LOG_FILE)  # a link or a FIFO is unlinked; a directory removed
    if why:
        raise ReamerError(f"cannot replace {base / LOG_FILE}: {why}", "remove the job and deploy it again")
    return create_file(base, LOG_FILE, 0o640, *owner, append=True)


def remove(jobs_dir: Path, name: str, deploy_id: str) -> str:
    """Remove a deploy's directory (without following links); "" when it is gone, else why not."""
    return remove_tree(deploy_dir(jobs_dir, name, deploy_id))


def job_environment(user: JobUser, agent_env: dict[str, str] | None = None) -> dict[str, str]:
    """The job's environment: the allowlisted part of the agent's, and the job user's identity."""
    source = os.environ if agent_env is None else agent_env
    env = {k: v for k, v in source.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    env.setdefault("PATH", DEFAULT_PATH)
    try:
        entry = pwd.getpwuid(user.uid)
        env.update(HOME=entry.pw_dir or "/", USER=entry.pw_name, LOGNAME=entry.pw_name)
    except KeyError:
        env["HOME"] = "/"
    return env
