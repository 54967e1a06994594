"""The job -> agent channel, the agent's side: what a job may tell the agent, and how much.

A job (running as its user) writes `status.json` (JobStatus, replaced atomically) and appends to
`events.jsonl` (one JSON object per line) in a directory its user can write; the root agent reads them.
Nothing there is trusted:

- files are read with reamer.host.safe_files.open_untrusted: never through a link, never a FIFO or a
  device, only regular files of the job's uid, never more than a cap per read;
- an event line longer than LIMITS.max_line_bytes is skipped before it is parsed; a line that is not a
  flat JSON object of a known kind is skipped (RecursionError of a deeply nested line included) and
  counted, never a failed pass;
- only JOB_EVENT_KINDS pass (the kinds reamer.serve's jobs emit); texts are cleaned of control
  characters and cut to size, data is flat (scalars only) and bounded;
- per job, at most LIMITS.events_per_minute events a minute are forwarded: the rest are dropped and
  counted (JobChannel.note tells the agent so, once a minute at most);
- the status has a schema: every field has the type JobStatus declares (finite numbers, bounded
  strings); a wrong-typed field is dropped (its default stays), a status without name/pid is ignored.

The job's side (serve.spec.append_event / JobStatus.write) writes the same format as ever.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter, deque
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Collection, Union

from reamer.host.safe_files import UntrustedFileError, UntrustedFileMissing, open_untrusted
from reamer.serve.spec import EVENTS_FILE, STATUS_FILE, JobStatus

# Every kind a job emits (serve/runtime/: job.py, instance_worker.py, offline.py, the batcher's faults): anything else
# is dropped. tests/security/test_channel_fuzz.py checks that serve/ emits no other.
JOB_EVENT_KINDS = frozenset({
    "failed", "done", "overload", "frontdoor_saturated", "reconfigured", "reload_failed",
    "worker_crashed", "worker_restarted", "worker_start_failed", "input_failed",
    "batching", "batch_failed", "not_batchable", "lane_failed",
})
# Keys of an event line that are not data (the agent sets its own time and job).
_ENVELOPE = ("ts", "kind", "message")
_DATA_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_INT = 2 ** 53  # exact as a float (Prometheus, JSON clients)
_JOB_STATES = ("starting", "ready", "running", "done", "failed")

Scalar = Union[str, int, float, bool, None]


@dataclass(frozen=True)
class ChannelLimits:
    """The caps of the channel (per job)."""

    max_line_bytes: int = 4096  # one event line; longer ones are skipped unparsed
    max_message_chars: int = 1024  # an event's or the status's message is cut to this
    max_text_chars: int = 256  # any other string (data values, status fields)
    max_fields: int = 16  # data fields of one event; the rest are dropped
    max_read_bytes: int = 64 * 1024  # of events.jsonl per pass (held in memory at once)
    max_skip_bytes: int = 4 * 2**20  # of an over-long line skipped per pass, a max_read_bytes piece at a time
    max_status_bytes: int = 64 * 1024  # status.json larger than this is ignored
    events_per_minute: int = 30  # forwarded per job; the rest are dropped and counted


LIMITS = ChannelLimits()


class BadLine(Exception):
    """An event line the agent does not forward; `reason` is what the drop counts are keyed by."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BadStatus(Exception):
    """A status.json the agent ignores (the previous status stays)."""


