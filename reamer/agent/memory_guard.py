"""Training's memory comes first: inference job processes are the OOM killer's first choice and may
have a memory limit, and a job the OOM killer hit is reported as such.

Each pass (the agent's reconcile loop, and right after a deploy) every running inference job's
processes, descendants included, get `inference.oom_score_adj` (training keeps its own, usually 0)
and are moved into the job's memory cgroup `<cgroup_name>/infer-<job>`, whose limit is the job's
`memory_limit_mb` or the config's `inference.memory_limit_mb` (none: unlimited). The kernel counts
OOM kills per memory cgroup (its own limit or the host running out); a rise is an event
`inference_oom_killed` and `infer show` says so.

A removed job's cgroup goes with it: whatever is still in it is killed (empty()), then it is removed
(forget()); one that cannot be removed yet (a process stuck in the kernel) is tried again at each pass.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from reamer.agent.training import job_process_trees
from reamer.host.cgroups import CgroupDriver
from reamer.host.errors import HostError
from reamer.host.executor import HostExecutor, executor_for
from reamer.host.sched import ThreadGone

log = logging.getLogger("reamer.memory")

MEMORY = "memory"
MIB = 1024 * 1024
EMPTY_TIMEOUT_S = 10.0  # how long a removal waits for killed processes to leave the job's cgroup


@dataclass
class JobMemory:
    """What the guard knows of one job's memory cgroup."""

    limit_mb: float | None = None
    oom_kills: int = 0  # seen in this agent's lifetime (the cgroup's counter minus its value when first seen)
    counter: int | None = None  # the kernel's counter at the last look


