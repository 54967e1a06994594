"""A fuzzer for the job -> agent channel (serve.job_channel): whatever a job's user writes as events.jsonl or
status.json — random bytes, huge, deeply nested, invalid UTF-8, floods, FIFOs, links, devices, someone else's
file — no exception escapes the reader and every cap holds. Bounded to run in seconds."""
from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reamer.api.schemas import InferenceStatus
from reamer.serve.job_channel import (JOB_EVENT_KINDS, LIMITS, BadLine, BadStatus, EventCursor, JobChannel, JobEvent,
                                      ReadRequest, parse_event_line, parse_events_chunk, parse_status, read_channel,
                                      read_job_events, read_job_status)
from reamer.serve.spec import EVENTS_FILE, STATUS_FILE, JobStatus
from tests.conftest import IS_ROOT

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])
ME = frozenset({os.geteuid()})
# The job's uid in the planted-files test: as root, another user's (root's own files are then someone else's).
JOB_UID = 65534 if IS_ROOT else os.geteuid()

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2000))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=70), inner,
                                                                                  max_size=4)), max_leaves=12)
kinds = st.one_of(st.sampled_from(sorted(JOB_EVENT_KINDS)),
                  st.sampled_from(["training_ended", "rt_throttling_disabled", "inference_removed", "demoted_all"]),
                  json_values)
event_docs = st.fixed_dictionaries({"kind": kinds}, optional={"message": json_values, "ts": json_values}).flatmap(
    lambda base: st.dictionaries(st.text(max_size=70), json_values, max_size=24).map(lambda extra: {**extra, **base}))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


lines = st.one_of(
    st.binary(max_size=6000),
    event_docs.map(lambda d: json.dumps(d, allow_nan=True).encode()),
    st.integers(min_value=1, max_value=20_000).map(nested),
    st.integers(min_value=1, max_value=20_000).map(lambda n: b"[" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: b'{"kind": "done", "x": ' + b"{" * n),
    st.binary(max_size=64).map(lambda b: b'{"kind": "done", "message": "' + b"\xff\xfe" + b + b'"}'),
    st.just(b'{"kind": "done", "message": "\\ud800\\u001b[2J\\u202e"}'),
)


def assert_capped(event: JobEvent) -> None:
    assert event.kind in JOB_EVENT_KINDS
    assert isinstance(event.message, str) and len(event.message) <= LIMITS.max_message_chars
    assert event.message.isprintable() or all(c.isprintable() or c == " " for c in event.message)
    event.message.encode("utf-8")  # storable: no lone surrogates
    assert len(event.data) <= LIMITS.max_fields
    for key, value in event.data.items():
        assert isinstance(key, str) and len(key) <= 64 and key not in ("kind", "message", "ts")
        assert value is None or isinstance(value, (bool, int, float, str))
        if isinstance(value, str):
            assert len(value) <= LIMITS.max_text_chars and value.isprintable()
            value.encode("utf-8")
        if isinstance(value, float):
            assert math.isfinite(value)
        if isinstance(value, int):
            assert abs(value) < 2 ** 53
    json.dumps(event.to_dict(), allow_nan=False)


@FUZZ
@given(lines)
def test_any_line_is_an_event_within_the_caps_or_a_counted_rejection(line):
    try:
        event = parse_event_line(line)
    except BadLine as bad:
        assert bad.reason in ("too_long", "not_json", "too_deep", "not_an_object", "unknown_kind")
        if len(line) > LIMITS.max_line_bytes:
            assert bad.reason == "too_long"
        return
    assert len(line) <= LIMITS.max_line_bytes
    assert_capped(event)


@FUZZ
@given(st.lists(lines, max_size=16), st.booleans(), st.booleans())
def test_any_chunk_advances_within_itself_and_keeps_the_caps(parts, discarding, torn):
    chunk = b"\n".join(parts) + (b"" if torn else b"\n")
    start = EventCursor(1000, discarding)
    read = parse_events_chunk(chunk, start)
    assert start.offset <= read.cursor.offset <= start.offset + len(chunk)
    assert len(read.events) <= chunk.count(b"\n")
    for event in read.events:
        assert_capped(event)
    assert sum(read.rejected.values()) + len(read.events) <= chunk.count(b"\n") + 1
    rest = chunk[read.cursor.offset - start.offset:]
    if not read.cursor.discarding:
        assert b"\n" not in rest and len(rest) <= LIMITS.max_line_bytes  # only a torn last line is left
    if chunk and read.cursor == start:
        assert b"\n" not in chunk and len(chunk) <= LIMITS.max_line_bytes and not discarding


