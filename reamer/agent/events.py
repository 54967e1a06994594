"""The agent's event log: durable (in the store), ids monotonic, bounded (Store's retention), and a long-poll
for subscribers. Events a job sends (serve.job_channel) never use the store's disk reserve, and an event
that cannot be stored (a full disk) is logged, never the failure of what it reports."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reamer.agent.store import Store, StoreError
from reamer.serve.job_channel import JOB_EVENT_KINDS

# Kinds a job's own channel produces: stored only while there is room (never with the disk reserve).
JOB_CHANNEL_KINDS = JOB_EVENT_KINDS | {"job_events_dropped"}

log = logging.getLogger("reamer.events")


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    job: str | None
    message: str
    data: dict[str, Any] = field(default_factory=dict)


class EventLog:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._last_id = store.last_event_id()

    @property
    def last_id(self) -> int:
        return self._last_id

    def emit(self, kind: str, message: str, job: str | None = None, data: dict[str, Any] | None = None) -> Event:
        ts = time.time()
        with self._cond:
            try:
                event_id = self._store.append_event(ts, kind, job, message, data or {},
                                                    essential=kind not in JOB_CHANNEL_KINDS)
            except StoreError as exc:
                log.error("event %s%s not recorded (%s; fix: %s): %s", kind, f" [{job}]" if job else "",
                          exc.message, exc.fix, message)
                return Event(0, ts, kind, job, message, dict(data or {}))
            self._last_id = max(self._last_id, event_id)
            self._cond.notify_all()
        log.info("event %s%s: %s", kind, f" [{job}]" if job else "", message)
        return Event(event_id, ts, kind, job, message, dict(data or {}))

    def since(self, since_id: int, limit: int = 1000) -> list[Event]:
        return [Event(**row) for row in self._store.events_since(since_id, limit)]

    def wait(self, since_id: int, timeout: float, limit: int = 1000) -> list[Event]:
        """Events newer than `since_id`; blocks up to `timeout` seconds until there is one."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._last_id <= since_id:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return self.since(since_id, limit)
