"""The agent's durable desired state: SQLite (WAL) at <state_dir>/state.db.

Every change is written here (one transaction) BEFORE the agent applies it to the host, so a
restarted agent knows what it promised and re-attaches to it. Records are JSON documents keyed by
job name; the schema version lives in PRAGMA user_version.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from reamer.errors import ErrorKind
from reamer.host.errors import ReamerError

log = logging.getLogger("reamer.store")

SCHEMA_VERSION = 1
# Bounds of one event as stored: a longer message is cut, larger data is replaced by a note of its size.
MAX_EVENT_MESSAGE_CHARS = 8192
MAX_EVENT_DATA_BYTES = 64 * 1024
RESERVE_RETRY_S = 30.0  # how often a missing disk reserve is made again (when there is room)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS training_jobs (name TEXT PRIMARY KEY, doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS inference_jobs (name TEXT PRIMARY KEY, doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL, job TEXT,
    message TEXT NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_job ON events(job, id);
CREATE TABLE IF NOT EXISTS documents (name TEXT PRIMARY KEY, doc TEXT NOT NULL, updated_at REAL NOT NULL);
"""
# The bytes an event takes, as retention counts them.
_EVENT_SIZE = ("(length(CAST(kind AS BLOB)) + length(CAST(message AS BLOB)) + length(CAST(data AS BLOB)) "
               "+ coalesce(length(CAST(job AS BLOB)), 0) + 16)")

_TABLES = {"training": "training_jobs", "inference": "inference_jobs"}


class StoreError(ReamerError):
    """The state database cannot be opened, read or written."""

    kind = ErrorKind.STORE_UNAVAILABLE


@dataclass(frozen=True)
class Retention:
    """How much of the event log is kept (the config's `events` section): past a bound, oldest first."""

    max_count: int = 20000
    max_bytes: int = 32 * 2**20
    max_per_job: int = 2000  # a job's own events beyond this go before anything else


def _recovery_fix(path: Path) -> str:
    return (f"stop the agent, move the database aside (mv {path} {path}.bad; also its -wal and -shm files) "
            "and start the agent again: it starts empty, running training keeps its pinning and can be "
            "attached again with `reamer train attach`")


def _read_only(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _is_full(exc: BaseException) -> bool:
    return getattr(exc, "sqlite_errorname", "") == "SQLITE_FULL" or "disk is full" in str(exc) \
        or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC)


def _cannot_write(path: Path, exc: BaseException) -> StoreError | None:
    """The state directory is read-only or unwritable, or its disk is full: said as such (the database is
    fine: moving it aside would lose every job for nothing). None when it is none of these."""
    directory = path.parent
    if _read_only(directory):
        return StoreError(f"the state directory {directory} is on a read-only file system, so the agent cannot "
                          f"write its state database {path.name} ({exc}); the database itself is intact",
                          f"make it writable again (mount -o remount,rw on its mount point, or end the ro bind "
                          f"mount), or set state_dir (--state-dir) to a writable directory; do not move {path} "
                          "aside: it holds every job")
    name = getattr(exc, "sqlite_errorname", "")
    if name.startswith("SQLITE_READONLY") or name in ("SQLITE_CANTOPEN", "SQLITE_PERM") \
            or not os.access(directory, os.W_OK):
        return StoreError(f"the agent cannot write its state database {path} or the directory {directory} "
                          f"({exc}); the database itself is intact",
                          f"give the agent's user write access to {directory} and to {path.name}, its -wal and "
                          f"-shm files (check chattr +i with lsattr), or set state_dir to a writable directory; "
                          f"do not move {path} aside: it holds every job")
    if _is_full(exc):
        try:
            free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        except OSError:
            free = 0
        return StoreError(f"the disk of the state directory {directory} is full ({free // 1024} KiB free): "
                          f"the agent cannot record changes ({exc})",
                          f"free space on that file system (see du -sh {directory}/* and what else fills it); "
                          "the agent's event log is bounded by events.max_mb")
    return None


def _open_error(path: Path, exc: sqlite3.Error) -> StoreError:
    name = getattr(exc, "sqlite_errorname", "")
    corrupt = name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or type(exc) is sqlite3.DatabaseError
    if not corrupt:
        refused = _cannot_write(path, exc)
        if refused is not None:
            return refused
        return StoreError(f"cannot open state database {path}: {exc}",
                          f"check the permissions and free space of {path.parent}; if the database itself is "
                          "damaged, " + _recovery_fix(path))
    return StoreError(f"state database {path} is corrupt or not a reamer database ({exc})", _recovery_fix(path))


