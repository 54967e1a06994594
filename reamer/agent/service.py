"""The Agent: desired state (store) -> host (cgroups, SCHED_RR, inference processes), and the reconcile loop.

One lock guards the agent's state and the short host operations; waits (inference leaving cores,
job processes stopping, a layout search) happen outside it. Every change is written to the store
before it is applied, so a restarted agent re-attaches to what it had promised.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil

import reamer
from reamer.agent.config import AgentConfig
from reamer.agent.errors import Conflict, InvalidRequest, NotFound
from reamer.agent.events import Event, EventLog
from reamer.agent.inference import (InferenceRecord, InferenceSupervisor, apply_choice, choose_for, free_port,
                                    validate_request)
from reamer.agent.memory_guard import InferenceMemoryGuard
from reamer.agent.policy import (AGENT, Caller, SecurityRules, check_cgroup, check_job_owner, check_priority,
                                 check_processes)
from reamer.agent.scheduler_api import Capacity, CapacityTracker, admit_training
from reamer.agent.slurm_jobs import SOURCE as SLURM_SOURCE, SlurmTraining
from reamer.agent.k8s_jobs import SOURCE as K8S_SOURCE, K8sTraining
from reamer.agent.store import Store
from reamer.agent.training import (Placement, PinState, ProcessGate, RtThrottlingDisabled, TrainingPinner,
                                   job_processes)
from reamer.host.cgroups import CgroupDriver
from reamer.host.access import Identity, can_access, identity_named, identity_of
from reamer.host.errors import HostError, ReamerError
from reamer.host.identity import ProcessFacts, pid_max, process_facts
from reamer.host.sched import rt_throttling
from reamer.host.executor import HostExecutor
from reamer.host.topology import Topology
from reamer.plan.coretable import AllocationError, CoreTable
from reamer.search.chooser import LayoutChooser
from reamer.serve.job_channel import read_channels
from reamer.serve.deploy_check import DeployCheck

log = logging.getLogger("reamer.agent")

HEALTHY_RECONCILE_AGE_S = 15.0
MIN_CHECK_MEMORY_MB = 512.0  # the least a deploy check gets (Python, onnx and a runtime opening a model)


@dataclass
class AgentParts:
    """Everything the Agent holds, built by the composition root (reamer.node.build_parts, in its start order)."""

    topology: Topology
    host: HostExecutor  # the one executor of host changes (training and the memory guard share it)
    store: Store
    events: EventLog
    cores: CoreTable
    pinner: TrainingPinner
    supervisor: InferenceSupervisor
    memory: InferenceMemoryGuard
    choose_layout: LayoutChooser
    profile_dir: str
    gpu: Any = None  # the GPU manager (reamer.gpu.manager), or None with gpu_message saying why
    gpu_message: str = ""


class Agent:
    def __init__(self, config: AgentConfig, parts: AgentParts) -> None:
        self.config = config
        self.proc_root = parts.host.proc_root
        sec = config.security
        self.rules = SecurityRules(tuple(sec.allowed_cgroup_prefixes), tuple(sec.protected_cgroups),
                                   sec.max_rt_priority)
        self.started_at = time.time()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_reconcile: float = 0.0
        self._last_gpu_tick: float = float("-inf")  # time.monotonic() of the last GPU sample
        self.on_reconcile: list[Callable[[float], None]] = []  # called with the pass duration (metrics, watchdog)
        self.topology = parts.topology
        self.host = parts.host
        self.driver: CgroupDriver = parts.host.driver
        self.cores = parts.cores
        self.store = parts.store
        self.events = parts.events
        self.pinner = parts.pinner
        self.supervisor = parts.supervisor
        self.supervisor.save = self._save_inference
        self.memory = parts.memory
        self.profile_dir = parts.profile_dir
        self.choose_layout: LayoutChooser = parts.choose_layout
        self.gpu = parts.gpu
        self.gpu_message = parts.gpu_message
        self.training: dict[str, dict[str, Any]] = {}
        self._pin_state: dict[str, PinState] = {}
        self.rt_disabled = False
        self._conflicts: dict[str, str] = {}  # training job -> another manager's cpuset change, as reported
        self.slurm = SlurmTraining(self)  # training jobs a Slurm Prolog handed over (followed step by step)
        self.k8s = K8sTraining(self)  # Kubernetes containers the NRI plugin handed over before they run
        self.capacity_tracker = CapacityTracker()  # spare capacity for schedulers (GET /v1/capacity)

    # ------------------------------------------------------------------------------- lifecycle

    def start(self, run_loop: bool = True) -> None:
        """Set up cgroups, restore jobs from the store, re-attach to running processes, start reconciling."""
        self.pinner.setup()  # refuses when RT throttling is off
        Path(self.config.run_dir).mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._restore()
            self._start_gpu()
            self._replan()
        self.events.emit("agent_started", f"agent started (pid {os.getpid()}): {len(self.training)} training and "
                         f"{len(self.supervisor.records)} inference job(s) restored")
        if run_loop:
            self._thread = threading.Thread(target=self._loop, name="reamer-reconcile", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop reconciling. Training stays pinned and inference keeps running: they do not need the agent."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self.supervisor.close()
            if self.gpu is not None:
                try:
                    self.gpu.close()
                except Exception:  # noqa: BLE001 - shutting down anyway
                    log.exception("closing the GPU manager failed")
            released = 0
            try:
                released = self.pinner.release_budgets()  # v1 RT group scheduling only: held only while running
            except ReamerError as exc:
                log.error("giving back the training RT budget: %s", exc)
            self.events.emit("agent_stopped", "agent stopped; training stays pinned, inference keeps running"
                             + (f"; RT budget of {released} training job(s) given back: their threads run "
                                "SCHED_OTHER until the agent starts again" if released else ""))
            self.store.close()

    def _restore(self) -> None:
        for name, doc in self.store.jobs("training").items():
            if doc.get("source") == SLURM_SOURCE or self.k8s.pending_doc(doc):  # followed again from the next pass on
                if doc["cpus"]:
                    self.cores.restore(name, doc["cpus"])
                self.training[name] = doc
                continue
            self._restore_pinning(name, doc)
            if doc.get("state") == "attaching":  # the agent died mid-attach: undo it from its record
                self._undo_unfinished_attach(name, doc)
                continue
            try:
                self.cores.restore(name, doc["cpus"])
            except AllocationError as exc:
                log.error("cannot restore training job %s: %s", name, exc)
                self.events.emit("training_restore_failed", f"{name}: {exc}", job=name)
                continue
            doc["state"] = "running"
            self.training[name] = doc
        for name, doc in self.store.jobs("inference").items():
            self.supervisor.adopt(InferenceRecord.from_doc(doc))
        self._reconcile_training()

    def _save_changes(self, doc: dict[str, Any]) -> Callable[[list[dict[str, Any]]], None]:
        def save(changes: list[dict[str, Any]]) -> None:
            doc["changes"] = changes
            self.store.put_job("training", doc["name"], doc)
        return save

    def _restore_pinning(self, name: str, doc: dict[str, Any]) -> None:
        placement = doc.get("placement") or {"mode": "own", "cpuset_path": self.pinner.own_path(name)}
        self.pinner.placements[name] = Placement.from_doc(placement)
        self.pinner.new_log(name, self._save_changes(doc), doc.get("changes") or [])

    def _undo_unfinished_attach(self, name: str, doc: dict[str, Any]) -> None:
        try:
            self.pinner.detach(name)
        except ReamerError as exc:
            log.error("undoing the unfinished attach of %s: %s", name, exc)
        self.store.delete_job("training", name)
        self.events.emit("training_attach_undone", f"{name}: the agent stopped while attaching it; every change "
                         "it had made is undone", job=name, data={"changes": len(doc.get("changes") or [])})

    def _start_gpu(self) -> None:
        """Start the GPU manager the composition root built (or was given): the agent owns it, stop() closes it."""
        if self.gpu is not None and not getattr(self.gpu, "_started", True):
            try:
                self.gpu.start()
            except Exception as exc:  # noqa: BLE001 - the agent must run on machines without GPUs
                self.gpu_message = f"GPU manager not started: {exc}"
                log.warning(self.gpu_message)

    # ------------------------------------------------------------------------------- reconcile

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.config.reconcile_interval_s)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("reconcile pass failed")

    def wake(self) -> None:
        """Reconcile now rather than at the next tick."""
        self._wake.set()

    def reconcile(self) -> None:
        started = time.monotonic()
        with self._lock:
            requests = self.supervisor.read_requests()
        # What jobs wrote (status, events) is read outside the lock: those files are their users' to make a
        # FIFO, a flood or anything else of, and the API must answer meanwhile (serve.job_channel).
        reads = read_channels(requests)
        slurm_jobs = self.slurm.observe_all()  # scontrol and /proc, outside the lock too
        self.k8s.apply(self.k8s.observe_all())  # pending Kubernetes containers that run now: pinned in place
        with self._lock:
            self._check_rt_throttling()
            ended = self._reconcile_training()
            for name in ended:
                self._end_training(name, "all its processes exited")
            for name in self.slurm.apply(slurm_jobs):
                self._end_training(name, "the Slurm job ended on this node")
            for name in self.slurm.ended_inference(slurm_jobs):  # removed as a caller would, outside this pass
                threading.Thread(target=self._remove_ended_inference, args=(name,), daemon=True).start()
            self.supervisor.tick(reads)
            self._replan()
            self.memory.apply(self.supervisor.records.values())
            self._report_capacity()
        # The GPU manager is thread-safe and its tick runs MPS control commands (up to
        # gpu.command_timeout_s each): outside the agent lock, so a slow MPS daemon never stalls the API.
        # Paced by gpu.sample_interval_s, not by the (usually faster) reconcile interval.
        if self.gpu is not None and started - self._last_gpu_tick >= self.gpu.config.sample_interval_s:
            self._last_gpu_tick = started
            try:
                self.gpu.tick()
            except Exception:  # noqa: BLE001
                log.exception("GPU tick failed")
        self.last_reconcile = time.time()
        duration = time.monotonic() - started
        for callback in self.on_reconcile:
            callback(duration)

    def _check_rt_throttling(self) -> None:
        allowed = rt_throttling(self.proc_root)[0] != -1
        if not allowed and not self.rt_disabled:
            self.rt_disabled = True
            demoted = self.pinner.demote_all()
            self.events.emit("rt_throttling_disabled",
                             f"RT throttling was turned off: demoted {demoted} training thread(s) to SCHED_OTHER; "
                             "fix: sysctl -w kernel.sched_rt_runtime_us=950000", data={"demoted": demoted})
        elif allowed and self.rt_disabled:
            self.rt_disabled = False
            self.events.emit("rt_throttling_enabled", "RT throttling is on again: training threads go back to SCHED_RR")

    def _reconcile_training(self) -> list[str]:
        ended = []
        for name, doc in list(self.training.items()):
            if doc.get("state") != "running" or doc.get("source") == SLURM_SOURCE:
                continue
            placement = self.pinner.placements.get(name)
            owner_uid = int(doc.get("owner_uid", 0))
            if placement is not None and placement.owner_uid != owner_uid:  # a record from before owners were kept
                placement.owner_uid, placement.privileged = owner_uid, owner_uid == 0
            try:
                state = self.pinner.reconcile(name, doc["cpus"], doc["priority"],
                                              make_rr=not (self.rt_disabled or doc.get("demoted")))
            except HostError as exc:
                log.warning("reconcile of training job %s failed: %s", name, exc)
                continue
            self._pin_state[name] = state
            self._note_conflict(name, doc, state.conflict)
            self._note_refused(name, state)
            if not state.alive:
                ended.append(name)
            elif state.fixed:
                self.events.emit("training_threads_fixed",
                                 f"{name}: made {state.fixed} new thread(s) SCHED_RR", job=name,
                                 data={"fixed": state.fixed})
        return ended

    def _note_refused(self, name: str, state: PinState) -> None:
        """One event per thread of a job that the policy refused RT (once per thread, not per pass)."""
        for reason in state.refused:
            self.events.emit("training_thread_refused", f"{name}: {reason}"
                             + (" (it was RT: demoted to SCHED_OTHER)" if state.demoted else ""), job=name,
                             data={"demoted": state.demoted})

    def _note_conflict(self, name: str, doc: dict[str, Any], conflict: str) -> None:
        """Report another manager's cpuset once per change it makes (reamer does not fight it)."""
        if conflict == self._conflicts.get(name, ""):
            return
        self._conflicts[name] = conflict
        doc["conflict"] = conflict
        self.store.put_job("training", name, doc)
        if conflict:
            self.events.emit("training_cpuset_conflict", f"{name}: {conflict}", job=name, data={"cpus": doc["cpus"]})
        else:
            self.events.emit("training_cpuset_conflict_resolved", f"{name}: its cpuset is the job's cpus again",
                             job=name)

    def _replan(self) -> dict[str, str]:
        return self.supervisor.replan(self.cores.idle_cpus(), self.cores.training_cpus())

    # ------------------------------------------------------------------------------- training

    def _check_pids(self, pids: list[int], caller: Caller) -> list[int]:
        """Sorted distinct pids, each in range and running, and every one of them and of their
        descendants a process the caller may touch (policy)."""
        return self._checked_pids(pids, caller)[0]

    def _checked_pids(self, pids: list[int], caller: Caller) -> tuple[list[int], list[ProcessFacts]]:
        """_check_pids, and the facts checked (each process's identity: pid and start time)."""
        limit = pid_max(self.proc_root)
        pids = sorted(set(int(p) for p in pids))
        for pid in pids:
            if not 0 < pid <= limit:
                raise InvalidRequest(f"pid {pid} is out of range (1..{limit})", "give the pids of running processes")
            if not psutil.pid_exists(pid):
                raise InvalidRequest(f"process {pid} does not exist",
                                     "give the pids of running processes (see `ps -ef`)")
        return pids, self._check_processes(pids, caller)

    def _check_processes(self, pids: list[int], caller: Caller) -> list[ProcessFacts]:
        """The policy's verdict on the processes and all their descendants; returns what it checked (the
        identities every later step compares with)."""
        facts = [process_facts(p, self.proc_root) for p in job_processes(pids) or pids]
        check_processes(caller, facts, os.getpid(), self.rules)
        return [f for f in facts if not f.gone]

    def _resolve_pids(self, req: dict[str, Any],
                      caller: Caller) -> tuple[list[int], str, str, int | None, list[ProcessFacts]]:
        """(pids, source, source reference, cores the source asks for, the facts checked); the policy has
        seen every process."""
        if req.get("pids"):
            pids, checked = self._checked_pids(req["pids"], caller)
            return pids, "pids", ",".join(map(str, pids)), None, checked
        if req.get("cgroup"):
            path = check_cgroup(caller, req["cgroup"], self.rules)
            pids = []
            for controller in ("cpu", "cpuset"):
                try:
                    pids = self.driver.processes(path, controller)
                except HostError:
                    continue
                if pids:
                    break
            if not pids:
                raise InvalidRequest(f"cgroup {req['cgroup']!r} has no processes (or does not exist)",
                                     "give the cgroup path of the running training job, relative to the "
                                     f"hierarchy root {self.config.cgroup_root}")
            checked = self._check_processes(pids, caller)
            return pids, "cgroup", path, None, checked
        from reamer.host.container import resolve_container

        info = resolve_container(req["container"], proc_root=self.proc_root, cgroup_root=self.config.cgroup_root,
                                 driver=self.driver)
        checked = self._check_processes(info.pids, caller)
        return info.pids, "container", info.id, info.cpus_wanted, checked

    def attach_training(self, req: dict[str, Any], caller: Caller = AGENT) -> dict[str, Any]:
        if req.get("slurm_job") is not None:
            return self.slurm.attach(req, caller)
        if req.get("k8s_container") is not None:
            return self.k8s.attach(req, caller)
        with contextlib.ExitStack() as held:  # the checked processes' pidfds, until the attach is over
            return self._attach_training(req, caller, held)

    def training_priority(self, req: dict[str, Any], caller: Caller) -> int:
        """The priority a new training job asks for (or the config's), within the caller's cap."""
        priority = req.get("priority") or self.config.training.priority
        check_priority(caller, priority, self.rules)
        return priority

    def record_new_training(self, name: str, cores: int, doc: dict[str, Any]) -> list[int]:
        """Take `cores` whole cores for a new training job and record `doc` with them, all or nothing (the cores go
        back when the store refuses). Under the agent's lock; attaches and Kubernetes reservations start this way."""
        cpus = list(self.cores.allocate(name, cores))
        doc["cpus"] = cpus
        try:
            self.store.put_job("training", name, doc)
        except ReamerError:
            self.cores.release(name)
            raise
        self.training[name] = doc
        return cpus

    def check_new_training(self, name: str) -> None:
        """Under the lock: a new training job `name` may be attached now."""
        if name in self.training:
            raise Conflict(f"training job {name!r} is already attached", "detach it first, or use another name")
        if self.rt_disabled:
            raise RtThrottlingDisabled()

    def _attach_training(self, req: dict[str, Any], caller: Caller, held: contextlib.ExitStack) -> dict[str, Any]:
        name = req["name"]
        priority = self.training_priority(req, caller)
        with self._lock:
            self.check_new_training(name)
            pids, source, ref, wanted, checked = self._resolve_pids(req, caller)
            gate = held.enter_context(ProcessGate(caller, checked, os.getpid(), self.proc_root))
            taken = {p for doc in self.training.values() for p in self._pin_state.get(doc["name"], PinState()).pids}
            if taken & set(pids):
                raise Conflict(f"process(es) {sorted(taken & set(pids))} already belong to another training job",
                               "detach that job first")
            self.pinner.check_rt_possible()
            placement = self.pinner.place(name, source, pids, ref)
            placement.owner_uid, placement.privileged = caller.uid, caller.is_admin
            self.pinner.check_budget(name, placement)  # before inference leaves the cores for it
            doc = {"name": name, "pids": pids, "priority": priority, "source": source,
                   "source_ref": ref, "state": "attaching", "created_at": time.time(),
                   "placement": placement.to_doc(), "changes": [], "demoted": False, "owner_uid": caller.uid,
                   "owner_admin": caller.is_admin}
            cpus = self.record_new_training(name, req.get("cores") or wanted or 1, doc)
            before = {n: r.pid for n, r in self.supervisor.records.items()}
            changes = self._replan()
        # Inference leaves the cores before training is pinned there. The processes may change meanwhile:
        # the pinner re-checks each one (identity, then policy) right before it is pinned.
        if not self.supervisor.wait_left(changes, before):
            log.warning("some inference processes had not left cpus %s in time; pinning training anyway", cpus)
        with self._lock:
            try:
                state = self.pinner.attach(name, placement, pids, cpus, priority,
                                           self.pinner.new_log(name, self._save_changes(doc)), gate=gate)
            except BaseException:
                self._rollback_attach(name)
                raise
            doc.update(state="running")
            self.store.put_job("training", name, doc)
            self._pin_state[name] = state
            self._note_refused(name, state)
            self.events.emit("training_attached",
                             f"{name}: cpus {cpus}, {state.threads_rr} thread(s) SCHED_RR at priority {priority}",
                             job=name, data={"cpus": cpus, "pids": state.pids, "priority": priority})
            return self._training_view(name)

    def _rollback_attach(self, name: str) -> None:
        # pinner.attach has undone its changes already; this forgets the job
        self.training.pop(name, None)
        self._pin_state.pop(name, None)
        self.cores.release(name)
        self.store.delete_job("training", name)
        self._replan()

    def detach_training(self, name: str, caller: Caller = AGENT) -> dict[str, Any]:
        with self._lock:
            doc = self._training_doc(name)
            check_job_owner(caller, "training", name, doc.get("owner_uid", 0))
            if doc.get("state") == "attaching":
                raise Conflict(f"training job {name!r} is still being attached", "retry in a few seconds")
            view = self._training_view(name)
            if doc.get("source") == SLURM_SOURCE:
                demoted = self.slurm.detach(name)
            elif self.k8s.is_pending(name):
                demoted = 0  # nothing pinned yet: only its cores go back
            else:
                demoted = self.pinner.detach(name)  # undoes its record step by step: a crash meanwhile resumes it
            self.store.delete_job("training", name)
            self.training.pop(name)
            self._conflicts.pop(name, None)
            self._pin_state.pop(name, None)
            self.cores.release(name)
            self.events.emit("training_detached", f"{name}: {demoted} thread(s) back to SCHED_OTHER, "
                             f"cpus {doc['cpus']} free", job=name, data={"cpus": doc["cpus"]})
            self._replan()
        view.update(state="ended", threads_rr=0, message="detached")
        return view

    def _end_training(self, name: str, reason: str) -> None:
        if self.training[name].get("source") == SLURM_SOURCE:
            self.slurm.end(name)
        doc = self.training.pop(name)
        try:
            self.pinner.forget(name)
        except ReamerError as exc:
            log.warning("cleaning up after training job %s: %s", name, exc)
        self.store.delete_job("training", name)
        self._conflicts.pop(name, None)
        self._pin_state.pop(name, None)
        self.cores.release(name)
        self.events.emit("training_ended", f"{name}: {reason}; cpus {doc['cpus']} go back to inference",
                         job=name, data={"cpus": doc["cpus"]})

    def _training_doc(self, name: str) -> dict[str, Any]:
        doc = self.training.get(name)
        if doc is None:
            raise NotFound(f"no training job named {name!r}", "see `reamer train list`")
        return doc

    def _training_view(self, name: str) -> dict[str, Any]:
        doc = self.training[name]
        state = self._pin_state.get(name)
        message = ""
        if self.rt_disabled:
            message = "demoted: RT throttling is off (sysctl -w kernel.sched_rt_runtime_us=950000)"
        elif doc.get("demoted"):
            message = "demoted by demote-all: detach and attach again to restore SCHED_RR"
        if self._conflicts.get(name):
            message = (message + "; " if message else "") + "conflict: " + self._conflicts[name]
        view = {"name": name, "cpus": list(doc["cpus"]), "pids": state.pids if state else list(doc["pids"]),
                "threads_rr": state.threads_rr if state else 0, "threads": state.threads if state else 0,
                "priority": doc["priority"], "source": doc["source"], "state": "running",
                "created_at": doc["created_at"], "message": message, "owner_uid": doc.get("owner_uid", 0)}
        if doc["source"] == SLURM_SOURCE:
            slurm = self.slurm.view(doc)
            slurm["message"] = "; ".join(m for m in (message, slurm["message"]) if m)
            view.update(slurm)
        elif doc["source"] == K8S_SOURCE:
            view.update(self.k8s.view(doc))
        return view

    def list_training(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._training_view(n) for n in sorted(self.training)]

    def get_training(self, name: str) -> dict[str, Any]:
        with self._lock:
            self._training_doc(name)
            return self._training_view(name)

    def demote_all(self, caller: Caller = AGENT) -> dict[str, Any]:
        """Root: every training thread reamer made RT. Any other caller: the threads of its own jobs."""
        with self._lock:
            if caller.is_root:
                jobs = sorted(set(self.pinner.job_cgroups()) | set(self.training))
            else:
                jobs = sorted(n for n, d in self.training.items() if d.get("owner_uid", 0) == caller.uid)
            for name in jobs:
                doc = self.training.get(name)
                if doc is not None:
                    doc["demoted"] = True
                    self.store.put_job("training", name, doc)
            if caller.is_root:
                demoted = self.pinner.demote_all()
            else:
                demoted = sum(self.pinner.demote(name) for name in jobs
                              if self.training.get(name, {}).get("source") != SLURM_SOURCE)
            demoted += self.slurm.demote_all(jobs)
            self.events.emit("demoted_all", f"demoted {demoted} thread(s) to SCHED_OTHER (by uid {caller.uid})",
                             data={"jobs": jobs, "uid": caller.uid})
        return {"threads_demoted": demoted, "jobs": jobs,
                "message": "training keeps its cores but runs SCHED_OTHER until detached and attached again"}

    # ------------------------------------------------------------------------------- inference

    def _save_inference(self, rec: InferenceRecord) -> None:
        if rec.name in self.supervisor.records:
            self.store.put_job("inference", rec.name, rec.to_doc())

    def _online_free_cpus(self) -> list[int]:
        used = {c for r in self.supervisor.records.values() if r.kind == "online"
                for i in r.instances for c in i["cpus"]}
        return [c for c in self.cores.idle_cpus() if c not in used]

    def _job_identity(self, caller: Caller) -> Identity:
        """Whom a job runs as: the caller who deploys it; root's jobs as inference.run_as."""
        if caller.is_root:
            return identity_named(self.config.inference.run_as)
        return identity_of(caller.uid, caller.gid)

    def _check_paths_as(self, runner: Identity, req: dict[str, Any]) -> None:
        """Every file the job will open, checked with the rights of the user it runs as. A path that user
        cannot reach gets the same answer as one that does not exist (the agent tells no secrets).

        A missing output_dir is made here by that user (the job makes it too, at its start); for a job that
        runs as root nothing is made before the job starts: the check only asks whether it could be."""
        checks = (("model", "file", "read"), ("input_data", "file", "read"), ("input_dir", "dir", "list"),
                  ("output_dir", "output_dir", "create and write"))
        if runner.is_root:  # root reads everything: only whether output_dir can be made is a question
            checks = (("output_dir", "output_parent", "create"),)
        for key, kind, verb in checks:
            path = req.get(key)
            if not isinstance(path, str) or not os.path.isabs(path):
                continue  # absent, or relative: validate_request names that problem
            if not can_access(runner, path, kind):
                raise InvalidRequest(f"{key} {path} does not exist or {runner} cannot {verb} it",
                                     f"give a path {runner} can {verb} (the job runs as that user); check the "
                                     "permissions of the path and of every directory above it")

    def deploy_inference(self, req: dict[str, Any], caller: Caller = AGENT) -> dict[str, Any]:
        name = req["name"]
        self._check_layout_size(req.get("layout"))
        runner = self._job_identity(caller)
        self._check_paths_as(runner, req)  # outside the lock: it runs a command per path
        with self._lock:
            if name in self.supervisor.records:
                raise Conflict(f"inference job {name!r} already exists", "remove it first, or use another name")
        # The model and input_data are the user's files: a child process running as the job's user, within the
        # job's memory limit, opens and checks them (and a backend that cannot open the model is refused now,
        # with the runtime's reason). Without the lock: every other caller is answered meanwhile.
        check = self._deploy_check(runner, req.get("memory_limit_mb"))
        rec = validate_request(req, self.config.inference.default_backend, check)
        rec.owner_uid = caller.uid
        rec.memory_limit_mb = req.get("memory_limit_mb")
        rec.run_uid, rec.run_gid = runner.uid, runner.gid
        if req.get("slurm_job") is not None:
            self.slurm.scope_inference(rec, int(req["slurm_job"]), caller)
        # output_dir is made by the job itself, as its user, when it starts (and by the user's own access
        # check above): the agent never creates it, so no link can aim root's mkdir anywhere.
        if rec.kind == "online" and rec.layout is None:
            with self._lock:
                cpus = [c for c in self._online_free_cpus() if not rec.allowed_cpus or c in rec.allowed_cpus]
            from reamer.serve.measure.profiler import workers_run_as

            # the search runs the user's model and traffic: its workers too are the job user's processes
            with workers_run_as(check.runner, check.memory_mb):
                apply_choice(rec, choose_for(self.choose_layout, rec, cpus), cpus)
            if rec.layout is None:  # no search possible: one instance over all free cores
                rec.cores = max(1, len(cpus))
        with self._lock:
            if name in self.supervisor.records:
                raise Conflict(f"inference job {name!r} already exists", "remove it first, or use another name")
            if rec.kind == "online" and not rec.port:
                rec.port = free_port()
            while rec.kind == "online" and (not rec.grpc_port or rec.grpc_port == rec.port):
                rec.grpc_port = free_port()
            self.store.put_job("inference", name, rec.to_doc())
            self.supervisor.records[name] = rec
            self.events.emit("inference_deployed", f"{name} ({rec.kind}, {rec.backend}) deployed", job=name,
                             data={"layout": rec.layout, "port": rec.port, "grpc_port": rec.grpc_port})
            self._replan()
            self.memory.apply([rec])  # at once: the job's workers inherit its oom_score_adj and cgroup
            return self._inference_view(rec)

    def _deploy_check(self, runner: Identity, job_memory_mb: Any) -> DeployCheck:
        """The deploy check of a job that runs as `runner`: as that user, within the job's memory limit."""
        inference = self.config.inference
        if isinstance(job_memory_mb, (int, float)) and not isinstance(job_memory_mb, bool) and job_memory_mb > 0:
            memory_mb, source = float(job_memory_mb), "the job's memory_limit_mb"
        elif inference.memory_limit_mb:
            memory_mb, source = float(inference.memory_limit_mb), "inference.memory_limit_mb"
        else:
            memory_mb, source = float(inference.check_memory_mb), "inference.check_memory_mb"
        if memory_mb < MIN_CHECK_MEMORY_MB:  # too little for Python and a runtime to open any model: the
            # job's own cgroup limit still holds the job to it once it runs (and OOM-kills it there)
            memory_mb, source = MIN_CHECK_MEMORY_MB, f"the deploy check's floor ({source} is lower)"
        return DeployCheck(runner=runner, memory_mb=memory_mb, timeout_s=inference.check_timeout_s,
                           memory_source=source)

    def _check_layout_size(self, layout: str | None) -> None:
        """A layout may ask for at most the node's CPUs outside the reserved ones (checked while parsing,
        before it makes a single instance)."""
        if not layout:
            return
        from reamer.plan.layout import parse_layout

        usable = max(1, len(set(self.topology.cpu_ids()) - set(self.cores.reserved)))
        try:
            parse_layout(layout, max_cores=usable)
        except ValueError as exc:
            raise InvalidRequest(f"layout is invalid: {exc}",
                                 f'write it like "2x1:b4" (instances x cores : batch); this node has {usable} '
                                 "usable cpus") from None

    def remove_inference(self, name: str, caller: Caller = AGENT) -> dict[str, Any]:
        with self._lock:
            rec = self._inference_rec(name)
            check_job_owner(caller, "inference", name, rec.owner_uid)
            view = self._inference_view(rec)
            self.store.delete_job("inference", name)
            pid = self.supervisor.remove(name)
            self.events.emit("inference_removed", f"{name} removed", job=name)
        self.supervisor.wait_stopped(name, pid)
        self.memory.empty(name)  # whatever of it is left (workers, a hung process): killed, outside the lock
        with self._lock:
            self.supervisor.forget_process(name)
            self.memory.forget(name)
            self._replan()
        self.supervisor.remove_files(rec)  # its directory, now that nothing of it runs
        view.update(state="done", message="removed")
        return view

    def _remove_ended_inference(self, name: str) -> None:
        self.events.emit("inference_slurm_job_ended", f"{name}: the Slurm job that placed it ended; removing it",
                         job=name)
        try:
            self.remove_inference(name)
        except NotFound:
            pass  # removed meanwhile

    def _inference_rec(self, name: str) -> InferenceRecord:
        rec = self.supervisor.records.get(name)
        if rec is None:
            raise NotFound(f"no inference job named {name!r}", "see `reamer infer list`")
        return rec

    def _inference_view(self, rec: InferenceRecord) -> dict[str, Any]:
        status = self.supervisor.status_of(rec.name)
        fields = ("rate_rps", "p50_ms", "p99_ms", "slo_attainment", "done", "total", "throughput", "eta_s",
                  "frontdoor_busy", "frontdoor_cpu_ms", "batchable", "batchable_reason")
        status_doc = {k: getattr(status, k) for k in fields} if status is not None else {}
        message = rec.message or (status.message if status is not None else "")
        oom = self.memory.oom_note(rec.name)
        message = f"{message}; {oom}" if message and oom else (message or oom)
        return {"name": rec.name, "model": rec.model, "kind": rec.kind, "backend": rec.backend,
                "slo_ms": rec.slo_ms, "rate_rps": rec.rate_rps, "port": rec.port, "grpc_port": rec.grpc_port,
                "input_dir": rec.input_dir,
                "output_dir": rec.output_dir, "max_batch": rec.max_batch, "state": rec.state,
                "layout": rec.layout or _layout_of(rec.instances), "instances": [dict(i) for i in rec.instances],
                "pid": rec.pid if rec.state == "running" else None, "status": status_doc, "message": message,
                "created_at": rec.created_at, "owner_uid": rec.owner_uid,
                "run_uid": rec.run_uid, "memory_limit_mb": self.memory.limit_of(rec), "oom_kills": self.memory.jobs.get(rec.name).oom_kills
                if rec.name in self.memory.jobs else 0,
                "bind_address": (rec.bind_address or self.supervisor.bind_address) if rec.kind == "online" else None,
                "url": self.supervisor.url(rec), "grpc_target": self.supervisor.grpc_target(rec),
                "shapes": rec.shapes, "input_data": rec.input_data, "precision": rec.precision,
                "slurm_job": rec.slurm_job, "allowed_cpus": rec.allowed_cpus,
                "effective_precision": status.precision if status is not None else None,
                # online: the running process reports every instance ready, its front doors serving
                "ready": bool(rec.kind == "online" and rec.state == "running" and status is not None
                              and status.pid == rec.pid and status.state == "ready")}

    def list_inference(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._inference_view(r) for r in sorted(self.supervisor.records.values(), key=lambda r: r.name)]

    def get_inference(self, name: str) -> dict[str, Any]:
        with self._lock:
            return self._inference_view(self._inference_rec(name))

    # ------------------------------------------------------------------------------- node, events, gpu

    def capacity(self) -> dict[str, Any]:
        with self._lock:
            return self._capacity()[0].to_doc()

    def _capacity(self) -> tuple[Capacity, bool]:
        online = {c for r in self.supervisor.records.values() if r.kind == "online" and r.state == "running"
                  for i in r.instances for c in i["cpus"]}
        return self.capacity_tracker.compute(self.cores, online)

    def _report_capacity(self) -> None:
        """Once a pass: a `capacity_changed` event whenever spare cores or batch capacity changed."""
        self.capacity_tracker.sample()
        capacity, changed = self._capacity()
        if changed:
            self.events.emit("capacity_changed", f"spare cores {capacity.spare_cores}, batch capacity "
                             f"{capacity.offline_capacity_cores:.1f} core(s)", data=capacity.to_doc())

    def admit_training_dry(self, req: dict[str, Any]) -> dict[str, Any]:
        """Could this node take a training job of `cores` (inside `allocated_cpus`)? Nothing changes."""
        with self._lock:
            return admit_training(self.cores, self.supervisor, int(req["cores"]), req.get("allocated_cpus")).to_doc()

    def admit_inference_dry(self, req: dict[str, Any]) -> dict[str, Any]:
        """Could this node serve `rate_rps` of `model` within `slo_ms` on its free cores, and with which layout?
        Answered from cached profiles (`reamer search MODEL` fills them); nothing is measured or changed."""
        from reamer.agent.inference import InferenceRecord
        from reamer.search.chooser import LayoutChoice, ProfileCacheChooser

        with self._lock:
            cpus = self._online_free_cpus()
        rec = InferenceRecord(name="\0dry-run", model=req["model"], kind="online",
                              backend=req.get("backend") or self.config.inference.default_backend,
                              slo_ms=req["slo_ms"], rate_rps=req.get("rate_rps"), max_batch=req.get("max_batch"),
                              shapes=req.get("shapes") or {})
        chooser = self.choose_layout
        if isinstance(chooser, ProfileCacheChooser):
            chooser = ProfileCacheChooser(chooser.profile_dir, search=None, margin=chooser.margin)
        choice = choose_for(chooser, rec, cpus) if cpus else LayoutChoice(None, False, 0.0, "no free cores")
        if choice is None:
            return {"admit": None, "achievable_rps": None, "layout": None, "cores_free": len(cpus),
                    "reason": f"no cached profile of {rec.model} covers the {len(cpus)} free core(s); run "
                              "`reamer search MODEL --cores N` on this node first"}
        return {"admit": bool(choice.accepted and choice.layout is not None) if rec.rate_rps else choice.accepted,
                "achievable_rps": choice.achievable_rps, "layout": choice.layout, "cores_free": len(cpus),
                "reason": choice.reason}

    def node_info(self) -> dict[str, Any]:
        with self._lock:
            runtime, period = rt_throttling(self.proc_root)
            gpus = 0
            if self.gpu is not None:
                try:
                    gpus = len(self.gpu.status().get("gpus") or [])
                except Exception:  # noqa: BLE001
                    gpus = 0
            return {
                "hostname": socket.gethostname(), "version": getattr(reamer, "__version__", "0.1.0"),
                "agent_pid": os.getpid(), "uptime_s": time.time() - self.started_at,
                "cpu_model": self.topology.model_name, "cpus": self.topology.cpu_ids(),
                "reserved_cpus": sorted(self.cores.reserved), "training_cpus": sorted(self.cores.training_cpus()),
                "idle_cpus": sorted(self.cores.idle_cpus()), "free_cores": self.cores.free_core_count(),
                "allocations": {k: list(v) for k, v in self.cores.jobs().items()},
                "cgroup_version": self.driver.version,
                "rt_throttling": {"runtime_us": runtime, "period_us": period},
                "training_jobs": len(self.training), "inference_jobs": len(self.supervisor.records),
                "gpus": gpus, "offline_sched": self.config.inference.offline_sched, "profile_dir": self.profile_dir,
                "rt_budget": self._rt_budget_info(),
            }

    def _rt_budget_info(self) -> dict[str, Any]:
        """The RT budget rule and who holds what (cgroup v1 with RT group scheduling only; elsewhere no
        training job needs a budget)."""
        pools = self.pinner.pools
        budgets = self.pinner.budgets()
        holders = []
        for holder in self.pinner.budget_holders():
            cpu_path = self.pinner.placements[holder.job].cpu_path
            try:
                held = self.driver.get_rt_runtime(cpu_path) or 0
            except HostError:
                held = 0
            holders.append({"job": holder.job, "owner_uid": holder.uid, "pool": pools.pool_of(holder),
                            "budget_us": budgets.get(holder.job, 0), "held_us": held, "cpu_cgroup": cpu_path})
        return {"enabled": self.pinner.rt_budgets, "cap_us": pools.cap_us, "user_percent": pools.user_percent,
                "privileged_pool_us": pools.privileged_pool_us, "user_pool_us": pools.user_pool_us,
                "jobs": holders,
                "rule": "users' jobs together hold at most user_percent of the cap (split among the users, then "
                        "each user's jobs); root's and admins' jobs share the rest: a user's attach never shrinks "
                        "theirs"}

    def events_since(self, since: int, wait_s: float = 0.0) -> tuple[list[Event], int]:
        events = self.events.wait(since, wait_s) if wait_s > 0 else self.events.since(since)
        return events, self.events.last_id

    def health(self) -> tuple[bool, str]:
        if self._thread is not None and not self._thread.is_alive():
            return False, "the reconcile loop has stopped"
        if self.last_reconcile and time.time() - self.last_reconcile > HEALTHY_RECONCILE_AGE_S:
            return False, f"no reconcile pass for {time.time() - self.last_reconcile:.0f}s"
        return True, ""

    # GPU methods: the GpuManager is thread-safe, so they do not take the agent lock (a reconcile pass
    # or a slow MPS command must not hold up the rest of the API). Its errors (reamer.gpu.errors) reach
    # the API unchanged; the API maps them to HTTP statuses.

    def _gpu_manager(self) -> Any:
        if self.gpu is None:
            raise Conflict(f"GPU requests cannot be served: {self.gpu_message or 'the GPU manager is not running'}",
                           "see the agent log; set the gpu section of the config (configs/reamer.yaml) and restart "
                           "the agent")
        return self.gpu

    def gpu_status(self) -> dict[str, Any]:
        """GpuManager.status() (GPUs, MPS daemons, servers and clients, latest telemetry, jobs) plus
        `message` (why GPUs are unavailable, "" when they work) and `fix` where there is one."""
        if self.gpu is None:
            return {"enabled": False, "available": False, "message": self.gpu_message or "GPU manager not running",
                    "fix": "see the agent log; set the gpu section of the config and restart the agent",
                    "gpus": [], "jobs": []}
        status = dict(self.gpu.status())
        status.setdefault("message", status.get("reason", ""))
        if not status.get("available", True) and status.get("enabled", True):
            from reamer.gpu.nvml import NO_DRIVER_FIX

            status.setdefault("fix", NO_DRIVER_FIX)
        return status

    def gpu_telemetry(self, gpu: str | None = None) -> dict[str, Any]:
        return self._gpu_manager().telemetry(_gpu_ref(gpu) if gpu is not None else None)

    def gpu_jobs(self) -> list[dict[str, Any]]:
        return self.gpu.jobs() if self.gpu is not None else []

    def gpu_job(self, name: str) -> dict[str, Any]:
        if self.gpu is None:
            raise NotFound(f"no GPU job named {name!r}: the GPU manager is not running", "see `reamer gpu status`")
        return self.gpu.job(name)

    def gpu_register(self, req: dict[str, Any], caller: Caller = AGENT) -> dict[str, Any]:
        """Register a GPU job; returns its view with `env` (the launch environment: MPS pipe directory,
        active-thread percentage, pinned-memory limit, CUDA_VISIBLE_DEVICES=<uuid>). Its pids (which
        eviction and fault handling may signal) must be running processes the caller may touch."""
        pids, checked = self._checked_pids(req["pids"], caller) if req.get("pids") else (None, [])
        manager = self._gpu_manager()
        return manager.register_job(req["name"], _gpu_ref(req["gpu"]), req["sm_percent"], req.get("mem_limit_mb"),
                                    kind=req.get("kind", "training"), pids=pids, owner_uid=caller.uid,
                                    pid_starts=_starts_of(checked))

    def _owned_gpu_job(self, name: str, caller: Caller) -> Any:
        check_job_owner(caller, "GPU", name, int(self.gpu_job(name).get("owner_uid", 0)))
        return self.gpu

    def gpu_update(self, name: str, req: dict[str, Any], caller: Caller = AGENT) -> dict[str, Any]:
        """Change a job's desired limits and/or pids; limits reach it when it restarts with the returned
        `env` (until then the view says pending_restart)."""
        manager = self._owned_gpu_job(name, caller)
        pids, checked = self._checked_pids(req["pids"], caller) if req.get("pids") else (req.get("pids"), [])
        return manager.update_job(name, sm_percent=req.get("sm_percent"), mem_limit_mb=req.get("mem_limit_mb"),
                                  pids=pids, clear_mem_limit=bool(req.get("clear_mem_limit")),
                                  pid_starts=_starts_of(checked))

    def gpu_remove(self, name: str, caller: Caller = AGENT) -> dict[str, Any]:
        return self._owned_gpu_job(name, caller).remove_job(name)

    # ------------------------------------------------------------------------------- metrics

    def snapshot(self) -> dict[str, Any]:
        """Numbers for the metrics collector (cheap, no host calls)."""
        with self._lock:
            return {
                "training": {n: self._pin_state.get(n, PinState()) for n in self.training},
                "inference": {n: (r.state, self.supervisor.status_of(n)) for n, r in self.supervisor.records.items()},
                "idle_cpus": len(self.cores.idle_cpus()),
                "training_cpus": len(self.cores.training_cpus()),
            }


def _layout_of(instances: list[dict[str, Any]]) -> str | None:
    if not instances:
        return None
    try:
        from reamer.plan.layout import InstanceShape, Layout, format_layout

        return format_layout(Layout(tuple(InstanceShape(len(i["cpus"]), i["threads"], i["max_batch"])
                                          for i in instances)))
    except (ImportError, ValueError, TypeError):
        return None


def _starts_of(checked: list[ProcessFacts]) -> dict[int, int]:
    """pid -> start time of the processes the policy checked (what GPU eviction may signal)."""
    return {f.pid: f.start_time for f in checked if f.start_time is not None}


def _gpu_ref(gpu: Any) -> str | int:
    """A GPU index ("0", 0) as int, anything else (a UUID) as given."""
    text = str(gpu).strip()
    return int(text) if text.isdigit() else text
