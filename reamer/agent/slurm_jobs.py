"""Training jobs a Slurm Prolog hands to the agent: pending until their steps run, then followed step by step.

A Slurm job is attached before it has processes (`POST /v1/training-jobs {"slurm_job": ID}`); its record is
"pending" until slurmstepd tracks processes of it on this node. From then on, every pass:
- the job's allocation is the effective cpuset of the cgroup holding all its steps (Slurm writes it);
  the agent's cores for it are chosen once, inside it;
- every step except `extern` is narrowed in place: the step's own cgroup gets the chosen cpus (Slurm
  re-widens only the job's cgroup at each step start, which the agent never writes, so there is no fight);
- every thread of the step's task processes (never slurmstepd or Slurm's other daemons; never a process
  whose real, effective or saved uid is not the job's user) runs SCHED_RR.
When slurmstepd tracks nothing of a job that was running, the job has ended: its cores go back.
The tasks stay in Slurm's cgroups, so its accounting and limits hold.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import psutil

from reamer.host import cgroups
from reamer.host.cgroups import CgroupDriver
from reamer.host.changes import ChangeLog
from reamer.host.errors import HostError
from reamer.host.executor import HostExecutor
from reamer.host.sched import ThreadGone
from reamer.host.slurm import EXTERN_STEP, SlurmStep, common_parent, job_steps, task_processes

log = logging.getLogger("reamer.slurm")

SOURCE = "slurm"
INFERENCE_KEY = "inference:"  # observations of Slurm jobs that placed inference jobs


@dataclass(frozen=True)
class SlurmObservation:
    """What one look at the node found of a Slurm job (gathered outside the agent's lock)."""

    job_id: int
    steps: list[SlurmStep] | None  # None: slurmstepd tracks nothing of it here (not started, or ended)
    allocation: list[int]  # cpus Slurm gave the job on this node ([] while it has no processes)
    error: str = ""  # scontrol could not be asked
    job_cgroup: str = ""  # the cgroup holding all its steps (Slurm's; never written)


def observe(job_id: int, driver: CgroupDriver, proc_root: str = "/proc") -> SlurmObservation:
    controller = "cpuset" if driver.version == 1 else ""
    try:
        steps = job_steps(job_id, controller, proc_root)
    except HostError as error:
        return SlurmObservation(job_id, None, [], error=f"{error.message} ({error.fix})")
    if not steps:
        return SlurmObservation(job_id, None, [])
    holder = common_parent([s.cgroup for s in steps])
    if len(steps) == 1 and "/" in holder:  # only one step so far: the job's cgroup is the one above it
        holder = holder.rsplit("/", 1)[0]
    try:
        allocation = cgroups.read_cpuset_effective(driver, holder)
    except HostError:
        allocation = []
    return SlurmObservation(job_id, steps, allocation, job_cgroup=holder)


def narrowing_target(driver: CgroupDriver, step_cgroup: str, job_cgroup: str) -> str:
    """The cgroup to narrow for a step: its tasks' own, or (cgroup v2, where Slurm enables cpuset only down to
    the step) the nearest ancestor below the job's cgroup that has cpuset.cpus."""
    path = step_cgroup
    while path and path != job_cgroup and "/" in path:
        if (cgroups.cpuset_dir(driver, path) / "cpuset.cpus").exists():
            return path
        path = path.rsplit("/", 1)[0]
    return step_cgroup


def pinned_steps(doc: dict[str, Any]) -> dict[str, str]:
    """{step: cgroup} of the steps the agent has narrowed."""
    return doc.setdefault("steps", {})


def pin_steps(doc: dict[str, Any], seen: SlurmObservation, change_log: ChangeLog, proc_root: str = "/proc"
              ) -> tuple[int, list[str]]:
    """Narrow every new step's cgroup to the job's cpus and make its task threads SCHED_RR (again, for threads
    that appeared since). Returns (threads made RR this pass, problems)."""
    cpus, priority, user = doc["cpus"], doc["priority"], doc.get("slurm_uid")
    steps = pinned_steps(doc)
    made_rr, problems = 0, []
    for step in seen.steps or []:
        if step.step == EXTERN_STEP:
            continue
        if step.step not in steps:
            target = narrowing_target(change_log.driver, step.cgroup, seen.job_cgroup)
            try:
                if sorted(cgroups.read_cpuset_effective(change_log.driver, target)) != sorted(cpus):
                    change_log.set_cpuset(target, cpus)
                steps[step.step] = target
            except HostError as error:
                problems.append(f"step {step.step}: {error.message}")
                continue
        for pid in task_processes(list(step.pids), proc_root):
            if not _runs_as(pid, user):
                continue
            made_rr += _make_rr(change_log.host, pid, priority, problems)
    return made_rr, problems


def demote(doc: dict[str, Any], seen: SlurmObservation, host: HostExecutor, proc_root: str = "/proc") -> int:
    """Every SCHED_RR thread of the job's task processes back to SCHED_OTHER."""
    demoted = 0
    for step in seen.steps or []:
        for pid in task_processes(list(step.pids), proc_root):
            for tid in _threads(host, pid):
                try:
                    if host.policy_of(tid)[0] in ("rr", "fifo"):
                        host.set_other(tid)
                        demoted += 1
                except ThreadGone:
                    continue
    return demoted


def job_user(seen: SlurmObservation) -> int | None:
    """The job's user: the real uid of its task processes, when they agree (None: none seen yet)."""
    uids = set()
    for step in seen.steps or []:
        if step.step == EXTERN_STEP:
            continue
        for pid in step.pids:
            try:
                uids.add(psutil.Process(pid).uids().real)
            except psutil.Error:
                continue
    return uids.pop() if len(uids) == 1 else None


def _runs_as(pid: int, uid: int | None) -> bool:
    """Whether every uid (real, effective, saved) of `pid` is `uid` (a setuid program is never made RT)."""
    if uid is None:
        return False
    try:
        return set(psutil.Process(pid).uids()) == {uid}
    except psutil.Error:
        return False


def _threads(host: HostExecutor, pid: int) -> list[int]:
    try:
        return host.threads_of(pid)
    except ThreadGone:
        return []


def _policy(host: HostExecutor, tid: int) -> str:
    try:
        return host.policy_of(tid)[0]
    except ThreadGone:
        return ""


def _make_rr(host: HostExecutor, pid: int, priority: int, problems: list[str]) -> int:
    made = 0
    for tid in _threads(host, pid):
        try:
            if host.policy_of(tid) == ("rr", priority):
                continue
            host.set_rr(tid, priority)
            made += 1
        except ThreadGone:
            continue
        except HostError as error:
            problems.append(error.message)
            break
    return made


class SlurmTraining:
    """The agent's Slurm jobs: attach before they run, follow them each pass, give their cores back at the end.

    Works on the Agent's own tables (its lock, store, core table, events); the Agent calls `observe_all`
    outside its lock (scontrol and /proc reads) and `apply` under it."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.logs: dict[str, ChangeLog] = {}
        self.last_seen: dict[str, SlurmObservation] = {}

    @property
    def host(self) -> HostExecutor:
        """The agent's host executor (its training pinner's): every change to a Slurm job goes through it."""
        return self.agent.pinner.host

    def jobs(self) -> dict[str, dict[str, Any]]:
        return {n: d for n, d in self.agent.training.items() if d.get("source") == SOURCE}

    # --- API ---

    def attach(self, req: dict[str, Any], caller: Any) -> dict[str, Any]:
        from reamer.agent.policy import Forbidden

        agent = self.agent
        if not caller.is_admin:
            raise Forbidden("slurm_job", "only root and the admin group hand Slurm jobs to reamer (the Prolog runs "
                                         "as root)", "attach from the node's Slurm Prolog (contrib/slurm), or give "
                                                     "your own processes with pids/cgroup")
        name, job_id = req["name"], int(req["slurm_job"])
        priority = agent.training_priority(req, caller)
        with agent._lock:
            agent.check_new_training(name)
            doc = {"name": name, "pids": [], "cpus": [], "priority": priority, "source": SOURCE,
                   "source_ref": str(job_id), "slurm_job": job_id, "cores_wanted": req.get("cores"),
                   "state": "pending", "created_at": time.time(), "changes": [], "demoted": False,
                   "owner_uid": caller.uid, "steps": {}, "message": "waiting for the Slurm job's steps to start"}
            agent.store.put_job("training", name, doc)
            agent.training[name] = doc
            agent.events.emit("training_pending", f"{name}: Slurm job {job_id} is pending until its steps run",
                              job=name, data={"slurm_job": job_id})
            view = agent._training_view(name)
        agent.wake()
        return view

    def detach(self, name: str) -> int:
        """Under the agent's lock: demote the job's task threads, undo its cpusets, forget it. Returns threads
        demoted."""
        doc = self.agent.training[name]
        seen = self.last_seen.pop(name, None)
        demoted = demote(doc, seen, self.host) if seen is not None else 0
        self._forget(name)
        return demoted

    def demote_all(self, names: list[str]) -> int:
        return sum(demote(self.jobs()[n], self.last_seen[n], self.host) for n in names
                   if n in self.jobs() and n in self.last_seen)

    # --- the pass ---

    def observe_all(self) -> dict[str, SlurmObservation]:
        """Training jobs by name, inference jobs Slurm placed by INFERENCE_KEY + name."""
        with self.agent._lock:
            wanted = {n: int(d["slurm_job"]) for n, d in self.jobs().items()}
            wanted.update({INFERENCE_KEY + n: r.slurm_job for n, r in self.agent.supervisor.records.items()
                           if r.slurm_job is not None})
        return {n: observe(job_id, self.agent.driver, self.agent.proc_root) for n, job_id in wanted.items()}

    def ended_inference(self, observed: dict[str, SlurmObservation]) -> list[str]:
        """Inference jobs whose Slurm job no longer runs here."""
        return [key[len(INFERENCE_KEY):] for key, seen in observed.items()
                if key.startswith(INFERENCE_KEY) and seen.steps is None and not seen.error
                and key[len(INFERENCE_KEY):] in self.agent.supervisor.records]

    def scope_inference(self, rec: Any, job_id: int, caller: Any) -> None:
        """An inference job deployed from inside Slurm job `job_id`: it may use only that job's cpus here.
        Refused unless the job runs on this node and the caller is its user (or an admin)."""
        from reamer.agent.errors import InvalidRequest
        from reamer.agent.policy import Forbidden

        seen = observe(job_id, self.agent.driver, self.agent.proc_root)
        if seen.steps is None or not seen.allocation:
            raise InvalidRequest(f"Slurm job {job_id} has no processes on this node"
                                 + (f" ({seen.error})" if seen.error else ""),
                                 "deploy from inside the Slurm job (its batch script), on the node it runs on")
        if not caller.is_admin and job_user(seen) != caller.uid:
            raise Forbidden("job_owner", f"Slurm job {job_id} is not yours", "deploy from inside your own Slurm job")
        allowed = sorted(set(seen.allocation) - set(self.agent.cores.reserved))
        if not allowed:
            raise InvalidRequest(f"Slurm job {job_id}'s cpus {seen.allocation} are all reserved for housekeeping",
                                 "ask Slurm for other cpus (or fewer reserved_cpus in reamer's config)")
        rec.slurm_job, rec.allowed_cpus = job_id, allowed

    def apply(self, observed: dict[str, SlurmObservation]) -> list[str]:
        """Under the agent's lock: pin what appeared; returns the jobs that ended (their processes are gone)."""
        ended = []
        for name, doc in self.jobs().items():
            seen = observed.get(name)
            if seen is None:
                continue  # attached after this pass looked
            if seen.error:
                self._say(doc, seen.error)
                continue
            if seen.steps is None:
                if doc["state"] == "running":
                    ended.append(name)
                continue
            self.last_seen[name] = seen
            if not doc["cpus"] and not self._place(name, doc, seen):
                continue
            if doc.get("demoted") or self.agent.rt_disabled:
                continue
            before = set(pinned_steps(doc))
            made, problems = pin_steps(doc, seen, self._log(name, doc), self.agent.proc_root)
            for step in sorted(set(pinned_steps(doc)) - before):
                self.agent.events.emit("training_step_attached", f"{name}: step {step} on cpus {doc['cpus']}",
                                       job=name, data={"step": step, "cgroup": doc["steps"][step]})
            self._say(doc, "; ".join(problems))
            if made or set(pinned_steps(doc)) != before:
                self.agent.store.put_job("training", name, doc)
        return ended

    def end(self, name: str) -> None:
        """The job's processes are gone: undo what is left and give the cores back (the Agent emits the event)."""
        self.last_seen.pop(name, None)
        self._forget(name)

    def view(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The Slurm-specific part of a training job's view."""
        seen = self.last_seen.get(doc["name"])
        pids = sorted({p for s in (seen.steps or []) for p in s.pids if s.step != EXTERN_STEP}) if seen else []
        threads = [tid for pid in task_processes(pids, self.agent.proc_root) for tid in _threads(self.host, pid)]
        rr = sum(1 for tid in threads if _policy(self.host, tid) in ("rr", "fifo"))
        return {"state": doc["state"], "pids": pids, "message": doc.get("message", ""), "threads": len(threads),
                "threads_rr": rr,
                "steps": [{"id": step, "cgroup": cgroup} for step, cgroup in sorted(pinned_steps(doc).items())],
                "scheduler": {"kind": "slurm", "job_id": doc["slurm_job"],
                              "allocated_cpus": seen.allocation if seen else []}}

    # --- helpers ---

    def _place(self, name: str, doc: dict[str, Any], seen: SlurmObservation) -> bool:
        from reamer.plan.coretable import AllocationError

        agent = self.agent
        allowed = set(seen.allocation) - set(agent.cores.reserved)
        whole = [core for core in agent.cores.free_cores() if allowed.issuperset(core)]
        cores = doc.get("cores_wanted") or max(1, len(whole))
        try:
            cpus = agent.cores.allocate(name, cores, within=seen.allocation)
        except AllocationError as error:
            self._say(doc, f"{error.message}; fix: {error.fix}")
            return False
        doc.update(cpus=list(cpus), state="running", slurm_uid=job_user(seen), message="")
        agent.store.put_job("training", name, doc)
        agent.events.emit("training_attached", f"{name}: Slurm job {doc['slurm_job']} on cpus {list(cpus)} (inside "
                          f"its allocation {seen.allocation}), its tasks SCHED_RR at priority {doc['priority']}",
                          job=name, data={"cpus": list(cpus), "slurm_job": doc["slurm_job"]})
        agent._replan()
        return True

    def _log(self, name: str, doc: dict[str, Any]) -> ChangeLog:
        if name not in self.logs:
            self.logs[name] = ChangeLog(self.host, self.agent._save_changes(doc), changes=doc.get("changes"))
        return self.logs[name]

    def _forget(self, name: str) -> None:
        doc = self.agent.training[name]
        problems = self._log(name, doc).undo()  # steps that ended took their cgroups along: nothing to undo
        if problems:
            log.info("undoing the cpusets of %s: %s", name, "; ".join(problems))
        self.logs.pop(name, None)
        self.agent.cores.release(name)

    def _say(self, doc: dict[str, Any], message: str) -> None:
        if message != doc.get("message", ""):
            doc["message"] = message
            self.agent.store.put_job("training", doc["name"], doc)
            if message:
                self.agent.events.emit("training_slurm_problem", f"{doc['name']}: {message}", job=doc["name"])
