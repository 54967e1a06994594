"""Files as another user sees them: the agent (root) asks the kernel on a user's behalf.

Each check runs a tiny shell command with the user's uid, gid and groups, so the kernel decides
(mode bits, ACLs, every directory on the way, root-squashed mounts) exactly as it will for the
user's job. A path the user cannot reach and a path that does not exist look the same from here,
so callers can answer both with one message.

Children that work on a user's input (the deploy check, the layout search's workers) start with that
user's identity (as_user_kwargs), a minimal environment (child_env) and rlimits set before they run
(limited_argv).
"""
from __future__ import annotations

import grp
import os
import pwd
import subprocess
from dataclasses import dataclass
from typing import Any

from reamer.host.errors import ReamerError

SHELL = "/bin/sh"
CHECK_TIMEOUT_S = 20.0
_TESTS = {
    "file": 'test -f "$1" && test -r "$1"',
    "dir": 'test -d "$1" && test -r "$1" && test -x "$1"',
    # created (with parents) by the user itself, then writable by it
    "output_dir": 'mkdir -p -- "$1" 2>/dev/null; test -d "$1" && test -w "$1" && test -x "$1"',
    # could be created (its nearest existing ancestor is a writable directory), nothing made
    "output_parent": 'p="$1"; while [ ! -e "$p" ] && [ ! -L "$p" ]; do p=$(dirname -- "$p"); done; '
                     'test -d "$p" && test -w "$p" && test -x "$p"',
}


class UnknownUser(ReamerError):
    """A user named in the config does not exist on this host."""


@dataclass(frozen=True)
class Identity:
    """Whom a job runs as."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    name: str = ""

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def __str__(self) -> str:
        return f"{self.name or 'uid'} (uid {self.uid})" if self.name else f"uid {self.uid}"


def identity_of(uid: int, gid: int) -> Identity:
    """The identity of a caller: its uid and gid, and the groups the user database gives that uid."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Identity(uid, gid, (gid,))
    return Identity(uid, gid, tuple(sorted(set(_grouplist(entry.pw_name, gid)))), entry.pw_name)


def identity_named(user: str) -> Identity:
    """`user` (a name or a numeric uid) with its primary group and groups from the user database."""
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise UnknownUser(f"user {user!r} (inference.run_as) does not exist on this host",
                          f"create it (useradd --system {user}) or set inference.run_as to an existing user") from None
    return Identity(entry.pw_uid, entry.pw_gid, tuple(sorted(set(_grouplist(entry.pw_name, entry.pw_gid)))),
                    entry.pw_name)


def _grouplist(name: str, gid: int) -> list[int]:
    try:
        return os.getgrouplist(name, gid)
    except (OSError, KeyError):
        return [gid] + [g.gr_gid for g in grp.getgrall() if name in g.gr_mem]


def can_access(identity: Identity, path: str, kind: str) -> bool:
    """Whether `identity` can use `path` as a "file" (read), a "dir" (list and enter), an
    "output_dir" (created by it if missing, then written) or an "output_parent" (could be created by it:
    nothing is made)."""
    try:
        done = subprocess.run([SHELL, "-c", _TESTS[kind], "reamer-access", path], **as_user_kwargs(identity), cwd="/",
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False  # a hung mount: the job could not use it either
    return done.returncode == 0


def in_group(uid: int, gid: int, group: str | None) -> bool:
    """Whether the user `uid` (primary group `gid`) is a member of `group`, by the user database (never by
    what a caller says); False for no group, an unknown group or an unknown user."""
    if not group:
        return False
    try:
        wanted = grp.getgrnam(group).gr_gid
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return wanted == gid or wanted in _grouplist(name, gid)


# --------------------------------------------------------------------------- children on a user's behalf

PRLIMIT = "/usr/bin/prlimit"
# What a child started for a job's user inherits from the agent's environment (root's own settings only;
# REAMER_CUSTOM_OP_LIBRARIES: the agent config's inference.custom_op_libraries, see reamer.serve.backends).
INHERITED_ENV = ("LANG", "LC_ALL", "TZ", "LD_LIBRARY_PATH", "REAMER_CUSTOM_OP_LIBRARIES")


def as_user_kwargs(identity: Identity | None) -> dict[str, Any]:
    """Popen arguments that start a child with `identity`'s uid, gid and groups (nothing when it is this
    process's own user, or when this process cannot change user)."""
    if identity is None or identity.uid == os.geteuid() or os.geteuid() != 0:
        return {}
    return {"user": identity.uid, "group": identity.gid, "extra_groups": list(identity.groups or (identity.gid,))}


def child_env(**extra: str) -> dict[str, str]:
    """A minimal environment for a child started on a user's behalf: a fixed PATH, the locale, and `extra`."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/"}
    env.update({k: os.environ[k] for k in INHERITED_ENV if k in os.environ})
    env.update(extra)
    return env


def limited_argv(argv: list[str], data_bytes: int, file_bytes: int) -> list[str]:
    """`argv` behind prlimit: its data segment (heap and private writable mappings, so every allocation a
    decompression makes) and the files it writes are capped, and it dumps no core, from before the program
    starts. Unchanged when prlimit is missing (the child then sets its own: set_own_limits)."""
    if not os.access(PRLIMIT, os.X_OK):
        return argv
    return [PRLIMIT, f"--data={data_bytes}", f"--fsize={file_bytes}", "--core=0", "--", *argv]


def set_own_limits(data_bytes: int, file_bytes: int) -> None:
    """What limited_argv does, for this process (the child's own backstop): only lowers limits."""
    import resource

    def above(limit: int, value: int) -> bool:
        return limit == resource.RLIM_INFINITY or limit > value

    for which, value in ((resource.RLIMIT_DATA, data_bytes), (resource.RLIMIT_FSIZE, file_bytes),
                         (resource.RLIMIT_CORE, 0)):
        soft, hard = resource.getrlimit(which)
        value = value if above(hard, value) else hard
        if above(soft, value) or above(hard, value):
            resource.setrlimit(which, (value, value))
