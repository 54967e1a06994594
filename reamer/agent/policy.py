"""Who may do what: the agent's access policy, as pure functions of facts the host code gathered.

No I/O here: callers pass the caller's credentials (SO_PEERCRED), the facts about every process a
request would touch (owner, kernel thread; descendants included), cgroup paths, job owners and the
config's `security` section. Each check returns normally or raises `Forbidden` naming the rule and
the fix (HTTP 403).

Root may do everything except what is never right on a shared node, whoever asks: touch pid 1,
kernel threads or the agent itself, take a protected cgroup (the root cgroup, init.scope,
system.slice, ... from the config), or exceed the configured RT priority cap. Any other caller acts
only on processes it owns (every process found, descendants included), cgroups under the prefixes
the config allows, and jobs it created.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Sequence

from reamer.host.errors import ReamerError
from reamer.host.identity import ProcessFacts

ROOT_UID = 0


@dataclass(frozen=True)
class Caller:
    """The process on the other end of the API socket."""

    uid: int
    gid: int
    pid: int
    admin: bool = False  # a member of security.admin_group (root is an admin whatever its groups)

    @property
    def is_root(self) -> bool:
        return self.uid == ROOT_UID

    @property
    def is_admin(self) -> bool:
        """Root, or a member of the configured admin group."""
        return self.is_root or self.admin

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


# The agent acting on its own behalf (restoring jobs from its store, the reconcile loop, tests that
# embed it): it is root.
AGENT = Caller(uid=ROOT_UID, gid=0, pid=0)


@dataclass(frozen=True)
class SecurityRules:
    """The config's `security` section, as the policy reads it."""

    allowed_cgroup_prefixes: tuple[str, ...] = ("user.slice/user-{uid}.slice",)
    protected_cgroups: tuple[str, ...] = ("/", "init.scope", "system.slice", "user.slice", "machine.slice")
    max_rt_priority: int = 90


class Forbidden(ReamerError):
    """The policy refused a request (HTTP 403); `rule` names the rule that refused it."""

    code = "forbidden"

    def __init__(self, rule: str, message: str, fix: str) -> None:
        super().__init__(f"refused by rule {rule}: {message}", fix)
        self.rule = rule

    @property
    def data(self) -> dict[str, str]:
        return {"rule": self.rule}


def normalize_cgroup(path: str) -> str:
    """A cgroup path relative to the hierarchy root, with './', '..', doubled and trailing slashes
    resolved ('' is the root cgroup). '..' never climbs above the root."""
    return posixpath.normpath("/" + path.strip()).lstrip("/")


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + "/")


def check_priority(caller: Caller, priority: int, rules: SecurityRules) -> None:
    """Nobody, root included, makes threads RT above the configured cap."""
    if priority > rules.max_rt_priority:
        raise Forbidden("max_rt_priority",
                        f"SCHED_RR priority {priority} is above this node's cap of {rules.max_rt_priority}",
                        f"ask for priority {rules.max_rt_priority} or less (or raise security.max_rt_priority "
                        "in the agent's config)")


def check_processes(caller: Caller, processes: Sequence[ProcessFacts], agent_pid: int,
                    rules: SecurityRules) -> None:
    """Every process a request would pin (descendants included) must be one the caller may touch."""
    del rules  # no process rule is configurable today; kept for one signature across checks
    for proc in processes:
        if proc.uid is None:  # gone since it was found: nothing to touch
            continue
        if proc.pid == 1:
            raise Forbidden("pid_1", "pid 1 (init) would be pinned", "give the training job's own pids")
        if proc.kernel_thread:
            raise Forbidden("kernel_thread", f"process {proc.pid} is a kernel thread",
                            "give the training job's own pids; kernel threads are never pinned")
        if proc.pid == agent_pid:
            raise Forbidden("agent_process", f"process {proc.pid} is the reamer agent itself",
                            "give the training job's own pids")
        if not caller.is_root and proc.uid != caller.uid:
            raise Forbidden("process_owner",
                            f"process {proc.pid} belongs to uid {proc.uid}, not to the caller ({caller})",
                            "attach only processes you own (descendants included), or ask root to attach it")


def check_cgroup(caller: Caller, path: str, rules: SecurityRules) -> str:
    """The normalized cgroup path a request may take; refuses protected ones (for everyone) and, for
    callers other than root, paths outside the allowed prefixes."""
    normal = normalize_cgroup(path)
    protected = {normalize_cgroup(p) for p in rules.protected_cgroups}
    if normal in protected:
        shown = normal or "/"
        raise Forbidden("protected_cgroup", f"cgroup {shown!r} is protected on this node (it holds the host's "
                        "own processes)", "give the training job's own cgroup (a child of it), or its pids")
    if not caller.is_root:
        allowed = allowed_prefixes(caller, rules)
        if not any(_under(normal, prefix) for prefix in allowed):
            raise Forbidden("cgroup_prefix",
                            f"cgroup {normal!r} is not under a prefix allowed to uid {caller.uid} "
                            f"({', '.join(repr(p) for p in allowed) or 'none'})",
                            "attach by --pid, use a cgroup under an allowed prefix, or ask the operator to add "
                            "one to security.allowed_cgroup_prefixes")
    return normal


def allowed_prefixes(caller: Caller, rules: SecurityRules) -> list[str]:
    """The config's prefixes with {uid} filled in for this caller."""
    filled = (normalize_cgroup(p.replace("{uid}", str(caller.uid))) for p in rules.allowed_cgroup_prefixes)
    return [p for p in filled if p]


def check_job_owner(caller: Caller, kind: str, name: str, owner_uid: int) -> None:
    """Changing or removing a job needs its owner or root."""
    if not caller.is_root and caller.uid != owner_uid:
        raise Forbidden("job_owner", f"{kind} job {name!r} belongs to uid {owner_uid}, not to the caller ({caller})",
                        "act only on jobs you created (see the owner_uid of `list`), or ask root")
