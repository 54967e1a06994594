"""The node agent, assembled: the one place that builds every part of `reamer daemon` and runs them.

Nothing below this module builds another part: the agent, the GPU manager, the API and the metrics get
what they use handed to them here. `reamer daemon` (reamer.cli.daemon_cmd) and `python -m reamer.node`
run `run_daemon`; tests and embedders build an agent with `build_agent`.

Start order (each step needs only the ones before it):

 1. config     — the file, then the command-line overrides; logging as the config says.
 2. API socket — bound before anything else is touched, so a second agent on the same socket is refused
                 before it could change the host or open the store.
 3. host       — topology (sysfs), the cgroup driver, systemd where it owns cgroup v2, and the one
                 HostExecutor every host change goes through (training and the memory guard share it).
 4. store      — the desired state (sqlite), then the event log on it: every later part writes to them.
 5. parts      — the core table, the training pinner, the inference supervisor and memory guard (on the
                 executor, reporting to the event log), the layout chooser and its profile cache.
 6. GPU        — the GPU manager, writing its registrations to the store and its events to the event log.
                 Built, not started: a node without GPUs runs all the same (the agent says why not).
 7. agent      — holds the parts. Its start(): RT throttling check and the training cgroups, restore from
                 the store (re-attach to what runs), start the GPU manager, re-plan, the reconcile loop.
 8. metrics    — the agent's one registry, with the GPU collector in it; fed by each reconcile pass.
 9. API        — the app over the agent and the metrics, served on the socket of step 2; systemd hears
                 READY once it listens and WATCHDOG after each reconcile pass.

Shutdown runs backwards: the server stops, then the agent (its loop, the GPU manager, the store), then the
socket file goes. Training stays pinned and inference keeps serving: they need no agent (see run_daemon).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from reamer.agent.config import AgentConfig, ConfigError, config_from_dict, load_config
from reamer.agent.events import EventLog
from reamer.agent.gpu_state import StoreGpuEvents, StoreGpuState
from reamer.agent.inference import InferenceSupervisor
from reamer.agent.memory_guard import InferenceMemoryGuard
from reamer.agent.metrics import AgentMetrics
from reamer.agent.service import Agent, AgentParts
from reamer.agent.store import Retention, Store
from reamer.agent.training import TrainingPinner
from reamer.api.server import bind_unix_socket
from reamer.host.cgroups import CgroupDriver, detect_driver
from reamer.host.errors import ReamerError
from reamer.host.executor import HostExecutor
from reamer.host.systemd import Systemd, systemd_booted
from reamer.host.topology import Topology, read_topology
from reamer.plan.coretable import CoreTable
from reamer.search.chooser import LayoutChooser, load_chooser
from reamer.serve.model_types import CUSTOM_OP_LIBRARIES_ENV

log = logging.getLogger("reamer.daemon")


# ------------------------------------------------------------------------------------------- 1. config


def resolve_config(config: AgentConfig | str | Path | None, overrides: dict[str, Any] | None) -> AgentConfig:
    """The agent's config: a file (or the defaults) with the command-line overrides ("a.b" keys) on top."""
    if isinstance(config, AgentConfig):
        if not overrides:
            return config
        data = config.model_dump()
        for key, value in overrides.items():
            node = data
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return config_from_dict(data, "config + command-line flags")
    return load_config(config, overrides)


# ------------------------------------------------------------------------------------------- 3. host


def build_host(config: AgentConfig, driver: CgroupDriver | None = None, proc_root: str = "/proc",
               run_root: str = "/run") -> HostExecutor:
    """The one executor of host changes: the cgroup driver, and systemd where it manages cgroup v2
    (AllowedCPUs= needs v2)."""
    driver = driver or detect_driver(config.cgroup_root, proc_root)
    systemd = Systemd() if driver.version == 2 and systemd_booted(run_root) else None
    return HostExecutor(driver, systemd, proc_root)


# ------------------------------------------------------------------------------------------- 4. store


def build_store(config: AgentConfig) -> Store:
    return Store(config.store_path, Retention(config.events.max_count, int(config.events.max_mb * 2**20),
                                              config.events.max_per_job),
                 reserve_bytes=int(config.events.disk_reserve_mb * 2**20))


# ------------------------------------------------------------------------------------------- 5.–6. parts


def build_gpu(config: AgentConfig, store: Store, events: EventLog) -> tuple[Any, str]:
    """The GPU manager on the agent's store and event log, or None and why (the agent runs without GPUs)."""
    try:
        from reamer.gpu.config import GpuConfig
        from reamer.gpu.manager import GpuManager
    except ImportError as exc:
        return None, f"GPU support unavailable: {exc}"
    run_dir = Path(config.run_dir) / "gpu"
    try:
        manager = GpuManager(GpuConfig.from_dict(config.gpu), str(run_dir),
                             state=StoreGpuState(store, legacy_file=run_dir / "gpu_jobs.json"),
                             events=StoreGpuEvents(events, store))
    except Exception as exc:  # noqa: BLE001 - the agent must run on machines without GPUs
        message = f"GPU manager not started: {exc}"
        log.warning(message)
        return None, message
    return manager, ""


