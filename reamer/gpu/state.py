"""Where the GPU manager keeps its registrations and sends its events: interfaces, and the stand-alone kind.

Inside the agent the composition root (reamer.node) hands the manager the agent's own store and event log
(reamer.agent.gpu_state): one database, one event log, one set of ids. A manager used on its own (tests of
this layer, embedding) keeps its registrations in `gpu_jobs.json` and its events in memory, as below.
"""
from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Protocol

JOBS_FILE = "gpu_jobs.json"
RECENT_EVENTS = 200  # how many events a stand-alone manager keeps (events() shows them)

# Every kind of event the GPU manager emits (the agent's event log finds the GPU's own by these).
GPU_EVENT_KINDS = frozenset({
    "mps_daemon_started", "mps_daemon_adopted", "mps_daemon_failed", "mps_daemon_stopped", "mps_daemon_missing",
    "compute_mode_failed", "gpu_job_registered", "gpu_job_removed", "gpu_job_evicted",
    "gpu_health", "gpu_complement", "gpu_fault", "gpu_fault_cleared", "gpu_fault_handled", "gpu_fault_recovered",
    "gpu_fault_recovery_failed",
})


class GpuState(Protocol):
    """The manager's registrations (jobs, issued limits, compute modes to restore) as one JSON document."""

    location: str  # where it lives, for messages ("cannot read GPU job registrations from …")

    def load(self) -> dict[str, Any] | None:
        """The document saved last, None when there is none. Raises ValueError for one that cannot be read."""

    def save(self, doc: dict[str, Any]) -> None:
        """Replace the document (durably)."""


class GpuEvents(Protocol):
    """Where the manager's events go: each is {"ts", "kind", "gpu", "job", "message", …extra}."""

    def emit(self, event: dict[str, Any]) -> None:
        """Record one event (best effort: never raises into GPU control)."""

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The last `limit` GPU events, oldest first."""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(text.encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class JsonFileState:
    """A stand-alone manager's registrations: `<run_dir>/gpu_jobs.json`, written atomically."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.location = str(self.path)

    def load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        return json.loads(self.path.read_text())

    def save(self, doc: dict[str, Any]) -> None:
        write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True))


class MemoryEvents:
    """A stand-alone manager's events: the last RECENT_EVENTS, in memory."""

    def __init__(self) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)

    def emit(self, event: dict[str, Any]) -> None:
        self._events.append(event)

    def recent(self, limit: int) -> list[dict[str, Any]]:
        return list(self._events)[-limit:] if limit > 0 else []
