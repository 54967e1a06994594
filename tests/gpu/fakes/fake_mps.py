"""A fake `nvidia-cuda-mps-control`: the same command line and text protocol, no GPU.

`nvidia-cuda-mps-control -d` starts a background daemon for $CUDA_MPS_PIPE_DIRECTORY (pid file
`nvidia-cuda-mps-control.pid` and a `control` FIFO there, `control.log` in $CUDA_MPS_LOG_DIRECTORY).
Without -d it is a client (in the executable `nvidia-cuda-mps-control`): each stdin line is one command; it goes down the `control` FIFO as
"<reply-file>\t<command>" and the daemon writes the reply to that file (temp + rename).

It answers as the real binary did on an H100 (driver 580.159.04; samples in REAL_REPLIES below): a
refused command exits 0 with the reason on stdout ("Server 123 not found", 'Unknown command "x"'), an
out-of-range value is ignored (the setters echo the value in force), `terminate_client` answers "0" and
the client stays listed until its process exits, and `quit` with clients connected (or a second
`terminate_client` for the same client) gets no answer until they have exited, while the daemon serves
no other command. Only a missing daemon makes the client exit 1 ("Cannot find MPS control daemon
process" on stderr), and `-d` with one running exits 1 ("An instance of this daemon is already running"
on stdout).

State (servers, clients, defaults, a log of commands) lives in `fake_state.json` in the pipe
directory, under an flock, so tests can read it and drive MPS events with the helpers below:
`connect_client` applies limits exactly as MPS does (at connect time; the client's env can only lower
the server's active-thread percentage and pinned-memory limit), `fault` puts a server in FAULT (new
clients refused with 807 until all its clients exit; then it is ACTIVE again, same pid), and
`disconnect_client` lets a client go. A client whose pid is a real process leaves when that process
exits, as MPS notices.
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


# What the real control binary printed (stdout, exit 0) for each case; the fake answers the same.
REAL_REPLIES = {
    "get_default_active_thread_percentage": "100.0",
    "set_default_active_thread_percentage 50.5": "50.5",
    "set_default_active_thread_percentage 0": "100.0",  # ignored: the value in force
    "get_server_list (no server yet)": "",
    "get_server_list": "592",
    "get_server_status 592": "ACTIVE",  # "FAULT" after a client's illegal memory access
    "get_client_list 592": "575",
    "set_active_thread_percentage 592 40": "40.0",
    "set_device_pinned_mem_limit 592 0 1024M": "",
    "terminate_client 592 575": "0",
    "get_server_status 999999": "Server 999999 not found",
    "terminate_client 999999 1": "Server 999999 not found\nServer 999999 not found!\n1",
    "foo": 'Unknown command "foo"',
    "quit (no clients)": "",
    "terminate_client 457 548 (548 runs, not a client)": "201",
    "terminate_client 457 4000000 (no such process)": "Invalid process 4000000!\n1",
    "set_active_thread_percentage 457 101": "50.0",  # ignored: the value in force
    "get_default_device_pinned_mem_limit 0 (after ... 0 1536M)": "1G",  # whole G, rounded down
    "-d (pipe directory missing)": "Cannot access CUDA_MPS_PIPE_DIRECTORY=/tmp/rp/c/pipe",  # exit 1
}


def _new_state() -> dict[str, Any]:
    return {"default_active_thread_percentage": 100.0, "default_pinned_mem_limit": {},
            "servers": {}, "commands": [], "terminated_clients": [], "next_server_pid": 4_000_000,
            "visible_devices": None, "daemon_pid": None}


def _process_alive(pid: int) -> bool:
    """A zombie has closed its MPS connection: it counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _prune(st: dict[str, Any]) -> None:
    """Clients whose process has exited leave; a FAULT server with no clients left is ACTIVE again."""
    for server in st["servers"].values():
        for pid, client in list(server["clients"].items()):
            if client.get("process") and not _process_alive(int(pid)):
                del server["clients"][pid]
        if server["status"] != "ACTIVE" and not server["clients"] and not server.get("sticky_fault"):
            server["status"] = "ACTIVE"