status_docs = st.dictionaries(
    st.sampled_from(["name", "pid", "state", "rate_rps", "p50_ms", "p99_ms", "slo_attainment", "done", "total",
                     "throughput", "eta_s", "message", "port", "grpc_port", "precision", "frontdoor_busy",
                     "instances_ready", "updated_at", "unknown", "__class__"]),
    json_values, max_size=20)


def check_status(status: JobStatus) -> None:
    """What the job list, `infer show` and /metrics do with a status must work."""
    for name, value in vars(status).items():
        if isinstance(value, float):
            assert math.isfinite(value), name
        if isinstance(value, str):
            limit = LIMITS.max_message_chars if name == "message" else LIMITS.max_text_chars
            assert len(value) <= limit and value.isprintable(), name
    assert isinstance(status.name, str) and isinstance(status.pid, int) and not isinstance(status.pid, bool)
    assert status.state in ("starting", "ready", "running", "done", "failed")
    doc = {k: getattr(status, k) for k in ("rate_rps", "p50_ms", "p99_ms", "slo_attainment", "done", "total",
                                           "throughput", "eta_s", "frontdoor_busy", "frontdoor_cpu_ms")}
    InferenceStatus(**doc)  # the API's response model takes it
    json.dumps(doc, allow_nan=False)
    for value in doc.values():
        if value is not None:
            float(value)  # a Prometheus sample


@FUZZ
@given(st.one_of(status_docs.map(lambda d: json.dumps(d, allow_nan=True).encode()),
                 st.builds(lambda d, pid: json.dumps({"name": "j", "pid": pid, **d}, allow_nan=True).encode(),
                           status_docs, st.integers(min_value=0, max_value=2**40)),
                 st.binary(max_size=3000), st.integers(min_value=1, max_value=100_000).map(nested)))
def test_any_status_is_typed_or_ignored(raw):
    try:
        status = parse_status(raw)
    except BadStatus:
        return
    check_status(status)


# --- real files: what a job's user can put where the agent reads -----------------------------

@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("root-only") / "secret"
    path.write_text('{"kind": "done", "message": "TOPSECRET"}\n' * 3)
    os.chmod(path, 0o600)
    return path


def plant(directory: Path, name: str, what: str, content: bytes, secret: Path) -> None:
    """Put `what` at directory/name: a regular file with `content`, a FIFO, a link, a directory, a device..."""
    path = directory / name
    if what == "file":
        path.write_bytes(content)
    elif what == "fifo":
        os.mkfifo(path)
    elif what == "symlink":
        path.symlink_to(secret)
    elif what == "hardlink":
        os.link(secret, path)
    elif what == "dir":
        path.mkdir()
    elif what == "dev":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless bytes
    elif what == "sparse":
        with open(path, "wb") as fh:
            fh.truncate(200 * 2**20)  # 200 MiB of NULs, no newline
    elif what == "other_owner":
        path.write_bytes(content)
        os.chown(path, JOB_UID + 1, JOB_UID + 1)
    if what not in ("symlink", "hardlink", "other_owner"):
        os.lchown(path, JOB_UID, JOB_UID)  # the job user's own


kinds_of_file = ["file", "fifo", "symlink", "dir", "sparse"] + (["hardlink", "dev", "other_owner"] if IS_ROOT else [])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.data_too_large])
@given(what_events=st.sampled_from(kinds_of_file), what_status=st.sampled_from(kinds_of_file),
       events=st.lists(lines, max_size=8).map(lambda ls: b"\n".join(ls)), status=st.binary(max_size=2000),
       offset=st.integers(min_value=0, max_value=5000), discarding=st.booleans())
