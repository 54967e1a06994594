"""Request and response bodies of the agent's HTTP API (the contract the CLI and schedulers use).

Times are Unix seconds (float). CPU lists are lists of ints. Every error response is an
`ErrorBody`: ``{"error": {"code": "...", "message": "...", "fix": "..."}}``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

JOB_NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$"
PID_MAX_LIMIT = 4194304  # the kernel's largest pid_max (64-bit); the agent also checks /proc/sys/kernel/pid_max
MAX_PIDS = 4096  # pids in one request
MAX_PATH = 4096  # PATH_MAX
Pid = Annotated[int, Field(gt=0, le=PID_MAX_LIMIT)]

TrainingSource = Literal["pids", "cgroup", "container", "slurm", "k8s"]
TrainingState = Literal["pending", "running", "ended"]
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


class RtBudgetHolder(_Response):
    job: str
    owner_uid: int
    pool: Literal["privileged", "users"]
    budget_us: int  # its share of its pool (cpu.rt_runtime_us per cpu.rt_period_us)
    held_us: int  # what its cpu cgroup holds now (0 while the agent is stopped or throttling is off)
    cpu_cgroup: str


class RtBudget(_Response):
    """The training RT budget rule (cgroup v1 with RT group scheduling): users' jobs share user_pool_us,
    root's and admins' jobs privileged_pool_us; no user's attach shrinks a privileged job's budget."""

    enabled: bool  # false: this host needs no budgets (cgroup v2, or no RT group scheduling)
    cap_us: int  # training.rt_runtime_us
    user_percent: int  # training.user_rt_percent
    privileged_pool_us: int
    user_pool_us: int
    jobs: list[RtBudgetHolder] = Field(default_factory=list)
    rule: str = ""


class Capacity(_Response):
    """Spare capacity in the units schedulers count (see reamer/agent/scheduler_api.py)."""

    spare_cores: int  # whole cores no training, online inference or housekeeping holds
    spare_cpus: list[int]
    offline_capacity_cores: float  # batch core-equivalents: spare cores + training cores' measured idle share
    offline_capacity_millicores: int
    training_cores: int
    reserved_cpus: list[int]
    generation: int  # increases at every change; a capacity_changed event carries the same body
    ts: float
    # Kubernetes node-status units: {"reamer.io/spare-cores": whole cores, "reamer.io/batch-cpu": milli-cores}
    kubernetes: dict[str, str] = Field(default_factory=dict)


class TrainingAdmissionRequest(_Body):
    cores: int = Field(ge=1, le=4096)
    allocated_cpus: Optional[list[Annotated[int, Field(ge=0, le=65535)]]] = Field(default=None, max_length=65536)


class TrainingAdmission(_Response):
    admit: bool
    cpus: list[int]  # the cpus it would take
    evicts: list[dict[str, str]]  # inference jobs that would give way: {"job", "kind", "action"}
    reason: str


class InferenceAdmissionRequest(_Body):
    model: str = Field(min_length=1, max_length=4096)
    slo_ms: float = Field(gt=0, le=3_600_000, allow_inf_nan=False)
    rate_rps: Optional[float] = Field(default=None, gt=0, le=1e7, allow_inf_nan=False)
    backend: Optional[str] = Field(default=None, max_length=32)
    max_batch: Optional[int] = Field(default=None, ge=1, le=65536)
    shapes: Optional[dict[str, list[Annotated[int, Field(ge=1, le=2**31)]]]] = None


class InferenceAdmission(_Response):
    admit: Optional[bool]  # None: no cached profile to answer from (reason says how to get one)
    achievable_rps: Optional[float]
    layout: Optional[str]
    cores_free: int
    reason: str


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
    profile_dir: Optional[str] = None  # the agent's profile cache (`reamer search`/`profile` share it)
    rt_budget: Optional[RtBudget] = None


class Health(_Response):
    status: Literal["ok", "degraded"]
    detail: str = ""


# --- training ---------------------------------------------------------------------------------

_TRAINING_SOURCES = {"pids": "array", "cgroup": "string", "container": "string", "slurm_job": "integer",
                     "k8s_container": "string"}


class TrainingJobRequest(_Body):
    """Attach a training job: exactly one of pids, cgroup, container (running processes) or slurm_job (a Slurm
    job on this node, pending until its steps run; root and the admin group only)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": [source], "properties": {source: {"type": kind}}, "not": {"anyOf": [
            {"required": [other], "properties": {other: {"type": other_kind}}}
            for other, other_kind in _TRAINING_SOURCES.items() if other != source]}}
        for source, kind in _TRAINING_SOURCES.items()]})

    name: str = Field(pattern=JOB_NAME_PATTERN)
    pids: Optional[list[Pid]] = Field(default=None, min_length=1, max_length=MAX_PIDS)
    # cgroup path (relative to the hierarchy root) whose processes to take
    cgroup: Optional[str] = Field(default=None, min_length=1, max_length=MAX_PATH, pattern=r"\S")
    # container id (docker/containerd/cri-o/podman)
    container: Optional[str] = Field(default=None, min_length=1, max_length=256, pattern=r"\S")
    # a Slurm job id (the Prolog's SLURM_JOB_ID): its steps' tasks are pinned as they start
    slurm_job: Optional[int] = Field(default=None, ge=1, le=2**31 - 1)
    # a Kubernetes container the runtime is creating (reamer's NRI plugin; root and the admin group only): its
    # cores are taken now, pending until it runs; posting the same container again returns its record
    k8s_container: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    k8s_pod: Optional[str] = Field(default=None, max_length=320)  # "namespace/name", shown in views only
    cores: Optional[int] = Field(default=None, ge=1, le=4096)  # default: from the container's cpuset/quota, else 1
    priority: Optional[int] = Field(default=None, ge=1, le=99)  # default: config training.priority

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "TrainingJobRequest":
        given = [k for k in _TRAINING_SOURCES if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of pids, cgroup, container, slurm_job, k8s_container (got "
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
    owner_uid: int = 0  # who attached it (root: 0); only it or root may detach it
    steps: Optional[list[dict[str, Any]]] = None  # slurm: the steps followed ({"id", "cgroup"})
    scheduler: Optional[dict[str, Any]] = None  # slurm: {"kind", "job_id", "allocated_cpus"}


class TrainingJobList(_Response):
    jobs: list[TrainingJob]


# --- inference --------------------------------------------------------------------------------

class InferenceJobRequest(_Body):
    name: str = Field(pattern=JOB_NAME_PATTERN)
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"properties": {"kind": {"const": "online"}, "slo_ms": {"type": "number"}}, "required": ["slo_ms"]},
        {"properties": {"kind": {"const": "offline"}, "input_dir": {"type": "string", "minLength": 1},
                        "output_dir": {"type": "string", "minLength": 1}},
         "required": ["input_dir", "output_dir"]}]})

    model: str = Field(max_length=MAX_PATH)  # path to an ONNX file on the node
    kind: InferenceKind
    slo_ms: Optional[float] = Field(default=None, gt=0, le=3600000, allow_inf_nan=False)  # online: p99 target
    # online: expected request rate (admission)
    rate_rps: Optional[float] = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    port: Optional[int] = Field(default=None, ge=1, le=65535)  # online: v2 REST port (default: a free one)
    grpc_port: Optional[int] = Field(default=None, ge=1, le=65535)  # online: v2 gRPC port (default: a free one)
    input_dir: Optional[str] = Field(default=None, max_length=MAX_PATH)  # offline: .npy/.npz inputs
    output_dir: Optional[str] = Field(default=None, max_length=MAX_PATH)  # offline: one result file per input
    # "onnxruntime" | "openvino" | "auto" (online: searched with the layout); default from config
    backend: Optional[str] = Field(default=None, max_length=64)
    max_batch: Optional[int] = Field(default=None, ge=1, le=65536)
    # e.g. "2x1:b4", "2x1:b4+1x2:b8" or "1x2s2:b4@openvino"; default: searched / all free cores
    layout: Optional[str] = Field(default=None, max_length=1024)
    # memory limit (MiB) of all the job's processes (its memory cgroup); default inference.memory_limit_mb
    memory_limit_mb: Optional[float] = Field(default=None, gt=0, le=2**30, allow_inf_nan=False)
    # online: the one address the front doors listen on (default: inference.bind_address, 0.0.0.0 = all)
    bind_address: Optional[str] = Field(default=None, max_length=64)
    # the traffic, as perf_analyzer takes it: input name -> dims (with or without the batch dim), and a
    # sample-data file on the node (.npz of named arrays, or perf_analyzer's JSON input data)
    shapes: Optional[dict[str, list[int]]] = Field(default=None, max_length=1024)
    input_data: Optional[str] = Field(default=None, max_length=MAX_PATH)
    # "f32" (default: answers as ONNX Runtime computes them) | "bf16" (OpenVINO computes in bfloat16 where
    # the CPU supports it; ONNX Runtime stays f32). Checked by the agent: an unknown value is a 400.
    precision: Optional[str] = Field(default=None, max_length=16)
    # placed by Slurm (deployed from inside a Slurm job, e.g. one asking for --gres=reamer_spare:N): the job runs
    # only on that Slurm job's cpus on this node, and is removed when the Slurm job ends
    slurm_job: Optional[int] = Field(default=None, ge=1, le=2**31 - 1)

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
    # online: the job's front door process over the last 10 s: cpus busy (1.0 = one cpu, where it limits the
    # job's rate) and cpu ms per request
    frontdoor_busy: Optional[float] = None
    frontdoor_cpu_ms: Optional[float] = None
    # online: whether requests are merged into batches, and why (not) (None until an instance has started)
    batchable: Optional[bool] = None
    batchable_reason: Optional[str] = None