# --------------------------------------------------------------------------- test helpers


def connect_client(pipe_dir: str | os.PathLike, pid: int, env: dict[str, str] | None = None,
                   uid: int = 0, process: bool = True) -> dict[str, Any]:
    """A CUDA process connects: returns the client record, or {"error": 807} if its server faulted.
    With `process` (and `pid` a running process) the client leaves when that process exits."""
    env = env or {}
    with locked_state(pipe_dir) as st:
        _prune(st)
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
            dev, value = (x.strip() for x in part.split("="))
            if dev not in mem or _mb(value) < _mb(mem[dev]):  # the server's limit caps the client's
                mem[dev] = value
        client = {"pid": pid, "active_thread_percentage": pct, "pinned_mem_limit": mem,
                  "visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
                  "process": process and _process_alive(pid), "terminated": False}
        server["clients"][str(pid)] = client
        return dict(client, server_pid=server["pid"])


def disconnect_client(pipe_dir: str | os.PathLike, pid: int) -> None:
    with locked_state(pipe_dir) as st:
        for server in st["servers"].values():
            server["clients"].pop(str(pid), None)
        _prune(st)  # a faulted server is ACTIVE again once its last client has gone


def fault(pipe_dir: str | os.PathLike, server_pid: int, sticky: bool = False) -> None:
    """A client's fatal fault: the server is FAULT until its clients have gone (with `sticky`, also
    after that -- never seen on the H100, where it turned ACTIVE again)."""
    with locked_state(pipe_dir) as st:
        st["servers"][str(server_pid)]["status"] = "FAULT"
        st["servers"][str(server_pid)]["sticky_fault"] = sticky


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


def _execute(command: str) -> tuple[str, Any]:
    """Run one control command against the state; returns (reply, action): action None, "quit", or
    ("wait_gone", server pid, client pid) -- the reply waits until that client (None: every client) has gone."""
    words = command.split()
    if not words:
        return 'Unknown command ""', None
    verb, args = words[0], words[1:]
    with locked_state(_pipe_dir()) as st:
        st["commands"].append(command)
        _prune(st)
        servers = st["servers"]

        def server(pid: str) -> dict[str, Any] | None:
            return servers.get(pid)

        def not_found(pid: str) -> str:
            return f"Server {pid} not found"

        if verb == "quit":
            return "", ("wait_gone", None, None) if any(s["clients"] for s in servers.values()) else "quit"
        if verb == "get_server_list":
            return "\n".join(sorted(servers, key=int)), None
        if verb == "get_server_status" and len(args) == 1:
            s = server(args[0])
            return (s["status"] if s else not_found(args[0])), None
        if verb == "get_client_list" and len(args) == 1:
            s = server(args[0])
            return ("\n".join(sorted(s["clients"], key=int)) if s else not_found(args[0])), None
        if verb == "get_default_active_thread_percentage" and not args:
            return f"{float(st['default_active_thread_percentage']):.1f}", None
        if verb == "set_default_active_thread_percentage" and len(args) == 1:
            pct = _pct(args[0])
            if pct is not None:  # an invalid value is ignored; the answer is the value in force
                st["default_active_thread_percentage"] = pct
            return f"{float(st['default_active_thread_percentage']):.1f}", None
        if verb == "get_active_thread_percentage" and len(args) == 1:
            s = server(args[0])
            return (f"{float(s['active_thread_percentage']):.1f}" if s else not_found(args[0])), None
        if verb == "set_active_thread_percentage" and len(args) == 2:
            s, pct = server(args[0]), _pct(args[1])
            if s is None:
                return not_found(args[0]), None
            if pct is not None:
                s["active_thread_percentage"] = pct  # for clients that connect from now on
            return f"{float(s['active_thread_percentage']):.1f}", None
        if verb == "set_default_device_pinned_mem_limit" and len(args) == 2:
            if _mem(args[1]):  # an invalid value is ignored without a word
                st["default_pinned_mem_limit"][args[0]] = args[1]
            return "", None
        if verb == "get_default_device_pinned_mem_limit" and len(args) == 1:
            value = st["default_pinned_mem_limit"].get(args[0])
            if value is None:
                return "", None
            mb = int(_mb(value))
            return (f"{mb // 1024}G" if mb >= 1024 else f"{mb}M"), None
        if verb == "set_device_pinned_mem_limit" and len(args) == 3:
            s = server(args[0])
            if s is None:
                return not_found(args[0]), None
            if _mem(args[2]):
                s["pinned_mem_limit"][args[1]] = args[2]
            return "", None
        if verb == "terminate_client" and len(args) == 2:
            s = server(args[0])
            if s is None:
                return f"{not_found(args[0])}\n{not_found(args[0])}!\n1", None
            client = s["clients"].get(args[1])
            if client is None:
                return ("201" if _process_alive(int(args[1])) else f"Invalid process {args[1]}!\n1"), None
            if client["terminated"]:  # asked already: the real daemon blocks until the client exits
                return "0", ("wait_gone", args[0], args[1])
            client["terminated"] = True  # its CUDA calls fail from now on; it stays listed until it exits
            st["terminated_clients"].append([int(args[0]), int(args[1])])
            return "0", None
        return f'Unknown command "{command}"', None