class InferenceMemoryGuard:
    def __init__(self, driver: CgroupDriver | HostExecutor, cgroup_name: str, oom_score_adj_value: int,
                 default_limit_mb: float | None, emit: Callable[..., Any], proc_root: str = "/proc") -> None:
        """`driver`: the host executor every change goes through, or a bare cgroup driver (one is made)."""
        self.host = executor_for(driver, proc_root=proc_root)
        self.driver: CgroupDriver = self.host.driver
        self.cgroup_name = cgroup_name
        self.oom_score_adj = oom_score_adj_value
        self.default_limit_mb = default_limit_mb
        self.emit = emit
        self.proc_root = proc_root
        self.jobs: dict[str, JobMemory] = {}
        # the pids each job's were last brought to: their children inherit both the oom_score_adj and the
        # cgroup, so an unchanged set needs no per-pid reads on the next pass
        self._settled: dict[str, frozenset[int]] = {}
        self._left: set[str] = set()  # removed jobs whose cgroup could not be removed yet
        self.message = ""  # why memory cgroups are unavailable ("" when they work)
        self.available = self._probe()

    def _probe(self) -> bool:
        try:
            self.driver.memory_dir(self.cgroup_name)
            if self.driver.version == 1:
                return (self.driver.root / MEMORY).is_dir()
            return MEMORY in self.driver.controllers("")  # type: ignore[attr-defined]
        except (HostError, OSError) as exc:
            self.message = f"no memory cgroup controller ({exc}): memory limits and OOM reports are off"
            return False

    def _exists(self, path: str) -> bool:
        return self.driver.memory_dir(path).is_dir()  # driver.exists() looks at the cpu/cpuset trees only

    def cgroup_path(self, job: str) -> str:
        return f"{self.cgroup_name}/infer-{job}"

    def limit_of(self, rec: Any) -> float | None:
        return getattr(rec, "memory_limit_mb", None) or self.default_limit_mb

    def apply(self, records: Iterable[Any]) -> None:
        """Bring every running job to its oom_score_adj, memory cgroup and limit; report new OOM kills."""
        records = list(records)
        trees = job_process_trees({rec.name: [rec.pid] for rec in records if rec.state == "running" and rec.pid})
        for rec in records:
            if rec.name in trees:
                pids = trees[rec.name]
                settled = self._settled.get(rec.name) == frozenset(pids)
                if not settled:
                    self._prefer_as_victims(pids)
                if self.available:
                    try:
                        self._contain(rec, pids, settled)
                    except HostError as exc:
                        log.warning("memory cgroup of inference job %s: %s", rec.name, exc)
                        continue
                self._settled[rec.name] = frozenset(pids)
            if self.available and rec.name in self.jobs:
                self._check_oom(rec.name)
        if self._left:
            self._remove_left()

    def _prefer_as_victims(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                if self.host.oom_score_adj(pid) != self.oom_score_adj:
                    self.host.set_oom_score_adj(pid, self.oom_score_adj)
            except ThreadGone:
                continue
            except HostError as exc:
                log.warning("cannot set oom_score_adj of %d: %s", pid, exc)

    def _contain(self, rec: Any, pids: list[int], settled: bool = False) -> None:
        path = self.cgroup_path(rec.name)
        job = self.jobs.get(rec.name)
        limit = self.limit_of(rec)
        self._left.discard(rec.name)  # deployed again under the same name: its cgroup is in use again
        if job is None or not self._exists(path):
            self.host.create_cgroup(path, controllers=(MEMORY,))
            job = self.jobs.setdefault(rec.name, JobMemory(limit_mb=-1.0))
            settled = False  # a cgroup made anew holds none of them
        if job.limit_mb != limit:
            self.host.set_memory_limit(path, None if limit is None else int(limit * MIB))
            job.limit_mb = limit
        if job.counter is None:
            job.counter = self.driver.oom_kills(path)
        for pid in [] if settled else pids:
            try:
                if self.driver.cgroup_of(pid).get(MEMORY, "").strip("/") != path:
                    self.host.add_process(path, pid, controllers=(MEMORY,))
            except ThreadGone:
                continue

    def _check_oom(self, name: str) -> None:
        job = self.jobs[name]
        try:
            counter = self.driver.oom_kills(self.cgroup_path(name))
        except HostError:
            return
        if job.counter is not None and counter > job.counter:
            killed = counter - job.counter
            job.oom_kills += killed
            limit = f"its memory limit of {job.limit_mb:g} MiB" if job.limit_mb else "the host running out of memory"
            self.emit("inference_oom_killed",
                      f"{name}: the kernel's OOM killer killed {killed} of its process(es) ({limit}); fix: raise "
                      "memory_limit_mb, use a smaller layout or batch, or free memory",
                      job=name, data={"killed": killed, "oom_kills": job.oom_kills, "memory_limit_mb": job.limit_mb})
        job.counter = counter

    def oom_note(self, name: str) -> str:
        """A line for the job's view: how often the OOM killer hit it ("" when never)."""
        job = self.jobs.get(name)
        if job is None or not job.oom_kills:
            return ""
        limit = f" (memory limit {job.limit_mb:g} MiB)" if job.limit_mb else ""
        return f"killed by the OOM killer {job.oom_kills} time(s){limit}"

    def empty(self, name: str, timeout: float = EMPTY_TIMEOUT_S) -> bool:
        """Kill whatever of a removed job is still in its memory cgroup (workers its main process left
        behind, a hung process); True once none is left. Call without the agent's lock: it waits."""
        if not self.available:
            return True
        return self.host.empty_cgroup(self.cgroup_path(name), timeout)

    def forget(self, name: str) -> None:
        """Remove a removed job's memory cgroup (after empty()); if it cannot go yet, every pass retries."""
        self.jobs.pop(name, None)
        self._settled.pop(name, None)
        if not self.available:
            return
        if not self._remove(name):
            self._left.add(name)

    def _remove(self, name: str) -> bool:
        path = self.cgroup_path(name)
        try:
            if not self._exists(path):
                return True
            if self.driver.processes(path, MEMORY):
                self.host.empty_cgroup(path, timeout=0)  # one more round of kills; removed at a later pass
                return False
            self.host.remove_cgroup(path)
            return True
        except (HostError, OSError) as exc:
            log.warning("could not remove %s: %s", path, exc)
            return False

    def _remove_left(self) -> None:
        for name in sorted(self._left):
            if name in self.jobs or self._remove(name):
                self._left.discard(name)
