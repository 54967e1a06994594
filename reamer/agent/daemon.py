"""`reamer daemon`: the agent with its API on a Unix socket, under systemd (Type=notify) or by hand.

Shutdown (SIGTERM/SIGINT) stops the API and the reconcile loop only. Training stays pinned (its
cgroups and SCHED_RR stay as they are: the kernel keeps them, not the agent) and inference keeps
serving (its job processes run in their own sessions). A restarted agent re-attaches to both from
its store. To undo the pinning use `reamer train detach NAME` or `reamer demote-all` (which works
without the agent too).
"""
from __future__ import annotations

import grp
import logging
import os
import signal
import socket
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from reamer.agent.config import AgentConfig, config_from_dict, load_config
from reamer.host.errors import ReamerError

log = logging.getLogger("reamer.daemon")

SOCKET_MODE = 0o660


class SocketInUse(ReamerError):
    pass


def bind_unix_socket(path: str | Path, group: str | None = None) -> socket.socket:
    """Listen on `path`, created 0660 from the start (umask), replacing a stale socket file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReamerError(f"cannot create the socket directory {path.parent}: {exc.strerror}",
                          "pick a writable place with --socket, or run as root") from None
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUse(f"{path} exists and is not a socket", "remove it or choose another --socket path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens
        else:
            raise SocketInUse(f"another process (an agent?) already listens on {path}",
                              "stop it first (systemctl stop reamer), or give this one another --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)  # the socket is never group-/world-accessible beyond 0660, not even briefly
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ReamerError(f"cannot listen on {path}: {exc.strerror}", "check the directory's permissions") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, SOCKET_MODE)
    if group is not None:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            sock.close()
            path.unlink()
            raise ReamerError(f"socket_group {group!r} is not a group on this host",
                              f"create it (groupadd {group}) or change socket_group in the config") from None
    sock.listen(128)
    return sock


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


def _resolve_config(config: AgentConfig | str | Path | None, overrides: dict[str, Any] | None) -> AgentConfig:
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


def run_daemon(config: AgentConfig | str | Path | None = None, overrides: dict[str, Any] | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit code. Raises ReamerError for setup problems
    (bad config, socket in use, RT throttling off, unreadable store)."""
    from reamer.agent.service import Agent
    from reamer.api.app import build_app
    from reamer.api.fairness import SocketLimits
    from reamer.api.server import make_server

    cfg = _resolve_config(config, overrides)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = bind_unix_socket(cfg.socket, cfg.socket_group)  # first: refuse early when another agent listens there
    try:
        agent = Agent(cfg)
        agent.start()
    except BaseException:
        sock.close()
        Path(cfg.socket).unlink(missing_ok=True)
        raise
    notifier = _Notifier()
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
    if notifier.enabled and watchdog_usec:
        agent.on_reconcile.append(lambda _duration: notifier.notify("WATCHDOG=1"))

    # tells the API who calls (SO_PEERCRED); caps connections per uid with a share kept for admins; timeouts
    server = make_server(build_app(agent), log_level=cfg.log_level, limits=SocketLimits.from_security(cfg.security))

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
    """`python -m reamer.agent.daemon [--config FILE]` (the CLI's `reamer daemon` is the usual way)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m reamer.agent.daemon")
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
        return 2 if type(exc).__name__ == "ConfigError" else 1


if __name__ == "__main__":
    sys.exit(main())