def _gone(action: tuple[str, str | None, str | None]) -> bool:
    _, spid, cpid = action
    with locked_state(_pipe_dir()) as st:
        _prune(st)
        if spid is None:
            return not any(s["clients"] for s in st["servers"].values())
        return cpid not in st["servers"].get(spid, {}).get("clients", {})


def _pct(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if 0 < v <= 100 else None


def _mem(text: str) -> bool:
    return len(text) > 1 and text.upper().rstrip("B")[-1:] in ("M", "G") and text.upper().rstrip("B")[:-1].isdigit()


def _mb(text: str) -> float:
    t = text.upper().rstrip("B")
    return float(t[:-1]) * (1024 if t.endswith("G") else 1) if _mem(text) else float("inf")


def _daemon_loop() -> None:
    pipe_dir = _pipe_dir()
    fifo = pipe_dir / CONTROL_FIFO
    born = time.monotonic()
    # O_RDWR keeps a writer open ourselves, so reads block instead of returning EOF between clients.
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    buf = b""
    pending: tuple[str, str, Any] | None = None  # (reply file, reply, action) held back until clients go

    def answer(reply_name: str, reply: str) -> None:
        tmp = pipe_dir / f".{reply_name}.tmp"
        tmp.write_text(reply)
        os.replace(tmp, pipe_dir / reply_name)

    _log("Startup")
    try:
        while time.monotonic() - born < MAX_LIFETIME_S and fifo.exists():
            if pending is not None:  # like the real daemon: no other command is served meanwhile
                reply_name, reply, action = pending
                if not _gone(action):
                    time.sleep(0.05)
                    continue
                pending = None
                answer(reply_name, reply)
                if action[1] is None:  # a quit that waited for the clients
                    _log("Shutdown")
                    return
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready and b"\n" not in buf:
                continue
            if ready:
                buf += os.read(fd, 65536)
            while b"\n" in buf and pending is None:
                line, buf = buf.split(b"\n", 1)
                reply_name, _, command = line.decode().partition("\t")
                reply, action = _execute(command.strip())
                _log(f"Command {command.strip()!r}")
                if isinstance(action, tuple):
                    _log("Waiting for clients to exit")
                    pending = (reply_name, reply, action)
                    continue
                answer(reply_name, reply)
                if action == "quit":
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
    if not pipe_dir.is_dir():
        print(f"Cannot access CUDA_MPS_PIPE_DIRECTORY={pipe_dir}")  # stdout, exit 1, like the real binary
        return 1
    if len(str(pipe_dir)) + len("/control_privileged") >= 108:  # its Unix sockets' sun_path: fails silently
        return 1
    if daemon_pid(pipe_dir) is not None:
        print("An instance of this daemon is already running")  # stdout, like the real binary
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
