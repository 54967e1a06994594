"""Supervise inference jobs: placement, JobSpec files, job processes, their status and events.

Each job runs as `python -I -m reamer.serve.runtime.job --spec <run_dir>/jobs/<name>@<deploy id>/spec.json` in its
own session (so it survives an agent restart), from a directory root made for that deploy
(reamer.agent.job_dir); the agent re-attaches by pid (checked against /proc/<pid>/cmdline). A placement
change rewrites the spec and sends SIGHUP; an online job that loses its cores is stopped and waits (state
"pending") until cores are free again.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import psutil

from reamer.agent import job_dir as job_files
from reamer.agent.errors import AdmissionRefused, InvalidRequest
from reamer.host.cpulist import format_cpulist
from reamer.host.errors import ReamerError
from reamer.host.safe_files import UntrustedFileError, UntrustedFileMissing, open_untrusted
from reamer.plan.layout import BACKENDS
from reamer.search.backends import AUTO as AUTO_BACKEND  # the backend is a search dimension: the chosen layout names it
from reamer.search.backends import installed_backends
from reamer.search.chooser import LayoutChoice, LayoutChooser, LayoutRequest
from reamer.serve.job_channel import (JOB_EVENT_KINDS, LIMITS, ChannelRead, EventCursor, JobChannel, ReadRequest,
                                      read_channels)
from reamer.serve.spec import EVENTS_FILE, STATUS_FILE, InstanceSpec, JobSpec, JobStatus

if TYPE_CHECKING:
    from reamer.serve.deploy_check import DeployCheck
    from reamer.serve.samples import SampleSpec

log = logging.getLogger("reamer.inference")

DEFAULT_BATCH = 4
DEFAULT_BIND_ADDRESS = "0.0.0.0"  # online front doors listen on every interface, as Triton and KServe do
STOP_TIMEOUT_S = 5.0
LEAVE_TIMEOUT_S = 5.0
FORWARDED_EVENTS = tuple(sorted(JOB_EVENT_KINDS))  # the kinds a job may emit (serve.job_channel); others are dropped

EmitFn = Callable[..., Any]  # emit(kind, message, job=None, data=None)


# --- layout choice (pluggable: reamer.search.chooser) -------------------------------------------

def choose_for(chooser: LayoutChooser, rec: "InferenceRecord", cpus: list[int]) -> LayoutChoice | None:
    """Ask `chooser` for the layout of `rec` on `cpus`: the one LayoutRequest every chooser takes."""
    return chooser(LayoutRequest(rec.model, rec.backend, list(cpus), rec.slo_ms, rec.rate_rps,
                                 max_batch=rec.max_batch, samples=rec.samples(), precision=rec.precision))


# --- records ----------------------------------------------------------------------------------

@dataclass
class InferenceRecord:
    """One inference job as the agent keeps it (stored as JSON)."""

    name: str
    model: str
    kind: str
    backend: str
    slo_ms: float | None = None
    rate_rps: float | None = None
    port: int | None = None
    grpc_port: int | None = None  # online: the gRPC front door's port
    bind_address: str | None = None  # online: the address the front doors listen on (None: the config's)
    # The traffic (perf_analyzer's --shape and --input-data): warm-up, search and admission use them.
    shapes: dict[str, list[int]] = field(default_factory=dict)
    input_data: str | None = None
    input_dir: str | None = None
    output_dir: str | None = None
    max_batch: int | None = None
    precision: str = "f32"  # asked for: "f32" | "bf16" (what runs: the job's status, JobStatus.precision)
    layout: str | None = None  # asked for or chosen; None = default
    cores: int | None = None  # online without a layout: one instance on this many cores (all free at deploy)
    state: str = "pending"  # running | pending | done | failed
    pid: int | None = None
    pid_started: float | None = None  # psutil create_time, against pid reuse
    instances: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    created_at: float = field(default_factory=time.time)
    restarts: list[float] = field(default_factory=list)
    events_offset: int = 0
    owner_uid: int = 0  # the API caller who deployed it; only it or root may remove it
    memory_limit_mb: float | None = None  # None: the config's inference.memory_limit_mb
    run_uid: int = 0  # the job's processes run as this uid/gid (the deploying caller, or inference.run_as)
    run_gid: int = 0
    # names this deploy's own directory (jobs/<name>@<deploy_id>), fresh for each deploy; "" in older records
    deploy_id: str = field(default_factory=job_files.new_deploy_id)
    # placed by Slurm: the job runs only on that Slurm job's cpus here and is removed when it ends
    slurm_job: int | None = None
    allowed_cpus: list[int] | None = None

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    def samples(self) -> "SampleSpec":
        from reamer.serve.samples import SampleSpec

        return SampleSpec(shapes=self.shapes, input_data=self.input_data)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "InferenceRecord":
        known = cls.__dataclass_fields__
        # a record of an older agent has no deploy id: it keeps the per-name directory it runs in
        return cls(**{"deploy_id": "", **{k: v for k, v in doc.items() if k in known}})


def job_user(rec: InferenceRecord) -> job_files.JobUser:
    """Whom the job runs as: its run_uid when the agent is root and that is not root, else the agent."""
    if rec.run_uid and os.geteuid() == 0:
        return job_files.JobUser(rec.run_uid, rec.run_gid, switch=True)
    return job_files.JobUser(os.geteuid(), os.getegid(), switch=False)


def _run_as_kwargs(rec: InferenceRecord) -> dict[str, Any]:
    """Popen arguments that start the job as its user (nothing when it runs as the agent)."""
    if not job_user(rec).switch:
        return {}
    import pwd

    try:
        groups = os.getgrouplist(pwd.getpwuid(rec.run_uid).pw_name, rec.run_gid)
    except KeyError:
        groups = [rec.run_gid]
    return {"user": rec.run_uid, "group": rec.run_gid, "extra_groups": groups}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


LOG_TAIL_BYTES = 4096


def _tail(directory: Path, owner: int, lines: int = 5) -> str:
    """The last lines of the job's job.log in its (root-owned) directory: at most LOG_TAIL_BYTES, and only
    from a regular file of the job's user (never through a link, a FIFO or a device)."""
    try:
        data = open_untrusted(directory, job_files.LOG_FILE, {owner}, LOG_TAIL_BYTES, mode="tail")
    except UntrustedFileMissing:
        return ""
    except UntrustedFileError as exc:
        log.warning("not reading the log of a job: %s", exc.message)
        return f"(job.log not read: {exc.message})"
    text = data.decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