class Store:
    """Thread-safe access to state.db; each method is one transaction.

    `retention` bounds the event log; `reserve_bytes` is a file kept beside the database and given up when
    the disk is full, so the writes that free resources (a job's record deleted or updated, the agent's own
    events) still succeed; writes that only add (a new job, a job's forwarded events) never use it."""

    def __init__(self, path: str | Path, retention: Retention | None = None, reserve_bytes: int = 0) -> None:
        self.path = Path(path)
        self.retention = retention or Retention()
        self.reserve_path = self.path.with_name(self.path.name + ".reserve")
        self.reserve_bytes = max(0, int(reserve_bytes))
        self._reserve_tried = float("-inf")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the state directory {self.path.parent}: {exc.strerror}",
                             "set state_dir in the config (or --state-dir) to a writable directory") from None
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"state database {self.path} has schema version {version}, newer than this reamer "
                    f"understands ({SCHEMA_VERSION}): it was written by a newer reamer",
                    "run the newer reamer again, or " + _recovery_fix(self.path))
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            if version < SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(check)
            self._count, self._bytes = self._db.execute(
                f"SELECT COUNT(*), COALESCE(SUM({_EVENT_SIZE}), 0) FROM events").fetchone()
        except sqlite3.Error as exc:
            raise _open_error(self.path, exc) from None
        self._make_reserve()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- the disk reserve -----------------------------------------------------------------------

    def _make_reserve(self) -> None:
        """Make the reserve file if it is missing and there is room (tried at most every RESERVE_RETRY_S)."""
        if not self.reserve_bytes or self.reserve_path.exists():
            return
        now = time.monotonic()
        if now - self._reserve_tried < RESERVE_RETRY_S:
            return
        self._reserve_tried = now
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, self.reserve_bytes)  # real blocks, not a sparse file
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self.reserve_path.unlink(missing_ok=True)
            log.warning("cannot keep a %d KiB disk reserve in %s: %s", self.reserve_bytes // 1024,
                        self.path.parent, exc.strerror)
            return
        os.close(fd)

    def _give_up_reserve(self) -> bool:
        try:
            self.reserve_path.unlink()
        except OSError:
            return False
        log.warning("the state disk is full: gave up the %d KiB reserve in %s to record a change",
                    self.reserve_bytes // 1024, self.path.parent)
        self._reserve_tried = time.monotonic()
        return True

    # --- transactions ---------------------------------------------------------------------------

    def _transaction(self, fn, write: bool = True):
        self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            result = fn(self._db)
        except BaseException:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite rolled back already (SQLITE_FULL does)
            raise
        self._db.execute("COMMIT")
        return result

    def _run(self, fn, essential: bool | None = True, *, may_write: bool = True):
        """One transaction. On a full disk, an `essential` one (a callable deciding it, given the connection,
        for None-like cases) gives up the reserve and tries once more."""
        with self._lock:
            try:
                try:
                    result = self._transaction(fn, may_write)
                except sqlite3.Error as exc:
                    if not (may_write and _is_full(exc) and self._essential(essential)
                            and self._give_up_reserve()):
                        raise
                    result = self._transaction(fn)
            except sqlite3.Error as exc:
                refused = _cannot_write(self.path, exc) if may_write else None
                if refused is not None:
                    raise refused from None
                raise StoreError(f"state database {self.path} failed: {exc}",
                                 "check free disk space and permissions of the state directory; if it "
                                 "persists, " + _recovery_fix(self.path)) from None
            if may_write:
                self._make_reserve()
            return result

    def _essential(self, essential: Any) -> bool:
        if callable(essential):
            try:
                return bool(essential(self._db))
            except sqlite3.Error:
                return False
        return bool(essential)

    # --- jobs (kind = "training" | "inference") -----------------------------------------------

    def put_job(self, kind: str, name: str, doc: dict[str, Any]) -> None:
        """Insert or update a job's record. On a full disk, an update (the job exists: demote, a state change)
        may use the reserve; a new job may not."""
        table = _TABLES[kind]
        text = json.dumps(doc, sort_keys=True)
        self._run(lambda db: db.execute(
            f"INSERT INTO {table}(name, doc, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET doc=excluded.doc, updated_at=excluded.updated_at",
            (name, text, time.time())),
            essential=lambda db: db.execute(f"SELECT 1 FROM {table} WHERE name=?", (name,)).fetchone() is not None)

    def delete_job(self, kind: str, name: str) -> None:
        """Forget a job (detach, remove, its end): may use the disk reserve."""
        table = _TABLES[kind]
        self._run(lambda db: db.execute(f"DELETE FROM {table} WHERE name=?", (name,)))

    def get_job(self, kind: str, name: str) -> dict[str, Any] | None:
        table = _TABLES[kind]
        row = self._run(lambda db: db.execute(f"SELECT doc FROM {table} WHERE name=?", (name,)).fetchone(),
                        may_write=False)
        return json.loads(row[0]) if row else None

    def jobs(self, kind: str) -> dict[str, dict[str, Any]]:
        table = _TABLES[kind]
        rows = self._run(lambda db: db.execute(f"SELECT name, doc FROM {table} ORDER BY name").fetchall(),
                         may_write=False)
        return {name: json.loads(doc) for name, doc in rows}

    # --- documents (one JSON document per part that keeps state of its own: "gpu") ----------------

    def put_document(self, name: str, doc: dict[str, Any]) -> None:
        """Replace a part's document; like put_job, an update may use the disk reserve, a first write not."""
        text = json.dumps(doc, sort_keys=True)
        self._run(lambda db: db.execute(
            "INSERT INTO documents(name, doc, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET doc=excluded.doc, updated_at=excluded.updated_at",
            (name, text, time.time())),
            essential=lambda db: db.execute("SELECT 1 FROM documents WHERE name=?", (name,)).fetchone() is not None)

    def get_document(self, name: str) -> dict[str, Any] | None:
        row = self._run(lambda db: db.execute("SELECT doc FROM documents WHERE name=?", (name,)).fetchone(),
                        may_write=False)
        return json.loads(row[0]) if row else None

    # --- events -------------------------------------------------------------------------------

    def append_event(self, ts: float, kind: str, job: str | None, message: str, data: dict[str, Any],
                     essential: bool = True) -> int:
        """Store one event (cut to MAX_EVENT_MESSAGE_CHARS / MAX_EVENT_DATA_BYTES) and apply the retention.
        `essential`: on a full disk it may use the reserve (the agent's own events; not a job's)."""
        if len(message) > MAX_EVENT_MESSAGE_CHARS:
            message = message[: MAX_EVENT_MESSAGE_CHARS - 1] + "…"
        text = json.dumps(data, default=str)
        if len(text) > MAX_EVENT_DATA_BYTES:
            text = json.dumps({"truncated": True, "bytes": len(text)})

        def insert(db: sqlite3.Connection) -> tuple[int, int, int]:
            cursor = db.execute("INSERT INTO events(ts, kind, job, message, data) VALUES (?, ?, ?, ?, ?)",
                                (ts, kind, job, message, text))
            event_id = int(cursor.lastrowid)
            size = db.execute(f"SELECT {_EVENT_SIZE} FROM events WHERE id=?", (event_id,)).fetchone()[0]
            count, total = self._count + 1, self._bytes + size
            if job is not None:
                removed, freed = self._prune_job(db, job)
                count, total = count - removed, total - freed
            count, total = self._prune_oldest(db, count, total)
            return event_id, count, total

        with self._lock:  # the totals follow the committed transaction
            event_id, self._count, self._bytes = self._run(insert, essential)
        return event_id

    def _prune_job(self, db: sqlite3.Connection, job: str) -> tuple[int, int]:
        """The job's events beyond retention.max_per_job, oldest first: (events, bytes) removed."""
        cut = db.execute("SELECT id FROM events WHERE job=? ORDER BY id DESC LIMIT 1 OFFSET ?",
                         (job, self.retention.max_per_job)).fetchone()
        if cut is None:
            return 0, 0
        removed, freed = db.execute(f"SELECT COUNT(*), COALESCE(SUM({_EVENT_SIZE}), 0) FROM events "
                                    "WHERE job=? AND id<=?", (job, cut[0])).fetchone()
        db.execute("DELETE FROM events WHERE job=? AND id<=?", (job, cut[0]))
        return removed, freed

    def _prune_oldest(self, db: sqlite3.Connection, count: int, total: int) -> tuple[int, int]:
        """Past retention.max_count or max_bytes: the oldest events go, down to 95% of the bound (so this runs
        now and then, not at every event). AUTOINCREMENT: ids stay monotonic, never reused."""
        r = self.retention
        if count <= r.max_count and total <= r.max_bytes:
            return count, total
        keep_count, keep_bytes = int(r.max_count * 0.95), int(r.max_bytes * 0.95)
        while count > keep_count or total > keep_bytes:
            rows = db.execute(f"SELECT id, {_EVENT_SIZE} FROM events ORDER BY id LIMIT 512").fetchall()
            if not rows:
                return 0, 0
            last = rows[-1][0]
            for event_id, size in rows:
                count, total, last = count - 1, total - size, event_id
                if count <= keep_count and total <= keep_bytes:
                    break
            db.execute("DELETE FROM events WHERE id<=?", (last,))
        return count, total

    def event_totals(self) -> tuple[int, int]:
        """(events kept, their bytes as retention counts them)."""
        with self._lock:
            return self._count, self._bytes

    def events_since(self, since_id: int, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self._run(lambda db: db.execute(
            "SELECT id, ts, kind, job, message, data FROM events WHERE id > ? ORDER BY id LIMIT ?",
            (since_id, limit)).fetchall(), may_write=False)
        return [{"id": r[0], "ts": r[1], "kind": r[2], "job": r[3], "message": r[4], "data": json.loads(r[5])}
                for r in rows]

    def last_events_of(self, kinds: Iterable[str], limit: int) -> list[dict[str, Any]]:
        """The last `limit` events of these kinds, oldest first."""
        kinds = sorted(kinds)
        marks = ",".join("?" * len(kinds))
        rows = self._run(lambda db: db.execute(
            f"SELECT id, ts, kind, job, message, data FROM events WHERE kind IN ({marks}) ORDER BY id DESC LIMIT ?",
            (*kinds, limit)).fetchall(), may_write=False)
        return [{"id": r[0], "ts": r[1], "kind": r[2], "job": r[3], "message": r[4], "data": json.loads(r[5])}
                for r in reversed(rows)]

    def last_event_id(self) -> int:
        # AUTOINCREMENT keeps ids monotonic across restarts even after trimming.
        row = self._run(lambda db: db.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone(),
                        may_write=False)
        return int(row[0]) if row else 0
