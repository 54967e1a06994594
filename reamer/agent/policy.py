"""Who may do what: the agent's access policy, as pure functions of facts the host code gathered.

No I/O here: callers pass the caller's credentials (SO_PEERCRED), the facts about every process a
request would touch (owner, kernel thread; descendants included), cgroup paths, job owners and the
config's `security` section. Each check returns normally or raises `Forbidden` naming the rule and
the fix (HTTP 403).

Root may do everything except what is never right on a shared node, whoever asks: touch pid 1,
kernel threads or the agent itself, take a protected cgroup (the root cgroup, init.scope,
system.slice, ... from the config), or exceed the configured RT priority cap. Any other caller acts
only on processes it owns (every process found, descendants included; every one of its uids: a
setuid program is not the caller's), cgroups under the prefixes the config allows, and jobs it created.

The training RT budget (cgroup v1 RT group scheduling): `rt_pools` splits the cap into a privileged
pool (root's and admins' jobs) and a users' pool, so that no user's attach shrinks a privileged job's
budget.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Sequence

from reamer.errors import ErrorKind
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

    kind = ErrorKind.FORBIDDEN

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


def process_refusal(caller: Caller, proc: ProcessFacts, agent_pid: int) -> Forbidden | None:
    """Why `caller` may not pin `proc` or make it SCHED_RR (None: it may; a gone process is nothing to
    touch). A caller other than root needs every uid of the process (real, effective, saved, filesystem)
    to be its own: a setuid program it runs keeps its real uid but is not its to make real-time."""
    if proc.uid is None:
        return None
    if proc.pid == 1:
        return Forbidden("pid_1", "pid 1 (init) would be pinned", "give the training job's own pids")
    if proc.kernel_thread:
        return Forbidden("kernel_thread", f"process {proc.pid} is a kernel thread",
                         "give the training job's own pids; kernel threads are never pinned")
    if proc.pid == agent_pid or proc.tgid == agent_pid:
        return Forbidden("agent_process", f"process {proc.pid} is the reamer agent itself",
                         "give the training job's own pids")
    if caller.is_root:
        return None
    if proc.uid != caller.uid:
        return Forbidden("process_owner",
                         f"process {proc.pid} belongs to uid {proc.uid}, not to the caller ({caller})",
                         "attach only processes you own (descendants included), or ask root to attach it")
    foreign = sorted({u for u in proc.uids if u != caller.uid})
    if foreign:
        named = dict(zip(("real", "effective", "saved", "filesystem"),
                         (proc.uid, proc.euid, proc.suid, proc.fsuid)))
        shown = ", ".join(f"{k} {v}" for k, v in named.items() if v is not None)
        return Forbidden("process_owner",
                         f"process {proc.pid} runs setuid or changed identity: its uids are {shown}, not only the "
                         f"caller's ({caller})",
                         "attach only processes that run as you alone (no setuid programs), or ask root to attach it")
    return None


def check_processes(caller: Caller, processes: Sequence[ProcessFacts], agent_pid: int,
                    rules: SecurityRules) -> None:
    """Every process a request would pin (descendants included) must be one the caller may touch."""
    del rules  # no process rule is configurable today; kept for one signature across checks
    for proc in processes:
        refusal = process_refusal(caller, proc, agent_pid)
        if refusal is not None:
            raise refusal


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


def check_same_process(checked: ProcessFacts, now: ProcessFacts, still_running: bool | None = None) -> None:
    """A process named in a request must be the one that was checked, at every later step (its pid may have
    been freed and given to another process meanwhile). `still_running`: what a pidfd held since the check
    says (exact); None: the start times decide."""
    if now.uid is None or now.zombie:
        return
    if still_running is None:
        still_running = checked.start_time is None or now.start_time == checked.start_time
    if still_running:
        return
    raise Forbidden("process_identity",
                    f"process {checked.pid} exited while the request was being carried out and its pid now belongs to "
                    f"another process (uid {now.uid}, started later)",
                    "nothing was pinned: give the pids of the job's running processes again")


# ---------------------------------------------------------------------------------------------- RT budget


@dataclass(frozen=True)
class BudgetHolder:
    """A training job that needs an RT budget, and whose pool it draws from."""

    job: str
    uid: int
    privileged: bool  # attached by root or an admin


@dataclass(frozen=True)
class RtPools:
    """training.rt_runtime_us split in two: users' jobs together get at most user_percent of it, root's and
    admins' jobs share the rest. A job's budget is its pool divided among the jobs drawing from it (in the
    users' pool: first among the users with jobs, then among each user's jobs), so an attach shrinks only
    jobs of the same pool, and never a privileged job because of a user's."""

    cap_us: int
    user_percent: int

    @property
    def user_pool_us(self) -> int:
        return self.cap_us * self.user_percent // 100

    @property
    def privileged_pool_us(self) -> int:
        return self.cap_us - self.user_pool_us

    def pool_of(self, holder: BudgetHolder) -> str:
        return "privileged" if holder.privileged else "users"


def rt_budgets(pools: RtPools, holders: Sequence[BudgetHolder]) -> dict[str, int]:
    """Each holder's budget (us per period) under the pool rule."""
    budgets: dict[str, int] = {}
    privileged = [h for h in holders if h.privileged]
    for holder in privileged:
        budgets[holder.job] = pools.privileged_pool_us // len(privileged)
    by_uid: dict[int, list[BudgetHolder]] = {}
    for holder in holders:
        if not holder.privileged:
            by_uid.setdefault(holder.uid, []).append(holder)
    for jobs in by_uid.values():
        for holder in jobs:
            budgets[holder.job] = pools.user_pool_us // len(by_uid) // len(jobs)
    return budgets


MIN_RT_BUDGET_US = 1000  # below this a job's threads would hardly run as SCHED_RR


def check_rt_budget(pools: RtPools, holder: BudgetHolder, holders: Sequence[BudgetHolder]) -> None:
    """A job may draw from its pool only while its budget there would be worth having."""
    budget = rt_budgets(pools, [*holders, holder])[holder.job]
    if budget >= MIN_RT_BUDGET_US:
        return
    pool = pools.pool_of(holder)
    size = pools.user_pool_us if pool == "users" else pools.privileged_pool_us
    same = sorted(h.job for h in holders if h.privileged == holder.privileged)
    raise Forbidden("rt_pool",
                    f"training job {holder.job!r} needs a real-time budget (its processes live in a cpu cgroup "
                    f"of their own) and the {pool} pool ({size} us of training.rt_runtime_us {pools.cap_us}) would "
                    f"give it {budget} us (held by: {', '.join(same) or 'none'})",
                    "detach a job of that pool, attach processes that live in the root cpu cgroup (they need no "
                    "budget), ask an admin to attach it, or raise training.user_rt_percent / rt_runtime_us in "
                    "the agent's config")