# --- the supervisor ---------------------------------------------------------------------------

class InferenceSupervisor:
    """Not thread-safe by itself: the Agent calls it under its lock (long waits are separate calls)."""

    def __init__(self, run_dir: str | Path, reserved_cpus: Iterable[int], *, offline_sched: str = "rr-preempt",
                 max_request_mb: float = 64.0, emit: EmitFn | None = None, save: Callable[[InferenceRecord], None] | None = None,
                 restart_limit: int = 5, restart_window_s: float = 60.0, python: str = sys.executable) -> None:
        self.jobs_dir = Path(run_dir) / "jobs"
        self.reserved = sorted(reserved_cpus)
        self.offline_sched = offline_sched
        self.max_request_mb = max_request_mb
        self.frontdoor: dict[str, Any] = {}  # inference.frontdoor of the config: the front door's limits
        self.bind_address = DEFAULT_BIND_ADDRESS  # inference.bind_address: where online jobs listen
        self.job_log_mb = 16.0  # inference.job_log_mb: job.log is kept under this
        self.emit = emit or (lambda *a, **k: None)
        self.save = save or (lambda rec: None)
        self.restart_limit = restart_limit
        self.restart_window_s = restart_window_s
        self.python = python
        self.records: dict[str, InferenceRecord] = {}
        # idle cpus no instance of any job runs on (last replan): front doors go there when none is reserved
        self.spare_cpus: list[int] = []
        self._frontdoor_written: dict[str, list[int]] = {}  # job -> frontdoor_cpus of the spec it runs
        self._procs: dict[str, subprocess.Popen] = {}
        self._status: dict[str, JobStatus] = {}
        self._channels: dict[str, JobChannel] = {}  # job -> its channel's rate window and drop counts

    # --- paths ---

    def job_dir(self, job: "str | InferenceRecord") -> Path:
        """The job's directory (root's: its cwd, spec.json, job.log); a name means the current record's."""
        rec = self.records.get(job) if isinstance(job, str) else job
        name = job if isinstance(job, str) else job.name
        return job_files.deploy_dir(self.jobs_dir, name, rec.deploy_id if rec is not None else "")

    def io_dir(self, job: "str | InferenceRecord") -> Path:
        """Where the job writes what the agent reads: status.json, events.jsonl (its user's directory)."""
        rec = self.records.get(job) if isinstance(job, str) else job
        name = job if isinstance(job, str) else job.name
        return job_files.io_dir(self.jobs_dir, name, rec.deploy_id if rec is not None else "")

    def spec_path(self, job: "str | InferenceRecord") -> Path:
        return self.job_dir(job) / job_files.SPEC_FILE

    # --- adoption after an agent restart ---

    def adopt(self, rec: InferenceRecord) -> None:
        """Take over a job from the store: keep its process if it is still ours, else restart it later."""
        self.records[rec.name] = rec
        if rec.pid and not self._is_our_process(rec):
            log.info("job %s: process %s is gone; will start it again", rec.name, rec.pid)
            rec.pid = None
            rec.pid_started = None
            self.save(rec)

    def _is_our_process(self, rec: InferenceRecord) -> bool:
        if not rec.pid:
            return False
        try:
            proc = psutil.Process(rec.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            if rec.pid_started and abs(proc.create_time() - rec.pid_started) > 1.0:
                return False
        except psutil.Error:
            return False
        cmd = _cmdline(rec.pid)
        return "reamer.serve.runtime.job" in cmd and str(self.spec_path(rec.name)) in cmd

    # --- placement ---

    def demands(self) -> list:
        active = [rec for rec in sorted(self.records.values(), key=lambda r: (r.created_at, r.name))
                  if rec.state not in ("done", "failed")]
        if not active:
            return []
        from reamer.plan.layout import parse_layout
        from reamer.plan.placement import InferenceDemand

        result = []
        for rec in active:
            layout = parse_layout(rec.layout) if rec.layout else None
            cores = None if layout is not None or rec.kind == "offline" else max(1, rec.cores or 1)
            result.append(InferenceDemand(job=rec.name, kind=rec.kind, layout=layout, cores=cores,
                                          batch=rec.max_batch or DEFAULT_BATCH,
                                          allowed_cpus=tuple(rec.allowed_cpus) if rec.allowed_cpus else None))
        return result

    def previous(self) -> dict[str, list]:
        from reamer.plan.placement import PlacedInstance

        return {name: [PlacedInstance(cpus=tuple(i["cpus"]), threads=i["threads"], batch=i["max_batch"],
                                      on_training=i.get("on_training", False), streams=int(i.get("streams", 1)))
                       for i in rec.instances]
                for name, rec in self.records.items() if rec.instances}

    def replan(self, idle_cpus: list[int], training_cpus: Iterable[int]) -> dict[str, str]:
        """Place every job on the current cores and apply the difference.

        Returns {job: "stopped"|"moved"|"started"} for jobs whose processes must react."""
        demands = self.demands()
        if not demands:
            return {}
        from reamer.plan.placement import place

        training = sorted(set(training_cpus))
        result = place(list(idle_cpus), set(training), demands, self.previous())
        used = {c for placed in result.assignments.values() for p in placed for c in p.cpus}
        self.spare_cpus = [c for c in idle_cpus if c not in used and c not in training]
        changes: dict[str, str] = {}
        for demand in demands:
            rec = self.records[demand.job]
            placed = result.assignments.get(rec.name) or []
            instances = [self._instance_doc(rec, p) for p in placed]
            if not instances:
                reason = (f"waiting for free cores ({'training holds' if training else 'other jobs hold'} them)"
                          if rec.kind == "online" else "waiting for cores")
                running = self.is_running(rec)
                if running or rec.state != "pending" or rec.message != reason or rec.instances:
                    rec.state, rec.instances, rec.message = "pending", [], reason
                    self.save(rec)  # the store first, then the host
                    self.emit("inference_pending", f"{rec.name} is pending: {reason}", job=rec.name)
                if running:
                    self._stop(rec)
                    changes[rec.name] = "stopped"
                continue
            running = self.is_running(rec)
            if instances == rec.instances and running and self._frontdoor_unchanged(rec):
                continue
            old = rec.instances
            rec.instances, rec.message, rec.state = instances, "", "running"
            self.save(rec)  # the store first, then the host
            self._write_spec(rec)
            if running:
                self._signal(rec, signal.SIGHUP)
                where = (f"its front door to cpus {format_cpulist(self._frontdoor_written[rec.name])}"
                         if old == instances else f"to cpus {self._cpus_text(rec)}")
                self.emit("replanned", f"{rec.name} moved {where}", job=rec.name,
                          data={"from": old, "to": instances, "frontdoor_cpus": self._frontdoor_written[rec.name]})
                changes[rec.name] = "moved"
            else:
                self._start(rec)
                changes[rec.name] = "started"
        return changes

    def _instance_doc(self, rec: InferenceRecord, placed) -> dict[str, Any]:
        doc = {"cpus": sorted(int(c) for c in placed.cpus), "threads": int(placed.threads),
               "max_batch": int(placed.batch or DEFAULT_BATCH), "on_training": bool(placed.on_training)}
        if placed.streams > 1:
            doc["streams"] = int(placed.streams)
        return doc

    @staticmethod
    def _cpus_text(rec: InferenceRecord) -> str:
        from reamer.host.cpulist import format_cpulist

        return format_cpulist({c for i in rec.instances for c in i["cpus"]}) or "-"

    def frontdoor_cpus(self, rec: InferenceRecord) -> list[int]:
        """Where the job's own process (its front doors) runs: see reamer.plan.frontdoor.frontdoor_cpus."""
        from reamer.plan.frontdoor import frontdoor_cpus

        own = [c for i in rec.instances if not i["on_training"] for c in i["cpus"]]
        return frontdoor_cpus(self.reserved, self.spare_cpus, own, [c for i in rec.instances for c in i["cpus"]])

    def _frontdoor_unchanged(self, rec: InferenceRecord) -> bool:
        written = self._frontdoor_written.get(rec.name)
        if written is None:  # adopted after an agent restart: the spec on disk says what it runs
            try:
                written = JobSpec.load(self.spec_path(rec.name)).frontdoor_cpus
            except Exception:  # noqa: BLE001 - unreadable: write it again
                return False
            self._frontdoor_written[rec.name] = written
        return written == self.frontdoor_cpus(rec)

    def build_spec(self, rec: InferenceRecord) -> JobSpec:
        instances = [InstanceSpec(cpus=list(i["cpus"]), threads=i["threads"], max_batch=i["max_batch"],
                                  sched="idle" if i["on_training"] and self.offline_sched == "idle" else "other",
                                  streams=int(i.get("streams", 1)))
                     for i in rec.instances]
        frontdoor = self.frontdoor_cpus(rec)
        return JobSpec(name=rec.name, kind=rec.kind, model=rec.model, backend=rec.backend, instances=instances,
                       frontdoor_cpus=frontdoor, slo_ms=rec.slo_ms, rate_rps=rec.rate_rps, port=rec.port,
                       grpc_port=rec.grpc_port,
                       input_dir=rec.input_dir, output_dir=rec.output_dir, run_dir=str(self.io_dir(rec)),
                       max_request_mb=self.max_request_mb, frontdoor=dict(self.frontdoor),
                       log_max_mb=self.job_log_mb, host=rec.bind_address or self.bind_address,
                       shapes=dict(rec.shapes), input_data=rec.input_data, precision=rec.precision)

    def url(self, rec: InferenceRecord) -> str | None:
        """The URL a client uses for an online job's REST front door (see client_url)."""
        if rec.kind != "online" or not rec.port:
            return None
        return client_url(rec.bind_address or self.bind_address, rec.port)

    def grpc_target(self, rec: InferenceRecord) -> str | None:
        """HOST:PORT a gRPC client dials for an online job's gRPC front door (the REST url's host)."""
        if rec.kind != "online" or not rec.grpc_port:
            return None
        return client_url(rec.bind_address or self.bind_address, rec.grpc_port).split("://", 1)[1]

    def allowed_cpus(self, rec: InferenceRecord) -> set[int]:
        spec = self.build_spec(rec)
        return set(spec.frontdoor_cpus) | {c for i in spec.instances for c in i.cpus}

    def _write_spec(self, rec: InferenceRecord) -> None:
        if rec.deploy_id or not self.is_running(rec):  # a running job of an older agent keeps its directory
            self._prepare_dir(rec)
        spec = self.build_spec(rec)
        spec.save(self.spec_path(rec))
        self._frontdoor_written[rec.name] = list(spec.frontdoor_cpus)

    def _prepare_dir(self, rec: InferenceRecord) -> Path:
        """The deploy's own directory (see reamer.agent.job_dir), made now if it is not there."""
        if not rec.deploy_id:  # a record of an older agent, whose process has ended
            rec.deploy_id = job_files.new_deploy_id()
            self.save(rec)
        try:
            base, made = job_files.prepare(self.jobs_dir, rec.name, rec.deploy_id, job_user(rec))
        except ReamerError as exc:  # something not of ours is there: never use it, start a fresh one
            log.warning("job %s: %s; using a new directory", rec.name, exc.message)
            rec.deploy_id = job_files.new_deploy_id()
            self.save(rec)
            base, made = job_files.prepare(self.jobs_dir, rec.name, rec.deploy_id, job_user(rec))
        if made:  # an older agent's per-name directory (its user's) is used by no one from now on
            why = job_files.remove(self.jobs_dir, rec.name, "")
            if why:
                log.warning("job %s: the directory of an older agent is left: %s", rec.name, why)
        return base

    # --- processes ---

    def is_running(self, rec: InferenceRecord) -> bool:
        proc = self._procs.get(rec.name)
        if proc is not None:
            return proc.poll() is None
        return self._is_our_process(rec)

    def _start(self, rec: InferenceRecord) -> None:
        try:
            self._write_spec(rec)  # in the deploy's own directory, made now if need be (see _prepare_dir)
            job_dir, io_dir = self.job_dir(rec), self.io_dir(rec)
            try:
                (io_dir / STATUS_FILE).unlink()  # unlink never follows; io/ sits in root's directory
            except FileNotFoundError:
                pass
            try:
                events = os.stat(io_dir / EVENTS_FILE, follow_symlinks=False)
                rec.events_offset = events.st_size if stat.S_ISREG(events.st_mode) else 0
            except FileNotFoundError:
                rec.events_offset = 0
            # made by root in root's directory (reamer.agent.job_dir): the job's user writes it, cannot swap it
            log_fd = job_files.open_log(job_dir, job_user(rec))
        except (OSError, ReamerError) as exc:
            why = exc.message if isinstance(exc, ReamerError) else f"{exc.strerror} ({exc.filename})"
            self._fail_start(rec, f"cannot prepare the job's directory under {self.jobs_dir}: {why}; fix: make the "
                                  "agent's run_dir a local directory only root can write, with free space, and deploy "
                                  "it again")
            return
        self._status.pop(rec.name, None)
        as_user = _run_as_kwargs(rec)
        with os.fdopen(log_fd, "ab") as log_file:
            try:
                # -I: neither the cwd nor the user's site directory nor PYTHON* variables reach sys.path;
                # the cwd is root's anyway, and the environment is an allowlist (job_dir.job_environment).
                proc = subprocess.Popen(
                    [self.python, "-I", "-m", "reamer.serve.runtime.job", "--spec", str(self.spec_path(rec))],
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, cwd=job_dir,
                    env=job_files.job_environment(job_user(rec)),
                    start_new_session=True, close_fds=True, **as_user)
            except OSError as exc:  # e.g. the job's user cannot execute the agent's python
                self._fail_start(rec, f"cannot start the job as uid {rec.run_uid}: {exc.strerror} ({exc.filename}); "
                                      "fix: make reamer's python and the model readable by that user, or deploy as "
                                      "another")
                return
        self._procs[rec.name] = proc
        rec.pid = proc.pid
        try:
            rec.pid_started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            rec.pid_started = None
        rec.state = "running"
        self.save(rec)
        self.emit("inference_started", f"{rec.name} started (pid {proc.pid}) on cpus {self._cpus_text(rec)}",
                  job=rec.name, data={"pid": proc.pid, "instances": rec.instances})

    def _fail_start(self, rec: InferenceRecord, message: str) -> None:
        rec.state, rec.pid, rec.instances, rec.message = "failed", None, [], message
        self.save(rec)
        self.emit("inference_failed", f"{rec.name} failed: {rec.message}", job=rec.name)

    def _signal(self, rec: InferenceRecord, sig: int) -> None:
        if rec.pid:
            try:
                os.kill(rec.pid, sig)
            except ProcessLookupError:
                pass

    def _stop(self, rec: InferenceRecord) -> None:
        """SIGTERM now; wait_stopped() does the waiting (and SIGKILL) outside the agent lock."""
        if self.is_running(rec):
            self._signal(rec, signal.SIGTERM)

    def wait_stopped(self, name: str, pid: int | None, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for a job process to exit after SIGTERM; kill its whole session after `timeout`."""
        if not pid:
            return
        proc = self._procs.get(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.pid == pid:
                if proc.poll() is not None:
                    return
            elif not psutil.pid_exists(pid) or _is_zombie(pid):
                return
            time.sleep(0.05)
        log.warning("job %s (pid %d) did not stop within %.0fs; killing its session", name, pid, timeout)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc is not None and proc.pid == pid:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def processes_outside(self, name: str) -> list[int]:
        """Processes of the job whose CPU affinity is not within its current allowed cpus."""
        rec = self.records.get(name)
        if rec is None or not rec.pid or not rec.instances:
            return []
        allowed = self.allowed_cpus(rec)
        outside = []
        try:
            root = psutil.Process(rec.pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    if not set(proc.cpu_affinity()) <= allowed:
                        outside.append(proc.pid)
                except psutil.Error:
                    continue
        except psutil.Error:
            return []
        return outside

    def wait_left(self, changes: dict[str, str], pids: dict[str, int | None], timeout: float = LEAVE_TIMEOUT_S) -> bool:
        """After a replan: wait until stopped jobs exited and moved jobs run within their new cpus."""
        deadline = time.monotonic() + timeout
        for name, change in changes.items():
            if change == "stopped":
                self.wait_stopped(name, pids.get(name), max(0.5, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            if not any(self.processes_outside(name) for name, change in changes.items() if change == "moved"):
                return True
            time.sleep(0.05)
        return False

    def remove(self, name: str) -> int | None:
        """Forget the job and SIGTERM its process; returns the pid to wait_stopped() on."""
        rec = self.records.pop(name)
        self._frontdoor_written.pop(name, None)
        pid = rec.pid if self.is_running(rec) else None
        if pid:
            self._signal(rec, signal.SIGTERM)
        return pid

    def forget_process(self, name: str) -> None:
        self._procs.pop(name, None)

    def remove_files(self, rec: InferenceRecord) -> None:
        """Remove a removed job's directory, once no process of it is left (never following a link)."""
        why = job_files.remove(self.jobs_dir, rec.name, rec.deploy_id)
        if why:
            log.warning("job %s: could not remove all of %s: %s", rec.name, self.job_dir(rec), why)

    # --- the periodic pass ---

    def status_of(self, name: str) -> JobStatus | None:
        return self._status.get(name)

    @staticmethod
    def _deploy_of(rec: InferenceRecord) -> tuple:
        return rec.name, rec.deploy_id or rec.created_at

    def read_requests(self) -> list[ReadRequest]:
        """What tick() needs read of each job (cheap: no job file is touched). Call under the agent's lock,
        read with serve.job_channel.read_channels outside it, and pass the result to tick()."""
        # The job's files are its user's (the agent's own uid when it starts jobs as itself): a file of any
        # other owner there (a hard link to root's file) is refused.
        requests = []
        for rec in self.records.values():
            owner = job_user(rec).uid
            channel = self._channels.get(rec.name)
            discarding = bool(channel and channel.deploy == self._deploy_of(rec) and channel.discarding)
            exited = rec.state == "running" and rec.pid is not None and not self.is_running(rec)
            requests.append(ReadRequest(rec.name, self._deploy_of(rec), str(self.io_dir(rec)),
                                        frozenset({owner}), EventCursor(rec.events_offset, discarding), rec.pid,
                                        exited))
        return requests

    def tick(self, reads: dict[str, ChannelRead] | None = None) -> bool:
        """Take what was read of each job (`reads`, from read_requests() + read_channels(); None: read now),
        notice exits, restart crashed jobs. Returns True when cores changed hands (a job ended), so the caller
        re-plans. A job whose process died after its files were read is handled at the next pass, when its
        last status has been read."""
        if reads is None:
            reads = read_channels(self.read_requests())
        for name in set(self._channels) - set(self.records):
            del self._channels[name]
        changed = False
        for rec in list(self.records.values()):
            read = reads.get(rec.name)
            if read is not None and read.request.deploy != self._deploy_of(rec):
                read = None  # removed and deployed again since: that read was of the other deploy
            if read is not None:
                self._read_status(rec, read)
                self._forward_events(rec, read)
            if rec.state != "running" or rec.pid is None:
                continue
            if self.is_running(rec):
                continue
            if read is None or not read.request.exited:
                continue  # it died after its files were read: its last status is read at the next pass
            changed |= self._handle_exit(rec)
        return changed

    def _channel(self, rec: InferenceRecord) -> JobChannel:
        channel = self._channels.get(rec.name)
        if channel is None or channel.deploy != self._deploy_of(rec):
            channel = self._channels[rec.name] = JobChannel(deploy=self._deploy_of(rec))
        return channel

    def _read_status(self, rec: InferenceRecord, read: ChannelRead | None = None) -> None:
        """Take the status read of the job (nothing is read here: the read phase of this pass did it)."""
        if read is None:
            return
        if read.status.problem:
            self._channel(rec).count({}, f"status.json: {read.status.problem}")
        status = read.status.status
        if status is None or read.request.pid != rec.pid:  # none, or of the process before a restart
            return
        self._status[rec.name] = status
        if (status.port and not rec.port) or (status.grpc_port and not rec.grpc_port):
            rec.port = rec.port or status.port
            rec.grpc_port = rec.grpc_port or status.grpc_port
            self.save(rec)

    def _forward_events(self, rec: InferenceRecord, read: ChannelRead) -> None:
        """Forward the job's new events within its rate, as agent events of the kinds a job may emit; say once
        a minute at most what was dropped."""
        channel = self._channel(rec)
        got = read.events
        if got.problem:
            channel.count({}, f"events.jsonl: {got.problem}")
        if rec.events_offset == read.request.cursor.offset and got.cursor != read.request.cursor:
            channel.count(got.rejected)
            channel.discarding = got.cursor.discarding
            rec.events_offset = got.cursor.offset
            for event in channel.admit(got.events):
                data = {k: v for k, v in event.data.items() if k != "job"}  # the agent says which job
                self.emit(event.kind, f"{rec.name}: {event.message}", job=rec.name, data=data)
            self.save(rec)
        elif rec.events_offset != read.request.cursor.offset:  # the job started again meanwhile: a new cursor
            channel.discarding = False
        note = channel.note()
        if note is not None:
            dropped = ", ".join(f"{n} {why}" for why, n in sorted(note["dropped"].items()))
            refused = ", ".join(f"{what} ({n}x)" for what, n in sorted(note["refused_files"].items()))
            self.emit("job_events_dropped",
                      f"{rec.name}: " + "; ".join(filter(None, (
                          f"event lines dropped: {dropped}" if dropped else "",
                          f"files refused: {refused}" if refused else ""))) +
                      f"; a job may send its known event kinds only, in lines of at most {LIMITS.max_line_bytes} "
                      f"bytes, {LIMITS.events_per_minute} a minute, from regular files of its own",
                      job=rec.name, data=note)

    def _handle_exit(self, rec: InferenceRecord) -> bool:
        proc = self._procs.pop(rec.name, None)
        code = proc.poll() if proc is not None else None
        self._read_status(rec)  # the job writes its final state just before it exits
        status = self._status.get(rec.name)
        log_path = self.job_dir(rec) / job_files.LOG_FILE
        if status is not None and status.state == "done":  # exit 0 alone may be a SIGTERM mid-way
            rec.state, rec.pid, rec.instances = "done", None, []
            rec.message = "all inputs done"
            self.save(rec)
            self.emit("inference_done", f"{rec.name} finished", job=rec.name)
            return True
        if status is not None and status.state == "failed":  # the job gave up itself: restarting will not help
            rec.state, rec.pid, rec.instances = "failed", None, []
            rec.message = f"{status.message or 'failed'} (see {log_path})"
            self.save(rec)
            self.emit("inference_failed", f"{rec.name} failed: {rec.message}", job=rec.name)
            return True
        now = time.time()
        rec.restarts = [t for t in rec.restarts if now - t < self.restart_window_s]
        why = f"exit code {code}" if code is not None else "process gone"
        tail = _tail(self.job_dir(rec), job_user(rec).uid)
        if len(rec.restarts) >= self.restart_limit:
            rec.state, rec.pid, rec.instances = "failed", None, []
            rec.message = (f"crashed {len(rec.restarts) + 1} times within {self.restart_window_s:.0f}s ({why}); "
                           f"last log lines: {tail or '(none)'} — see {log_path}; fix the cause and deploy it again")
            self.save(rec)
            self.emit("inference_failed", f"{rec.name} failed: {rec.message}", job=rec.name)
            return True
        rec.restarts.append(now)
        self.emit("inference_crashed", f"{rec.name} exited unexpectedly ({why}); restarting", job=rec.name,
                  data={"log_tail": tail})
        self._start(rec)
        return False

    def close(self) -> None:
        """Drop Popen handles without touching the processes (they outlive the agent)."""
        self._procs.clear()


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def validate_request(req: dict[str, Any], default_backend: str,
                     check: "DeployCheck | None" = None) -> InferenceRecord:
    """Turn an API request into a record; raises InvalidRequest naming the field and the fix.

    The model and its traffic (shapes, input_data) are opened and checked by `check`, a child process with
    the rights and the memory limit of the job's user (default: this process's user); never in this
    process. Call it without the agent's lock: the check may take as long as its timeout."""
    model = Path(req["model"])
    if not model.is_absolute():
        raise InvalidRequest(f"model path {req['model']!r} is relative; the agent cannot know your directory",
                             "pass an absolute path (the CLI does this for you)")
    if not model.is_file():
        raise InvalidRequest(f"model file {model} does not exist on this node",
                             "build one with `reamer models build tiny --out FILE` or copy the ONNX file here")
    from reamer.serve.spec import canonical_backend

    asked = req.get("backend") or default_backend
    backend = AUTO_BACKEND if asked == AUTO_BACKEND else canonical_backend(asked) or asked
    if backend not in (*BACKENDS, AUTO_BACKEND):
        raise InvalidRequest(f"backend {backend!r} is unknown", "use onnxruntime, openvino or auto")
    layout = req.get("layout")
    if layout:
        from reamer.plan.layout import format_layout, parse_layout

        try:
            parsed = parse_layout(layout)
        except ValueError as exc:
            raise InvalidRequest(f"layout {req['layout']!r} is invalid: {exc}",
                                 'write it like "2x1:b4" (instances x cores : batch) or "2x1:b4+1x2:b8"') from None
        if parsed.backend and req.get("backend") and backend not in (AUTO_BACKEND, parsed.backend):
            raise InvalidRequest(f"layout {req['layout']!r} runs on {parsed.backend}, the request asks for {backend}",
                                 f"drop backend, or the layout's @{parsed.backend}, or make them agree")
        if parsed.backend:
            backend = parsed.backend
        elif backend == AUTO_BACKEND:
            backend = first_backend()
        if backend != "openvino" and any(s.streams > 1 for s in parsed.instances):
            raise InvalidRequest(f"layout {req['layout']!r} has streams, which only openvino runs",
                                 "add @openvino to the layout, or drop the sNN streams")
        layout = format_layout(parsed)
    if backend == AUTO_BACKEND and req["kind"] != "online":
        backend = first_backend()  # only an online deploy searches a layout
    kind = req["kind"]
    if kind == "offline":
        for key in ("input_dir", "output_dir"):
            if not Path(req[key]).is_absolute():
                raise InvalidRequest(f"{key} {req[key]!r} is relative", "pass an absolute path")
        if not Path(req["input_dir"]).is_dir():
            raise InvalidRequest(f"input directory {req['input_dir']} does not exist",
                                 "create it and put .npy/.npz inputs in it")
    if req.get("grpc_port") and req.get("grpc_port") == req.get("port"):
        raise InvalidRequest(f"grpc_port {req['grpc_port']} is also the REST port",
                             "give gRPC another port, or leave grpc_port out to get a free one")
    shapes, input_data = _checked_traffic(req)
    bind_address = _checked_bind_address(req.get("bind_address"), kind)
    precision = _checked_precision(req.get("precision"))
    _checked_in_child(check, str(model), backend, shapes, input_data)
    return InferenceRecord(name=req["name"], model=str(model), kind=kind, backend=backend,
                           shapes=shapes, input_data=input_data, bind_address=bind_address,
                           slo_ms=req.get("slo_ms"), rate_rps=req.get("rate_rps"), port=req.get("port"),
                           grpc_port=req.get("grpc_port"),
                           input_dir=req.get("input_dir"), output_dir=req.get("output_dir"),
                           max_batch=req.get("max_batch"), layout=layout or None, precision=precision)


def _checked_precision(asked: Any) -> str:
    from reamer.serve.spec import DEFAULT_PRECISION, PRECISION_FIX, PRECISIONS, canonical_precision

    if asked is None:
        return DEFAULT_PRECISION
    precision = canonical_precision(asked)
    if precision is None:
        raise InvalidRequest(f"precision {asked!r} is unknown: reamer runs {' or '.join(PRECISIONS)}",
                             PRECISION_FIX)
    return precision


def _checked_traffic(req: dict[str, Any]) -> tuple[dict[str, list[int]], str | None]:
    """The request's `shapes` and `input_data` as given (InvalidRequest names the field and the fix); the
    deploy check (_checked_in_child) checks them against the model."""
    from reamer.serve.samples import SampleError, SampleSpec, shapes_from_doc

    input_data = req.get("input_data")
    try:
        shapes = shapes_from_doc(req.get("shapes"))
        if input_data is not None:
            if not Path(input_data).is_absolute():
                raise InvalidRequest(f"input_data {input_data!r} is relative; the agent cannot know your directory",
                                     "pass an absolute path (the CLI does this for you)")
            if not Path(input_data).is_file():
                raise InvalidRequest(f"input_data file {input_data} does not exist on this node",
                                     "give a .npz of named arrays or a perf_analyzer JSON input-data file")
        SampleSpec(shapes=shapes, input_data=input_data)
    except SampleError as exc:
        raise InvalidRequest(exc.message, exc.fix) from None
    return {k: list(v) for k, v in shapes.items()}, input_data


def _checked_in_child(check: "DeployCheck | None", model: str, backend: str, shapes: dict[str, list[int]],
                      input_data: str | None) -> None:
    """The deploy check: the model opened by `backend` (when it names one: "auto" leaves that to the search,
    where only backends that ran the model can win; its graph is still read) and the traffic checked against
    its inputs, in a child process as the job's user (reamer.serve.deploy_check). InvalidRequest says what
    and the fix."""
    from reamer.serve.backends import BACKENDS
    from reamer.serve.deploy_check import DeployCheck, DeployRequest

    answer = (check or DeployCheck()).run(DeployRequest(model, backend if backend in BACKENDS else None,
                                                        shapes, input_data))
    if answer.problem is not None:
        raise InvalidRequest(answer.problem.message, answer.problem.fix)


def _checked_bind_address(address: str | None, kind: str) -> str | None:
    if address is None:
        return None
    import ipaddress

    if kind != "online":
        raise InvalidRequest("bind_address is for online jobs", "drop it, or deploy the job online")
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        raise InvalidRequest(f"bind_address {address!r} is not an IP address",
                             "give an address of this node, like 10.0.0.5, 127.0.0.1 or 0.0.0.0 (all)") from None


def host_address() -> tuple[str, str]:
    """(name, address) clients elsewhere reach this node by: the fully qualified host name when it resolves
    to an address of this node that is not loopback, else the address of the interface the default
    route leaves by."""
    import ipaddress

    name = socket.getfqdn()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        resolved = set()
    own = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    outside = sorted(a for a in resolved & own if not ipaddress.ip_address(a).is_loopback)
    if outside:
        return name, outside[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, the kernel only picks a route
            return probe.getsockname()[0], probe.getsockname()[0]
        except OSError:
            return "127.0.0.1", "127.0.0.1"  # no route anywhere: only this host can be a client


def client_url(bind_address: str, port: int) -> str:
    """http://HOST:PORT for clients: the bound address itself, or for 0.0.0.0 / :: (every interface) the
    host's name when it resolves to a non-loopback address of it, else its primary address (host_address)."""
    import ipaddress

    address = ipaddress.ip_address(bind_address)
    if address.is_unspecified:
        name, _ = host_address()
        return f"http://{name}:{port}"
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{port}"


def first_backend() -> str:
    """The backend "auto" means where nothing is searched: the first installed, in reamer's order."""
    return next(iter(installed_backends()), "onnxruntime")


def apply_choice(rec: InferenceRecord, choice: LayoutChoice | None, cpus: list[int]) -> None:
    """Use the chooser's layout, or refuse admission with the achievable rate. A layout that names its
    backend (chosen with "auto") sets the record's; "auto" with no layout chosen becomes `first_backend`."""
    try:
        _apply_choice(rec, choice, cpus)
    finally:
        if rec.backend == AUTO_BACKEND:
            rec.backend = first_backend()


def _apply_choice(rec: InferenceRecord, choice: LayoutChoice | None, cpus: list[int]) -> None:
    if choice is None:
        return
    if not choice.accepted:
        achievable = f"{choice.achievable_rps:.1f} rps" if choice.achievable_rps is not None else "less"
        raise AdmissionRefused(
            f"online job {rec.name!r} cannot serve {rec.rate_rps} rps within {rec.slo_ms} ms on the "
            f"{len(cpus)} free core(s): the best layout sustains {achievable}"
            + (f" ({choice.reason})" if choice.reason else ""),
            "lower --rate, relax --slo-ms, or free cores (detach training / remove other online jobs)",
            achievable_rps=choice.achievable_rps, layout=choice.layout)
    if choice.layout:
        from reamer.plan.layout import format_layout, parse_layout

        chosen = parse_layout(choice.layout)
        rec.backend = chosen.backend or rec.backend
        rec.layout = format_layout(chosen)