@dataclass(frozen=True)
class JobEvent:
    kind: str
    message: str
    data: dict[str, Scalar] = field(default_factory=dict)
    ts: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The line as the job wrote it, less what was dropped."""
        return {"ts": self.ts, "kind": self.kind, "message": self.message, **self.data}


@dataclass(frozen=True)
class EventCursor:
    """Where the agent has read a job's events.jsonl to. `discarding`: the offset is inside a line longer than
    the cap, whose rest is skipped up to its newline."""

    offset: int = 0
    discarding: bool = False


@dataclass
class EventsRead:
    events: list[JobEvent]
    cursor: EventCursor
    rejected: Counter = field(default_factory=Counter)  # reason -> lines
    problem: str = ""  # the file itself was refused: link | not_regular | wrong_owner | unreadable | ...


@dataclass
class StatusRead:
    status: JobStatus | None  # None: nothing (new) to take; the previous status stays
    problem: str = ""  # why it was refused: link | not_regular | too_large | invalid | ...


# --- texts and values ---------------------------------------------------------------------------

def clean_text(value: str, limit: int) -> str:
    """`value` safe to store and print: valid UTF-8, no control or format characters (terminal escapes,
    bidi overrides), at most `limit` characters."""
    text = value[: limit + 1].encode("utf-8", "replace").decode("utf-8")
    text = "".join(c if c.isprintable() else " " if c in "\t\n\r" else "\ufffd" for c in text)
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"


def _scalar(value: Any, limits: ChannelLimits) -> tuple[bool, Scalar]:
    if value is None or isinstance(value, bool):
        return True, value
    if isinstance(value, int):
        return (True, value) if -_MAX_INT < value < _MAX_INT else (False, None)
    if isinstance(value, float):
        return (True, value) if math.isfinite(value) else (False, None)
    if isinstance(value, str):
        return True, clean_text(value, limits.max_text_chars)
    return False, None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity, -Infinity: Python's json takes them by default


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BadLine("too_deep") from None
    except (ValueError, TypeError):  # JSONDecodeError, UnicodeDecodeError (invalid UTF-8), constants
        raise BadLine("not_json") from None


# --- events -------------------------------------------------------------------------------------

def parse_event_line(line: bytes, limits: ChannelLimits = LIMITS) -> JobEvent:
    """One line of events.jsonl as the agent takes it; BadLine(reason) when it takes none of it."""
    if len(line) > limits.max_line_bytes:
        raise BadLine("too_long")
    doc = _loads(line)
    if not isinstance(doc, dict):
        raise BadLine("not_an_object")
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in JOB_EVENT_KINDS:
        raise BadLine("unknown_kind")
    message = doc.get("message")
    message = clean_text(message, limits.max_message_chars) if isinstance(message, str) else kind
    ts = doc.get("ts")
    ts = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts) else None
    data: dict[str, Scalar] = {}
    for key, value in doc.items():
        if key in _ENVELOPE or len(data) >= limits.max_fields:
            continue
        ok, scalar = _scalar(value, limits)
        if ok and isinstance(key, str) and _DATA_KEY.fullmatch(key):
            data[key] = scalar
    return JobEvent(kind, message, data, ts)


def parse_events_chunk(chunk: bytes, cursor: EventCursor, limits: ChannelLimits = LIMITS) -> EventsRead:
    """The events in `chunk` (bytes of events.jsonl from cursor.offset on) and the cursor after them. A last
    line without its newline is left for the next read, unless it is already longer than the cap."""
    events: list[JobEvent] = []
    rejected: Counter = Counter()
    discarding = cursor.discarding
    pos = 0
    while (end := chunk.find(b"\n", pos)) >= 0:
        line, pos = chunk[pos:end], end + 1
        if discarding:  # the tail of an over-long line (counted when it began)
            discarding = False
            continue
        if not line.strip():
            continue
        try:
            events.append(parse_event_line(line, limits))
        except BadLine as bad:
            rejected[bad.reason] += 1
    rest = len(chunk) - pos
    if rest and (discarding or rest > limits.max_line_bytes):
        if not discarding:
            rejected["too_long"] += 1
        return EventsRead(events, EventCursor(cursor.offset + len(chunk), True), rejected)
    return EventsRead(events, EventCursor(cursor.offset + pos, discarding), rejected)


def read_job_events(directory: str | os.PathLike | int, owner_uids: Collection[int], cursor: EventCursor,
                    limits: ChannelLimits = LIMITS) -> EventsRead:
    """The next events of `directory`/events.jsonl (at most limits.max_read_bytes of them), read safely. An
    over-long line is skipped up to limits.max_skip_bytes a call, a max_read_bytes piece at a time."""
    read = _read_events_once(directory, owner_uids, cursor, limits)
    skipped = read.cursor.offset - cursor.offset
    while read.cursor.discarding and not read.events and not read.problem and 0 < skipped < limits.max_skip_bytes:
        more = _read_events_once(directory, owner_uids, read.cursor, limits)
        if more.cursor == read.cursor:
            break
        skipped += more.cursor.offset - read.cursor.offset
        read = EventsRead(more.events, more.cursor, read.rejected + more.rejected, more.problem)
    return read


def _read_events_once(directory: str | os.PathLike | int, owner_uids: Collection[int], cursor: EventCursor,
                      limits: ChannelLimits) -> EventsRead:
    try:
        chunk = open_untrusted(directory, EVENTS_FILE, owner_uids, limits.max_read_bytes, offset=cursor.offset,
                               mode="head")
    except UntrustedFileMissing:
        return EventsRead([], cursor)
    except UntrustedFileError as exc:
        return EventsRead([], cursor, problem=exc.reason or "unreadable")
    except OSError:
        return EventsRead([], cursor, problem="unreadable")
    return parse_events_chunk(chunk, cursor, limits)


# --- status -------------------------------------------------------------------------------------

def _field_types() -> dict[str, tuple[str, bool, bool]]:
    """JobStatus field -> (base type, None allowed, required), from its annotations ("float | None", ...)."""
    table = {}
    for f in fields(JobStatus):
        annotation = str(f.type).replace(" ", "")
        optional = "|None" in annotation or annotation.startswith("Optional[")
        base = annotation.replace("|None", "").removeprefix("Optional[").rstrip("]")
        required = f.default is MISSING and f.default_factory is MISSING  # type: ignore[misc]
        table[f.name] = (base, optional, required)
    return table


_STATUS_FIELDS = _field_types()


def _status_value(name: str, base: str, optional: bool, value: Any, limits: ChannelLimits) -> tuple[bool, Any]:
    if value is None:
        return optional, None
    if isinstance(value, bool):
        return (True, value) if base == "bool" else (False, None)
    if base == "int":
        top = 65536 if name.endswith("port") else _MAX_INT
        return (True, value) if isinstance(value, int) and -1 < value < top else (False, None)
    if base == "float":
        ok = isinstance(value, (int, float)) and math.isfinite(value) and abs(value) < _MAX_INT
        return (True, float(value)) if ok else (False, None)
    if base == "JobState":
        return (True, value) if value in _JOB_STATES else (False, None)
    if base == "str" and isinstance(value, str):
        cap = limits.max_message_chars if name == "message" else limits.max_text_chars
        return True, clean_text(value, cap)
    return False, None  # a type this schema does not know: the default stays


def status_from_doc(doc: Any, limits: ChannelLimits = LIMITS) -> JobStatus:
    """A JobStatus of checked types from a parsed status.json; BadStatus when it cannot be one."""
    if not isinstance(doc, dict):
        raise BadStatus("status is not a JSON object")
    values: dict[str, Any] = {}
    for name, (base, optional, required) in _STATUS_FIELDS.items():
        if name not in doc:
            if required:
                raise BadStatus(f"status has no {name}")
            continue
        ok, value = _status_value(name, base, optional, doc[name], limits)
        if ok:
            values[name] = value
        elif required:
            raise BadStatus(f"status field {name} has the wrong type")
    return JobStatus(**values)


def parse_status(raw: bytes, limits: ChannelLimits = LIMITS) -> JobStatus:
    """status.json's bytes -> JobStatus, bounded and typed; BadStatus otherwise."""
    if len(raw) > limits.max_status_bytes:
        raise BadStatus(f"status is larger than {limits.max_status_bytes} bytes")
    try:
        doc = _loads(raw)
    except BadLine as bad:
        raise BadStatus(f"status is not JSON ({bad.reason})") from None
    return status_from_doc(doc, limits)


