"""A fake `nvidia-cuda-mps-control`: the same command line and text protocol, no GPU.

`nvidia-cuda-mps-control -d` starts a background daemon for $CUDA_MPS_PIPE_DIRECTORY (pid file
`nvidia-cuda-mps-control.pid` and a `control` FIFO there, `control.log` in $CUDA_MPS_LOG_DIRECTORY).
Without -d it is a client (in the executable `nvidia-cuda-mps-control`): each stdin line is one command; it goes down the `control` FIFO as
"<reply-file>\t<command>" and the daemon writes the reply to that file (temp + rename). Replies are
printed; a reply that starts with "ERROR " makes the client exit 1 (the real binary's error
reporting differs; reamer only relies on the outputs of get_* commands).

State (servers, clients, defaults, a log of commands) lives in `fake_state.json` in the pipe
directory, under an flock, so tests can read it and drive MPS events with the helpers below:
`connect_client` applies limits exactly as MPS does (at connect time; the client's env can only lower
the server's active-thread percentage), `fault` puts a server in FAULT (new clients refused with
807 until all its clients exit), `disconnect_client` lets a client go.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_FIFO = "control"
STATE_FILE = "fake_state.json"
LOCK_FILE = "fake_state.lock"
MAX_LIFETIME_S = float(os.environ.get("FAKE_MPS_MAX_LIFETIME_S", "900"))  # never outlive a test run


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def _log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))


# --------------------------------------------------------------------------- state


@contextlib.contextmanager
def locked_state(pipe_dir: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Read-modify-write the fake's state under its lock (for the daemon and for tests)."""
    pipe_dir = Path(pipe_dir)
    pipe_dir.mkdir(parents=True, exist_ok=True)
    with open(pipe_dir / LOCK_FILE, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = pipe_dir / STATE_FILE
        state = json.loads(path.read_text()) if path.exists() else _new_state()
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, path)


def read_state(pipe_dir: str | os.PathLike) -> dict[str, Any]:
    with locked_state(pipe_dir) as state:
        return json.loads(json.dumps(state))


def _new_state() -> dict[str, Any]:
    return {"default_active_thread_percentage": 100.0, "default_pinned_mem_limit": {},
            "servers": {}, "commands": [], "terminated_clients": [], "next_server_pid": 4_000_000,
            "visible_devices": None, "daemon_pid": None, "fail_commands": []}


# --------------------------------------------------------------------------- test helpers


def connect_client(pipe_dir: str | os.PathLike, pid: int, env: dict[str, str] | None = None,
                   uid: int = 0) -> dict[str, Any]:
    """A CUDA process connects: returns the client record, or {"error": 807} if its server faulted."""
    env = env or {}
    with locked_state(pipe_dir) as st:
        server = next((s for s in st["servers"].values() if s["uid"] == uid), None)
        if server is None:
            spid = st["next_server_pid"]
            st["next_server_pid"] += 1
            server = {"pid": spid, "uid": uid, "status": "ACTIVE", "clients": {},
                      "active_thread_percentage": st["default_active_thread_percentage"],
                      "pinned_mem_limit": dict(st["default_pinned_mem_limit"])}
            st["servers"][str(spid)] = server
        if server["status"] != "ACTIVE":
            return {"error": 807, "message": "cudaErrorMpsServerNotReady"}
        pct = float(server["active_thread_percentage"])
        if "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in env:
            pct = min(pct, float(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]))
        mem = dict(server["pinned_mem_limit"])
        for part in filter(None, env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "").split(",")):
            dev, value = part.split("=")
            mem[dev.strip()] = value.strip()
        client = {"pid": pid, "active_thread_percentage": pct, "pinned_mem_limit": mem,
                  "visible_devices": env.get("CUDA_VISIBLE_DEVICES")}
        server["clients"][str(pid)] = client
        return dict(client, server_pid=server["pid"])


def disconnect_client(pipe_dir: str | os.PathLike, pid: int) -> None:
    with locked_state(pipe_dir) as st:
        for spid, server in list(st["servers"].items()):
            server["clients"].pop(str(pid), None)
            if server["status"] != "ACTIVE" and not server["clients"]:
                del st["servers"][spid]  # a faulted server goes once its last client has gone


def fault(pipe_dir: str | os.PathLike, server_pid: int) -> None:
    with locked_state(pipe_dir) as st:
        st["servers"][str(server_pid)]["status"] = "FAULT"


