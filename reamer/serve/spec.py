"""What one inference job is (JobSpec), how it is doing (JobStatus), and its on-disk records.

The agent writes a JobSpec as JSON; `python -m reamer.serve.runtime.job --spec FILE` runs it and writes
`<run_dir>/status.json` (JobStatus, about every 0.5 s) and `<run_dir>/events.jsonl` (one JSON object
per line: {"ts", "kind", "message", ...}).
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from reamer.errors import ErrorKind
from reamer.host.errors import ReamerError
from reamer.plan.layout import BACKENDS  # the one list of backends

JobKind = Literal["online", "offline"]
SchedPolicy = Literal["other", "idle"]
JobState = Literal["starting", "ready", "running", "done", "failed"]

# other names users type for them (case and "-"/"_" do not matter)
BACKEND_ALIASES = {"ort": "onnxruntime", "onnx": "onnxruntime", "onnxruntime": "onnxruntime",
                   "openvino": "openvino", "ov": "openvino", "openvinoruntime": "openvino"}


def canonical_backend(name: str) -> str | None:
    """The backend `name` means (ONNX Runtime, ORT, onnx-runtime, OpenVINO, ov, ...), or None."""
    return BACKEND_ALIASES.get(name.strip().lower().replace("-", "").replace("_", "").replace(" ", ""))


# The precision instances compute in. "f32": as the model file says (answers as ONNX Runtime computes them).
# "bf16": OpenVINO computes in bfloat16 where the CPU supports it (its own default on such CPUs); ONNX
# Runtime has no bf16 path and stays f32. Other names users type for them are accepted too.
PRECISIONS = ("f32", "bf16")
DEFAULT_PRECISION = "f32"
PRECISION_ALIASES = {"f32": "f32", "fp32": "f32", "float32": "f32", "float": "f32",
                     "bf16": "bf16", "bfloat16": "bf16"}
PRECISION_FIX = ("use f32 (the default: answers as ONNX Runtime computes them) or bf16 (OpenVINO computes in "
                 "bfloat16 where the CPU supports it: faster where the CPU has bf16 units, answers differ slightly from f32's)")


def canonical_precision(name: object) -> str | None:
    """The precision `name` means (f32, FP32, float32, bf16, BF16, bfloat16, ...), or None."""
    if not isinstance(name, str):
        return None
    return PRECISION_ALIASES.get(name.strip().lower().replace("-", "").replace("_", ""))


STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
# Temp files of write_atomic look like ".<name>.tmp-<pid>-<hex>": hidden, and never a final name.
_TEMP_MARK = ".tmp-"


class SpecError(ReamerError):
    """A job spec file is missing, unreadable or inconsistent."""

    kind = ErrorKind.BAD_INPUT


def static_batch_for(max_batch: int) -> int | None:
    """The batch size an instance's OpenVINO compiles for first (backends.OpenVinoBackend's `static_batch`): 1 where
    the instance's max batch is 1, so nearly all its batches are one row; None (the dynamic form) where they vary."""
    return 1 if max_batch == 1 else None


