"""Supervise inference jobs: placement, JobSpec files, job processes, their status and events.

Each job runs as `python -m reamer.serve.job --spec <run_dir>/jobs/<name>/spec.json` in its own
session, so it survives an agent restart; the agent re-attaches by pid (checked against
/proc/<pid>/cmdline). A placement change rewrites the spec and sends SIGHUP; an online job that
loses its cores is stopped and waits (state "pending") until cores are free again.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import psutil

from reamer.agent.errors import AdmissionRefused, InvalidRequest
from reamer.host.errors import ReamerError
from reamer.serve.spec import EVENTS_FILE, STATUS_FILE, InstanceSpec, JobSpec, JobStatus, read_events

if TYPE_CHECKING:
    from reamer.serve.samples import SampleSpec

log = logging.getLogger("reamer.inference")

DEFAULT_BATCH = 4
DEFAULT_BIND_ADDRESS = "0.0.0.0"  # online front doors listen on every interface, as Triton and KServe do
STOP_TIMEOUT_S = 5.0
LEAVE_TIMEOUT_S = 5.0
FORWARDED_EVENTS = ("overload", "frontdoor_saturated", "worker_crashed", "worker_restarted", "done", "failed")

EmitFn = Callable[..., Any]  # emit(kind, message, job=None, data=None)


# --- layout choice (pluggable) -----------------------------------------------------------------

@dataclass
class LayoutChoice:
    """What a layout chooser decided for an online job on the given cores."""

    layout: str | None  # None: no opinion (the default: one instance over all free cores)
    accepted: bool = True
    achievable_rps: float | None = None
    reason: str = ""


# choose_layout(model, backend, cpus, slo_ms, rate_rps) -> LayoutChoice | None
LayoutChooser = Callable[[str, str, list[int], "float | None", "float | None"], "LayoutChoice | None"]


def load_chooser(spec: str | None, profile_dir: str | Path, config: Any = None) -> LayoutChooser:
    """A chooser from "module:function", or the built-in profile-cache chooser. `config` (the agent's
    InferenceConfig) switches on the measured search on deploy for the built-in one."""
    if not spec:
        return ProfileCacheChooser(profile_dir, search=SearchOnDeploy.from_config(config))
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ReamerError(f"inference.layout_chooser {spec!r} cannot be loaded: {exc}",
                          "give an importable 'module:function', or remove the key") from None


def choose_for(chooser: LayoutChooser, rec: "InferenceRecord", cpus: list[int]) -> "LayoutChoice | None":
    """Ask `chooser` for the layout of `rec` on `cpus`, also passing the job's max batch, traffic (shapes and
    sample data) and precision as the keywords `max_batch`, `samples` and `precision` to a chooser that takes
    them (the built-in one does; a custom one written for the five positional arguments still works)."""
    offered = {"max_batch": rec.max_batch, "samples": rec.samples(), "precision": rec.precision}
    return chooser(rec.model, rec.backend, cpus, rec.slo_ms, rec.rate_rps, **_keywords_taken(chooser, offered))


def _keywords_taken(fn: Callable, offered: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: the five positional arguments only
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


@dataclass(frozen=True)
class SearchOnDeploy:
    """How the built-in chooser measures a layout when no cached profile covers the free cpus."""

    budget_s: float = 90.0
    max_batch: int = 32
    warmup_s: float = 0.5
    window_s: float = 0.25

    @classmethod
    def from_config(cls, config: Any) -> "SearchOnDeploy | None":
        if config is None or not getattr(config, "search_on_deploy", False):
            return None
        return cls(budget_s=config.search_budget_s, max_batch=config.search_max_batch,
                   warmup_s=config.search_warmup_s, window_s=config.search_window_s)


class ProfileCacheChooser:
    """Cached profile -> plan_from_profile -> admit (no measuring, well under 100 ms).

    Without a cached profile that covers the free cpus it runs the layout search on exactly those
    cpus when `search` is set (they are idle at deploy; the searches of concurrent deploys take
    turns), caches the points, and admits on the best measured layout. Without `search`, or when
    the search cannot measure, it has no opinion (`reamer search MODEL` fills the cache)."""

    def __init__(self, profile_dir: str | Path, search: SearchOnDeploy | None = None,
                 margin: float = 0.10) -> None:
        self.profile_dir = Path(profile_dir)
        self.search = search
        self.margin = margin
        self._searching = threading.Lock()

    def __call__(self, model: str, backend: str, cpus: list[int], slo_ms: float | None,
                 rate_rps: float | None, *, max_batch: int | None = None,
                 samples: "SampleSpec | None" = None, precision: str = "f32") -> LayoutChoice | None:
        """`max_batch`: the job's largest batch (None: up to the configured search_max_batch). `samples`: the
        traffic's shapes and data (profiles are cached per traffic). `precision`: the job's (profiles of
        OpenVINO at bf16 are cached apart from f32 ones)."""
        if not cpus:
            return None
        choice = self._from_cache(model, backend, cpus, slo_ms, rate_rps, max_batch, samples, precision)
        if choice is not None or self.search is None:
            return choice
        asked = time.monotonic()
        with self._searching:  # concurrent deploys see the same free cpus: their searches take turns
            # a search that ran while we waited may have cached what we need
            return self._from_cache(model, backend, cpus, slo_ms, rate_rps, max_batch, samples, precision) or \
                self._measure(model, backend, cpus, slo_ms, rate_rps, max_batch,
                              budget_s=self.search.budget_s - (time.monotonic() - asked), samples=samples,
                              precision=precision)

    def _cached_points(self, model: str, backend: str, samples: "SampleSpec | None" = None,
                       precision: str = "f32") -> list:
        from reamer.serve.profile_cache import ProfileCache, model_key

        if not self.profile_dir.is_dir():
            return []
        try:
            return ProfileCache(self.profile_dir).get(model_key(model, backend, samples=samples,
                                                                precision=precision)) or []
        except (OSError, ValueError) as exc:  # an unreadable cache is a miss, never a failed deploy
            log.debug("no profile for %s/%s: %s", model, backend, exc)
            return []

    def _from_cache(self, model: str, backend: str, cpus: list[int], slo_ms: float | None,
                    rate_rps: float | None, max_batch: int | None,
                    samples: "SampleSpec | None" = None, precision: str = "f32") -> LayoutChoice | None:
        from reamer.plan.admission import batch_latency_target_ms
        from reamer.plan.online_sim import with_sustained
        from reamer.plan.partition import NoFeasibleLayout
        from reamer.plan.search import plan_from_profile

        backends = installed_backends() if backend == AUTO_BACKEND else [backend]
        plans, refusals = [], []
        for one in backends:
            points = [p for p in self._cached_points(model, one, samples, precision)
                      if max_batch is None or p.batch <= max_batch]
            # a profile measured on fewer cores than are free now is a miss when we may measure
            if not points or (self.search is not None and max(p.cores for p in points) < len(cpus)):
                return None  # "auto" plans only when every backend is cached: else it would never measure one
            try:
                plans.append((one, plan_from_profile(points, len(cpus), batch_latency_target_ms(slo_ms)), points))
            except NoFeasibleLayout as exc:
                refusals.append(exc.message)
        if not plans:
            return LayoutChoice(None, accepted=False, achievable_rps=0.0, reason="; ".join(refusals))
        one, candidate, points = max(plans, key=lambda item: item[1].rps)
        if slo_ms is not None:
            candidate = with_sustained(candidate, slo_ms, points)
        if backend == AUTO_BACKEND:
            candidate = replace(candidate, layout=candidate.layout.on(one))
        return self._admit(candidate, slo_ms, rate_rps, "planned from the cached profile")

    def _measure(self, model: str, backend: str, cpus: list[int], slo_ms: float | None,
                 rate_rps: float | None, max_batch: int | None, budget_s: float,
                 samples: "SampleSpec | None" = None, precision: str = "f32") -> LayoutChoice | None:
        """The search within `budget_s` (what is left of search.budget_s after waiting for another)."""
        from reamer.serve.layout_search import MeasureSettings, batch_choices, search_layout

        assert self.search is not None
        s = self.search
        budget_s = max(budget_s, 1e-6)
        log.info("searching a layout for %s (%s, %s) on cpus %s, budget %.1fs", model, backend, precision, cpus,
                 budget_s)
        try:
            outcome = search_layout(model, backend, cpus, slo_ms, cache_dir=self.profile_dir,
                                    batches=batch_choices(min(s.max_batch, max_batch or s.max_batch)),
                                    budget_s=budget_s,
                                    settings=MeasureSettings(warmup_s=s.warmup_s, window_s=s.window_s),
                                    strict_cache=False, cache_source="agent deploy", samples=samples,
                                    precision=precision)
        except ReamerError as exc:  # the model would not run here: the job itself will say why
            log.warning("layout search for %s failed: %s", model, exc)
            return None
        log.info("layout search for %s: %s after %d run(s)%s", model,
                 outcome.best.layout if outcome.best else "nothing meets the SLO", len(outcome.rows),
                 "" if outcome.complete else f" ({outcome.note})")
        if outcome.best is None:
            if not outcome.complete and rate_rps is None:
                return None  # nothing measured in time and no rate to check: no opinion
            slo = f"the {slo_ms:g} ms SLO" if slo_ms is not None else "the SLO"
            reason = outcome.note or f"no layout on the free cores meets {slo}"
            if not outcome.complete:
                reason += "; raise inference.search_budget_s, or run `reamer search` for this model beforehand"
            return LayoutChoice(None, accepted=False, achievable_rps=0.0, reason=reason)
        how = "measured on the free cpus" if outcome.complete else outcome.note
        return self._admit(outcome.best, slo_ms, rate_rps, how)

    def _admit(self, candidate: Any, slo_ms: float | None, rate_rps: float | None, how: str) -> LayoutChoice:
        from reamer.plan.admission import admit
        from reamer.plan.layout import format_layout

        layout = format_layout(candidate.layout)
        if rate_rps is None or slo_ms is None:
            return LayoutChoice(layout, reason=how)
        decision = admit(candidate, rate_rps, slo_ms, margin=self.margin)
        return LayoutChoice(layout, decision.accepted, decision.achievable_rps, f"{decision.reason}; {how}")


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

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    def samples(self) -> "SampleSpec":
        from reamer.serve.samples import SampleSpec

        return SampleSpec(shapes=self.shapes, input_data=self.input_data)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "InferenceRecord":
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in doc.items() if k in known})


def _run_as_kwargs(rec: InferenceRecord, job_dir: Path) -> dict[str, Any]:
    """Popen arguments that start the job as its user (nothing for root), and the job directory handed
    to that user (the job writes its status, events and log there)."""
    if not rec.run_uid or os.geteuid() != 0:
        return {}
    import pwd

    os.chown(job_dir, rec.run_uid, rec.run_gid)
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


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
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
        self._procs: dict[str, subprocess.Popen] = {}
        self._status: dict[str, JobStatus] = {}

    # --- paths ---

    def job_dir(self, name: str) -> Path:
        return self.jobs_dir / name

    def spec_path(self, name: str) -> Path:
        return self.job_dir(name) / "spec.json"

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
        return "reamer.serve.job" in cmd and str(self.spec_path(rec.name)) in cmd

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
                                          batch=rec.max_batch or DEFAULT_BATCH))
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
            if instances == rec.instances and running:
                continue
            old = rec.instances
            rec.instances, rec.message, rec.state = instances, "", "running"
            self.save(rec)  # the store first, then the host
            self._write_spec(rec)
            if running:
                self._signal(rec, signal.SIGHUP)
                self.emit("replanned", f"{rec.name} moved to cpus {self._cpus_text(rec)}", job=rec.name,
                          data={"from": old, "to": instances})
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

    def build_spec(self, rec: InferenceRecord) -> JobSpec:
        instances = [InstanceSpec(cpus=list(i["cpus"]), threads=i["threads"], max_batch=i["max_batch"],
                                  sched="idle" if i["on_training"] and self.offline_sched == "idle" else "other",
                                  streams=int(i.get("streams", 1)))
                     for i in rec.instances]
        own = sorted({c for i in rec.instances if not i["on_training"] for c in i["cpus"]})
        frontdoor = self.reserved or own or sorted({c for i in rec.instances for c in i["cpus"]})
        return JobSpec(name=rec.name, kind=rec.kind, model=rec.model, backend=rec.backend, instances=instances,
                       frontdoor_cpus=frontdoor, slo_ms=rec.slo_ms, rate_rps=rec.rate_rps, port=rec.port,
                       grpc_port=rec.grpc_port,
                       input_dir=rec.input_dir, output_dir=rec.output_dir, run_dir=str(self.job_dir(rec.name)),
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
        self.job_dir(rec.name).mkdir(parents=True, exist_ok=True)
        self.build_spec(rec).save(self.spec_path(rec.name))

    # --- processes ---

    def is_running(self, rec: InferenceRecord) -> bool:
        proc = self._procs.get(rec.name)
        if proc is not None:
            return proc.poll() is None
        return self._is_our_process(rec)

    def _start(self, rec: InferenceRecord) -> None:
        job_dir = self.job_dir(rec.name)
        job_dir.mkdir(parents=True, exist_ok=True)
        self._write_spec(rec)
        try:
            (job_dir / STATUS_FILE).unlink()
        except FileNotFoundError:
            pass
        self._status.pop(rec.name, None)
        events = job_dir / EVENTS_FILE
        rec.events_offset = events.stat().st_size if events.exists() else 0
        as_user = _run_as_kwargs(rec, job_dir)
        # O_NOFOLLOW: the directory may belong to the job's user, who must not aim root's writes elsewhere.
        log_fd = os.open(job_dir / "job.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
        if as_user:
            os.fchown(log_fd, rec.run_uid, rec.run_gid)
        with os.fdopen(log_fd, "ab") as log_file:
            try:
                proc = subprocess.Popen(
                    [self.python, "-m", "reamer.serve.job", "--spec", str(self.spec_path(rec.name))],
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, cwd=job_dir,
                    start_new_session=True, close_fds=True, **as_user)
            except OSError as exc:  # e.g. the job's user cannot execute the agent's python
                rec.state, rec.pid, rec.instances = "failed", None, []
                rec.message = (f"cannot start the job as uid {rec.run_uid}: {exc.strerror} ({exc.filename}); fix: "
                               "make reamer's python and the model readable by that user, or deploy as another")
                self.save(rec)
                self.emit("inference_failed", f"{rec.name} failed: {rec.message}", job=rec.name)
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
        pid = rec.pid if self.is_running(rec) else None
        if pid:
            self._signal(rec, signal.SIGTERM)
        return pid

    def forget_process(self, name: str) -> None:
        self._procs.pop(name, None)

    # --- the periodic pass ---

    def status_of(self, name: str) -> JobStatus | None:
        return self._status.get(name)

    def tick(self) -> bool:
        """Read status and events, notice exits, restart crashed jobs. Returns True when cores changed hands
        (a job ended), so the caller re-plans."""
        changed = False
        for rec in list(self.records.values()):
            self._read_status(rec)
            self._forward_events(rec)
            if rec.state != "running" or rec.pid is None:
                continue
            if self.is_running(rec):
                continue
            changed |= self._handle_exit(rec)
        return changed

    def _read_status(self, rec: InferenceRecord) -> None:
        path = self.job_dir(rec.name) / STATUS_FILE
        try:
            status = JobStatus.load(path)
        except (OSError, ValueError, TypeError):
            return
        self._status[rec.name] = status
        if (status.port and not rec.port) or (status.grpc_port and not rec.grpc_port):
            rec.port = rec.port or status.port
            rec.grpc_port = rec.grpc_port or status.grpc_port
            self.save(rec)

    def _forward_events(self, rec: InferenceRecord) -> None:
        events, offset = read_events(self.job_dir(rec.name), rec.events_offset)
        if offset == rec.events_offset:
            return
        rec.events_offset = offset
        for event in events:
            kind = str(event.get("kind", "job_event"))
            data = {k: v for k, v in event.items() if k not in ("kind", "message", "ts")}
            self.emit(kind, f"{rec.name}: {event.get('message', kind)}", job=rec.name, data=data)
        self.save(rec)

    def _handle_exit(self, rec: InferenceRecord) -> bool:
        proc = self._procs.pop(rec.name, None)
        code = proc.poll() if proc is not None else None
        self._read_status(rec)  # the job writes its final state just before it exits
        status = self._status.get(rec.name)
        log_path = self.job_dir(rec.name) / "job.log"
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
        tail = _tail(log_path)
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


def validate_request(req: dict[str, Any], default_backend: str) -> InferenceRecord:
    """Turn an API request into a record; raises InvalidRequest naming the field and the fix."""
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
    if backend not in ("onnxruntime", "openvino", AUTO_BACKEND):
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
    shapes, input_data = _checked_traffic(req, model)
    bind_address = _checked_bind_address(req.get("bind_address"), kind)
    precision = _checked_precision(req.get("precision"))
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


def _checked_traffic(req: dict[str, Any], model: Path) -> tuple[dict[str, list[int]], str | None]:
    """The request's `shapes` and `input_data`, checked against the model's inputs (InvalidRequest names the
    input and the fix)."""
    from reamer.serve.samples import SampleError, SampleSpec, check_against_model, shapes_from_doc

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
        check_against_model(model, SampleSpec(shapes=shapes, input_data=input_data))
    except SampleError as exc:
        raise InvalidRequest(exc.message, exc.fix) from None
    return {k: list(v) for k, v in shapes.items()}, input_data


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


AUTO_BACKEND = "auto"  # the backend is a search dimension: the chosen layout names it


def installed_backends() -> list[str]:
    """The backends whose runtime is importable here, in reamer's order."""
    import importlib.util

    return [b for b in ("onnxruntime", "openvino") if importlib.util.find_spec(b) is not None]


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
