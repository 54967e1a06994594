"""The GPU manager on the agent's own store and event log (reamer.gpu.state has the interfaces).

Its registrations are the store's "gpu" document; its events are the agent's events (one log, one set of
ids, the same retention). A node upgraded in place had them in `<run_dir>/gpu/gpu_jobs.json`: that file is
read once, copied into the store and renamed `gpu_jobs.json.migrated`, so nothing registered is lost.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from reamer.agent.events import EventLog
from reamer.agent.store import Store
from reamer.gpu.state import GPU_EVENT_KINDS

log = logging.getLogger("reamer.agent")

GPU_DOCUMENT = "gpu"
MIGRATED_SUFFIX = ".migrated"


class StoreGpuState:
    """reamer.gpu.state.GpuState in the agent's store, with a one-time migration of the old file."""

    def __init__(self, store: Store, legacy_file: str | Path | None = None) -> None:
        self.store = store
        self.legacy_file = Path(legacy_file) if legacy_file is not None else None
        self.location = f"the agent's store ({store.path}, document {GPU_DOCUMENT!r})"

    def load(self) -> dict[str, Any] | None:
        doc = self.store.get_document(GPU_DOCUMENT)
        if doc is not None or self.legacy_file is None or not self.legacy_file.exists():
            return doc
        self.location = str(self.legacy_file)  # a bad file is named as such, with its fix
        doc = json.loads(self.legacy_file.read_text())
        self.store.put_document(GPU_DOCUMENT, doc)
        migrated = self.legacy_file.with_name(self.legacy_file.name + MIGRATED_SUFFIX)
        self.legacy_file.replace(migrated)
        log.info("GPU job registrations moved from %s into the agent's store (the file is kept as %s)",
                 self.legacy_file, migrated)
        return doc

    def save(self, doc: dict[str, Any]) -> None:
        self.store.put_document(GPU_DOCUMENT, doc)


class StoreGpuEvents:
    """reamer.gpu.state.GpuEvents as the agent's event log: the GPU's events are the agent's events."""

    def __init__(self, events: EventLog, store: Store) -> None:
        self.events = events
        self.store = store

    def emit(self, event: dict[str, Any]) -> None:
        data = {k: v for k, v in event.items() if k not in ("ts", "kind", "job", "message")}
        self.events.emit(str(event.get("kind", "gpu")), str(event.get("message", "")), job=event.get("job"),
                         data=data)

    def recent(self, limit: int) -> list[dict[str, Any]]:
        return [{"ts": e["ts"], "kind": e["kind"], "job": e["job"], "message": e["message"], **e["data"]}
                for e in self.store.last_events_of(GPU_EVENT_KINDS, limit)]
