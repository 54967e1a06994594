"""GpuManager: the agent's one handle on NVIDIA GPUs — MPS daemons, per-job limits, telemetry, policies.

How limits work (and why the API shows desired / applied / pending_restart):
- one MPS control daemon per GPU (pipe and log directories under `<run_dir>/mps/<id>/`), started
  with CUDA_VISIBLE_DEVICES=<uuid> and a default active-thread percentage of 100;
- a job's limits travel in the environment reamer hands back (`register_job(...)["env"]`):
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (can only lower the server's limit, hence the default of 100) and
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=<MB>M": inside its MPS server the GPU is device 0);
  server-wide commands (set_active_thread_percentage <server pid>) would hit every job of that user,
  so reamer does not use them for per-job limits;
- MPS fixes a client's limits when it connects. "applied" is what the job's running processes got:
  the limits reamer had issued when each process started (process start time vs issue time, in the
  same boot clock; a start in the same clock tick as a change counts as the older limits). A process that is not a client of
  the GPU's MPS server has no applied limits. pending_restart = running with limits != desired.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from reamer.gpu import policies
from reamer.gpu.config import GpuConfig
from reamer.gpu.errors import GpuError, LimitError, MpsError, NoGpuDriver, UnknownJob
from reamer.gpu.eviction import EvictionResult, execute_eviction
from reamer.gpu.mps import MpsDaemon, ServerInfo, find_control_binary, pinned_mem_env
from reamer.gpu.nvml import GpuInfo, GpuSample, Nvml
from reamer.gpu.state import JOBS_FILE, RECENT_EVENTS, GpuEvents, GpuState, JsonFileState, MemoryEvents
from reamer.host.identity import (ProcessIdentity, boot_clock, boot_id, is_running, process_alive, start_seconds,
                                  start_time)

JobKind = Literal["training", "inference"]
JOB_KINDS = ("training", "inference")
# Complement-rule changes smaller than this many points are ignored (no restart churn from noise).
COMPLEMENT_MIN_CHANGE_PCT = 5
# Samples (most recent) over which the online job's activity is predicted (its peak).
COMPLEMENT_WINDOW = 60
# A daemon that failed to start is retried after this many seconds (not on every tick).
DAEMON_RETRY_S = 30.0
# After a fault's evictions, how long to wait for the MPS server to notice that evicted clients exited.
FAULT_SETTLE_S = 3.0


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Limits:
    sm_percent: int
    mem_limit_mb: int | None = None


@dataclass(frozen=True)
class IssuedLimits:
    """Limits handed out in a job's environment at `boot_ts` (seconds since boot)."""

    boot_ts: float
    limits: Limits


@dataclass
class GpuJob:
    name: str
    gpu_uuid: str
    kind: str
    desired: Limits
    issued: list[IssuedLimits] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    state: str = "registered"  # registered | running | evicting | evicted
    message: str = ""
    recommended_sm_percent: int | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    owner_uid: int = 0  # who registered it (the API caller); only it or root may change or remove it
    # pid -> start time (field 22 of /proc/PID/stat) when it was registered: the process eviction and fault
    # handling may signal. A pid without one, or whose process now has another start time, is not the job's.
    pid_starts: dict[int, int] = field(default_factory=dict)

    def identities(self) -> dict[int, ProcessIdentity | None]:
        return {p: ProcessIdentity(p, self.pid_starts[p]) if p in self.pid_starts else None for p in self.pids}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "gpu_uuid": self.gpu_uuid, "kind": self.kind, "desired": asdict(self.desired),
                "issued": [{"boot_ts": i.boot_ts, "limits": asdict(i.limits)} for i in self.issued],
                "pids": self.pids, "pid_starts": {str(p): s for p, s in self.pid_starts.items()},
                "state": self.state, "message": self.message,
                "created_at": self.created_at, "updated_at": self.updated_at, "owner_uid": self.owner_uid}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GpuJob":
        return cls(name=d["name"], gpu_uuid=d["gpu_uuid"], kind=d["kind"], desired=Limits(**d["desired"]),
                   issued=[IssuedLimits(i["boot_ts"], Limits(**i["limits"])) for i in d.get("issued", [])],
                   pids=list(d.get("pids", [])), state=d.get("state", "registered"), message=d.get("message", ""),
                   created_at=d.get("created_at", time.time()), updated_at=d.get("updated_at", time.time()),
                   owner_uid=int(d.get("owner_uid", 0)),
                   pid_starts={int(p): int(s) for p, s in (d.get("pid_starts") or {}).items()})


@dataclass
class _GpuRuntime:
    info: GpuInfo
    daemon: MpsDaemon | None
    health: policies.HealthStatus = field(default_factory=policies.HealthStatus)
    servers: list[ServerInfo] = field(default_factory=list)
    daemon_error: str = ""
    previous_compute_mode: int | None = None
    fault_handling: bool = False  # a recovery is under way
    last_fault: str = ""
    # Server faults already handled: a server that stays in FAULT (its online clients have not exited
    # yet) must not trigger a new recovery on every tick. XIDs are one-shot events and always count.
    handled_server_faults: set[str] = field(default_factory=set)
    next_restart_at: float = 0.0  # monotonic time before which a dead daemon is not restarted again