def build_parts(config: AgentConfig, *, topology: Topology | None = None, driver: CgroupDriver | None = None,
                host: HostExecutor | None = None, layout_chooser: LayoutChooser | None = None,
                gpu_manager: Any = None, proc_root: str = "/proc") -> AgentParts:
    """Steps 3 to 6: every part the agent holds, built in order. `topology`, `driver` (or a whole `host`
    executor, such as reamer.host.fake's), `layout_chooser` and `gpu_manager` replace the real ones (tests,
    embedding); an injected GPU manager is used as given and started with the agent."""
    topology = topology or read_topology()
    host = host or build_host(config, driver, proc_root)
    store = build_store(config)
    events = EventLog(store)
    cores = CoreTable(topology, set(config.reserved_cpus))
    pinner = TrainingPinner(host, config.cgroup_name, config.training.rt_runtime_us, proc_root,
                            user_rt_percent=config.training.user_rt_percent)
    inference = config.inference
    supervisor = InferenceSupervisor(
        config.run_dir, config.reserved_cpus, offline_sched=inference.offline_sched,
        max_request_mb=inference.max_request_mb, emit=events.emit, restart_limit=inference.restart_limit,
        restart_window_s=inference.restart_window_s)
    supervisor.frontdoor = inference.frontdoor.model_dump()
    supervisor.bind_address = inference.bind_address
    supervisor.job_log_mb = inference.job_log_mb
    if inference.custom_op_libraries:  # inherited by jobs, deploy checks and searches (backends.py)
        os.environ[CUSTOM_OP_LIBRARIES_ENV] = os.pathsep.join(inference.custom_op_libraries)
    memory = InferenceMemoryGuard(host, config.cgroup_name, inference.oom_score_adj, inference.memory_limit_mb,
                                  events.emit, proc_root)
    profile_dir = inference.profile_dir or str(Path(config.state_dir) / "profiles")
    chooser = layout_chooser or load_chooser(inference.layout_chooser, profile_dir, inference)
    if not config.reserved_cpus and hasattr(chooser, "frontdoor_cpu_ms"):
        from reamer.plan.frontdoor import DEFAULT_FRONTDOOR_CPU_MS  # front doors share cores: count their cpu

        chooser.frontdoor_cpu_ms = DEFAULT_FRONTDOOR_CPU_MS
    gpu, gpu_message = (gpu_manager, "") if gpu_manager is not None else build_gpu(config, store, events)
    return AgentParts(topology=topology, host=host, store=store, events=events, cores=cores, pinner=pinner,
                      supervisor=supervisor, memory=memory, choose_layout=chooser, profile_dir=profile_dir,
                      gpu=gpu, gpu_message=gpu_message)


def build_agent(config: AgentConfig, **replacements: Any) -> Agent:
    """Steps 3 to 7 (not started): the agent with every part built by build_parts."""
    return Agent(config, build_parts(config, **replacements))


# ------------------------------------------------------------------------------------------- 9. run


class _Notifier:
    """sd_notify READY/WATCHDOG/STOPPING when run by systemd (NOTIFY_SOCKET set); silent otherwise."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = None
        if self.enabled:
            import sdnotify

            self._notifier = sdnotify.SystemdNotifier()

    def notify(self, state: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(state)


def run_daemon(config: AgentConfig | str | Path | None = None, overrides: dict[str, Any] | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit code. Raises ReamerError for setup problems
    (bad config, socket in use, RT throttling off, unreadable store).

    Shutdown (SIGTERM/SIGINT) stops the API and the reconcile loop only. Training stays pinned (its cgroups and
    SCHED_RR stay as they are: the kernel keeps them, not the agent) and inference keeps serving (its job
    processes run in their own sessions). A restarted agent re-attaches to both from its store. To undo the
    pinning use `reamer train detach NAME` or `reamer demote-all` (which works without the agent too)."""
    from reamer.api.app import build_app
    from reamer.api.fairness import SocketLimits
    from reamer.api.server import make_server

    cfg = resolve_config(config, overrides)  # 1
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = bind_unix_socket(cfg.socket, cfg.socket_group)  # 2: refuse early when another agent listens there
    try:
        agent = build_agent(cfg)  # 3–7
        agent.start()
    except BaseException:
        sock.close()
        Path(cfg.socket).unlink(missing_ok=True)
        raise
    metrics = AgentMetrics(agent)  # 8
    notifier = _Notifier()
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    if notifier.enabled and watchdog_usec:
        agent.on_reconcile.append(lambda _duration: notifier.notify("WATCHDOG=1"))

    # 9: tells the API who calls (SO_PEERCRED); caps connections per uid with a share kept for admins; timeouts
    server = make_server(build_app(agent, metrics), log_level=cfg.log_level,
                         limits=SocketLimits.from_security(cfg.security))

    def announce_ready() -> None:
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            log.info("reamer agent ready on %s", cfg.socket)
            notifier.notify(f"READY=1\nSTATUS=serving on {cfg.socket}\nMAINPID={os.getpid()}")

    threading.Thread(target=announce_ready, name="reamer-ready", daemon=True).start()
    # uvicorn re-raises the signal it caught once it has stopped; make that a no-op so we can clean up.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        notifier.notify("STOPPING=1")
        agent.stop()
        sock.close()
        Path(cfg.socket).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("reamer agent stopped; training stays pinned and inference keeps running")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m reamer.node [--config FILE]` (the CLI's `reamer daemon` is the usual way)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m reamer.node")
    parser.add_argument("--config", default=None)
    parser.add_argument("--socket", default=None)
    parser.add_argument("--state-dir", default=None)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("socket", args.socket), ("state_dir", args.state_dir)) if v is not None}
    try:
        return run_daemon(args.config, overrides)
    except ReamerError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.fix:
            print(f"fix: {exc.fix}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
