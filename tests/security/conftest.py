"""A real agent whose socket group has an unprivileged member, made for the test and removed after it.

`UserClient` talks to the agent as that user: a child process started with the user's uid/gid (and
the socket group as its only group), so the agent sees the user's credentials through SO_PEERCRED.
"""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.agent.conftest import Daemon, _new_daemon, kill_tree, trainer_factory  # noqa: F401
from tests.conftest import IS_ROOT

needs_root_for_users = pytest.mark.skipif(
    not IS_ROOT or not shutil.which("useradd"),
    reason="needs root and useradd/groupadd to create an unprivileged user in the socket group")

# The test's virtualenv python lives under /root (not reachable by other users): processes that
# start as the user run the system's python with the standard library only.
USER_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"

# Runs as the user: one JSON request per stdin line -> one JSON answer per stdout line, over the socket.
REMOTE_CLIENT = r"""
import http.client, json, socket, sys, urllib.parse
class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("reamer", timeout=60)
        self.path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)
for line in sys.stdin:
    req = json.loads(line)
    try:
        conn = UnixConnection(sys.argv[1])
        path = req["path"]
        if req.get("params"):
            path += "?" + urllib.parse.urlencode(req["params"])
        body = req.get("content")
        if body is None and req.get("json") is not None:
            body = json.dumps(req["json"])
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(req["method"], path, body=body.encode() if body is not None else None, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw.decode(errors="replace")
        conn.close()
        print(json.dumps({"status": r.status, "body": answer}), flush=True)
    except Exception as exc:
        print(json.dumps({"status": -1, "error": repr(exc)}), flush=True)
"""

SLEEPER = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"

# Starts as root, forks a child that stays root, then becomes the user: a user-owned process with a
# root-owned descendant.
MIXED_TREE = r"""
import os, sys, time
uid, gid = int(sys.argv[1]), int(sys.argv[2])
child = os.fork()
if child == 0:
    while True: time.sleep(0.05)
os.setgroups([]); os.setgid(gid); os.setuid(uid)
print(child, flush=True)
while True: time.sleep(0.05)
"""


class TestUser:
    """An unprivileged user whose only group is the agent's socket group."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.group = f"rmrsec{tag}"
        self.name = f"rmrsec{tag}"
        subprocess.run(["groupadd", self.group], check=True)
        try:
            subprocess.run(["useradd", "-M", "-N", "-g", self.group, "-s", "/usr/sbin/nologin", self.name],
                           check=True)
        except BaseException:
            subprocess.run(["groupdel", self.group], check=False)
            raise
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.procs: list[subprocess.Popen] = []

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        proc = subprocess.Popen(args, user=self.uid, group=self.gid, extra_groups=[self.gid], cwd="/", **kwargs)
        self.procs.append(proc)
        return proc

    def sleeper(self) -> subprocess.Popen:
        """A process the user owns."""
        proc = self.popen([USER_PYTHON, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    def mixed_tree(self) -> tuple[subprocess.Popen, int]:
        """A process the user owns with a root-owned child: (process, child pid)."""
        proc = subprocess.Popen([sys.executable, "-c", MIXED_TREE, str(self.uid), str(self.gid)],
                                stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc, int(proc.stdout.readline())

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        subprocess.run(["userdel", self.name], check=False, capture_output=True)
        subprocess.run(["groupdel", self.group], check=False, capture_output=True)


class GroupMember(TestUser):
    """Another unprivileged user, also a member of the socket group (and of `extra` groups, if given)."""

    def __init__(self, socket_group: str, socket_gid: int, extra: tuple[str, ...] = ()) -> None:
        super().__init__()
        subprocess.run(["usermod", "-aG", ",".join((socket_group, *extra)), self.name], check=True)
        self.socket_gid = socket_gid

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        proc = subprocess.Popen(args, user=self.uid, group=self.gid, extra_groups=[self.gid, self.socket_gid],
                                cwd="/", **kwargs)
        self.procs.append(proc)
        return proc


class UserClient:
    """HTTP calls to the agent, made by a process running as `user`."""

    def __init__(self, user: TestUser, socket: str) -> None:
        self.proc = user.popen([USER_PYTHON, "-c", REMOTE_CLIENT, socket], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={"PATH": os.environ.get("PATH", "")})

    def call(self, method: str, path: str, json_body: Any = None, params: dict | None = None,
             content: str | None = None) -> tuple[int, Any]:
        self.proc.stdin.write(json.dumps({"method": method, "path": path, "json": json_body, "params": params,
                                          "content": content}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert answer["status"] != -1, answer.get("error")
        return answer["status"], answer["body"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def user() -> Iterator[TestUser]:
    made = TestUser()
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture(scope="module")
def secure_daemon(user: TestUser) -> Iterator[Daemon]:
    """An agent whose socket group is the user's group (the user can reach the socket)."""
    daemon = _new_daemon(socket_group=user.group, security={"max_rt_priority": 30, "max_long_polls": 64})
    os.chmod(daemon.base, 0o711)  # the socket's directory: traversable, not listable
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


@pytest.fixture
def as_user(user: TestUser, secure_daemon: Daemon) -> Iterator[UserClient]:
    secure_daemon.reset()
    client = UserClient(user, secure_daemon.socket)
    try:
        yield client
    finally:
        client.close()
        for job in secure_daemon.client.list_training_jobs():
            try:
                secure_daemon.client.detach_training(job.name)
            except Exception:  # noqa: BLE001 - it may have ended meanwhile
                pass


def cgroup_exists(daemon: Daemon, job: str) -> bool:
    return any((Path("/sys/fs/cgroup") / c / daemon.cgroup_name / f"train-{job}").exists()
               for c in ("cpuset", "cpu"))