class InferenceJob(_Response):
    name: str
    model: str
    kind: InferenceKind
    backend: str
    slurm_job: Optional[int] = None  # placed by this Slurm job: runs on its cpus only, ends with it
    allowed_cpus: Optional[list[int]] = None
    slo_ms: Optional[float] = None
    rate_rps: Optional[float] = None
    port: Optional[int] = None
    grpc_port: Optional[int] = None
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
    owner_uid: int = 0  # who deployed it (root: 0); only it or root may remove it
    run_uid: int = 0  # its processes run as this uid (the deploying caller; root's jobs: inference.run_as)
    memory_limit_mb: Optional[float] = None  # the limit its processes run under (None: none)
    oom_kills: int = 0  # its processes the kernel's OOM killer killed (seen by this agent)
    bind_address: Optional[str] = None  # online: where its front doors listen (0.0.0.0: every interface)
    url: Optional[str] = None  # online: the URL clients use (for 0.0.0.0: the host's name or primary address)
    grpc_target: Optional[str] = None  # online: HOST:PORT gRPC clients dial (tritonclient.grpc's url), same host
    shapes: dict[str, list[int]] = Field(default_factory=dict)
    input_data: Optional[str] = None
    precision: str = "f32"  # asked for: "f32" | "bf16"
    # what its instances compute in, as the runtime reports it (OpenVINO keeps f32 on a CPU without bf16;
    # ONNX Runtime is always f32); None until an instance is ready
    effective_precision: Optional[str] = None
    # online: its process reports every instance ready and its front doors serving (what `infer deploy` waits for)
    ready: bool = False


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
    gpu: Union[Annotated[int, Field(ge=0, le=1024)], Annotated[str, Field(min_length=1, max_length=128)]]  # UUID or index
    sm_percent: int = Field(ge=1, le=100)  # MPS active thread percentage
    mem_limit_mb: Optional[int] = Field(default=None, ge=1, le=2**40)  # MPS pinned device memory limit
    kind: Literal["training", "inference"] = "training"
    pids: Optional[list[Pid]] = Field(default=None, max_length=MAX_PIDS)


class GpuJobUpdate(_Body):
    """New desired limits and/or the job's pids (tell reamer the pids once the job runs)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "anyOf": [{"required": ["sm_percent"], "properties": {"sm_percent": {"type": "integer"}}},
                  {"required": ["mem_limit_mb"], "properties": {"mem_limit_mb": {"type": "integer"}}},
                  {"required": ["clear_mem_limit"], "properties": {"clear_mem_limit": {"const": True}}},
                  {"required": ["pids"], "properties": {"pids": {"type": "array"}}}],
        "not": {"required": ["mem_limit_mb", "clear_mem_limit"],
                "properties": {"mem_limit_mb": {"type": "integer"}, "clear_mem_limit": {"const": True}}}})

    sm_percent: Optional[int] = Field(default=None, ge=1, le=100)
    mem_limit_mb: Optional[int] = Field(default=None, ge=1, le=2**40)
    clear_mem_limit: bool = False  # drop the pinned-memory limit
    pids: Optional[list[Pid]] = Field(default=None, max_length=MAX_PIDS)

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
