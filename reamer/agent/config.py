"""The agent's configuration: a YAML file (see configs/reamer.yaml) validated into AgentConfig.

Flags of `reamer daemon` arrive as overrides: a dict whose keys are top-level names or dotted
paths ("training.priority"); they win over the file.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from reamer.host.cpulist import parse_cpulist
from reamer.errors import ErrorKind
from reamer.host.errors import ReamerError

DEFAULT_CONFIG_DOC = "configs/reamer.yaml"


class ConfigError(ReamerError):
    """The agent config names an unknown key or holds a value the agent cannot use."""

    kind = ErrorKind.BAD_INPUT


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainingConfig(_Section):
    # SCHED_RR priority of every training thread (1..99).
    priority: int = Field(default=50, ge=1, le=99)
    # Real-time budget (µs per cpu.rt_period_us, per CPU; v1 RT group scheduling): the cap for all attached
    # jobs together, held only while jobs are attached. Below the root's 950000 so RT throttling keeps working.
    rt_runtime_us: int = Field(default=900000, ge=1000, le=950000)
    # The part of rt_runtime_us (percent) that the jobs of users other than root and the admin group may hold
    # together; root's and admins' jobs share the rest, so no user's attach shrinks their budget.
    user_rt_percent: int = Field(default=25, ge=0, le=100)


class FrontDoorConfig(_Section):
    """What one client may cost an online job's REST front door (defaults follow nginx's)."""

    # Open connections per job; one more gets 503 and is closed at once.
    max_connections: int = Field(default=1024, ge=1, le=1_000_000)
    # The request line and headers must arrive within this; else 408 and the connection closes.
    header_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # A request body that stalls (no bytes) this long: 408, closed.
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # A keep-alive connection with no request in progress is closed after this.
    idle_timeout_s: float = Field(default=75.0, gt=0, le=86400)
    # A client that takes none of its answer this long is cut off.
    send_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # Longest URL (414 past it) and largest header section (431 past it), in bytes.
    max_url_bytes: int = Field(default=8192, ge=256, le=1 << 20)
    max_header_bytes: int = Field(default=32768, ge=1024, le=1 << 24)
    # Unanswered pipelined requests per connection before the job stops reading from it.
    max_pipelined: int = Field(default=16, ge=1, le=1024)
    # Request bodies all connections together may hold (MiB); past it a new body gets 503.
    max_buffered_mb: float = Field(default=256.0, gt=0, le=1 << 20)
    # JSON request and answer bodies larger than this (KiB) are coded on a helper thread.
    json_offload_kb: float = Field(default=64.0, ge=0, le=1 << 20)


class InferenceConfig(_Section):
    # How offline instances on training cores give way: "rr-preempt" = they run SCHED_OTHER and the
    # SCHED_RR training threads preempt them; "idle" = they also run SCHED_IDLE.
    offline_sched: Literal["rr-preempt", "idle"] = "rr-preempt"
    # "auto": an online deploy that searches its layout tries every installed backend (the layout names the
    # winner); offline jobs, given layouts without @BACKEND and deploys that do not search take the first installed
    default_backend: Literal["auto", "onnxruntime", "openvino"] = "auto"
    # The address online jobs' front doors listen on: 0.0.0.0 = every interface (clients are elsewhere
    # in the cluster); one address of this node to keep them to it (127.0.0.1: this host only).
    bind_address: str = "0.0.0.0"

    @field_validator("bind_address")
    @classmethod
    def _an_ip_address(cls, value: str) -> str:
        import ipaddress

        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (use 0.0.0.0 for every interface, or one address "
                             "of this node)") from None
    # Shared libraries of custom ONNX operators that every ONNX Runtime session of the node's jobs, deploy checks
    # and searches registers (onnxruntime-extensions' own is registered whenever that package is installed).
    # Absolute paths of root-owned files that no one else can write: they run as code in every job.
    custom_op_libraries: list[str] = Field(default_factory=list, max_length=32)

    @field_validator("custom_op_libraries")
    @classmethod
    def _root_owned_libraries(cls, paths: list[str]) -> list[str]:
        import os
        import stat

        for path in paths:
            if not os.path.isabs(path) or os.pathsep in path:
                raise ValueError(f"{path!r} is not an absolute path (without {os.pathsep!r})")
            try:
                info = os.stat(path)
            except OSError as exc:
                raise ValueError(f"{path} cannot be read ({exc.strerror})") from None
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ValueError(f"{path} must be owned by root and writable by root alone (it runs in every job)")
        return paths
    # "module:attribute", a reamer.search.chooser.LayoutChooser: f(LayoutRequest) -> LayoutChoice | None
    # (None: the built-in profile-cache chooser).
    layout_chooser: Optional[str] = None
    # Where cached profiles are read from (default: <state_dir>/profiles).
    profile_dir: Optional[str] = None
    # An online deploy without a layout and without a cached profile: measure the layout search on
    # the job's free cpus (then cache the profile and admit). False: plan from cached profiles only.
    search_on_deploy: bool = True
    # Time for that search; when it runs out, the layout is planned from the points measured so far.
    search_budget_s: float = Field(default=90.0, gt=0, le=3600)
    # Largest batch the search tries (powers of two up to it).
    search_max_batch: int = Field(default=32, ge=1, le=1024)
    # Warm-up and window length of each measurement run of that search (seconds).
    search_warmup_s: float = Field(default=0.5, ge=0, le=60)
    search_window_s: float = Field(default=0.25, gt=0, le=60)
    # Crash-loop guard: a job process restarted more than restart_limit times in restart_window_s fails.
    # Largest online request body a job's front door takes; bigger ones get 413 before they are read.
    max_request_mb: float = Field(default=64.0, gt=0, le=4096)
    # Per-client limits of the online front door (timeouts, connections, sizes).
    frontdoor: FrontDoorConfig = Field(default_factory=FrontDoorConfig)
    # job.log of each job is kept under this size (MiB): past it, it is moved to job.log.1.
    job_log_mb: float = Field(default=16.0, gt=0, le=1 << 20)
    restart_limit: int = Field(default=5, ge=0)
    restart_window_s: float = Field(default=60.0, gt=0)
    # Memory limit (MiB) of each job's processes through its memory cgroup; a job's own
    # memory_limit_mb wins. None = no limit.
    memory_limit_mb: Optional[float] = Field(default=None, gt=0, le=2**30)
    # oom_score_adj of every job process (1..1000): the kernel's OOM killer takes them before training.
    oom_score_adj: int = Field(default=800, ge=1, le=1000)
    # Whom jobs that root deploys run as (a user name or uid). Jobs other callers deploy run as them.
    run_as: str = Field(default="root", min_length=1, max_length=64)
    # The deploy check (a child process as the job's user opens the model and reads input_data) is stopped
    # after this and the deploy refused; its memory limit is the job's (memory_limit_mb), else check_memory_mb.
    check_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    check_memory_mb: float = Field(default=4096.0, ge=64, le=2**30)


class SecurityConfig(_Section):
    # Cgroups a caller other than root may attach (a path equal to or under one of these; "{uid}" is
    # the caller's uid). Every process found must be the caller's own as well.
    allowed_cgroup_prefixes: list[str] = Field(default_factory=lambda: ["user.slice/user-{uid}.slice"])
    # Cgroups nobody may attach, root included (the host's own processes live there).
    protected_cgroups: list[str] = Field(
        default_factory=lambda: ["/", "init.scope", "system.slice", "user.slice", "machine.slice"])
    # Highest SCHED_RR priority any training job gets, root's included (1..99).
    max_rt_priority: int = Field(default=90, ge=1, le=99)
    # Largest control API request body (KiB); bigger ones get 413.
    max_body_kb: int = Field(default=256, ge=1, le=65536)
    # Long-polls (GET /v1/events?wait=) open at once; more get 429 (they never hold worker threads).
    max_long_polls: int = Field(default=64, ge=1, le=10000)
    # Control-socket connections open at once from callers other than admins; one more gets 503 and is closed
    # at once (bounds the agent's memory and fds). Admins get in beyond it (admin_reserved_connections).
    max_connections: int = Field(default=256, ge=8, le=100000)
    # Connections one uid (not an admin) may hold open at once; one more gets 429 and is closed at once.
    max_connections_per_uid: int = Field(default=32, ge=1, le=100000)
    # Connections kept for root and admin_group above max_connections: admins get in while fewer than
    # max_connections + this are open, whatever other callers hold.
    admin_reserved_connections: int = Field(default=32, ge=1, le=100000)
    # The request line and headers must arrive within this of a request's first byte (of the connection, for
    # its first request), and its body within this of its headers; else 408 and the connection closes.
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    # A connection with no request in progress (nothing sent since its last answer) is closed after this.
    # A long-poll being answered is in progress, not idle.
    idle_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    # Largest request line + headers (KiB); past it 431 and the connection closes, the rest never read.
    max_header_kb: int = Field(default=32, ge=1, le=4096)
    # Group whose members (with root) are the node's admins: the control socket always lets them in
    # (connections beyond other callers' caps), and other users' jobs never shrink their jobs' RT budget.
    # None: root alone is an admin. Membership is read from the user database, never from the caller.
    admin_group: Optional[str] = Field(default=None, min_length=1, max_length=64)


INSTANCE_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}$"


def instance_defaults(instance: str | None) -> dict[str, str]:
    """The socket, state and run directories and cgroup name of agent `instance` (None: the node's one agent).
    One name keeps a second agent apart from the first in everything it owns on the node."""
    suffix = f"-{instance}" if instance else ""
    return {"socket": f"/run/reamer{suffix}/reamer.sock", "state_dir": f"/var/lib/reamer{suffix}",
            "run_dir": f"/run/reamer{suffix}", "cgroup_name": f"reamer{suffix}"}


class EventsConfig(_Section):
    """Retention of the agent's event log (in state.db): oldest events go first past any of these."""

    # Events kept in all.
    max_count: int = Field(default=20000, ge=100, le=10_000_000)
    # Size of the kept events (MiB: their kinds, messages and data), so the log cannot fill the state disk.
    max_mb: float = Field(default=32.0, gt=0, le=1 << 20)
    # Events kept per job: a job's own beyond this go before anything else, so one job (its events, its
    # deploys and removals) cannot push other jobs' and the agent's events out.
    max_per_job: int = Field(default=2000, ge=10, le=10_000_000)
    # A file of this size (MiB) kept in the state directory and given up when the disk is full, so that
    # detach, demote-all and remove still get recorded; made again once there is room. 0: none.
    disk_reserve_mb: float = Field(default=4.0, ge=0, le=1024)


class AgentConfig(_Section):
    # A second agent on the node: its name derives socket, state_dir (and so its profile cache), run_dir and
    # cgroup_name (instance_defaults) wherever they are not set; `reamer --instance NAME` talks to it.
    instance: Optional[str] = Field(default=None, pattern=INSTANCE_PATTERN)
    socket: str = "/run/reamer/reamer.sock"
    # Group that owns the socket (mode 0660): its members may use the CLI and API. None = root's group.
    socket_group: Optional[str] = None
    state_dir: str = "/var/lib/reamer"
    run_dir: str = "/run/reamer"
    cgroup_root: str = "/sys/fs/cgroup"
    cgroup_name: str = Field(default="reamer", pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
    # Housekeeping CPUs (OS, agent, IRQs): never given to training, never RT. [] allowed.
    reserved_cpus: list[int] = Field(default_factory=lambda: [0])
    reconcile_interval_s: float = Field(default=1.0, gt=0, le=60)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    # Passed to reamer.gpu.config.GpuConfig.from_dict; {} = defaults.
    gpu: dict[str, Any] = Field(default_factory=dict)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="before")
    @classmethod
    def _instance_paths(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("instance"), str) and data["instance"]:
            data = {**instance_defaults(data["instance"]), **data}
        return data

    @field_validator("reserved_cpus", mode="before")
    @classmethod
    def _cpulist(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, int):
            return [value]
        if isinstance(value, str):
            return parse_cpulist(value) if value.strip() else []
        return value

    @property
    def store_path(self) -> Path:
        return Path(self.state_dir) / "state.db"

    @property
    def jobs_dir(self) -> Path:
        return Path(self.run_dir) / "jobs"


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _describe(error: dict[str, Any], source: str) -> tuple[str, str]:
    key = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return (f"unknown config key {key!r} in {source}",
                f"remove it or fix its spelling; every key is documented in {DEFAULT_CONFIG_DOC}")
    return (f"config key {key!r} in {source}: {error['msg']} (got {error.get('input')!r})",
            f"set {key} to a valid value; see {DEFAULT_CONFIG_DOC}")


def config_from_dict(data: dict[str, Any], source: str = "config") -> AgentConfig:
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(e, source) for e in exc.errors()]
        message = "; ".join(p for p, _ in problems)
        raise ConfigError(message, problems[0][1]) from None
    except ValueError as exc:  # parse_cpulist in a validator
        raise ConfigError(f"bad value in {source}: {exc}", f"see {DEFAULT_CONFIG_DOC}") from None
    if config.training.priority > config.security.max_rt_priority:
        raise ConfigError(f"training.priority {config.training.priority} in {source} is above "
                          f"security.max_rt_priority {config.security.max_rt_priority}",
                          "lower training.priority or raise security.max_rt_priority")
    if config.gpu:
        validate_gpu_section(config.gpu, source)
    return config


def validate_gpu_section(gpu: dict[str, Any], source: str) -> None:
    try:
        from reamer.gpu.config import GpuConfig
    except ImportError:
        return
    try:
        GpuConfig.from_dict(gpu)
    except ReamerError as exc:
        raise ConfigError(f"config section 'gpu' in {source}: {exc.message}", exc.fix) from None
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"config section 'gpu' in {source}: {exc}", f"see {DEFAULT_CONFIG_DOC}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> AgentConfig:
    """Read `path` (YAML; None = built-in defaults), apply `overrides`, validate."""
    data: dict[str, Any] = {}
    source = "built-in defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist",
                              f"pass an existing file to --config (an example: {DEFAULT_CONFIG_DOC})") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}",
                              "check the path and its permissions") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise ConfigError(f"config file {path} is not valid YAML{at}: {getattr(exc, 'problem', exc)}",
                              "fix the YAML syntax (indent with spaces, 'key: value')") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must be a mapping of keys to values, not {type(loaded).__name__}",
                              f"write it as 'key: value' lines like {DEFAULT_CONFIG_DOC}")
        data = copy.deepcopy(loaded)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    if overrides:
        source += " + command-line flags"
    return config_from_dict(data, source)
