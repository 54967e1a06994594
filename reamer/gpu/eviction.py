"""Carry out a graceful eviction plan (policies.eviction_plan) on real processes.

Only the processes that were registered are signalled: each pid goes with its start time (its identity),
every signal goes through a pidfd opened and checked against that identity, so a pid that its process
freed and another process took is never signalled."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from reamer.gpu.policies import EvictionStep
from reamer.host.identity import ProcessIdentity, identity_of, is_running, process_alive, send_signal


@dataclass
class EvictionResult:
    pids: list[int]
    log: list[str] = field(default_factory=list)
    terminated_clients: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    not_registered: list[int] = field(default_factory=list)  # pids now another process's: left alone

    def to_dict(self) -> dict:
        return {"pids": self.pids, "log": self.log, "terminated_clients": self.terminated_clients,
                "killed": self.killed, "survivors": self.survivors, "not_registered": self.not_registered}


def execute_eviction(steps: list[EvictionStep], terminate_client: Callable[[int, int], None] | None = None,
                     alive: Callable[[int], bool] = process_alive, poll_s: float = 0.05,
                     identities: Mapping[int, ProcessIdentity | None] | None = None) -> EvictionResult:
    """Run the steps in order; steps for processes that are already gone are skipped, and a wait ends
    as soon as every process has exited. terminate_client errors are logged, not raised (the
    SIGKILL that follows still stops the process). `identities`: each pid's registered process (a pid
    without one, or whose process is another now, is never touched); None: the processes there now."""
    pids = sorted({s.pid for s in steps if s.pid is not None})
    result = EvictionResult(pids)
    if identities is None:
        identities = {pid: identity_of(pid) for pid in pids}

    def registered(pid: int) -> bool:
        identity = identities.get(pid)
        return identity is not None and is_running(identity)

    def running(pid: int) -> bool:
        return registered(pid) and alive(pid)

    for pid in pids:
        if not registered(pid) and alive(pid):
            result.not_registered.append(pid)
            result.log.append(f"pid {pid} is not the registered process any more (it exited and its pid was "
                              "reused): left alone")
    for step in steps:
        if step.action == "wait":
            deadline = time.monotonic() + step.seconds
            while any(running(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(poll_s)
            continue
        if step.pid is None or not running(step.pid):
            continue
        if step.action == "signal":
            if send_signal(identities[step.pid], step.signal or 15):
                result.log.append(step.describe())
                if step.signal == 9:
                    result.killed.append(step.pid)
        elif step.action == "terminate_client" and terminate_client is not None and step.server_pid is not None:
            try:
                terminate_client(step.server_pid, step.pid)
                result.terminated_clients.append(step.pid)
                result.log.append(step.describe())
            except Exception as exc:  # the client may have left the server already
                result.log.append(f"{step.describe()} failed: {exc}")
    deadline = time.monotonic() + 5.0  # SIGKILL is not instant
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(poll_s)
    result.survivors = [p for p in pids if running(p)]
    return result