@dataclass(frozen=True)
class InstanceSpec:
    """One instance worker: the cpus it is pinned to, runtime threads, max batch, scheduling policy."""

    cpus: list[int]
    threads: int
    max_batch: int
    sched: SchedPolicy = "other"
    streams: int = 1  # OpenVINO streams sharing the threads (each batch split among them)

    def __post_init__(self) -> None:
        # frozen + list: keep lists (JSON-friendly) but validate the values.
        if not self.cpus:
            raise SpecError("an instance has no cpus", "give every instance at least one cpu id")
        if any((not isinstance(c, int)) or c < 0 for c in self.cpus):
            raise SpecError(f"instance cpus {self.cpus!r} are not cpu ids", "use non-negative integers like [2, 3]")
        if self.threads < 1:
            raise SpecError(f"instance threads={self.threads} must be at least 1", "set threads to 1 or more")
        if self.max_batch < 1:
            raise SpecError(f"instance max_batch={self.max_batch} must be at least 1", "set max_batch to 1 or more")
        if not 1 <= self.streams <= self.threads:
            raise SpecError(f"instance streams={self.streams} must be between 1 and its {self.threads} thread(s)",
                            "set streams to 1, or to at most the instance's threads")
        if self.sched not in ("other", "idle"):
            raise SpecError(f"instance sched={self.sched!r} is unknown", 'use "other" or "idle"')

    def key(self) -> tuple:
        """What makes two instances interchangeable: a change in any of these needs a restart."""
        return (tuple(self.cpus), self.threads, self.max_batch, self.sched, self.streams)

    def __hash__(self) -> int:  # cpus is a list (JSON-shaped), so hash the key
        return hash(self.key())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "InstanceSpec":
        try:
            return cls(
                cpus=[int(c) for c in data["cpus"]],
                threads=int(data["threads"]),
                max_batch=int(data.get("max_batch", 1)),
                sched=data.get("sched", "other"),
                streams=int(data.get("streams", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"instance entry {data!r} is invalid ({exc})",
                            'write instances as {"cpus": [2, 3], "threads": 2, "max_batch": 4}') from exc


@dataclass(kw_only=True)
class JobSpec:
    name: str
    kind: JobKind
    model: str
    instances: list[InstanceSpec]
    # Where the job writes status.json, events.jsonl and its rotated log (job.log.1): a directory its user
    # owns. Under the agent that is <deploy dir>/io/; the spec and job.log sit in the deploy dir, root's.
    run_dir: str
    backend: str = "onnxruntime"
    frontdoor_cpus: list[int] = field(default_factory=list)
    slo_ms: float | None = None
    rate_rps: float | None = None
    port: int | None = None
    grpc_port: int | None = None  # online: the gRPC front door's port (None or 0 picks a free one)
    host: str = "0.0.0.0"  # the front door's address: all interfaces, as Triton and KServe listen
    max_request_mb: float = 64.0  # online: larger request bodies get 413
    frontdoor: dict[str, Any] = field(default_factory=dict)  # online: per-client limits (frontdoor.DoorLimits)
    log_max_mb: float = 16.0  # job.log is kept under this size (joblog.bound_log)
    input_dir: str | None = None
    output_dir: str | None = None
    # The traffic's shapes (input name -> dims, perf_analyzer's --shape) and sample data (a .npz or
    # perf_analyzer JSON file) that the instances warm up on; see reamer.serve.samples.
    shapes: dict[str, list[int]] = field(default_factory=dict)
    input_data: str | None = None
    precision: str = DEFAULT_PRECISION  # see PRECISIONS

    def samples(self) -> dict[str, Any]:
        """The warm-up's samples.SampleSpec as a document (what an InstanceWorker takes)."""
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "input_data": self.input_data}

    def __post_init__(self) -> None:
        if self.kind not in ("online", "offline"):
            raise SpecError(f"job {self.name!r} has kind {self.kind!r}", 'use kind "online" or "offline"')
        if self.backend not in BACKENDS:
            raise SpecError(f"job {self.name!r} asks for backend {self.backend!r}", f"use one of {', '.join(BACKENDS)}")
        if self.precision not in PRECISIONS:
            raise SpecError(f"job {self.name!r} asks for precision {self.precision!r}", PRECISION_FIX)
        if not self.instances:
            raise SpecError(f"job {self.name!r} has no instances", "give the job at least one instance")
        if self.kind == "offline" and (not self.input_dir or not self.output_dir):
            raise SpecError(f"offline job {self.name!r} needs input_dir and output_dir",
                            "set both input_dir and output_dir in the spec")
        if self.kind == "online" and self.port is None:
            raise SpecError(f"online job {self.name!r} has no port", "set port (0 picks a free one)")
        if not self.max_request_mb > 0:
            raise SpecError(f"job {self.name!r} has max_request_mb={self.max_request_mb}",
                            "set max_request_mb to a positive number of MiB")
        if self.slo_ms is not None and self.slo_ms <= 0:
            raise SpecError(f"job {self.name!r} has slo_ms={self.slo_ms}", "set slo_ms to a positive number or null")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobSpec":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SpecError(f"job spec has unknown keys {sorted(unknown)}", f"use only {sorted(known)}")
        data = dict(data)
        try:
            data["instances"] = [i if isinstance(i, InstanceSpec) else InstanceSpec.from_dict(i)
                                 for i in data.get("instances", [])]
            data["frontdoor_cpus"] = [int(c) for c in data.get("frontdoor_cpus") or []]
            return cls(**data)
        except TypeError as exc:
            raise SpecError(f"job spec is incomplete or malformed ({exc})",
                            "give at least name, kind, model, instances and run_dir") from exc

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"job spec is not valid JSON ({exc})", "fix the JSON syntax") from exc
        if not isinstance(data, dict):
            raise SpecError("job spec must be a JSON object", "write the spec as {...}")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "JobSpec":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise SpecError(f"cannot read job spec {path}: {exc.strerror}", "check the path and its permissions") from exc
        return cls.from_json(text)

    def save(self, path: str | os.PathLike) -> None:
        """Write the spec as JSON, atomically."""
        write_atomic(path, self.to_json())

    write_atomic = save  # the contract's name for it


