"""The agent's durable desired state: SQLite (WAL) at <state_dir>/state.db.

Every change is written here (one transaction) BEFORE the agent applies it to the host, so a
restarted agent knows what it promised and re-attaches to it. Records are JSON documents keyed by
job name; the schema version lives in PRAGMA user_version.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from reamer.host.errors import ReamerError

SCHEMA_VERSION = 1
EVENTS_KEPT = 10000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS training_jobs (name TEXT PRIMARY KEY, doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS inference_jobs (name TEXT PRIMARY KEY, doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL, job TEXT,
    message TEXT NOT NULL, data TEXT NOT NULL);
"""

_TABLES = {"training": "training_jobs", "inference": "inference_jobs"}


class StoreError(ReamerError):
    """The state database cannot be opened, read or written."""


def _recovery_fix(path: Path) -> str:
    return (f"stop the agent, move the database aside (mv {path} {path}.bad; also its -wal and -shm files) "
            "and start the agent again: it starts empty, running training keeps its pinning and can be "
            "attached again with `reamer train attach`")


class Store:
    """Thread-safe access to state.db; each method is one transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the state directory {self.path.parent}: {exc.strerror}",
                             "set state_dir in the config (or --state-dir) to a writable directory") from None
        self._lock = threading.Lock()
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
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"state database {self.path} is corrupt or not a reamer database ({exc})",
                             _recovery_fix(self.path)) from None
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open state database {self.path}: {exc}", _recovery_fix(self.path)) from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, fn):
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(self._db)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
                return result
            except sqlite3.Error as exc:
                raise StoreError(f"state database {self.path} failed: {exc}",
                                 "check free disk space and permissions of the state directory; if it "
                                 "persists, " + _recovery_fix(self.path)) from None

    # --- jobs (kind = "training" | "inference") -----------------------------------------------

    def put_job(self, kind: str, name: str, doc: dict[str, Any]) -> None:
        table = _TABLES[kind]
        text = json.dumps(doc, sort_keys=True)
        self._run(lambda db: db.execute(
            f"INSERT INTO {table}(name, doc, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET doc=excluded.doc, updated_at=excluded.updated_at",
            (name, text, time.time())))

    def delete_job(self, kind: str, name: str) -> None:
        table = _TABLES[kind]
        self._run(lambda db: db.execute(f"DELETE FROM {table} WHERE name=?", (name,)))

    def get_job(self, kind: str, name: str) -> dict[str, Any] | None:
        table = _TABLES[kind]
        row = self._run(lambda db: db.execute(f"SELECT doc FROM {table} WHERE name=?", (name,)).fetchone())
        return json.loads(row[0]) if row else None

    def jobs(self, kind: str) -> dict[str, dict[str, Any]]:
        table = _TABLES[kind]
        rows = self._run(lambda db: db.execute(f"SELECT name, doc FROM {table} ORDER BY name").fetchall())
        return {name: json.loads(doc) for name, doc in rows}

    # --- events -------------------------------------------------------------------------------

    def append_event(self, ts: float, kind: str, job: str | None, message: str, data: dict[str, Any]) -> int:
        def insert(db: sqlite3.Connection) -> int:
            cursor = db.execute("INSERT INTO events(ts, kind, job, message, data) VALUES (?, ?, ?, ?, ?)",
                                (ts, kind, job, message, json.dumps(data, default=str)))
            event_id = int(cursor.lastrowid)
            if event_id % 1000 == 0:
                db.execute("DELETE FROM events WHERE id <= ?", (event_id - EVENTS_KEPT,))
            return event_id
        return self._run(insert)

    def events_since(self, since_id: int, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self._run(lambda db: db.execute(
            "SELECT id, ts, kind, job, message, data FROM events WHERE id > ? ORDER BY id LIMIT ?",
            (since_id, limit)).fetchall())
        return [{"id": r[0], "ts": r[1], "kind": r[2], "job": r[3], "message": r[4], "data": json.loads(r[5])}
                for r in rows]

    def last_event_id(self) -> int:
        # AUTOINCREMENT keeps ids monotonic across restarts even after trimming.
        row = self._run(lambda db: db.execute("SELECT seq FROM sqlite_sequence WHERE name='events'").fetchone())
        return int(row[0]) if row else 0
