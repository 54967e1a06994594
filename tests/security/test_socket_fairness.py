"""The control socket is fair: a member of the socket group cannot take it from root, an admin or another user.

A real agent (short clocks, small caps), real unprivileged users in its socket group and raw sockets opened by
processes running as them: connection floods (per uid and overall), idle connections, slowloris headers and
bodies, and megabytes of headers. Root (over the CLI and the API) and a member of security.admin_group always
get in; a long-poll being answered is never cut by the clocks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any, Iterator

import psutil
import pytest

from tests.agent.conftest import REPO, Daemon, _new_daemon
from tests.conftest import wait_for
from tests.security.conftest import USER_PYTHON, GroupMember, UserClient, needs_root_for_users
from tests.security.conftest import TestUser as UnprivilegedUser  # (not collected as a test class)

pytestmark = [needs_root_for_users, pytest.mark.root]

MAX_CONNECTIONS = 8
PER_UID = 6
HEADER_TIMEOUT_S = 1.5
IDLE_TIMEOUT_S = 2.0
MAX_HEADER_KB = 16
# above the 8 long-polls a test holds plus the 8 the previous test just dropped (gone within a 0.2 s step)
MAX_LONG_POLLS = 16

# Runs as a user (standard library only): commands on stdin, one JSON answer per command on stdout.
#   open N poll|none|node  N connections: sending a long-poll (in progress for 60 s, so no clock closes it while
#                          a test runs), nothing, or GET /v1/node (answer read, then idle);
#                          answers what the agent said at once on each (status counts) and how many stay open
#   wait_closed T          waits up to T s for the agent to close every connection still held
#   dribble head|body      a request sent a few bytes at a time until the agent closes it: what it answered
#   big MB                 a request line and MB MiB of one header: what the agent answered, bytes it took
#   close                  closes every connection held
HOSTILE = r"""
import json, select, socket, sys, time
path = sys.argv[1]
held = []

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(path)
    return s

def status(data):
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0

def read_answer(s):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body

def body_of(answer):
    try:
        return json.loads(answer.split(b"\r\n\r\n", 1)[1])
    except (IndexError, ValueError):
        return None

def settle(socks, quiet):
    # what the agent says on each socket until nothing new comes for `quiet` s: {socket: bytes}; b"" = closed
    said = {}
    pending = list(socks)
    while pending:
        readable, _, _ = select.select(pending, [], [], quiet)
        if not readable:
            break
        for s in readable:
            try:
                chunk = s.recv(65536)
            except OSError:
                chunk = b""
            said[s] = said.get(s, b"") + chunk
            if not chunk or b"\r\n\r\n" in said[s]:
                pending.remove(s)
    return said

for line in sys.stdin:
    cmd, *args = line.split()
    out = {}
    if cmd == "open":
        n, what = int(args[0]), args[1]
        new, statuses, sample = [], {}, None
        for _ in range(n):
            s = connect()
            try:
                if what == "poll":
                    s.sendall(b"GET /v1/events?since=1000000000000&wait=60 HTTP/1.1\r\nhost: reamer\r\n\r\n")
                elif what == "node":
                    s.sendall(b"GET /v1/node HTTP/1.1\r\nhost: reamer\r\n\r\n")
                    answer = read_answer(s)
                    statuses[status(answer)] = statuses.get(status(answer), 0) + 1
                    if status(answer) != 200:
                        sample = body_of(answer)
                        s.close()
                        continue
            except OSError:
                pass
            new.append(s)
        # a refusal is written at accept(): wait for it on long-polls (nothing else answers them for 60 s); a
        # connection that sent nothing is left for wait_closed (the header clock may answer it any time)
        said = settle(new, 2.0) if what == "poll" else {}
        for s in new:
            if s in said:
                code = status(said[s])
                statuses[code] = statuses.get(code, 0) + 1
                if sample is None:
                    sample = body_of(said[s])
                s.close()
            else:
                held.append(s)
        out = {"open": len(held), "statuses": statuses, "sample": sample}
    elif cmd == "wait_closed":
        deadline = time.monotonic() + float(args[0])
        closed, answers = 0, {}
        while held and time.monotonic() < deadline:
            readable, _, _ = select.select(held, [], [], 0.2)
            for s in readable:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if data:
                    answers[status(data)] = answers.get(status(data), 0) + 1
                    continue  # the EOF comes next
                held.remove(s)
                s.close()
                closed += 1
        out = {"closed": closed, "open": len(held), "answers": answers}
    elif cmd == "dribble":
        s = connect()
        if args[0] == "head":
            parts = [b"GET /v1/node HTTP/1.1\r\n"] + [b"x-slow-%d: a\r\n" % i for i in range(100000)]
        else:
            parts = [b"POST /v1/demote-all HTTP/1.1\r\nhost: reamer\r\ncontent-length: 100000\r\n\r\n"] + [b"{"] * 100000
        started, sent, answer = time.monotonic(), 0, b""
        for part in parts:
            try:
                s.sendall(part)
            except OSError:
                break
            sent += 1
            readable, _, _ = select.select([s], [], [], 0.1)
            if readable:
                break
        try:
            answer = read_answer(s)
        except OSError:
            pass
        out = {"status": status(answer), "body": body_of(answer), "parts_sent": sent,
               "seconds": time.monotonic() - started}
        s.close()
    elif cmd == "big":
        limit = int(args[0]) << 20
        s = connect()
        s.sendall(b"GET /v1/node HTTP/1.1\r\nhost: reamer\r\nx-big: ")
        chunk, sent = b"a" * (1 << 16), 0
        try:
            while sent < limit:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        answer = b""
        try:
            answer = read_answer(s)
        except OSError:
            pass
        out = {"status": status(answer), "body": body_of(answer), "sent": sent}
        s.close()
    elif cmd == "close":
        for s in held:
            s.close()
        out = {"closed": len(held)}
        held.clear()
    print(json.dumps(out), flush=True)