def test_whatever_is_planted_the_reader_returns_and_never_shows_what_it_must_not(
        secret, what_events, what_status, events, status, offset, discarding):
    with tempfile.TemporaryDirectory(prefix="rmr-fuzz-") as base:
        directory = Path(base)
        plant(directory, EVENTS_FILE, what_events, events, secret)
        plant(directory, STATUS_FILE, what_status, status, secret)
        read = read_channel(ReadRequest("j", 1, str(directory), frozenset({JOB_UID}), EventCursor(offset, discarding),
                                        pid=1))
        for event in read.events.events:
            assert_capped(event)
            assert "TOPSECRET" not in event.message  # a link or a hard link to root's file is never read
        assert read.events.cursor.offset - offset <= LIMITS.max_read_bytes + LIMITS.max_skip_bytes
        if what_events not in ("file", "sparse"):
            assert not read.events.events and read.events.cursor == EventCursor(offset, discarding)
        if what_events in ("fifo", "symlink", "dir", "dev", "hardlink", "other_owner"):
            assert read.events.problem
        if read.status.status is not None:
            assert what_status == "file"
            check_status(read.status.status)


def test_a_flood_is_read_a_capped_chunk_at_a_time_and_forwarded_at_the_rate(tmp_path):
    line = json.dumps({"kind": "overload", "message": "x"}).encode() + b"\n"
    (tmp_path / EVENTS_FILE).write_bytes(line * 12_000)
    channel, cursor, forwarded, passes = JobChannel(), EventCursor(), 0, 0
    while True:
        read = read_job_events(tmp_path, ME, cursor)
        if read.cursor == cursor:
            break
        assert read.cursor.offset - cursor.offset <= LIMITS.max_read_bytes
        forwarded += len(channel.admit(read.events, now=0.0))
        cursor, passes = read.cursor, passes + 1
    assert cursor.offset == len(line) * 12_000 and passes >= len(line) * 12_000 // LIMITS.max_read_bytes
    assert forwarded == LIMITS.events_per_minute
    assert channel.dropped["rate"] == 12_000 - LIMITS.events_per_minute
    note = channel.note(now=1.0)
    assert note["dropped"] == {"rate": 12_000 - LIMITS.events_per_minute}
    assert channel.note(now=2.0) is None  # once a minute at most
    assert len(channel.admit([JobEvent("done", "d")], now=61.0)) == 1  # the next minute has room again


def test_a_40_mb_line_is_skipped_in_capped_reads_and_the_next_line_is_read(tmp_path):
    path = tmp_path / EVENTS_FILE
    with open(path, "wb") as fh:
        fh.write(b'{"kind": "done", "message": "' + b"A" * (40 * 2**20) + b'"}\n')
        fh.write(b'{"kind": "done", "message": "after"}\n')
    cursor, seen, rejected = EventCursor(), [], Counter()
    for _ in range(100):
        read = read_job_events(tmp_path, ME, cursor)
        assert read.cursor.offset - cursor.offset <= LIMITS.max_skip_bytes + LIMITS.max_read_bytes
        seen += read.events
        rejected.update(read.rejected)
        if read.cursor == cursor:
            break
        cursor = read.cursor
    assert [e.message for e in seen] == ["after"] and rejected == Counter({"too_long": 1})


def test_a_status_larger_than_the_cap_is_ignored(tmp_path):
    (tmp_path / STATUS_FILE).write_bytes(json.dumps({"name": "j", "pid": 1, "message": "m" * 100_000}).encode())
    read = read_job_status(tmp_path, ME)
    assert read.status is None and read.problem == "too_large"


def test_every_event_kind_a_job_emits_is_let_through():
    """The kinds reamer.serve writes (append_event, the job's _event, the batcher's _fault) are exactly the ones the
    agent forwards: a kind missing from JOB_EVENT_KINDS would be dropped as forged."""
    import re
    from pathlib import Path

    import reamer.serve
    from reamer.serve.job_channel import JOB_EVENT_KINDS

    emitted = set()
    for source in Path(reamer.serve.__file__).parent.rglob("*.py"):
        text = source.read_text()
        emitted |= set(re.findall(r'(?:append_event\([^,]+,|_event\(|_fault\()\s*"([a-z_]+)"', text))
    assert emitted and emitted <= JOB_EVENT_KINDS, sorted(emitted - JOB_EVENT_KINDS)