@dataclass
class JobStatus:
    name: str
    pid: int
    state: JobState = "starting"
    instances_ready: int = 0
    requests: int = 0
    rate_rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    slo_attainment: float | None = None
    shed: int = 0
    done: int = 0
    total: int = 0
    throughput: float = 0.0
    eta_s: float | None = None
    message: str = ""
    updated_at: float = 0.0
    # Additions to the contract: where an online job listens (port 0 in the spec picks one),
    # and how many instances the spec asks for.
    port: int | None = None
    instances_total: int = 0
    grpc_port: int | None = None  # where the gRPC front door of an online job listens
    precision: str | None = None  # what the ready instances compute in (OpenVINO's read-back; None: none ready)
    # online: the cpu of the job's own process (its front doors) over the last 10 s: cpus busy (1.0 = one cpu)
    # and ms per request (see stats.FrontDoorLoad)
    frontdoor_busy: float | None = None
    frontdoor_cpu_ms: float | None = None
    # online: whether requests are merged into batches (batchability.py: every input and output has a leading
    # batch dimension, confirmed on the sample inputs), and why (not); None until an instance has started
    batchable: bool | None = None
    batchable_reason: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "JobStatus":
        """Parsed with the agent's schema (serve.job_channel): bounded, every field of its declared type (a
        wrong-typed field keeps its default); ValueError when it is no status at all."""
        from reamer.serve.job_channel import BadStatus, parse_status

        try:
            return parse_status(text.encode() if isinstance(text, str) else text)
        except BadStatus as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "JobStatus":
        """Read as the agent reads it: no link followed, never a FIFO, capped (serve.job_channel)."""
        from reamer.serve.job_channel import load_status

        return load_status(path)

    def write(self, run_dir: str | os.PathLike) -> None:
        self.updated_at = time.time()
        write_atomic(Path(run_dir) / STATUS_FILE, self.to_json())


def is_temp_file(name: str) -> bool:
    """True for a leftover temp file of write_atomic (safe to delete when no writer runs)."""
    return name.startswith(".") and _TEMP_MARK in name


def write_atomic(path: str | os.PathLike, data: bytes | str, replace: bool = True) -> None:
    """Write a file so readers see the old or the new content, never a part: temp + fsync + rename.

    replace=False never replaces anything already at `path` (a file, a symlink, another user's
    file): FileExistsError instead. The temp file is O_EXCL (it never follows a planted symlink)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}{_TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path, follow_symlinks=False)  # EEXIST when anything is there: nothing is replaced
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # Make the rename itself durable (a crash right after must not bring back the old name).
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def append_event(run_dir: str | os.PathLike, kind: str, message: str, **fields_: Any) -> dict[str, Any]:
    """Append one event line to <run_dir>/events.jsonl (a single write, so lines never interleave). Texts are
    cut to what the agent takes (serve.job_channel.LIMITS), so a long message is shortened, not dropped."""
    from reamer.serve.job_channel import LIMITS

    fields_ = {k: (v[: LIMITS.max_text_chars] if isinstance(v, str) else v) for k, v in fields_.items()}
    event = {"ts": time.time(), "kind": kind, "message": message[: LIMITS.max_message_chars], **fields_}
    line = (json.dumps(event, default=str) + "\n").encode()
    fd = os.open(Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return event


def read_events(path: str | os.PathLike, since_offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Events after byte offset `since_offset`, and the offset to pass next time.

    A partly written last line is left for the next call. `path` may be the events file or the run dir.
    Read and checked as the agent does (serve.job_channel: no link followed, never a FIFO, lines past the
    cap, invalid or of an unknown kind skipped)."""
    from reamer.serve.job_channel import read_event_dicts

    return read_event_dicts(path, since_offset)


def plan_reconcile(old: list[InstanceSpec], new: list[InstanceSpec]) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Match running instances to a new spec: (kept (old_idx, new_idx) pairs, new indexes to start, old indexes to retire).

    An old instance is kept when an unmatched new one has the same (cpus, threads, max_batch, sched).
    """
    kept: list[tuple[int, int]] = []
    unmatched_old = list(range(len(old)))
    start: list[int] = []
    for j, spec in enumerate(new):
        match = next((i for i in unmatched_old if old[i].key() == spec.key()), None)
        if match is None:
            start.append(j)
        else:
            unmatched_old.remove(match)
            kept.append((match, j))
    return kept, start, unmatched_old
