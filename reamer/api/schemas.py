"""Request and response bodies of the agent's HTTP API (the contract the CLI and schedulers use).

Times are Unix seconds (float). CPU lists are lists of ints. Every error response is an
`ErrorBody`: ``{"error": {"code": "...", "message": "...", "fix": "..."}}``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

JOB_NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$"

TrainingSource = Literal["pids", "cgroup", "container"]
TrainingState = Literal["running", "ended"]
InferenceKind = Literal["online", "offline"]
InferenceState = Literal["running", "pending", "done", "failed"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- errors -----------------------------------------------------------------------------------

class ErrorDetail(_Response):
    code: str  # machine-readable: "not_found", "conflict", "invalid_request", "admission_refused", ...
    message: str  # names the problem and, where known, the fix
    fix: str = ""
    data: dict[str, Any] = Field(default_factory=dict)  # e.g. {"achievable_rps": 41.0} for admission_refused


class ErrorBody(_Response):
    error: ErrorDetail


# --- node -------------------------------------------------------------------------------------

class RtThrottling(_Response):
    runtime_us: int  # -1 = throttling disabled (reamer refuses RT then)
    period_us: int


class NodeInfo(_Response):
    hostname: str
    version: str
    agent_pid: int
    uptime_s: float
    cpu_model: str
    cpus: list[int]  # online CPUs
    reserved_cpus: list[int]  # housekeeping cores: never training, never RT
    training_cpus: list[int]
    idle_cpus: list[int]  # not reserved, not training (online/offline inference lives here)
    free_cores: int  # physical cores still allocatable to training
    allocations: dict[str, list[int]]  # training job -> cpus
    cgroup_version: int
    rt_throttling: RtThrottling
    training_jobs: int
    inference_jobs: int
    gpus: int = 0
    offline_sched: str = "rr-preempt"


class Health(_Response):
    status: Literal["ok", "degraded"]
    detail: str = ""


# --- training ---------------------------------------------------------------------------------

class TrainingJobRequest(_Body):
    """Attach a running training job: exactly one of pids, cgroup, container."""

    name: str = Field(pattern=JOB_NAME_PATTERN)
    pids: Optional[list[int]] = None
    cgroup: Optional[str] = None  # cgroup path (relative to the hierarchy root) whose processes to take
    container: Optional[str] = None  # container id (docker/containerd/cri-o/podman)
    cores: Optional[int] = Field(default=None, ge=1)  # default: from the container's cpuset/quota, else 1
    priority: Optional[int] = Field(default=None, ge=1, le=99)  # default: config training.priority

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "TrainingJobRequest":
        given = [k for k in ("pids", "cgroup", "container") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of pids, cgroup, container (got "
                             f"{', '.join(given) if given else 'none'})")
        return self


class TrainingJob(_Response):
    name: str
    cpus: list[int]
    pids: list[int]
    threads_rr: int  # threads currently SCHED_RR
    threads: int = 0  # threads in total
    priority: int
    source: TrainingSource
    state: TrainingState
    created_at: float
    message: str = ""


class TrainingJobList(_Response):
    jobs: list[TrainingJob]


# --- inference --------------------------------------------------------------------------------

class InferenceJobRequest(_Body):
    name: str = Field(pattern=JOB_NAME_PATTERN)
    model: str  # path to an ONNX file on the node
    kind: InferenceKind
    slo_ms: Optional[float] = Field(default=None, gt=0)  # online: p99 latency target
    rate_rps: Optional[float] = Field(default=None, gt=0)  # online: expected request rate (admission)
    port: Optional[int] = Field(default=None, ge=1, le=65535)  # online: v2 REST port (default: a free one)
    input_dir: Optional[str] = None  # offline: .npy/.npz inputs
    output_dir: Optional[str] = None  # offline: one result file per input
    backend: Optional[str] = None  # "onnxruntime" | "openvino"; default from config
    max_batch: Optional[int] = Field(default=None, ge=1)
    layout: Optional[str] = None  # e.g. "2x1:b4" or "2x1:b4+1x2:b8"; default: searched / all free cores

    @model_validator(mode="after")
    def _kind_fields(self) -> "InferenceJobRequest":
        if self.kind == "online" and self.slo_ms is None:
            raise ValueError("an online job needs slo_ms (its p99 latency target)")
        if self.kind == "offline" and (not self.input_dir or not self.output_dir):
            raise ValueError("an offline job needs input_dir and output_dir")
        return self


class InferenceInstance(_Response):
    cpus: list[int]
    threads: int
    max_batch: int
    on_training: bool = False


class InferenceStatus(_Response):
    rate_rps: Optional[float] = None
    p50_ms: Optional[float] = None
    p99_ms: Optional[float] = None
    slo_attainment: Optional[float] = None  # fraction 0..1 of requests within the SLO
    done: Optional[int] = None  # offline: inputs finished
    total: Optional[int] = None
    throughput: Optional[float] = None  # offline: inputs/s
    eta_s: Optional[float] = None


class InferenceJob(_Response):
    name: str
    model: str
    kind: InferenceKind
    backend: str
    slo_ms: Optional[float] = None
    rate_rps: Optional[float] = None
    port: Optional[int] = None
    input_dir: Optional[str] = None
    output_dir: Optional[str] = None
    max_batch: Optional[int] = None
    state: InferenceState
    layout: Optional[str] = None
    instances: list[InferenceInstance] = Field(default_factory=list)
    pid: Optional[int] = None
    status: InferenceStatus = Field(default_factory=InferenceStatus)
    message: str = ""
    created_at: float = 0.0


class InferenceJobList(_Response):
    jobs: list[InferenceJob]


# --- events -----------------------------------------------------------------------------------

class Event(_Response):
    id: int  # monotonic; pass the last seen id as ?since= to get only newer ones
    ts: float
    kind: str  # training_attached, training_ended, inference_deployed, replanned, overload, ...
    job: Optional[str] = None
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class EventList(_Response):
    events: list[Event]
    last_id: int  # highest id known to the agent (use as the next ?since=)


# --- demote / gpu -----------------------------------------------------------------------------

class DemoteResult(_Response):
    threads_demoted: int
    jobs: list[str]
    message: str = ""


class GpuJobRequest(_Body):
    """Register a job's share of a GPU (MPS active-thread percentage, pinned-memory limit)."""

    name: str = Field(pattern=JOB_NAME_PATTERN)
    gpu: Union[int, str]  # GPU UUID or index
    sm_percent: int = Field(ge=1, le=100)  # MPS active thread percentage
    mem_limit_mb: Optional[int] = Field(default=None, ge=1)  # MPS pinned device memory limit
    kind: Literal["training", "inference"] = "training"
    pids: Optional[list[int]] = None


class GpuJobUpdate(_Body):
    """New desired limits and/or the job's pids (tell reamer the pids once the job runs)."""

    sm_percent: Optional[int] = Field(default=None, ge=1, le=100)
    mem_limit_mb: Optional[int] = Field(default=None, ge=1)
    clear_mem_limit: bool = False  # drop the pinned-memory limit
    pids: Optional[list[int]] = None

    @model_validator(mode="after")
    def _something(self) -> "GpuJobUpdate":
        if self.sm_percent is None and self.mem_limit_mb is None and not self.clear_mem_limit and self.pids is None:
            raise ValueError("give at least one of sm_percent, mem_limit_mb, clear_mem_limit, pids")
        if self.clear_mem_limit and self.mem_limit_mb is not None:
            raise ValueError("give mem_limit_mb or clear_mem_limit, not both")
        return self


class GpuStatus(_Response):
    """Whatever reamer.gpu.manager.GpuManager.status() reports, plus whether it is enabled."""

    model_config = ConfigDict(extra="allow")
    enabled: bool
    message: str = ""