class GpuManager:
    """NVIDIA MPS sharing for the agent. Thread-safe; every public method may be called from the API."""

    def __init__(self, config: GpuConfig | dict | None, run_dir: str | os.PathLike, nvml: Any | None = None,
                 state: GpuState | None = None, events: GpuEvents | None = None) -> None:
        """`state` and `events`: where registrations and events go — the agent's store and event log when the
        composition root builds it (reamer.node); `<run_dir>/gpu_jobs.json` and memory when used alone."""
        self.config = config if isinstance(config, GpuConfig) else GpuConfig.from_dict(config or {})
        self.run_dir = Path(run_dir)
        self._nvml = Nvml(nvml, history_len=self.config.history_len)
        self._state: GpuState = state or JsonFileState(self.run_dir / JOBS_FILE)
        self._lock = threading.RLock()
        self._gpus: dict[str, _GpuRuntime] = {}
        self._jobs: dict[str, GpuJob] = {}
        self._events: GpuEvents = events or MemoryEvents()
        self._threads: list[threading.Thread] = []
        self._control: str | None = None
        self._reason = "not started"
        self._started = False
        self._last_tick: float | None = None
        self._saved_compute_modes: dict[str, int] = {}
        self._last_saved = ""

    # ================================================================== lifecycle

    @property
    def available(self) -> bool:
        """True when NVML works (GPUs can be listed and sampled)."""
        return self._nvml.available

    @property
    def mps_available(self) -> bool:
        return self.available and self._control is not None

    def start(self) -> None:
        """Open NVML, start (or adopt) one MPS daemon per GPU, reload job registrations. Never raises
        for a missing driver or binary: status() says what is missing."""
        with self._lock:
            self._started = True
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._load_jobs()
            if not self.config.enabled:
                self._reason = "GPU management is disabled (gpu.enabled: false)"
                return
            reasons = []
            try:
                self._nvml.open()
            except NoGpuDriver as exc:
                reasons.append(exc.message)
            self._control = find_control_binary(self.config.mps_control_path) if self.config.manage_mps else None
            if self.config.manage_mps and self._control is None:
                reasons.append(f"nvidia-cuda-mps-control not found ({self.config.mps_control_path!r})")
            self._reason = "; ".join(reasons)
            if not self.available:
                return
            wanted = None
            if self.config.gpus is not None:
                wanted = {self._nvml.resolve(g).uuid for g in self.config.gpus}
            ids = self._short_ids([g.uuid for g in self._nvml.gpus()])
            for info in self._nvml.gpus():
                if wanted is not None and info.uuid not in wanted:
                    continue
                daemon = None
                if self.config.manage_mps:
                    base = self.run_dir / "mps" / ids[info.uuid]
                    daemon = MpsDaemon(info.uuid, base / "pipe", base / "log", self.config.mps_control_path,
                                       self.config.command_timeout_s)
                self._gpus[info.uuid] = _GpuRuntime(info, daemon)
            saved_modes = self._saved_compute_modes
            for rt in self._gpus.values():
                rt.previous_compute_mode = saved_modes.get(rt.info.uuid)
                if self.mps_available:
                    self._start_daemon(rt)
            self._save_jobs()

    def close(self) -> None:
        """Stop background evictions; stop the daemons only if gpu.stop_daemons_on_exit (jobs keep
        running under their MPS server across an agent restart otherwise)."""
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=30)
        with self._lock:
            if self.config.stop_daemons_on_exit:
                for rt in self._gpus.values():
                    self._stop_daemon(rt)
            self._save_jobs()
            self._nvml.close()
            self._started = False

    def stop_daemons(self) -> None:
        """Quit every MPS daemon reamer runs and restore the compute mode it changed."""
        with self._lock:
            for rt in self._gpus.values():
                self._stop_daemon(rt)

    def _start_daemon(self, rt: _GpuRuntime) -> None:
        assert rt.daemon is not None
        try:
            if self.config.exclusive_process and not rt.daemon.is_running():
                self._set_exclusive(rt)
            adopted = rt.daemon.is_running()
            pid = rt.daemon.start(self.config.default_active_thread_percentage)
            rt.daemon_error = ""
            self._event("mps_daemon_adopted" if adopted else "mps_daemon_started", gpu=rt.info.uuid,
                        message=f"MPS control daemon {pid} for GPU {rt.info.index} ({rt.info.uuid})")
        except GpuError as exc:
            rt.daemon_error = str(exc)
            self._event("mps_daemon_failed", gpu=rt.info.uuid, message=str(exc))

    def _stop_daemon(self, rt: _GpuRuntime) -> None:
        if rt.daemon is None or self._control is None:
            return
        try:
            if rt.daemon.stop():
                self._event("mps_daemon_stopped", gpu=rt.info.uuid, message=f"MPS daemon for GPU {rt.info.index} quit")
        except GpuError as exc:
            rt.daemon_error = str(exc)
            self._event("mps_daemon_failed", gpu=rt.info.uuid, message=str(exc))
            return
        if rt.previous_compute_mode is not None:
            try:
                self._nvml.set_compute_mode(rt.info.uuid, rt.previous_compute_mode)
                rt.previous_compute_mode = None
                self._save_jobs()
            except Exception as exc:
                self._event("compute_mode_failed", gpu=rt.info.uuid,
                            message=f"could not restore compute mode on GPU {rt.info.index}: {exc}")

    def _set_exclusive(self, rt: _GpuRuntime) -> None:
        mode = self._nvml.compute_mode(rt.info.uuid)
        target = self._nvml.exclusive_process_mode
        if mode == target:
            return
        try:
            self._nvml.set_compute_mode(rt.info.uuid, target)
        except Exception as exc:
            raise MpsError(f"could not set EXCLUSIVE_PROCESS compute mode on GPU {rt.info.index}: {exc}",
                           "run the agent as root, or set gpu.exclusive_process: false") from None
        if rt.previous_compute_mode is None:
            rt.previous_compute_mode = mode
            self._save_jobs()

    @staticmethod
    def _short_ids(uuids: list[str]) -> dict[str, str]:
        """Short directory names (MPS pipe paths must stay short): first 8 hex digits, unless they collide."""
        short = {u: u.removeprefix("GPU-").removeprefix("MIG-")[:8] for u in uuids}
        if len(set(short.values())) != len(short):
            return {u: u.removeprefix("GPU-") for u in uuids}
        return short

    # ================================================================== jobs

    def register_job(self, name: str, gpu: str | int, sm_percent: int, mem_limit_mb: int | None = None,
                     kind: JobKind = "training", pids: list[int] | None = None, owner_uid: int = 0,
                     pid_starts: dict[int, int] | None = None) -> dict[str, Any]:
        """Register a GPU job and return its view, including `env` to launch it with. Everything is
        validated before anything changes: a refused request leaves no trace. `pid_starts`: the start
        time of each pid as the caller checked it (missing ones are read now)."""
        with self._lock:
            self._validate_name(name)
            new_pids = _valid_pids(pids) if pids else []
            if name in self._jobs:
                raise LimitError(f"GPU job {name!r} is already registered",
                                 f"use update_job to change it, or remove_job {name!r} first")
            if kind not in JOB_KINDS:
                raise LimitError(f"unknown GPU job kind {kind!r}", f"use one of {', '.join(JOB_KINDS)}")
            rt = self._runtime(gpu)
            limits = self._validate_limits(rt, name, sm_percent, mem_limit_mb)
            if kind == "training" and self.config.policies.health and not rt.health.admits_offline():
                raise GpuError(f"GPU {rt.info.index} is {rt.health.state.value} "
                               f"({', '.join(rt.health.reasons) or 'no sample yet'}): no new offline GPU work is "
                               "admitted", "wait until `reamer gpu status` shows it healthy, or use another GPU")
            job = GpuJob(name, rt.info.uuid, kind, limits, owner_uid=owner_uid)
            job.issued.append(IssuedLimits(boot_clock(), limits))
            _set_pids(job, new_pids, pid_starts, new=True)
            self._refresh_job(job)
            self._jobs[name] = job
            self._refresh_job(job)
            self._save_jobs()
            self._event("gpu_job_registered", gpu=rt.info.uuid, job=name,
                        message=f"{kind} job {name} on GPU {rt.info.index}: {limits.sm_percent}% SM"
                                + (f", {limits.mem_limit_mb} MB pinned" if limits.mem_limit_mb else ""))
            return self._job_view(job)

    def update_job(self, name: str, sm_percent: int | None = None, mem_limit_mb: int | None = None,
                   pids: list[int] | None = None, clear_mem_limit: bool = False,
                   pid_starts: dict[int, int] | None = None) -> dict[str, Any]:
        """Change desired limits and/or the job's pids. New limits reach the job only when it restarts
        with the returned `env` (pending_restart says so)."""
        with self._lock:
            job = self._job(name)
            new_pids = _valid_pids(pids) if pids is not None else None
            rt = self._gpus.get(job.gpu_uuid) or self._runtime(job.gpu_uuid)
            changed = sm_percent is not None or mem_limit_mb is not None or clear_mem_limit
            limits = None
            if changed:
                new_sm = job.desired.sm_percent if sm_percent is None else sm_percent
                new_mem = None if clear_mem_limit else (job.desired.mem_limit_mb if mem_limit_mb is None else mem_limit_mb)
                limits = self._validate_limits(rt, name, new_sm, new_mem)
            if limits is not None:
                self._set_desired(job, limits)
            if new_pids is not None:
                _set_pids(job, new_pids, pid_starts, new=True)
                if job.state in ("evicted",) and job.pids:
                    job.state = "registered"
            job.updated_at = time.time()
            self._refresh_job(job)
            self._save_jobs()
            return self._job_view(job)

    def remove_job(self, name: str) -> dict[str, Any]:
        """Forget a job (its processes are not touched). Returns its last view."""
        with self._lock:
            job = self._job(name)
            view = self._job_view(job)
            del self._jobs[name]
            self._save_jobs()
            self._event("gpu_job_removed", gpu=job.gpu_uuid, job=name, message=f"GPU job {name} removed")
            return view

    def job(self, name: str) -> dict[str, Any]:
        with self._lock:
            job = self._job(name)
            self._refresh_job(job)
            return self._job_view(job)

    def jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            for job in self._jobs.values():
                self._refresh_job(job)
            return [self._job_view(j) for j in sorted(self._jobs.values(), key=lambda j: j.name)]

    def job_env(self, name: str) -> dict[str, str]:
        """Environment to (re)start the job with: its desired limits on its GPU's MPS server."""
        with self._lock:
            return self._env(self._job(name))

    def evict_job(self, name: str, reason: str = "requested", wait: bool = False) -> dict[str, Any]:
        """Graceful eviction of the job's processes: SIGTERM, wait, terminate_client, SIGKILL."""
        with self._lock:
            job = self._job(name)
            self._start_eviction(job, reason)
            thread = self._threads[-1] if self._threads else None
        if wait and thread is not None:
            thread.join()
        return self.job(name)

    # ---------------------------------------------------------------- job internals

    @staticmethod
    def _validate_name(name: str) -> None:
        if not isinstance(name, str) or not name or len(name) > 128 or any(c.isspace() or c == "/" for c in name):
            raise LimitError(f"invalid GPU job name {name!r}",
                             "use 1-128 characters without spaces or '/'")

    def _job(self, name: str) -> GpuJob:
        job = self._jobs.get(name)
        if job is None:
            raise UnknownJob(f"no GPU job named {name!r}",
                             f"registered GPU jobs: {', '.join(sorted(self._jobs)) or 'none'}")
        return job

    def _require_gpu(self) -> None:
        if not self.config.enabled:
            raise NoGpuDriver("GPU management is disabled (gpu.enabled: false)",
                              "set gpu.enabled: true in the config and restart the agent")
        if not self.available:
            raise NoGpuDriver(f"cannot serve a GPU request: {self._reason or 'NVML not opened'}",
                              "install the NVIDIA driver and its compute utilities (nvidia-smi and "
                              "nvidia-cuda-mps-control must work), or run the job without reamer's GPU controls")
        if self.config.manage_mps and self._control is None:
            raise NoGpuDriver(f"nvidia-cuda-mps-control not found ({self.config.mps_control_path!r}): MPS limits "
                              "cannot be enforced", "install the NVIDIA compute utilities or set gpu.mps_control_path")

    def _runtime(self, gpu: str | int) -> _GpuRuntime:
        self._require_gpu()
        info = self._nvml.resolve(gpu)
        rt = self._gpus.get(info.uuid)
        if rt is None:
            raise LimitError(f"GPU {info.index} ({info.uuid}) is not managed by reamer",
                             "add it to gpu.gpus in the config, or pick a managed GPU")
        return rt

    def _validate_limits(self, rt: _GpuRuntime, name: str, sm_percent: Any, mem_limit_mb: Any) -> Limits:
        if isinstance(sm_percent, bool) or not isinstance(sm_percent, int) or not 1 <= sm_percent <= 100:
            raise LimitError(f"sm_percent must be a whole number from 1 to 100, got {sm_percent!r}",
                             "pass the job's share of the GPU's SMs in percent, e.g. 30")
        if mem_limit_mb is not None and (isinstance(mem_limit_mb, bool) or not isinstance(mem_limit_mb, int)
                                         or mem_limit_mb < 1):
            raise LimitError(f"mem_limit_mb must be a positive whole number of MB, got {mem_limit_mb!r}",
                             "pass the pinned device-memory limit in MB, or leave it out")
        total = rt.info.memory_total_mb
        if mem_limit_mb is not None and total and mem_limit_mb > total:
            raise LimitError(f"mem_limit_mb {mem_limit_mb} is more than GPU {rt.info.index} has ({total:.0f} MB)",
                             f"ask for at most {total:.0f} MB")
        if not self.config.allow_oversubscription:
            others = {j.name: j.desired.sm_percent for j in self._jobs.values()
                      if j.gpu_uuid == rt.info.uuid and j.name != name}
            problem = policies.sm_budget_problem(others, name, sm_percent, str(rt.info.index))
            if problem:
                raise LimitError(problem, "lower sm_percent, update or remove another job on this GPU, use "
                                          "another GPU, or set gpu.allow_oversubscription: true")
            if mem_limit_mb is not None and total:
                used = sum(j.desired.mem_limit_mb or 0 for j in self._jobs.values()
                           if j.gpu_uuid == rt.info.uuid and j.name != name)
                if used + mem_limit_mb > total:
                    raise LimitError(f"pinned memory limits on GPU {rt.info.index} would add up to "
                                     f"{used + mem_limit_mb} MB, more than its {total:.0f} MB",
                                     f"ask for at most {max(0, int(total - used))} MB, or set "
                                     "gpu.allow_oversubscription: true")
        return Limits(int(sm_percent), None if mem_limit_mb is None else int(mem_limit_mb))

    def _set_desired(self, job: GpuJob, limits: Limits) -> None:
        if limits == job.desired:
            return
        job.desired = limits
        job.issued.append(IssuedLimits(boot_clock(), limits))
        job.issued = job.issued[-20:]
        job.updated_at = time.time()

    def _env(self, job: GpuJob) -> dict[str, str]:
        rt = self._gpus.get(job.gpu_uuid)
        env = {"CUDA_VISIBLE_DEVICES": job.gpu_uuid,
               "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(job.desired.sm_percent)}
        if rt is not None and rt.daemon is not None:
            env.update(rt.daemon.env())
        if job.desired.mem_limit_mb:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = pinned_mem_env({0: job.desired.mem_limit_mb})
        return env

    def _mps_clients(self, rt: _GpuRuntime | None) -> set[int] | None:
        if rt is None or rt.daemon is None:
            return None
        return {c for s in rt.servers for c in s.clients}

    def _applied(self, job: GpuJob) -> tuple[Limits | None, str, str]:
        """What the job's live processes got from MPS (see the module docstring): (applied limits or
        None, note, limits_state) with limits_state one of not_running / not_connected / applied /
        pending_restart."""
        live = [p for p in job.pids if _job_process_alive(job, p)]
        if not live:
            return None, ("not running: the limits apply when it starts with `env`" if job.state != "evicted"
                          else job.message), "not_running"
        clients = self._mps_clients(self._gpus.get(job.gpu_uuid))
        got: set[Limits | None] = set()
        notes = []
        unconnected = 0
        for pid in live:
            if clients is not None and pid not in clients:
                unconnected += 1
                notes.append(f"process {pid} is not a client of this GPU's MPS server yet (CUDA not started, or "
                             "launched without reamer's env)")
                continue
            start = start_seconds(pid)
            version = None
            for i, issued in enumerate(job.issued):
                # The start time is truncated to a clock tick. Within that tick the order is unknown:
                # for a change of limits count it as the older ones (never claim a change took
                # effect); for the first limits count it as after (no reamer env existed before).
                slack = _TICK_S if i == 0 else 0.0
                if start is not None and issued.boot_ts <= start + slack:
                    version = issued.limits
            if version is None:
                notes.append(f"process {pid} started before reamer issued its limits: restart it with `env`")
            got.add(version)
        applied = next(iter(got)) if len(got) == 1 else None
        if len(got) > 1:
            notes.append("the job's processes run with different limits: restart it with `env`")
        if got and got != {job.desired}:
            if applied is not None:
                notes.append("limits changed since the job started: restart it with `env` to apply them")
            return applied, "; ".join(notes), "pending_restart"
        return applied, "; ".join(notes), "not_connected" if unconnected else "applied"

    def _refresh_job(self, job: GpuJob) -> None:
        live = [p for p in job.pids if _job_process_alive(job, p)]
        if job.state == "running" and not live:
            job.state = "registered"
        elif job.state == "registered" and live:
            job.state = "running"

    def _job_view(self, job: GpuJob) -> dict[str, Any]:
        applied, note, limits_state = self._applied(job)
        rt = self._gpus.get(job.gpu_uuid)
        return {
            "name": job.name, "gpu": job.gpu_uuid, "gpu_index": rt.info.index if rt else None, "kind": job.kind,
            "state": job.state, "pids": list(job.pids), "desired": asdict(job.desired),
            "applied": asdict(applied) if applied is not None else None, "limits_state": limits_state,
            "pending_restart": limits_state == "pending_restart", "note": note,
            "recommended_sm_percent": job.recommended_sm_percent, "env": self._env(job), "message": job.message,
            "created_at": job.created_at, "updated_at": job.updated_at, "owner_uid": job.owner_uid,
        }

    # ================================================================== tick: sample + policies

    def tick(self, now: float | None = None) -> dict[str, Any]:
        """Sample NVML, repair daemons, refresh MPS servers/clients, run the enabled policies.
        Call about every gpu.sample_interval_s. Returns a short summary."""
        with self._lock:
            now = time.time() if now is None else now
            self._last_tick = now
            if not self._started or not self.available:
                return {"available": False, "reason": self._reason}
            samples = {s.uuid: s for s in self._nvml.sample()}
            for uuid, rt in self._gpus.items():
                self._refresh_servers(rt)
            for job in self._jobs.values():
                if job.state != "evicting":
                    _set_pids(job, [p for p in job.pids if _job_process_alive(job, p)])
                self._refresh_job(job)
            pol = self.config.policies
            for uuid, rt in self._gpus.items():
                sample = samples.get(uuid)
                if pol.fault_handling:
                    self._handle_faults(rt, sample)
                if pol.health:
                    self._step_health(rt, sample, now)
                if pol.complement:
                    self._complement(rt)
            self._save_jobs()
            return {"available": True, "gpus": {u: rt.health.state.value for u, rt in self._gpus.items()},
                    "events": len(self._events.recent(RECENT_EVENTS))}

    def _refresh_servers(self, rt: _GpuRuntime) -> None:
        if rt.daemon is None or self._control is None:
            return
        if not rt.daemon.is_running() and not rt.fault_handling and time.monotonic() >= rt.next_restart_at:
            self._event("mps_daemon_missing", gpu=rt.info.uuid,
                        message=f"MPS control daemon for GPU {rt.info.index} is not running: restarting it")
            self._start_daemon(rt)
            if not rt.daemon.is_running():  # retry later, not on every tick
                rt.next_restart_at = time.monotonic() + DAEMON_RETRY_S
        try:
            rt.servers = rt.daemon.servers() if rt.daemon.is_running() else []
            rt.daemon_error = "" if rt.daemon.is_running() else rt.daemon_error
        except GpuError as exc:
            rt.daemon_error = str(exc)

    def _step_health(self, rt: _GpuRuntime, sample: GpuSample | None, now: float) -> None:
        th = self.config.policies.health_thresholds
        metrics = None
        if sample is not None:
            metrics = policies.HealthMetrics(sample.util_pct, sample.memory_pct, sample.sm_clock_pct)
        daemon_ok = rt.daemon is None or rt.daemon.is_running()
        before = rt.health.state
        rt.health = policies.step_health(rt.health, metrics, th, now, available=daemon_ok)
        if rt.health.state is not before:
            self._event("gpu_health", gpu=rt.info.uuid,
                        message=f"GPU {rt.info.index}: {before.value} -> {rt.health.state.value}"
                                + (f" ({', '.join(rt.health.reasons)})" if rt.health.reasons else ""))
        if rt.health.must_evict_offline() and self.config.policies.evict_on_overlimit:
            for job in self._offline_jobs(rt):
                self._start_eviction(job, f"GPU {rt.info.index} over limit ({', '.join(rt.health.reasons)})")

    def _offline_jobs(self, rt: _GpuRuntime) -> list[GpuJob]:
        return [j for j in self._jobs.values() if j.gpu_uuid == rt.info.uuid and j.kind == "training"
                and j.state not in ("evicting",) and any(_job_process_alive(j, p) for p in j.pids)]

    def _complement(self, rt: _GpuRuntime) -> None:
        online = [j for j in self._jobs.values() if j.gpu_uuid == rt.info.uuid and j.kind == "inference"]
        offline = [j for j in self._jobs.values() if j.gpu_uuid == rt.info.uuid and j.kind == "training"]
        if len(online) != 1 or not offline:
            return
        pids = set(online[0].pids)
        history = self._nvml.history(rt.info.uuid)[-COMPLEMENT_WINDOW:]
        activity = [sum(p.sm_util_pct or 0 for p in s.processes if p.pid in pids) for s in history
                    if any(p.pid in pids and p.sm_util_pct is not None for p in s.processes)]
        if not activity:
            return  # no per-process SM samples for the online job yet: nothing to predict from
        pol = self.config.policies
        plan = policies.complement_plan(max(activity), len(offline), pol.complement_headroom_pct,
                                        pol.inference_margin_pct, pol.training_floor_pct)
        online[0].recommended_sm_percent = plan.online_pct
        for j in offline:
            j.recommended_sm_percent = plan.offline_pct_each
        if not plan.feasible and not self.config.allow_oversubscription:
            rt.last_fault = plan.reason
            return
        changes = []
        for job, pct in [(online[0], plan.online_pct)] + [(j, plan.offline_pct_each) for j in offline]:
            if abs(job.desired.sm_percent - pct) >= COMPLEMENT_MIN_CHANGE_PCT:
                changes.append((job, pct))
        # Lower shares first so the GPU's total never passes 100 % mid-way.
        for job, pct in sorted(changes, key=lambda c: c[1] - c[0].desired.sm_percent):
            self._set_desired(job, Limits(pct, job.desired.mem_limit_mb))
        if changes:
            self._event("gpu_complement", gpu=rt.info.uuid,
                        message=f"GPU {rt.info.index}: online activity peak {max(activity):.0f}% -> "
                                + ", ".join(f"{j.name}={p}%" for j, p in changes) + " (applies on restart)")

    # ---------------------------------------------------------------- faults

    def _handle_faults(self, rt: _GpuRuntime, sample: GpuSample | None) -> None:
        statuses = {s.pid: s.status for s in rt.servers}
        report = policies.detect_fault(statuses, sample.xids if sample else ())
        server_reasons = {r for r in report.reasons if r.startswith("MPS server")}
        cleared = sorted(rt.handled_server_faults - server_reasons)
        if cleared:
            self._event("gpu_fault_cleared", gpu=rt.info.uuid,
                        message=f"GPU {rt.info.index}: no longer FAULT ({'; '.join(cleared)}): its clients have "
                                "exited and MPS accepts new clients again")
        rt.handled_server_faults &= server_reasons  # forget servers that have recovered or gone
        new = [r for r in report.reasons if r not in rt.handled_server_faults]
        if not new or rt.fault_handling:
            return
        rt.handled_server_faults |= server_reasons
        rt.fault_handling = True
        rt.last_fault = ", ".join(new)
        self._event("gpu_fault", gpu=rt.info.uuid,
                    message=f"GPU {rt.info.index}: fatal fault ({rt.last_fault}); MPS refuses new clients until "
                            "every client of the faulted server has exited: stopping offline clients")
        offline = self._offline_jobs(rt)
        for job in offline:
            job.state = "evicting"
            job.message = f"evicting: GPU fault ({rt.last_fault})"
        t = threading.Thread(target=self._recover, args=(rt, offline), name=f"gpu-fault-{rt.info.index}", daemon=True)
        self._threads.append(t)
        t.start()

    def _recover(self, rt: _GpuRuntime, offline: list[GpuJob]) -> None:
        for job in offline:
            self._evict_now(job, f"GPU fault ({rt.last_fault})")
        # Seen on an H100 (driver 580): every client of the faulted server gets the sticky error, the server
        # stays FAULT while any of them is connected and turns ACTIVE again (same pid) once the last one has
        # exited. `quit` would block until then, so the daemon is restarted only for a server that is
        # still FAULT with no clients left.
        if rt.daemon is not None and self._control:
            self._settle_after_exits(rt.daemon)
        with self._lock:
            stopped = f"{len(offline)} offline job(s) stopped after fault ({rt.last_fault})"
            try:
                faulted: list[ServerInfo] = []
                if rt.daemon is not None and self._control:
                    rt.servers = rt.daemon.servers()
                    faulted = [s for s in rt.servers if "FAULT" in s.status.upper()]
                left = sorted({c for s in faulted for c in s.clients})
                if left:
                    owners = sorted(j.name for j in self._jobs.values() if set(j.pids) & set(left))
                    self._event("gpu_fault_handled", gpu=rt.info.uuid,
                                message=f"GPU {rt.info.index}: {stopped}; MPS server "
                                        f"{', '.join(str(s.pid) for s in faulted)} stays FAULT until its clients "
                                        f"{', '.join(map(str, left))}"
                                        + (f" (jobs {', '.join(owners)})" if owners else "")
                                        + " exit: their CUDA contexts hold the fault, so restart them")
                elif faulted and self.config.policies.restart_daemon_on_fault:
                    rt.daemon.stop()
                    rt.daemon.start(self.config.default_active_thread_percentage)
                    rt.servers = rt.daemon.servers()
                    self._event("gpu_fault_recovered", gpu=rt.info.uuid,
                                message=f"GPU {rt.info.index}: {stopped}; the MPS server stayed FAULT without "
                                        "clients: MPS daemon restarted")
                elif not faulted and "MPS server" in rt.last_fault:
                    self._event("gpu_fault_recovered", gpu=rt.info.uuid,
                                message=f"GPU {rt.info.index}: {stopped}; its clients have exited and the MPS "
                                        "server is ACTIVE again")
                else:
                    self._event("gpu_fault_handled", gpu=rt.info.uuid, message=f"GPU {rt.info.index}: {stopped}")
                # Reported here: the next tick must not announce these as cleared again.
                rt.handled_server_faults &= {f"MPS server {s.pid} is FAULT" for s in rt.servers
                                             if "FAULT" in s.status.upper()}
            except GpuError as exc:
                rt.daemon_error = str(exc)
                self._event("gpu_fault_recovery_failed", gpu=rt.info.uuid, message=str(exc))
            finally:
                rt.fault_handling = False

    @staticmethod
    def _settle_after_exits(daemon: MpsDaemon) -> None:
        """Wait (up to FAULT_SETTLE_S) until a faulted server no longer lists clients that have exited:
        MPS notices an exit a moment after it happens."""
        deadline = time.monotonic() + FAULT_SETTLE_S
        while time.monotonic() < deadline:
            try:
                faulted = [s for s in daemon.servers() if "FAULT" in s.status.upper()]
            except GpuError:
                return
            if not any(not process_alive(c) for s in faulted for c in s.clients):
                return
            time.sleep(0.1)

    # ---------------------------------------------------------------- eviction

    def _start_eviction(self, job: GpuJob, reason: str) -> None:
        if job.state == "evicting" or not any(_job_process_alive(job, p) for p in job.pids):
            return
        job.state = "evicting"
        job.message = f"evicting: {reason}"
        self._threads = [t for t in self._threads if t.is_alive()]
        t = threading.Thread(target=self._evict_now, args=(job, reason), name=f"gpu-evict-{job.name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _evict_now(self, job: GpuJob, reason: str) -> EvictionResult:
        with self._lock:
            rt = self._gpus.get(job.gpu_uuid)
            daemon = rt.daemon if rt is not None and self._control else None
            server = None
            if rt is not None:
                server = next((s for s in rt.servers if set(s.clients) & set(job.pids)), None)
            pol = self.config.policies
            # terminate_client only for the server's clients (a job may list non-CUDA processes too).
            steps = policies.eviction_plan(job.pids, server.pid if server else None, pol.eviction_grace_s,
                                           pol.eviction_kill_after_s, server.clients if server else None)
            job.state = "evicting"
            identities = job.identities()
        # Outside the lock: this waits for processes to exit. Only the registered processes are signalled.
        result = execute_eviction(steps, daemon.terminate_client if daemon else None, identities=identities)
        with self._lock:
            job.state = "evicted"
            _set_pids(job, result.survivors)
            job.message = (f"evicted ({reason}): " + "; ".join(result.log)
                           + (f"; still alive: {result.survivors}" if result.survivors else ""))
            job.updated_at = time.time()
            self._save_jobs()
            self._event("gpu_job_evicted", gpu=job.gpu_uuid, job=job.name, message=f"{job.name} {job.message}",
                        eviction=result.to_dict())
        return result

    # ================================================================== reporting

    def status(self) -> dict[str, Any]:
        """Everything `reamer gpu status` / GET /v1/gpus shows: GPUs, daemons, servers, clients, jobs."""
        with self._lock:
            out: dict[str, Any] = {
                "enabled": self.config.enabled, "available": self.available, "mps_available": self.mps_available,
                "reason": self._reason, "mps_control": self._control,
                "policies": {k: getattr(self.config.policies, k) for k in ("complement", "health", "fault_handling")},
                "allow_oversubscription": self.config.allow_oversubscription,
                "sample_interval_s": self.config.sample_interval_s,
                "gpus": [], "jobs": self.jobs(), "events": self._events.recent(20),
                "last_tick": self._last_tick,
            }
            for rt in sorted(self._gpus.values(), key=lambda r: r.info.index):
                jobs_here = [j for j in self._jobs.values() if j.gpu_uuid == rt.info.uuid]
                latest = self._nvml.latest(rt.info.uuid)
                d = rt.daemon
                out["gpus"].append({
                    **rt.info.to_dict(),
                    "health": rt.health.to_dict(),
                    "daemon": None if d is None else {
                        "running": d.is_running(), "pid": d.pid(), "pipe_dir": str(d.pipe_dir),
                        "log_dir": str(d.log_dir), "error": rt.daemon_error},
                    "servers": [s.to_dict() for s in rt.servers],
                    "compute_mode_to_restore": rt.previous_compute_mode,
                    "sm_percent_desired_total": sum(j.desired.sm_percent for j in jobs_here),
                    "mem_limit_mb_desired_total": sum(j.desired.mem_limit_mb or 0 for j in jobs_here),
                    "jobs": sorted(j.name for j in jobs_here),
                    "xid_events_supported": self._nvml.xid_supported.get(rt.info.uuid, False),
                    "xid_events": self._nvml.xid_counts.get(rt.info.uuid, 0),
                    "last_fault": rt.last_fault,
                    "latest": latest.to_dict() if latest else None,
                })
            return out

    def telemetry(self, gpu: str | int | None = None) -> dict[str, Any]:
        """Sample history per GPU (bounded by gpu.history_len) for the API."""
        with self._lock:
            if not self.available:
                return {"available": False, "reason": self._reason, "gpus": {}}
            uuids = [self._nvml.resolve(gpu).uuid] if gpu is not None else list(self._gpus)
            return {"available": True, "interval_s": self.config.sample_interval_s,
                    "gpus": {u: {"index": self._gpus[u].info.index if u in self._gpus else None,
                                 "samples": [s.to_dict() for s in self._nvml.history(u)]} for u in uuids}}

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._events.recent(RECENT_EVENTS)

    def collector(self) -> "GpuCollector":
        """A prometheus_client collector; register it with the agent's registry."""
        return GpuCollector(self)

    def prometheus_text(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest
        registry = CollectorRegistry()
        registry.register(self.collector())
        return generate_latest(registry).decode()

    def recommend_share(self, gpu_pcts: list[float], p99_ms: list[float], slo_ms: float,
                        margin_pct: int | None = None) -> dict[str, Any]:
        """Mudi: fit p99-vs-GPU% samples and pick the smallest share meeting the SLO plus a margin."""
        model = policies.fit_piecewise_linear(gpu_pcts, p99_ms)
        margin = self.config.policies.inference_margin_pct if margin_pct is None else margin_pct
        choice = policies.smallest_share(model, slo_ms, margin)
        return {"model": model.to_dict(), "share_pct": choice.share_pct, "base_pct": choice.base_pct,
                "predicted_p99_ms": choice.predicted_p99_ms}

    def _event(self, kind: str, message: str, gpu: str | None = None, job: str | None = None, **extra: Any) -> None:
        ev = {"ts": time.time(), "kind": kind, "gpu": gpu, "job": job, "message": message, **extra}
        try:
            self._events.emit(ev)
        except Exception:  # noqa: BLE001
            pass  # the event log is best effort; never break GPU control for it

    # ================================================================== persistence

    def _load_jobs(self) -> None:
        try:
            data = self._state.load()
            if data is None:
                return
            jobs = [GpuJob.from_json(d) for d in data.get("jobs", [])]
        except (ValueError, KeyError, TypeError) as exc:
            where = self._state.location  # (after load: the agent's store names the old file it read)
            raise GpuError(f"cannot read GPU job registrations from {where}: {exc}",
                           f"fix or remove {where} (jobs must then be registered again)") from None
        if data.get("boot_id") != boot_id():
            # Boot-clock stamps from another boot mean nothing now: the newest limits count from boot.
            for j in jobs:
                j.issued = [IssuedLimits(0.0, j.desired)]
                _set_pids(j, [])
        self._jobs = {j.name: j for j in jobs}
        self._saved_compute_modes = {k: int(v) for k, v in data.get("compute_modes", {}).items()}

    def _save_jobs(self) -> None:
        if not self._started:
            return
        modes = {u: rt.previous_compute_mode for u, rt in self._gpus.items() if rt.previous_compute_mode is not None}
        data = {"version": 1, "boot_id": boot_id(), "jobs": [j.to_json() for j in self._jobs.values()],
                "compute_modes": modes}
        text = json.dumps(data, indent=1, sort_keys=True)
        if text != self._last_saved:  # tick() calls this every second: write (and fsync) only changes
            self._state.save(data)
            self._last_saved = text


def _set_pids(job: GpuJob, pids: list[int], starts: dict[int, int] | None = None, new: bool = False) -> None:
    """The job's pids, each with the start time of its registered process: the one given (as the caller
    checked it), else for a `new` registration the one there now, else the one recorded before. A pid
    without one (it runs nothing) is never signalled."""
    recorded = {}
    for pid in pids:
        start = (starts or {}).get(pid)
        if start is None:
            start = start_time(pid) if new else job.pid_starts.get(pid)
        if start is not None:
            recorded[pid] = start
    job.pids = list(pids)
    job.pid_starts = recorded


def _job_process_alive(job: GpuJob, pid: int) -> bool:
    """The job's registered process at `pid` is running (not another process that took its pid)."""
    start = job.pid_starts.get(pid)
    return start is not None and is_running(ProcessIdentity(pid, start)) and process_alive(pid)


def _valid_pids(pids: Iterable[Any]) -> list[int]:
    """Sorted distinct pids, each a positive integer no larger than the kernel's pid_max."""
    from reamer.host.identity import pid_max

    limit = pid_max()
    found = set()
    for pid in pids:
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= limit:
            raise LimitError(f"pid {pid!r} is not a process id (1..{limit})", "give the pids of the job's processes")
        found.add(pid)
    return sorted(found)


class GpuCollector:
    """Prometheus collector over a GpuManager (latest sample, health, daemons, per-job limits)."""

    def __init__(self, manager: GpuManager) -> None:
        self.manager = manager

    def describe(self) -> Iterable[Any]:
        return []  # unchecked collector: metric families vary with the GPUs present

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.manager.status()
        up = GaugeMetricFamily("reamer_gpu_available", "1 if NVML works on this node", value=1 if st["available"] else 0)
        yield up
        gauges = {
            "util_pct": GaugeMetricFamily("reamer_gpu_utilization_percent", "Percent of time a kernel ran (NVML)",
                                          labels=["gpu", "uuid"]),
            "memory_used_mb": GaugeMetricFamily("reamer_gpu_memory_used_bytes", "Device memory in use",
                                                labels=["gpu", "uuid"]),
            "memory_total_mb": GaugeMetricFamily("reamer_gpu_memory_total_bytes", "Device memory",
                                                 labels=["gpu", "uuid"]),
            "sm_clock_mhz": GaugeMetricFamily("reamer_gpu_sm_clock_hertz", "SM clock", labels=["gpu", "uuid"]),
            "power_w": GaugeMetricFamily("reamer_gpu_power_watts", "Board power draw", labels=["gpu", "uuid"]),
        }
        scale = {"memory_used_mb": 1024 * 1024, "memory_total_mb": 1024 * 1024, "sm_clock_mhz": 1e6}
        proc_mem = GaugeMetricFamily("reamer_gpu_process_memory_bytes", "Device memory per process",
                                     labels=["gpu", "pid"])
        xids = CounterMetricFamily("reamer_gpu_xid_events", "Critical XID events seen", labels=["gpu", "uuid"])
        health = GaugeMetricFamily("reamer_gpu_health_state", "1 for the GPU's current SysMonitor state",
                                   labels=["gpu", "state"])
        daemon = GaugeMetricFamily("reamer_gpu_mps_daemon_up", "1 if the GPU's MPS control daemon runs",
                                   labels=["gpu"])
        for g in st["gpus"]:
            idx, uuid = str(g["index"]), g["uuid"]
            latest = g["latest"] or {}
            for key, fam in gauges.items():
                value = latest.get(key)
                if value is not None:
                    fam.add_metric([idx, uuid], value * scale.get(key, 1))
            for p in latest.get("processes", []):
                if p.get("used_memory_mb") is not None:
                    proc_mem.add_metric([idx, str(p["pid"])], p["used_memory_mb"] * 1024 * 1024)
            xids.add_metric([idx, uuid], g["xid_events"])
            for state in policies.HealthState:
                health.add_metric([idx, state.value], 1 if g["health"]["state"] == state.value else 0)
            if g["daemon"] is not None:
                daemon.add_metric([idx], 1 if g["daemon"]["running"] else 0)
        yield from gauges.values()
        yield from (proc_mem, xids, health, daemon)
        limits = GaugeMetricFamily("reamer_gpu_job_sm_percent", "A GPU job's SM share (active-thread percentage)",
                                   labels=["job", "gpu", "kind", "which"])
        pending = GaugeMetricFamily("reamer_gpu_job_pending_restart", "1 if the job runs with other limits than desired",
                                    labels=["job", "gpu"])
        for j in st["jobs"]:
            gpu = str(j["gpu_index"])
            limits.add_metric([j["name"], gpu, j["kind"], "desired"], j["desired"]["sm_percent"])
            if j["applied"] is not None:
                limits.add_metric([j["name"], gpu, j["kind"], "applied"], j["applied"]["sm_percent"])
            pending.add_metric([j["name"], gpu], 1 if j["pending_restart"] else 0)
        yield limits
        yield pending
