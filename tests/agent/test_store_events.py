"""The SQLite store and the event log: durability, monotonic ids, long-poll, clear corruption errors."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from reamer.agent.events import EventLog
from reamer.agent.store import SCHEMA_VERSION, Store, StoreError


def test_jobs_round_trip_and_survive_reopen(tmp_path):
    store = Store(tmp_path / "state.db")
    store.put_job("training", "a", {"cpus": [1], "pids": [10]})
    store.put_job("training", "a", {"cpus": [1, 2], "pids": [10]})
    store.put_job("inference", "web", {"kind": "online"})
    store.close()
    store = Store(tmp_path / "state.db")
    assert store.jobs("training") == {"a": {"cpus": [1, 2], "pids": [10]}}
    assert store.get_job("inference", "web") == {"kind": "online"}
    store.delete_job("training", "a")
    assert store.jobs("training") == {} and store.get_job("training", "a") is None
    assert sqlite3.connect(tmp_path / "state.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_event_ids_are_monotonic_across_reopen(tmp_path):
    store = Store(tmp_path / "state.db")
    log = EventLog(store)
    first = log.emit("a", "one")
    second = log.emit("b", "two", job="j", data={"x": 1})
    assert second.id > first.id
    store.close()
    store = Store(tmp_path / "state.db")
    log = EventLog(store)
    assert log.last_id == second.id
    third = log.emit("c", "three")
    assert third.id > second.id
    assert [(e.kind, e.job, e.data) for e in log.since(first.id)] == [("b", "j", {"x": 1}), ("c", None, {})]


def test_wait_returns_at_once_when_newer_events_exist_and_blocks_otherwise(tmp_path):
    log = EventLog(Store(tmp_path / "state.db"))
    event = log.emit("a", "one")
    assert [e.id for e in log.wait(0, timeout=5)] == [event.id]
    assert log.wait(event.id, timeout=0.05) == []
    timer = threading.Timer(0.2, lambda: log.emit("b", "later"))
    timer.start()
    try:
        found = log.wait(event.id, timeout=30)
    finally:
        timer.cancel()
    assert [e.kind for e in found] == ["b"]


def test_corrupt_database_names_the_recovery(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError) as info:
        Store(path)
    assert "corrupt" in info.value.message and str(path) in info.value.message
    assert f"mv {path} {path}.bad" in info.value.fix


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError) as info:
        Store(path)
    assert "newer" in info.value.message and "move the database aside" in info.value.fix