def daemon_pid(pipe_dir: str | os.PathLike) -> int | None:
    try:
        pid = int((Path(pipe_dir) / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def kill_daemon(pipe_dir: str | os.PathLike) -> None:
    """Test cleanup: SIGKILL the daemon of this pipe directory (only ever one we started)."""
    pid = daemon_pid(pipe_dir)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- daemon


def _log(line: str) -> None:
    with contextlib.suppress(OSError):
        _log_dir().mkdir(parents=True, exist_ok=True)
        with open(_log_dir() / "control.log", "a") as fh:
            fh.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


def _execute(command: str) -> tuple[str, bool]:
    """Run one control command against the state; returns (reply, quit?)."""
    words = command.split()
    if not words:
        return "", False
    verb, args = words[0], words[1:]
    with locked_state(_pipe_dir()) as st:
        st["commands"].append(command)
        if verb in st.get("fail_commands", []):
            return f"ERROR {verb} failed (injected by test)", False
        servers = st["servers"]

        def server(pid: str) -> dict[str, Any] | None:
            return servers.get(pid)

        if verb == "quit":
            return "", True
        if verb == "get_server_list":
            return "\n".join(sorted(servers, key=int)), False
        if verb == "get_server_status" and len(args) == 1:
            s = server(args[0])
            return (s["status"] if s else f"ERROR no server with PID {args[0]}"), False
        if verb == "get_client_list" and len(args) == 1:
            s = server(args[0])
            return ("\n".join(sorted(s["clients"], key=int)) if s else f"ERROR no server with PID {args[0]}"), False
        if verb == "get_default_active_thread_percentage" and not args:
            return f"{float(st['default_active_thread_percentage']):.1f}", False
        if verb == "set_default_active_thread_percentage" and len(args) == 1:
            pct = _pct(args[0])
            if pct is None:
                return f"ERROR invalid percentage {args[0]}", False
            st["default_active_thread_percentage"] = pct
            return f"{pct:.1f}", False
        if verb == "get_active_thread_percentage" and len(args) == 1:
            s = server(args[0])
            return (f"{float(s['active_thread_percentage']):.1f}" if s else "ERROR no such server"), False
        if verb == "set_active_thread_percentage" and len(args) == 2:
            s, pct = server(args[0]), _pct(args[1])
            if s is None or pct is None:
                return "ERROR invalid server PID or percentage", False
            s["active_thread_percentage"] = pct  # for clients that connect from now on
            return f"{pct:.1f}", False
        if verb == "set_default_device_pinned_mem_limit" and len(args) == 2:
            if not _mem(args[1]):
                return f"ERROR invalid memory limit {args[1]}", False
            st["default_pinned_mem_limit"][args[0]] = args[1]
            return "", False
        if verb == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return st["default_pinned_mem_limit"].get(args[0], "0"), False
        if verb == "set_device_pinned_mem_limit" and len(args) == 3:
            s = server(args[0])
            if s is None or not _mem(args[2]):
                return "ERROR invalid server PID or memory limit", False
            s["pinned_mem_limit"][args[1]] = args[2]
            return "", False
        if verb == "terminate_client" and len(args) == 2:
            s = server(args[0])
            if s is None or args[1] not in s["clients"]:
                return f"ERROR no client {args[1]} on server {args[0]}", False
            del s["clients"][args[1]]
            st["terminated_clients"].append([int(args[0]), int(args[1])])
            if s["status"] != "ACTIVE" and not s["clients"]:
                del servers[args[0]]
            return "", False
        return f"ERROR unrecognized command: {command}", False


def _pct(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if 0 < v <= 100 else None


def _mem(text: str) -> bool:
    return len(text) > 1 and text[-1] in "MG" and text[:-1].isdigit()


def _daemon_loop() -> None:
    pipe_dir = _pipe_dir()
    fifo = pipe_dir / CONTROL_FIFO
    born = time.monotonic()
    # O_RDWR keeps a writer open ourselves, so reads block instead of returning EOF between clients.
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    buf = b""
    _log("Startup")
    try:
        while time.monotonic() - born < MAX_LIFETIME_S and fifo.exists():
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            buf += os.read(fd, 65536)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                reply_name, _, command = line.decode().partition("\t")
                reply, quit_now = _execute(command.strip())
                _log(f"Command {command.strip()!r}")
                tmp = pipe_dir / f".{reply_name}.tmp"
                tmp.write_text(reply)
                os.replace(tmp, pipe_dir / reply_name)
                if quit_now:
                    _log("Shutdown")
                    return
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            fifo.unlink()
        with contextlib.suppress(OSError):
            (pipe_dir / PID_FILE).unlink()


def _start_daemon() -> int:
    pipe_dir = _pipe_dir()
    pipe_dir.mkdir(parents=True, exist_ok=True)
    if daemon_pid(pipe_dir) is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    fifo = pipe_dir / CONTROL_FIFO
    with contextlib.suppress(FileNotFoundError):
        fifo.unlink()
    os.mkfifo(fifo, 0o600)
    with locked_state(pipe_dir) as st:
        st["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        st["log_dir"] = str(_log_dir())
    proc = subprocess.Popen([sys.executable, "-SE", os.path.abspath(__file__), "--daemon-loop"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    (pipe_dir / PID_FILE).write_text(f"{proc.pid}\n")
    with locked_state(pipe_dir) as st:
        st["daemon_pid"] = proc.pid
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--daemon-loop"]:
        _daemon_loop()
        return 0
    if argv[:1] == ["-d"]:
        return _start_daemon()
    print(f"usage: nvidia-cuda-mps-control [-d]  (fake; got {argv})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