def read_job_status(directory: str | os.PathLike | int, owner_uids: Collection[int],
                    limits: ChannelLimits = LIMITS) -> StatusRead:
    """`directory`/status.json, read safely and checked (StatusRead.status None: keep the previous one)."""
    try:
        raw = open_untrusted(directory, STATUS_FILE, owner_uids, limits.max_status_bytes, mode="whole")
    except UntrustedFileMissing:
        return StatusRead(None)
    except UntrustedFileError as exc:
        return StatusRead(None, exc.reason or "unreadable")
    except OSError:
        return StatusRead(None, "unreadable")
    try:
        return StatusRead(parse_status(raw, limits))
    except BadStatus:
        return StatusRead(None, "invalid")


# --- per job, between reads ---------------------------------------------------------------------

@dataclass
class JobChannel:
    """What the agent keeps per job between reads: its rate window and what it dropped since the last note."""

    deploy: Any = None  # which deploy of the job this belongs to (a new one starts afresh)
    discarding: bool = False
    sent: deque = field(default_factory=deque)  # monotonic times of the events forwarded in the last minute
    dropped: Counter = field(default_factory=Counter)
    problems: Counter = field(default_factory=Counter)  # files refused (link, not_regular, ...)
    last_note: float = float("-inf")

    def admit(self, events: list[JobEvent], limits: ChannelLimits = LIMITS,
              now: float | None = None) -> list[JobEvent]:
        """The events within the job's rate; the rest are counted as dropped ("rate")."""
        now = time.monotonic() if now is None else now
        while self.sent and now - self.sent[0] >= 60.0:
            self.sent.popleft()
        room = max(0, limits.events_per_minute - len(self.sent))
        taken = events[:room]
        self.sent.extend([now] * len(taken))
        if len(events) > room:
            self.dropped["rate"] += len(events) - room
        return taken

    def count(self, rejected: Counter, problem: str = "") -> None:
        self.dropped.update(rejected)
        if problem:
            self.problems[problem] += 1

    def note(self, now: float | None = None, every_s: float = 60.0) -> dict[str, Any] | None:
        """What was dropped or refused since the last note, at most once every `every_s` (then reset)."""
        now = time.monotonic() if now is None else now
        if not (self.dropped or self.problems) or now - self.last_note < every_s:
            return None
        note = {"dropped": dict(self.dropped), "refused_files": dict(self.problems)}
        self.dropped, self.problems, self.last_note = Counter(), Counter(), now
        return note


