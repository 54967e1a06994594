"""Carry out a graceful eviction plan (policies.eviction_plan) on real processes."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

from reamer.gpu.policies import EvictionStep


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass
class EvictionResult:
    pids: list[int]
    log: list[str] = field(default_factory=list)
    terminated_clients: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"pids": self.pids, "log": self.log, "terminated_clients": self.terminated_clients,
                "killed": self.killed, "survivors": self.survivors}


def execute_eviction(steps: list[EvictionStep], terminate_client: Callable[[int, int], None] | None = None,
                     alive: Callable[[int], bool] = process_alive, poll_s: float = 0.05) -> EvictionResult:
    """Run the steps in order; steps for processes that are already gone are skipped, and a wait ends
    as soon as every process has exited. terminate_client errors are logged, not raised (the
    SIGKILL that follows still stops the process)."""
    pids = sorted({s.pid for s in steps if s.pid is not None})
    result = EvictionResult(pids)
    for step in steps:
        if step.action == "wait":
            deadline = time.monotonic() + step.seconds
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(poll_s)
            continue
        if step.pid is None or not alive(step.pid):
            continue
        if step.action == "signal":
            try:
                os.kill(step.pid, step.signal or 15)
                result.log.append(step.describe())
                if step.signal == 9:
                    result.killed.append(step.pid)
            except ProcessLookupError:
                pass
        elif step.action == "terminate_client" and terminate_client is not None and step.server_pid is not None:
            try:
                terminate_client(step.server_pid, step.pid)
                result.terminated_clients.append(step.pid)
                result.log.append(step.describe())
            except Exception as exc:  # the client may have left the server already
                result.log.append(f"{step.describe()} failed: {exc}")
    deadline = time.monotonic() + 5.0  # SIGKILL is not instant
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(poll_s)
    result.survivors = [p for p in pids if alive(p)]
    return result