"""


class Hostile:
    """HOSTILE running as a user against the agent's socket."""

    def __init__(self, user: UnprivilegedUser, socket: str) -> None:
        self.proc = user.popen([USER_PYTHON, "-c", HOSTILE, socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={"PATH": os.environ.get("PATH", "")})

    def __call__(self, *command: Any) -> dict[str, Any]:
        self.proc.stdin.write(" ".join(str(c) for c in command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the hostile client died (exit {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def admin_group() -> Iterator[str]:
    name = f"rmradm{os.urandom(3).hex()}"
    subprocess.run(["groupadd", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["groupdel", name], check=False, capture_output=True)


@pytest.fixture(scope="module")
def other(user: UnprivilegedUser) -> Iterator[GroupMember]:
    made = GroupMember(user.group, user.gid)
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture(scope="module")
def admin(user: UnprivilegedUser, admin_group: str) -> Iterator[GroupMember]:
    made = GroupMember(user.group, user.gid, extra=(admin_group,))
    try:
        yield made
    finally:
        made.cleanup()


@pytest.fixture(scope="module")
def fair_daemon(user: UnprivilegedUser, admin_group: str) -> Iterator[Daemon]:
    daemon = _new_daemon(socket_group=user.group, security={
        "max_connections": MAX_CONNECTIONS, "max_connections_per_uid": PER_UID, "admin_reserved_connections": 8,
        "admin_group": admin_group, "header_timeout_s": HEADER_TIMEOUT_S, "idle_timeout_s": IDLE_TIMEOUT_S,
        "max_header_kb": MAX_HEADER_KB, "max_long_polls": MAX_LONG_POLLS})
    os.chmod(daemon.base, 0o711)  # the socket's directory: traversable, not listable
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def unix_sockets(daemon: Daemon) -> int:
    """Unix sockets the agent has open (its listening socket and every connection)."""
    return len(psutil.Process(daemon.proc.pid).net_connections(kind="unix"))


@pytest.fixture
def hostile(user: UnprivilegedUser, fair_daemon: Daemon) -> Iterator[Hostile]:
    yield from _hostile(user, fair_daemon)


@pytest.fixture
def hostile_other(other: GroupMember, fair_daemon: Daemon) -> Iterator[Hostile]:
    yield from _hostile(other, fair_daemon)


def _hostile(user: UnprivilegedUser, daemon: Daemon) -> Iterator[Hostile]:
    client = Hostile(user, daemon.socket)
    try:
        yield client
    finally:
        before = unix_sockets(daemon)
        closed = client("close")["closed"]
        client.close()
        # the next test counts connections from zero: wait until the agent has seen these ones go
        wait_for(lambda: unix_sockets(daemon) <= before - closed + 1, timeout=60,
                 what="the agent to close the test's connections")


def root_cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reamer.cli.main", "--socket", daemon.socket, "-o", "json", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def refusal(sample: dict, code: str, key: str) -> None:
    error = sample["error"]
    assert error["code"] == code and key in error["message"] and error["fix"], sample


def test_a_flood_of_connections_from_users_never_locks_out_root_or_an_admin(fair_daemon, hostile, hostile_other,
                                                                            admin):
    flood = hostile("open", 300, "poll")  # 300 connections, each holding a long-poll
    assert flood["open"] == PER_UID and flood["statuses"] == {"429": 300 - PER_UID}, flood
    refusal(flood["sample"], "too_many_connections", "security.max_connections_per_uid")
    more = hostile_other("open", 300, "poll")  # the second user fills what the overall cap leaves
    assert more["open"] == MAX_CONNECTIONS - PER_UID and more["statuses"] == {"503": 300 - more["open"]}, more
    refusal(more["sample"], "over_capacity", "security.max_connections")

    # every connection other callers may hold is held: root still answers, over the CLI and the API
    demoted = root_cli(fair_daemon, "demote-all")
    assert demoted.returncode == 0, demoted.stderr
    assert fair_daemon.client.node().agent_pid == fair_daemon.proc.pid
    # so does a member of security.admin_group, over the same socket
    as_admin = UserClient(admin, fair_daemon.socket)
    try:
        status, node = as_admin.call("GET", "/v1/node")
        assert status == 200 and node["agent_pid"] == fair_daemon.proc.pid
    finally:
        as_admin.close()


def test_the_per_uid_cap_refuses_the_users_next_connection_while_another_user_and_root_get_in(
        fair_daemon, hostile, user, other):
    held = hostile("open", PER_UID, "poll")
    assert held["open"] == PER_UID and held["statuses"] == {}, held
    one_more = hostile("open", 1, "node")
    assert one_more["statuses"] == {"429": 1}, one_more
    refusal(one_more["sample"], "too_many_connections", f"uid {user.uid} already has {PER_UID} connections")
    as_other = UserClient(other, fair_daemon.socket)
    try:
        status, _ = as_other.call("GET", "/v1/node")
        assert status == 200
    finally:
        as_other.close()
    assert fair_daemon.client.node().agent_pid == fair_daemon.proc.pid
    hostile("close")
    assert hostile("open", 1, "node")["statuses"] == {"200": 1}  # its connections closed: it gets in again


def test_idle_connections_are_closed_but_a_long_poll_being_answered_is_not(fair_daemon, hostile):
    fresh = hostile("open", 3, "none")  # connected, nothing sent
    assert fresh["open"] == 3
    served = hostile("open", 3, "node")  # one answer each, then nothing
    assert served["statuses"] == {"200": 3} and served["open"] == 6, served
    closed = hostile("wait_closed", 60)
    assert closed["closed"] == 6 and closed["open"] == 0, closed  # the agent closed every one of them
    assert closed["answers"] == {"408": 3}, closed  # the fresh ones hear why: no request came in time

    # a long-poll longer than both clocks is answered in full (it is in progress, not idle)
    poll = subprocess.run([sys.executable, "-c", LONG_POLL_CLIENT, fair_daemon.socket, "5"], capture_output=True,
                          text=True, timeout=120)
    assert poll.returncode == 0, poll.stderr
    status, body = json.loads(poll.stdout)
    assert status == 200 and body["events"] == [], (status, body)


LONG_POLL_CLIENT = r"""
import http.client, json, socket, sys
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(120)
        self.sock.connect(sys.argv[1])
conn = Unix("reamer")
conn.request("GET", "/v1/events?since=1000000000000&wait=" + sys.argv[2])
r = conn.getresponse()
print(json.dumps([r.status, json.loads(r.read())]))
"""


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_slowloris_is_cut_off_after_the_header_timeout(fair_daemon, hostile, part):
    slow = hostile("dribble", part)
    assert slow["status"] == 408, slow
    refusal(slow["body"], "request_timeout", "security.header_timeout_s")
    # it sent a part every 0.1 s for the whole header timeout at least: the dribbling, not a parse error, ended it
    assert slow["parts_sent"] > 1, slow
    assert fair_daemon.client.node().agent_pid == fair_daemon.proc.pid


def test_megabytes_of_headers_are_refused_without_being_held(fair_daemon, hostile):
    agent = psutil.Process(fair_daemon.proc.pid)
    before = agent.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], agent.memory_info().rss)
            except psutil.Error:
                return
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        big = hostile("big", 64)  # up to 64 MiB of one header
    finally:
        done.set()
        sampler.join(timeout=10)
    assert big["status"] == 431, big
    refusal(big["body"], "headers_too_large", "security.max_header_kb")
    assert big["sent"] >= 1 << 20, big  # it did send more than a MiB before the agent closed on it
    assert peak[0] - before < 16 << 20, (before, peak[0])  # far less than what was sent
    assert fair_daemon.client.node().agent_pid == fair_daemon.proc.pid


def test_an_abandoned_long_poll_gives_its_place_back_at_once(fair_daemon, hostile):
    """A user opening long-polls and dropping them (more than max_long_polls in all) cannot keep root's long-poll
    out: a long-poll whose client is gone ends when the agent sees it, not when its 60 s wait runs out."""
    for _ in range(MAX_LONG_POLLS // PER_UID + 2):
        hostile("open", PER_UID, "poll")
        hostile("close")

    def root_long_poll_served() -> bool:
        from reamer.api.client import ApiError

        try:
            fair_daemon.client.request("GET", "/v1/events", params={"since": 10**12, "wait": 0.5})
        except ApiError as exc:
            assert exc.code == "too_many_long_polls", exc
            return False
        return True

    wait_for(root_long_poll_served, timeout=30, what="root's long-poll to be served (the dropped ones hold 60 s)")