# --- for the job's own tools and tests: a path, any owner ---------------------------------------

def _owner_of(path: Path) -> set[int]:
    try:
        return {os.lstat(path).st_uid}
    except OSError:
        return set()


def read_event_dicts(path: str | os.PathLike, since_offset: int = 0,
                     max_bytes: int = 16 * 2**20) -> tuple[list[dict[str, Any]], int]:
    """Events of an events file (or of a run dir) after byte `since_offset`, as dicts, and the offset to pass
    next; the same checks as the agent's, without a rate. At most `max_bytes` are read per call."""
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS_FILE
    cursor = EventCursor(since_offset)
    found: list[dict[str, Any]] = []
    owners = _owner_of(path)
    while cursor.offset - since_offset < max_bytes:
        read = read_job_events(path.parent, owners, cursor)
        found.extend(e.to_dict() for e in read.events)
        if read.cursor == cursor:
            break
        cursor = read.cursor
    return found, cursor.offset


def load_status(path: str | os.PathLike) -> JobStatus:
    """A status file read as the agent reads it; OSError when it cannot be read, ValueError when invalid."""
    path = Path(path)
    owner = _owner_of(path)
    if not owner:  # not there (yet): the same answer as a missing file, not a refusal
        raise FileNotFoundError(f"{path} does not exist")
    try:
        raw = open_untrusted(path.parent, path.name, owner, LIMITS.max_status_bytes, mode="whole")
    except UntrustedFileMissing:
        raise FileNotFoundError(f"{path} does not exist") from None
    except UntrustedFileError as exc:
        raise OSError(exc.message) from None
    try:
        return parse_status(raw)
    except BadStatus as exc:
        raise ValueError(str(exc)) from None


# --- one pass: read every job's files (outside the agent's lock), then apply (under it) ---------

@dataclass(frozen=True)
class ReadRequest:
    """What to read of one job, decided under the agent's lock and read outside it."""

    job: str
    deploy: Any  # the deploy it was made for: a read of a job removed and deployed again meanwhile is dropped
    directory: str
    owner_uids: frozenset[int]
    cursor: EventCursor
    pid: int | None = None  # the job's process when the read was asked for (a status of another one is stale)
    exited: bool = False  # its process had exited before the read: what was read is its last word


@dataclass
class ChannelRead:
    request: ReadRequest
    status: StatusRead
    events: EventsRead


def read_channel(request: ReadRequest, limits: ChannelLimits = LIMITS) -> ChannelRead:
    """One job's status and next events; never raises, never blocks on what the job's user put there."""
    try:
        status = read_job_status(request.directory, request.owner_uids, limits)
    except Exception:  # noqa: BLE001 - one job's files must never fail the pass of every job
        status = StatusRead(None, "unreadable")
    try:
        events = read_job_events(request.directory, request.owner_uids, request.cursor, limits)
    except Exception:  # noqa: BLE001
        events = EventsRead([], request.cursor, problem="unreadable")
    return ChannelRead(request, status, events)


def read_channels(requests: list[ReadRequest], limits: ChannelLimits = LIMITS) -> dict[str, ChannelRead]:
    return {r.job: read_channel(r, limits) for r in requests}
